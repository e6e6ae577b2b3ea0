"""`POST /inference/v1/generate`: token ids in, token ids and their logprobs out.

This is the endpoint the `verifiers` 0.4.0 training client calls (through
the `renderers` package it pins): the client renders the chat template
itself and sends

    {"model": M, "token_ids": [...], "sampling_params": {..., "logprobs": 1,
     "stop_token_ids": [...]}, "cache_salt"?: S, "priority"?: P}
    header X-Session-ID: <rollout session>

and requires, for `choices[0]`, the sampled `token_ids`, a `finish_reason`
and `logprobs.content` with exactly one `{"token": "token_id:<id>",
"logprob": x}` per sampled token (x finite, not vLLM's -9999 sentinel).
vLLM 0.32 mounts a route of this name only with `--enable-scale-out` /
`--tokens-only`, and its entries (`{"token_id": N, ...}`) fail that check,
so prl serves its own. Sampling keys vLLM does not know are ignored (the
client passes provider-specific extras through).

Pictures (a vision-language model): `content_parts` lists the prompt's
pictures in order, `[{"type": "image_url", "url": "data:image/png;base64,..."}]`
(the verifiers train client sends them so), and `token_ids` holds one image
placeholder token per picture, which vLLM expands as its processor does. The
answer then carries the expanded `prompt_token_ids` and `mm_placeholders`
(`{"image": [{"offset", "length"}, ...]}`: where each picture's tokens lie in
them), what the trainer recomputes. Only data URLs: the server fetches nothing
a request names. Precomputed `features` are refused, and so are pictures sent to a
text-only model (before any is decoded). A request's pictures hold at most
MAX_REQUEST_PIXELS together, judged from their headers before any is decoded; they
decode on DECODER's threads, never on the event loop.

Routed experts (a server started with `--routed-experts`, for router replay): each choice carries the experts
every MoE layer routed its tokens to (`take_routes`; prl/inference/worker.py `RouteCapture` captures them),
from `sampling_params.routed_experts_prompt_start` on, as verifiers reads them.

Prefill/decode disaggregation (vLLM's protocol, as on its OpenAI routes): a
top-level `kv_transfer_params` is handed to the engine's KV connector, and
the answer carries the connector's `kv_transfer_params` (a prefill server's
say where a decode server fetches the prompt's KV; null without a connector).
"""

from __future__ import annotations

import asyncio
import math
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from vllm.entrypoints.serve.utils.api_utils import with_cancellation
from vllm.exceptions import VLLMClientError
from vllm.inputs import TokensPrompt
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.utils import random_uuid

from prl.log import get_logger

log = get_logger(__name__)

router = APIRouter()

SESSION_HEADER = "X-Session-ID"

# SamplingParams fields a client may set; the rest are engine-internal or need objects.
CLIENT_SAMPLING_KEYS = frozenset({
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p",
    "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens",
    "logprobs", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
    "logit_bias", "allowed_token_ids", "bad_words", "extra_args",
})


INT64 = (-(2**63), 2**63 - 1)
"""Range of every integer a request may carry (the engine's MessagePack transport holds no more)."""
MAX_N = 256
"""Most completions one request may ask for (`sampling_params.n`)."""
MAX_STRINGS = 64
"""Most `stop` strings or `bad_words` one request may carry."""
MAX_STRING_CHARS = 1024
"""Longest `stop` string, `bad_words` entry, `request_id` or `cache_salt`."""
MAX_LOGIT_BIAS = 100.0
"""Largest |bias| in `logit_bias` (OpenAI's bound)."""
TOKEN_JSON_BYTES = 24
"""Most bytes one token id takes in a request's JSON, generously (`"151643": -100.0, ` is 18)."""
STRINGS_JSON_BYTES = 1 << 20
"""Room in a request's JSON for everything but token ids (stop strings, bad words, ids, sampling values)."""


