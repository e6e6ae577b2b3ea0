"""Orchestrator overhead: rollouts/s and CPU per rollout against an instant fake engine.

    python bench/bench_orchestrator.py [--steps 4] [--batch 256] [--group 8] [--max-tokens 16]

The engine (testkit/fake_engine.py) runs in its own process and answers at once, so
what is measured is the orchestrator itself: verifiers' interception + train client
(client-side chat-template rendering), the in-process harness, scoring, advantages, packing
and publishing. Baseline in the same run: the same number of bare token-level generate calls
from one asyncio client (what an orchestrator with no environment at all would reach).
Prints steady-state rollouts/s (step 1, with the tokenizer warm-up, is excluded), the
orchestrator process's CPU seconds per wall second, and CPU milliseconds per rollout.

    python bench/bench_orchestrator.py --env-workers 0,1,2,4

runs once per `orchestrator.env_workers` setting (0: rollouts in the orchestrator's process) and
adds the ratio to the in-process rate and the workers' CPU per rollout. Scaling needs the cores:
run it where the workers and the engine each have their own.

    python bench/bench_orchestrator.py --profile      # needs py-spy (pip install py-spy)

runs the same under py-spy (200 samples/s) and splits the orchestrator's CPU while it runs
rollouts by whose code it is: each sample goes to the innermost frame of prl, verifiers,
renderers or the environment package (a library frame such as aiohttp or pydantic counts for
its caller); imports and environment loading are left out. `cpu_ms_per_rollout_by_owner` is that
split of `cpu_ms_per_rollout` (py-spy's sampling is run-to-run noisy by a few points).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MODEL = "local-tiny"
"""The served model name of configs/local-tiny.yaml's plan, which the run uses."""

ENGINE = f"""
import sys, time
from testkit.fake_engine import FakeEngine
eng = FakeEngine(model={MODEL!r}, token_ids=range(3, 400), stop_id=2, p_stop=0.0).start()
print(eng.url, flush=True)
while True:
    time.sleep(3600)
"""


def cpu(who: int = resource.RUSAGE_SELF) -> float:
    """CPU seconds of this process, or (RUSAGE_CHILDREN) of its children that have ended: the env worker pool."""
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


async def baseline(url: str, n: int, max_tokens: int, concurrency: int = 256) -> float:
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    body = {"model": MODEL, "token_ids": list(range(3, 40)), "sampling_params": {"max_tokens": max_tokens, "logprobs": 1}}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:

        async def one():
            async with sem, session.post(f"{url}/inference/v1/generate", json=body) as r:
                r.raise_for_status()
                await r.read()

        await one()
        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        return n / (time.perf_counter() - t0)


OWNERS = (("prl", re.compile(r"^prl/")), ("verifiers", re.compile(r"^verifiers/")),
          ("renderers", re.compile(r"^renderers/")), ("environment", re.compile(r"^prl_(letters|reverse_text)/")))
"""Whose code a py-spy frame's file is (py-spy names files relative to their sys.path entry)."""
SETUP = ("_find_and_load", "load_env (", "serving (", "build_tokenizer (")
"""Frames of one-time work (imports, loading the environment), not of running rollouts."""
ENTRIES = ("Handle._run (", "_WorkItem.run (")
"""Where code of its own starts in a stack: an event-loop callback (a task's step) or a worker thread's item."""
LOOP = "python (event loop, stdlib)"


def owner_of(stack: str) -> str:
    """The owner of one sample: the innermost prl/verifiers/renderers/environment frame after the last
    entry point (a library frame, e.g. aiohttp or pydantic, counts for its caller); the event loop's own
    work (selecting, scheduling) is LOOP."""
    frames = stack.split(";")
    entry = max((i for i, f in enumerate(frames) if f.startswith(ENTRIES)), default=None)
    if entry is None:
        return LOOP
    for frame in reversed(frames[entry + 1:]):
        path = frame[frame.rfind("(") + 1:].rsplit(":", 1)[0]
        for name, pattern in OWNERS:
            if pattern.search(path):
                return name
    return LOOP


def owner_shares(raw: Path) -> dict[str, float]:
    """Share of the orchestrator's rollout-time samples of a py-spy raw profile that each owner holds."""
    counts: dict[str, int] = {}
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        running = "prl/orchestrator/loop.py" in stack or "_WorkItem.run (" in stack
        if not running or any(mark in stack for mark in SETUP):
            continue
        who = owner_of(stack)
        counts[who] = counts.get(who, 0) + int(n)
    total = sum(counts.values()) or 1
    return {who: round(n / total, 3) for who, n in sorted(counts.items(), key=lambda kv: -kv[1])}


