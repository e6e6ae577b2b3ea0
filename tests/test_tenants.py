"""Runs attached to an inference pool (prl/run/tenants.py): their records, keys and what each may call.
The real server with two attached runs: tests/test_pool.py."""

from __future__ import annotations

import json
import hmac
import os
import shutil
import stat
import subprocess
import time

import pytest

from prl.errors import ConfigError
from prl.run import tenants
from prl.run.api import generation_key
from prl.run.rundir import RunDir


@pytest.fixture
def pool(tmp_path):
    return RunDir(tmp_path / "pool").create()


def test_a_run_attaches_with_its_key_s_digest_only_and_detaches(pool, tmp_path):
    path = tenants.attach(pool, "exp-a", tmp_path / "a", "secret-a")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert "secret-a" not in path.read_text()  # the key stays in the run's own directory
    record = json.loads(path.read_text())
    assert record["run_dir"] == str((tmp_path / "a").resolve()) and record["name"] == "exp-a"
    generation = generation_key("secret-a")  # what the run's orchestrator and environments generate with
    assert generation not in path.read_text() and record["generation_sha256"] == tenants.digest(generation).hex()
    assert [r["name"] for r in tenants.attached_runs(pool)] == ["exp-a"]
    tenants.attach(pool, "exp-a", tmp_path / "a", "new-key")  # the same run again (a resume): replaced
    assert tenants.read_tenants(pool)["exp-a"].digest == tenants.digest("new-key")
    with pytest.raises(ConfigError, match="'exp-a' is attached to .*/a; give this run another name"):
        tenants.attach(pool, "exp-a", tmp_path / "b", "secret-b")
    with pytest.raises(ConfigError, match="cannot name a run in an inference pool"):
        tenants.attach(pool, "../escape", tmp_path / "b", "secret-b")
    assert tenants.detach(pool, "exp-a") and not tenants.detach(pool, "exp-a")
    assert tenants.read_tenants(pool) == {}


def test_a_pool_detaches_runs_whose_job_ended_without_detaching(pool, tmp_path):
    """The pool launcher's reaper (prl/job/launch.py `ended_jobs`, prl/run/tenants.py `reap`) on real run
    directories: a run whose local launcher is gone without recording an end (killed -9) and one whose launcher
    recorded an end go, and so does one whose directory was deleted; a live one, one whose record is newer than its
    job record (a resubmission on its way) and one on another host (pids say nothing there) stay."""
    from prl.job.launch import ended_jobs
    from prl.run.records import JobRecord, LauncherRecord
    from prl.run.rundir import atomic_write_json
    from prl.states import Backend, LauncherStatus

    gone = subprocess.Popen(["true"])
    gone.wait()

    def run(name: str, pid: int, status: LauncherStatus, submitted_later: bool = True) -> RunDir:
        rundir = RunDir(tmp_path / name).create()
        rundir.create_api_key()
        tenants.attach(pool, name, rundir.root, rundir.read_api_key())
        submitted = time.time() + (1 if submitted_later else -60)
        rundir.write_job(JobRecord(job_id=f"local-{name}", name=name, backend=Backend.LOCAL, cluster="local",
                                   submitted=submitted, run_dir=str(rundir.root), pid=pid))
        atomic_write_json(rundir.launcher_state, LauncherRecord(attempt=1, status=status))
        return rundir

    run("killed", gone.pid, LauncherStatus.RUNNING)
    run("completed", os.getpid(), LauncherStatus.COMPLETED)
    run("alive", os.getpid(), LauncherStatus.RUNNING)
    run("resubmitting", gone.pid, LauncherStatus.RUNNING, submitted_later=False)
    shutil.rmtree(run("deleted", gone.pid, LauncherStatus.RUNNING).root)

    elsewhere = tenants.reap(pool, lambda runs: ended_jobs(runs, local_pids=False))
    assert sorted(elsewhere) == ["completed", "deleted"], elsewhere
    assert "ended (completed)" in elsewhere["completed"] and "is gone" in elsewhere["deleted"]
    here = tenants.reap(pool, lambda runs: ended_jobs(runs, local_pids=True))
    assert here == {"killed": "its job ended (its launcher died without recording an end) without detaching"}
    assert sorted(tenants.read_tenants(pool)) == ["alive", "resubmitting"]


