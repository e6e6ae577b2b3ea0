"""Hostile strings in every string field end up inert when bash runs the rendered scripts.

Each string leaf of a full topology (and the profile's shell-bound fields) is set in turn
to a payload that would create a canary file if any shell evaluated it. The field is
either refused with a ConfigError, or the rendered scripts, run by real bash with fake
`srun`/`python3` on PATH, leave no canary and hand the value through unchanged.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from prl.errors import ConfigError
from prl.planner.prepare import prepare

PAYLOADS = [
    "x$(touch {canary})",
    "x`touch {canary}`",
    "x'; touch {canary}; echo '",
    'x"; touch {canary}; echo "',
    "x; touch {canary}",
    "x\ntouch {canary}\n",
]

TOPOLOGY: dict[str, Any] = {
    "name": "inj",
    "cluster": "./prof.yaml",
    "run_dir": "/tmp/inj-run",
    "model": {"path": "/models/m", "tokenizer": "/models/tok"},
    "inference": {"nodes": 1, "extra_args": ["--seed", "1"], "env": {"A_VAR": "a"}},
    "trainer": {"nodes": 1, "env": {"T_VAR": "t"}},
    "orchestrator": {"placement": "own", "env": {"O_VAR": "o"}},
    "environment": {"id": "prl_reverse_text", "args": {"split": "train"}},
    "training": {"batch_size": 8, "rollouts_per_example": 4, "max_steps": 2},
    "slurm": {"time": "10", "qos": "q", "reservation": "r", "account": "a", "job_name": "j",
              "extra_directives": ["--comment=c"]},
}

PROFILE: dict[str, Any] = {
    "name": "inj", "partitions": {"inference": "p", "trainer": "p", "orchestrator": "p"},
    "account": "acct", "qos": "q", "gpu_node": {"gpus": 2, "cpus": 8, "memory_gb": 64},
    "constraint": "c", "modules": ["mod/1"], "venv": "/envs/v", "python": "python3",
    "env": {"C_VAR": "c"}, "shared_root": "/tmp", "network": {"interface": "eth0", "env": {"N_VAR": "n"}},
    "container": {"image": "img", "mounts": ["/a:/a"], "workdir": "/w"}, "max_nodes": 8,
}
# `setup` is shell by contract (cluster-admin code); every other profile string is checked.


def _string_leaves(obj: Any, prefix: tuple = ()) -> list[tuple]:
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in _string_leaves(v, prefix + (k,))]
    if isinstance(obj, list):
        return [p for i, v in enumerate(obj) for p in _string_leaves(v, prefix + (i,))]
    return [prefix] if isinstance(obj, str) else []


def _set(obj: Any, path: tuple, value: str) -> Any:
    import copy

    out = copy.deepcopy(obj)
    target = out
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value
    return out


FAKE_BIN = {
    # Record argv one per line and the environment, never evaluate anything.
    "srun": '#!/bin/bash\nprintf "%s\\n" "$@" >> "$FAKE_LOG"\n',
    "python3": '#!/bin/bash\nprintf "%s\\n" "$@" >> "$FAKE_LOG"\nenv >> "$FAKE_LOG"\n',
    "module": '#!/bin/bash\nprintf "module %s\\n" "$@" >> "$FAKE_LOG"\n',
}


def _run_scripts(files: dict[str, str], tmp_path: Path) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in FAKE_BIN.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    venv = Path("/envs/v/bin")
    log = tmp_path / "fake.log"
    log.write_text("")
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_LOG": str(log), "HOME": str(tmp_path)}
    for rel, text in files.items():
        if not rel.endswith((".sh", ".sbatch")):
            continue
        script = tmp_path / "scripts" / Path(rel).name
        script.parent.mkdir(exist_ok=True)
        # `source /envs/v/bin/activate` would fail on this machine; give it an empty file when quoted right.
        script.write_text(text.replace("source /envs/v/bin/activate", ": source /envs/v/bin/activate"))
        subprocess.run(["bash", str(script)], env=env, cwd=tmp_path, capture_output=True, timeout=30)
    del venv
    return log.read_text()


CASES = [("topology", p) for p in _string_leaves(TOPOLOGY)] + [("profile", p) for p in _string_leaves(PROFILE)]


@pytest.mark.parametrize("payload", PAYLOADS, ids=["subst", "backtick", "squote", "dquote", "semicolon", "newline"])
@pytest.mark.parametrize("case", CASES, ids=[f"{w}:{'.'.join(map(str, p))}" for w, p in CASES])
def test_field_is_inert(tmp_path, case, payload):
    which, path = case
    canary = tmp_path / "CANARY"
    value = payload.format(canary=canary)
    topo, profile = TOPOLOGY, PROFILE
    if which == "topology":
        topo = _set(TOPOLOGY, path, value)
    else:
        profile = _set(PROFILE, path, value)
    (tmp_path / "prof.yaml").write_text(yaml.safe_dump(profile))
    (tmp_path / "topo.yaml").write_text(yaml.safe_dump(topo))
    try:
        prepared = prepare(tmp_path / "topo.yaml", cwd=tmp_path)
    except ConfigError:
        return  # refused with a located message: inert
    log = _run_scripts(prepared.files, tmp_path)
    assert not canary.exists(), f"{'.'.join(map(str, path))} reached a shell unquoted"
    assert not os.path.exists(str(canary)), log
    assert "touch" not in log or value.splitlines()[0] in log or value in log


def test_env_value_round_trips(tmp_path):
    """A value with every shell metacharacter arrives in the role's environment byte for byte."""
    value = "a$(b)`c`'d\"e;f g\\h"
    topo = _set(TOPOLOGY, ("trainer", "env", "T_VAR"), value)
    (tmp_path / "prof.yaml").write_text(yaml.safe_dump(PROFILE))
    (tmp_path / "topo.yaml").write_text(yaml.safe_dump(topo))
    log = _run_scripts(prepare(tmp_path / "topo.yaml", cwd=tmp_path).files, tmp_path)
    assert f"T_VAR={value}\n" in log
