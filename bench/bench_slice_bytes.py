"""Bytes per inference worker per update, its slices against the whole step, for the shipped GPU topologies' plans.

    python bench/bench_slice_bytes.py [--topology moe-1t ...]

No GPU and no checkpoint: each topology is planned as `prl plan` plans it (its inference roles' tp, dp and expert
parallelism), its model's tensors are laid out from the model's public config.json values (below: names and
shapes as the Hugging Face checkpoint has them), and prl/weights/slices.py, the code every worker runs, says what
each worker of each server keeps. Prints per role: bytes per worker (least-most over a server's workers), the
whole step, their ratio, and what all of that role's servers take per update together; then the sum over roles.
A model stored block-FP8 (moe-1t's Kimi-K2: its config.json's quantization_config) gets two lines per role: the
step in the trainer's dtype (`wire bf16`, what prl sent before FP8 on the wire) and as its servers load it
(`wire fp8`: each quantised weight in e4m3 beside its float32 scales, prl/weights/fp8.py). These are the numbers
docs/weights.md's 1T table uses.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prl.planner.prepare import DTYPE_BYTES, prepare  # noqa: E402
from prl.states import WEIGHT_ROLES  # noqa: E402
from prl.weights.slices import SLICED_FAMILIES, server_places, slice_plan, wire_layout, worker_bytes  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

# config.json values of the shipped GPU topologies' models (their model cards' configs).
CONFIGS = {
    "moe-1t": {  # Kimi-K2-Instruct (DeepseekV3ForCausalLM)
        "model_type": "kimi_k2", "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 61, "first_k_dense_replace": 1, "n_routed_experts": 384, "n_shared_experts": 1,
        "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 163840,
        "tie_word_embeddings": False, "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                                                              "quant_method": "fp8", "weight_block_size": [128, 128]}},
    "moe-30b-pd": {  # Qwen3-30B-A3B
        "model_type": "qwen3_moe", "hidden_size": 2048, "moe_intermediate_size": 768, "num_hidden_layers": 48,
        "num_experts": 128, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "vocab_size": 151936, "tie_word_embeddings": False},
    "mixtral-8x7b": {  # Mixtral-8x7B-Instruct-v0.1
        "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_local_experts": 8, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
        "tie_word_embeddings": False},
    "dense-8b": {  # Qwen3-8B
        "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
        "tie_word_embeddings": False},
}


def _attention(c: dict, p: str) -> dict[str, tuple[int, ...]]:
    h, heads = c["hidden_size"], c["num_attention_heads"]
    if "kv_lora_rank" in c:  # MLA
        qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
        return {p + "q_a_proj.weight": (c["q_lora_rank"], h), p + "q_a_layernorm.weight": (c["q_lora_rank"],),
                p + "q_b_proj.weight": (heads * qk, c["q_lora_rank"]),
                p + "kv_a_proj_with_mqa.weight": (c["kv_lora_rank"] + c["qk_rope_head_dim"], h),
                p + "kv_a_layernorm.weight": (c["kv_lora_rank"],),
                p + "kv_b_proj.weight": (heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"]),
                p + "o_proj.weight": (h, heads * c["v_head_dim"])}
    d, kv = c.get("head_dim", h // heads), c["num_key_value_heads"]
    out = {p + "q_proj.weight": (heads * d, h), p + "k_proj.weight": (kv * d, h), p + "v_proj.weight": (kv * d, h),
           p + "o_proj.weight": (h, heads * d)}
    if c["model_type"].startswith("qwen3"):
        out.update({p + "q_norm.weight": (d,), p + "k_norm.weight": (d,)})
    return out


def _mlp(c: dict, p: str, layer: int) -> dict[str, tuple[int, ...]]:
    h = c["hidden_size"]
    experts = c.get("n_routed_experts") or c.get("num_experts") or c.get("num_local_experts") or 0
    if not experts or layer < c.get("first_k_dense_replace", 0):
        i = c["intermediate_size"]
        return {p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i)}
    if c["model_type"] == "mixtral":
        i, q = c["intermediate_size"], p + "block_sparse_moe."
        out = {q + "gate.weight": (experts, h)}
        for e in range(experts):
            out.update({f"{q}experts.{e}.w1.weight": (i, h), f"{q}experts.{e}.w3.weight": (i, h),
                        f"{q}experts.{e}.w2.weight": (h, i)})
        return out
    i, q = c["moe_intermediate_size"], p + "mlp."
    out = {q + "gate.weight": (experts, h)}
    if "n_routed_experts" in c:
        out[q + "gate.e_score_correction_bias"] = (experts,)
    for e in range(experts):
        out.update({f"{q}experts.{e}.gate_proj.weight": (i, h), f"{q}experts.{e}.up_proj.weight": (i, h),
                    f"{q}experts.{e}.down_proj.weight": (h, i)})
    shared = c.get("n_shared_experts", 0) * i
    if shared:
        out.update({q + "shared_experts.gate_proj.weight": (shared, h), q + "shared_experts.up_proj.weight": (shared, h),
                    q + "shared_experts.down_proj.weight": (h, shared)})
    return out


def layout_of(c: dict) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> shape, as the model's Hugging Face safetensors hold it."""
    h, v = c["hidden_size"], c["vocab_size"]
    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not c.get("tie_word_embeddings"):
        out["lm_head.weight"] = (v, h)
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
        out.update(_attention(c, p + "self_attn."))
        out.update(_mlp(c, p, n))
    return out


