"""Step time per loss, as a ratio to the `token` loss on the same batch and model, in one process.

    python bench/bench_losses.py [--hidden 256] [--layers 4] [--samples 16] [--len 256] [--repeats 5]

Builds a tiny Qwen3 in-process and one packed batch of `--samples` sequences of `--len` tokens (random
ids, sampling logprobs, advantages, teacher and reference logprobs). Each variant runs the trainer's
step on it: forward, `token_logprobs_and_entropy`, `policy_loss` (prl/trainer/loss.py), backward, AdamW.
Variants: the kinds `token`, `gspo`, `cispo`, `dppo`; `token` with `distill_coef` (teacher logprobs from
the batch) and with `kl_ref_coef` (reference logprobs from the batch); and `token` plus one no-grad
forward of a frozen copy of the model, what a reference computed in the trainer would add to every
step. Variants are interleaved over `--repeats` rounds (after a warm-up round) and the median time of
each is divided by the median `token` time of the same run: ratios, never absolute times. Each round starts
with another variant, so that none always runs first after the others (caches, a neighbour's load).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from prl.config.topology import Loss  # noqa: E402
from prl.trainer.loss import policy_loss, sample_ids_of, token_logprobs_and_entropy  # noqa: E402
from prl.trainer.tiny_model import build_tiny_model  # noqa: E402

VARIANTS = {
    "token": Loss(),
    "gspo": Loss(kind="gspo"),
    "cispo": Loss(kind="cispo"),
    "dppo": Loss(kind="dppo"),
    "token+distill": Loss(distill_coef=1.0),
    "token+kl_ref": Loss(kl_ref_coef=0.1),
    "token+trainer_ref_forward": Loss(),
}


def batch(samples: int, length: int, vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n = samples * length
    mask = torch.ones(n)
    mask[::length] = 0  # a sample's first token has no loss
    return {"input_ids": torch.randint(0, vocab, (n,), generator=g),
            "position_ids": torch.arange(length).repeat(samples),
            "inference_logprobs": -torch.rand(n, generator=g) * 5, "advantages": torch.randn(n, generator=g),
            "teacher_logprobs": -torch.rand(n, generator=g) * 5, "reference_logprobs": -torch.rand(n, generator=g) * 5,
            "loss_mask": mask}


def step(model, frozen, opt, x: dict[str, torch.Tensor], name: str) -> float:
    t0 = time.perf_counter()
    if name == "token+trainer_ref_forward":
        with torch.no_grad():
            ref_logits = frozen(input_ids=x["input_ids"][None], position_ids=x["position_ids"][None]).logits[0]
            token_logprobs_and_entropy(ref_logits[:-1], x["input_ids"][1:])
    logits = model(input_ids=x["input_ids"][None], position_ids=x["position_ids"][None]).logits[0]
    logp, entropy = token_logprobs_and_entropy(logits[:-1], x["input_ids"][1:])
    shifted = {k: x[k][1:] for k in ("inference_logprobs", "advantages", "loss_mask", "teacher_logprobs",
                                     "reference_logprobs", "position_ids")}
    loss, _ = policy_loss(logp, shifted["inference_logprobs"], shifted["advantages"], shifted["loss_mask"],
                          VARIANTS[name], float(shifted["loss_mask"].sum()), entropy=entropy,
                          sample_ids=sample_ids_of(shifted["position_ids"]),
                          teacher_logprobs=shifted["teacher_logprobs"], reference_logprobs=shifted["reference_logprobs"])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(Path(tmp) / "m", hidden_size=args.hidden, num_layers=args.layers,
                                num_heads=args.hidden // 64, num_kv_heads=max(1, args.hidden // 128), head_dim=64)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    frozen = copy.deepcopy(model).eval().requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    x = batch(args.samples, args.len, model.config.vocab_size)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    for round_ in range(args.repeats + 1):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:  # rotated: no variant always first
            seconds = step(model, frozen, opt, x, name)
            if round_:  # round 0 warms up
                times[name].append(seconds)
    base = statistics.median(times["token"])
    print(f"{args.samples} x {args.len} tokens, hidden {args.hidden}, {args.layers} layers, "
          f"median of {args.repeats}; step time / token's:")
    for name, ts in times.items():
        print(f"  {name:28s} {statistics.median(ts) / base:.3f}")


if __name__ == "__main__":
    main()