def test_the_reaper_leaves_a_run_resubmitted_between_its_judgement_and_its_detach(pool, tmp_path):
    """The race forced: while the reaper judges a run's old job ended, the run is submitted again (a new key, a
    new tenant record, a new job record). The reaper detaches only the record it judged: the new one stays."""
    from prl.job.launch import ended_jobs
    from prl.run.records import JobRecord, LauncherRecord
    from prl.run.rundir import atomic_write_json
    from prl.states import Backend, LauncherStatus

    rundir = RunDir(tmp_path / "again").create()
    rundir.create_api_key()
    tenants.attach(pool, "again", rundir.root, rundir.read_api_key())

    def job(status: LauncherStatus, job_id: str) -> None:
        rundir.write_job(JobRecord(job_id=job_id, name="again", backend=Backend.LOCAL, cluster="local",
                                   submitted=time.time() + 1, run_dir=str(rundir.root), pid=os.getpid()))
        atomic_write_json(rundir.launcher_state, LauncherRecord(attempt=1, status=status))

    job(LauncherStatus.FAILED, "local-old")

    def judge_then_resubmit(runs):
        states = ended_jobs(runs, local_pids=True)  # the old job: ended
        rundir.create_api_key()
        time.sleep(0.01)
        tenants.attach(pool, "again", rundir.root, rundir.read_api_key())
        job(LauncherStatus.RUNNING, "local-new")
        return states

    assert tenants.reap(pool, judge_then_resubmit) == {}
    held = tenants.read_tenants(pool)["again"]
    assert hmac.compare_digest(held.digest, tenants.digest(rundir.read_api_key()))


def test_the_pool_launcher_checks_its_runs_beside_its_loop_one_check_at_a_time(pool, monkeypatch):
    """`Launcher.check_tenants` returns at once while a check waits on Slurm or on a server that does not answer,
    and starts no second check while one runs."""
    import threading

    from prl.job import launch

    calls, release = [], threading.Event()

    def slow_reap(run, ended):
        calls.append(run)
        release.wait(30)
        return {"gone": "its job ended (COMPLETED) without detaching"}

    monkeypatch.setattr(tenants, "reap", slow_reap)
    launcher = launch.Launcher(pool, None, 1, False, "local")
    launcher.tenants_checked = -launch.TENANTS_CHECK_S
    started = time.monotonic()
    launcher.check_tenants()
    launcher.tenants_checked = -launch.TENANTS_CHECK_S  # due again, but the first check still runs
    launcher.check_tenants()
    assert time.monotonic() - started < 1 and calls == [pool] and launcher.reaper.is_alive()
    release.set()
    launcher.reaper.join(10)
    assert not launcher.reaper.is_alive()


def test_a_pool_judges_slurm_runs_by_their_jobs_states_on_the_lab_cluster(pool, tmp_path, slurm_cluster):
    """The reaper's Slurm branch (`ended_jobs`: one query for every Slurm run, terminal states only) against real
    jobs: a run whose job completed is detached and one whose job still runs stays; once that job is cancelled it
    goes too, named by Slurm's state."""
    from prl.job.launch import ended_jobs
    from prl.ops import slurm
    from prl.run.records import JobRecord
    from prl.states import Backend, JobState
    from tests.helpers import wait_for

    def run(name: str, command: str) -> str:
        out = subprocess.run(["sbatch", "--parsable", f"--partition={slurm_cluster.partition}", f"--chdir={tmp_path}",
                              f"--job-name=prl-reap-{name}", "--output=/dev/null", f"--wrap={command}"],
                             capture_output=True, text=True, timeout=30, check=True)
        job_id = out.stdout.strip().split(";")[0]
        rundir = RunDir(tmp_path / name).create()
        rundir.create_api_key()
        tenants.attach(pool, name, rundir.root, rundir.read_api_key())
        rundir.write_job(JobRecord(job_id=job_id, name=name, backend=Backend.SLURM, cluster="lab",
                                   submitted=time.time() + 1, run_dir=str(rundir.root)))
        return job_id

    def state(job_id: str) -> JobState:
        return slurm.merge_state(slurm.query_jobs([job_id]).values())

    def reap() -> dict[str, str]:
        return tenants.reap(pool, lambda runs: ended_jobs(runs, local_pids=False))

    done, running = run("done", "true"), run("running", "sleep 300")
    try:
        wait_for("the short job to complete", lambda: state(done) == JobState.COMPLETED, timeout=60)
        wait_for("the long job to run", lambda: state(running) == JobState.RUNNING, timeout=60)
        assert reap() == {"done": "its job ended (COMPLETED) without detaching"}
        assert sorted(tenants.read_tenants(pool)) == ["running"]
    finally:
        subprocess.run(["scancel", running], timeout=30, check=False)
    assert wait_for("the cancelled run to be detached", reap, timeout=60, interval=1.0) == {
        "running": "its job ended (CANCELLED) without detaching"}
    assert tenants.read_tenants(pool) == {}


