"""The orchestrator role: verifiers environments -> rollouts -> training batches; weights -> servers.

    loop.py         the step loop (`main(run_dir)`, `python -m prl.orchestrator --run-dir RUN`)
    config.py       settings from plan.json
    env.py          loading a verifiers v1 environment offline (subprocess runtime, prl harness)
    harness.py      the in-process `prl` harness (tokens + logprobs via the train client)
    rollouts.py     groups of rollouts on the server pool -> samples
    continuous.py   continuous rollouts: groups in flight across steps; the data order a batch records
    advantages.py   group-relative advantages (pure)
    sync.py         server endpoints, load balancing, the weight watcher
    eval.py         eval split: periodic and `prl eval` (`eval.main`)
    display.py      progress output

Importing this package is light (no verifiers, no torch); `main` imports the rest on call.
"""

from __future__ import annotations


def main(run_dir: str, servers: list[str] | None = None) -> int:
    """Run the orchestrator of RUN (see prl.orchestrator.loop.main)."""
    from prl.orchestrator.loop import main as _main

    return _main(run_dir, servers)


__all__ = ["main"]
