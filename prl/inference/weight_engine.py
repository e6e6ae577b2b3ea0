"""vLLM weight-transfer engine "prl": a worker loads a step the run's weight transport sends it (prl/weights).

vLLM's part: the engine interface (`WeightTransferEngine`, created in each worker from
`--weight-transfer-config '{"backend": "prl"}'`), the worker RPCs that drive it
(`start_weight_update`, `update_weights`, `finish_weight_update`) and the layerwise reload that
rebuilds each layer from checkpoint-format tensors. The transport's part (`Transport.receive`, e.g.
prl/weights/memory.py): opening the step with the run's key and saying which tensors it holds, then streaming
them. prl's part here: checking those names and shapes against the served checkpoint before any weight is
touched, and the CPU repacks a reload leaves out (worker.py).

    update_info = the WeightsRequest the server was sent (prl/run/api.py), e.g.
                  {"transport": "memory", "step": N, "feeds": ["host:port", ...]}

The run's key comes from API_KEY_VAR in the worker's environment, inherited from the server process. A step
whose tensors are not the served ones, or a transport that refuses (a wrong key, another step, a group that
does not form), fails before the model is touched, so the old weights keep serving. `report` says what the last
update did, so the server can tell an update refused before loading from one that failed part-way.
"""

from __future__ import annotations

import os
import time

import msgspec
import torch
from dataclasses import dataclass

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
from vllm.model_executor.model_loader.reload import (
    finalize_layerwise_reload,
    initialize_layerwise_reload,
)

from prl import weights
from prl.errors import ConfigError
from prl.inference.worker import check_reloaded, repack_after_reload, tied_lm_head, unloaded_layers
from prl.run.api import WeightsRequest
from prl.run.rundir import API_KEY_VAR
from prl.weights.layout import UpdateRefused, checkpoint_layout, compare_layouts
from prl.weights.slices import place

@dataclass
class NoInitInfo(WeightTransferInitInfo):
    """Nothing: each update names where its step comes from."""


@dataclass
class RequestInfo(WeightTransferUpdateInfo):
    """An update: the server's WeightsRequest, as the transport's `receive` reads it."""

    request: WeightsRequest


class TransportEngine(WeightTransferEngine[NoInitInfo, RequestInfo]):
    init_info_cls = NoInitInfo
    update_info_cls = RequestInfo
    supports_draft_weight_update = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.report: dict = {}
        """The last update: {"step", "touched", "tensors", "bytes", "received", "delta", "group", "seconds"
        [, "error"]}: `bytes` loaded, `received` read off the sockets (less with deltas)."""
        self._reloading = False
        self._kept: dict = {}
        """What the transport keeps between steps (the memory transports: by feed address, the last snapshot
        loaded from it where the feed computes deltas, `weights.delta`; a model's worth of CPU memory per
        worker); replaced only by a complete load."""

    def init_transfer_engine(self, init_info: NoInitInfo) -> None:
        pass

    def parse_update_info(self, update_dict: dict) -> RequestInfo:
        try:
            return RequestInfo(msgspec.convert(update_dict, WeightsRequest))
        except msgspec.ValidationError as e:
            raise UpdateRefused(400, f"not a WeightsRequest: {e}") from None

    def start_weight_update(self) -> None:
        self.report = {"step": None, "touched": False, "tensors": 0, "bytes": 0, "received": 0, "delta": False,
                       "group": False, "seconds": 0.0}

    def update_weights(self, update_info: dict) -> None:
        """vLLM's update without its `torch.accelerator.synchronize()` (it raises on a CPU-only torch)."""
        self.receive_weights(self.parse_update_info(update_info).request)

    def receive_weights(self, request: WeightsRequest) -> None:
        from vllm.distributed.parallel_state import get_world_group

        start = time.perf_counter()
        self.report.update(step=request.step, group=request.groups is not None)
        reception = None
        try:
            key = os.environ.get(API_KEY_VAR, "").strip()
            if not key:
                raise ConfigError(f"{API_KEY_VAR} is not set in the worker's environment: start the server with "
                                  "--api-key-env to load weights the trainer sends")
            reception = weights.get(request.transport).receive(request, key.encode(), get_world_group().rank_in_group,
                                                               self._kept, place(self.vllm_config))
            self.report["delta"] = reception.delta
            compare_layouts(self._served_layout(), reception.layout,
                            f"step {request.step} by {request.transport}")
            initialize_layerwise_reload(self.model)
            self._reloading = self.report["touched"] = True
            with disable_mtp_completeness_check():
                self.model.load_weights(self._counted(reception.tensors()))
            self._kept = reception.kept()
            self.report["received"] = reception.received
        except BaseException as e:
            self.report["error"] = f"{type(e).__name__}: {e}"
            if reception is not None:
                reception.close()
            if self._reloading:
                # vLLM's worker ends the session on an error without calling finish: leave no layer on meta (the
                # layers the cut stream did not reach keep their old values; the error raised is this one).
                self._finish(check=False)
            raise
        finally:
            self.report["seconds"] = time.perf_counter() - start

    def finish_weight_update(self) -> None:
        if self._reloading:
            self._finish()

    def shutdown(self) -> None:
        pass

    def _finish(self, check: bool = True) -> None:
        self._reloading = False
        with unloaded_layers() as failed:
            finalize_layerwise_reload(self.model, self.model_config)
        repack_after_reload(self.model)
        if check:
            check_reloaded(failed, tied_lm_head(self.model_config))

    def _counted(self, tensors):
        for name, tensor in tensors:
            self.report["tensors"] += 1
            self.report["bytes"] += tensor.numel() * tensor.element_size()
            yield name, tensor

    def _served_layout(self) -> dict[str, tuple[int, ...]]:
        return checkpoint_layout(self.model_config.model)

