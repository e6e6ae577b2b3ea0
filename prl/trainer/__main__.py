"""`python -m prl.trainer --run-dir RUN [--resume latest|none|N]` (one rank; launch with torchrun)."""

from __future__ import annotations

import argparse
import os
import sys

from prl.errors import run_entry
from prl.run.rundir import RunDir
from prl.states import Role


def cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prl.trainer", description=__doc__)
    p.add_argument("--run-dir", required=True, help="the run directory (holds plan.json)")
    p.add_argument("--resume", default="latest", help="latest (default), none, or a checkpoint step")
    args = p.parse_args(argv)
    from prl.trainer import main

    rank = int(os.environ.get("RANK", "0"))  # torchrun's
    return run_entry("prl trainer", lambda: main(args.run_dir, args.resume),
                     record=lambda line: RunDir(args.run_dir).write_role_error(Role.TRAINER, line, rank))


if __name__ == "__main__":
    sys.exit(cli())
