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

import functools
import json
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from prl.errors import StaleReload
from prl.inference.server import WEIGHT_BACKEND
from prl.log import get_logger
from prl.weights.filesystem import read_step
from prl.weights.layout import checkpoint_layout
from prl.weights.slices import place, slice_plan

log = get_logger(__name__)

# vLLM imports this module by name in every worker before it loads the model (and creates the engine
# named by --weight-transfer-config); a spawned worker does not inherit the parent's registry.
if WEIGHT_BACKEND not in WeightTransferEngineFactory._registry:
    WeightTransferEngineFactory.register_engine(WEIGHT_BACKEND, "prl.inference.weight_engine", "TransportEngine")


def iter_safetensors(path: str | Path) -> Iterator[tuple[str, "torch.Tensor"]]:  # noqa: F821
    """(name, tensor) for every tensor of a model directory, file by file, in name order, whole."""
    return read_step(path)


def slices_of(path: str | Path, vllm_config) -> dict:
    """What this worker keeps of each tensor of the model directory `path` (prl/weights/slices.py)."""
    config = json.loads((Path(path) / "config.json").read_text())
    return slice_plan(config, checkpoint_layout(path), place(vllm_config))


class WeightUpdater:
    """Methods vLLM mixes into its Worker class (`self` is the worker)."""

    def prl_load_weights(self, path: str) -> dict:
        """Load the HF checkpoint at `path` into this worker's model, in place, reading only the bytes of each
        tensor this worker keeps (its slices); "read": those bytes."""
        start, read = time.perf_counter(), []
        with unloaded_layers() as failed:
            self.reload_weights(weights_iterator=read_step(path, slices_of(path, self.vllm_config), read),
                                is_checkpoint_format=True)
        repacked = repack_after_reload(self.model_runner.get_model())
        check_reloaded(failed, tied_lm_head(self.model_config))
        return {"rank": getattr(self, "rank", 0), "seconds": time.perf_counter() - start, "repacked": repacked,
                "read": sum(read)}

    def prl_transfer_report(self) -> dict:
        """What this worker's last update through the weight-transfer engine did (prl/inference/weight_engine.py
        `report`)."""
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

    def prl_capture_routes(self) -> dict:
        """Start recording which experts every MoE layer routes each token of a `prl-gen-` request to
        (`RouteCapture`); the capture's shape. Idempotent."""
        capture = getattr(self, "_prl_routes", None)
        if capture is None:
            capture = self._prl_routes = RouteCapture.install(self.model_runner, self.vllm_config)
        return {"layers": capture.layers, "top_k": capture.top_k, "dtype": capture.dtype}

    def prl_take_routes(self, request_id: str, n: int, start: int) -> list[dict | None] | None:
        """The routes of request `request_id`'s `n` completions from token `start` on (`RouteCapture.take`),
        forgotten here once taken; None on every worker but the first of its tensor-parallel group (they
        captured the same routes)."""
        from vllm.distributed.parallel_state import get_tp_group

        capture = getattr(self, "_prl_routes", None)
        if capture is None or not get_tp_group().is_first_rank:
            return None
        return capture.take(request_id, n, start)

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
        raise StaleReload(f"vLLM's reload loaded none of the new weights of {', '.join(stale)} and kept their "
                                f"old values: this server cannot take weight updates of this model (it would serve a "
                                f"mix of two steps)")


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


ROUTED_PREFIX = "prl-gen-"
"""Requests whose routes `RouteCapture` keeps: those of prl's generate route (prl/inference/generate.py)."""
MAX_UNTAKEN_ROUTES = 1024
"""Finished requests whose routes a capture keeps for the API process to take; the oldest go beyond."""
_ENGINE_ID = re.compile(r"(?:(\d+)_)?(.*)-[0-9A-Za-z]{8}")
"""An engine request id: vLLM appends `-` and 8 random characters to the id it was given, and names the
i-th of `n` completions `i_<id>`."""


@functools.lru_cache(maxsize=4096)
def _owner(rid: str) -> tuple[str, int] | None:
    """(the id the generate route gave, completion index) of an engine request id of prl's generate route; None
    for any other request. Cached: every step asks it of every request it runs."""
    m = _ENGINE_ID.fullmatch(rid)
    return (m.group(2), int(m.group(1) or 0)) if m and m.group(2).startswith(ROUTED_PREFIX) else None


