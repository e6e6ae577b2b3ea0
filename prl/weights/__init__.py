"""The weight transport: how each trainer step's weights reach the inference servers' workers.

    transport.py    the interface (one group of methods per side: plan time, trainer, orchestrator, server,
                    its workers) and the registry of transports by name: `get(name)`, `names()`
    filesystem.py   `filesystem`: every step to RUN/weights/step_N, read back by each server
    memory.py       `memory`: each trainer rank's weight feed serves its share over TCP to every worker
    broadcast.py    `broadcast`: the feeds broadcast a step to every server behind on it at once (a group per place)
    feed.py         the weight feed's keyed TCP protocol: FeedServer (a trainer rank), FeedReader (a worker)
    collective.py   the broadcast groups (torch.distributed gloo, bound to the nodes' addresses)
    slices.py       which part of each tensor one inference worker keeps (its tensor-parallel shard)
    delta.py        `weights.delta`: what changed since the previous step, and back
    fp8.py          FP8 on the wire: a block-FP8 checkpoint's weights as e4m3 blocks + scales, as vLLM loads them
    layout.py       what a step holds (safetensors names and shapes), read before any weight is touched

Importing the package registers the shipped transports; it imports no torch, vLLM or numpy (the planner on a
login node imports it): each side imports those when it runs. docs/weights.md explains the choice between them.
"""

# Importing a transport's module registers it; this order is `names()`'s (the default, filesystem, first).
from prl.weights import filesystem  # noqa: F401, I001
from prl.weights import memory  # noqa: F401
from prl.weights import broadcast  # noqa: F401
from prl.weights.transport import Behind, Fail, Offer, Sender, Target, Transport, get, names, register

__all__ = ["Behind", "Fail", "Offer", "Sender", "Target", "Transport", "get", "names", "register"]
