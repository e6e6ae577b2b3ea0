"""The `prl` command. Control-plane commands stay light: no torch, vLLM, transformers or
verifiers is imported here or by what they import (tests/test_imports.py checks it).

Errors: the project's own (PrlError) become one line on stderr and exit 2 (bad input)
or 1 (failure); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer

from prl.errors import PrlError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help="prl: asynchronous RL post-training on Slurm. Start with `prl plan configs/local-tiny.yaml`.",
)

def _version(value: bool) -> None:
    if value:
        from prl import __version__

        print(f"prl {__version__}")
        raise typer.Exit()


@app.callback()
def root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                      help="Print the version and exit.")) -> None:
    """prl: asynchronous RL post-training on Slurm."""


OVERRIDES_HELP = "key.path=value overrides, e.g. trainer.nodes=8 (cluster.KEY=... overrides the profile)"


@app.command()
def plan(
    topology: Path = typer.Argument(..., help="Topology YAML (see configs/)."),
    overrides: Optional[List[str]] = typer.Argument(None, help=OVERRIDES_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON instead of tables."),
    no_write: bool = typer.Option(False, "--no-write", help="Check and show only; write nothing."),
    force: bool = typer.Option(False, "--force", help="Write into a run directory that already holds a job."),
) -> None:
    """Validate a topology, show the placement and write the rendered job to its run directory (dry run)."""
    from prl.planner.prepare import prepare, write_run_files

    prepared = prepare(topology, overrides or [])
    written = [] if no_write else write_run_files(prepared, force=force)
    if as_json:
        out = json.loads(prepared.plan.to_json())
        out["written"] = [str(p) for p in written]
        sys.stdout.write(json.dumps(out, indent=2, sort_keys=True) + "\n")
        return
    from prl.planner.show import show_plan

    show_plan(prepared.plan, written)


@app.command()
def submit(
    topology: Path = typer.Argument(..., help="Topology YAML (see configs/)."),
    overrides: Optional[List[str]] = typer.Argument(None, help=OVERRIDES_HELP),
    local: bool = typer.Option(False, "--local", help="Run the roles as local processes, not on Slurm."),
    detach: bool = typer.Option(False, "--detach", help="With --local: return at once; the run goes on."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in this run directory from its checkpoints."),
    force: bool = typer.Option(False, "--force", help="Submit into a run directory that already holds a job."),
    preflight: bool = typer.Option(False, "--preflight",
                                   help="Only run every role's preflight checks on its nodes, then end."),
    hold: float = typer.Option(0.0, "--hold", help="With --preflight: keep the allocation this many seconds."),
) -> None:
    """Plan, render and submit one heterogeneous job (or local processes); record its handle."""
    from prl.ops.submit import submit as do_submit

    run, job = do_submit(topology, overrides or [], local=local, detach=detach, resume=resume, force=force,
                         preflight=preflight, hold=hold)
    where = f"job {job['job_id']}" if job["backend"] == "slurm" else f"local run (launcher pid {job['pid']})"
    parts = ", ".join(f"{k}: {v}" for k, v in job["components"].items())
    print(f"submitted {where}: {job['name']} ({parts}){' [preflight]' if preflight else ''}")
    print(f"run dir {run.root}")
    if "exit_code" in job:
        print(f"local run ended with exit code {job['exit_code']}")
        if job["exit_code"]:
            raise typer.Exit(1)
        return
    print(f"  prl status {run.root}\n  prl logs {run.root} -f\n  prl cancel {run.root}")


@app.command()
def status(
    run: Optional[str] = typer.Argument(None, help="Run directory or job id (default: the most recent run)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    watch: bool = typer.Option(False, "--watch", "-w", help="Refresh every few seconds until the job ends."),
    interval: float = typer.Option(3.0, "--interval", help="Seconds between refreshes with --watch."),
) -> None:
    """Per-role state of a run: Slurm, heartbeats, progress, the first failure and its log."""
    import time

    from prl.ops.status import TERMINAL, collect, resolve_run, show

    run_dir = resolve_run(run)
    while True:
        current = collect(run_dir)
        if as_json:
            print(current.to_json())
        else:
            show(current)
        if not watch or current.state in TERMINAL:
            break
        time.sleep(interval)
        if not as_json:
            print()
    if current.state in ("FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "CANCELLED") and not as_json:
        raise typer.Exit(1)


@app.command()
def logs(
    run: Optional[str] = typer.Argument(None, help="Run directory or job id (default: the most recent run)."),
    role: Optional[str] = typer.Option(None, "--role", "-r", help="Role (default: the failed one, else trainer)."),
    rank: int = typer.Option(0, "--rank", "-k", help="Task (rank) of the role."),
    attempt: Optional[int] = typer.Option(None, "--attempt", help="Attempt (default: the latest)."),
    lines: int = typer.Option(100, "-n", help="Lines to show from the end."),
    follow: bool = typer.Option(False, "-f", "--follow", help="Keep printing new lines, across requeues."),
) -> None:
    """Show a role's log from the run directory."""
    from prl.ops.logs import default_role, follow as do_follow, log_path
    from prl.ops.status import log_tail, resolve_run

    run_dir = resolve_run(run)
    role = role or default_role(run_dir, run_dir.read_plan())
    if follow:
        do_follow(run_dir, role, rank, lines)
        return
    for line in log_tail(log_path(run_dir, role, rank, attempt), lines):
        print(line)


