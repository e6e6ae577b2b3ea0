"""The `prl` command. Control-plane commands stay light: no torch, vLLM, transformers or
verifiers is imported here or by what they import (tests/test_imports.py checks it).

argparse, not typer: typer builds every parameter through pydantic on each call, ~100 ms a
login-node user feels on every `prl status`. Each command imports what it needs when it runs.

Errors: the project's own (PrlError) become one line on stderr and exit 2 (bad input)
or 1 (failure); a bad flag is one line and exit 2 too; anything else is a bug and keeps
its traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Callable, NoReturn, Optional

from prl.errors import ConfigError, run_entry

OVERRIDES_HELP = "key.path=value overrides, e.g. trainer.nodes=8 (cluster.KEY=... overrides the profile)"
RUN_HELP = "Run directory or job id (default: the most recent run)."


class Exit(Exception):
    """End a command with this exit code (after it printed what it had to say)."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, as for every other bad input; the usage is one --help away.
        raise ConfigError(f"{self.prog}: {message} (see {self.prog} --help)")


# ----------------------------------------------------------------------------- commands


def plan(a: argparse.Namespace) -> None:
    """Validate a topology, show the placement and write the rendered job to its run directory (dry run)."""
    import msgspec

    from prl.planner.prepare import prepare, write_run_files

    prepared = prepare(a.topology, a.overrides)
    written = [] if a.no_write else write_run_files(prepared, force=a.force)
    if a.as_json:
        out = json.loads(prepared.plan.to_json())
        out["settings"] = msgspec.to_builtins(prepared.plan.settings())
        out["written"] = [str(p) for p in written]
        sys.stdout.write(json.dumps(out, indent=2, sort_keys=True) + "\n")
        return
    from prl.planner.show import show_plan

    show_plan(prepared.plan, written, shares=prepared.shares, why_not=prepared.why_not)


def submit(a: argparse.Namespace) -> None:
    """Plan, render and submit one heterogeneous job (or local processes); record its handle."""
    from prl.ops.submit import submit as do_submit
    from prl.states import Backend

    run, job, launcher = do_submit(a.topology, a.overrides, local=a.local, detach=a.detach, resume=a.resume,
                                   force=a.force, preflight=a.preflight, hold=a.hold)
    where = f"job {job.job_id}" if job.backend == Backend.SLURM else f"local run (launcher pid {job.pid})"
    parts = ", ".join(f"{k}: {v}" for k, v in job.components.items())
    print(f"submitted {where}: {job.name} ({parts}){' [preflight]' if a.preflight else ''}")
    print(f"run dir {run.root}")
    if launcher is None:
        print(f"  prl status {run.root}\n  prl logs {run.root} -f\n  prl cancel {run.root}")
        return
    from prl.ops.progress import follow_local
    from prl.planner.model import Plan

    print(f"following it here (Ctrl-C stops it); the roles' logs: prl logs {run.root} --role ROLE", flush=True)
    exit_code = follow_local(run, launcher, Plan.read(run).settings().training.max_steps)
    print(f"local run ended with exit code {exit_code}")
    if exit_code:
        print(f"  prl status {run.root}    (which role failed, and its log)")
        raise Exit(1)
    print(f"  prl plot {run.root}      (reward, lag, step time: a PNG)\n  prl status {run.root}")


def status(a: argparse.Namespace) -> None:
    """Per-role state of a run: Slurm, heartbeats, progress, the first failure and its log."""
    import time

    from prl.ops.status import collect, resolve_run, show
    from prl.states import FAILED_STATES, TERMINAL_STATES

    run_dir = resolve_run(a.run)
    while True:
        current = collect(run_dir)
        if a.as_json:
            print(current.to_json())
        else:
            show(current)
        if not a.watch or current.state in TERMINAL_STATES:
            break
        time.sleep(a.interval)
        if not a.as_json:
            print()
    if current.state in FAILED_STATES and not a.as_json:
        raise Exit(1)


