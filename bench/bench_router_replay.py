"""Router replay's cost in the trainer: steps with `training.router_replay` vs without, on the same batches.

    python bench/bench_router_replay.py [--family glm4_moe] [--steps 4] [--hidden 256] [--layers 4]
                                        [--experts 8] [--top-k 2] [--samples 16] [--len 256] [--ep 2]

Builds an MoE of `--family` in-process and publishes `--steps` rollout batches whose samples carry routes (the
batch's `routed_experts`: random distinct experts per token and layer, as a server would return them), then runs
`python -m prl.trainer` twice under torchrun with 2 gloo ranks and `trainer.ep=--ep`: router_replay off (the
routes are read and ignored) and on (every token routed to its given experts). Prints the median training
tokens/s of steps 2..N of each and the ratio on / off measured in this run (goal: cost <= 1.1x, a ratio >= 0.91).
The mismatch replay removes is measured against a real server in tests/test_router_replay.py.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_moe import build_model, moe_arguments  # noqa: E402
from bench.bench_trainer import samples  # noqa: E402
from prl.run.batch import publish_batch  # noqa: E402
from prl.run.rundir import RunDir  # noqa: E402
from testkit.plans import write_plan  # noqa: E402
from testkit.trainer_helpers import launch, make_plan  # noqa: E402


def routed(step: int, args, vocab: int, layers: int) -> list:
    rng = np.random.default_rng(step)
    out = samples(step, args.samples, args.len, vocab)
    for s in out:
        n = len(s.token_ids)
        s.routed_experts = rng.random((n, layers, args.experts)).argsort(-1)[..., :args.top_k].astype(np.uint8)
    return out


def run_once(tmp: Path, model: Path, replay: bool, args, vocab: int, layers: int) -> list[dict]:
    root = tmp / f"run-replay-{replay}"
    plan = make_plan(model, root, world_size=2, max_steps=args.steps, checkpoint_interval=0,
                     micro_batch_tokens=args.micro_batch_tokens, lr=1e-5, max_off_policy_steps=args.steps,
                     overrides=[f"trainer.ep={args.ep}", f"training.router_replay={str(replay).lower()}"])
    run = write_plan(RunDir(root), plan)
    for s in range(1, args.steps + 1):
        publish_batch(run, s, routed(s, args, vocab, layers), dp_size=2,
                      micro_batch_tokens=args.micro_batch_tokens)
    launch(run, 2, resume="none", timeout=3600, threads=1)
    return run.read_metrics("trainer")[1:]


def main() -> None:
    ap = moe_arguments("glm4_moe")
    ap.add_argument("--ep", type=int, choices=(1, 2), default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = build_model(tmp, args)
        config = json.loads((model / "config.json").read_text())
        runs = {on: run_once(tmp, model, on, args, config["vocab_size"], config["num_hidden_layers"])
                for on in (False, True)}
    tps = {on: statistics.median(r["tokens_per_s"] for r in m) for on, m in runs.items()}
    replayed = [r.get("replayed_fraction") for r in runs[True]]
    print(f"{args.family} hidden {args.hidden} x {args.layers} layers, {args.experts} experts top-{args.top_k}, "
          f"ep={args.ep}; {args.samples} samples/step of <= {args.len} tokens; 2 CPU ranks (gloo); median over "
          f"steps 2..{args.steps}")
    print(f"  router_replay off: {tps[False]:8.0f} tokens/s")
    print(f"  router_replay on:  {tps[True]:8.0f} tokens/s (replayed fraction of tokens {replayed})")
    print(f"ratio on/off = {tps[True] / tps[False]:.2f} (cost {tps[False] / tps[True]:.2f}x)")


if __name__ == "__main__":
    main()