def test_the_registry_finds_a_key_in_records_read_at_most_a_rescan_ago(pool, tmp_path, monkeypatch):
    tenants.attach(pool, "a", tmp_path / "a", "key-a")
    registry = tenants.Registry(pool)
    assert registry.by_key("key-a").name == "a" and registry.by_key("key-b") is None
    tenants.attach(pool, "b", tmp_path / "b", "key-b")
    assert registry.by_key("key-b") is None  # read less than RESCAN_S ago: not yet
    monkeypatch.setattr(tenants, "RESCAN_S", 0.0)
    assert registry.by_key("key-b").name == "b"  # attached after the server started
    registry.forget("a")  # what the server does on /prl/detach: until the record is read again
    assert registry.get("a") is None and registry.by_key("key-a").name == "a"
    tenants.detach(pool, "a")  # the record removed: refused
    assert registry.by_key("key-a") is None
    (tenants.tenants_dir(pool) / "broken.json").write_text("{not json")
    time.sleep(0.01)
    registry.refresh()
    assert sorted(t for t in ("a", "b", "broken") if registry.get(t)) == ["b"]


@pytest.mark.parametrize("method,path,body,expected", [
    ("POST", "/inference/v1/generate", {"model": "a", "token_ids": [1]}, None),
    ("POST", "/v1/chat/completions", {"model": "base"}, None),
    ("POST", "/v1/completions", {"prompt": "x"}, None),
    ("POST", "/inference/v1/generate", {"model": "b"}, 404),
    ("POST", "/v1/chat/completions", {"model": "b"}, 404),
    ("POST", "/prl/weights", {"step": 3}, None),
    ("GET", "/prl/live", None, None),
    ("POST", "/prl/detach", None, None),
    ("POST", "/pause", None, 403),
    ("POST", "/resume", None, 403),
    ("POST", "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": "/x"}, 403),
    ("POST", "/v1/unload_lora_adapter", {"lora_name": "b"}, 403),
    ("GET", "/metrics", None, 403),
])
def test_what_an_attached_run_may_call(method, path, body, expected):
    a = tenants.Tenant("a", "/runs/a", tenants.digest("key-a"))
    raw = json.dumps(body).encode() if body is not None else b""
    refused = tenants.access(a, method, path, raw, base_model="base")
    assert (refused[0] if refused else None) == expected, refused
    if expected == 404:
        assert refused[1] == "The model `b` does not exist."  # as for any unknown model: nothing said of run b


