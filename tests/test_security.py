"""Who may call a run's servers, what a run leaves readable on disk, and what its endpoints refuse.

- every route but /health of the inference server and the router needs the run's key (routes are
  enumerated from the apps, so a new route without authentication fails here);
- the key lives only in RUN/api_key (0600), never in plan.json, job.json, scripts or logs;
- the run directory is 0700 and prl's files in it 0600;
- `${oc.env:...}` values never reach the disk; they stay references resolved on the node;
- `submit --resume` is refused while the previous job still runs (local and Slurm);
- out-of-range and oversized requests get a 400/413 with a reason, never a 500, and leave no
  request behind in the engine.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from starlette.requests import Request

from tests.helpers import REPO, prl_cli as prl, wait_for
from tests.vllm_fixtures import http_json, server_fixture, start_inference
from testkit.pictures import png_url

KEY_VAR = "PRL_TEST_API_KEY"
KEY = "k-" + "x" * 40


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def files_under(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and not p.is_symlink()]


def contents(path: Path) -> bytes:
    """A file's bytes; b"" for one that vanished since it was listed (an atomic write's temp file, renamed)."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return b""


def state(env, run) -> dict:
    return json.loads(prl(env, "status", run, "--json").stdout)


# ---------------------------------------------------------------- run directory and key file


def test_a_run_dir_that_is_not_this_run_is_refused_and_left_as_it_was(tmp_path):
    """`run_dir` naming a home directory, a checkout or a symlink to one (anything neither empty nor a prl run
    of this name) is refused in one line, before prl makes it private or replaces a file in it."""
    env = {**os.environ, "PRL_HOME": str(tmp_path / "home")}
    home = tmp_path / "someones-home"
    home.mkdir(mode=0o755)
    (home / "notes.txt").write_text("mine")
    (tmp_path / "link").symlink_to(home)
    other = tmp_path / "other-run"
    prl(env, "plan", "configs/local-tiny.yaml", f"run_dir={other}", "name=other")
    for run_dir, says in ((home, "holds notes.txt"), (tmp_path / "link", "holds notes.txt"),
                          (other, "a prl run of 'other'"), (home / "notes.txt", "is not a directory")):
        out = prl(env, "plan", "configs/local-tiny.yaml", f"run_dir={run_dir}", check=False)
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and says in out.stderr, out.stderr
    assert sorted(p.name for p in home.iterdir()) == ["notes.txt"] and mode(home) == 0o755
    assert json.loads((other / "plan.json").read_text())["name"] == "other"
    # An empty directory, and the run's own directory planned again, are fine.
    (tmp_path / "empty").mkdir()
    for run_dir in (tmp_path / "empty", tmp_path / "empty"):
        prl(env, "plan", "configs/local-tiny.yaml", f"run_dir={run_dir}")
    assert (tmp_path / "empty" / "plan.json").exists()


def test_run_directory_and_its_files_are_private(tmp_path):
    from prl.run.rundir import RunDir, atomic_write_json

    run = RunDir(tmp_path / "run").create()
    assert mode(run.root) == 0o700
    assert all(mode(d) == 0o700 for d in (run.scripts_dir, run.logs_dir, run.state_dir, run.root / "weights"))
    atomic_write_json(run.state_dir / "x.json", {"a": 1})
    run.append_metrics({"role": "trainer", "step": 1})
    run.heartbeat("trainer", step=1)
    for path in (run.state_dir / "x.json", run.metrics_jsonl, run.role_state("trainer")):
        assert mode(path) == 0o600, path
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    RunDir(loose).create()
    assert mode(loose) == 0o700, "an existing run directory is made private too"


def test_the_run_registry_is_private_and_an_old_one_is_made_so(tmp_path, monkeypatch):
    """The registry lists every run directory and job of the user: 0600 in a 0700 folder, even under umask 0."""
    from prl.ops.registry import entries, register, registry_path
    from prl.run.records import JobRecord
    from prl.run.rundir import RunDir
    from prl.states import Backend

    monkeypatch.setenv("PRL_HOME", str(tmp_path / "home"))
    job = JobRecord(job_id="7", name="r", backend=Backend.LOCAL, cluster="local", submitted=1.0,
                    run_dir=str(tmp_path / "run"))
    old = os.umask(0)
    try:
        register(RunDir(tmp_path / "run"), job)
    finally:
        os.umask(old)
    assert (mode(registry_path()), mode(registry_path().parent)) == (0o600, 0o700)
    registry_path().chmod(0o644)  # written by an older prl
    registry_path().parent.chmod(0o755)
    register(RunDir(tmp_path / "run"), job)
    assert (mode(registry_path()), mode(registry_path().parent)) == (0o600, 0o700)
    assert [e.job_id for e in entries()] == ["7", "7"]


def test_atomic_write_is_private_before_the_rename(tmp_path, monkeypatch):
    """No window where the new file is readable by others: the temp file is 0600 from its creation."""
    from prl.run import rundir

    seen = []
    real_replace = os.replace

    def spy(src, dst):
        seen.append(mode(Path(src)))
        return real_replace(src, dst)

    monkeypatch.setattr(rundir.os, "replace", spy)
    old = os.umask(0)  # even with a permissive umask
    try:
        rundir.atomic_write_text(tmp_path / "f", "secret")
    finally:
        os.umask(old)
    assert seen == [0o600] and mode(tmp_path / "f") == 0o600