@app.command()
def cancel(run: Optional[str] = typer.Argument(None, help="Run directory or job id (default: the most recent run).")
           ) -> None:
    """Cancel the whole job (every het component) and record it."""
    from prl.ops.status import resolve_run
    from prl.ops.submit import cancel as do_cancel

    job, cancelled = do_cancel(resolve_run(run))
    if cancelled:
        print(f"cancelled job {job['job_id']} ({job['name']})")
    else:
        print(f"job {job['job_id']} ({job['name']}) has already ended; nothing to cancel")


@app.command()
def doctor(
    run: str = typer.Argument(..., help="Run directory (after `prl plan` or `prl submit`)."),
    role: str = typer.Option(..., "--role", help="Role whose checks to run here."),
    task: int = typer.Option(0, "--task", help="Task index of the role."),
    strict: bool = typer.Option(True, "--strict/--lenient", help="Missing role packages are errors."),
) -> None:
    """Run a role's preflight checks on this node (what every role does first)."""
    from prl.job import doctor as checks
    from prl.run.rundir import RunDir

    run_dir = RunDir(run)
    plan = run_dir.read_plan()
    roles = [s["name"] for s in plan["steps"]]
    if role not in roles:
        from prl.errors import ConfigError

        raise ConfigError(f"--role {role!r}: this run's roles are {', '.join(roles)}")
    results = checks.preflight(run_dir, plan, role, task, strict=strict)
    print(checks.format_checks(results))
    if checks.failed(results):
        raise typer.Exit(1)


@app.command()
def trainer(
    run_dir: str = typer.Option(..., "--run-dir", help="The run directory (holds plan.json)."),
    resume: str = typer.Option("latest", "--resume", help="latest, none, or a checkpoint step."),
) -> None:
    """Run one trainer rank (start it under torchrun; the job's step scripts do)."""
    from prl.trainer import main as train

    code = train(run_dir, resume)
    if code:
        raise typer.Exit(code)


@app.command()
def orchestrator(
    run_dir: str = typer.Option(..., "--run-dir", help="The run directory (holds plan.json)."),
    server: Optional[List[str]] = typer.Option(None, "--server", help="Inference server URL (repeatable); "
                                                                     "default: the run's endpoints."),
) -> None:
    """Run the orchestrator: environments -> rollouts -> batches; new weights -> every server."""
    from prl.orchestrator import main as orchestrate

    code = orchestrate(run_dir, server or None)
    if code:
        raise typer.Exit(code)


@app.command(name="eval")
def evaluate(
    env_id: str = typer.Argument(..., help="verifiers taskset id, e.g. prl_reverse_text."),
    base_url: str = typer.Option(..., "--base-url", help="OpenAI-compatible endpoint, e.g. http://host:8000/v1."),
    model: str = typer.Option(..., "--model", help="Model name the endpoint serves."),
    api_key_env: Optional[str] = typer.Option(None, "--api-key-env", help="Variable that holds the API key."),
    examples: int = typer.Option(64, "--examples", "-n", help="Eval-split examples."),
    rollouts: int = typer.Option(1, "--rollouts", help="Rollouts per example."),
    max_tokens: int = typer.Option(512, "--max-tokens"),
    temperature: float = typer.Option(0.0, "--temperature"),
    env_arg: Optional[List[str]] = typer.Option(None, "--arg", help="Taskset argument KEY=VALUE (repeatable)."),
) -> None:
    """Evaluate an environment's eval split against any OpenAI-compatible endpoint (the same env code as training)."""
    from prl.errors import ConfigError
    from prl.orchestrator.eval import main as run_eval

    args = {}
    for item in env_arg or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--arg {item!r}: expected KEY=VALUE")
        args[key] = yaml_value(value)
    stats = run_eval(env_id, base_url, model, api_key_env=api_key_env, examples=examples, rollouts=rollouts,
                     args=args, max_tokens=max_tokens, temperature=temperature)
    if stats.get("rollouts") and stats.get("failed_rollouts") == stats.get("rollouts"):
        print(f"error: every rollout failed against {base_url}", file=sys.stderr)
        raise typer.Exit(1)


def yaml_value(text: str) -> object:
    """`--arg n=3` gives 3, `--arg name=abc` gives 'abc': values parse as YAML scalars."""
    import yaml

    return yaml.safe_load(text)


def main() -> None:
    try:
        code = app(standalone_mode=False)
    except PrlError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except Exception as exc:
        # Usage errors of the click that typer carries: print them as click would.
        if hasattr(exc, "show") and isinstance(getattr(exc, "exit_code", None), int):
            exc.show()
            raise SystemExit(exc.exit_code) from None
        if type(exc).__name__ == "Abort":
            raise SystemExit(1) from None
        raise
    if isinstance(code, int) and code:
        raise SystemExit(code)


if __name__ == "__main__":
    main()
