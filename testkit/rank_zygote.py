"""A zygote for the trainer tests' CPU ranks: `testkit.trainer_helpers.launch` forks each rank of a run from it.

A 2-rank torchrun launch of the tiny model spent about 8 s on a quiet 2-core machine (10-19 s under the suite's
load) to train for a fraction of one: torchrun's agent imports torch before it starts the ranks (1.7 s), then
each rank imports torch, torch.distributed, transformers and prl's trainer (about 4 s of CPU each). This process
imports them once per pytest worker (`PRELOAD`, with one thread: nothing started that a fork would lose), then
forks every rank of every launch from itself: each rank is a process of its own that runs the trainer's real
entry (`python -m prl.trainer`'s `cli`) in the environment torchrun gives a rank (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT: rank 0 hosts the store, as without torchrun's agent) over real gloo.
What torchrun itself does (signals passed on, a failed rank stopping the others) stays tested where the trainer
is started as the job starts it: the launcher's runs and the trainer tests that signal or kill torchrun
(`launch(..., wait=False)`).

Protocol (one JSON line each way per launch, over the zygote's stdin and stdout): the request {"argv", "env",
"nproc", "out"} (the `prl.trainer` arguments, the full environment, the ranks, a file prefix for each rank's
output); the answer {"pids"} at once, then {"codes"} when every rank has exited. EOF on stdin ends the zygote.
"""

from __future__ import annotations

import atexit
import importlib
import io
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

PRELOAD = ("torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.checkpoint", "transformers",
           "transformers.models.qwen3.modeling_qwen3", "safetensors.torch", "prl.trainer.train", "prl.trainer.float8",
           "torchao.float8")
OPTIONAL = ("torchao.float8", "prl.trainer.float8")  # the fp8 extra: absent from a minimal install
GRACE_S = 10


def preload() -> None:
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            if name not in OPTIONAL:
                raise


def rank_main(argv: list[str], env: dict[str, str], out: str) -> None:
    """In a forked child: the rank's environment and output files, the trainer's entry, its exit code."""
    code = 1
    try:
        os.setpgid(0, 0)  # a launch that runs past its timeout is killed as a group
        os.environ.clear()
        os.environ.update(env)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, suffix in ((1, ".out"), (2, ".err")):
            os.dup2(os.open(out + suffix, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
        # Unbuffered, as torchrun starts a rank (`python -u`): what a rank wrote is there even if it is killed.
        sys.stdout, sys.stderr = (io.TextIOWrapper(os.fdopen(fd, "wb", buffering=0, closefd=False),
                                                   errors="backslashreplace", write_through=True) for fd in (1, 2))
        import torch

        torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
        from prl.trainer.__main__ import cli

        code = cli(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve() -> None:
    answers = sys.stdout
    sys.stdout = sys.stderr  # nothing but answers on the pipe
    preload()
    for line in sys.stdin:
        request = json.loads(line)
        nproc, pids = request["nproc"], []
        for rank in range(nproc):
            env = {**request["env"], "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                   "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0"}
            pid = os.fork()
            if pid == 0:
                rank_main(request["argv"], env, f"{request['out']}.{rank}")
            pids.append(pid)
        answers.write(json.dumps({"pids": pids}) + "\n")
        answers.flush()
        answers.write(json.dumps({"codes": reap(pids)}) + "\n")
        answers.flush()


def reap(pids: list[int]) -> list[int]:
    """Every rank's exit code, in rank order. As torchrun does, the first rank to fail stops the others: SIGTERM,
    then SIGKILL after `GRACE_S` (one rank's failure would otherwise leave the rest waiting in a collective)."""
    codes: dict[int, int] = {}
    kill_at = None
    while len(codes) < len(pids):
        for pid in [p for p in pids if p not in codes]:  # these pids only: never another child's status
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
        if kill_at is None and any(code != 0 for code in codes.values()):
            kill_at = time.monotonic() + GRACE_S
            signal_all([p for p in pids if p not in codes], signal.SIGTERM)
        if kill_at is not None and time.monotonic() > kill_at:
            signal_all([p for p in pids if p not in codes], signal.SIGKILL)
            kill_at = float("inf")
        time.sleep(0.05)
    return [codes[p] for p in pids]


def signal_all(pids: list[int], sig: int) -> None:
    """`sig` to each rank's process group (the rank and anything it started)."""
    for pid in pids:
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            pass


class Zygote:
    """The client side, one per pytest worker (`zygote()`): starts the zygote, runs launches through it."""

    def __init__(self, env: dict[str, str]):
        self.proc = subprocess.Popen([sys.executable, "-m", "testkit.rank_zygote"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, bufsize=0, start_new_session=True)
        self.pending = b""  # what was read past the last answer (both answers may come in one read)
        atexit.register(self.close)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)

    def answer(self, deadline: float | None) -> dict:
        import select

        fd = self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], timeout)[0]:
                raise TimeoutError
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"the rank zygote died (exit code {self.proc.wait()})")
            self.pending += chunk
        line, _, self.pending = self.pending.partition(b"\n")
        return json.loads(line)

    def run(self, argv: list[str], env: dict[str, str], nproc: int, out: Path, timeout: float) -> list[int]:
        """Fork `nproc` ranks of `python -m prl.trainer ARGV`; their exit codes (a rank killed by a signal:
        minus the signal). Past `timeout`, every rank is killed and TimeoutError raised."""
        request = {"argv": argv, "env": env, "nproc": nproc, "out": str(out)}
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        pids = self.answer(None)["pids"]
        try:
            return self.answer(time.monotonic() + timeout)["codes"]
        except TimeoutError:
            signal_all(pids, signal.SIGKILL)
            self.answer(None)
            raise


_zygote: Zygote | None = None


def zygote(env: dict[str, str]) -> Zygote:
    """This pytest worker's zygote (started on first use, with `env`: the one every launch passes)."""
    global _zygote
    if _zygote is None or _zygote.proc.poll() is not None:
        _zygote = Zygote(env)
    return _zygote


if __name__ == "__main__":
    serve()
