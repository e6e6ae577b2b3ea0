"""What prl's processes say to each other over HTTP: the bodies of prl's own routes, typed.

    POST /prl/weights   WeightsRequest -> WeightsAnswer        the orchestrator (or a user) -> an inference server
    GET  /prl/live      LiveAnswer                             an inference server -> the orchestrator, `prl eval`
    GET  /prl/proof?nonce=HEX  KeyProof (open)                 a server or the router -> the launcher's readiness
    GENERATE_PATHS      vLLM's and prl's bodies                the generation key may call these (and /v1/models)
    any route, refused  ErrorAnswer                            {"error": why, "status": HTTP code}

The run directory's files are typed the same way in prl/run/records.py. A body is decoded by `decode`, which
bounds its size before it reads it and turns every way it can be wrong (not JSON, too deep, a field of the
wrong type or out of range, an unknown field) into one `BodyError` naming the field. Where a request names a
broadcast group, the group is the one prl/weights/collective.py forms.

Imports nothing of prl but the errors: the control plane, the roles and the servers' workers read these alike.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import urllib.parse
import urllib.request
from typing import Annotated, Literal, Optional, TypeVar, Union

import msgspec
import msgspec.inspect
from msgspec import UNSET, Meta, UnsetType

from prl.errors import PrlError

MAX_BODY_BYTES = 64 * 1024
"""Largest admin request body (a few small fields; a memory update names at most MAX_FEEDS feeds)."""
MAX_ANSWER_BYTES = 1 << 20
"""Largest answer a client reads from a server's admin route."""
MAX_STEP = 2**31 - 1
"""Largest weights step a request may name."""
MAX_PATH = 4096
"""Longest weights path a request may name (Linux's PATH_MAX)."""
MAX_FEEDS = 1024
"""Most weight feeds one memory update may name (one per trainer rank)."""
MAX_WORLD = 4096
"""Most members a broadcast group may have (1 sender + workers)."""
DEFAULT_GROUP_TIMEOUT_S = 60.0
MAX_GROUP_TIMEOUT_S = 3600.0
PAUSE_MODES = ("keep", "wait", "abort")
PROOF_PATH = "/prl/proof"
"""The open route where a server proves it holds the run's key (`key_proof`) before anyone sends it the key."""
NONCE = re.compile(r"[0-9a-f]{32,128}")
"""A proof's nonce: lowercase hex, 16 to 64 random bytes."""
"""How a server pauses generation for an update: in-flight requests freeze, finish first, or end (vLLM's)."""

Step = Annotated[int, Meta(ge=1, le=MAX_STEP)]
GroupBackend = Literal["gloo", "nccl"]
"""A broadcast group's torch.distributed backend (`weights.backend`)."""
Token = Annotated[str, Meta(pattern=r"^[0-9a-f]{32}$")]
_FEED = re.compile(r"([A-Za-z0-9._-]{1,253}):(\d{1,5})")


class BodyError(PrlError):
    """A body that is not the route's: `status` is the HTTP code to answer with (400, or 413 for one too large)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class Body(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of a request body: unknown fields are refused (a misspelt field must not be silently ignored)."""


