"""Runs attached to an inference pool: who they are, which routes each may call, which model names it may use.

A pool is a run directory whose servers (`python -m prl.inference --tenants ...`, with `--enable-lora`) serve
one base model to several RL runs that each train a LoRA adapter. A run attaches by writing its record into
the pool's run directory:

    POOL/tenants/<name>.json    TenantRecord: {"name", "run_dir", "key_sha256", "generation_sha256", "attached"}
                                (mode 0600, atomic)

`name` is the run's name in the pool (its adapter is served under it), `run_dir` the run's own directory
(the only place its adapters are loaded from), `key_sha256` the digest of the run's API key (the key itself
stays in the run's directory), `generation_sha256` that of its generation-only key (`prl.run.api.generation_key`:
what the run's orchestrator and environments generate with). A server reads the records again on a request at most every RESCAN_S, so a run
attached after the pool started is served within a second, and one whose record is removed (`detach`, after
every server unloaded its adapter: `POST /prl/detach`) is refused within a second.

What an attached run's key may do (`access`), checked by the server's auth middleware before a route runs:
generate (prl's token route and the OpenAI completion routes) with its own adapter's name or the base
model's, load its own adapter (`POST /prl/weights`, from its own run directory), read its own view of
`GET /prl/live`, and detach; its generation-only key only generates and lists models
(prl.run.api.GENERATION_KEY_PATHS, the rest 403). Another run's adapter name is 404, as an unknown model; every other route
(pausing the pool, vLLM's RL and admin routes) is 403. The pool's own key may do everything but load
adapters. No torch, vLLM or FastAPI here: `prl submit` and `prl status` use it on login nodes.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prl.errors import ConfigError, RunDirError
from prl.run import records
from prl.run.api import GENERATE_PATHS, generation_key, generation_refusal
from prl.run.records import TenantRecord
from prl.run.rundir import RunDir, atomic_write_json
from prl.states import Role

TENANTS_DIR = "tenants"
NAME = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")
"""A tenant's name: its adapter's served model name (what vLLM's OpenAI routes accept as a model)."""
RESCAN_S = 1.0
"""Least time between two readings of the records by a server (they are read again on a request after it)."""

TENANT_PATHS = GENERATE_PATHS | {"/v1/models", "/prl/weights", "/prl/live", "/prl/detach"}
"""Every route an attached run's key may call."""


@dataclass(frozen=True)
class Tenant:
    name: str
    run_dir: Path
    digest: bytes
    """SHA-256 of the run's API key."""
    attached: float | None = None
    generation_digest: bytes | None = None
    """SHA-256 of the run's generation-only key (None: a record written before there was one)."""
    """When the run attached (its `prl submit`)."""


def digest(key: str) -> bytes:
    return hashlib.sha256(key.strip().encode()).digest()


def tenants_dir(pool: RunDir) -> Path:
    return pool.root / TENANTS_DIR


def tenant_file(pool: RunDir, name: str) -> Path:
    if not NAME.match(name):
        raise ConfigError(f"{name!r} cannot name a run in an inference pool: letters, digits, '.', '_', '-', "
                          f"at most 64, starting with a letter or digit")
    return tenants_dir(pool) / f"{name}.json"


def attach(pool: RunDir, name: str, run_dir: str | Path, key: str) -> Path:
    """Record run `run_dir` (API key `key`) as tenant `name` of `pool`; its servers accept the key from now on.
    ConfigError when another run holds the name (a run attaching again, e.g. on resume, replaces its record)."""
    path = tenant_file(pool, name)
    run_dir = Path(run_dir).resolve()
    check_attachable(pool, name, run_dir)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    atomic_write_json(path, TenantRecord(name=name, run_dir=str(run_dir), key_sha256=digest(key).hex(),
                                         generation_sha256=digest(generation_key(key)).hex(), attached=time.time()))
    return path


def detach(pool: RunDir, name: str) -> bool:
    """Remove tenant `name`'s record; whether there was one."""
    path = tenant_file(pool, name)
    existed = path.exists()
    path.unlink(missing_ok=True)
    return existed


def detach_if(pool: RunDir, judged: Tenant) -> bool:
    """Remove `judged`'s record only if it is still that record (compare-and-delete: a run attaching again since,
    with a new record, keeps it); whether it was removed. The record is moved aside first, so an attach between
    the comparison and the removal is put back, never lost."""
    path = tenant_file(pool, judged.name)
    aside = path.with_name(f".{path.name}.reaped.{os.getpid()}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    held = read_tenant(aside)
    if held is not None and (held.digest, held.attached) == (judged.digest, judged.attached):
        aside.unlink(missing_ok=True)
        return True
    with contextlib.suppress(FileExistsError):  # an attach wrote a newer record meanwhile: that one stands
        os.link(aside, path)
    aside.unlink(missing_ok=True)
    return False


def check_attachable(pool: RunDir, name: str, run_dir: str | Path) -> None:
    """ConfigError when `attach` would refuse (checked before a submission writes anything)."""
    held = read_tenant(tenant_file(pool, name))
    if held is not None and held.run_dir != Path(run_dir).resolve():
        raise ConfigError(f"inference pool {pool.root}: the name {name!r} is attached to {held.run_dir}; give this "
                          f"run another name (topology `name`), or detach that run first")


def leave(pool: RunDir, name: str, key: str, timeout: float = 10.0, judged: Tenant | None = None) -> list[str]:
    """Detach run `name` from every server of `pool` (each unloads its adapter: `POST /prl/detach` with the run's
    key), then remove its record; the servers that answered. A server that does not answer keeps the adapter
    until vLLM's LRU cache evicts it (the run's key is refused there too once the record is gone)."""
    import urllib.error
    import urllib.request

    done = []
    for endpoint in (pool.endpoints().get(Role.INFERENCE) or {}).values():
        url = (endpoint.url or "").rstrip("/")
        if not url:
            continue
        request = urllib.request.Request(f"{url}/prl/detach", data=b"{}", method="POST",
                                         headers={"Authorization": f"Bearer {key}",
                                                  "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout):
                done.append(url)
        except (OSError, urllib.error.HTTPError):
            pass
    if judged is None:
        detach(pool, name)
    else:
        detach_if(pool, judged)
    return done


def read_tenant(path: Path) -> Tenant | None:
    """The record at `path`; None when missing or not a record (a half-written one is never seen: atomic)."""
    try:
        record = records.read(path, TenantRecord)
    except (OSError, RunDirError):
        return None
    if record is None:
        return None
    generation = None if record.generation_sha256 is None else bytes.fromhex(record.generation_sha256)
    return Tenant(record.name, Path(record.run_dir), bytes.fromhex(record.key_sha256), record.attached, generation)


def read_tenants(pool: RunDir) -> dict[str, Tenant]:
    """Every tenant of `pool`, by name."""
    folder = tenants_dir(pool)
    found = (read_tenant(p) for p in sorted(folder.glob("*.json"))) if folder.is_dir() else ()
    return {t.name: t for t in found if t is not None and NAME.match(t.name)}


def attached_runs(pool: RunDir) -> list[dict]:
    """What `prl status` shows of a pool's tenants: name, run directory, when it attached."""
    return [{"name": name, "run_dir": str(t.run_dir), "attached": t.attached} for name, t in read_tenants(pool).items()]


def reap(pool: RunDir, ended: Callable[[list[RunDir]], dict[Path, str]]) -> dict[str, str]:
    """Detach every tenant whose run's job ended without detaching (its launcher killed -9, say, or a job Slurm
    ended before the launcher could): each server unloads the adapter (`leave`, with the run's key) and the record
    goes. `ended(runs)` says which of those runs' jobs ended, and how (run directory -> state); a run it cannot
    judge is left alone, and so is a record newer than its run's job record (a submission on its way). Returns
    name -> why."""
    held = read_tenants(pool)
    judged: dict[str, RunDir] = {}
    jobs: dict = {}
    why: dict[str, str] = {}
    for name, tenant in held.items():
        run = RunDir(tenant.run_dir)
        if not run.root.is_dir():
            why[name] = f"its run directory {run.root} is gone"
            continue
        try:
            job = run.read_job()
        except (OSError, ValueError, ConfigError):
            continue
        if job is not None and tenant.attached is not None and job.submitted >= tenant.attached:
            judged[name], jobs[name] = run, job
    states = ended(list(judged.values()))
    for name, run in judged.items():
        if (state := states.get(run.root)) is not None:
            why[name] = f"its job ended ({state}) without detaching"
    return {name: reason for name, reason in why.items() if _reap_one(pool, held[name], jobs.get(name))}


def _reap_one(pool: RunDir, judged: Tenant, job_judged) -> bool:
    """Detach `judged` if its record and its run's job are still the ones judged ended (a run resubmitted since
    has a new job record and a new tenant record: left alone); with the run's key only if it is the judged key."""
    run = RunDir(judged.run_dir)
    try:
        job_now = run.read_job() if job_judged is not None else None
        key = run.read_api_key()
    except (OSError, ValueError, ConfigError, RunDirError):
        job_now, key = job_judged, ""
    if job_judged is not None and (job_now is None or (job_now.job_id, job_now.submitted)
                                   != (job_judged.job_id, job_judged.submitted)):
        return False
    if read_tenant(tenant_file(pool, judged.name)) != judged:
        return False
    if key and hmac.compare_digest(digest(key), judged.digest):
        leave(pool, judged.name, key, judged=judged)  # every server unloads its adapter; the record goes
        return True
    return detach_if(pool, judged)  # its key refused within RESCAN_S; the adapter ages out of vLLM's LRU cache


class Registry:
    """The tenants as a server sees them: the records, read again on a request at most every RESCAN_S."""

    def __init__(self, pool: RunDir) -> None:
        self.pool = pool
        self._tenants: dict[str, Tenant] = {}
        self._read_at = float("-inf")
        self.refresh()

    def refresh(self) -> None:
        self._tenants = read_tenants(self.pool)
        self._read_at = time.monotonic()

    def by_key(self, key: str) -> Tenant | None:
        """The tenant whose key this is, from records read at most RESCAN_S ago: a run attached or detached
        since counts within a second."""
        return self._find(digest(key), "digest")

    def by_generation_key(self, key: str) -> Tenant | None:
        """The tenant whose generation-only key this is (as `by_key`)."""
        return self._find(digest(key), "generation_digest")

    def _find(self, wanted: bytes, field: str) -> Tenant | None:
        if time.monotonic() - self._read_at >= RESCAN_S:
            self.refresh()
        # Every record compared, in constant time each: which key matched, or that none did, takes the same time.
        found = None
        for tenant in self._tenants.values():
            if hmac.compare_digest(getattr(tenant, field) or b"", wanted):
                found = tenant
        return found

    def get(self, name: str) -> Tenant | None:
        return self._tenants.get(name)

    def names(self) -> list[str]:
        return sorted(self._tenants)

    def forget(self, name: str) -> None:
        """Drop `name` until its record is read again (the next request rereads them: a run may attach again)."""
        self._tenants.pop(name, None)
        self._read_at = float("-inf")


def access(tenant: Tenant, method: str, path: str, body: bytes, base_model: str,
           generation: bool = False) -> tuple[int, str] | None:
    """Why `tenant` may not make this request, as (HTTP status, message), `generation`: with its generation-only
    key; None when it may."""
    if generation and (refused := generation_refusal(path)) is not None:
        return refused
    if path not in TENANT_PATHS:
        return 403, (f"{path} is the inference pool's: run {tenant.name!r} may generate, load and detach its own "
                     f"adapter, and read /prl/live")
    if method != "POST" or path not in GENERATE_PATHS:
        return None
    try:
        model = json.loads(body or b"{}").get("model")
    except (ValueError, AttributeError):
        return None  # not a JSON object: the route itself answers 400
    except RecursionError:  # a body nested past the parser's depth: refused here, not a 500 from this check
        return 400, "request body: JSON nested too deeply to read (a chat request nests a few levels)"
    if model is None or model in (tenant.name, base_model):
        return None
    return 404, f"The model `{str(model)[:80]}` does not exist."