def logs(a: argparse.Namespace) -> None:
    """Show a role's log from the run directory."""
    from prl.ops.logs import default_role, follow, log_path
    from prl.ops.status import log_tail, resolve_run
    from prl.planner.model import Plan

    run_dir = resolve_run(a.run)
    role = a.role or default_role(run_dir, Plan.read(run_dir))
    if a.follow:
        follow(run_dir, role, a.rank, a.lines)
        return
    for line in log_tail(log_path(run_dir, role, a.rank, a.attempt), a.lines):
        print(line)


def cancel(a: argparse.Namespace) -> None:
    """Cancel the whole job (every het component) and record it."""
    from prl.ops.status import resolve_run
    from prl.ops.submit import cancel as do_cancel

    job, cancelled = do_cancel(resolve_run(a.run))
    if cancelled:
        print(f"cancelled job {job.job_id} ({job.name})")
    else:
        print(f"job {job.job_id} ({job.name}) has already ended; nothing to cancel")


def plot(a: argparse.Namespace) -> None:
    """Draw a run's progress (reward, eval, policy lag, tokens/s, step and weight-sync time) as a PNG."""
    from prl.ops.plot import plot as draw
    from prl.ops.status import resolve_run

    path = draw(resolve_run(a.run), [resolve_run(r) for r in a.compare or []], a.output)
    print(f"wrote {path}")


def rollouts(a: argparse.Namespace) -> None:
    """Read a run's sampled rollouts: each conversation, its rewards and fate (terminal, or --html PAGE)."""
    from prl.ops import rollouts as sampled
    from prl.run.files import atomic_write_text

    run = sampled.source(a.run)
    steps = sampled.choose_steps(run, a.steps)
    shown = sampled.select(run, steps, sort=a.sort, fate=a.fate, failed=a.failed, truncated=a.truncated, env=a.env,
                           limit=None if a.html else a.limit)
    if a.html:
        out = Path(a.html).expanduser().resolve()
        try:
            atomic_write_text(out, sampled.page(run, steps, shown))
        except OSError as e:
            raise ConfigError(f"--html {out}: {e.strerror or e}") from None
        print(f"wrote {out}: {len(shown)} rollout(s) of {len(steps)} step(s)")
        return
    sampled.show(shown)


def wandb(a: argparse.Namespace) -> None:
    """Log a run's metrics (trainer, orchestrator, eval, weight sync; joined by step) to one W&B run."""
    from prl.ops.status import resolve_run
    from prl.ops.wandb_sync import sync

    run = resolve_run(a.run)
    if a.attempt is not None:  # the launcher's own follower: until its attempt ends
        from prl.ops.wandb_sync import attempt_ended

        logged = sync(run, a.project, a.entity, follow=True, ended=lambda r: attempt_ended(r, a.attempt))
    else:
        logged = sync(run, a.project, a.entity, follow=a.follow)
    print(f"logged {logged} step(s) of {run.root} to W&B project {a.project}")


def doctor(a: argparse.Namespace) -> None:
    """What this machine has for each command (and for a topology); or, with a run and --role, that role's
    preflight checks on this node (what every role does first)."""
    target = Path(a.target) if a.target else None
    if target is not None and target.is_dir():
        return _preflight(a, target)
    if a.role is not None:
        raise ConfigError("--role goes with a run directory (`prl doctor RUN --role trainer`); "
                          f"{a.target or 'no target'} is not one")
    from prl.ops.doctor import check, failed, format_findings
    from prl.planner.prepare import prepare

    prepared = prepare(target, a.overrides) if target is not None else None
    found = check(prepared, str(target or ""))
    print(f"prl doctor: this machine{f' for {target}' if target else ''}")
    print(format_findings(found))
    bad = failed(found, prepared, str(target or ""))
    if bad:
        print(f"{len(bad)} problem(s): see the fix lines above")
        raise Exit(1)


def _preflight(a: argparse.Namespace, run_path: Path) -> None:
    from prl.job import preflight as checks
    from prl.planner.model import Plan
    from prl.run.rundir import RunDir

    run_dir = RunDir(run_path)
    plan = Plan.read(run_dir)
    if a.role not in plan.role_names:
        said = f"--role {a.role!r}:" if a.role else f"a run directory needs --role:"
        raise ConfigError(f"{said} this run's roles are {', '.join(plan.role_names)}")
    results = checks.preflight(run_dir, plan, a.role, a.task, strict=a.strict)
    print(checks.format_checks(results))
    if checks.failed(results):
        raise Exit(1)