def rows(topology: str, fp8: bool) -> list[tuple]:
    """Per weight role: what its workers receive, the step in the trainer's dtype or (`fp8`) as its servers load it."""
    plan = prepare(REPO / "configs" / f"{topology}.yaml", cwd=REPO).plan
    config, size = CONFIGS[topology], DTYPE_BYTES[plan.settings().model.dtype]
    if not fp8:
        config = {k: v for k, v in config.items() if k != "quantization_config"}
    shapes, sizes = wire_layout(config, layout_of(config), size)
    whole = worker_bytes(dict.fromkeys(shapes), shapes, sizes)
    out = []
    for role in (r for r in plan.inference if r.name in WEIGHT_ROLES):
        per = [worker_bytes(slice_plan(config, shapes, w), shapes, sizes)
               for w in server_places(role.tp, role.dp, role.expert_parallel)]
        out.append((topology, role.name, f"tp{role.tp} dp{role.dp}" + (" ep" if role.expert_parallel else ""),
                    role.replicas, len(per), min(per), max(per), whole, role.replicas * sum(per)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--topology", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    args = ap.parse_args()
    print(f"{'topology':<13} {'wire':<5} {'role':<9} {'server':<12} {'servers':>7} {'workers':>7} {'GB/worker':>15} "
          f"{'whole GB':>9} {'most/whole':>10} {'all servers TB':>14}")
    for topology in args.topology:
        for fp8 in (False, True) if "quantization_config" in CONFIGS[topology] else (False,):
            wire = "fp8" if fp8 else plan_dtype(topology)
            total, found = 0, rows(topology, fp8)
            for t, role, place, replicas, workers, least, most, whole, together in found:
                got = f"{least / 1e9:.1f}" if least == most else f"{least / 1e9:.1f}-{most / 1e9:.1f}"
                print(f"{t:<13} {wire:<5} {role:<9} {place:<12} {replicas:>7} {workers:>7} {got:>15} "
                      f"{whole / 1e9:>9.1f} {most / whole:>10.4f} {together / 1e12:>14.2f}")
                total += together
            sliced = CONFIGS[topology]["model_type"] in SLICED_FAMILIES
            print(f"{'':<13} {wire:<5} every worker whole: {whole * sum(r[3] * r[4] for r in found) / 1e12:.2f} TB "
                  f"per update; sliced: {total / 1e12:.2f} TB{'' if sliced else ' (family not sliced: whole today)'}")


def plan_dtype(topology: str) -> str:
    """The trainer's dtype, as the wire's name (bf16)."""
    dtype = prepare(REPO / "configs" / f"{topology}.yaml", cwd=REPO).plan.settings().model.dtype
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype, dtype)


if __name__ == "__main__":
    main()