def test_api_key_file(tmp_path):
    from prl.errors import RunDirError
    from prl.run.rundir import RunDir

    run = RunDir(tmp_path / "run").create()
    with pytest.raises(RunDirError, match="no API key in .*api_key"):
        run.read_api_key()
    run.create_api_key()
    first = run.read_api_key()
    assert mode(run.api_key_file) == 0o600 and len(first) >= 40
    run.create_api_key()
    assert run.read_api_key() != first, "each submission gets a new key"
    run.api_key_file.write_text("\n")
    with pytest.raises(RunDirError):
        run.read_api_key()


# ---------------------------------------------------------------- ${oc.env:...} stays off the disk


def test_environment_values_never_reach_the_run_directory(tmp_path):
    secret = "hunter2-" + os.urandom(8).hex()
    run = tmp_path / "run"
    env = {**os.environ, "PRL_TEST_SECRET": secret, "PRL_HOME": str(tmp_path / "home")}
    prl(env, "plan", "configs/local-tiny.yaml", f"run_dir={run}", "trainer.env.MY_TOKEN=${oc.env:PRL_TEST_SECRET}",
        "orchestrator.env.WITH_DEFAULT=x-${oc.env:PRL_TEST_UNSET,fallback}")
    written = files_under(run)
    assert {p.name for p in written} >= {"plan.json", "topology.yaml", "trainer.sh"}
    assert [p for p in written if secret.encode() in p.read_bytes()] == []
    assert "${oc.env:PRL_TEST_SECRET}" in (run / "topology.yaml").read_text()
    assert mode(run) == 0o700 and all(mode(p) in (0o600, 0o700) for p in written)

    # On the node, the launch script reads the variable from the job's environment.
    def exported(script: str, name: str, node_env: dict) -> subprocess.CompletedProcess:
        text = (run / "scripts" / script).read_text()
        body = re.sub(r"^exec .*$", f'printf %s "${name}"', text, flags=re.M)
        return subprocess.run(["bash", "-c", body], capture_output=True, text=True, env=node_env)

    assert exported("trainer.sh", "MY_TOKEN", {"PRL_TEST_SECRET": secret}).stdout == secret
    missing = exported("trainer.sh", "MY_TOKEN", {})
    assert missing.returncode != 0 and "PRL_TEST_SECRET: is not set where this role runs" in missing.stderr
    assert exported("orchestrator.sh", "WITH_DEFAULT", {}).stdout == "x-fallback"


@pytest.mark.parametrize("override, field, says", [
    ("name=${oc.env:PRL_TEST_SECRET}", "(name)", "would write PRL_TEST_SECRET's value into plan.json"),
    ('inference.extra_args=["--token","${oc.env:PRL_TEST_SECRET}"]', "(inference.extra_args[1])", "`env:` map"),
    ("trainer.env.A=${oc.env:PRL_TEST_UNSET}", "(trainer.env.A)", "PRL_TEST_UNSET is not set"),
    ("trainer.env.A=${oc.decode:${oc.env:PRL_TEST_SECRET}}", "(trainer.env.A)", "cannot use other interpolation"),
    # Other spellings of the same read: spaces or quotes inside the braces, a read hidden in a default.
    ("name=${ oc.env:PRL_TEST_SECRET }", "(name)", "would write PRL_TEST_SECRET's value into plan.json"),
    ('name=${oc.env:"PRL_TEST_SECRET"}', "(name)", "write environment references as `${oc.env:NAME}`"),
    ("name=x${oc.env:USER,${oc.env:PRL_TEST_SECRET}}", "(name)", "write environment references as `${oc.env:NAME}`"),
    ("name=x${ oc.env:USER,${ oc.env:PRL_TEST_SECRET}}", "(name)", "would write PRL_TEST_SECRET's value"),
    ("trainer.env.A=${ oc.env:PRL_TEST_SECRET }", "(trainer.env.A)", "exactly as `${oc.env:PRL_TEST_SECRET}`"),
    # A literal secret given as a default would be saved as written.
    ("trainer.env.HF_TOKEN=${oc.env:PRL_TEST_UNSET,hf_s3cret}", "(trainer.env.HF_TOKEN)", "a default for a secret"),
    ("trainer.env.A=${oc.env:PRL_TEST_TOKEN,s3cret}", "(trainer.env.A)", "a default for a secret"),
])
def test_environment_values_outside_env_maps_are_refused(tmp_path, override, field, says):
    from prl.errors import ConfigError
    from prl.planner.prepare import prepare

    os.environ["PRL_TEST_SECRET"] = "s3cret"
    try:
        with pytest.raises(ConfigError) as e:
            prepare(REPO / "configs" / "local-tiny.yaml", [f"run_dir={tmp_path}/run", override], cwd=REPO)
    finally:
        del os.environ["PRL_TEST_SECRET"]
    assert field in str(e.value) and says in str(e.value), str(e.value)
    assert "s3cret" not in str(e.value)


