"""Rich tables for `prl plan`: the placement, the derived totals, the warnings."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

from rich.console import Console
from rich.table import Table

from rich.markup import escape

from prl.planner.model import Plan
from prl.states import Role


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
    table = Table(title=escape(f"{plan.name} on {plan.cluster}"), title_justify="left")
    for col in (kind, "role", "nodes", "GPUs/node", "tasks/node", "parallel", "ports", "waits for"):
        table.add_column(col, justify="right" if col in ("nodes", "GPUs/node", "tasks/node") else "left",
                         no_wrap=col != "waits for")
    roles = {r.name: r for r in plan.inference}
    for launch in plan.launches:
        group = plan.groups[launch.group]
        where = str(group.index) if plan.hetjob and plan.slurm else f"{group.node_offset}-{group.node_offset + group.nodes - 1}"
        parallel, ports = "", "-"
        if launch.name in roles:
            r = roles[launch.name]
            parallel = f"{r.replicas} x (tp{r.tp} dp{r.dp}{' ep' if r.expert_parallel else ''})"
            ports = _ports([s.port for s in plan.role_servers(launch.name) if s.head and s.port is not None])
            side = plan.role_side_channel_ports(launch.name)
            if side:
                ports += f" (nixl {_ports(side)})"
        elif launch.name == Role.TRAINER:
            m = plan.trainer.mesh
            parallel = f"rep{m.dp_replicate} shard{m.dp_shard} cp{m.cp} ep{m.ep}"
            ports = f"{plan.trainer.master_port} (rdzv)"
            if plan.trainer.weight_ports:
                ports += f" (weights {_ports(list(plan.trainer.weight_ports))})"
        elif launch.name == Role.ROUTER:
            ports = str(plan.router_port)
        elif launch.name == Role.ORCHESTRATOR:
            parallel = "shares node" if launch.overlap else ""
        # A role that waits itself starts with the first roles; the others start once what they wait for is ready.
        waits = ", ".join(launch.start_after) + (" (starts alongside)" if launch.waits_itself and launch.start_after else "")
        table.add_row(where, launch.name, str(launch.nodes), str(launch.gpus_per_node), str(launch.ntasks_per_node),
                      parallel, ports, waits or "-")
    return table


def _gb(n: int) -> str:
    return f"{n / 1e9:.3g} GB" if n >= 1e8 else f"{n / 1e6:.3g} MB"


def weights_line(plan: Plan, shares: Sequence, why_not: str) -> str:
    """`weights: memory (...); per update each inference worker receives 1.2 GB of 2.4 GB (tp2, its slices)`."""
    from prl.weights import get

    settings = plan.settings().weights
    transport = get(settings.transport)
    over = f" over {plan.trainer.weight_backend}" if transport.groups and plan.trainer is not None else ""
    line = f"weights: {transport.name}{over} ({transport.summary})"
    parts = []
    for s in shares:
        place = f"tp{s.tp}" + (f" dp{s.dp}" if s.dp > 1 else "") + (" ep" if s.expert_parallel else "")
        got = _gb(s.most) if s.most == s.least else f"{_gb(s.least)}-{_gb(s.most)}"
        kind = "the whole step" if s.least == s.whole else "its slices"
        parts.append(f"each {s.role} worker receives {got} of {_gb(s.whole)} ({place}: {kind})")
    if parts:
        return f"{line}; per update {', '.join(parts)}"
    return f"{line}; bytes per worker unknown: {why_not}" if why_not else line


def show_plan(plan: Plan, written: list[Path], console: Console | None = None,
              shares: Sequence = (), why_not: str = "") -> None:
    # Piped output (logs, CI) gets a wide table rather than an 80-column wrap.
    console = console or Console(width=None if sys.stdout.isatty() else 160)
    console.print(placement_table(plan))
    t, tr = plan.totals, plan.settings().training

    def say(text: str) -> None:
        # User text (names, paths) may hold '[...]': never read it as rich markup.
        console.print(text, markup=False, highlight=False)

    if plan.trainer is None:
        say(f"totals: {t.nodes} nodes, {t.gpus} GPUs ({t.inference_gpus} inference in {t.inference_servers} servers)")
    else:
        mesh = plan.trainer.mesh
        say(f"totals: {t.nodes} nodes, {t.gpus} GPUs ({t.inference_gpus} inference in {t.inference_servers} "
            f"servers, trainer world {t.trainer_world_size} on {plan.trainer.device}: {mesh.describe()}, "
            f"expert shard {mesh.expert_shard})")
    if plan.attach:
        say(f"inference: the pool {plan.attach} (this run's adapter is served there as {plan.served_model_name!r})")
    sft = plan.settings().sft
    if plan.pool is not None:
        say(f"inference pool: {plan.pool.model} for the runs that attach (inference.attach: {plan.run_dir}), "
            f"adapters of rank <= {plan.pool.max_lora_rank}, {plan.pool.max_loras} per batch; serves until stopped")
    elif sft is not None:
        epochs = f" (or {sft.epochs} epochs, whichever comes first)" if sft.epochs else ""
        say(f"sft: {tr.batch_size} conversations per step from {sft.data}, {tr.max_steps} steps{epochs}, "
            f"checkpoint every {tr.checkpoint_interval or 'never'}")
    else:
        say(f"training: batch {tr.batch_size} = {tr.batch_size // tr.rollouts_per_example} prompts x "
            f"{tr.rollouts_per_example} rollouts, max_off_policy_steps {tr.max_off_policy_steps}, "
            f"{tr.max_steps} steps, checkpoint every {tr.checkpoint_interval or 'never'}")
    if plan.trainer is not None and plan.inference and not plan.attach:
        say(weights_line(plan, shares, why_not))
    for warning in plan.warnings:
        console.print(f"[yellow]warning:[/yellow] {escape(warning)}", highlight=False)
    if written:
        say(f"wrote {len(written)} files to {plan.run_dir} (nothing submitted)")
        if plan.slurm:
            say(f"  job script: {plan.run_dir}/scripts/job.sbatch")
    else:
        say("checked; nothing written (--no-write)")
