"""What the tests and the benches share, importable without pytest (a bench runs after the README's install,
which has no pytest): nothing here imports `tests` or `pytest` (tests/test_imports.py checks it).

    plans.py            typed plans made as users make them: a shipped topology plus overrides, through the planner
    fake_engine.py      a stand-in inference server (no model, no vLLM) for orchestrator tests and benches
    servers.py          real vLLM servers and the P/D router on this machine, with HTTP and metrics helpers
    trainer_helpers.py  a trainer run on CPU ranks: a run dir with a plan and synthetic rollouts, `launch`
    rank_zygote.py      forks the trainer's CPU ranks from one process that imported torch once
    ports.py            free ports for the servers started here
    browser.py          a real headless Chromium over the DevTools protocol, for the pages prl writes
    pictures.py         real PNG payloads (data URLs) for the servers' picture routes
"""