@pytest.mark.parametrize("override, says", [
    ("orchestrator.env.WANDB_API_KEY=abc123", "WANDB_API_KEY looks like a secret"),
    ("trainer.env.HF_TOKEN=hf_abc123", "HF_TOKEN looks like a secret"),
    ("trainer.env.DB_PASSWORD=abc123", "DB_PASSWORD looks like a secret"),
    ("trainer.env.USE_FAST=true", "write the value in quotes"),
])
def test_a_literal_secret_in_an_env_map_is_refused_before_anything_is_written(tmp_path, override, says):
    env = {**os.environ, "PRL_HOME": str(tmp_path / "home")}
    out = prl(env, "plan", "configs/local-tiny.yaml", f"run_dir={tmp_path}/run", override, check=False)
    assert out.returncode != 0 and says in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert f"({override.split('=')[0]})" in out.stderr and "abc123" not in out.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides, field, name", [
    (["training.loss.import_path=my.loss:fn", "training.loss.args={api_key: abc123}"], "training.loss.args.api_key",
     "api_key"),
    (["training.advantage.shaping={import_path: my.shape:fn, args: {hf_token: abc123}}"],
     "training.advantage.shaping.args.hf_token", "hf_token"),
    (['inference.extra_args=["--hf-token=abc123"]'], "inference.extra_args[0]", "--hf-token"),
])
def test_a_literal_secret_in_any_map_the_plan_stores_is_refused_unechoed(tmp_path, overrides, field, name):
    """The secret rule of `env:` for every free-form map and argument list: refused at the field, the value
    never echoed (not even in the quoted override), nothing written."""
    from prl.errors import ConfigError
    from prl.planner.prepare import prepare

    with pytest.raises(ConfigError) as e:
        prepare(REPO / "configs" / "local-tiny.yaml", [f"run_dir={tmp_path}/run", *overrides], cwd=REPO)
    assert f"({field}): {name} looks like a secret" in str(e.value), str(e.value)
    assert "abc123" not in str(e.value)
    assert not (tmp_path / "run").exists()


def test_ordinary_names_in_free_form_maps_still_plan(tmp_path):
    from prl.planner.prepare import prepare

    plan = prepare(REPO / "configs" / "local-tiny.yaml", [
        f"run_dir={tmp_path}/run", "training.loss.import_path=my.loss:fn",
        "training.loss.args={scale: 2, max_tokens: 3, token_budget_path: /x}",
        'inference.extra_args=["--enforce-eager", "--max-num-batched-tokens", "512"]'], cwd=REPO).plan
    assert plan.settings().training.loss.args == {"scale": 2, "max_tokens": 3, "token_budget_path": "/x"}


def test_env_numbers_are_text_and_ordinary_names_stay_literal(tmp_path):
    from prl.planner.prepare import prepare

    plan = prepare(REPO / "configs" / "local-tiny.yaml", [f"run_dir={tmp_path}/run", "trainer.env.OMP_NUM_THREADS=4",
                                                          "trainer.env.MONKEY_PATCH=1",
                                                          "trainer.env.HF_TOKEN_PATH=/home/me/.hf/token",
                                                          "trainer.env.SSL_KEY_FILE=/etc/ssl/key.pem"], cwd=REPO).plan
    env = dict(plan.launch("trainer").env)
    assert env["OMP_NUM_THREADS"] == "4" and env["MONKEY_PATCH"] == "1"
    # A name that says where a secret is kept is no secret itself.
    assert env["HF_TOKEN_PATH"] == "/home/me/.hf/token" and env["SSL_KEY_FILE"] == "/etc/ssl/key.pem"


def test_public_variables_resolve_at_plan_time(tmp_path):
    from prl.planner.prepare import prepare

    prepared = prepare(REPO / "configs" / "local-tiny.yaml", ["run_dir=" + str(tmp_path) + "/${oc.env:USER,nobody}"],
                       cwd=REPO)
    assert prepared.plan.run_dir == f"{tmp_path}/{os.environ.get('USER', 'nobody')}"
    assert "${oc.env:USER,nobody}" in prepared.topology_yaml


# ---------------------------------------------------------------- authentication


def _calls(routes) -> list[tuple[str, str]]:
    """(method, concrete path) for every route of an app, OPTIONS included."""
    out = []
    for route in routes:
        path = getattr(route, "path", None)
        if not path or path == "/health":
            continue
        concrete = re.sub(r"\{[^}]*\}", "x", path)
        for method in sorted({*(getattr(route, "methods", None) or {"GET"}), "OPTIONS"} - {"HEAD"}):
            out.append((method, concrete))
    return out


def test_every_router_route_needs_the_key():
    from starlette.testclient import TestClient

    from prl.inference.router import build_app

    app = build_app(["http://127.0.0.1:9"], ["http://127.0.0.1:9"], api_key=KEY)
    calls = _calls(app.routes)
    assert ("POST", "/prl/weights") in calls and ("OPTIONS", "/pause") in calls and len(calls) > 8
    with TestClient(app) as client:
        for method, path in calls:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
                r = client.request(method, path, headers=headers)
                assert r.status_code == 401, (method, path, headers, r.status_code)


def test_the_generation_key_generates_through_the_router_and_calls_no_other_route():
    """The run's generation-only key (what the orchestrator's environments hold): the router lets it through on
    the generation routes and /v1/models only (here to backends that are not there: 502), every other route 403
    in one line naming the route; the run's key still passes everywhere."""
    from starlette.testclient import TestClient

    from prl.inference.router import build_app
    from prl.run.api import GENERATION_KEY_PATHS, generation_key

    app = build_app(["http://127.0.0.1:9"], ["http://127.0.0.1:9"], api_key=KEY)
    calls = [c for c in _calls(app.routes) if c[0] != "OPTIONS"] + [("GET", "/v1/models"), ("POST", "/pause")]
    generation = {"Authorization": f"Bearer {generation_key(KEY)}"}
    with TestClient(app) as client:
        for method, path in calls:
            r = client.request(method, path, headers=generation, json={})
            if path in GENERATION_KEY_PATHS:
                assert r.status_code not in (401, 403), (method, path, r.status_code)
            else:
                assert r.status_code == 403, (method, path, r.status_code)
                assert r.json() == {"error": f"{path} needs the run's key: the generation-only key may call only "
                                             f"{', '.join(sorted(GENERATION_KEY_PATHS))}"}
        assert client.post("/pause", headers={"Authorization": f"Bearer {KEY}"}).status_code not in (401, 403)
    assert generation_key(KEY) != KEY and KEY not in generation_key(KEY)


