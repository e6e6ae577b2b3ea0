"""`python -m prl.trainer --run-dir RUN [--resume latest|none|N]` (one rank; launch with torchrun)."""

from __future__ import annotations

import argparse
import sys

from prl.errors import PrlError, disk_full, disk_full_message


def cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prl.trainer", description=__doc__)
    p.add_argument("--run-dir", required=True, help="the run directory (holds plan.json)")
    p.add_argument("--resume", default="latest", help="latest (default), none, or a checkpoint step")
    args = p.parse_args(argv)
    from prl.trainer import main

    try:
        return main(args.run_dir, args.resume)
    except PrlError as e:
        print(f"prl trainer: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except OSError as e:
        if not disk_full(e):
            raise
        print(f"prl trainer: error: {disk_full_message(e)}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(cli())
