"""The orchestrator role: verifiers environments -> rollouts -> training batches; weights -> servers.

    loop.py         the components assembled once, the step loop (`main(run_dir)`,
                    `python -m prl.orchestrator --run-dir RUN`)
    config.py       settings from plan.json
    env.py          loading a verifiers v1 environment offline (subprocess runtime, prl harness)
    harness.py      the in-process `prl` harness (tokens + logprobs via the train client)
    fastpath.py     what the harness saves per model call: no HTTP hop to the in-process interception,
                    the engine called over aiohttp (`engine_client.py`), pydantic's factory check cached
    engine_client.py  verifiers' train client with its engine calls over aiohttp, not the OpenAI SDK
    pooled.py       one pooled aiohttp session per event loop
    rollouts.py     groups of rollouts on the server pool -> samples
    transcripts.py  rollouts as a person reads them: conversations as text, each step's bounded sample
    scoring.py      the scoring servers (`teacher:`, `reference:`): each one's logprob of a step's model tokens
    shaping.py      per-token advantage shaping (`training.advantage.shaping`)
    continuous.py   continuous rollouts: groups in flight across steps; the data order a batch records
    advantages.py   group-relative advantages (pure)
    clients.py      the model clients: train client (rendered here, token-in/token-out), plain eval client
    sync.py         server endpoints, load balancing, the weight watcher
    eval.py         eval split: periodic (`evaluate`) and against an endpoint (`evaluate_endpoint`, for
                    `prl eval`, whose command is prl/cli.py)
    eval_task.py    one task of an eval sweep over a run's weights (`prl eval --run`)
    workers.py      environment rollouts in worker processes (`orchestrator.env_workers`)
    chatml.py       a ChatML renderer whose turns extend the last one token for token (`model.renderer`)
    idefics3.py     the tiny Idefics3 VLM's renderer: ChatML with one `<image>` per picture (vLLM expands it)
    display.py      progress output

Importing this package is light (no verifiers, no torch); `main` imports the rest on call.
"""

from __future__ import annotations


def main(run_dir: str, servers: list[str] | None = None) -> int:
    """Run the orchestrator of RUN (see prl.orchestrator.loop.main)."""
    from prl.orchestrator.loop import main as _main

    return _main(run_dir, servers)


__all__ = ["main"]
