"""The inference servers as the orchestrator sees them, and the weight watcher.

Where the servers are: `RUN/state/endpoints/<role>.<replica>.json` (an `Endpoint` with its `url`),
written by the role runner once a server is healthy; one per replica head in
plan.json `servers`, plus `router.0` under prefill/decode disaggregation
(plan `router_port`). Generation goes to the router when there is one, else
to every inference server (least requests in flight first). Weight updates go
to every prefill / decode / inference server, never the router. Standalone
use passes `--server URL` instead (each URL both generates and loads weights). Either way the
servers found are a `Fleet`; the orchestrator builds its one `ServerPool` from it, whole
(`ServerPool.of`), and hands that to the generators and the weight watcher.
Weight updates and `/prl/live` carry the run's key (`auth_headers`), held by this process alone (`hold_keys`);
what generates (the environments' clients, the scorers) carries the generation-only key, the one environments
and their tools inherit.

The weight watcher asks the run's weight transport (prl/weights, `weights.transport`) for the newest step the
servers may load (`offer`: the newest STABLE step under weights/, or a newer one the trainer holds in memory)
and tells every server behind on it to load it (`POST /prl/weights`, the transport's `WeightsRequest` for each
server: the same for all, or one broadcast group of them), with retries and back-off. A request a group was
formed for is tried once (`once`): a server whose group fails asks for the plain offer at once. A step from
memory that the trainer replaced meanwhile (a 502 while a newer offer exists) is not a failure: the watcher
asks for the newer one. A server that still fails is recorded in state/orchestrator.json and metrics, and after
`weight_update_retries` attempts the watcher fails the orchestrator with an error naming the server, the step
and the server's answer. It also asks `GET /prl/live` now and then, so a server that restarted (back to the
base weights) is noticed and updated.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import msgspec

from prl import weights
from prl.errors import PrlError, StepTimeout
from prl.inference import routing
from prl.log import get_logger
from prl.planner.model import Plan
from prl.run import api
from prl.run.api import LiveAnswer, WeightsRequest
from prl.run.rundir import API_KEY_VAR, GENERATION_KEY_VAR, HEARTBEAT_S, RunDir
from prl.states import WEIGHT_ROLES, Role

log = get_logger(__name__)

_HELD: dict[str, str] = {}
"""The run's key, held by this process alone once `hold_keys` took it out of the environment."""


def hold_keys(run: RunDir) -> None:
    """Keep the run's key in this process only, and hand everything this process starts (env workers, their
    tools, any subprocess) the generation-only key instead: the key comes from $PRL_INFERENCE_API_KEY, which is
    removed from the environment (standalone use), else from RUN/api_key (the role runner hands none: a child
    could read it in this process's /proc environ); GENERATION_KEY_VAR then holds `api.generation_key` of it.
    Without either, no key (servers that check none)."""
    key = os.environ.pop(API_KEY_VAR, "").strip()
    if not key and run.api_key_file.is_file():
        key = run.read_api_key()
    _HELD["admin"] = key
    if key:
        os.environ[GENERATION_KEY_VAR] = api.generation_key(key)
    else:
        os.environ.pop(GENERATION_KEY_VAR, None)


def auth_headers(generation: bool = False) -> dict[str, str]:
    """The run's key as a bearer header (what `hold_keys` took), or with `generation` its generation-only key;
    {} without one."""
    key = _HELD.get("admin", "")
    if key and generation:
        key = api.generation_key(key)
    return {"Authorization": f"Bearer {key}"} if key else {}


def server_client(**kwargs) -> httpx.AsyncClient:
    """An HTTP client for the servers' admin routes (weights, /prl/live), sending the run's key."""
    return httpx.AsyncClient(headers=auth_headers(), **kwargs)


def generation_client(**kwargs) -> httpx.AsyncClient:
    """An HTTP client for the servers' generation routes, sending the generation-only key."""
    return httpx.AsyncClient(headers=auth_headers(generation=True), **kwargs)


class WeightUpdateError(PrlError):
    """An inference server could not load a published weights step after retries."""


