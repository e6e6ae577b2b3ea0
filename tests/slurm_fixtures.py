"""The real local Slurm cluster (scripts/slurm-cluster.sh) as a session fixture.

A pytest plugin (tests/conftest.py `pytest_plugins`): a test asks for `slurm_cluster` by name, no import.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "slurm-cluster.sh"
PARTITION = "lab"
NODES = 4
CLUSTER_FIXTURES = {"slurm_cluster"}
"""Fixtures that bring the real cluster: a test using one is marked `slurm` (tests/conftest.py)."""


@dataclass(frozen=True)
class SlurmCluster:
    partition: str
    nodes: int
    accounting: bool
    """False when the cluster runs without slurmdbd (sacct is disabled)."""


def _ready_nodes() -> int:
    try:
        out = subprocess.run(
            ["sinfo", "--noheader", "--Node", f"--partition={PARTITION}", "--format=%N %T"],
            capture_output=True, text=True, timeout=15, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return 0
    if out.returncode != 0:
        return 0
    states = [line.split()[-1] for line in out.stdout.splitlines() if line.strip()]
    return sum(s in {"idle", "mixed", "allocated", "completing"} for s in states)


def _accounting() -> bool:
    out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=15, check=False)
    for line in out.stdout.splitlines():
        if line.startswith("AccountingStorageType"):
            return "slurmdbd" in line
    return False


@pytest.fixture(scope="session")
def slurm_cluster() -> SlurmCluster:
    """A running 4-node cluster; started with the script if it is not up."""
    if _ready_nodes() < NODES:
        if shutil.which("apt-get") is None or os.geteuid() != 0:
            pytest.fail(
                f"no ready Slurm cluster (partition {PARTITION!r}, {NODES} nodes) and cannot start one "
                f"here (needs root on Debian): run `sudo {SCRIPT} start`"
            )
        proc = subprocess.run([str(SCRIPT), "start"], capture_output=True, text=True, timeout=600, check=False)
        if proc.returncode != 0:
            pytest.fail(f"{SCRIPT} start failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    assert _ready_nodes() == NODES, "cluster started but not all nodes are ready"
    return SlurmCluster(partition=PARTITION, nodes=NODES, accounting=_accounting())
