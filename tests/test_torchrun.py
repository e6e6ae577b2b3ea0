"""`python -m prl.trainer.torchrun`: torchrun whose rendezvous store listens on the node's address only."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO, free_port

RANK = """
import json
import os
import sys
import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()  # every pair connected before a rank may leave (a rank gone mid-handshake fails the other's)
port, listening = int(os.environ["MASTER_PORT"]), []
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    for line in open(table).read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
            listening.append(local.rsplit(":", 1)[0])
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as out:
    json.dump(sorted(listening), out)
dist.barrier()
dist.destroy_process_group()
"""
LOOPBACK = "0100007F"
"""127.0.0.1 as /proc/net/tcp writes it; a wildcard is all zeros."""


def listeners(tmp_path, *rendezvous: str) -> list[str]:
    """The addresses listening on the store's port, as both ranks of a torchrun job saw them."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    result = subprocess.run([sys.executable, "-m", "prl.trainer.torchrun", "--nnodes=1", "--nproc-per-node=2",
                             *rendezvous, str(script), str(tmp_path)], capture_output=True, text=True, cwd=REPO,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    seen = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert seen[0] == seen[1], seen
    return seen[0]


def test_the_trainers_rendezvous_store_listens_on_the_nodes_address_only(tmp_path):
    from prl.planner.model import RENDEZVOUS_BACKEND  # what the job's trainer task names and the launcher registers

    port = free_port()
    assert listeners(tmp_path, f"--rdzv-backend={RENDEZVOUS_BACKEND}", f"--rdzv-endpoint=127.0.0.1:{port}",
                     "--rdzv-conf=rank=0") == [LOOPBACK]


def test_torchruns_own_static_rendezvous_listens_on_every_interface(tmp_path):
    """What the backend is for: torchrun's static rendezvous, given the same address, binds a wildcard."""
    port = free_port()
    got = listeners(tmp_path, "--master-addr=127.0.0.1", f"--master-port={port}")
    assert got and all(set(address) == {"0"} for address in got), got


def test_the_backend_needs_the_nodes_rank(tmp_path):
    result = subprocess.run([sys.executable, "-m", "prl.trainer.torchrun", "--nnodes=1", "--nproc-per-node=1",
                             "--rdzv-backend=prl-static", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "x.py"],
                            capture_output=True, text=True, cwd=REPO, timeout=300)
    last = result.stderr.strip().splitlines()[-1:]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert last[0].startswith("prl trainer.torchrun: error: --rdzv-backend=prl-static needs --rdzv-conf=rank=N"), last
