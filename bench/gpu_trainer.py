"""The trainer's step on one GPU: tokens/s and MFU for a Qwen3-0.6B-shaped dense model and a small Qwen3-MoE.

    python bench/gpu_trainer.py [--tokens 16384 32768] [--steps 5] [--models dense moe] [--peak-tflops 989]
                                [--attention packed|sdpa] [--ac] [--lora RANK] [--compile] [--profile]
                                [--precision bf16|fp8]
    python bench/gpu_trainer.py --smoke        # tiny models on CPU (gloo, fp32): checks the code path

One process, one GPU: NCCL process group of one rank, the trainer's own FSDP2 wrapping
(prl.trainer.parallel.apply_fsdp: bf16 compute, fp32 master weights and reduction) and its own
`train_step` (packed micro-batch, importance-ratio loss, backward, clipping, AdamW) on a packed
micro-batch of `--tokens` tokens (8 samples; each value of `--tokens` is a run). Attention is the trainer's
packed kernel (prl/trainer/attention.py: flash-attn varlen, else torch's varlen_attn; `--attention sdpa` keeps
transformers' sdpa with its dense [T, T] block mask, the path before it), logprobs the chunked head
(prl/trainer/logprobs.py; `--compile` compiles its per-chunk arithmetic too, as `trainer.compile` does). Models
are built from a config with random weights (no download): meta device, sharded, `to_empty` on the GPU,
initialised in place.
Step 1 warms up; the median of the next `--steps` is reported.

MFU = tokens/s x FLOPs/token / peak, with FLOPs/token = 6 x active parameters (4 x with `--lora`: frozen
weights get no gradient, adapters not counted; MoE: the router's top-k share of the experts; embeddings excluded,
lm_head included) + 6 x layers x attention width x sample length (causal attention, forward + backward). Peak:
H200 dense bf16, 989 TFLOP/s (change with --peak-tflops). Each run prints step 1's loss and gradient norm (the
weights are seeded), so runs with and without `--compile` can be compared. Both models at both sizes take about
30 s on an H200 (numbers in docs/trainer.md). Without activation checkpointing the dense model at 65,536 tokens does not fit in an H200's
139 GiB; with `--ac` it takes 16 GiB. `bash bench/gpu_session.sh` runs this with the other GPU benches.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def configs(smoke: bool) -> dict:
    """name -> transformers config of the benchmarked models (tiny ones for --smoke)."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    if smoke:
        return {
            "dense": Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True),
            "moe": Qwen3MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                                  num_experts=4, num_experts_per_tok=2, tie_word_embeddings=True),
        }
    return {
        # Qwen3-0.6B's shape.
        "dense": Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                             num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                             max_position_embeddings=40960),
        # A small Qwen3-MoE: ~1.3B total, ~0.4B active.
        "moe": Qwen3MoeConfig(vocab_size=151936, hidden_size=1024, intermediate_size=3072, moe_intermediate_size=384,
                              num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                              num_experts=64, num_experts_per_tok=8, norm_topk_prob=True, tie_word_embeddings=False,
                              max_position_embeddings=40960),
    }


def active_params(model, config) -> tuple[int, int]:
    """(all parameters, parameters one token uses), embeddings excluded."""
    total = active = 0
    experts, top_k = getattr(config, "num_experts", 0), getattr(config, "num_experts_per_tok", 0)
    for name, p in model.named_parameters():
        if "embed_tokens" in name:
            continue
        n = p.numel()
        total += n
        active += n * top_k // experts if ".experts." in name else n
    if getattr(config, "tie_word_embeddings", False):  # the tied lm_head still does its matmul
        active += config.vocab_size * config.hidden_size
    return total, active


def build(config, cfg, d, attention: str):
    """Random-initialised, FSDP2-wrapped model on d.device, built through the meta device (with `cfg.lora`: the
    trainer's adapters on it, B zero, everything else frozen)."""
    import torch
    from transformers import AutoModelForCausalLM

    from prl.trainer.attention import install_packed
    from prl.trainer.loading import rebuild_nonpersistent_buffers
    from prl.trainer.lora import attach
    from prl.trainer.parallel import apply_fsdp

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    if attention == "packed":
        install_packed(model)
    if cfg.lora is not None:
        attach(model, cfg.lora, seed=0)
    model.config.use_cache = False
    model.train()
    apply_fsdp(model, cfg, d)
    model.to_empty(device=d.device)
    rebuild_nonpersistent_buffers(model, d.device)
    torch.manual_seed(0)  # the same weights in every run: step 1's loss compares runs (eager vs compiled)
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.fill_(1.0) if "norm" in name else local.zero_() if name.endswith("lora_B") else local.normal_(0, 0.02)
    return model