MAX_IMAGES = 64
"""Most pictures one generate request may carry."""
IMAGES_JSON_BYTES = 64 << 20
"""Room in a multimodal model's request for its pictures (base64 data URLs)."""
MAX_REQUEST_PIXELS = 64 << 20
"""Most pixels (width x height, summed over its pictures) one request may carry, read from each picture's
header before any is decoded: a small PNG may claim a huge canvas. Decoded, a pixel takes at most 4 bytes
(RGBA) and 3 more as the RGB vLLM gets, so one request's pictures hold at most 448 MiB while they decode."""
DECODE_THREADS = 2
"""Threads that decode pictures, for the whole server: a request's pictures decode off the event loop, and
at most this many requests' at once (the others wait their turn), so decoding holds at most
DECODE_THREADS x 448 MiB and never stalls the server's other requests."""
DECODER = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="prl-picture-decode")


async def decoded_images(parts: Any) -> list:
    """`decode_images(parts)` on the DECODER threads."""
    return await asyncio.get_running_loop().run_in_executor(DECODER, decode_images, parts)


def max_body_bytes(vocab: int, max_model_len: int, multimodal: bool = False) -> int:
    """Largest body a generate request of this model can need: a prompt of max_model_len ids, and up to a
    vocabulary of ids in each of stop_token_ids, allowed_token_ids and logit_bias (and IMAGES_JSON_BYTES of
    pictures for a multimodal model). The server refuses a larger one (413) before parsing it
    (`prl.inference.server.BodyLimit`)."""
    return TOKEN_JSON_BYTES * (max_model_len + 3 * vocab) + STRINGS_JSON_BYTES + (IMAGES_JSON_BYTES if multimodal else 0)


def decode_images(parts: Any) -> list:
    """The pictures of a request's `content_parts`, decoded as vLLM decodes an `image_url` (RGB); BadRequest
    naming the part for anything else, or naming MAX_REQUEST_PIXELS for pictures that hold more together
    (judged from their headers: nothing is decoded before every picture is known to fit)."""
    from PIL import Image

    opened = opened_images(parts)
    images = []
    for i, image in enumerate(opened):
        try:
            images.append(image.convert("RGB"))
        except (OSError, ValueError, Image.DecompressionBombError) as e:  # a truncated or corrupt payload
            raise BadRequest(f"content_parts[{i}]: not a picture PIL can decode: {str(e)[:200]}") from e
    return images


def opened_images(parts: Any) -> list:
    """Each part's picture opened (its header read, its pixels not decoded); BadRequest naming the part for
    anything that is not an image_url part of a picture PIL reads, or once the pixels pass MAX_REQUEST_PIXELS."""
    import binascii
    import io

    from PIL import Image

    from prl.run.batch import NotADataURL, picture_bytes

    if not isinstance(parts, list) or len(parts) > MAX_IMAGES:
        raise BadRequest(f"content_parts must be a list of at most {MAX_IMAGES} image_url parts")
    opened, pixels = [], 0
    for i, part in enumerate(parts):
        part = part if isinstance(part, dict) else {}
        nested = part.get("image_url")  # {"url": ...}; a bare string there is refused like any other shape
        url = part.get("url", nested.get("url") if isinstance(nested, dict) else None)
        if part.get("type") != "image_url" or not isinstance(url, str):
            raise BadRequest(f"content_parts[{i}] must be {{\"type\": \"image_url\", \"url\": ...}}")
        try:
            image = Image.open(io.BytesIO(picture_bytes(url)))
        except NotADataURL as e:
            raise BadRequest(f"content_parts[{i}]: {e}") from None
        except (binascii.Error, OSError, ValueError, Image.DecompressionBombError) as e:  # binascii: no base64
            raise BadRequest(f"content_parts[{i}]: not a picture PIL can decode: {str(e)[:200]}") from e
        pixels += image.width * image.height
        if pixels > MAX_REQUEST_PIXELS:
            raise BadRequest(f"content_parts[{i}]: a {image.width}x{image.height} picture takes the request's "
                             f"pictures to {pixels} pixels, over MAX_REQUEST_PIXELS={MAX_REQUEST_PIXELS}")
        opened.append(image)
    return opened


