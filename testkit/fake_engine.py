"""A stand-in inference server for orchestrator tests and benchmarks (no model, no vLLM).

It speaks the parts of the `prl inference` API the orchestrator uses:

    GET  /health                       200
    GET  /v1/models                    {"data": [{"id": MODEL, "max_model_len": ...}]}
    POST /inference/v1/generate        token-level generate (verifiers' train client)
    POST /v1/chat/completions          plain chat (the eval client)
    POST /prl/weights {"step": N}      "load" RUN/weights/step_N (checks the STABLE marker); the body is decoded
                                       as a prl server does (prl.run.api.WeightsRequest)
    POST /prl/weights {"transport": ..., "step": N, "feeds": [...][, "groups": [{...}]]}   "load" step N from memory
                                       (502 unless `feed_step` is N, or with a group while `group_fail`)
    GET  /prl/live                     {"weights_step": N, ...}
    POST /pause, /resume               (vLLM's RL API, which prl servers mount)

Generated tokens are random ids from `token_ids` (for a real tokenizer's
vocabulary) with made-up logprobs; a stop token ends a reply with
probability `p_stop` per token (or `reply(prompt_ids)` scripts them, and
`logprobs(ids)` their logprobs; `chat(body)` scripts the chat route's
messages; `delay(prompt_ids)` the seconds a request takes, e.g. a heavy tail).
`log` records every generate request: when it came and went (time.time()), the
weights step at both moments, its prompt and reply. Failure injection for tests:
`fail_every` answers every N-th generate request with 503, `weights_fail` makes
weight loads answer 500, `weights_gate` holds them. It runs in a background thread with its own event loop:

    with FakeEngine(model="m", token_ids=range(3, 300), stop_id=2) as eng:
        eng.url  # http://127.0.0.1:PORT
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import random
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

import msgspec
from aiohttp import web

from prl.run import api
from prl.run.api import WeightsRequest


class FakeEngine:
    def __init__(
        self,
        *,
        model: str = "fake",
        token_ids: Iterable[int] = range(3, 200),
        stop_id: int | None = None,
        p_stop: float = 0.1,
        run_dir: str | Path | None = None,
        max_model_len: int = 4096,
        latency_s: float = 0.0,
        seed: int = 0,
        reply: Callable[[list[int]], list[int]] | None = None,
        logprobs: Callable[[list[int]], list[float]] | None = None,
        chat: Callable[[dict], dict] | None = None,
        delay: Callable[[list[int]], float | Awaitable[None]] | None = None,
        expand: Callable[[list[int]], tuple[list[int], dict]] | None = None,
        port: int = 0,
    ):
        self.model = model
        self.token_ids = list(token_ids)
        self.stop_id = stop_id
        self.p_stop = p_stop
        self.run_dir = Path(run_dir) if run_dir else None
        self.max_model_len = max_model_len
        self.latency_s = latency_s
        self.rng = random.Random(seed)
        self.reply = reply
        """Scripted completions: prompt token ids -> completion token ids (instead of random ones)."""
        self.logprobs = logprobs
        """Scripted logprobs: completion token ids -> one logprob each (instead of -log(vocabulary size))."""
        self.chat = chat
        """Scripted chat replies: the /v1/chat/completions request body -> the assistant message (instead of
        random text)."""
        self.delay = delay
        """Seconds a generate request takes, from its prompt token ids (added to `latency_s`); or an awaitable
        the request waits for (e.g. until the engine loads new weights)."""
        self.log: list[dict] = []
        self.weights_step = 0
        self.paused = False
        self.fail_every = 0
        self.weights_fail = False
        self.weights_gate: threading.Event | None = None
        """While set to an unset Event, a weight load waits for it (a server slow to load a step)."""
        self.requests = 0
        self.weight_requests: list[int] = []
        self.feed_requests: list[int] = []
        self.feed_step: int | None = None
        """The step the trainer's feeds hold, as this server would find them (None: whatever it is asked)."""
        self.workers: int | None = 1
        """Its workers, as /prl/live says (None: it does not say)."""
        self.groups: list[dict] = []
        """The broadcast group of each update asked with one."""
        self.group_fail = False
        """Answer an update asked with a group 502, as a group that did not form."""
        self.generate_bodies: list[dict] = []
        self.generate_clients: set[str] = set()
        """The User-Agent products that sent generate requests (aiohttp: prl's fast path; AsyncOpenAI: the SDK)."""
        self.expand = expand
        """vLLM's multimodal expansion, for a request with `content_parts` (pictures): the renderer's prompt ids ->
        the expanded ids and their `mm_placeholders`, answered as `prompt_token_ids` and `mm_placeholders`."""
        self.port = port
        """Port to listen on (0: any free one; a restarted server comes back on its old port)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- handlers
    def _sample(self, max_tokens: int, stop_ids: list[int]) -> list[int]:
        out = []
        stop = self.stop_id if self.stop_id is not None else (stop_ids[0] if stop_ids else None)
        for _ in range(max_tokens):
            if stop is not None and self.rng.random() < self.p_stop:
                out.append(stop)
                break
            out.append(self.rng.choice(self.token_ids))
        return out or [self.rng.choice(self.token_ids)]

    async def _generate(self, request: web.Request) -> web.Response:
        self.requests += 1
        if self.fail_every and self.requests % self.fail_every == 0:
            return web.json_response({"error": "injected failure"}, status=503)
        body = await request.json()
        self.generate_bodies.append(body)
        self.generate_clients.add(request.headers.get("User-Agent", "").split("/")[0])
        prompt = list(body["token_ids"])
        start, weights = time.time(), self.weights_step
        extra = self.delay(prompt) if self.delay else 0.0
        if inspect.isawaitable(extra):
            await extra
            extra = 0.0
        if self.latency_s + extra:
            await asyncio.sleep(self.latency_s + extra)
        sp = body.get("sampling_params") or {}
        if self.reply is not None:
            ids = list(self.reply(prompt))
        else:
            ids = self._sample(int(sp.get("max_tokens") or 16), list(sp.get("stop_token_ids") or []))
        self.log.append({"start": start, "end": time.time(), "weights": weights, "weights_end": self.weights_step,
                         "prompt": prompt, "reply": ids})
        finish = "stop" if self.stop_id is not None and ids[-1] == self.stop_id else "length"
        values = self.logprobs(ids) if self.logprobs else [-math.log(len(self.token_ids))] * len(ids)
        logprobs = [{"token": f"token_id:{t}", "logprob": v} for t, v in zip(ids, values)]
        out = {
            "request_id": f"fake-{self.requests}",
            "choices": [{"index": 0, "token_ids": ids, "finish_reason": finish, "logprobs": {"content": logprobs}}],
        }
        if body.get("content_parts") and self.expand is not None:
            out["prompt_token_ids"], out["mm_placeholders"] = self.expand(prompt)
        return web.json_response(out)

    async def _chat(self, request: web.Request) -> web.Response:
        self.requests += 1
        body = await request.json()
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 8)
        if self.chat is not None:
            message = {"role": "assistant", **self.chat(body)}
        else:
            message = {"role": "assistant", "content": "".join(self.rng.choice("ab ") for _ in range(n))}
        return web.json_response(
            {
                "id": f"fake-{self.requests}",
                "object": "chat.completion",
                "created": 0,
                "model": self.model,
                "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if message.get("tool_calls") else "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1},
            }
        )

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model", "max_model_len": self.max_model_len}]})

    async def _weights(self, request: web.Request) -> web.Response:
        # Decoded as a prl server decodes it: what the orchestrator sends must be a valid request.
        body = api.decode(await request.read(), WeightsRequest)
        step = body.step
        self.weight_requests.append(step)
        while self.weights_gate is not None and not self.weights_gate.is_set():
            await asyncio.sleep(0.01)
        if self.weights_fail:
            return web.json_response({"error": "injected weight-load failure"}, status=500)
        if body.feeds is not None:
            self.feed_requests.append(step)
            if body.groups is not None:
                self.groups.append(msgspec.to_builtins(body.groups))
                if self.group_fail:
                    return web.json_response({"error": "weight feed h:1: group did not form; nothing was loaded"},
                                             status=502)
            if self.feed_step not in (None, step):
                return web.json_response({"error": f"weight feed h:1: holds step {self.feed_step}, not step {step}"},
                                         status=502)
        elif self.run_dir is not None and not (self.run_dir / "weights" / f"step_{step}" / "STABLE").is_file():
            return web.json_response({"error": f"weights/step_{step} is not published"}, status=409)
        self.weights_step = step
        return web.json_response({"weights_step": step})

    async def _live(self, request: web.Request) -> web.Response:
        live = {"ok": True, "weights_step": self.weights_step, "paused": self.paused}
        if self.workers is not None:
            live["workers"] = self.workers
        return web.json_response(live)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _pause(self, request: web.Request) -> web.Response:
        self.paused = True
        return web.json_response({"status": "paused"})

    async def _resume(self, request: web.Request) -> web.Response:
        self.paused = False
        return web.json_response({"status": "resumed"})

    # -- lifecycle
    def start(self) -> FakeEngine:
        ready = threading.Event()

        async def serve() -> None:
            app = web.Application(client_max_size=64 * 1024**2)
            app.add_routes(
                [
                    web.post("/inference/v1/generate", self._generate),
                    web.post("/v1/chat/completions", self._chat),
                    web.get("/v1/models", self._models),
                    web.post("/prl/weights", self._weights),
                    web.get("/prl/live", self._live),
                    web.post("/pause", self._pause),
                    web.post("/resume", self._resume),
                    web.get("/health", self._health),
                ]
            )
            # A request still held at stop (a client that went away mid-rollout, a delay waiting for weights
            # that never come) is cancelled after 1 s rather than aiohttp's 60 s grace.
            self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", self.port)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]
            ready.set()

        def main() -> None:
            self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(serve())
            self._loop.run_forever()

        self._thread = threading.Thread(target=main, name="fake-engine", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fake engine did not start")
        return self

    def stop(self) -> None:
        if self._loop is None:
            return
        fut = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
        fut.result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop = None

    def __enter__(self) -> FakeEngine:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def endpoint_json(url: str) -> str:
    """The content of a RUN/state/endpoints/<role>.<i>.json file for `url`."""
    return json.dumps({"url": url})
