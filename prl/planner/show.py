"""Rich tables for `prl plan`: the placement, the derived totals, the warnings."""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from prl.planner.plan import Plan


def _ports(ports: list[int]) -> str:
    ports = sorted(set(ports))
    if not ports:
        return "-"
    if len(ports) == 1:
        return str(ports[0])
    if ports == list(range(ports[0], ports[-1] + 1)):
        return f"{ports[0]}-{ports[-1]}"
    return ",".join(map(str, ports))


def placement_table(plan: Plan) -> Table:
    kind = "het group" if plan.hetjob and plan.slurm else "nodes"
    table = Table(title=f"{plan.name} on {plan.cluster}", title_justify="left")
    for col in (kind, "role", "nodes", "GPUs/node", "tasks/node", "parallel", "ports", "starts after"):
        table.add_column(col, justify="right" if col in ("nodes", "GPUs/node", "tasks/node") else "left",
                         no_wrap=col != "starts after")
    servers = defaultdict(list)
    for s in plan.servers:
        servers[s.role].append(s)
    for step in plan.steps:
        group = plan.groups[step.group]
        where = str(group.index) if plan.hetjob and plan.slurm else f"{group.node_offset}-{group.node_offset + group.nodes - 1}"
        parallel, ports = "", "-"
        if step.name in servers:
            role_servers = servers[step.name]
            heads = [s for s in role_servers if s.head]
            args = role_servers[0].args
            tp = args[args.index("--tensor-parallel-size") + 1]
            dp = args[args.index("--data-parallel-size") + 1] if "--data-parallel-size" in args else "1"
            ep = " ep" if "--enable-expert-parallel" in args else ""
            parallel = f"{len(heads)} x (tp{tp} dp{dp}{ep})"
            ports = _ports([s.port for s in heads if s.port is not None])
        elif step.name == "trainer":
            m = plan.trainer.mesh
            parallel = f"rep{m.dp_replicate} shard{m.dp_shard} cp{m.cp} ep{m.ep}"
            ports = f"{plan.trainer.master_port} (rdzv)"
        elif step.name == "router":
            ports = str(plan.router_port)
        elif step.name == "orchestrator":
            parallel = "shares node" if step.overlap else ""
        table.add_row(where, step.name, str(step.nodes), str(step.gpus_per_node), str(step.ntasks_per_node),
                      parallel, ports, ", ".join(step.start_after) or "-")
    return table


def show_plan(plan: Plan, written: list[Path], console: Console | None = None) -> None:
    # Piped output (logs, CI) gets a wide table rather than an 80-column wrap.
    console = console or Console(width=None if sys.stdout.isatty() else 160)
    console.print(placement_table(plan))
    t = plan.totals
    mesh = plan.trainer.mesh
    console.print(
        f"totals: {t['nodes']} nodes, {t['gpus']} GPUs ({t['inference_gpus']} inference in "
        f"{t['inference_servers']} servers, trainer world {t['trainer_world_size']} on {plan.trainer.device}: "
        f"{mesh.describe()}, expert shard {mesh.expert_shard})"
    )
    tr = plan.training
    console.print(
        f"training: batch {tr['batch_size']} = {tr['batch_size'] // tr['rollouts_per_example']} prompts x "
        f"{tr['rollouts_per_example']} rollouts, max_off_policy_steps {tr['max_off_policy_steps']}, "
        f"{tr['max_steps']} steps, checkpoint every {tr['checkpoint_interval'] or 'never'}"
    )
    for warning in plan.warnings:
        console.print(f"[yellow]warning:[/yellow] {warning}")
    if written:
        console.print(f"wrote {len(written)} files to {plan.run_dir} (nothing submitted)")
        if plan.slurm:
            console.print(f"  job script: {plan.run_dir}/scripts/job.sbatch")
    else:
        console.print("checked; nothing written (--no-write)")