def placeholders(engine_input) -> dict[str, list[dict[str, int]]]:
    """Where each picture's tokens lie in the expanded prompt (the `mm_placeholders` of vLLM's rendered input)."""
    found = engine_input.get("mm_placeholders") or {} if engine_input.get("type") == "multimodal" else {}
    return {kind: [{"offset": r.offset, "length": r.length} for r in ranges] for kind, ranges in found.items()}


class BadRequest(ValueError):
    """A request outside what this endpoint serves; the message is the 400's reason."""


class GenerateRequest(BaseModel):
    """Body of POST /inference/v1/generate."""

    model_config = ConfigDict(extra="allow")

    token_ids: list[int] = Field(min_length=1)
    """The rendered prompt."""
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    """vLLM SamplingParams fields; unknown keys are ignored."""
    model: str | None = None
    request_id: str | None = None
    cache_salt: str | None = None
    priority: int = 0
    stream: bool = False
    features: Any = None
    content_parts: Any = None
    kv_transfer_params: dict[str, Any] | None = None
    """For the KV connector (prefill/decode disaggregation): set by the router, see the module doc."""


def _error(status: HTTPStatus, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": status.phrase, "code": status.value}},
                        status_code=status.value)


def _int(value: Any, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{name} must be an integer, got {_shown(value)}")
    if not low <= value <= high:
        raise BadRequest(f"{name}={_shown(value)} is out of range [{low}, {high}]")
    return value


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "..."


def _token_ids(values: Any, name: str, vocab: int, most: int) -> None:
    """A list of at most `most` ids in [0, vocab): its length first, then every id in one pass."""
    if not isinstance(values, list):
        raise BadRequest(f"{name} must be a list of token ids, got {_shown(values)}")
    if len(values) > most:
        raise BadRequest(f"{name} holds {len(values)} ids; at most {most}")
    bad = next((i for i, t in enumerate(values) if type(t) is not int or not 0 <= t < vocab), None)
    if bad is not None:
        _int(values[bad], f"{name}[{bad}]", 0, vocab - 1)  # raises, saying why


def _strings(values: Any, name: str) -> None:
    values = [values] if isinstance(values, str) else values
    if not isinstance(values, list) or len(values) > MAX_STRINGS:
        raise BadRequest(f"{name} must be a string or a list of at most {MAX_STRINGS} strings")
    for v in values:
        if not isinstance(v, str) or len(v) > MAX_STRING_CHARS:
            raise BadRequest(f"{name} entries must be strings of at most {MAX_STRING_CHARS} characters")


def _finite_numbers(value: Any, name: str) -> None:
    """Every number in `value` (nested) is finite and, if an integer, within int64.

    A value's place is kept as (parent, key) and spelled out only for the error: a list of a
    million numbers costs a million checks, not a million formatted names."""
    pending: list[tuple[Any, Any]] = [(value, name)]
    while pending:
        v, where = pending.pop()
        if isinstance(v, bool) or v is None or isinstance(v, str):
            continue
        if isinstance(v, int):
            if not INT64[0] <= v <= INT64[1]:
                _int(v, _spelled(where), *INT64)
        elif isinstance(v, float):
            if not math.isfinite(v):
                raise BadRequest(f"{_spelled(where)} must be a finite number, got {v}")
        elif isinstance(v, dict):
            pending.extend((x, (where, f".{k}")) for k, x in v.items())
        elif isinstance(v, list):
            pending.extend((x, (where, i)) for i, x in enumerate(v))


def _spelled(where: Any) -> str:
    """A place kept by _finite_numbers as nested (parent, key) pairs, as `a.b[2]`."""
    parts = []
    while isinstance(where, tuple):
        where, key = where
        parts.append(key if isinstance(key, str) else f"[{key}]")
    return where + "".join(reversed(parts))


def check_request(request: GenerateRequest, vocab: int, max_model_len: int, max_logprobs: int) -> int:
    """Refuse (BadRequest) what the engine must never see; return the room the prompt leaves.

    vLLM checks some of this itself, some only deep in the engine (a token id outside the
    vocabulary), some not at all (a seed beyond int64 breaks its transport): every bound is
    checked here, before the engine sees the request, so a bad request is a 400 with a reason.
    """
    room = max_model_len - len(request.token_ids)
    if room < 1:  # before a look at each id: a prompt far too long is refused at once
        raise BadRequest(f"prompt of {len(request.token_ids)} tokens leaves no room in max_model_len={max_model_len}")
    _token_ids(request.token_ids, "token_ids", vocab, max_model_len)
    for name in ("request_id", "cache_salt"):
        value = getattr(request, name)
        if value is not None and len(value) > MAX_STRING_CHARS:
            raise BadRequest(f"{name} is longer than {MAX_STRING_CHARS} characters")
    _int(request.priority, "priority", *INT64)
    sp = request.sampling_params
    _finite_numbers(sp, "sampling_params")
    if (v := sp.get("max_tokens")) is not None:
        _int(v, "sampling_params.max_tokens", 1, room)
    if (v := sp.get("min_tokens")) is not None:
        _int(v, "sampling_params.min_tokens", 0, sp.get("max_tokens") or room)
    if (v := sp.get("n")) is not None:
        _int(v, "sampling_params.n", 1, MAX_N)
    if (v := sp.get("logprobs")) is not None:
        _int(v, "sampling_params.logprobs", 0, max_logprobs if max_logprobs >= 0 else vocab)
    if (v := sp.get("top_k")) is not None:
        _int(v, "sampling_params.top_k", -1, vocab)
    if (v := sp.get("seed")) is not None:
        _int(v, "sampling_params.seed", *INT64)
    if (v := sp.get("routed_experts_prompt_start")) is not None:
        _int(v, "sampling_params.routed_experts_prompt_start", 0, INT64[1])
    for name in ("stop_token_ids", "allowed_token_ids"):
        if (v := sp.get(name)) is not None:
            _token_ids(v, f"sampling_params.{name}", vocab, vocab)
    for name in ("stop", "bad_words"):
        if (v := sp.get(name)) is not None:
            _strings(v, f"sampling_params.{name}")
    if (bias := sp.get("logit_bias")) is not None:
        if not isinstance(bias, dict):
            raise BadRequest("sampling_params.logit_bias must be an object of token id -> bias")
        if len(bias) > vocab:
            raise BadRequest(f"sampling_params.logit_bias holds {len(bias)} entries; at most {vocab}")
        for key, value in bias.items():
            try:
                token = int(key)
            except ValueError:
                raise BadRequest(f"sampling_params.logit_bias key {_shown(key)} is not a token id") from None
            _int(token, "sampling_params.logit_bias key", 0, vocab - 1)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or abs(value) > MAX_LOGIT_BIAS:
                raise BadRequest(f"sampling_params.logit_bias[{key}] must be a number in "
                                 f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {_shown(value)}")
    return room


def build_sampling_params(raw: dict[str, Any], defaults: dict[str, Any], room: int) -> SamplingParams:
    """SamplingParams from a client dict: generation-config defaults, then the client's known keys.

    `room` (context length left after the prompt) is the default `max_tokens`,
    as in vLLM's OpenAI routes. Logprobs are always on: at least the sampled
    token's (`logprobs=0`).
    """
    kwargs = {k: v for k, v in defaults.items() if k in CLIENT_SAMPLING_KEYS}
    kwargs.update({k: v for k, v in raw.items() if k in CLIENT_SAMPLING_KEYS and v is not None})
    ignored = sorted(set(raw) - CLIENT_SAMPLING_KEYS)
    if ignored:
        log.debug("generate: ignoring sampling keys %s", ignored)
    if kwargs.get("logit_bias"):
        kwargs["logit_bias"] = {int(k): float(v) for k, v in kwargs["logit_bias"].items()}
    kwargs.setdefault("max_tokens", room)
    kwargs["logprobs"] = max(int(kwargs.get("logprobs") or 0), 0)
    kwargs["output_kind"] = RequestOutputKind.FINAL_ONLY
    return SamplingParams(**kwargs)


def _entry(token_id: int, logprob: float) -> dict[str, Any]:
    return {"token": f"token_id:{token_id}", "logprob": logprob}


def _choice(index: int, completion, want_top: int) -> dict[str, Any]:
    content = []
    for i, tok in enumerate(completion.token_ids):
        step = completion.logprobs[i] if completion.logprobs is not None else {}
        sampled = step.get(tok)
        if sampled is None:
            raise RuntimeError(f"the engine returned no logprob for sampled token {i} ({tok})")
        # JSON has no -inf; a sampled token this unlikely only comes from an underflow.
        entry = _entry(tok, sampled.logprob if math.isfinite(sampled.logprob) else -1e30)
        if want_top:
            entry["top_logprobs"] = [_entry(t, v.logprob) for t, v in
                                     sorted(step.items(), key=lambda kv: kv[1].rank or 0)[:want_top]]
        content.append(entry)
    return {
        "index": index,
        "token_ids": list(completion.token_ids),
        "finish_reason": completion.finish_reason or "abort",
        "stop_reason": completion.stop_reason,
        "logprobs": {"content": content},
    }


@router.post("/inference/v1/generate")
@with_cancellation
async def generate(request: GenerateRequest, raw_request: Request):
    engine = raw_request.app.state.engine_client
    if request.stream:
        return _error(HTTPStatus.BAD_REQUEST, "stream=true is not supported by this endpoint")
    if request.features is not None:
        return _error(HTTPStatus.BAD_REQUEST, "precomputed multimodal features are not supported: send the "
                                              "pictures as content_parts")
    model_config = engine.model_config
    if request.content_parts and not model_config.is_multimodal_model:  # before a byte of them is decoded
        return _error(HTTPStatus.BAD_REQUEST, f"model {model_config.served_model_name} is text-only: it takes no "
                                              "pictures (content_parts)")
    try:
        room = check_request(request, model_config.get_vocab_size(), model_config.max_model_len,
                             model_config.max_logprobs)
    except BadRequest as e:
        return _error(HTTPStatus.BAD_REQUEST, str(e))
    try:
        params = build_sampling_params(request.sampling_params, model_config.get_diff_sampling_param(), room)
    except (TypeError, ValueError, VLLMClientError) as e:  # SamplingParams' own checks (VLLMValidationError)
        return _error(HTTPStatus.BAD_REQUEST, f"bad sampling_params: {e}")
    if request.kv_transfer_params:
        params.extra_args = {**(params.extra_args or {}), "kv_transfer_params": request.kv_transfer_params}

    try:
        prompt = await engine_prompt(request, raw_request)
    except (BadRequest, ValueError, VLLMClientError) as e:
        return _error(HTTPStatus.BAD_REQUEST, str(e))
    request_id = f"prl-gen-{request.request_id or random_uuid()}"
    final = None
    try:
        async for out in engine.generate(prompt, params, request_id, priority=request.priority,
                                         lora_request=served_adapter(raw_request, request.model),
                                         session_id=raw_request.headers.get(SESSION_HEADER)):
            final = out
    except (ValueError, VLLMClientError) as e:  # vLLM's input validation (token ids out of vocab, too long, ...)
        await _release_remote_kv(engine, request_id, request.kv_transfer_params)
        return _error(HTTPStatus.BAD_REQUEST, str(e))
    if final is None:
        return _error(HTTPStatus.INTERNAL_SERVER_ERROR, "the engine returned no output")
    body = answer(request, request_id, prompt, final)
    if getattr(raw_request.app.state, "prl_routes", False):
        start = int(request.sampling_params.get("routed_experts_prompt_start") or 0)
        for choice, routes in zip(body["choices"], await take_routes(engine, request_id, len(body["choices"]), start)):
            choice["routed_experts"] = routes
    return JSONResponse(body)


async def take_routes(engine, request_id: str, n: int, start: int) -> list[dict[str, Any] | None]:
    """The experts the server's MoE layers routed each token of the request's `n` completions to, from
    position `start` on (prl/inference/worker.py `RouteCapture`), as verifiers reads them (`choices[i].
    routed_experts`): `{"data": base64 of [tokens, layers, top_k] ids, "shape", "dtype", "start"}`, covering
    the prompt and completion but the last token (no forward pass follows it); None where none were captured.
    "data" comes first: the renderers client cuts the base64 out of the raw JSON by that prefix."""
    import base64

    for found in await engine.collective_rpc("prl_take_routes", args=(request_id, n, start)):
        if found is not None:
            return [None if r is None else {"data": base64.b64encode(r["data"]).decode("ascii"),
                                            "shape": r["shape"], "dtype": r["dtype"], "start": r["start"]}
                    for r in found]
    return [None] * n


async def engine_prompt(request: GenerateRequest, raw_request: Request):
    """What the engine generates from: the request's ids, or with pictures the input vLLM's renderer makes of
    them (each placeholder expanded as the model's processor does, and where: as vLLM's own token route does)."""
    prompt = TokensPrompt(prompt_token_ids=request.token_ids)
    if request.cache_salt:
        prompt["cache_salt"] = request.cache_salt
    if not request.content_parts:
        return prompt
    prompt["multi_modal_data"] = {"image": await decoded_images(request.content_parts)}
    (rendered,) = await raw_request.app.state.online_renderer.renderer.render_cmpl_async([prompt])
    return rendered


def answer(request: GenerateRequest, request_id: str, prompt, final) -> dict[str, Any]:
    """The response body: the choices, and the prompt the model saw (with pictures: vLLM's expanded ids)."""
    want_top = int(request.sampling_params.get("logprobs") or 0)
    choices = [_choice(i, c, want_top if want_top > 1 else 0) for i, c in enumerate(final.outputs)]
    completion_tokens = sum(len(c["token_ids"]) for c in choices)
    prompt_ids = list(prompt["prompt_token_ids"]) if request.content_parts else list(request.token_ids)
    body = {
        "request_id": request_id,
        "model": request.model,
        "prompt_token_ids": prompt_ids,
        "choices": choices,
        "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                  "total_tokens": len(prompt_ids) + completion_tokens},
        "kv_transfer_params": final.kv_transfer_params,
    }
    if request.content_parts:
        body["mm_placeholders"] = placeholders(prompt)
    return body


def served_adapter(raw_request: Request, model: str | None):
    """The LoRA adapter loaded under `model`'s name (`model.lora` runs, prl/inference/admin.py), else None."""
    models = getattr(raw_request.app.state, "openai_serving_models", None)
    return models.lora_requests.get(model) if models is not None and model else None


async def _release_remote_kv(engine, request_id: str, kv_transfer_params: dict[str, Any] | None) -> None:
    """A decode request the engine refused: let the connector free the prompt's KV held on the prefill
    server (as vLLM's OpenAI routes do), instead of leaving it pinned until its lease runs out."""
    if not kv_transfer_params or not kv_transfer_params.get("do_remote_prefill"):
        return
    try:
        await engine.notify_kv_transfer_request_rejected(request_id, kv_transfer_params)
    except Exception:  # noqa: BLE001 - best effort: the lease frees the blocks anyway
        log.warning("could not release the remote KV of refused request %s", request_id, exc_info=True)