@dataclass(eq=False)
class LiveServer:
    """The orchestrator's live view of one server: its URL, the weights it serves, its requests in flight, whether
    it is in rotation (the planned server, its nodes and ports, is prl.planner.model.Server)."""

    url: str
    role: str = Role.INFERENCE
    version: int = 0
    """Weights step this server is known to serve (0: the base model)."""
    disk_version: int = 0
    """Weights step it last loaded from disk, which it rolls back to (`version` unless that came from memory)."""
    inflight: int = 0
    failures: int = 0
    """Consecutive failed weight updates."""
    error: str | None = None
    alive: bool = True
    """In rotation: its endpoint is published and it answers. A server that died (or restarted and is not on
    the newest weights yet) is out of rotation: no rollouts, no weight pushes until it rejoins."""
    rejoining: bool = False
    """Its endpoint came back (a restart): it rejoins once it serves the newest published weights."""
    started: float | None = None
    """The `started` of the endpoint file it was found by: a new value is a new server process."""
    workers: int | None = None
    """Its vLLM workers, each a member of a broadcast group (`/prl/live`; None: not known yet)."""
    places: list | None = None
    """Each worker's place (prl.run.api.Worker), where they keep different slices (`/prl/live`)."""


@dataclass(frozen=True)
class Fleet:
    """The servers a pool is made of, as found (`discover`, `standalone`)."""

    generate: list[LiveServer]
    """Where rollouts are sent (the router, or the inference servers)."""
    admin: list[LiveServer]
    """Who loads weights (every inference / prefill / decode server)."""
    follow_endpoints: bool = False
    """Found in the run's endpoint files (`discover`): follow them as servers die and restart."""
    scorers: dict[str, list[str]] = field(default_factory=dict)
    """Scoring role -> its servers (`teacher`, `reference`; prl/orchestrator/scoring.py)."""
    endpoints: RunDir | None = None
    """The run directory whose endpoint files name the servers: the run's own, or its inference pool's."""


