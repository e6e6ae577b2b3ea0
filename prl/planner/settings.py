"""The user's own settings that every role needs, carried by the Plan as the topology's schemas.

`make_plan` copies them from the topology unchanged; roles read them with `plan.settings()`.
One definition per concept: these are the classes of prl/config/topology.py, nothing restated.
"""

from __future__ import annotations

import json
from typing import Optional

import msgspec

from prl.config.types import Strict
from prl.config.topology import SFT, Environment, KVConnector, KVOffload, Model, Topology, Training, WandB, Weights
from prl.errors import ConfigError


class RunSettings(Strict, kw_only=True):
    model: Model
    environment: Optional[Environment]
    """RL: the environment (None: an SFT run)."""
    sft: Optional[SFT] = None
    """SFT: the data (None: an RL run)."""
    training: Optional[Training]
    """None for an inference pool (it trains nothing)."""
    kv_offload: KVOffload
    kv_connector: Optional[KVConnector]
    """The connector both sides use under prefill/decode disaggregation (None: unified)."""
    wandb: Optional[WandB] = None
    """W&B logging during the run: the launcher's `prl wandb --follow` (None: off)."""
    weights: Weights = Weights()
    """How new weights reach the inference servers (the trainer publishes, the orchestrator tells the servers)."""

    @classmethod
    def of(cls, topo: Topology) -> RunSettings:
        inference = topo.inference
        if inference is None:
            return cls(model=topo.model, environment=None, sft=topo.sft, training=topo.training,
                       kv_offload=KVOffload(), kv_connector=None, wandb=topo.wandb)
        return cls(model=topo.model, environment=topo.environment, training=topo.training,
                   kv_offload=inference.kv_offload,
                   kv_connector=inference.kv_connector if inference.disaggregated else None, wandb=topo.wandb,
                   weights=topo.weights)

    def to_json(self) -> bytes:
        return json.dumps(msgspec.to_builtins(self), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> RunSettings:
        try:
            return msgspec.json.decode(raw, type=cls, strict=True)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            message, at, where = str(exc).rpartition(" - at `")
            field = f" ({where.rstrip('`').removeprefix('$').removeprefix('.')})" if at else ""
            raise ConfigError(f"plan.json settings{field}: {message or exc}; the plan was written by another "
                              f"prl version or edited by hand: run `prl plan` again") from None