def test_the_orchestrator_is_started_without_the_run_s_key_in_its_environment(tmp_path, monkeypatch):
    """The role runner hands the orchestrator no key in its environment (which its children inherit, and which
    they can read in /proc/PID/environ): it reads RUN/api_key itself."""
    from types import SimpleNamespace

    from prl.job import runtimes
    from prl.run.rundir import API_KEY_VAR, RunDir

    run = RunDir(tmp_path / "run").create()
    run.create_api_key()
    monkeypatch.setenv(API_KEY_VAR, "inherited")
    seen = {}
    monkeypatch.setattr(runtimes, "supervise", lambda argv, env, *a, **k: seen.update(env) and 0)
    runtimes.run_orchestrator(run, None, 0, SimpleNamespace(signum=None))
    assert seen and API_KEY_VAR not in seen and run.read_api_key() not in seen.values()


@pytest.mark.parametrize("module", ["prl.inference.router", pytest.param("prl.inference", marks=pytest.mark.vllm)])
def test_a_server_without_its_key_refuses_to_start(tmp_path, module):
    argv = [sys.executable, "-m", module, "--api-key-env", "PRL_TEST_UNSET_KEY"]
    argv += (["--port", "9", "--prefill", "http://a", "--decode", "http://b"] if module.endswith("router") else
             ["--run-dir", str(tmp_path), "--model", str(tmp_path)])
    env = {k: v for k, v in os.environ.items() if k != "PRL_TEST_UNSET_KEY"}
    out = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert out.returncode != 0
    assert "PRL_TEST_UNSET_KEY: the variable is not set or empty; refusing to serve" in out.stderr, out.stderr


async def _echo(request: Request):
    return {"n": len(await request.body())}


def test_body_limit():
    from fastapi import FastAPI
    from starlette.testclient import TestClient

    from prl.inference.server import BodyLimit

    app = FastAPI()
    app.add_api_route("/echo", _echo, methods=["POST"])  # the router's way of adding routes
    app.add_middleware(BodyLimit, max_bytes=1000)
    client = TestClient(app)
    assert client.post("/echo", content=b"x" * 1000).json() == {"n": 1000}
    assert client.post("/echo", content=b"x" * 1001).status_code == 413
    streamed = client.post("/echo", content=iter([b"x" * 600, b"x" * 600]))  # chunked: no Content-Length
    assert streamed.status_code == 413
    assert client.post("/echo", content=b"{}", headers={"content-length": "nope"}).status_code == 400
    app.state.body_limits = {"/echo": 100}  # a route's own, smaller bound (the generate route's, from the model)
    assert client.post("/echo", content=b"x" * 100).json() == {"n": 100}
    assert client.post("/echo", content=b"x" * 101).status_code == 413
    assert client.post("/echo", content=iter([b"x" * 60, b"x" * 60])).status_code == 413
    app.state.body_limits = {"/echo": 10**9}  # never above the server's
    assert client.post("/echo", content=b"x" * 1001).status_code == 413


def test_generate_checks_a_prompts_length_before_its_ids_and_each_id_once():
    """A 32 MiB prompt held the event loop for seconds: every id was checked (and named) before the length."""
    from prl.inference.generate import BadRequest, GenerateRequest, check_request, max_body_bytes

    def refused(**fields) -> str:
        with pytest.raises(BadRequest) as e:
            check_request(GenerateRequest(**fields), vocab=1000, max_model_len=100, max_logprobs=20)
        return str(e.value)

    assert refused(token_ids=[-1] * 4_000_000) == "prompt of 4000000 tokens leaves no room in max_model_len=100"
    assert refused(token_ids=[1, 2, 1000, -1]) == "token_ids[2]=1000 is out of range [0, 999]"
    assert refused(token_ids=[1], sampling_params={"allowed_token_ids": [1, True]}) == \
        "sampling_params.allowed_token_ids[1] must be an integer, got True"
    stop = {"stop_token_ids": [5] * 1001}
    assert refused(token_ids=[1], sampling_params=stop) == "sampling_params.stop_token_ids holds 1001 ids; at most 1000"
    deep = {"extra_args": {"a": [1, [2.0, float("nan")]]}}
    assert refused(token_ids=[1], sampling_params=deep) == "sampling_params.extra_args.a[1][1] must be a finite number, got nan"
    assert refused(token_ids=[1], sampling_params={"seed": 2**64}) == \
        f"sampling_params.seed={2**64} is out of range [{-(2**63)}, {2**63 - 1}]"
    assert check_request(GenerateRequest(token_ids=[1] * 99), vocab=1000, max_model_len=100, max_logprobs=20) == 1
    assert max_body_bytes(1000, 100) < 2 << 20  # a small model's requests are refused far below 32 MiB