def trainer(a: argparse.Namespace) -> None:
    """Run one trainer rank (start it under torchrun; the job's launch scripts do)."""
    from prl.trainer import main as train

    code = train(a.run_dir, a.resume)
    if code:
        raise Exit(code)


def export(a: argparse.Namespace) -> None:
    """Write a run's published weights step as a model of its own (--merged: a LoRA adapter merged in)."""
    from prl.ops.status import resolve_run
    from prl.trainer.lora import export as do_export

    out = do_export(resolve_run(a.run), a.step, Path(a.output).expanduser().resolve(), a.merged)
    print(f"wrote {out}")


def export_data(a: argparse.Namespace) -> None:
    """Write the rollouts that scored well (a run's samples, an eval's records) as chat JSONL for an sft: run."""
    from prl.ops import export_data as data
    from prl.ops import rollouts as sampled
    from prl.run.files import atomic_write_text

    source = sampled.source(a.source)
    steps = sampled.choose_steps(source, a.steps)
    pairs = [(s.step, s.record) for s in sampled.select(source, steps)]
    kept, skipped = data.choose(pairs, a.min_reward, a.best_per_task)
    if not kept:
        best = max((r.reward for _, r in pairs), default=None)
        raise ConfigError(f"prl export-data: no rollout to write, nothing written: {data.summary(0, len(pairs), skipped)}"
                          + (f"; the best reward is {best:.4g}" if best is not None else ""))
    out = Path(a.output).expanduser().resolve()
    try:
        atomic_write_text(out, data.jsonl(kept))
    except OSError as e:
        raise ConfigError(f"--output {out}: {e.strerror or e}") from None
    print(f"wrote {out}: {data.summary(len(kept), len(pairs), skipped)}")


def orchestrator(a: argparse.Namespace) -> None:
    """Run the orchestrator: environments -> rollouts -> batches; new weights -> every server."""
    from prl.orchestrator import main as orchestrate

    code = orchestrate(a.run_dir, a.server or None)
    if code:
        raise Exit(code)


def evaluate(a: argparse.Namespace) -> None:
    """Evaluate environments' eval splits: against an endpoint, or over a run's published weights (a sweep)."""
    args = {}
    for item in a.env_arg or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--arg {item!r}: expected KEY=VALUE")
        args[key] = yaml_value(value)
    if a.run and a.records:
        raise ConfigError("--records: an endpoint's eval writes them; a sweep over a run's weights (--run) does not yet")
    if a.run:
        return sweep(a, args)
    if not (a.base_url and a.model):
        raise ConfigError("prl eval: give --base-url and --model (an endpoint), or --run RUN (a run's weights)")
    from prl.orchestrator.eval import evaluate_endpoint

    records_to = records_path(a.records)
    if a.api_key_env and not os.environ.get(a.api_key_env):
        print(f"warning: ${a.api_key_env} is not set; sending no API key")
    failed = False
    records: Optional[list] = [] if records_to is not None else None
    for env_id in a.env_ids:
        stats = evaluate_endpoint(env_id, a.base_url, a.model, api_key_env=a.api_key_env, examples=a.examples,
                                  rollouts=a.rollouts, args=args, harness=a.harness or "prl",
                                  max_tokens=a.max_tokens, temperature=a.temperature, records=records)
        show_eval(stats)
        if stats.get("rollouts") and stats.get("failed_rollouts") == stats.get("rollouts"):
            print(f"error: every rollout of {env_id} failed against {a.base_url}", file=sys.stderr)
            failed = True
    if records_to is not None:
        from prl.run.files import atomic_write_json
        from prl.run.records import RolloutSample

        atomic_write_json(records_to, RolloutSample(step=0, rollouts=len(records), records=records))
        print(f"wrote {records_to}: {len(records)} rollout record(s) (prl rollouts {records_to})")
    if failed:
        raise Exit(1)


