"""An inference pool serving two attached runs' adapters from one real vLLM server (`--tenants`,
prl/run/tenants.py): each run loads and generates with its own adapter under its own name and key, and
can neither generate with, load nor unload the other's (404/403); the pool's routes stay the pool's; a run that
detaches is unloaded and its key refused."""

from __future__ import annotations

import os
import time

import pytest

from prl.run import tenants
from prl.run.rundir import RunDir
from tests.test_inference import LOGPROB_TOL
from tests.vllm_fixtures import HTTPFailure, http_json, start_inference

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPT = [5, 17, 42, 99, 7, 3, 250, 61]


def adapted(model_dir, seed: int):
    """The tiny model in fp32 with a rank-8 adapter (prl/trainer/lora.py `attach`), A and B random."""
    import torch
    from transformers import AutoModelForCausalLM

    from prl.config.topology import Lora
    from prl.trainer.lora import attach

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    attach(model, Lora(rank=8, alpha=16), seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith((".lora_A", ".lora_B")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model


def transformers_logprobs(model, completion: list[int]) -> list[float]:
    import torch

    ids = torch.tensor([PROMPT + completion])
    with torch.no_grad():
        logp = model(input_ids=ids).logits[0].float().log_softmax(-1)
    n = len(PROMPT)
    return [float(logp[n - 1 + i, t]) for i, t in enumerate(completion)]


def generate(url: str, key: str, model: str) -> tuple[list[int], list[float]]:
    out = http_json("POST", f"{url}/inference/v1/generate", {
        "model": model, "token_ids": PROMPT, "sampling_params": {"max_tokens": 6, "temperature": 0.0,
                                                                 "logprobs": 1}},
        headers={"Authorization": f"Bearer {key}"})["choices"][0]
    return out["token_ids"], [e["logprob"] for e in out["logprobs"]["content"]]


def refused(status: int, call) -> dict | str:
    with pytest.raises(HTTPFailure) as e:
        call()
    assert e.value.status == status, e.value
    return e.value.body


def test_two_runs_share_one_server_each_with_its_own_adapter_key_and_name(tiny_model_dir, tmp_path):
    import torch

    from prl.config.topology import Lora
    from prl.trainer.lora import publish_adapter

    pool = RunDir(tmp_path / "pool").create()
    pool.create_api_key()
    runs, models, keys = {}, {}, {}
    for seed, name in enumerate(("exp-a", "exp-b"), 1):
        runs[name] = RunDir(tmp_path / name).create()
        runs[name].create_api_key()
        keys[name] = runs[name].read_api_key()
        models[name] = adapted(tiny_model_dir, seed)
        publish_adapter(runs[name], 1, models[name], Lora(rank=8, alpha=16), str(tiny_model_dir), torch.float32,
                        is_main=True)
        tenants.attach(pool, name, runs[name].root, keys[name])
    pool_key = pool.read_api_key()
    lora = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", "--max-cpu-loras", "4"]
    with start_inference(pool.root, tiny_model_dir, extra_args=["--tenants", "--api-key-env", "POOL_KEY", *lora],
                         env={"POOL_KEY": pool_key}) as server:
        url, base = server.url, str(tiny_model_dir)

        def call(method, path, key, body=None):
            return http_json(method, url + path, body, headers={"Authorization": f"Bearer {key}"})

        base_tokens, base_served = generate(url, keys["exp-a"], "exp-a")  # before its adapter: the base model
        for name in runs:
            answer = call("POST", "/prl/weights", keys[name], {"step": 1})
            assert answer["step"] == 1 and answer["path"] == str(runs[name].weights(1)), answer
            live = call("GET", "/prl/live", keys[name])
            assert live["model"] == name and live["weights_step"] == 1 and live["ok"], live
        for name in runs:
            tokens, served = generate(url, keys[name], name)
            trained = transformers_logprobs(models[name], tokens)
            assert max(abs(a - b) for a, b in zip(served, trained)) < LOGPROB_TOL, (name, served, trained)
        a_tokens, a_served = generate(url, keys["exp-a"], "exp-a")
        assert a_tokens != base_tokens or max(abs(x - y) for x, y in zip(a_served, base_served)) > 20 * LOGPROB_TOL
        assert generate(url, keys["exp-b"], base)[0] == base_tokens  # the base model by its own name

        # Isolation: run b cannot generate with, load or unload run a's adapter, nor act on the pool.
        assert "does not exist" in str(refused(404, lambda: generate(url, keys["exp-b"], "exp-a")))
        assert "does not exist" in str(refused(404, lambda: call("POST", "/v1/completions", keys["exp-b"], {
            "model": "exp-a", "prompt": "hi", "max_tokens": 2})))
        refused(403, lambda: call("POST", "/prl/weights", keys["exp-b"], {"path": str(runs["exp-a"].weights(1))}))
        for path, body in (("/pause", None), ("/resume", None), ("/v1/load_lora_adapter", {
                "lora_name": "exp-a", "lora_path": str(runs["exp-b"].weights(1))}),
                ("/v1/unload_lora_adapter", {"lora_name": "exp-a"})):
            refused(403, lambda: call("POST", path, keys["exp-b"], body))
        refused(401, lambda: call("GET", "/prl/live", "not-a-key"))
        # The pool's own key: its base model does not change, and it sees every run.
        assert "adapters" in str(refused(409, lambda: call("POST", "/prl/weights", pool_key, {"step": 1})))
        assert sorted(call("GET", "/prl/live", pool_key)["tenants"]) == ["exp-a", "exp-b"]

        # Run a detaches: the server unloads its adapter; once its record is removed too (what its launcher does
        # after every server unloaded it) its key is refused; run b serves on.
        refused(400, lambda: call("POST", "/prl/detach", pool_key))
        assert call("POST", "/prl/detach", keys["exp-a"])["unloaded"] == ["exp-a"]
        assert call("GET", "/prl/live", keys["exp-a"])["weights_step"] is None  # the base model again, until...
        assert tenants.detach(pool, "exp-a")
        time.sleep(tenants.RESCAN_S)
        refused(401, lambda: call("GET", "/prl/live", keys["exp-a"]))
        assert sorted(call("GET", "/prl/live", pool_key)["tenants"]) == ["exp-b"]
        assert "does not exist" in str(refused(404, lambda: generate(url, keys["exp-b"], "exp-a")))
        tokens, served = generate(url, keys["exp-b"], "exp-b")
        assert max(abs(a - b) for a, b in zip(served, transformers_logprobs(models["exp-b"], tokens))) < LOGPROB_TOL
        assert os.environ.get("POOL_KEY") is None  # the pool's key went to the server only
