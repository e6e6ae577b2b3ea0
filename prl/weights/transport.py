"""The interface of a weight transport, one group of methods per side, and the registry of transports by name.

A transport is how each trainer step's weights reach the inference servers' workers (`weights.transport`).
Whatever the transport, the run directory stays the durable record: checkpoint steps, the last step and a
SIGTERM's step are published to RUN/weights/step_N by the trainer's own publish (prl/trainer/weights.py); that
is what a restarted server starts from, what a failed update rolls back to and what `model.from_run` reads. A
transport moves the other steps its own way.

    transport = get(settings.weights.transport)

    plan time     transport.check(topo, fail, gpus)      refuse, at its YAML line, what it cannot carry
                  transport.group_backend(weights, gpus) its broadcast groups' backend (gloo or nccl)
                  transport.feeds                        the trainer's ranks serve from memory: a port each
    trainer       transport.forget(run)                  a new attempt: what the last held in memory is gone
                  transport.sender(run, weights, ...)    this rank's Sender (collective), or None: every step to disk
                  sender.send(step, tensors, writers)    collective: a step that is not durable
    orchestrator  transport.offer(run)                   the newest step the servers may load, as an Offer
                  transport.requests(offer, behind)      each server's WeightsRequest for it
    server        transport.target(run, request, ...)    what a request names, checked before any weight is touched
                  target.load(engine)                    every worker loads it (target.untouched after a failure)
    its workers   transport.receive(request, ...)        a worker's Reception of a step (the transports that send
                                                         through vLLM's weight-transfer API: memory, broadcast)

A new transport is one module of this package: a `Transport` subclass, `register`ed, imported by
prl/weights/__init__.py, with its plan-time `check`. The planner, the trainer's engine, the orchestrator and
the inference roles name a transport only through these methods.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Optional

from prl.run.api import GroupBackend, WeightsRequest
from prl.run.rundir import RunDir
from prl.weights.layout import UpdateRefused

if TYPE_CHECKING:
    from prl.config.topology import Topology, Weights

Fail = Callable[[tuple[Any, ...], str], Exception]
"""The planner's error at a topology field: `fail(("weights", "delta"), message)` is the error to raise."""


@dataclass(frozen=True)
class Offer:
    """The newest weights step the servers may load, and the request that loads it."""

    step: int
    request: WeightsRequest


@dataclass(frozen=True)
class Behind:
    """A server behind on an offer, as a transport that sends to several servers at once sees it."""

    url: str
    workers: Optional[int]
    """Its vLLM workers (`/prl/live`); None while not known."""
    places: Optional[Sequence[Any]] = None
    """Each worker's place (prl.run.api.Worker) in rank order, where they keep different slices; None: every
    worker takes the whole step."""


class Target(ABC):
    """What one `/prl/weights` request names on a server, checked before any weight was touched."""

    step: Optional[int]
    """The policy version it holds (None: a directory not named step_N)."""
    durable: ClassVar[bool] = False
    """From the run directory: a failed update later rolls back to it."""
    adapter: bool = False
    """A LoRA adapter, not a whole model (the server loads it under the model's name itself)."""

    @property
    @abstractmethod
    def origin(self) -> str:
        """Where the served weights come from, as `/prl/live` says: a directory, or memory:step_N."""

    @abstractmethod
    def describe(self) -> str:
        """Where it comes from, for the server's log line."""

    @abstractmethod
    async def load(self, engine) -> tuple[float, dict]:
        """Every worker of `engine` (vLLM's engine client) loads it: the slowest worker's seconds, and what moved
        (fields of `prl.run.api.WeightsAnswer`)."""

    async def untouched(self, engine) -> bool:
        """After `load` failed: True when no worker changed a weight (the old ones keep serving); False when the
        server must roll back to its disk weights."""
        return False