def records_path(arg: str | None) -> Optional[Path]:
    """`--records FILE`, checked before any rollout runs: a .json file whose directory exists."""
    if arg is None:
        return None
    path = Path(arg).expanduser().resolve()
    if path.suffix != ".json":
        raise ConfigError(f"--records {arg}: name a .json file")
    if path.is_dir():
        raise ConfigError(f"--records {arg}: is a directory; name a .json file")
    if not path.parent.is_dir():
        raise ConfigError(f"--records {arg}: no directory {path.parent} to write it in")
    return path


def show_eval(stats: dict) -> None:
    """One environment's eval stats (`prl.orchestrator.eval.evaluate_endpoint`): rewards, then each metric's mean."""
    print(f"{stats['env']} (eval split) on {stats['model']}: reward {stats['reward_mean']:.4f} "
          f"± {stats['reward_std']:.4f} [{stats['reward_min']:.3f}, {stats['reward_max']:.3f}] "
          f"over {stats['rollouts']} rollouts ({stats['failed_rollouts']} failed) in {stats['eval_s']:.1f} s")
    for k, v in stats.items():
        if k.startswith("metric/"):
            print(f"  {k[7:]}: {v:.4f}")
    if stats.get("first_error"):
        print(f"  first error: {stats['first_error']}")


def sweep(a: argparse.Namespace, env_args: dict) -> None:
    from prl.ops import sweep as sweeps
    from prl.ops.status import resolve_run
    from prl.orchestrator.eval_task import EvalTask
    from prl.planner.model import Plan
    from prl.states import Backend

    run = resolve_run(a.run)
    plan = Plan.read(run)
    tasks = [EvalTask(str(run.root), step, tuple(a.env_ids), a.examples, a.rollouts, a.max_tokens, a.temperature,
                      env_args, a.harness) for step in sweeps.choose_steps(run, a.steps)]
    print(f"evaluating {len(tasks)} weights step(s) x {len(a.env_ids)} environment(s) "
          f"{'as a Slurm job array' if a.slurm else 'here, one step after another'}")
    if a.slurm:
        outcomes = sweeps.run_slurm(run, plan, tasks, a.parallel, a.timeout_min)
    else:
        outcomes = sweeps.run_local(tasks)
    path = sweeps.save(run, outcomes, {"envs": list(a.env_ids), "examples": a.examples, "rollouts": a.rollouts,
                                       "backend": Backend.SLURM if a.slurm else Backend.LOCAL})
    sweeps.show(outcomes, path)
    if any(o.error for o in outcomes):
        raise Exit(1)


def yaml_value(text: str) -> object:
    """`--arg n=3` gives 3, `--arg name=abc` gives 'abc': values parse as YAML scalars."""
    import yaml

    return yaml.safe_load(text)


# ----------------------------------------------------------------------------- the parsers


def _topology(p: argparse.ArgumentParser) -> None:
    p.add_argument("topology", type=Path, help="Topology YAML (see configs/).")
    p.add_argument("overrides", nargs="*", default=[], help=OVERRIDES_HELP)


def _plan_args(p: argparse.ArgumentParser) -> None:
    _topology(p)
    p.add_argument("--json", dest="as_json", action="store_true", help="Print the plan as JSON instead of tables.")
    p.add_argument("--no-write", action="store_true", help="Check and show only; write nothing.")
    p.add_argument("--force", action="store_true", help="Write into a run directory that already holds a job.")


def _submit_args(p: argparse.ArgumentParser) -> None:
    _topology(p)
    p.add_argument("--local", action="store_true", help="Run the roles as local processes, not on Slurm.")
    p.add_argument("--detach", action="store_true", help="With --local: return at once; the run goes on.")
    p.add_argument("--resume", action="store_true", help="Continue the run in this run directory from its checkpoints.")
    p.add_argument("--force", action="store_true", help="Submit into a run directory that already holds a job.")
    p.add_argument("--preflight", action="store_true", help="Only run every role's preflight checks, then end.")
    p.add_argument("--hold", type=float, default=0.0, help="With --preflight: keep the allocation this many seconds.")


