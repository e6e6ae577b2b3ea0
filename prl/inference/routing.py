"""Which server gets a request: rendezvous (consistent) hashing with bounded load.

Light and pure (no vLLM, no HTTP): the router (`prl.inference.router`) uses it
to pick prefill and decode servers, and the orchestrator's `ServerPool.pick`
to pick a generation server, so both follow one rule:

- Requests with the same key (a rollout's `X-Session-ID`, else a prefix of its
  prompt) go to the same server, so that server's prefix cache holds the
  earlier turns / the group's shared prompt.
- No server takes more than `ceil(balance * (in_flight_total + 1) / n) +
  slack` requests at once ("consistent hashing with bounded loads",
  Mirrokni, Thorup and Zadimoghaddam 2018, plus an absolute allowance as in
  vllm-router's cache-aware policy): a hot key spills to its next server
  instead of piling onto one. Without the slack, at low load the bound is one
  request per server and even a group of two rollouts would be split.
- Rendezvous hashing (highest random weight): each server's score for a key
  is a hash of (key, server); a key tries servers in score order. Adding or
  removing a server moves only the keys whose first choice it is / becomes.
- No key: the least-loaded server (ties: the first listed).

Hashes are blake2b, not Python's `hash`, so every process (router,
orchestrator, a restarted router) maps a key to the same server.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

DEFAULT_BALANCE = 1.25
"""Load bound factor c: a server may hold at most ceil(c * (total + 1) / n) + slack requests."""
DEFAULT_SLACK = 8
"""Requests a server may hold above the ratio bound (a vLLM server batches many at once)."""

PREFIX_TOKENS = 256
"""Prompt tokens that make the routing key when there is no session id."""
PREFIX_CHARS = 1024
"""Prompt characters that make the routing key for text prompts."""

SESSION_HEADER = "x-session-id"


def _score(key: str, server: str) -> int:
    digest = hashlib.blake2b(f"{key}\x00{server}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


@functools.lru_cache(maxsize=65536)
def preference(key: str, servers: tuple[str, ...]) -> tuple[str, ...]:
    """`servers` in the order `key` tries them (highest rendezvous score first)."""
    return tuple(sorted(servers, key=lambda s: _score(key, s), reverse=True))


def capacity(total_load: int, n: int, balance: float = DEFAULT_BALANCE, slack: int = DEFAULT_SLACK) -> int:
    """Most requests one of `n` servers may hold when `total_load` are in flight and one more arrives."""
    return max(1, math.ceil(balance * (total_load + 1) / n)) + slack


def choose(key: str | None, servers: Sequence[str], load: Mapping[str, int],
           balance: float = DEFAULT_BALANCE, slack: int = DEFAULT_SLACK) -> str:
    """The server for a request with routing `key`, given each server's requests in flight."""
    if not servers:
        raise ValueError("no server to choose from")
    if key is None:
        return min(servers, key=lambda s: load.get(s, 0))
    cap = capacity(sum(load.get(s, 0) for s in servers), len(servers), balance, slack)
    for server in preference(key, tuple(servers)):
        if load.get(server, 0) < cap:
            return server
    return min(servers, key=lambda s: load.get(s, 0))  # unreachable with balance >= 1


def request_key(headers: Mapping[str, str], body: Mapping[str, Any]) -> str | None:
    """A request's routing key: its session id, else a prefix of its prompt, else None."""
    session = headers.get(SESSION_HEADER) or headers.get("X-Session-ID")
    if session:
        return "session:" + session
    return prompt_key(body)


def prompt_key(body: Mapping[str, Any]) -> str | None:
    """A key from the start of the prompt of a generate / completion / chat body (None if none).

    Token prompts use their first PREFIX_TOKENS ids, text prompts their first
    PREFIX_CHARS characters, chat requests the messages up to the first user
    message (so every turn of a conversation has the key of its first turn).
    """
    if isinstance(body.get("token_ids"), list):
        return "tokens:" + ",".join(map(str, body["token_ids"][:PREFIX_TOKENS]))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return "text:" + prompt[:PREFIX_CHARS]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return "tokens:" + ",".join(map(str, prompt[:PREFIX_TOKENS]))
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        head = []
        for m in messages:
            head.append(m)
            if isinstance(m, dict) and m.get("role") == "user":
                break
        return "chat:" + json.dumps(head, sort_keys=True, default=str)[:PREFIX_CHARS]
    return None
