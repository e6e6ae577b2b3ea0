"""`weights.transport: filesystem`: every step published to RUN/weights/step_N, and each server reads it back.

    trainer        no sender: every step is published (prl/trainer/weights.py, `publish_weights`)
    orchestrator   the newest STABLE step: WeightsRequest(step=N)
    server         `resolve_weights_dir`: a published directory under RUN/weights/ (403 outside it, 409 before
                   its STABLE marker), its safetensors laid out as the served model (422); then every worker
                   reloads from it (`prl_load_weights`, prl/inference/worker.py)

The same request shape (`{"step": N}` or `{"path": DIR}`) is what every transport's durable steps use, and what a
user may POST by hand; a LoRA adapter step (PEFT's adapter_config.json) is loaded by the server under the served
model's name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from prl.run.api import WeightsRequest
from prl.run.rundir import RunDir, is_stable, step_of
from prl.weights.layout import ADAPTER_CONFIG, UpdateRefused, checkpoint_layout, compare_layouts, weight_files
from prl.weights.transport import Target, Transport, register

LOAD_RPC = "prl_load_weights"
"""The worker method (prl/inference/worker.py `WeightUpdater`) that reloads a model directory in place."""


@dataclass(frozen=True)
class WeightsTarget(Target):
    """A published weights directory a server may load."""

    path: Path
    """Resolved (realpath) directory under RUN/weights/."""
    step: Optional[int]
    """Policy version, from the directory name step_N (None for another name)."""
    adapter: bool = False
    """A LoRA adapter (PEFT's adapter_config.json + adapter_model.safetensors), not a whole model."""

    durable = True

    @property
    def origin(self) -> str:
        return str(self.path)

    def describe(self) -> str:
        return str(self.path)

    async def load(self, engine) -> tuple[float, dict]:
        results = await engine.collective_rpc(LOAD_RPC, args=(str(self.path),))
        await engine.update_weight_version(str(self.step or 0))  # vLLM's stamp on outputs, as a feed update sets it
        return max(r["seconds"] for r in results), {"worker_bytes": [r["read"] for r in results]}

    async def untouched(self, engine) -> bool:
        return self.adapter  # the engine refuses an adapter whole; a model reloads layer by layer as it reads


def _inside(path: Path, root: Path) -> bool:
    return path != root and os.path.commonpath([str(path), str(root)]) == str(root)


def resolve_weights_dir(run: RunDir, request: WeightsRequest) -> WeightsTarget:
    """The directory a `{"step": N}` or `{"path": DIR}` request names, or `UpdateRefused` (400/403/409)."""
    if (request.step is None) == (request.path is None) or request.feeds is not None or request.groups is not None:
        raise UpdateRefused(400, 'a request from the run directory names exactly one of "step" (int) or "path" '
                                 '(str), and no "feeds" or "groups"')
    root = run.weights_root()
    requested = run.weights(request.step) if request.step is not None else Path(request.path)
    real = Path(os.path.realpath(requested))
    if not _inside(real, root):
        raise UpdateRefused(403, f"refused: {str(requested)!r} resolves to {str(real)!r}, "
                                 f"which is not a directory under this run's weights dir {str(root)!r}")
    if not is_stable(real):  # False, not an error, for a name too long for the filesystem
        raise UpdateRefused(409, f"{real} is not published (no STABLE marker yet); "
                                 f"latest published step: {run.latest_stable('weights')}")
    for f in weight_files(real):
        if not _inside(Path(os.path.realpath(f)), root):
            raise UpdateRefused(403, f"refused: weight file {f} links outside {root}")
    return WeightsTarget(real, step_of(real), adapter=(real / ADAPTER_CONFIG).is_file())


class Filesystem(Transport):
    name = "filesystem"
    summary = "every step written to RUN/weights/step_N, each server's workers read it back"

    def check(self, topo, fail, gpus: bool = False) -> None:
        if topo.weights.delta:
            raise fail(("weights", "delta"), "deltas are sent by the weight feeds: set weights.transport: memory "
                                             "(or broadcast), or remove weights.delta")

    def target(self, run: RunDir, request: WeightsRequest, *, layout: Optional[dict], lora: bool,
               workers: int = 1) -> WeightsTarget:
        """The published directory, laid out as the served model (an adapter: readable safetensors; vLLM checks
        an adapter's names as it loads), of the kind the server serves (adapters with --enable-lora)."""
        target = resolve_weights_dir(run, request)
        if target.adapter != lora:
            raise UpdateRefused(409, f"{target.path} is {'a LoRA adapter' if target.adapter else 'a whole model'}; "
                                     f"this server {'serves adapters (--enable-lora)' if lora else 'runs without --enable-lora'}")
        if layout is not None and not target.adapter:
            compare_layouts(layout, checkpoint_layout(target.path), target.path)
        else:
            checkpoint_layout(target.path)
        return target


FILESYSTEM = register(Filesystem())


def read_step(path: str | Path, plan: dict | None = None, counted: list | None = None):
    """(name, tensor) for every tensor of a model directory, file by file, in name order: with `plan` (name ->
    prl.weights.slices.Slice or WHOLE, a worker's), only the bytes of each tensor's slice are read from the file
    (a memory map touches only the pages the slice lies in), placed in a tensor of the checkpoint's shape whose
    rest is never written (vLLM's loaders read only the slice). `counted` (a list) gets the bytes read."""
    import numpy as np
    import torch

    from prl.weights.layout import SAFETENSORS_DTYPES, read_entries

    for file in weight_files(path):
        start, entries = read_entries(file)
        data = np.memmap(file, dtype=np.uint8, mode="r")
        for name in sorted(entries):
            entry = entries[name]
            dtype, shape = getattr(torch, SAFETENSORS_DTYPES[entry["dtype"]]), tuple(entry["shape"])
            begin, end = entry["data_offsets"]
            raw = data[start + begin:start + end].reshape(*shape, dtype.itemsize)
            cut = None if plan is None else plan.get(name)
            piece_shape = shape if cut is None else tuple(cut.end - cut.start if i == cut.dim else n
                                                          for i, n in enumerate(shape))
            window = raw if cut is None else raw[(slice(None),) * cut.dim + (slice(cut.start, cut.end),)]
            piece = torch.from_numpy(np.array(window)).view(dtype).reshape(piece_shape)  # a copy: the map is not ours
            if counted is not None:
                counted.append(piece.numel() * dtype.itemsize)
            if cut is None:
                yield name, piece
                continue
            whole = torch.empty(shape, dtype=dtype)
            whole.narrow(cut.dim, cut.start, cut.end - cut.start).copy_(piece)
            yield name, whole