class Sender(ABC):
    """A trainer rank's side of a transport that sends steps from memory (started collectively by `sender`)."""

    @abstractmethod
    def send(self, step: int, tensors: Sequence[tuple[str, Any]], writers: Sequence[int]) -> None:
        """Collective: this rank's share of step `step` (what a sharded publish would write to its file; empty on
        a rank that writes none) goes out; `writers` are the ranks that hold a share."""

    @abstractmethod
    def close(self) -> None:
        """Stop serving (the trainer is done)."""


class Transport(ABC):
    """One way weights travel from the trainer to the servers; registered by `name`."""

    name: ClassVar[str]
    summary: ClassVar[str]
    """How a step travels, in a few words (`prl plan` shows it)."""
    feeds: ClassVar[bool] = False
    """The trainer's ranks serve their shares from memory: the planner gives each rank a port."""
    groups: ClassVar[bool] = False
    """It broadcasts to groups of workers: `weights.backend` and `weights.group_timeout_s` are its settings."""

    def check(self, topo: Topology, fail: Fail, gpus: bool = False) -> None:
        """Plan time: raise `fail(field, message)` for what this transport cannot carry on a cluster whose roles
        run on GPUs (`gpus`) or not (nothing by default)."""

    def forget(self, run: RunDir) -> None:
        """Trainer, rank 0, as an attempt starts: what a replaced attempt held outside the run directory is gone;
        say so before the orchestrator may offer it (nothing by default)."""

    def sender(self, run: RunDir, weights: Weights, host: str, ports: Sequence[int], config: Optional[Mapping] = None,
               backend: GroupBackend = "gloo") -> Optional[Sender]:
        """Trainer, collective: this rank's Sender on `host` (its port: `ports[rank]`; the run's key guards what
        it serves; `config`, the model's config.json, says what each worker keeps of each tensor; `backend`, the
        planned `group_backend`, its groups'), or None when every step goes to the run directory."""
        return None

    def group_backend(self, weights: Weights, gpus: bool) -> GroupBackend:
        """Plan time: the broadcast groups' backend for roles on GPUs (`gpus`) or not (gloo: no groups)."""
        return "gloo"

    def offer(self, run: RunDir) -> Optional[Offer]:
        """Orchestrator: the newest step the servers may load; default the newest published to the run directory."""
        step = run.latest_stable("weights")
        return None if step is None else Offer(step, WeightsRequest(step=step))

    def requests(self, offer: Offer, behind: Sequence[Behind]) -> dict[str, WeightsRequest]:
        """Orchestrator: the request each server behind on `offer` is sent first (by URL); default the offer's."""
        return {b.url: offer.request for b in behind}

    @abstractmethod
    def target(self, run: RunDir, request: WeightsRequest, *, layout: Optional[dict], lora: bool, workers: int
               ) -> Target:
        """Server: what `request` names, checked against the served `layout` (names and shapes; None when the
        server cannot say), whether it serves adapters (`lora`) and its `workers`; UpdateRefused before anything
        is touched."""

    def receive(self, request: WeightsRequest, key: bytes, rank: int, kept: dict, place: Any = None) -> Any:
        """A server's worker (rank `rank` within its server, `place` its prl.weights.slices.Worker): the step
        `request` names, as a Reception (its layout first, then its tensors, only the parts the worker keeps).
        Only the transports that send through vLLM's weight-transfer API have one."""
        raise UpdateRefused(400, f"weights.transport {self.name} sends no weights through a worker's transfer "
                                 "engine")


_TRANSPORTS: dict[str, Transport] = {}


def register(transport: Transport) -> Transport:
    """Make `transport` known by its name (a module of this package does it once, when imported)."""
    if transport.name in _TRANSPORTS:
        raise ValueError(f"a weight transport named {transport.name!r} is registered already")
    _TRANSPORTS[transport.name] = transport
    return transport


def names() -> tuple[str, ...]:
    """Every registered transport's name, in registration order."""
    return tuple(_TRANSPORTS)


def get(name: str) -> Transport:
    """The transport called `name`; UpdateRefused(400) naming the known ones for another name (a request's)."""
    try:
        return _TRANSPORTS[name]
    except KeyError:
        raise UpdateRefused(400, f"no weight transport {name!r}; one of {', '.join(names())}") from None
