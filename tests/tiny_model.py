"""A tiny Qwen3-style causal LM and a byte-level BPE tokenizer, built in-process.

No model hub is reachable from CI, so tests (trainer, and later vLLM) build
their model here and save it to a directory that `from_pretrained` and
`vllm serve` both accept. head_dim is 32: vLLM's CPU attention backend
refuses head sizes below 32.

    from tests.tiny_model import build_tiny_model
    path = build_tiny_model(tmp_path / "model")
    moe = build_tiny_moe(tmp_path / "moe")       # Qwen3-MoE: 4 experts, top-2
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
) -> Path:
    """Build, save and return the directory of a random tiny Qwen3 model + tokenizer."""
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
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def build_tiny_moe(
    out_dir: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    num_experts: int = 4,
    top_k: int = 2,
    moe_intermediate_size: int = 64,
    vocab_size: int = 512,
    seed: int = 0,
    dtype: str = "float32",
    router_std: float = 0.5,
) -> Path:
    """Build, save and return the directory of a random tiny Qwen3-MoE model + tokenizer.

    The router gets a larger init (`router_std`) than transformers' 0.02 so routing is not a
    coin toss between near-equal logits: tests compare routed runs across process layouts.
    """
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size)
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        moe_intermediate_size=moe_intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, router_std)
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


if __name__ == "__main__":  # pragma: no cover - manual use
    import argparse

    ap = argparse.ArgumentParser(description="Build a tiny random model + tokenizer into DIR.")
    ap.add_argument("dir", nargs="?", default="/tmp/tiny-model")
    ap.add_argument("--moe", action="store_true", help="a Qwen3-MoE (4 experts, top-2) instead of dense Qwen3")
    ap.add_argument("--kv-heads", type=int, default=None, help="key/value heads (cp must divide them)")
    ap.add_argument("--teacher-of", default=None, metavar="STUDENT",
                    help="a distillation teacher instead: the tiny model in STUDENT after a little SFT")
    args = ap.parse_args()
    if args.teacher_of:
        print(build_tiny_teacher(args.dir, args.teacher_of))
        raise SystemExit(0)
    kw = {} if args.kv_heads is None else {"num_kv_heads": args.kv_heads}
    print((build_tiny_moe if args.moe else build_tiny_model)(args.dir, **kw))
