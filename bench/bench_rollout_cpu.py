"""Orchestrator CPU per rollout: prl's in-process fast path vs verifiers' model-call path as shipped.

    python bench/bench_rollout_cpu.py [--rollouts 256] [--repeats 2] [--concurrency 64] [--parts]

Rollouts run as the orchestrator runs them (`Generator.rollout` in `env.serving()`, groups of 8 rollouts of
a task, the `prl` harness, verifiers' train client) against an instant stand-in engine in its own process
(testkit/fake_engine.py), so the CPU measured is the orchestrator's alone: `time.process_time()` of this
process (all its threads, the renderers' pool included) over `--rollouts` rollouts after a warm-up batch,
divided by the rollouts. Two scenarios:

    single   prl_letters, one model turn (16 tokens), the tokenizer's own template (renderers' default)
    multi    prl_guess, four model turns with the environment's answers between them (16 tokens each),
             prl's ChatML renderer (each turn extends the last: no re-render)

and, per scenario, `verifiers` (the fast path off: verifiers 0.4.0's path as shipped) and `prl` (all of
prl/orchestrator/fastpath.py), alternated `--repeats` times in this one run; ratios are prl / verifiers
of the medians. `--parts` adds a run per part of the fast path alone (what each part saves), which is
how docs/orchestrator.md splits the saving between pydantic, the OpenAI SDK and the HTTP hop.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench_orchestrator import ENGINE, MODEL  # the instant stand-in engine, in its own process

GROUP = 8
"""Rollouts per task, as `training.rollouts_per_example` groups them."""
SCENARIOS = {
    "single": dict(env="prl_letters", args={}, renderer=None),
    "multi": dict(env="prl_guess", args={}, renderer="chatml"),
}


async def measure(scenario: dict, url: str, tok: str, rollouts: int, concurrency: int) -> dict:
    """CPU ms per rollout (and turns per rollout) of `rollouts` rollouts after a warm-up batch."""
    import verifiers.v1 as vf

    from prl.orchestrator.chatml import IMPORT_PATH
    from prl.orchestrator.clients import renderer_config, train_client
    from prl.orchestrator.env import load_env
    from prl.orchestrator.rollouts import Generator
    from prl.orchestrator.sync import LiveServer, ServerPool
    from prl.run.rundir import API_KEY_VAR

    renderer = {"name": "custom", "import_path": IMPORT_PATH} if scenario["renderer"] == "chatml" else None
    env = load_env(scenario["env"], args=scenario["args"], split="train")
    tasks = list(env.taskset)
    server = LiveServer(url)
    sampling = vf.SamplingConfig(temperature=1.0, max_tokens=16)
    client = train_client(f"{url}/v1", API_KEY_VAR, tok, renderer_config(renderer))
    ctx = vf.ModelContext(model=MODEL, client=client, sampling=sampling)
    async with env.serving():
        gen = Generator(env, ServerPool(generate=[server], admin=[server]), lambda s: ctx,
                        max_concurrent=concurrency, retries=0)

        async def batch(start: int, n: int) -> list:
            groups = [gen.group(tasks[(start + g) % len(tasks)], GROUP, 0) for g in range(n // GROUP)]
            return [r for group in await asyncio.gather(*groups) for r in group]

        await batch(0, concurrency)  # warm-up: tokenizer, renderer pool, connections, the fast path's caches
        gc.collect()
        c0, w0 = time.process_time(), time.perf_counter()
        done = await batch(concurrency, rollouts)
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    failed = [r.error for r in done if not r.ok]
    if failed:
        raise SystemExit(f"{len(failed)} rollouts failed, e.g. {failed[0]}")
    return {"cpu_ms_per_rollout": 1000 * cpu / len(done), "turns": statistics.mean(r.turns for r in done),
            "rollouts_per_s": len(done) / wall}


def run(name: str, parts: tuple[str, ...], scenario: dict, url: str, tok: str, a: argparse.Namespace) -> dict:
    from prl.orchestrator import fastpath

    with fastpath.parts(parts):
        return asyncio.run(measure(scenario, url, tok, a.rollouts, a.concurrency))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rollouts", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--scenarios", default="single,multi")
    p.add_argument("--parts", action="store_true", help="Also run each part of the fast path alone.")
    p.add_argument("--only", choices=["verifiers", "prl"], help="Run one mode alone (to profile it: py-spy record -- ...).")
    a = p.parse_args()
    assert a.rollouts % GROUP == 0 and a.concurrency % GROUP == 0, f"--rollouts and --concurrency: multiples of {GROUP}"

    from prl.orchestrator.fastpath import PARTS
    from prl.trainer.tiny_model import build_tokenizer

    modes = {"verifiers": (), "prl": PARTS}
    if a.parts:
        modes.update({f"only {part}": (part,) for part in PARTS})
    if a.only:
        modes = {a.only: modes[a.only]}
    eng = subprocess.Popen([sys.executable, "-c", ENGINE], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        url = eng.stdout.readline().strip()
        with tempfile.TemporaryDirectory() as tmp:
            build_tokenizer().save_pretrained(Path(tmp) / "tok")
            tok = str(Path(tmp) / "tok")
            for name in a.scenarios.split(","):
                results: dict[str, list[dict]] = {mode: [] for mode in modes}
                for _ in range(a.repeats):
                    for mode, parts in modes.items():
                        results[mode].append(run(mode, parts, SCENARIOS[name], url, tok, a))
                report(name, results)
    finally:
        eng.terminate()
        eng.wait(10)


def report(scenario: str, results: dict[str, list[dict]]) -> None:
    cpu = {mode: statistics.median(r["cpu_ms_per_rollout"] for r in runs) for mode, runs in results.items()}
    base = cpu.get("verifiers", 0.0) or cpu["prl"]
    print(json.dumps({
        "scenario": scenario,
        "turns_per_rollout": round(statistics.mean(r["turns"] for runs in results.values() for r in runs), 2),
        "cpu_ms_per_rollout": {mode: round(ms, 2) for mode, ms in cpu.items()},
        "cpu_ms_per_rollout_runs": {mode: [round(r["cpu_ms_per_rollout"], 2) for r in runs]
                                    for mode, runs in results.items()},
        "ratio_to_verifiers": {mode: round(ms / base, 3) for mode, ms in cpu.items()},
        "rollouts_per_cpu_s": {mode: round(1000 / ms, 1) for mode, ms in cpu.items()},
    }, indent=2), flush=True)


if __name__ == "__main__":
    main()
