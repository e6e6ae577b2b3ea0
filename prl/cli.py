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
    from prl.prepare import prepare, write_run_files

    prepared = prepare(topology, overrides or [])
    written = [] if no_write else write_run_files(prepared, force=force)
    if as_json:
        out = json.loads(prepared.plan.to_json())
        out["written"] = [str(p) for p in written]
        sys.stdout.write(json.dumps(out, indent=2, sort_keys=True) + "\n")
        return
    from prl.show import show_plan

    show_plan(prepared.plan, written)


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