def _status_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", nargs="?", help=RUN_HELP)
    p.add_argument("--json", dest="as_json", action="store_true", help="Print JSON.")
    p.add_argument("--watch", "-w", action="store_true", help="Refresh every few seconds until the job ends.")
    p.add_argument("--interval", type=float, default=3.0, help="Seconds between refreshes with --watch.")


def _logs_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", nargs="?", help=RUN_HELP)
    p.add_argument("--role", "-r", help="Role (default: the failed one, else trainer); `launcher` for the launcher.")
    p.add_argument("--rank", "-k", type=int, default=0, help="Task (rank) of the role.")
    p.add_argument("--attempt", type=int, help="Attempt (default: the latest).")
    p.add_argument("-n", dest="lines", type=int, default=100, help="Lines to show from the end.")
    p.add_argument("--follow", "-f", action="store_true", help="Keep printing new lines, across requeues.")


def _cancel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", nargs="?", help=RUN_HELP)


def _plot_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", nargs="?", help=RUN_HELP)
    p.add_argument("--compare", "-c", action="append", help="Another run (directory or job id) to overlay; repeatable.")
    p.add_argument("--output", "-o", type=Path, help="PNG to write (default: RUN/plots/progress.png).")


def _rollouts_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", nargs="?", help=RUN_HELP)
    p.add_argument("--steps", default="latest", help="latest (default), all, N, A-B or A,B,...")
    p.add_argument("--sort", default="step", help="step (the step's order), best or worst (by reward).")
    p.add_argument("--fate", help="Only rollouts that were trained, or dropped as zero_advantage, failed, resampled "
                   "or stale.")
    p.add_argument("--failed", action="store_true", help="Only rollouts that failed.")
    p.add_argument("--truncated", action="store_true", help="Only rollouts cut by a limit.")
    p.add_argument("--env", help="Only rollouts of this environment.")
    p.add_argument("--limit", type=int, default=20, help="Most rollouts shown in the terminal (0: all).")
    p.add_argument("--html", help="Write one self-contained HTML page of the chosen steps here instead.")


def _wandb_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", nargs="?", help=RUN_HELP)
    p.add_argument("--project", default="prl", help="W&B project.")
    p.add_argument("--entity", help="W&B entity (team or user; default: yours).")
    p.add_argument("--follow", "-f", action="store_true", help="Keep logging new steps until the job ends.")
    p.add_argument("--attempt", type=int, help="Follow until attempt N of the job ends (how the launcher runs it "
                                               "for a topology's `wandb:`).")


def _doctor_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", nargs="?", help="Nothing: this machine's install. A topology YAML: also what it "
                                             "needs here. A run directory (with --role): a role's preflight.")
    p.add_argument("overrides", nargs="*", help="With a topology: dotted overrides, as for prl plan.")
    p.add_argument("--role", help="With a run directory: the role whose preflight checks to run here.")
    p.add_argument("--task", type=int, default=0, help="Task index of the role.")
    p.add_argument("--lenient", dest="strict", action="store_false", help="Missing role packages are warnings.")


def _trainer_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", required=True, help="The run directory (holds plan.json).")
    p.add_argument("--resume", default="latest", help="latest, none, or a checkpoint step.")


def _export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", nargs="?", help=RUN_HELP)
    p.add_argument("--step", type=int, help="Published weights step (default: the newest).")
    p.add_argument("--merged", action="store_true", help="A LoRA run: merge the adapter into the base model, "
                                                         "writing a plain Hugging Face model.")
    p.add_argument("--output", "-o", required=True, help="Directory to write (must not exist).")


def _export_data_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", nargs="?", help=RUN_HELP[:-1] + ", or a records file of `prl eval --records`.")
    p.add_argument("--min-reward", type=float, required=True, help="Only rollouts scoring at least this.")
    p.add_argument("--best-per-task", action="store_true", help="Of each task's rollouts, only the best one.")
    p.add_argument("--steps", default="all", help="A run's steps: all (default), latest, N, A-B or A,B,...")
    p.add_argument("--output", "-o", required=True, help="JSONL file to write (an sft: topology's data).")


