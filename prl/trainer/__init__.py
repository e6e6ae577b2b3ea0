"""The trainer role: FSDP2 policy-gradient training from the run directory.

`main(run_dir, resume="latest") -> int` is the entry point (the `prl trainer`
command and `python -m prl.trainer` call it, one process per rank under
torchrun). torch and transformers load only when it is called.
"""

from __future__ import annotations


def main(run_dir: str, resume: str = "latest") -> int:
    """Train on RUN to its last step; see prl/trainer/train.py (the spec) and prl/trainer/engine.py (the loop)."""
    from prl.trainer.train import main as _main

    return _main(run_dir, resume)


__all__ = ["main"]