def test_an_image_url_that_is_a_string_is_a_bad_request_naming_the_part():
    """`{"type": "image_url", "image_url": "data:..."}` (the URL not under `url`) answered 500 (AttributeError)."""
    from prl.inference.generate import BadRequest, decode_images

    with pytest.raises(BadRequest) as e:
        decode_images([{"type": "image_url", "image_url": "data:image/png;base64,AAAA"}])
    assert str(e.value) == 'content_parts[0] must be {"type": "image_url", "url": ...}'


def test_pictures_over_the_request_s_pixel_budget_are_refused_from_their_headers():
    """Pictures that claim more than MAX_REQUEST_PIXELS together are refused naming the bound, from their
    headers: the first picture's pixel data is cut short, yet the answer names the budget (nothing was decoded
    when the fifth picture went over it). Within the budget every picture decodes, as RGB."""
    from prl.inference.generate import MAX_REQUEST_PIXELS, BadRequest, decode_images

    side = 4096  # 16 Mpixels: four fit in MAX_REQUEST_PIXELS, a fifth does not
    assert 4 * side * side <= MAX_REQUEST_PIXELS < 5 * side * side
    part = {"type": "image_url", "url": png_url(side, side)}
    broken = {"type": "image_url", "url": png_url(side, side, truncated=True)}
    with pytest.raises(BadRequest) as e:
        decode_images([broken, part, part, part, part])
    assert str(e.value) == (f"content_parts[4]: a 4096x4096 picture takes the request's pictures to "
                            f"{5 * side * side} pixels, over MAX_REQUEST_PIXELS={MAX_REQUEST_PIXELS}")
    with pytest.raises(BadRequest) as e:  # within the budget, the cut one is refused when it decodes
        decode_images([part, broken])
    assert str(e.value).startswith("content_parts[1]: not a picture PIL can decode")
    images = decode_images([part] * 4)
    assert [(im.mode, im.size) for im in images] == [("RGB", (side, side))] * 4


