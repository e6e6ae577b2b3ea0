"""verifiers' train client with its engine calls over aiohttp instead of the OpenAI SDK.

`renderers.client.generate` (what verifiers' `TrainClient` calls per model turn) posts the rendered
token ids to the engine's `/inference/v1/generate` through an `openai.AsyncOpenAI` client, and asks its
`/v1/models` once for the context length. Through the SDK (httpx, httpcore) that post cost more CPU than
rendering and parsing the turn together. `EngineHTTP` is the slice of `AsyncOpenAI` that `generate` uses
(`base_url`, `post`, `get`, `close`) over the per-loop aiohttp session the prl harness already pools:
the same body, the same headers that matter (the API key, the config's headers, the session id), and
HTTP failures raised as the SDK's own exception types, so verifiers maps them to the same
`ProviderError` statuses (a 5xx or a dropped connection is retried by the rollout, a 4xx is not).
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import httpx
import openai
from pydantic_core import to_json

from verifiers.v1.clients.train import ElasticRendererPool, TrainClient

from prl.orchestrator.pooled import session

_STATUS_ERRORS: dict[int, type[openai.APIStatusError]] = {
    400: openai.BadRequestError, 401: openai.AuthenticationError, 403: openai.PermissionDeniedError,
    404: openai.NotFoundError, 409: openai.ConflictError, 422: openai.UnprocessableEntityError,
    429: openai.RateLimitError,
}
"""The SDK's exception per status (`AsyncOpenAI._make_status_error`); >= 500 is InternalServerError."""


class Reply:
    """What `generate` reads of the SDK's raw response: the body bytes."""

    __slots__ = ("content", "status_code")

    def __init__(self, status_code: int, content: bytes):
        self.status_code = status_code
        self.content = content


def status_error(method: str, url: str, status: int, content: bytes) -> openai.APIStatusError:
    """The SDK's exception for an HTTP error answer, with its message (`Error code: N - body`)."""
    text = content.decode(errors="replace").strip()
    try:
        body: Any = json.loads(text)
        message = f"Error code: {status} - {body}"
    except ValueError:
        body, message = text, text or f"Error code: {status}"
    response = httpx.Response(status, content=content, request=httpx.Request(method, url))
    data = body.get("error", body) if isinstance(body, dict) else body
    cls = _STATUS_ERRORS.get(status, openai.InternalServerError if status >= 500 else openai.APIStatusError)
    return cls(message, response=response, body=data)


class EngineHTTP:
    """`AsyncOpenAI`'s `base_url`, `post`, `get` and `close`, as `renderers.client.generate` calls them."""

    def __init__(self, config: Any):
        from verifiers.v1.configs.client import resolve_api_key, resolve_headers

        self.base_url = config.base_url.rstrip("/")
        self.headers = {**resolve_headers(config), "Authorization": f"Bearer {resolve_api_key(config)}",
                        "Content-Type": "application/json"}
        t = config.timeout
        self.timeout = aiohttp.ClientTimeout(total=None, connect=t.connect, sock_read=t.read)

    def url(self, path: str) -> str:
        return path if "://" in path else f"{self.base_url}/{path.lstrip('/')}"

    async def post(self, path: str, *, cast_to: Any = None, body: Any = None, options: Any = None) -> Reply:
        headers = {**self.headers, **((options or {}).get("headers") or {})}
        return await self.request("POST", self.url(path), headers, to_json(body))

    async def get(self, path: str, *, cast_to: Any = None) -> Any:
        reply = await self.request("GET", self.url(path), self.headers, None)
        return json.loads(reply.content)

    async def request(self, method: str, url: str, headers: dict[str, str], data: bytes | None) -> Reply:
        try:
            async with (await session()).request(method, url, data=data, headers=headers,
                                                  timeout=self.timeout) as resp:
                content = await resp.read()
        except TimeoutError as e:
            raise openai.APITimeoutError(request=httpx.Request(method, url)) from e
        except aiohttp.ClientError as e:
            raise openai.APIConnectionError(message=f"Connection error: {e}", request=httpx.Request(method, url)) from e
        if resp.status >= 400:
            raise status_error(method, url, resp.status, content)
        return Reply(resp.status, content)

    async def close(self) -> None:
        """Nothing to close: the session is the loop's, closed when the loop ends."""


class PrlTrainClient(TrainClient):
    """verifiers' `TrainClient` (rendering, bridging, parsing: all its own) with `EngineHTTP` as its engine client."""

    def __init__(self, config: Any):  # TrainClient.__init__ with EngineHTTP in place of build_async_openai
        self.config = config
        self.client = EngineHTTP(config)
        if config.renderer_model_name is not None:
            ElasticRendererPool(config.renderer_model_name, config.renderer, multiplex=config.multiplex).warm()
