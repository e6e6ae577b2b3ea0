"""Worker-side weight loading, mixed into every vLLM worker.

`python -m prl.inference` passes `--worker-extension-cls
prl.inference.worker.WeightUpdater`; vLLM adds this class to each worker's
bases, and the API process calls `engine_client.collective_rpc(
"prl_load_weights", args=(dir,))` to run it on every worker (all TP/PP/DP
ranks) at once.

The load goes through vLLM's in-place reload (`Worker.reload_weights`, the
layer-wise helpers in `model_executor/model_loader/reload/`): each layer is
rebuilt from checkpoint-format tensors and re-processed (quantization,
CPU repacking), then copied into the original storage so captured graphs
keep pointing at it. A plain `model.load_weights` is not enough on the CPU
backend: linear weights were repacked into oneDNN handles at load time and
the parameters left empty, so new values would never reach the kernels.

One CPU-specific gap remains: a tied `lm_head` receives no tensor of its own
(the checkpoint stores the embedding once), so the reload puts its old
parameter back without re-running its processing, and on CPU that
processing is what builds the packed GEMM weight the logits use. We re-run
it for every unquantized `ParallelLMHead` after the reload. On GPU the tied
head reads the shared parameter directly, so nothing extra is needed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from prl.inference.checks import weight_files
from prl.inference.server import FEED_BACKEND

# vLLM imports this module by name in every worker before it loads the model (and creates the engine
# named by --weight-transfer-config); a spawned worker does not inherit the parent's registry.
if FEED_BACKEND not in WeightTransferEngineFactory._registry:
    WeightTransferEngineFactory.register_engine(FEED_BACKEND, "prl.inference.feed_engine", "FeedEngine")


def iter_safetensors(path: str | Path) -> Iterator[tuple[str, "torch.Tensor"]]:  # noqa: F821
    """(name, tensor) for every tensor of a model directory, file by file, in name order."""
    from safetensors import safe_open

    for f in weight_files(path):
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name in sorted(sf.keys()):
                yield name, sf.get_tensor(name)


class WeightUpdater:
    """Methods vLLM mixes into its Worker class (`self` is the worker)."""

    def prl_load_weights(self, path: str) -> dict:
        """Load the HF checkpoint at `path` into this worker's model, in place."""
        start = time.perf_counter()
        with unloaded_layers() as failed:
            self.reload_weights(weights_iterator=iter_safetensors(path), is_checkpoint_format=True)
        repacked = repack_after_reload(self.model_runner.get_model())
        check_reloaded(failed, tied_lm_head(self.model_config))
        return {"rank": getattr(self, "rank", 0), "seconds": time.perf_counter() - start, "repacked": repacked}

    def prl_feed_report(self) -> dict:
        """What this worker's last weight-feed update did (prl/inference/feed_engine.py `report`)."""
        return {"rank": getattr(self, "rank", 0), **getattr(self.weight_transfer_engine, "report", {})}

    def prl_end_weight_update(self) -> bool:
        """End a weight-transfer session a failed update left open; whether one was open. vLLM's worker closes
        the session when `update_weights` raises, but not when `finish_weight_update` does: every later
        `start_weight_update` would then refuse ("already active") until the server restarts."""
        if not getattr(self, "_weight_update_active", False):
            return False
        self._weight_update_active = False
        self.weight_transfer_engine.reset_weight_update_target()
        return True

    def prl_weight_checksum(self, names: list[str]) -> dict[str, float]:
        """Sum of each named parameter (vLLM names) on this worker; for tests and debugging."""
        params = dict(self.model_runner.get_model().named_parameters())
        return {n: float(params[n].float().sum()) for n in names if n in params and params[n].numel() > 0}


LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
"""vLLM's layerwise reload logs "<layer class>: Failed to load weights" for each layer that had weights to load and
got none, and puts that layer's old tensors back."""


@contextmanager
def unloaded_layers() -> Iterator[list[str]]:
    """The classes of the layers vLLM's layerwise reload reported as not loaded while the block ran."""
    failed: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if message.endswith(": Failed to load weights"):
                failed.append(message.rpartition(":")[0])

    logger, handler = logging.getLogger(LAYERWISE_LOGGER), Catch(logging.WARNING)
    level = logger.level
    if logger.getEffectiveLevel() > logging.WARNING:  # VLLM_LOGGING_LEVEL=ERROR must not blind the check
        logger.setLevel(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield failed
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def check_reloaded(failed: list[str], tied_lm_head: bool) -> None:
    """Refuse a reload that left trained weights at their old values: the server would serve a mix of two steps.
    Allowed: rotary embeddings (buffers rebuilt from the config, nothing in a checkpoint) and a tied lm_head (no
    tensor of its own; `repack_after_reload` rebuilds it from the embedding). GPT-OSS in vLLM 0.32 is the case
    met: its load_weights writes the attention sinks and the experts' biases outside the loaders the reload
    tracks ("OAIAttention", "GptOssRoutedExperts")."""
    stale = sorted({name for name in failed if not name.endswith("RotaryEmbedding")
                    and not (name == "ParallelLMHead" and tied_lm_head)})
    if stale:
        raise RuntimeError(f"vLLM's reload loaded none of the new weights of {', '.join(stale)} and kept their old "
                           f"values: this server cannot take weight updates of this model (it would serve a mix of "
                           f"two steps)")


def tied_lm_head(model_config) -> bool:
    return bool(getattr(model_config.hf_text_config, "tie_word_embeddings", False))


def repack_after_reload(model) -> int:
    """The CPU repacks a layerwise reload leaves out (see the module docstring); how many layers."""
    from vllm.platforms import current_platform

    return _reprocess_lm_heads(model) + _reprocess_fused_experts(model) if current_platform.is_cpu() else 0


def _reprocess_fused_experts(model) -> int:
    """Rebuild the CPU kernels' packed expert weights of every fused-MoE layer from its reloaded w13/w2.

    The CPU MoE kernel packs expert weights once, at first load; a reload writes the parameters but the
    kernel would keep computing with the old packed copy (checked: served logprobs were off by 0.055
    after an expert-only update, and within 5e-7 of transformers with this).
    """
    count = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None and hasattr(module, "w13_weight"):
            kernel.fused_experts.process_weights_after_loading(module)
            count += 1
    return count


def _reprocess_lm_heads(model) -> int:
    """Rebuild the CPU GEMM handle of every unquantized LM head from its (possibly tied) weight."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        UnquantizedEmbeddingMethod,
    )

    count = 0
    for module in model.modules():
        if (isinstance(module, ParallelLMHead)
                and isinstance(getattr(module, "quant_method", None), UnquantizedEmbeddingMethod)
                and not module.weight.is_meta):
            module.quant_method.process_weights_after_loading(module)
            count += 1
    return count
