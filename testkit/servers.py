"""Real vLLM servers (and the P/D router) on this machine, for tests and benches: `start_inference`,
`start_servers`, `start_router`, and the HTTP and metrics helpers around them.

    with start_inference(run_dir, model_dir, port) as server:
        httpx.get(server.url + "/prl/live")

`start_inference` launches `python -m prl.inference` as a subprocess (CPU:
`VLLM_CPU_KVCACHE_SPACE=1`), waits for `/health` (600 s by default; on
failure the error carries the log tail), and stops it at the end (SIGTERM to
its process group, then SIGKILL). Servers run with `--enforce-eager`, as the
shipped CPU topologies do: vLLM's torch.compile warm-up alone took 33 s of an
81 s start here (38 s without it). Under pytest, `start_inference` refuses to run for a test without the `vllm`
marker (`SERVERS_ALLOWED`, set by tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from prl.run.records import ENGINE_DIED_EXIT
from testkit.ports import free_port

REPO = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 600.0  # vLLM on 2 busy CPU cores has taken 300+ s to start

SERVERS_ALLOWED = True
"""Set before each test by tests/conftest.py: whether the test is marked `vllm`."""


@dataclass
class InferenceServer:
    """A running `python -m prl.inference`."""

    url: str
    """http://host:port, no trailing slash."""
    process: subprocess.Popen
    log_path: Path
    run_dir: Path
    model_dir: Path
    start_seconds: float
    """Wall time from launch to a healthy /health."""

    def log_tail(self, n: int = 60) -> str:
        return _tail(self.log_path, n)

    def get(self, path: str, timeout: float = 60) -> dict:
        return http_json("GET", self.url + path, timeout=timeout)

    def post(self, path: str, body: dict | None = None, timeout: float = 120) -> dict:
        return http_json("POST", self.url + path, body or {}, timeout=timeout)


class HTTPFailure(Exception):
    def __init__(self, status: int, body: dict | str):
        super().__init__(f"HTTP {status}: {body}")
        self.status = status
        self.body = body


def http_json(method: str, url: str, body: dict | None = None, *, headers: dict | None = None,
              timeout: float = 60) -> dict:
    """One JSON request with the standard library; HTTPFailure on a non-2xx answer."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            payload = json.loads(raw)
        except ValueError:
            payload = raw.decode(errors="replace")
        raise HTTPFailure(e.code, payload) from None
    return json.loads(raw) if raw else {}


def _tail(path: Path, n: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as resp:
            return resp.status == 200
    except (OSError, urllib.error.URLError):
        return False


def stop_process(process: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM the server's process group (API server + engine core), then SIGKILL what remains."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # engine core children outliving the parent
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(10)


@contextlib.contextmanager
def start_inference(
    run_dir: str | Path,
    model_dir: str | Path,
    port: int | None = None,
    extra_args: Sequence[str] = (),
    *,
    log_path: str | Path | None = None,
    env: dict | None = None,
    timeout: float = START_TIMEOUT_S,
    module: str = "prl.inference",
) -> Iterator[InferenceServer]:
    """Run `python -m prl.inference --run-dir RUN --model DIR --port P ...` until the block ends."""
    if not SERVERS_ALLOWED:
        raise RuntimeError("this test starts a vLLM server but is not marked `vllm`: add the marker, or get the "
                           "server from a fixture declared with `server_fixture`")
    run_dir, model_dir = Path(run_dir), Path(model_dir)
    port = port or free_port()
    log_path = Path(log_path) if log_path else run_dir / f"inference-{port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", module, "--run-dir", str(run_dir), "--model", str(model_dir),
           "--port", str(port), "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "1024",
           "--disable-uvicorn-access-log", "--enforce-eager", *extra_args]
    full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(REPO), **(env or {})}
    full_env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    start = time.monotonic()
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=REPO,
                                   start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        while not _healthy(url):
            if process.poll() is not None:
                raise RuntimeError(f"prl.inference exited with {process.returncode} before /health; "
                                   f"log {log_path}:\n{_tail(log_path, 60)}")
            if time.monotonic() - start > timeout:
                raise RuntimeError(f"prl.inference not healthy after {timeout:.0f} s; "
                                   f"log {log_path}:\n{_tail(log_path, 60)}")
            time.sleep(1)
        yield InferenceServer(url, process, log_path, run_dir, model_dir, time.monotonic() - start)
    except BaseException:
        stop_process(process)
        raise
    running = process.poll() is None
    stop_process(process)
    # SIGTERM reaches the API server and its engine core at once (as Slurm's does): a stop, not an engine death
    # (ENGINE_DIED_EXIT) nor a crash on the way out; -9 only when it outlived stop_process's grace.
    assert not running or process.returncode in (0, -signal.SIGKILL), (
        f"prl.inference exited {process.returncode} when stopped (engine death: {ENGINE_DIED_EXIT}); "
        f"log {log_path}:\n{_tail(log_path, 40)}")


@contextlib.contextmanager
def start_router(prefill: Sequence[str], decode: Sequence[str], port: int | None = None, *,
                 log_path: str | Path, extra_args: Sequence[str] = (), env: dict | None = None,
                 timeout: float = 300.0) -> Iterator[str]:
    """Run `python -m prl.inference.router` in front of the given servers; yield its URL once healthy."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "prl.inference.router", "--port", str(port)]
    cmd += [a for url in prefill for a in ("--prefill", url)] + [a for url in decode for a in ("--decode", url)]
    cmd += list(extra_args)
    log_path = Path(log_path)
    with open(log_path, "ab") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                                   env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
    url = f"http://127.0.0.1:{port}"
    start = time.monotonic()
    try:
        while not _healthy(url):
            if process.poll() is not None or time.monotonic() - start > timeout:
                raise RuntimeError(f"router not healthy; log {log_path}:\n{_tail(log_path, 40)}")
            time.sleep(0.5)
        yield url
    finally:
        stop_process(process, grace=10)



@contextlib.contextmanager
def start_servers(specs: Sequence[dict]) -> Iterator[list[InferenceServer]]:
    """Start several `start_inference(**spec)` servers at once (their minute-long warm-ups overlap);
    yield them in order once all are healthy, stop them all at the end."""
    from concurrent.futures import ThreadPoolExecutor

    with contextlib.ExitStack() as stack:
        managers = [start_inference(**spec) for spec in specs]
        with ThreadPoolExecutor(len(managers)) as pool:
            futures = [pool.submit(m.__enter__) for m in managers]
            started = []
            for manager, future in zip(managers, futures):
                try:
                    started.append(future.result())
                except BaseException:
                    for m, f in zip(managers, futures):  # stop the ones that did start
                        if f.exception() is None:
                            m.__exit__(None, None, None)
                    raise
        for manager in managers:
            stack.push(manager.__exit__)
        yield started


def prometheus(url: str, timeout: float = 30) -> dict[str, float]:
    """A server's `/metrics` as {"name{labels}": value} (counters, gauges, histogram series)."""
    with urllib.request.urlopen(url + "/metrics", timeout=timeout) as resp:
        text = resp.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                values[name] = float(value)
            except ValueError:
                continue
    return values


def metric_sum(values: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the series of `name` (e.g. "vllm:prompt_tokens_by_source_total") whose labels include `labels`."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in values.items()
               if k.split("{", 1)[0] == name and all(w in k for w in want))