def profiled(argv: list[str]) -> None:
    """Run this benchmark under py-spy, then print its numbers with the CPU split by owner."""
    spy = shutil.which("py-spy")
    if spy is None:
        sys.exit("--profile needs py-spy: pip install py-spy")
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "profile.txt"
        out = subprocess.run([spy, "record", "--rate", "200", "--format", "raw", "--output", str(raw), "--",
                              sys.executable, __file__, *argv], capture_output=True, text=True, cwd=REPO)
        if out.returncode != 0:
            sys.exit(f"py-spy failed ({out.returncode}): {out.stderr[-2000:]}")
        numbers, _ = json.JSONDecoder().raw_decode(out.stdout[out.stdout.index("{"):])  # the first setting's
        shares = owner_shares(raw)
    numbers["cpu_share_by_owner"] = shares
    numbers["cpu_ms_per_rollout_by_owner"] = {w: round(f * numbers["cpu_ms_per_rollout"], 2) for w, f in shares.items()}
    print(json.dumps(numbers, indent=2))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--env", default="prl_letters")
    p.add_argument("--env-workers", default="0", help="Comma list of orchestrator.env_workers settings to run, e.g. 0,1,2,4.")
    p.add_argument("--profile", action="store_true", help="Split the CPU per rollout by owner (needs py-spy).")
    a = p.parse_args()
    if a.profile:
        return profiled([arg for arg in sys.argv[1:] if arg != "--profile"])

    from prl.orchestrator import main as orchestrate
    from prl.run.rundir import RunDir
    from testkit.plans import local_plan, write_plan
    from prl.trainer.tiny_model import build_tokenizer

    eng = subprocess.Popen([sys.executable, "-c", ENGINE], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        url = eng.stdout.readline().strip()
        with tempfile.TemporaryDirectory() as tmp:
            tok = Path(tmp) / "tok"
            build_tokenizer().save_pretrained(tok)
            base = asyncio.run(baseline(url, a.batch * 2, a.max_tokens))
            in_process = None
            for workers in [int(w) for w in a.env_workers.split(",")]:
                plan = local_plan(Path(tmp) / f"run-{workers}", tok, [
                    f"environment.id={a.env}", "trainer.gpus_per_node=1", f"training.batch_size={a.batch}",
                    f"training.rollouts_per_example={a.group}", f"training.max_steps={a.steps}",
                    f"training.max_off_policy_steps={a.steps}", f"training.max_tokens={a.max_tokens}",
                    "training.micro_batch_tokens=8192", f"orchestrator.env_workers={workers}"])
                assert plan.served_model_name == MODEL, plan.served_model_name
                run = write_plan(RunDir(plan.run_dir), plan)
                c0, k0, w0 = cpu(), cpu(resource.RUSAGE_CHILDREN), time.perf_counter()
                orchestrate(str(run.root), [url])
                c1, k1, w1 = cpu(), cpu(resource.RUSAGE_CHILDREN), time.perf_counter()
                steps = [m for m in run.read_metrics("orchestrator") if not m.get("eval")]
                steady = steps[1:] or steps
                rate = sum(m["rollouts"] for m in steady) / sum(m["generate_s"] for m in steady)
                rollouts = sum(m["rollouts"] for m in steps)
                in_process = in_process or (rate if workers == 0 else None)
                print(json.dumps({
                    "env_workers": workers,
                    "rollouts_per_s": round(rate, 1),
                    "baseline_generate_per_s": round(base, 1),
                    "ratio_to_baseline": round(rate / base, 3),
                    **({"ratio_to_in_process": round(rate / in_process, 2)} if in_process and workers else {}),
                    "orchestrator_cpu_per_wall": round((c1 - c0) / (w1 - w0), 2),
                    "cpu_ms_per_rollout": round(1000 * (c1 - c0) / rollouts, 2),
                    "worker_cpu_ms_per_rollout": round(1000 * (k1 - k0) / rollouts, 2),
                    "rollouts": rollouts,
                    "wall_s": round(w1 - w0, 1),
                }, indent=2), flush=True)
    finally:
        eng.terminate()
        eng.wait(10)


if __name__ == "__main__":
    main()