class Worker(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One vLLM worker's place in its server: tensor-parallel rank, data-parallel rank, expert parallelism (what
    a worker tells a feed, which then sends it only its slices)."""

    tp: Annotated[int, Meta(ge=1, le=4096)] = 1
    tp_rank: Annotated[int, Meta(ge=0)] = 0
    dp: Annotated[int, Meta(ge=1, le=4096)] = 1
    dp_rank: Annotated[int, Meta(ge=0)] = 0
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        if not (0 <= self.tp_rank < self.tp and 0 <= self.dp_rank < self.dp):
            raise ValueError(f"worker tp rank {self.tp_rank} of {self.tp}, dp rank {self.dp_rank} of {self.dp}")

    @property
    def moe_rank(self) -> int:
        """Its rank among the dp x tp ranks the experts are spread over (vLLM flattens DP into the MoE's TP)."""
        return self.dp_rank * self.tp + self.tp_rank

    @property
    def moe_size(self) -> int:
        return self.dp * self.tp


class Group(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One broadcast group as a member sees it (`weights.transport: broadcast`, prl/weights/collective.py)."""

    token: Token
    """32 hex digits, random per group: its store prefix."""
    world: Annotated[int, Meta(ge=2, le=MAX_WORLD)]
    """Members: the sender (rank 0) and every worker."""
    rank: Annotated[int, Meta(ge=0, lt=MAX_WORLD)]
    """This member's rank (0: the sender)."""
    timeout: Annotated[float, Meta(ge=1, le=MAX_GROUP_TIMEOUT_S)] = DEFAULT_GROUP_TIMEOUT_S
    """Longest a member waits at each stage: for every member to come, for each broadcast
    (`weights.group_timeout_s`)."""
    backend: GroupBackend = "gloo"
    """torch.distributed's backend for it: gloo (TCP, host memory) or nccl (the members' GPUs)."""

    def __post_init__(self) -> None:
        if self.rank >= self.world:
            raise ValueError(f"rank {self.rank} is not in a world of {self.world}")


class WeightsRequest(Body, kw_only=True, omit_defaults=True):
    """`POST /prl/weights`: load a weights step. `transport` says where it comes from (prl/weights: the
    registered transports) and which other fields it needs: `filesystem` exactly one of `step` (RUN/weights/step_N)
    and `path` (a directory under RUN/weights/); `memory` `step` and `feeds`; `broadcast` those and `groups`."""

    transport: Annotated[str, Meta(pattern=r"^[a-z][a-z0-9_]{0,31}$")] = "filesystem"
    step: Optional[Step] = None
    path: Optional[Annotated[str, Meta(min_length=1, max_length=MAX_PATH)]] = None
    feeds: Optional[Annotated[list[str], Meta(min_length=1, max_length=MAX_FEEDS)]] = None
    """host:port of each trainer rank's weight feed that holds a share of the step."""
    groups: Optional[Annotated[list[Group], Meta(min_length=1, max_length=MAX_WORLD)]] = None
    """The broadcast group each of this server's workers receives the step by, in worker rank order, each at
    its own rank: the workers of one place (the same slices) in every server behind share a group."""
    mode: Literal["keep", "wait", "abort"] = "keep"
    """How generation pauses while the step loads (PAUSE_MODES)."""

    def __post_init__(self) -> None:
        if self.path is not None and ("\0" in self.path or not self.path.startswith("/")):
            raise ValueError(f'"path" must be an absolute path without NUL, got {self.path[:80]!r}')
        for feed in self.feeds or ():
            m = _FEED.fullmatch(feed)
            if m is None or not 1 <= int(m.group(2)) <= 65535:
                raise ValueError(f'"feeds" entries must be "host:port", got {feed[:80]!r}')
        if self.feeds is not None and len(set(self.feeds)) != len(self.feeds):
            raise ValueError('"feeds" names a feed twice')
        if self.groups is not None and len({(g.token, g.rank) for g in self.groups}) != len(self.groups):
            raise ValueError('"groups" names one member of a group twice')

    @property
    def durable(self) -> bool:
        """From the run directory: a step a server can roll back to after a failed update."""
        return self.feeds is None

    @property
    def once(self) -> bool:
        """A group's request: its members were formed together, so it is tried once (a retry reads the feeds)."""
        return self.groups is not None


class WeightsAnswer(msgspec.Struct, kw_only=True, omit_defaults=True):
    """`POST /prl/weights`'s answer: what the server now serves and what the update took."""

    step: Optional[int]
    path: str
    """The weights' origin: a directory, or memory:step_N."""
    seconds: float
    load_seconds: float
    pause_seconds: float
    kv_storage_cleared: int
    """KV entries deleted from a storage connector's directory."""
    received_bytes: Optional[int] = None
    """From memory: the bytes one worker read off its sockets (less than the step's with deltas)."""
    delta: Optional[bool] = None
    """From memory: every worker got only what changed."""
    group: Optional[bool] = None
    """From memory: the step came by broadcast."""
    worker_bytes: Optional[list[int]] = None
    """What each worker (in rank order) read off its sockets or the step's files: its slices of the step."""


class LiveAnswer(msgspec.Struct, kw_only=True):
    """`GET /prl/live`: what an inference server serves (an attached run's view: its own adapter)."""

    ok: bool
    weights_step: Optional[int] = None
    """The weights step served (None: the base model)."""
    weights_path: Optional[str] = None
    disk_step: Union[int, None, UnsetType] = UNSET
    """The step it loaded last from disk, which a failed update rolls back to (unset: a server that does not say,
    taken to be on `weights_step`)."""
    paused: Optional[bool] = None
    model: str = ""
    updates: int = 0
    last_update: Optional[dict] = None
    updating: bool = False
    workers: Optional[Annotated[int, Meta(ge=1)]] = None
    """Its vLLM workers (each a member of a broadcast group)."""
    places: Optional[Annotated[list[Worker], Meta(max_length=MAX_WORLD)]] = None
    """Each worker's place, in rank order, where the model's slices differ by place (a broadcast group's members
    are the workers of one place); None: every worker receives the whole step."""
    error: Optional[str] = None
    tenants: Optional[dict[str, Optional[int]]] = None
    """An inference pool's: attached run -> the adapter step it serves."""


class KeyProof(msgspec.Struct, kw_only=True):
    """A server's answer on PROOF_PATH: `key_proof(its key, the nonce asked, the port the request came in on)`."""

    proof: str


def key_proof(key: str, nonce: str, port: int) -> str:
    """hex HMAC-SHA256 under `key` of `nonce:port`. The port binds the proof to the listener that gives it: a
    process squatting on a port cannot pass on the proof of the run's real server on another."""
    return hmac.new(key.encode(), f"{nonce}:{port}".encode(), hashlib.sha256).hexdigest()


GENERATE_PATHS = frozenset({"/inference/v1/generate", "/v1/chat/completions", "/v1/completions"})
"""The routes that generate (prl's token route and the OpenAI completion routes); their JSON body names the model."""
GENERATION_KEY_PATHS = GENERATE_PATHS | {"/v1/models"}
"""Every route the generation key may call (`generation_key`); the others need the run's key (docs/inference.md,
Which key can do what)."""
GENERATION_KEY_LABEL = b"prl generation-only key v1"


def generation_key(key: str) -> str:
    """The generation-only key of the run whose key is `key`: hex HMAC-SHA256 under it of a purpose label. A
    server accepts it on GENERATION_KEY_PATHS alone (403 elsewhere); it tells nothing of the run's key. The
    orchestrator hands its environments this one (prl/orchestrator/sync.py `hold_keys`)."""
    return hmac.new(key.strip().encode(), GENERATION_KEY_LABEL, hashlib.sha256).hexdigest()


def generation_refusal(path: str) -> Optional[tuple[int, str]]:
    """Why the generation key may not call `path`, as (HTTP status, message); None when it may."""
    if path in GENERATION_KEY_PATHS:
        return None
    return 403, (f"{path} needs the run's key: the generation-only key may call only "
                 f"{', '.join(sorted(GENERATION_KEY_PATHS))}")


class ErrorAnswer(msgspec.Struct, kw_only=True):
    """What a refused request is answered with."""

    error: str
    status: int


B = TypeVar("B")


def decode(raw: bytes, kind: type[B], *, limit: int = MAX_BODY_BYTES, empty_ok: bool = False,
           what: str = "admin requests") -> B:
    """`raw` as a `kind`, or BodyError saying what is wrong (413 when it is over `limit` bytes: `what` take at most
    that). An empty body is the type's defaults when `empty_ok`."""
    if len(raw) > limit:
        raise BodyError(f"body of {len(raw)} bytes; {what} take at most {limit}", 413)
    if empty_ok and not raw.strip():
        raw = b"{}"
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as e:
        raise BodyError(refusal(kind, str(e))) from None
    except (msgspec.DecodeError, RecursionError) as e:
        raise BodyError(f"body is not a JSON object: {str(e)[:200]}") from None


def proves_key(url: str, key: str, timeout: float = 2.0) -> bool:
    """Whether the server at `url` holds `key`: its answer on PROOF_PATH to a fresh nonce is `key_proof` of that
    nonce and `url`'s port. Asked before anything sends the key there: a process that took the planned port
    first (another user's, a stale one) answers /health as well as the run's server does."""
    nonce = secrets.token_hex(16)
    try:
        with urllib.request.urlopen(f"{url}{PROOF_PATH}?nonce={nonce}", timeout=timeout) as response:
            answer = decode(response.read(MAX_ANSWER_BYTES + 1), KeyProof, limit=MAX_ANSWER_BYTES)
    except (OSError, ValueError, BodyError):  # URLError and HTTPError are OSErrors
        return False
    port = urllib.parse.urlsplit(url).port
    return port is not None and hmac.compare_digest(answer.proof, key_proof(key, nonce, port))


_AT = re.compile(r"\A(?P<detail>.*?)(?: - at `\$(?P<path>[^`]*)`)?\Z", re.S)


def refusal(kind: type, message: str) -> str:
    """msgspec's refusal of a `kind` body said as the field and what it must be (`"step" must be an integer in
    [1, 2147483647] (Expected `int` <= 2147483647)`); a check of the body as a whole as it is."""
    m = _AT.match(message)
    detail, path = m.group("detail")[:200], m.group("path") or ""
    if not path:
        return "body must be a JSON object" if detail.startswith("Expected `object`") else detail
    info, names = msgspec.inspect.type_info(kind), re.findall(r"\.([A-Za-z_]\w*)|\[\d+\]", path)
    for name in names:
        info = _field(info, name)
    field = path.lstrip(".")
    return f'"{field}" {_must(info)} ({detail})' if info is not None else f'"{field}": {detail}'


def _field(info, name: str):
    """The type of field `name` of struct type `info` (its item type for a list index); None past what it knows."""
    while isinstance(info, msgspec.inspect.UnionType):
        info = next((t for t in info.types if not isinstance(t, msgspec.inspect.NoneType)), None)
    if isinstance(info, msgspec.inspect.ListType) and not name:
        return info.item_type
    if isinstance(info, msgspec.inspect.StructType):
        return next((f.type for f in info.fields if f.encode_name == name), None)
    return None


def _must(info) -> str:
    """What a value of type `info` must be, in words."""
    while isinstance(info, msgspec.inspect.UnionType):
        others = [t for t in info.types if not isinstance(t, msgspec.inspect.NoneType)]
        if len(others) != 1:
            return "has the wrong type"
        info = others[0]
    i = msgspec.inspect
    if isinstance(info, (i.IntType, i.FloatType)):
        lo = info.ge if info.ge is not None else info.gt
        hi = info.le if info.le is not None else (info.lt - 1 if info.lt is not None and isinstance(info, i.IntType)
                                                  else info.lt)
        what = "an integer" if isinstance(info, i.IntType) else "a number"
        return f"must be {what}" + (f" in [{lo}, {hi}]" if lo is not None and hi is not None else "")
    if isinstance(info, i.StrType):
        return "must be a string" + (f" of at most {info.max_length} characters" if info.max_length else "") + (
            f" matching {info.pattern}" if info.pattern else "")
    if isinstance(info, i.LiteralType):
        return f"must be one of {', '.join(map(str, info.values))}"
    if isinstance(info, i.ListType):
        return "must be a list" + (f" of at most {info.max_length} items" if info.max_length else "")
    if isinstance(info, i.StructType):
        return "must be a JSON object"
    if isinstance(info, i.BoolType):
        return "must be true or false"
    return "has the wrong type"


def encode(body: msgspec.Struct) -> dict:
    """A body as JSON-ready builtins (what a client or a server sends; a request leaves out its defaults)."""
    return msgspec.to_builtins(body)
