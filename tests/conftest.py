"""Shared fixtures. Real-component fixtures (Slurm cluster, vLLM server) live beside their tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SHIPPED = sorted(p.stem for p in (REPO / "configs").glob("*.yaml"))


@pytest.fixture
def repo() -> Path:
    return REPO
