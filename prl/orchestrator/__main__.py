"""`python -m prl.orchestrator --run-dir RUN [--server URL ...]`."""

from __future__ import annotations

import argparse
import sys

from prl.errors import PrlError, disk_full, disk_full_message
from prl.orchestrator.loop import main


def cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prl.orchestrator", description=__doc__)
    p.add_argument("--run-dir", required=True, help="the run directory (with plan.json)")
    p.add_argument(
        "--server", action="append", default=[], metavar="URL",
        help="inference server URL (repeatable); default: RUN/state/endpoints",
    )
    a = p.parse_args(argv)
    try:
        return main(a.run_dir, a.server or None)
    except PrlError as e:
        print(f"prl orchestrator: error: {e}", file=sys.stderr)
        return e.exit_code
    except OSError as e:
        if not disk_full(e):
            raise
        print(f"prl orchestrator: error: {disk_full_message(e)}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("prl orchestrator: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(cli())
