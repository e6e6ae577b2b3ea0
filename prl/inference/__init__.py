"""The inference role: vLLM's OpenAI-compatible server with prl's endpoints.

    python -m prl.inference --run-dir RUN [--api-key-env VAR] <vllm serve args>
    python -m prl.inference.router --port P --prefill URL ... --decode URL ...

    server.py         argument handling, app assembly, serving; mounts vLLM's RL API routes (/pause, /resume,
                      /is_paused, /weight_info) and prl's
    admin.py          prl's admin routes: /prl/live (liveness) and /prl/weights (weight updates)
    generate.py       the token-level /inference/v1/generate the verifiers train client calls
    worker.py         the worker extension mixed into every vLLM worker: loads weights in place
    weight_engine.py  vLLM's weight-transfer engine "prl": a worker loads what the run's transport sends (prl/weights)
    router.py         the prefill/decode proxy in front of disaggregated servers
    routing.py        which server gets a request: rendezvous hashing with bounded load
    http_limits.py    uvicorn's protocol with a deadline for request headers and a cap on open connections

See docs/inference.md. Importing this package imports nothing heavy.
"""