@dataclass
class ServerPool:
    """The servers as rollouts and the weight watcher share them: built whole (`ServerPool.of`), then handed
    out. What changes while it runs is state: the servers' versions and rotation, and `target`."""

    generate: list[LiveServer]
    """Where rollouts are sent (the router, or the inference servers)."""
    admin: list[LiveServer]
    """Who loads weights (every inference / prefill / decode server)."""
    follow_endpoints: bool = False
    """Servers come from the run's endpoint files (`discover`): follow them as servers die and restart."""
    on_idle: Callable[[], None] | None = None
    """Called when `pick` finds no server to use (the orchestrator's heartbeat while it waits for one)."""
    endpoints: RunDir | None = None
    """Where `follow_endpoints` reads the servers' endpoint files (None: the run's own directory)."""
    target: int = 0
    """Newest weights step the watcher has seen published."""
    _moved: asyncio.Event = field(default_factory=asyncio.Event)
    """Set by `notify` (the weight watcher: a version or the rotation changed), then replaced: wakes `moved`."""

    @classmethod
    def of(cls, fleet: Fleet, on_idle: Callable[[], None] | None = None) -> ServerPool:
        return cls(fleet.generate, fleet.admin, follow_endpoints=fleet.follow_endpoints, on_idle=on_idle,
                   endpoints=fleet.endpoints)

    def notify(self) -> None:
        """A server's version or rotation changed: wake every `moved` waiter (`wait_version` is one)."""
        self._moved.set()
        self._moved = asyncio.Event()

    async def moved(self, timeout: float) -> None:
        """Until the next `notify`, or `timeout` s."""
        try:
            await asyncio.wait_for(self._moved.wait(), timeout)
        except TimeoutError:
            pass

    @property
    def version(self) -> int:
        """The weights version every server in rotation serves (the oldest of them)."""
        serving = [s for s in self.admin if s.alive] or self.admin
        return min(s.version for s in serving) if serving else 0

    def version_of(self, server: LiveServer) -> int:
        """Version a generation server answers with: its own, or (a router) the oldest behind it."""
        return server.version if server in self.admin else self.version

    def pick(self, min_version: int, avoid: LiveServer | None = None, key: str | None = None) -> LiveServer | None:
        """A generation server new enough, by the router's rule (`prl.inference.routing.choose`).

        Requests with the same `key` (a rollout's session id, or its task: the
        group's shared prompt) keep to one server, so its prefix cache serves
        them, unless that server holds more than its share of requests in
        flight; without a key, the server with the fewest in flight.
        """
        ok = [s for s in self.generate if s.alive and self.version_of(s) >= min_version]
        if avoid is not None and len(ok) > 1:
            ok = [s for s in ok if s is not avoid]
        if not ok:
            if self.on_idle is not None:
                self.on_idle()  # waiting for a server (a restart) is waiting on another role, not a hang
            return None
        by_url = {s.url: s for s in ok}
        return by_url[routing.choose(key, list(by_url), {s.url: s.inflight for s in ok})]

    async def suspect(self, server: LiveServer) -> None:
        """A rollout on `server` failed: a server that does not answer /health leaves rotation now, not at the
        weight watcher's next look (a weight update in flight to a dying server holds the watcher until it
        ends), so the next rollouts wait for a server instead of failing on this one; the watcher brings it
        back once it serves again (`WeightWatcher.follow`)."""
        if not (self.follow_endpoints and server.alive):
            return
        async with server_client() as client:
            if await healthy(client, server):
                return
        if server.alive:
            log.warning("%s does not answer /health after a failed rollout; out of rotation", server.url)
            server.alive, server.rejoining = False, True
            self.notify()

    async def wait_version(self, min_version: int, timeout: float, error: list[BaseException], on_wait=None) -> float:
        """Block until every server serves version >= min_version; return the seconds waited."""
        t0 = time.monotonic()
        last_beat = t0
        while self.version < min_version:
            if error:
                raise error[0]
            now = time.monotonic()
            if now - t0 > timeout:
                behind = ", ".join(f"{s.url} at {s.version}" for s in self.admin if s.version < min_version)
                raise StepTimeout(
                    f"waited {timeout:.0f} s for weights step {min_version} on every server ({behind}); newest "
                    f"published weights step is {self.target}. Is the trainer running? See `prl status`."
                )
            if on_wait is not None and now - last_beat > HEARTBEAT_S:
                on_wait()
                last_beat = now
            await self.moved(1.0)
        return time.monotonic() - t0


def read_endpoints(run: RunDir) -> dict[str, list[str]]:
    """URLs by role from the run's published endpoints (entries without a url, e.g. multi-node heads, skipped)."""
    urls = {role: [e.url.rstrip("/") for _, e in sorted(by_index.items()) if e.url]
            for role, by_index in run.endpoints().items()}
    return {role: found for role, found in urls.items() if found}


def discover(run: RunDir, plan: Plan, timeout: float) -> Fleet:
    """Wait (up to `timeout` s) for every server the plan has to publish its endpoint; the servers found. A run
    attached to an inference pool (`plan.attach`) takes the pool's servers, as many as are up."""
    if plan.attach is not None:
        run = RunDir(plan.attach)
    want = set() if plan.attach is not None else plan.expected_endpoints()
    started = time.monotonic()
    deadline, waited = started + timeout, False
    while True:
        found = read_endpoints(run)
        have = {(role, i) for role, urls in found.items() for i in range(len(urls))}
        if want and want <= have or not want and found:
            if waited:
                log.info(f"the servers are up after {time.monotonic() - started:.1f} s")
            break
        if not waited:
            waited = True
            log.info(f"waiting for the servers to start: {', '.join(sorted(f'{r}.{i}' for r, i in want - have))}"
                     if want else "waiting for a server of the pool")
        if time.monotonic() > deadline:
            missing = sorted(f"{r}.{i}" for r, i in want - have) or ["any"]
            raise StepTimeout(
                f"no endpoint for inference server(s) {', '.join(missing)} in {run.endpoints_dir} "
                f"after {timeout:.0f} s; are the servers up? (`prl status`, `prl logs --role inference`)"
            )
        time.sleep(0.5)
    admin = [LiveServer(u, role) for role in WEIGHT_ROLES for u in found.get(role, [])]
    gen = ([LiveServer(u, Role.ROUTER) for u in found.get(Role.ROUTER, [])]
           or [s for s in admin if s.role == Role.INFERENCE])
    if not gen:
        raise PrlError(f"endpoints {found} have neither a router nor an inference server to generate with")
    return Fleet(generate=gen, admin=admin, follow_endpoints=True,
                 scorers={role: found[role] for role in plan.scorer_roles() if role in found}, endpoints=run)