def test_an_attached_run_s_generation_key_generates_with_its_adapter_and_nothing_else(pool, tmp_path, monkeypatch):
    """The pool's middleware, as a request meets it: a run's generation-only key generates with its own adapter
    (the request carries the run's name on) and lists models; loading, detaching, /prl/live and the pool's routes
    are 403, naming the route. The pool's own generation key is held to the same routes."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from prl.inference import server

    tenants.attach(pool, "a", tmp_path / "a", "key-a")
    monkeypatch.setattr(server, "_API_KEY", "pool-key")
    monkeypatch.setattr(server, "_TENANTS", tenants.Registry(pool))
    monkeypatch.setattr(server, "_BASE_MODEL", "base")

    async def routed(request):
        return JSONResponse({"tenant": request.scope.get("state", {}).get("prl_tenant")})

    paths = ("/v1/chat/completions", "/v1/models", "/prl/weights", "/prl/detach", "/prl/live", "/pause")
    app = Starlette(routes=[Route(p, routed, methods=["GET", "POST"]) for p in paths])
    app.add_middleware(server.PoolAuth)
    client = TestClient(app)

    def ask(key: str, path: str, body=None):
        return client.post(path, json=body or {}, headers={"Authorization": f"Bearer {key}"})

    run_key = generation_key("key-a")
    assert ask(run_key, "/v1/chat/completions", {"model": "a"}).json() == {"tenant": "a"}
    assert ask(run_key, "/v1/chat/completions", {"model": "b"}).status_code == 404
    assert ask(run_key, "/v1/models").status_code == 200
    assert ask(generation_key("pool-key"), "/v1/chat/completions", {"model": "a"}).json() == {"tenant": None}
    for key in (run_key, generation_key("pool-key")):
        for path in ("/prl/weights", "/prl/detach", "/prl/live", "/pause"):
            r = ask(key, path, {"step": 3})
            assert r.status_code == 403 and r.json()["error"].startswith(f"{path} needs the run's key"), (path, r.text)
    assert ask("key-a", "/prl/weights", {"step": 3}).json() == {"tenant": "a"}  # the run's own key still loads
    assert ask(generation_key("key-b"), "/v1/models").status_code == 401


def test_a_deeply_nested_body_is_refused_400_with_its_reason_not_a_500():
    a = tenants.Tenant("a", "/runs/a", tenants.digest("key-a"))
    raw = b'{"model": "a", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    refused = tenants.access(a, "POST", "/v1/chat/completions", raw, base_model="base")
    assert refused is not None and refused[0] == 400 and "nested too deeply" in refused[1], refused


def plan_json(run_dir) -> dict:
    return json.loads((run_dir / "plan.json").read_text())


def test_a_pool_plans_its_servers_alone_and_a_run_attaches_to_it(tmp_path, env):
    """configs/local-pool.yaml plans one server with --tenants and the pool's LoRA limits, no trainer; an attached
    run (configs/local-pool-run.yaml) plans a trainer and an orchestrator, no server, and names the pool."""
    from tests.helpers import prl_cli

    pool, run = tmp_path / "pool", tmp_path / "run"
    prl_cli(env, "plan", "configs/local-pool.yaml", f"run_dir={pool}")
    planned = plan_json(pool)
    assert planned["trainer"] is None and planned["orchestrator"] is None and planned["pool"]["max_lora_rank"] == 8
    [server] = planned["servers"]
    args = " ".join(server["args"])
    assert "--tenants --enable-lora --max-lora-rank 8 --max-loras 2 --max-cpu-loras 8" in args, args
    assert [s["name"] for s in planned["launches"]] == ["inference"]
    out = prl_cli(env, "plan", "configs/local-pool-run.yaml", f"run_dir={run}", f"inference.attach={pool}")
    assert f"inference: the pool {pool}" in out.stdout
    attached = plan_json(run)
    assert attached["attach"] == str(pool) and attached["servers"] == [] and attached["pool"] is None
    assert {s["name"]: s["start_after"] for s in attached["launches"]} == {"orchestrator": [], "trainer": []}


@pytest.mark.parametrize("overrides,says", [
    (["inference.attach={tmp}/nowhere"], "is not a prl run directory (no plan.json)"),
    (["inference.attach={tmp}/rl"], "which is not an inference pool"),
    (["model.lora.rank=16"], "rank 16 is over the pool's max_lora_rank (8"),
    (["model.lora=null"], "set model.lora"),
    (["model.path=models/other"], "an adapter is served on its own base model"),
    (["name=local-pool"], "like the pool it attaches to"),
    (["inference.nodes=1"], "nodes places servers of this run, and inference.attach uses a pool's"),
    (["orchestrator.placement=inference"], "no inference nodes of its own"),
    (["training.router_replay=true"], "router replay needs the run's own servers"),
])
def test_what_cannot_attach_to_a_pool_is_refused_at_its_field(tmp_path, env, overrides, says):
    from tests.helpers import prl_cli

    prl_cli(env, "plan", "configs/local-pool.yaml", f"run_dir={tmp_path / 'pool'}")
    prl_cli(env, "plan", "configs/local-lora.yaml", f"run_dir={tmp_path / 'rl'}")
    given = [o.format(tmp=tmp_path) for o in overrides]
    out = prl_cli(env, "plan", "configs/local-pool-run.yaml", f"run_dir={tmp_path / 'run'}",
                  f"inference.attach={tmp_path / 'pool'}", *given, check=False)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    assert says in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not (tmp_path / "run").exists()


def test_a_pool_runs_servers_only(tmp_path, env):
    from tests.helpers import prl_cli

    for extra, says in ((["trainer.nodes=1"], "an inference pool (pool:) runs inference servers only: remove trainer"),
                        (["model.lora.rank=8"], "the attached runs set model.lora")):
        out = prl_cli(env, "plan", "configs/local-pool.yaml", f"run_dir={tmp_path / 'pool'}", *extra, check=False)
        assert out.returncode != 0 and says in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_status_of_a_pool_lists_its_attached_runs_and_a_run_names_its_pool(tmp_path, env):
    from tests.helpers import prl_cli

    pool, run = tmp_path / "pool", tmp_path / "run"
    prl_cli(env, "plan", "configs/local-pool.yaml", f"run_dir={pool}")
    prl_cli(env, "plan", "configs/local-pool-run.yaml", f"run_dir={run}", f"inference.attach={pool}")
    shown = json.loads(prl_cli(env, "status", pool, "--json").stdout)
    assert shown["attached"] == [] and shown["pool"] is None and shown["progress"] == {}
    tenants.attach(RunDir(pool), "local-pool-run", run, "key")
    shown = json.loads(prl_cli(env, "status", pool, "--json").stdout)
    assert [(a["name"], a["run_dir"], a["adapter_step"]) for a in shown["attached"]] == [
        ("local-pool-run", str(run.resolve()), None)]
    text = prl_cli(env, "status", pool).stdout
    assert "attached runs: 1" in text and f"local-pool-run: -, adapter step -, {run.resolve()}" in text, text
    shown = json.loads(prl_cli(env, "status", run, "--json").stdout)
    assert shown["pool"] == str(pool) and shown["attached"] is None
    assert f"inference: the pool {pool}" in prl_cli(env, "status", run).stdout


def test_a_pool_reads_an_attached_run_s_body_no_further_than_its_route_s_bound(pool, tmp_path, monkeypatch):
    """PoolAuth reads a generate body to check its model: within the route's own bound (the app's
    `body_limits`), not the server-wide MAX_BODY_BYTES, so an oversize body is refused after ~limit bytes."""
    import asyncio
    from types import SimpleNamespace

    from prl.inference import server

    tenants.attach(pool, "a", tmp_path / "a", "key-a")
    monkeypatch.setattr(server, "_API_KEY", "pool-key")
    monkeypatch.setattr(server, "_TENANTS", tenants.Registry(pool))
    monkeypatch.setattr(server, "_BASE_MODEL", "base")
    reached = []

    async def app(scope, receive, send):
        reached.append(scope["path"])

    auth = server.PoolAuth(app)
    limit, chunk = 1000, b"x" * 100
    scope = {"type": "http", "method": "POST", "path": "/inference/v1/generate", "root_path": "",
             "headers": [(b"authorization", b"Bearer key-a")],
             "app": SimpleNamespace(state=SimpleNamespace(body_limits={"/inference/v1/generate": limit}))}
    reads, sent = [], []

    async def receive():
        reads.append(len(chunk))
        return {"type": "http.request", "body": chunk, "more_body": True}  # a body that never ends

    async def send(message):
        sent.append(message)

    asyncio.run(auth(scope, receive, send))
    assert sent[0]["status"] == 413 and not reached
    assert f"over {limit} bytes".encode() in b"".join(m.get("body", b"") for m in sent)
    assert sum(reads) <= limit + len(chunk), sum(reads)
