"""vLLM weight-transfer engine "prl_feed": a worker loads a step from the trainer ranks' weight feeds.

vLLM's part: the engine interface (`WeightTransferEngine`, created in each worker from
`--weight-transfer-config '{"backend": "prl_feed"}'`), the worker RPCs that drive it
(`start_weight_update`, `update_weights`, `finish_weight_update`) and the layerwise reload that
rebuilds each layer from checkpoint-format tensors. prl's part: the feed protocol and its key
(prl/run/feed.py), checking the step's names and shapes against the served checkpoint before any
weight is touched, and the CPU repacks a reload leaves out (worker.py).

    update_info = {"step": N, "feeds": ["host:port", ...]}   one feed per trainer rank
                  [+ "group": {"token": hex, "world": W, "rank": R, "timeout": s}]   a broadcast group,
                                                                 this server's workers at ranks R, R+1, ...

Each worker opens every feed (the run's key comes from API_KEY_VAR in its environment, inherited
from the server process) and checks that the feeds' headers together name exactly the served
tensors; only then is the model touched, so a refused key or a wrong step leaves the old weights
serving. With a group (`weights.transport: broadcast`, prl/run/collective.py) each feed's header comes
the same way, and its tensors by broadcast, once the group has formed (also before the model is
touched). The tensors then stream into `model.load_weights`, every feed read by a thread of its own
while the reload works on what arrived (`read_concurrently`, at most READ_AHEAD_BYTES ahead).
`report` says what the last update did, so the server can tell an update refused before loading
from one that failed part-way.
"""

from __future__ import annotations

import os
import time

import torch
from dataclasses import dataclass, field

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

from prl.errors import ConfigError
from prl.inference.checks import UpdateRefused, checkpoint_layout, compare_layouts
from prl.inference.worker import check_reloaded, repack_after_reload, tied_lm_head, unloaded_layers
from prl.run.collective import Group
from prl.run.feed import Base, FeedReader, read_concurrently
from prl.run.rundir import API_KEY_VAR

BACKEND = "prl_feed"
FEED_TIMEOUT_S = 120.0
"""Longest silence of a feed before the update fails (a lost trainer rank must not hang the engine)."""


@dataclass
class FeedInitInfo(WeightTransferInitInfo):
    """Nothing: the feeds are named by each update."""


@dataclass
class FeedUpdateInfo(WeightTransferUpdateInfo):
    step: int
    feeds: list[str] = field(default_factory=list)
    group: dict | None = None
    """A broadcast group ({"token", "world", "rank"}: this server's first rank), one per feed, or None."""


class FeedEngine(WeightTransferEngine[FeedInitInfo, FeedUpdateInfo]):
    init_info_cls = FeedInitInfo
    update_info_cls = FeedUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.report: dict = {}
        """The last update: {"step", "touched", "tensors", "bytes", "received", "delta", "group", "seconds"
        [, "error"]}:
        `bytes` loaded, `received` read off the sockets (less with deltas)."""
        self._reloading = False
        self._kept: dict[str, Base] = {}
        """By feed address, the last snapshot loaded from it, kept whole where the feed computes deltas
        (`weights.delta`): the next step then comes as what changed, rebuilt on copies of these. A
        model's worth of CPU memory per worker; replaced only by a complete load."""

    def init_transfer_engine(self, init_info: FeedInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        self.report = {"step": None, "touched": False, "tensors": 0, "bytes": 0, "received": 0, "delta": False,
                       "group": False, "seconds": 0.0}

    def update_weights(self, update_info: dict) -> None:
        """vLLM's update without its `torch.accelerator.synchronize()` (it raises on a CPU-only torch)."""
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, info: FeedUpdateInfo) -> None:
        start = time.perf_counter()
        self.report["step"] = info.step
        readers: list[FeedReader] = []
        try:
            key = os.environ.get(API_KEY_VAR, "").strip()
            if not key:
                raise ConfigError(f"{API_KEY_VAR} is not set in the worker's environment: "
                                  "start the server with --api-key-env to read weight feeds")
            group = self._group(info.group)
            readers = [FeedReader(address, info.step, key.encode(), FEED_TIMEOUT_S, self._kept.get(address), group)
                       for address in info.feeds]
            self.report["delta"] = any(r.delta for r in readers)
            self._check_layout(readers, info)
            initialize_layerwise_reload(self.model)
            self._reloading = self.report["touched"] = True
            # Keep what was read only where a feed sends deltas: otherwise each tensor is freed once its layer
            # is reloaded, as before, instead of a model's worth staying alive until the update ends.
            got: dict[str, torch.Tensor] | None = {} if any(r.keep for r in readers) else None
            with disable_mtp_completeness_check():
                self.model.load_weights(self._counted(read_concurrently(readers), got))
            self._kept = {r.address: Base(r.id, {m.name: got[m.name] for m in r.tensors})
                          for r in readers if r.keep}
            self.report["received"] = sum(r.received for r in readers)
        except BaseException as e:
            self.report["error"] = f"{type(e).__name__}: {e}"
            for reader in readers:
                reader.close()
            if self._reloading:
                # vLLM's worker ends the session on an error without calling finish: leave no layer on meta (the
                # layers the cut stream did not reach keep their old values; the error raised is this one).
                self._finish(check=False)
            raise
        finally:
            self.report["seconds"] = time.perf_counter() - start

    def _group(self, asked: dict | None) -> Group | None:
        """This worker's member of the update's group: the server's first rank + its own rank in the server."""
        if asked is None:
            return None
        from vllm.distributed.parallel_state import get_world_group

        self.report["group"] = True
        return Group(asked["token"], asked["world"], asked["rank"] + get_world_group().rank_in_group,
                     asked["timeout"])

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

    def _counted(self, tensors, got: dict | None):
        for name, tensor in tensors:
            self.report["tensors"] += 1
            self.report["bytes"] += tensor.numel() * tensor.element_size()
            if got is not None:
                got[name] = tensor
            yield name, tensor

    def _check_layout(self, readers: list[FeedReader], info: FeedUpdateInfo) -> None:
        """The feeds together hold each served tensor once, in its served shape (a layer that received
        nothing would keep its old weights with only a warning)."""
        got: dict[str, tuple[int, ...]] = {}
        for reader in readers:
            for meta in reader.tensors:
                if meta.name in got:
                    raise UpdateRefused(422, f"step {info.step}: {meta.name} is in more than one feed "
                                             f"({reader.address} and another)")
                got[meta.name] = meta.shape
        compare_layouts(self._served_layout(), got, f"step {info.step} from {', '.join(info.feeds)}")

    def _served_layout(self) -> dict[str, tuple[int, ...]]:
        return checkpoint_layout(self.model_config.model)