def endpoint_starts(run: RunDir) -> dict[str, float | None]:
    """url -> `started` of every published server endpoint (what `WeightWatcher.follow` compares)."""
    return {e.url.rstrip("/"): e.started for role in WEIGHT_ROLES
            for e in run.endpoints().get(role, {}).values() if e.url}


async def healthy(client: httpx.AsyncClient, server: LiveServer) -> bool:
    """True when the server's /health answers 200 (open without the API key: the launcher probes it too)."""
    try:
        r = await client.get(f"{server.url}/health", timeout=5)
        return r.status_code == 200
    except httpx.HTTPError:
        return False


def weights_trusted(run: RunDir) -> bool:
    """False while a trainer of this attempt has not yet dropped the weights steps a resume replaces
    (`weights_attempt` in its state): until then a published step may belong to the attempt being replaced."""
    from prl.run.rundir import current_attempt

    state = run.read_state(Role.TRAINER)
    return state is None or (state.weights_attempt or 0) >= current_attempt()


def standalone(urls: list[str]) -> Fleet:
    """`--server URL ...`: each server both generates and loads weights."""
    servers = [LiveServer(u.rstrip("/").removesuffix("/v1")) for u in urls]
    return Fleet(generate=servers, admin=servers)


async def served_model(fleet: Fleet) -> str:
    """The model name the fleet's first generation server answers to (GET /v1/models)."""
    url = fleet.generate[0].url
    async with generation_client(timeout=30) as client:
        r = await client.get(f"{url}/v1/models")
        r.raise_for_status()
        data = r.json().get("data") or []
    if not data:
        raise PrlError(f"{url}/v1/models lists no model")
    return data[0]["id"]


async def live_versions(client: httpx.AsyncClient, server: LiveServer) -> tuple[int, int] | None:
    """The server's own account of its weights step and of the step it loaded last from disk, which it
    rolls back to (the same step when it does not say); None if it does not answer. Notes its worker count."""
    try:
        r = await client.get(f"{server.url}/prl/live", timeout=10)
        if r.status_code != 200:
            return None
        live = api.decode(r.content, LiveAnswer, limit=api.MAX_ANSWER_BYTES, what="liveness answers")
    except (httpx.HTTPError, api.BodyError):
        return None
    step = live.weights_step or 0  # null: still the base model
    server.workers, server.places = live.workers, live.places
    return step, step if live.disk_step is msgspec.UNSET else live.disk_step or 0