def micro_batch(tokens: int, vocab: int, samples: int = 8):
    """One packed micro-batch of `samples` equal samples, the second half of each trained on."""
    import numpy as np

    from prl.run.batch import MicroBatch

    rng = np.random.default_rng(0)
    n = tokens // samples
    mask = np.concatenate([np.zeros(n // 2), np.ones(n - n // 2)]).astype("uint8")
    return MicroBatch(sample_ids=list(range(samples)),
                      input_ids=rng.integers(0, vocab, tokens).astype("int32"),
                      position_ids=np.tile(np.arange(n), samples).astype("int32"),
                      loss_mask=np.tile(mask, samples), advantages=rng.normal(size=tokens).astype("float32"),
                      inference_logprobs=np.full(tokens, -5.0, dtype="float32")), n


def lora_of(name: str, rank: int, experts: bool = False):
    """`--lora`'s adapters: on every projection of the dense model; on the MoE's attention projections, and with
    `experts` (`--lora-experts`) on every expert's gate, up and down projections too (prl's per-expert loop then
    runs the experts instead of transformers' grouped kernel: what that costs is what the option measures)."""
    from prl.config.topology import Lora

    if not rank:
        return None
    if name == "dense":
        return Lora(rank=rank)
    return Lora(rank=rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                           *(("gate_proj", "up_proj", "down_proj") if experts else ())])


def profile_step(step, device, wall: float) -> None:
    """One more step under torch.profiler: the ops that take the most GPU time, and (the table's footer) the GPU's
    busy time, to set against the step's wall time (a GPU idle for much of the step means the CPU, launching
    kernels, sets the pace; on the H200 it was busy 95 % of a dense 16k step)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    events = prof.key_averages()
    key = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    # The table's last line ("Self CUDA time total") is the GPU's busy time; compare it with the step's.
    print(f"    profile of one {1000 * wall:.0f} ms step, by GPU time:")
    print(events.table(sort_by=key if device.type == "cuda" else "self_cpu_time_total", row_limit=22,
                       max_name_column_width=60))


def bench(name: str, config, args, d, tokens: int) -> dict:
    import torch

    from prl.config.topology import Training
    from prl.planner.model import Mesh
    from prl.trainer.config import TrainerConfig
    from prl.trainer.engine import train_step
    from prl.trainer.lora import adapter_parameters
    from prl.trainer.rl import RLSpec

    # The trainer's own settings type, as a plan of one rank would give it (nothing is read from them but the
    # mesh, precision, activation checkpointing and the training defaults: loss, clipping, no aux loss). The smoke run computes in
    # fp32 (as the trainer on CPU), fp8's float8 matmuls included.
    cfg = TrainerConfig(model_path="", model_dtype="bfloat16", mesh=Mesh(dp_replicate=1, dp_shard=1, cp=1, ep=1,
                                                                         world_size=1),
                        activation_checkpointing=args.ac, master_port=0,
                        precision=args.precision if args.precision == "fp8" or not args.smoke else "fp32",
                        training=Training(batch_size=8, max_steps=args.steps + 1, max_grad_norm=1.0,
                                          router_aux_loss_coef=0.0),
                        tokenizer_path="", max_model_len=tokens, sft=None,
                        lora=lora_of(name, args.lora, args.lora_experts), compile=args.compile)
    spec = RLSpec(cfg)
    model = build(config, cfg, d, args.attention)
    optim = torch.optim.AdamW(adapter_parameters(model) if cfg.lora else model.parameters(), lr=1e-6)
    mb, sample_len = micro_batch(tokens, config.vocab_size)
    times, first = [], None
    for _ in range(args.steps + 1):
        if d.device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        metrics = train_step(model, optim, [mb], spec, cfg, d)
        first = first or metrics
        if d.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    if args.profile:
        profile_step(lambda: train_step(model, optim, [mb], spec, cfg, d), d.device, statistics.median(times[1:]))
    total, active = active_params(model, config)
    tps = tokens / statistics.median(times[1:])
    width = config.num_attention_heads * config.head_dim
    # A frozen weight needs no gradient of its own: 4 x its parameters per token with LoRA (the adapters' few
    # FLOPs left out), 6 x without.
    flops_per_token = (4 if args.lora else 6) * active + 6 * config.num_hidden_layers * width * sample_len
    mem = torch.cuda.max_memory_allocated() / 2**30 if d.device.type == "cuda" else float("nan")
    del model, optim
    return {"name": name, "first_step": f"step 1 loss {first['loss']:.6f} grad norm {first['grad_norm']:.6f}, "
                                        f"{times[0]:.1f} s",
            "params_b": total / 1e9, "active_b": active / 1e9, "tokens_per_s": tps,
            "mfu": tps * flops_per_token / (args.peak_tflops * 1e12), "max_mem_gib": mem}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768],
                    help="tokens per step (one packed micro-batch); one run per value")
    ap.add_argument("--attention", choices=["packed", "sdpa"], default="packed",
                    help="the trainer's packed kernel, or transformers' sdpa with its dense block mask")
    ap.add_argument("--steps", type=int, default=5, help="timed steps after one warm-up step")
    ap.add_argument("--models", nargs="+", default=["dense", "moe"], choices=["dense", "moe"])
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak (H200: 989)")
    ap.add_argument("--ac", action="store_true", help="activation checkpointing")
    ap.add_argument("--lora", type=int, default=0, metavar="RANK",
                    help="train a LoRA adapter of this rank on every attention and MLP projection, the rest frozen")
    ap.add_argument("--lora-experts", action="store_true",
                    help="with --lora: the MoE's adapters on its experts too, not on its attention alone")
    ap.add_argument("--compile", action="store_true",
                    help="trainer.compile: torch.compile each transformer block (apply_fsdp, before FSDP2) and the "
                         "logprob head's arithmetic")
    ap.add_argument("--precision", choices=["bf16", "fp8"], default="bf16",
                    help="trainer.precision: fp8 multiplies the blocks' linear layers in float8 (torchao); MFU "
                         "stays against the bf16 peak")
    ap.add_argument("--profile", action="store_true",
                    help="after the timed steps, one step under torch.profiler: GPU busy time and the top ops")
    ap.add_argument("--smoke", action="store_true", help="tiny models on CPU (gloo, fp32), to check the code path")
    args = ap.parse_args()
    if args.smoke:
        args.tokens, args.steps = [min(t, 256) for t in args.tokens[:1]], min(args.steps, 2)

    import torch
    import torch.distributed as dist

    from prl.planner.model import Mesh
    from prl.trainer.parallel import build_dist

    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        os.environ.setdefault(k, v)
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("gpu_trainer.py needs a CUDA GPU (use --smoke to check the code path on CPU)")
    device = torch.device("cpu") if args.smoke else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # One rank: an in-process store, no port (a fixed one collided when two runs of the suite's smoke overlapped).
    dist.init_process_group("gloo" if args.smoke else "nccl", store=dist.HashStore(), rank=0, world_size=1)
    one = SimpleNamespace(mesh=Mesh(dp_replicate=1, dp_shard=1, cp=1, ep=1, world_size=1))
    d = build_dist(one, 0, 1, 0, device)
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (smoke)"
    print(f"{gpu}; one packed micro-batch of 8 samples per step, {args.attention} attention"
          f"{f', LoRA rank {args.lora}' if args.lora else ''}{' (MoE: experts too)' if args.lora_experts else ''}"
          f"{', activation checkpointing' if args.ac else ''}"
          f"{', compiled blocks and head' if args.compile else ''}"
          f"{', float8 linear layers' if args.precision == 'fp8' else ''}; "
          f"median of {args.steps} steps")
    for tokens in args.tokens:
        for name in args.models:
            r = bench(name, configs(args.smoke)[name], args, d, tokens)
            print(f"  {tokens:6d} tokens {r['name']:5s} {r['params_b']:.2f}B params ({r['active_b']:.2f}B active, "
                  f"no embeddings): {r['tokens_per_s']:9.0f} tokens/s  MFU {100 * r['mfu']:5.1f}%  "
                  f"max mem {r['max_mem_gib']:.1f} GiB; {r['first_step']}")
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