def test_pictures_decode_off_the_event_loop():
    """Six requests of 64 Mpixels each decode while the event loop goes on: a 10 ms ticker on the same loop
    never waits as long as one request's decoding takes (decoded on the loop, each stalled it for all of it)."""
    import asyncio
    import time

    from prl.inference.generate import MAX_REQUEST_PIXELS, decode_images, decoded_images

    parts = [{"type": "image_url", "url": png_url(4096, 4096)}] * (MAX_REQUEST_PIXELS // 4096 ** 2)
    start = time.monotonic()
    decode_images(parts)
    one = time.monotonic() - start

    async def main() -> float:
        gaps, done = [], False

        async def tick():
            last = time.monotonic()
            while not done:
                await asyncio.sleep(0.01)
                gaps.append(time.monotonic() - last)
                last = time.monotonic()

        ticker = asyncio.create_task(tick())
        decoded = await asyncio.gather(*(decoded_images(parts) for _ in range(6)))
        done = True
        await ticker
        assert all(len(images) == len(parts) for images in decoded)
        return max(gaps)

    longest = asyncio.run(main())
    assert longest < one / 2, f"the loop waited {longest:.3f} s; one request decodes in {one:.3f} s"


# ---------------------------------------------------------------- resume while running


def test_local_submission_is_private_and_resume_waits_for_the_old_job(tmp_path, env, model):
    run = tmp_path / "run"
    args = ["submit", "configs/local-tiny.yaml", f"run_dir={run}", f"model.path={model}", "--local", "--detach",
            "--preflight", "--hold"]
    prl(env, *args, 120)
    try:
        wait_for("running", lambda: all(r["status"] == "running" for r in state(env, run)["roles"]), 60)
        key = (run / "api_key").read_text().strip()
        assert mode(run / "api_key") == 0o600 and mode(run) == 0o700 and len(key) >= 40
        leaks = [p for p in files_under(run) if p.name != "api_key" and key.encode() in contents(p)]
        assert leaks == []
        assert mode(run / "job.json") == 0o600 and mode(run / "plan.json") == 0o600
        again = prl(env, *args, 1, "--resume", check=False)
        assert again.returncode == 1 and again.stderr.count("\n") == 1, again.stderr
        assert "is still running: stop it first (`prl cancel" in again.stderr
        assert (run / "api_key").read_text().strip() == key, "a refused submission changes nothing"
    finally:
        prl(env, "cancel", run, check=False)
    wait_for("CANCELLED", lambda: state(env, run)["state"] == "CANCELLED", 60)
    prl(env, *args, 1, "--resume")
    wait_for("COMPLETED", lambda: state(env, run)["state"] == "COMPLETED", 60)
    assert (run / "api_key").read_text().strip() != key


@pytest.mark.slurm
def test_slurm_resume_is_refused_while_the_job_runs(tmp_path, env, model, slurm_cluster):
    run = tmp_path / "run"
    args = ["submit", "configs/lab.yaml", f"run_dir={run}", f"model.path={model}", "--preflight", "--hold"]
    prl(env, *args, 300)
    try:
        job = json.loads((run / "job.json").read_text())
        again = prl(env, *args, 1, "--resume", check=False)
        assert again.returncode == 1 and f"job {job['job_id']} of {run} is still running" in again.stderr
        assert mode(run / "api_key") == 0o600
        batch_log = wait_for("the batch log", lambda: (p := run / "logs" / f"slurm-{job['job_id']}.out").exists() and p, 60)
        assert mode(batch_log) == 0o600, "sbatch ran with the private umask, which slurmd applies"
    finally:
        prl(env, "cancel", run, check=False)
    from prl.ops import slurm

    # Until Slurm lists every component as ended (COMPLETING is not), a resume is still refused.
    wait_for("Slurm to end the job", lambda: all(r.terminal for r in slurm.squeue_jobs([job["job_id"]]).values()), 120)
    assert "submitted job" in prl(env, *args, 1, "--resume").stdout
    prl(env, "cancel", run, check=False)


# ---------------------------------------------------------------- a real server: auth and bounds


@server_fixture(scope="module")
def keyed_server(tmp_path_factory, tiny_model_dir):
    from prl.run.rundir import RunDir

    run = RunDir(tmp_path_factory.mktemp("keyed") / "run").create()
    with start_inference(run.root, tiny_model_dir, extra_args=("--api-key-env", KEY_VAR), env={KEY_VAR: KEY}) as s:
        yield s


AUTH = {"Authorization": f"Bearer {KEY}"}


def call(server, method: str, path: str, body=None, *, raw: bytes | None = None, headers=AUTH) -> tuple[int, object]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    request = urllib.request.Request(server.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        text = e.read()
        try:
            return e.code, json.loads(text)
        except ValueError:
            return e.code, text.decode(errors="replace")


@pytest.mark.vllm
@pytest.mark.slow
def test_every_server_route_but_health_needs_the_key(keyed_server):
    from prl.inference import admin, generate
    from prl.inference.server import OPEN_PATHS, RL_API_ROUTES

    spec = http_json("GET", keyed_server.url + "/openapi.json", headers=AUTH)
    documented = {(m.upper(), p) for p, ops in spec["paths"].items() for m in ops}
    ours = {(m, r.path) for r in [*admin.router.routes, *generate.router.routes] for m in r.methods}
    assert ours | RL_API_ROUTES <= documented, (ours | RL_API_ROUTES) - documented
    assert ("POST", "/update_weights") not in documented  # vLLM's weight-transfer routes stay unmounted
    calls = {(m, re.sub(r"\{[^}]*\}", "x", p)) for m, p in documented if p not in OPEN_PATHS}
    calls |= {("OPTIONS", p) for _, p in calls}
    for method, path in sorted(calls):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            status, _ = call(keyed_server, method, path, {} if method == "POST" else None, headers=headers)
            assert status == 401, (method, path, headers, status)
    for method, path in [("GET", "/metrics"), ("GET", "/docs"), ("POST", "/prl/not-a-route"), ("GET", "/")]:
        assert call(keyed_server, method, path, headers={})[0] == 401, path
    assert OPEN_PATHS == ("/health", "/prl/engine")  # the role runner's probes: answers that say nothing else
    for path in OPEN_PATHS:
        assert call(keyed_server, "GET", path, headers={})[0] == 200
    # The open proof route: the server proves it holds the key without the key sent to it (the readiness probe).
    from prl.job.runtimes import serves_for_run
    from prl.run.api import proves_key

    assert serves_for_run(keyed_server.url, KEY) and not proves_key(keyed_server.url, "wrong")


@pytest.mark.vllm
@pytest.mark.slow
def test_a_text_only_model_refuses_pictures_before_decoding_them(keyed_server):
    """Pictures sent to a text-only model: 400 naming the model, whatever they hold (a payload that is no picture
    at all gets the same answer: nothing of it was decoded); a request without them is served."""
    parts = [{"type": "image_url", "url": png_url(4096, 4096)},
             {"type": "image_url", "url": "data:image/png;base64,bm90IGEgcG5n"}]
    says = f"model {keyed_server.model_dir} is text-only: it takes no pictures (content_parts)"
    for sent in (parts, parts[1:]):
        status, body = call(keyed_server, "POST", "/inference/v1/generate",
                            {"token_ids": [1, 2, 3], "content_parts": sent, "sampling_params": {"max_tokens": 1}})
        assert (status, body["error"]["message"]) == (400, says), (status, body)
    status, _ = call(keyed_server, "POST", "/inference/v1/generate",
                     {"token_ids": [1, 2, 3], "content_parts": [], "sampling_params": {"max_tokens": 1}})
    assert status == 200


def running_requests(server) -> float:
    text = urllib.request.urlopen(urllib.request.Request(server.url + "/metrics", headers=AUTH), timeout=30).read()
    total = 0.0
    for line in text.decode().splitlines():
        if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.vllm
@pytest.mark.slow
def test_a_real_server_generates_with_the_generation_key_and_refuses_it_every_admin_route(keyed_server):
    """vLLM's app with prl's middleware: the generation-only key completes and lists models; pausing, weight
    updates, /prl/live and vLLM's adapter routes answer it 403 naming the route, and nothing of them runs."""
    from prl.run.api import generation_key

    generation = {"Authorization": f"Bearer {generation_key(KEY)}"}
    status, models = call(keyed_server, "GET", "/v1/models", headers=generation)
    assert status == 200, models
    status, done = call(keyed_server, "POST", "/v1/completions", {"model": models["data"][0]["id"], "prompt": "hi",
                                                                   "max_tokens": 2}, headers=generation)
    assert status == 200 and done["choices"], done
    for method, path, body in [("POST", "/pause", {}), ("POST", "/resume", {}), ("POST", "/prl/weights", {"step": 0}),
                               ("GET", "/prl/live", None), ("POST", "/v1/load_lora_adapter",
                                                            {"lora_name": "x", "lora_path": "/x"})]:
        status, answer = call(keyed_server, method, path, body, headers=generation)
        assert status == 403 and answer["error"].startswith(f"{path} needs the run's key"), (path, status, answer)
    status, live = call(keyed_server, "GET", "/prl/live")
    assert status == 200 and live["paused"] is False  # the refused pause never ran


@pytest.mark.vllm
@pytest.mark.slow
def test_generate_refuses_out_of_range_requests(keyed_server):
    from prl.inference.generate import MAX_N, max_body_bytes

    vocab = json.loads((keyed_server.model_dir / "config.json").read_text())["vocab_size"]
    ok = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2, "temperature": 0.0, "logprobs": 1}}

    def with_params(**params):
        return {**ok, "sampling_params": {**ok["sampling_params"], **params}}

    cases = {
        "max_tokens=0": with_params(max_tokens=0),
        "max_tokens beyond max_model_len": with_params(max_tokens=1024),
        "max_tokens not an integer": with_params(max_tokens="many"),
        "seed beyond int64": with_params(seed=2**64),
        "negative seed beyond int64": with_params(seed=-(2**63) - 1),
        "n=0": with_params(n=0),
        "huge n": with_params(n=MAX_N + 1),
        "negative temperature": with_params(temperature=-1.0),
        "huge temperature": with_params(temperature=1e30),
        "top_p=0": with_params(top_p=0.0),
        "logprobs beyond max_logprobs": with_params(logprobs=10_000),
        "negative logprobs": with_params(logprobs=-5),
        "min_tokens > max_tokens": with_params(min_tokens=5),
        "stop token outside vocab": with_params(stop_token_ids=[vocab]),
        "logit_bias key outside vocab": with_params(logit_bias={str(vocab + 5): 1.0}),
        "logit_bias not a number": with_params(logit_bias={"1": "x"}),
        "integer beyond int64 in extra_args": with_params(extra_args={"a": 2**70}),
        "token id = vocab": {**ok, "token_ids": [1, vocab]},
        "token id beyond int64": {**ok, "token_ids": [1, 2**70]},
        "negative token id": {**ok, "token_ids": [-1]},
        "empty prompt": {**ok, "token_ids": []},
        "prompt fills max_model_len": {**ok, "token_ids": [1] * 1024},
        "priority beyond int64": {**ok, "priority": 2**63},
        "sampling_params not an object": {**ok, "sampling_params": [1]},
        "too many stop strings": with_params(stop=["x"] * 100),
    }
    for name, body in cases.items():
        status, answer = call(keyed_server, "POST", "/inference/v1/generate", body)
        assert status in (400, 422), (name, status, answer)
        assert isinstance(answer, dict) and answer, (name, answer)
    status, answer = call(keyed_server, "POST", "/inference/v1/generate", with_params(max_tokens=0))
    assert "max_tokens=0 is out of range [1, 1021]" in answer["error"]["message"], answer
    for name, raw in {"not JSON": b"{", "deeply nested": b"[" * 100_000 + b"]" * 100_000}.items():
        status, answer = call(keyed_server, "POST", "/inference/v1/generate", raw=raw)
        assert 400 <= status < 500, (name, status, answer)
    assert declared_body_status(keyed_server, 64 * 1024 * 1024) == 413  # refused before a byte is read
    assert declared_body_status(keyed_server, max_body_bytes(vocab, 1024) + 1) == 413  # this model's own bound
    status, answer = call(keyed_server, "POST", "/inference/v1/generate", ok)
    assert status == 200 and len(answer["choices"][0]["token_ids"]) == 2, answer
    assert wait_for("no request left in the engine", lambda: running_requests(keyed_server) == 0 or None, 30) is not None