class RouteCapture:
    """The experts each MoE layer routed every token of every generate request to, for router replay.

    vLLM 0.32 returns routed experts (`--enable-return-routed-experts`) only from its GPU Model Runner V2; the
    CPU runner, and the V1 runner prl's worker extension runs in, refuse it. This capture uses vLLM's own
    hook instead: `bind_routed_experts_capturer` gives every MoE router a callback with its layer's top-k
    expert ids, which `capture` writes into a preallocated [max tokens, layers, k] buffer (a fixed buffer, as
    vLLM's own capturer, so a captured CUDA graph writes to it too). After each model step (`execute_model`
    wrapped) the step's rows are split among its requests, in the order the runner laid them out, and put at
    their tokens' positions. A request's rows cover every token that went through the model, so the server
    runs without a prefix cache (cached tokens never would): `split_args` turns it off.

    Rows are kept per request until `take`; at most MAX_UNTAKEN_ROUTES finished requests wait.
    """

    def __init__(self, model_runner, layers: int, top_k: int, num_experts: int, max_tokens: int, device) -> None:
        import numpy as np
        import torch

        self.model_runner = model_runner
        self.layers, self.top_k = layers, top_k
        self.dtype = "uint8" if num_experts <= 256 else "uint16"
        self._np_dtype = np.dtype(self.dtype)
        self.buffer = torch.zeros((max_tokens, layers, top_k), dtype=torch.int32, device=device)
        self.rows: dict[str, np.ndarray] = {}
        """Engine request id -> its rows so far [positions, layers, k]."""
        self.length: dict[str, int] = {}
        """Engine request id -> how many positions of its rows are filled."""
        self.finished: OrderedDict[str, None] = OrderedDict()
        self.dropped = 0
        self.broken: set[str] = set()
        """Requests a step left without routes (its layout was not the one expected): `take` gives them none."""
        self.seen: int | None = None
        """The fewest rows a router handed `capture` in the step running (None: none yet)."""

    @classmethod
    def install(cls, model_runner, vllm_config) -> "RouteCapture":
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import bind_routed_experts_capturer

        mc = vllm_config.model_config
        layers, top_k, experts = mc.get_total_num_hidden_layers(), mc.get_num_experts_per_tok(), mc.get_num_experts()
        if layers <= 0 or top_k <= 0 or experts <= 0:
            raise ValueError(f"routed experts: {mc.model} is not a mixture-of-experts model "
                             f"(layers {layers}, experts {experts}, top-k {top_k})")
        if vllm_config.parallel_config.data_parallel_size > 1:
            # Routers then see other DP ranks' tokens too (vLLM's own capturer untangles its dispatch layouts).
            raise ValueError("routed experts: not with data parallelism (--data-parallel-size > 1)")
        capture = cls(model_runner, layers, top_k, experts, vllm_config.scheduler_config.max_num_batched_tokens,
                      model_runner.device)
        bind_routed_experts_capturer(model_runner.get_model(), capture)
        step = model_runner.execute_model

        def execute_model(scheduler_output, *args, **kwargs):
            capture.seen = None  # a dummy run between steps (warm-up, profiling) does not count
            out = step(scheduler_output, *args, **kwargs)
            capture.after_step(scheduler_output)
            return out

        model_runner.execute_model = execute_model
        return capture

    def capture(self, layer_id: int, topk_ids) -> None:
        """vLLM's router callback: this step's top-k expert ids [tokens, k] of layer `layer_id`."""
        n = topk_ids.shape[0]
        self.buffer[:n, layer_id] = topk_ids
        self.seen = n if self.seen is None else min(self.seen, n)

    def after_step(self, scheduler_output) -> None:
        """File the step's rows under their requests (the runner's row order), then retire finished requests."""
        import numpy as np

        scheduled = scheduler_output.num_scheduled_tokens
        total = int(scheduler_output.total_num_scheduled_tokens)
        if total:
            start = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
            cached = scheduler_output.scheduled_cached_reqs
            start |= dict(zip(cached.req_ids, cached.num_computed_tokens))
            order = [r for r in self.model_runner.input_batch.req_ids if r in scheduled]
            if sum(scheduled[r] for r in order) != total or self.seen is None or self.seen < total:
                log.warning("routed experts: a step's %d rows (routers saw %s) do not match its requests %s; "
                            "they get no routes", total, self.seen, order)
                self.broken.update(scheduled)
            else:
                rows = self.buffer[:total].to("cpu").numpy().astype(self._np_dtype)
                offset = 0
                for rid in order:
                    n = scheduled[rid]
                    if _owner(rid) is not None:
                        self._put(rid, int(start[rid]), rows[offset:offset + n])
                    offset += n
        self.seen = None
        for rid in scheduler_output.finished_req_ids:
            if rid in self.rows:
                self.finished[rid] = None
            elif rid in self.broken:
                self.broken.discard(rid)
        while len(self.finished) > MAX_UNTAKEN_ROUTES:
            rid, _ = self.finished.popitem(last=False)
            self.rows.pop(rid, None)
            self.length.pop(rid, None)
            self.broken.discard(rid)
            self.dropped += 1

    def _put(self, rid: str, at: int, rows) -> None:
        import numpy as np

        have = self.rows.get(rid)
        end = at + rows.shape[0]
        if have is None or have.shape[0] < end:
            grown = np.zeros((max(end, 2 * (0 if have is None else have.shape[0])), self.layers, self.top_k),
                             dtype=self._np_dtype)
            if have is not None:
                grown[: have.shape[0]] = have
            self.rows[rid] = have = grown
        have[at:end] = rows
        # A preempted request is recomputed from 0: its length is where the newest rows end.
        self.length[rid] = end

    def take(self, request_id: str, n: int, start: int) -> list[dict | None]:
        """Completion i of `n` of the external request `request_id`: its rows from position `start` to its
        last computed token, as {"data": bytes, "shape", "dtype", "start"} (None: none captured)."""
        found = {owner[1]: rid for rid in self.rows if (owner := _owner(rid)) is not None and owner[0] == request_id}
        out: list[dict | None] = []
        for i in range(n):
            rid = found.get(i)
            rows = self.rows.pop(rid, None) if rid is not None else None
            length = self.length.pop(rid, 0) if rid is not None else 0
            self.finished.pop(rid, None)
            if rid in self.broken:
                self.broken.discard(rid)
                rows = None
            if rows is None or start >= length:
                out.append(None)
                continue
            part = rows[start:length]
            out.append({"data": part.tobytes(), "shape": list(part.shape), "dtype": self.dtype, "start": start})
        return out
