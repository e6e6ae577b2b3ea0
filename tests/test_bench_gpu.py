"""The GPU scripts under bench/ run only on a lent GPU, which CI never has: their CPU modes keep them from rotting.

Each one's CPU mode runs the same code path on tiny shapes: `gpu_kernels.py --smoke` (the packed-attention and
chunked-logprob checks, which must pass), `gpu_trainer.py --smoke` (the trainer's own step through the trainer's
settings type, both models, both attention paths), `gpu_weight_sync.py --check` (the disk and feed paths,
bit-equal), and `gpu_session.sh`, the one command a device call runs, passes shellcheck.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.helpers import REPO


def bench(*args: str, timeout: int = 240) -> str:
    done = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_the_kernel_checks_pass_on_cpu():
    out = bench("bench/gpu_kernels.py", "--smoke")
    assert "FAILED" not in out and out.count("  ok") == 4, out  # per_sample attention, the head (eager, fused), experts


@pytest.mark.parametrize("options", [["--attention", "packed"], ["--attention", "sdpa"], ["--precision", "fp8"],
                                     ["--lora", "4", "--lora-experts"]])
def test_the_trainer_benchmark_steps_both_models(options):
    out = bench("bench/gpu_trainer.py", "--smoke", *options)
    lines = [line for line in out.splitlines() if "tokens/s" in line]
    assert [line.split()[2] for line in lines] == ["dense", "moe"], out
    assert all(float(line.split("tokens/s")[0].split()[-1]) > 0 for line in lines), out


def test_the_weight_sync_benchmark_checks_its_disk_and_feed_paths():
    assert "check passed" in bench("bench/gpu_weight_sync.py", "--check")


def test_the_device_session_script_passes_shellcheck():
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "shellcheck is missing: .ci/run installs it (apt-get install shellcheck)"
    done = subprocess.run([shellcheck, "bench/gpu_session.sh"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout
