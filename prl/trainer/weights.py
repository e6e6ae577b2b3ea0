"""Publishing full weights in Hugging Face layout: weights/step_N/ + STABLE.

Every rank takes part in gathering the full state dict (an all-gather per
parameter, offloaded to CPU); rank 0 alone writes. The directory is what
`from_pretrained` and `vllm serve` load: safetensors (sharded with an index
above `max_shard_bytes`), config.json with the published dtype, and the
tokenizer / chat template / generation config copied from the model dir.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from prl.run.rundir import RunDir

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the full (unsharded) state dict on rank 0's CPU; empty on other ranks."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def drop_tied(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Remove keys that alias another weight (tied lm_head): HF stores them once."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    if not getattr(text, "tie_word_embeddings", False):
        return state
    tied = getattr(model, "_tied_weights_keys", None) or {}
    names = tied.keys() if isinstance(tied, dict) else tied
    return {k: v for k, v in state.items() if k not in set(names)}


def write_hf_dir(
    out: Path,
    state: dict[str, torch.Tensor],
    source_dir: str | Path,
    dtype: torch.dtype,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> None:
    """Write `state` as HF safetensors into `out`, with config/tokenizer files from `source_dir`."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in state.items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k in sorted(tensors):
        nbytes = tensors[k].numel() * tensors[k].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = tensors[k]
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata=meta)
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / name), metadata=meta)
            weight_map.update(dict.fromkeys(shard, name))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    for f in Path(source_dir).iterdir():
        if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(f, out / f.name)
    config = json.loads((Path(source_dir) / "config.json").read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    config.pop("torch_dtype", None)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def publish_weights(
    run: RunDir,
    step: int,
    model: torch.nn.Module,
    source_dir: str | Path,
    dtype: torch.dtype,
    is_main: bool,
) -> Path:
    """Collective: gather the full weights and (rank 0) publish weights/step_N atomically."""
    state = full_state_dict(model)
    dest = run.weights(step)
    if is_main:
        state = drop_tied(model, state)
        run.publish_dir(dest, lambda tmp: write_hf_dir(tmp, state, source_dir, dtype), step=step)
    return dest
