"""The inference role: vLLM's OpenAI-compatible server with prl's endpoints.

    python -m prl.inference --run-dir RUN [--api-key-env VAR] <vllm serve args>
    python -m prl.inference.router --port P --prefill URL ... --decode URL ...

Modules: `server` (argument handling, app assembly, serving; it mounts vLLM's RL API routes
/pause, /resume, /is_paused, /weight_info), `admin` (/prl/live, /prl/weights), `generate` (the
token-level /inference/v1/generate the verifiers train client calls),
`worker` (the worker extension that loads weights in place), `checks`
(what an update may load; light, no vLLM), `router` (prefill/decode proxy).
See docs/inference.md. Importing this package imports nothing heavy.
"""
