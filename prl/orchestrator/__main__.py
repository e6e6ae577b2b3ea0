"""`python -m prl.orchestrator --run-dir RUN [--server URL ...]`."""

from __future__ import annotations

import argparse
import sys

from prl.errors import run_entry
from prl.orchestrator.loop import main
from prl.run.rundir import RunDir
from prl.states import Role


def cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prl.orchestrator", description=__doc__)
    p.add_argument("--run-dir", required=True, help="the run directory (with plan.json)")
    p.add_argument(
        "--server", action="append", default=[], metavar="URL",
        help="inference server URL (repeatable); default: RUN/state/endpoints",
    )
    a = p.parse_args(argv)
    return run_entry("prl orchestrator", lambda: main(a.run_dir, a.server or None),
                     record=lambda line: RunDir(a.run_dir).write_role_error(Role.ORCHESTRATOR, line))


if __name__ == "__main__":
    sys.exit(cli())