def _orchestrator_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", required=True, help="The run directory (holds plan.json).")
    p.add_argument("--server", action="append", help="Inference server URL (repeatable); default: the run's endpoints.")


def _eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("env_ids", nargs="+", metavar="ENV_ID", help="verifiers taskset id(s), e.g. prl_reverse_text.")
    p.add_argument("--base-url", help="OpenAI-compatible endpoint, e.g. http://host:8000/v1.")
    p.add_argument("--model", help="Model name the endpoint serves.")
    p.add_argument("--api-key-env", help="Variable that holds the endpoint's API key.")
    p.add_argument("--run", help="Evaluate this run's published weights instead (directory or job id).")
    p.add_argument("--steps", default="all", help="With --run: all, latest, or steps like 0,10,20 (0: base model).")
    p.add_argument("--slurm", action="store_true", help="With --run: one submitit job array task per step.")
    p.add_argument("--parallel", type=int, default=4, help="With --slurm: array tasks running at once.")
    p.add_argument("--timeout-min", type=int, default=120, help="With --slurm: time limit of each task.")
    p.add_argument("--examples", "-n", type=int, default=64, help="Eval-split examples.")
    p.add_argument("--rollouts", type=int, default=1, help="Rollouts per example (pass@k with more than 1).")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--arg", dest="env_arg", action="append", help="Taskset argument KEY=VALUE (repeatable; with "
                   "--run, given for the run's own environment, they replace the run's environment.args).")
    p.add_argument("--harness", help="verifiers harness id the rollouts run in, as environment.harness in training "
                   "(default: prl's; with --run, the run's own for its environment).")
    p.add_argument("--records", help="Also write every rollout (conversation, rewards, metrics) to this .json file, "
                   "for `prl rollouts FILE` and `prl export-data FILE` (an endpoint's eval).")


Command = tuple[Callable[[argparse.Namespace], None], Callable[[argparse.ArgumentParser], None]]
COMMANDS: dict[str, Command] = {
    "plan": (plan, _plan_args), "submit": (submit, _submit_args), "status": (status, _status_args),
    "logs": (logs, _logs_args), "cancel": (cancel, _cancel_args), "doctor": (doctor, _doctor_args),
    "trainer": (trainer, _trainer_args), "orchestrator": (orchestrator, _orchestrator_args),
    "eval": (evaluate, _eval_args), "rollouts": (rollouts, _rollouts_args), "plot": (plot, _plot_args),
    "wandb": (wandb, _wandb_args),
    "export": (export, _export_args), "export-data": (export_data, _export_data_args),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {(func.__doc__ or '').strip().splitlines()[0]}"
                     for name, (func, _) in COMMANDS.items())
    return (f"usage: prl COMMAND [ARGS] [--help]\n\nprl: asynchronous RL post-training on Slurm. "
            f"Start with `prl plan configs/local-tiny.yaml`.\n\ncommands:\n{rows}\n")


def parse(args: list[str]) -> Optional[argparse.Namespace]:
    """The command's arguments (options and overrides in any order), or None after help/version."""
    if not args or args[0] in ("-h", "--help"):
        print(usage(), end="")
        return None
    if args[0] == "--version":
        from prl import __version__

        print(f"prl {__version__}")
        return None
    if args[0] not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(args[0], COMMANDS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"prl: unknown command {args[0]!r}; {hint}commands: {', '.join(COMMANDS)}")
    func, add_args = COMMANDS[args[0]]
    doc = (func.__doc__ or "").strip()
    parser = Parser(prog=f"prl {args[0]}", description=doc)
    add_args(parser)
    ns = parser.parse_intermixed_args(args[1:])
    ns.func = func
    return ns


def main(argv: Optional[list[str]] = None) -> None:
    """The `prl` command: errors become one line and an exit code (prl.errors.run_entry)."""
    code = run_entry(None, lambda: _dispatch(sys.argv[1:] if argv is None else list(argv)))
    if code:
        raise SystemExit(code)


def _dispatch(argv: list[str]) -> int:
    try:
        ns = parse(argv)
        if ns is not None:
            ns.func(ns)
    except Exit as done:
        return done.code
    return 0


if __name__ == "__main__":
    main()
