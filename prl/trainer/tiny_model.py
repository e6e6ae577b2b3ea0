"""A tiny Qwen3-style causal LM and a byte-level BPE tokenizer, built in-process.

No model hub is reachable from CI, so the tests and the demo topologies (`model.build_tiny`, which
`prl submit` runs as `python -m prl.trainer.tiny_model DIR [--moe]`) build their model here and save it to
a directory that `from_pretrained` and `vllm serve` both accept. head_dim is 32: vLLM's CPU attention
backend refuses head sizes below 32.

    from prl.trainer.tiny_model import build_tiny_model     # tests: from tests.tiny_model import ...
    path = build_tiny_model(tmp_path / "model")
    moe = build_tiny_moe(tmp_path / "moe")       # Qwen3-MoE: 4 experts, top-2
    glm = build_tiny_moe(tmp_path / "glm", family="glm4_moe")   # any of MOE_FAMILIES
"""

from __future__ import annotations

from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Enough text for a few hundred merges; the content does not matter.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is 2 + 3? The answer is 5.",
    "user: hello\nassistant: hi there, how can I help you today?",
    "Reinforcement learning from verifiable rewards trains a policy on rollouts.",
    "def add(a, b):\n    return a + b\n",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
] * 20


def build_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer with ChatML special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def build_tiny_model(
    out_dir: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    head_dim: int = 32,
    vocab_size: int = 512,
    seed: int = 0,
    dtype: str = "float32",
    embed_scale: float = 1.0,
) -> Path:
    """Build, save and return the directory of a random tiny Qwen3 model + tokenizer; its tied embeddings
    times `embed_scale` (`LORA_EMBED_SCALE`: the model `model.build_tiny: dense-lora` builds)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(embed_scale)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


LORA_EMBED_SCALE = 8.0
"""The tiny model for LoRA runs has 8x its default tied embeddings. With hidden 64 and embeddings of std 0.02,
the final norm's output (norm 8) reaches a logit of at most ~1.3: no hidden state an adapter on the
projections can make raises a token above ~1% probability (an in-process LoRA fit of one token plateaus at
NLL 4.86), so only full fine-tuning, which grows the embeddings, can learn on it. At 8x the same fit reaches
NLL 0.02 in 10 steps."""


def _moe_config(family: str, common: dict, *, num_experts: int, top_k: int, moe_intermediate_size: int):
    """The transformers config of a tiny MoE of `family` (a key of MOE_FAMILIES)."""
    import transformers

    experts = {"num_experts_per_tok": top_k}

    def alternate(kind: str) -> list[str]:
        """`kind` layers with full attention every second layer, as Qwen3.5's and GPT-OSS's checkpoints mix them."""
        return [kind if i % 2 == 0 else "full_attention" for i in range(common["num_hidden_layers"])]
    # Group-limited routing (DeepSeek-V3, GLM-4.5): 2 groups, the best 1 of them; layer 0 dense, as the
    # families' first_k_dense_replace layers are; one shared expert.
    grouped = {"n_routed_experts": num_experts, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
               "n_shared_experts": 1, "moe_intermediate_size": moe_intermediate_size, "norm_topk_prob": True,
               "routed_scaling_factor": 2.5, "intermediate_size": 2 * common["hidden_size"]}
    configs = {
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
            **common, **experts, num_experts=num_experts, moe_intermediate_size=moe_intermediate_size,
            intermediate_size=2 * common["hidden_size"], norm_topk_prob=True),
        "qwen3_5_moe": lambda: transformers.Qwen3_5MoeTextConfig(
            **common, **experts, num_experts=num_experts, moe_intermediate_size=moe_intermediate_size,
            shared_expert_intermediate_size=moe_intermediate_size,
            layer_types=alternate("linear_attention"), linear_num_key_heads=2, linear_num_value_heads=2,
            linear_key_head_dim=16, linear_value_head_dim=16,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                             "mrope_section": [2, 1, 1]}),
        "glm4_moe": lambda: transformers.Glm4MoeConfig(**common, **experts, **grouped),
        # MLA: one key/value head per attention head (the kv_b_proj output), head sizes of its own.
        "deepseek_v3": lambda: transformers.DeepseekV3Config(
            **{k: v for k, v in common.items() if k not in ("head_dim", "num_key_value_heads")}, **experts, **grouped,
            num_key_value_heads=common["num_attention_heads"],
            q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=32,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        "gpt_oss": lambda: transformers.GptOssConfig(
            **common, **experts, num_local_experts=num_experts, intermediate_size=moe_intermediate_size,
            sliding_window=128, layer_types=alternate("sliding_attention"),
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        "mixtral": lambda: transformers.MixtralConfig(
            **common, **experts, num_local_experts=num_experts, intermediate_size=moe_intermediate_size),
    }
    return configs[family]()


MOE_FAMILIES = ("qwen3_moe", "qwen3_5_moe", "glm4_moe", "deepseek_v3", "gpt_oss", "mixtral")
"""Families `build_tiny_moe` builds (transformers model_type names)."""


def tiny_moe_config(
    family: str = "qwen3_moe",
    *,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    num_experts: int = 4,
    top_k: int = 2,
    moe_intermediate_size: int = 64,
    **tokens,
):
    """The transformers config of a tiny MoE of `family` (MOE_FAMILIES); `tokens`: eos/pad/bos token ids."""
    common = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim,
        max_position_embeddings=2048, tie_word_embeddings=True, **tokens,
    )
    return _moe_config(family, common, num_experts=num_experts, top_k=top_k,
                       moe_intermediate_size=moe_intermediate_size)


def build_tiny_moe(
    out_dir: str | Path,
    *,
    family: str = "qwen3_moe",
    vocab_size: int = 512,
    seed: int = 0,
    dtype: str = "float32",
    router_std: float = 0.5,
    **sizes,
) -> Path:
    """Build, save and return the directory of a random tiny MoE of `family` (MOE_FAMILIES) + tokenizer.

    `sizes` are `tiny_moe_config`'s (hidden_size, num_experts, num_kv_heads, ...). The router gets a
    larger init (`router_std`) than transformers' 0.02 so routing is not a coin toss between
    near-equal logits: tests compare routed runs across process layouts. A group-limited router's
    score-correction bias (a buffer) is random too, so loading it is checked.
    """
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size)
    config = tiny_moe_config(
        family, vocab_size=len(tokenizer), eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None, **sizes,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "mlp.router.weight")):
                p.normal_(0.0, router_std)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def build_tiny_teacher(out_dir: str | Path, student_dir: str | Path, *, reply: str = "a a a a a a a a",
                       steps: int = 10, lr: float = 1e-2) -> Path:
    """A teacher for on-policy distillation tests: the student at `student_dir` after `steps` AdamW steps of SFT
    on always answering `reply` (same tokenizer, a peaked and learnable difference). Two random tiny models are
    both near uniform over the vocabulary: too little for a sampled reverse KL to pull a student toward."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(student_dir)
    model = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    torch.manual_seed(0)
    for _ in range(steps):
        for question in ("Write the letter a.", "Say something."):
            prompt = [{"role": "user", "content": question}]
            start = len(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                      return_dict=True)["input_ids"])
            ids = tokenizer.apply_chat_template(prompt + [{"role": "assistant", "content": reply}], tokenize=True,
                                                return_tensors="pt", return_dict=True)["input_ids"][0]
            logits = model(input_ids=ids[None]).logits[0]
            torch.nn.functional.cross_entropy(logits[start - 1:-1], ids[start:]).backward()
        optimizer.step()
        optimizer.zero_grad()
    out = Path(out_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Build a tiny random model + tokenizer into DIR.")
    ap.add_argument("dir", nargs="?", default="/tmp/tiny-model")
    ap.add_argument("--moe", action="store_true", help="a Qwen3-MoE (4 experts, top-2) instead of dense Qwen3")
    ap.add_argument("--family", choices=MOE_FAMILIES, default=None, help="an MoE of this family (implies --moe)")
    ap.add_argument("--kv-heads", type=int, default=None, help="key/value heads")
    ap.add_argument("--lora", action="store_true", help=f"dense, embeddings x{LORA_EMBED_SCALE:g}: a base a LoRA "
                                                        "adapter can move (model.build_tiny: dense-lora)")
    ap.add_argument("--teacher-of", default=None, metavar="STUDENT",
                    help="a distillation teacher instead: the tiny model in STUDENT after a little SFT")
    args = ap.parse_args(argv)
    if args.teacher_of:
        print(build_tiny_teacher(args.dir, args.teacher_of))
        return
    kw = {} if args.kv_heads is None else {"num_kv_heads": args.kv_heads}
    if args.lora:
        kw["embed_scale"] = LORA_EMBED_SCALE
    if args.family:
        kw["family"] = args.family
    print((build_tiny_moe if args.moe or args.family else build_tiny_model)(args.dir, **kw))


if __name__ == "__main__":
    main()