def declared_body_status(server, size: int) -> int:
    """The status answered to a generate request that declares a `size`-byte body and sends none."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST /inference/v1/generate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Authorization: Bearer {KEY}\r\nContent-Length: {size}\r\n\r\n".encode())
        return int(sock.recv(4096).split(b" ", 2)[1])


@pytest.mark.vllm
@pytest.mark.slow
def test_a_dropped_client_leaves_no_request_behind(keyed_server):
    body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 1000, "ignore_eos": True, "logprobs": 1}}
    host, port = keyed_server.url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(f"POST /inference/v1/generate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Authorization: Bearer {KEY}\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
        wait_for("the request to run", lambda: running_requests(keyed_server) > 0, 30, interval=0.05)
    wait_for("the engine to drop the request", lambda: running_requests(keyed_server) == 0, 30)


@pytest.mark.vllm
@pytest.mark.slow
def test_admin_routes_refuse_out_of_range_requests(keyed_server):
    cases = [
        ("/prl/weights", {"step": 2**70}, 400, '"step" must be an integer in [1, 2147483647]'),
        ("/prl/weights", {"step": 0}, 400, '"step" must be an integer'),
        ("/prl/weights", {"step": "1"}, 400, '"step" must be an integer'),
        ("/prl/weights", {"path": "/a\u0000b"}, 400, "without NUL"),
        ("/prl/weights", {"path": "/" + "a" * 5000}, 400, "at most 4096 characters"),
        ("/prl/weights", {"path": "/" + "b" * 300 + "/c"}, 403, "not a directory under"),  # a name too long
        ("/prl/weights", {"path": str(keyed_server.run_dir / "weights" / ("b" * 300))}, 409, "is not published"),
        ("/prl/weights", [1, 2], 400, "must be a JSON object"),
        ("/prl/weights", {"step": 1, "mode": ["x"]}, 400, '"mode" must be one of'),
        ("/prl/weights", {"pad": "x" * 70_000}, 413, "admin requests take at most"),
        ("/pause", {"pad": "x" * 70_000}, 413, "at most 65536"),  # vLLM's RL API routes get the admin bound
        ("/abort_requests", {"pad": "x" * 70_000}, 413, "at most 65536"),
    ]
    for path, body, want, says in cases:
        status, answer = call(keyed_server, "POST", path, body)
        assert status == want and says in answer.get("error", ""), (path, str(body)[:60], status, answer)
    assert call(keyed_server, "POST", "/prl/weights", raw=b"{nope")[0] == 400
    live = http_json("GET", keyed_server.url + "/prl/live", headers=AUTH)
    assert live["ok"] is True and live["paused"] is False and live["updates"] == 0


# -- idle connections: bounded header time and open connections (prl/inference/http_limits.py)

_HEALTH_BACKEND = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(port: int, timeout: float = 5.0) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


@contextlib.contextmanager
def _router(nofile: int | None = None):
    """A real router (`python -m prl.inference.router`, key "k") in front of a /health-only backend; its port.
    `nofile`: its descriptor limit."""
    import resource

    backend_port, router_port = _free_port(), _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "PRL_TEST_KEY": "k"}
    backend = subprocess.Popen([sys.executable, "-c", _HEALTH_BACKEND, str(backend_port)], env=env)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    router = subprocess.Popen(
        [sys.executable, "-m", "prl.inference.router", "--port", str(router_port), "--api-key-env", "PRL_TEST_KEY",
         "--prefill", f"http://127.0.0.1:{backend_port}", "--decode", f"http://127.0.0.1:{backend_port}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        preexec_fn=None if nofile is None else lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, hard)))
    try:
        wait_for("the router's /health", lambda: _health(router_port, 1) == 200, timeout=60)
        yield router_port
    finally:
        router.terminate()
        backend.terminate()
        router.wait(timeout=30)
        backend.wait(timeout=30)


def test_a_flood_of_idle_connections_does_not_stop_the_router_answering_health():
    idle = []
    with _router(nofile=300) as port:  # few descriptors, as on a node whose limit an idle flood can reach
        try:
            for _ in range(400):  # connected, and never a header: more than the router has descriptors
                idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            assert _health(port) == 200, "an idle flood starved /health"
            assert _health(port) == 200
        finally:
            for s in idle:
                s.close()


_SQUATTER = """
import http.server, sys, urllib.request
relay = sys.argv[2] if len(sys.argv) > 2 else None
class Squatter(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # 200 to everything; with a relay, the run's real server's answers passed on
        body = urllib.request.urlopen(relay + self.path).read() if relay else b'{"proof": "0"}'
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Squatter).serve_forever()
"""


def test_readiness_takes_only_a_listener_that_proves_the_run_s_key():
    from prl.job.runtimes import http_ok, serves_for_run
    from prl.run.api import proves_key

    with _router() as port:
        url = f"http://127.0.0.1:{port}"
        assert serves_for_run(url, "k") and not proves_key(url, "another run's key")
        for relay in ([], [url]):  # a process on a planned port, answering alone or relaying the real server
            squat_port = _free_port()
            squatter = subprocess.Popen([sys.executable, "-c", _SQUATTER, str(squat_port), *relay])
            try:
                squat = f"http://127.0.0.1:{squat_port}"
                wait_for("the squatter", lambda: http_ok(f"{squat}/health"), timeout=30)
                assert not serves_for_run(squat, "k"), "a /health of 200 alone is no proof"
            finally:
                squatter.terminate()
                squatter.wait(timeout=30)
        try:
            urllib.request.urlopen(f"{url}/prl/proof?nonce=not-hex", timeout=5)
        except urllib.error.HTTPError as e:
            assert e.code == 400 and b"nonce" in e.read()
        else:
            pytest.fail("a malformed nonce was answered")


def test_a_connection_that_never_completes_its_headers_is_closed_at_the_deadline(monkeypatch):
    import threading
    import time

    import uvicorn
    from fastapi import FastAPI

    from prl.inference import http_limits

    monkeypatch.setattr(http_limits, "HEADER_TIMEOUT_S", 0.5)
    app = FastAPI()
    app.add_api_route("/health", lambda: {}, methods=["GET"])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, http=http_limits.BoundedHTTP,
                                           log_level="warning", timeout_keep_alive=60))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for("the server to start", lambda: server.started, timeout=30, interval=0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        silent = socket.create_connection(("127.0.0.1", port), timeout=5)
        partial = socket.create_connection(("127.0.0.1", port), timeout=5)
        partial.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        answered = socket.create_connection(("127.0.0.1", port), timeout=5)
        answered.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert answered.recv(4096).startswith(b"HTTP/1.1 200")
        answered.sendall(b"G")  # after a response: the next request's headers have the same deadline
        start = time.monotonic()
        for s in (silent, partial, answered):
            assert s.recv(4096) == b"", "closed by the server"
        assert time.monotonic() - start < 3
        assert _health(port) == 200
    finally:
        server.should_exit = True
        thread.join(timeout=10)
