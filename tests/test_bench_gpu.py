"""The GPU scripts under bench/ run only on a lent GPU, which CI never has: their CPU modes keep them from rotting.

Each one's CPU mode runs the same code path on tiny shapes: `gpu_kernels.py --smoke` (the packed-attention and
chunked-logprob checks, which must pass), `gpu_trainer.py --smoke` (the trainer's own step through the trainer's
settings type, both models, both attention paths), `gpu_weight_sync.py --check` (the disk and feed paths,
bit-equal), and `gpu_session.sh`, the one command a device call runs, passes shellcheck and runs the parts
it is given.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

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


def test_the_device_session_runs_the_parts_it_is_given_and_refuses_an_unknown_one(tmp_path):
    """A session splits into calls by naming parts: only those run, each bounded and logged; a misspelt part is
    refused before anything runs (no device time spent on installs)."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    done = subprocess.run(["bash", "bench/gpu_session.sh", "trainer_fp8", "kernels"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    ran = [line.split()[1].rstrip(":") for line in done.stdout.splitlines()
           if line.startswith("== ") and " exit " in line]
    assert ran == ["trainer_fp8", "kernels"], done.stdout  # in the order given; without a GPU each exits 1
    assert "needs a CUDA GPU" in (tmp_path / "out" / "kernels.txt").read_text()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["kernels.txt", "machine.txt", "trainer_fp8.txt"]
    bad = subprocess.run(["bash", "bench/gpu_session.sh", "kernels", "trainer-fp8"], cwd=REPO,
                         env={**env, "OUT": str(tmp_path / "bad")}, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "no part named 'trainer-fp8'" in bad.stderr and "trainer_fp8" in bad.stderr
    assert not (tmp_path / "bad").exists() and "== " not in bad.stdout