class WeightWatcher:
    """Keeps every server on the newest weights the run's transport offers; records failures on the run.

    Each server's update runs as a task of its own (`pushes`, at most one per server): a server slow to load one
    step holds neither the other servers' next step nor the watcher's own rounds (`follow`, `sync_live`, which
    leave a server alone while its update runs)."""

    def __init__(self, run: RunDir, pool: ServerPool, transport: weights.Transport, *, retries: int,
                 poll: float = 0.5, live_every: float = 10.0):
        self.run = run
        self.pool = pool
        self.transport = transport
        self.retries = max(1, retries)
        self.poll = poll
        self.live_every = live_every
        self.error: list[BaseException] = []
        self.updates = 0
        self.update_s = 0.0
        self.pushes: dict[str, asyncio.Task] = {}
        """The update running for each server (by URL), until the watcher's next round collects it."""

    async def sync_live(self, client: httpx.AsyncClient) -> None:
        """Adopt what each server says it serves (a restarted server is back at 0)."""
        for s in self.pool.admin:
            if not s.alive or s.url in self.pushes:
                continue  # `follow` asks a returning server itself; an update in flight sets the version
            versions = await live_versions(client, s)
            if versions is None:
                continue
            v, s.disk_version = versions
            if v != s.version:
                if v < s.version:
                    log.warning("%s reports weights step %d, expected %d (restarted?)", s.url, v, s.version)
                s.version = v
        self.pool.notify()

    async def follow(self, client: httpx.AsyncClient) -> None:
        """Track the servers' comings and goings through their endpoint files and /health.

        A server whose endpoint file went away (its task saw it exit) or whose /health fails leaves
        rotation at once: its rollouts are retried on others. One whose endpoint reappears with a new
        `started` (the launcher restarted it) rejoins once it serves the newest published weights.
        """
        if not self.pool.follow_endpoints:
            return
        starts = endpoint_starts(self.pool.endpoints or self.run)
        probed = [s for s in self.pool.admin if s.alive and s.url in starts and starts[s.url] == s.started]
        answers = dict(zip(probed, await asyncio.gather(*(healthy(client, s) for s in probed))))
        for s in self.pool.admin:
            if s.url not in starts:
                if s.alive or s.rejoining:
                    log.warning("%s is gone (its endpoint was withdrawn); out of rotation", s.url)
                s.alive = s.rejoining = False
                continue
            started = starts[s.url]
            if s.started is None and (s.alive or s.rejoining):
                s.started = started
            elif started != s.started:
                log.warning("%s is back (a new server process); it rejoins on weights step %d", s.url,
                            self.pool.target)
                s.started, s.alive, s.rejoining, s.failures, s.error = started, False, True, 0, None
            elif s.alive and not answers.get(s, True):
                log.warning("%s does not answer /health; out of rotation", s.url)
                s.alive, s.rejoining = False, True
            if s.rejoining and s.url not in self.pushes:
                versions = await live_versions(client, s)
                if versions is not None:
                    v, s.disk_version = versions
                    s.version = v
                    if v >= self.pool.target:
                        s.alive, s.rejoining = True, False
                        log.info("%s rejoined on weights step %d", s.url, v)
        self.pool.notify()

    def pin(self) -> None:
        """Keep on disk every weights step a server serves or could roll back to (the run's cleanup reads it):
        a server on a step from memory rolls back to the step it last loaded from disk."""
        if self.pool.admin and self.pool.follow_endpoints:
            self.run.pin_weights(Role.ORCHESTRATOR, min(min(s.version, s.disk_version) for s in self.pool.admin))

    def newest(self) -> weights.Offer | None:
        """The newest weights step the servers may load and the request that loads it, as the run's transport
        offers it: the newest published step, or a newer one the trainer holds in memory. None while the
        trainer has not yet dropped the steps a resume replaces."""
        return self.transport.offer(self.run) if weights_trusted(self.run) else None

    def requests(self, servers: list[LiveServer], offer: weights.Offer) -> dict[str, WeightsRequest]:
        """The first request each server behind on `offer` is sent (by URL): the offer's, or (a transport that
        sends to several servers at once) one that joins them."""
        return self.transport.requests(offer, [weights.Behind(s.url, s.workers, s.places) for s in servers])

    async def push(self, client: httpx.AsyncClient, server: LiveServer, step: int,
                   first: WeightsRequest | None = None) -> None:
        """Bring `server` to `step` (or a newer one), with retries. `first` (`requests`): the first try's request,
        on its step whatever the transport offers by then (a group's other members ask for that one); a group's
        that fails is followed at once by the plain offer (not counted as a failure)."""
        delay, attempt = 1.0, 0
        while attempt < self.retries:
            attempt += 1
            if first is not None:
                request, first = first, None
            else:
                offer, request = self.newest(), WeightsRequest(step=step)
                if offer is not None and offer.step >= step:
                    request = offer.request  # a newer step appeared while we retried; an older one may be cleaned up
            step = request.step
            t0 = time.monotonic()
            try:
                r = await client.post(f"{server.url}/prl/weights", json=api.encode(request), timeout=600)
                if r.status_code == 200:
                    return self.loaded(server, request, time.monotonic() - t0)
                if r.status_code == 409:
                    # Not published (any more): a resume is replacing steps, or cleanup outran us. Wait and
                    # look again at what is published; not a failure of the server.
                    log.info("%s: weights step %d is not published (409); waiting", server.url, step)
                    return
                if request.once:
                    log.info("%s: weights step %d together with other servers failed (HTTP %d: %s); asking for it "
                             "alone", server.url, step, r.status_code, r.text[:200])  # tests/test_e2e_moe.py reads it
                    attempt -= 1
                    continue
                moved = self.newest()
                if r.status_code == 502 and not request.durable and moved is not None and moved.step > step:
                    # A step from memory is held only while it is the newest, and the trainer sent another.
                    log.info("%s: weights step %d left the trainer's memory; asking for step %d", server.url, step,
                             moved.step)
                    attempt -= 1
                    continue
                why = f"HTTP {r.status_code}: {r.text[:300]}"
            except httpx.HTTPError as e:
                why = f"{type(e).__name__}: {e}"
                if self.pool.follow_endpoints and not await healthy(client, server):
                    # The server died under the update: the launcher restarts it; it rejoins on its own.
                    log.warning("%s is down (%s); out of rotation until it restarts", server.url, why)
                    server.alive, server.rejoining = False, True
                    return
            server.failures += 1
            server.error = f"weights step {step}: {why}"
            log.warning("%s failed to load weights step %d (attempt %d/%d): %s", server.url, step, attempt, self.retries, why)
            self.run.heartbeat(Role.ORCHESTRATOR, server_errors={server.url: server.error})
            if attempt < self.retries:
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
        raise WeightUpdateError(
            f"inference server {server.url} ({server.role}) could not load weights step {step} after "
            f"{self.retries} attempts: {server.error}. Check its log (`prl logs --role {server.role}`)."
        )

    def loaded(self, server: LiveServer, request: WeightsRequest, seconds: float) -> None:
        """`server` answered `request` with 200: it serves that step."""
        step = request.step
        server.version, server.failures, server.error = step, 0, None
        if request.durable:
            server.disk_version = step
        if server.rejoining:
            server.alive, server.rejoining = True, False
            log.info("%s rejoined on weights step %d", server.url, step)
        self.updates += 1
        self.update_s += seconds
        log.info("%s loaded weights step %d in %.2f s%s", server.url, step, seconds,
                 "" if request.durable else f" (from memory: {request.transport})")

    async def run_forever(self) -> None:
        async with server_client() as client:
            last_live = 0.0
            try:
                while True:
                    await self.follow(client)
                    if time.monotonic() - last_live > self.live_every:
                        await self.sync_live(client)
                        last_live = time.monotonic()
                    self.pin()
                    offer = self.newest()
                    if offer is not None and offer.step > self.pool.target:
                        self.pool.target = offer.step
                    self.collect()
                    behind = [s for s in self.pool.admin if (s.alive or s.rejoining)
                              and s.version < self.pool.target and s.url not in self.pushes]
                    firsts = self.requests(behind, offer) if behind and offer and offer.step == self.pool.target else {}
                    for s in behind:
                        self.pushes[s.url] = asyncio.create_task(
                            self.pushed(client, s, self.pool.target, firsts.get(s.url)))
                    await asyncio.sleep(self.poll)
            except asyncio.CancelledError:
                raise
            except BaseException as e:  # surfaced by the loop (wait_version / the step loop)
                self.error.append(e)
                self.pool.notify()
            finally:
                for task in self.pushes.values():
                    task.cancel()
                await asyncio.gather(*self.pushes.values(), return_exceptions=True)
                self.pushes.clear()

    async def pushed(self, client: httpx.AsyncClient, server: LiveServer, step: int,
                     first: WeightsRequest | None = None) -> None:
        """`push`, then what a changed version means for the others: the pins, and whoever waits on the pool."""
        await self.push(client, server, step, first)
        self.pin()
        self.pool.notify()

    def collect(self) -> None:
        """Forget the updates that ended; the first that failed ends the watcher (`WeightUpdateError`)."""
        for url, task in list(self.pushes.items()):
            if task.done():
                del self.pushes[url]
                task.result()
