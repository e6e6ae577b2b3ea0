import sys

from prl.errors import run_entry
from prl.inference.server import main

if __name__ == "__main__":
    sys.exit(run_entry("prl inference", main))
