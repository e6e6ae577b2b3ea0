"""`prl plan` against hostile input: every bad topology, profile or override gets one located line.

Six corpora (YAML, schema, resources, shell, terminal markup, size), each a list of named cases.
Each case runs `prl plan` in-process (prl.cli.main with a patched argv) and must end with exit
code 2, exactly one stderr line `error: LOCATION: ...` where LOCATION is `file:LINE (field)` or
`override '...' (field)`, no traceback, nothing on stdout, no run directory and no run registry.
A handful of real subprocesses check the same through `python -m prl.cli`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

import prl.planner.prepare  # noqa: F401  (imported once here, not under the first case's timeout)
from tests.helpers import REPO
from prl.cli import main

BASE = """\
name: adv
cluster: ./prof.yaml
run_dir: {run}
model:
  path: /models/m
  max_model_len: 4096
inference:
  nodes: 1
  tp: 2
trainer:
  nodes: 1
orchestrator:
  placement: own
environment:
  id: prl_reverse_text
training:
  batch_size: 64
  rollouts_per_example: 8
  max_steps: 10
  max_tokens: 512
slurm:
  time: "01:00:00"
"""

PROFILE = """\
name: advgpu
partitions:
  inference: gpu
  trainer: gpu
  orchestrator: cpu
gpu_node:
  gpus: 8
  cpus: 64
  memory_gb: 1000
cpu_node:
  gpus: 0
  cpus: 32
  memory_gb: 256
shared_root: /shared
max_nodes: 16
"""

ANY = "#"
"""In an expected location, stands for any line number."""


@dataclass
class Case:
    id: str
    where: str
    """Expected location: `{topo}:12`, `{prof}:3`, `{topo}:#` (any line), `override 'a=b'`, `{topo}`."""
    field: Optional[str] = None
    """Expected field, shown in parentheses after the location."""
    topo: Optional[str] = None
    """Topology text (None: BASE); `{run}` becomes the run directory."""
    profile: str = PROFILE
    overrides: tuple[str, ...] = ()
    raw: Optional[bytes] = None
    """Topology bytes instead of text."""
    make: Optional[Callable[[Path], Path]] = None
    """Builds the topology path itself (FIFO, directory, ...) in tmp_path."""
    says: Optional[str] = None
    """A fragment the message must contain."""
    marks: tuple = ()


def _line_of(text: str, new: str, at: int) -> int:
    return text[:text.index(new)].count("\n") + 1 + at


def edit(id: str, old: str, new: str, field: Optional[str] = None, *, at: int = 0, line: Any = True,
         base: str = BASE, **kw: Any) -> Case:
    """A case that replaces `old` by `new` in BASE; the error is expected at the line where `new` starts (+at)."""
    assert base.count(old) == 1, f"{id}: {old!r} must occur once"
    text = base.replace(old, new)
    where = "{topo}:" + (str(_line_of(text, new, at)) if line is True else ANY) if line else "{topo}"
    return Case(id, where, field, topo=text, **kw)


def prof(id: str, old: str, new: str, field: Optional[str] = None, *, at: int = 0, **kw: Any) -> Case:
    """A case that edits the cluster profile; the error is expected there."""
    assert PROFILE.count(old) == 1, f"{id}: {old!r} must occur once"
    text = PROFILE.replace(old, new)
    return Case(id, "{prof}:" + str(_line_of(text, new, at)), field, profile=text, **kw)


def over(id: str, *overrides: str, field: Optional[str] = None, blame: Optional[str] = None, **kw: Any) -> Case:
    """A case of command-line overrides; the error names `blame` (default: the last override)."""
    blamed = repr(blame or overrides[-1])
    blamed = (blamed if len(blamed) < 150 else blamed[:150]).replace("{", "{{").replace("}", "}}")  # not a format field
    return Case(id, f"override {blamed}", field, overrides=overrides, **kw)


def append(id: str, extra: str, field: Optional[str] = None, *, at: int = 0, line: Any = True, **kw: Any) -> Case:
    """A case that adds text at the end of BASE."""
    return edit(id, 'time: "01:00:00"\n', 'time: "01:00:00"\n' + extra, field, at=at + 1, line=line, **kw)




def _alias_bomb() -> str:
    lines = ['lol0: ["lol"]'] + [f"lol{i}: [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 10)]
    lines = [line.replace(f"lol{i}:", f"lol{i}: &l{i}") for i, line in enumerate(lines)]
    return "\n".join(lines) + "\n"


def _doubling() -> str:
    lines = ["x0: xxxxxxxxxxxxxxxx"] + [f"x{i}: ${{x{i - 1}}}${{x{i - 1}}}" for i in range(1, 48)]
    return "\n".join(lines) + "\n"


YAML_CASES = [
    edit("unclosed-flow", "  max_model_len: 4096", "  max_model_len: [4096", line=ANY, says="invalid YAML"),
    edit("tab-indent", "  tp: 2", "\ttp: 2", line=ANY, says="invalid YAML"),
    edit("bad-indent", "  max_model_len: 4096", "    max_model_len: 4096", line=ANY, says="invalid YAML"),
    edit("unterminated-quote", "  path: /models/m", '  path: "/models/m', line=ANY, says="invalid YAML"),
    edit("bad-escape", "  path: /models/m", '  path: "/models/\\q"', line=ANY, says="invalid YAML"),
    edit("duplicate-top-key", "name: adv\n", "name: adv\nname: other\n", "name", at=1, says="duplicate key"),
    edit("duplicate-nested-key", "  tp: 2", "  tp: 2\n  tp: 4", "inference.tp", at=1, says="first at line 9"),
    edit("duplicate-in-flow", "  tp: 2", "  tp: 2\n  env: {A: x, A: y}", "inference.env.A", at=1),
    edit("python-tag", "name: adv", 'name: !!python/object/apply:os.system ["touch pwned"]', "name",
         says="not supported"),
    edit("python-name-tag", "  tp: 2", "  tp: !!python/name:os.system", "inference.tp", says="not supported"),
    edit("local-tag", "  tp: 2", "  tp: !custom 2", "inference.tp", says="not supported"),
    edit("int-tag-on-word", "  tp: 2", "  tp: !!int two", "inference.tp", says="not supported"),
    edit("binary-tag", "  path: /models/m", "  path: !!binary aGVsbG8=", "model.path", says="not supported"),
    edit("set-tag", "  id: prl_reverse_text", "  id: prl_reverse_text\n  args: !!set {a, b}", "environment.args",
         at=1, says="not supported"),
    edit("tag-directive", "name: adv\n", "%TAG !e! tag:evil.example,2000:\n---\nname: !e!x adv\n", "name", at=2,
         says="not supported"),
    edit("tagged-key", "  tp: 2", "  !!python/name:os.system tp: 2", "inference", says="not supported"),
    edit("complex-key", "name: adv\n", "name: adv\n? [a, b]\n: 1\n", at=1, says="a key must be a name"),
    edit("complex-key-flow", "  tp: 2", "  tp: 2\n  env: {[a, b]: x}", "inference.env", at=1,
         says="a key must be a name"),
    edit("mapping-key", "  tp: 2", "  tp: 2\n  ? {a: 1}\n  : 2", "inference", at=1, says="a key must be a name"),
    edit("null-key", "  tp: 2", "  tp: 2\n  ~: 1", "inference", at=1, says="reads as null"),
    edit("bool-key", "  tp: 2", "  tp: 2\n  yes: 1", "inference", at=1, says="reads as bool"),
    edit("float-key", "  tp: 2", "  tp: 2\n  env: {1.5: x}", "inference.env", at=1, says="reads as float"),
    edit("date-key", "name: adv\n", "name: adv\n2001-01-01: x\n", at=1, says="reads as timestamp"),
    edit("lone-equals", "  tp: 2", "  tp: =", "inference.tp", says="value key"),
    edit("undefined-alias", "  tp: 2", "  tp: *nope", says="no anchor"),
    edit("recursive-alias", "  tp: 2", "  tp: 2\n  extra_args: &a [*a]", at=1, says="contains it"),
    edit("recursive-alias-map", "  tp: 2", "  tp: 2\n  env: &e {A: *e}", at=1, says="contains it"),
    append("alias-bomb", _alias_bomb(), line=ANY, says="aliases expanded"),
    edit("merge-scalar", "trainer:\n  nodes: 1", "trainer:\n  <<: 3\n  nodes: 1", "trainer", at=1,
         says="merge key"),
    edit("merge-list-of-scalars", "trainer:\n  nodes: 1", "trainer:\n  <<: [1, 2]\n  nodes: 1", "trainer", at=1,
         says="merge key"),
    edit("merge-brings-typo", "inference:\n  nodes: 1\n  tp: 2", "inference:\n  <<: {nodes: 1, tq: 2}",
         "inference.tq", at=1, says="did you mean 'tp'?"),
    edit("alias-to-scalar-where-map-goes", "trainer:\n  nodes: 1", "trainer: &t 1", "trainer",
         says="valid dictionary"),
    Case("non-utf8-byte", "{topo}:5", raw=BASE.replace("/models/m", "/models/\xff").encode("latin-1"),
         says="not UTF-8"),
    Case("latin1-file", "{topo}:1", raw=BASE.replace("name: adv", "name: caf\xe9").encode("latin-1"),
         says="not UTF-8"),
    Case("utf16-file", "{topo}:1", raw=BASE.encode("utf-16"), says="not UTF-8"),
    Case("nul-byte", "{topo}:5", raw=BASE.replace("/models/m", "/models/\x00m").encode(), says="U+0000"),
    Case("raw-escape-byte", "{topo}:5", raw=BASE.replace("/models/m", "/models/\x1b[31mm").encode(),
         says="U+001B"),
    Case("bom-then-typo", "{topo}:10", "trainr", raw=("\ufeff" + BASE.replace("trainer:", "trainr:")).encode(),
         says="did you mean 'trainer'?"),
    Case("empty-file", "{topo}", "name", topo="", says="required field is missing"),
    Case("only-comments", "{topo}", "name", topo="# nothing here\n", says="required field is missing"),
    Case("top-level-list", "{topo}:1", topo="- name: adv\n- cluster: x\n", says="expected a mapping"),
    Case("top-level-scalar", "{topo}:1", topo="hello\n", says="expected a mapping"),
    Case("top-level-null", "{topo}:1", topo="~\n", says="expected a mapping"),
    append("two-documents", "---\nname: other\n", says="one document"),
]


SCHEMA_CASES = [
    edit("typo-top", "trainer:", "trainr:", "trainr", says="did you mean 'trainer'?"),
    edit("typo-nested", "  path: /models/m", "  pth: /models/m", "model.pth", says="did you mean 'path'?"),
    edit("typo-depth-3", "  tp: 2", "  tp: 2\n  kv_offload:\n    backnd: native", "inference.kv_offload.backnd",
         at=2, says="did you mean 'backend'?"),
    edit("typo-in-group", "  nodes: 1\n  tp: 2", "  prefill: {nodes: 1, tpp: 2}\n  decode: {nodes: 1}",
         "inference.prefill.tpp", says="did you mean 'tp'?"),
    edit("typo-loss", "  max_tokens: 512", "  max_tokens: 512\n  loss:\n    moed: clip", "training.loss.moed", at=2,
         says="did you mean 'mode'?"),
    append("unknown-no-match", "zzzqqq: 1\n", "zzzqqq", says="docs/reference.md"),
    edit("word-for-int", "  nodes: 1\norch", "  nodes: two\norch", "trainer.nodes", says="valid integer"),
    edit("yes-for-int", "  nodes: 1\norch", "  nodes: yes\norch", "trainer.nodes", says="booleans"),
    edit("on-for-int", "  tp: 2", "  tp: on", "inference.tp", says="booleans"),
    edit("off-for-str", "  id: prl_reverse_text", "  id: off", "environment.id", says="booleans"),
    edit("quoted-int", "  nodes: 1\norch", '  nodes: "1"\norch', "trainer.nodes", says="valid integer"),
    edit("float-for-int", "  nodes: 1\norch", "  nodes: 1.5\norch", "trainer.nodes", says="valid integer"),
    edit("whole-float-for-int", "  nodes: 1\norch", "  nodes: 2.0\norch", "trainer.nodes", says="valid integer"),
    edit("null-for-int", "  nodes: 1\norch", "  nodes: ~\norch", "trainer.nodes", says="valid integer"),
    edit("list-for-str", "name: adv", "name: [adv]", "name", says="valid string"),
    edit("map-for-int", "  tp: 2", "  tp: {a: 1}", "inference.tp", says="valid integer"),
    edit("scalar-for-model", "model:\n  path: /models/m\n  max_model_len: 4096", "model: /models/m", "model",
         says="valid dictionary"),
    edit("list-for-model", "trainer:\n  nodes: 1", "trainer: [1]", "trainer", says="valid dictionary"),
    edit("negative", "  tp: 2", "  tp: -2", "inference.tp", says="greater than or equal to 1"),
    edit("zero", "  nodes: 1\norch", "  nodes: 0\norch", "trainer.nodes", says="greater than or equal to 1"),
    edit("dp-shard-minus-2", "  nodes: 1\norch", "  nodes: 1\n  dp_shard: -2\norch", "trainer.dp_shard", at=1),
    edit("huge-tp", "  tp: 2", "  tp: 100000", "inference.tp", says="less than or equal to 4096"),
    edit("lr-inf", "  max_steps: 10", "  max_steps: 10\n  lr: .inf", "training.lr", at=1, says="finite"),
    edit("lr-minus-inf", "  max_steps: 10", "  max_steps: 10\n  lr: -.inf", "training.lr", at=1, says="finite"),
    edit("temperature-nan", "  max_steps: 10", "  max_steps: 10\n  temperature: .NaN", "training.temperature",
         at=1, says="finite"),
    edit("nan-in-free-args", "  id: prl_reverse_text", "  id: prl_reverse_text\n  args: {scale: .nan}",
         "environment.args.scale", at=1, says="finite"),
    edit("float-overflow-is-inf", "  max_steps: 10", "  max_steps: 10\n  lr: 1.0e+400", "training.lr", at=1,
         says="finite"),
    edit("sexagesimal-time", 'time: "01:00:00"', "time: 5:00", "slurm.time", says='quote it: "5:00"'),
    edit("sexagesimal-count", "  max_steps: 10", "  max_steps: 1:00", "training.max_steps", says="base-60"),
    edit("bad-time", 'time: "01:00:00"', "time: soon", "slurm.time", says="time must look like"),
    edit("env-missing", "  path: /models/m", "  path: ${oc.env:PRL_ADVERSARIAL_UNSET}", "model.path",
         says="PRL_ADVERSARIAL_UNSET"),
    edit("missing-key", "  path: /models/m", "  path: /models/${nope}", "model.path", says="nope"),
    edit("self-reference", "  path: /models/m", "  path: ${model.path}", "model.path", says="Recursive"),
    edit("reference-loop", "  path: /models/m", "  path: ${model.tokenizer}\n  tokenizer: ${model.path}",
         "model.path", says="Recursive"),
    edit("broken-interpolation", "  path: /models/m", "  path: /models/${", "model.path"),
    edit("unknown-resolver", "  path: /models/m", "  path: ${nope:x}", "model.path", says="nope"),
    edit("stray-unified-field", "  nodes: 1\n  tp: 2", "  prefill: {nodes: 1}\n  decode: {nodes: 1}\n  tp: 2",
         "inference.tp", at=2, says="set it inside each group"),
    edit("ratio-bounds", "  max_tokens: 512", "  max_tokens: 512\n  loss: {ratio_low: 2, ratio_high: 1}",
         "training.loss.ratio_low", at=1, says="must be below"),
    edit("seed-negative", "  max_steps: 10", "  max_steps: 10\n  seed: -1", "training.seed", at=1),
    edit("stray-unified-default", "  nodes: 1\n  tp: 2", "  prefill: {nodes: 1}\n  decode: {nodes: 1}\n  tp: 1",
         "inference.tp", at=2, says="set it inside each group"),
    edit("stray-unified-null", "  nodes: 1\n  tp: 2",
         "  prefill: {nodes: 1}\n  decode: {nodes: 1}\n  gpu_memory_utilization: null",
         "inference.gpu_memory_utilization", at=2, says="set it inside each group"),
    edit("huge-int-for-float", "  max_steps: 10", "  max_steps: 10\n  lr: 1" + "0" * 400, "training.lr", at=1,
         says="valid number"),
    edit("bool-for-float", "  max_steps: 10", "  max_steps: 10\n  lr: true", "training.lr", at=1, says="booleans"),
    edit("int-for-bool", "  tp: 2", "  tp: 2\n  expert_parallel: 1", "inference.expert_parallel", at=1,
         says="valid boolean"),
    edit("null-env-value", "  nodes: 1\norch", "  nodes: 1\n  env: {A: null}\norch", "trainer.env.A", at=1,
         says="valid string"),
    edit("float-for-minutes", 'time: "01:00:00"', "time: 1.5", "slurm.time", says="valid string"),
    over("override-no-equals", "trainer.nodes", says="expected key.path=value"),
    over("override-no-key", "=3", says="expected key.path=value"),
    over("override-empty-part", "a..b=1", says="expected key.path=value"),
    over("override-leading-dot", ".trainer.nodes=1", says="expected key.path=value"),
    over("override-space-in-key", "trainer nodes=1", says="expected key.path=value"),
    over("override-deep-key", "environment.args" + ".a" * 40 + "=1", says="at most 32 names"),
    over("override-word", "trainer.nodes=x", field="trainer.nodes", says="valid integer"),
    over("override-unknown", "trainer.nodez=2", field="trainer.nodez", says="did you mean 'nodes'?"),
    over("override-unknown-top", "trainr.nodes=2", field="trainr", says="did you mean 'trainer'?"),
    over("override-bad-yaml", "trainer.nodes=[", field="trainer.nodes", says="invalid YAML"),
    over("override-bool", "trainer.nodes=yes", field="trainer.nodes", says="booleans"),
    over("override-replaces-model", "model=3", field="model", says="valid dictionary"),
    over("override-below-scalar", "trainer.nodes.x=3", field="trainer.nodes"),
    over("override-tag", "name=!!python/name:os.system", field="name", says="not supported"),
    over("override-sexagesimal", "slurm.time=5:00", field="slurm.time", says="base-60"),
    over("override-inf", "training.lr=.inf", field="training.lr", says="finite"),
    over("override-newline-value", "trainer.nodes=1\nfoo: 2", field="trainer.nodes"),
    over("override-list-for-mapping", "trainer=[1,2]", field="trainer", says="cannot merge"),
    over("override-not-utf8", "name=\udcff", says="not valid UTF-8"),
    # An override replaces the file's list (and writes the keys of its mapping): what it wrote is blamed on it.
    over("override-list-replaces-file-list", 'inference.extra_args=["--seed", "--port=9000"]',
         field="inference.extra_args[1]", topo=BASE.replace("  tp: 2", '  tp: 2\n  extra_args: ["--enforce-eager", "-O0"]'),
         says="--port is set"),
    over("override-mapping-writes-file-key", 'inference.env={A: "\\x1b"}', field="inference.env.A",
         topo=BASE.replace("  tp: 2", "  tp: 2\n  env: {A: x}"), says="U+001B"),
    over("override-mapping-sets-file-field", "inference={tp: 3}", field="inference.tp", says="tp(3) must divide"),
    over("override-blamed-among-many", "trainer.nodes=1", "training.max_steps=0", "name=ok",
         blame="training.max_steps=0", field="training.max_steps"),
    over("cluster-override", "cluster.max_nodes=0", blame="max_nodes=0", field="max_nodes"),
    over("cluster-override-unknown", "cluster.max_nodez=3", blame="max_nodez=3", field="max_nodez",
         says="did you mean 'max_nodes'?"),
    prof("profile-typo", "gpu_node:", "gpu_nod:", "gpu_nod", says="did you mean 'gpu_node'?"),
    prof("profile-yes", "max_nodes: 16", "max_nodes: yes", "max_nodes", says="booleans"),
    prof("profile-duplicate", "max_nodes: 16", "max_nodes: 16\nmax_nodes: 8", "max_nodes", at=1,
         says="duplicate key"),
    prof("profile-tag", "shared_root: /shared", "shared_root: !!python/name:os.system", "shared_root"),
    prof("profile-memory-inf", "memory_gb: 1000", "memory_gb: .inf", "gpu_node.memory_gb", says="finite"),
    prof("profile-port", "max_nodes: 16", "max_nodes: 16\nport_base: 70000", "port_base", at=1),
]


RESOURCE_CASES = [
    Case("over-max-nodes", "{prof}:15", "max_nodes", topo=BASE.replace("  nodes: 1\norch", "  nodes: 20\norch"),
         says="max_nodes(16)"),
    edit("absurd-nodes", "  nodes: 1\norch", "  nodes: 1000000000000\norch", "trainer.nodes",
         says="less than or equal to 100000"),
    edit("absurd-inference-nodes", "  nodes: 1\n  tp", "  nodes: 100001\n  tp", "inference.nodes",
         says="less than or equal to 100000"),
    edit("tp-not-dividing", "  tp: 2", "  tp: 3", "inference.tp", says="tp(3)"),
    edit("tp-over-node", "  tp: 2", "  tp: 16", "inference.tp", says="8 GPUs"),
    edit("replica-not-dividing", "  tp: 2", "  tp: 2\n  dp: 3", "inference.dp", at=1),
    edit("trainer-gpus-over-node", "  nodes: 1\norch", "  nodes: 1\n  gpus_per_node: 16\norch",
         "trainer.gpus_per_node", at=1),
    edit("ep-not-dividing", "  nodes: 1\norch", "  nodes: 1\n  ep: 3\norch", "trainer.ep", at=1),
    edit("cp-not-dividing", "  nodes: 1\norch", "  nodes: 1\n  cp: 3\norch", "trainer.cp", at=1),
    edit("mesh-product", "  nodes: 1\norch", "  nodes: 1\n  dp_shard: 3\norch", "trainer.dp_shard", at=1),
    edit("orchestrator-cpus", "placement: own", "placement: own\n  cpus: 64", "orchestrator.cpus", at=1),
    edit("batch-not-multiple", "batch_size: 64", "batch_size: 60", "training.batch_size"),
    edit("max-tokens-over-context", "max_tokens: 512", "max_tokens: 4096", "training.max_tokens"),
    edit("offload-memory", "  tp: 2", "  tp: 2\n  kv_offload: {backend: native, cpu_gb: 900}",
         "inference.kv_offload.cpu_gb", at=1),
    edit("router-on-server-port", "  nodes: 1\n  tp: 2",
         "  prefill: {nodes: 1}\n  decode: {nodes: 1}\n  router: {port: 8000}", "inference.router.port", at=2,
         says="used twice"),
    edit("router-port-over-65535", "  nodes: 1\n  tp: 2",
         "  prefill: {nodes: 1}\n  decode: {nodes: 1}\n  router: {port: 70000}", "inference.router.port", at=2),
    Case("ports-over-65535", "{prof}:16", "port_base",
         topo=BASE.replace("  tp: 2", "  tp: 1").replace("  nodes: 1\norch", "  nodes: 1\n  gpus_per_node: 8\norch"),
         profile=PROFILE.replace("gpus: 8", "gpus: 1024") + "port_base: 65000\n", says="65535"),
    Case("profile-gpus-absurd", "{prof}:7", "gpu_node.gpus", profile=PROFILE.replace("gpus: 8", "gpus: 1000000")),
    Case("profile-max-nodes-absurd", "{prof}:15", "max_nodes",
         profile=PROFILE.replace("max_nodes: 16", "max_nodes: 1000000000000")),
    Case("profile-no-hetjob", "{prof}:16", "hetjob", profile=PROFILE + "hetjob: false\n", says="no hetjobs"),
    Case("override-over-max-nodes", "{prof}:15", "max_nodes", overrides=("trainer.nodes=15",),
         says="max_nodes(16)"),
]


SFT_BASE = """\
name: adv
cluster: ./prof.yaml
run_dir: {run}
model:
  path: /models/m
trainer:
  nodes: 1
sft:
  data: /data/chat.jsonl
training:
  batch_size: 64
  max_steps: 10
"""

SFT_CASES = [
    edit("sft-with-inference", "sft:", "inference:\n  nodes: 1\nsft:", "inference", base=SFT_BASE,
         says="runs the trainer alone"),
    edit("sft-with-orchestrator", "sft:", "orchestrator:\n  placement: own\nsft:", "orchestrator", base=SFT_BASE,
         says="remove orchestrator"),
    edit("sft-with-environment", "sft:", "environment:\n  id: e\nsft:", "environment", base=SFT_BASE),
    edit("sft-typo", "  data: /data/chat.jsonl", "  dta: /data/chat.jsonl", "sft.dta", base=SFT_BASE,
         says="did you mean 'data'?"),
    edit("sft-no-data", "  data: /data/chat.jsonl", "  split: train", "sft.data", base=SFT_BASE, line=False),
    edit("sft-zero-epochs", "  data: /data/chat.jsonl", "  data: /data/chat.jsonl\n  epochs: 0", "sft.epochs",
         at=1, base=SFT_BASE),
    edit("sft-batch-under-dp", "batch_size: 64", "batch_size: 4", "training.batch_size", base=SFT_BASE,
         says="use at least 8"),
    edit("sft-with-rl-temperature", "  max_steps: 10", "  max_steps: 10\n  temperature: 0.7", "training.temperature",
         at=1, base=SFT_BASE, says="an SFT run would ignore it"),
    edit("sft-with-rl-loss", "  max_steps: 10", "  max_steps: 10\n  loss: {kl_coef: 0.1}", "training.loss", at=1,
         base=SFT_BASE, says="RL setting"),
    edit("rl-without-environment", "environment:\n  id: prl_reverse_text\n", "", "environment", line=False,
         says="sft:"),
]


SHELL_CASES = [
    edit("name-subst", "name: adv", 'name: "adv$(touch pwned)"', "name"),
    edit("name-backtick", "name: adv", 'name: "adv`id`"', "name"),
    edit("job-name-semicolon", 'time: "01:00:00"', 'time: "01:00:00"\n  job_name: "j;id"', "slurm.job_name",
         at=1),
    edit("qos-subst", 'time: "01:00:00"', 'time: "01:00:00"\n  qos: "q$(id)"', "slurm.qos", at=1),
    edit("account-quote", 'time: "01:00:00"', 'time: "01:00:00"\n  account: "a\'b"', "slurm.account", at=1),
    edit("reservation-newline", 'time: "01:00:00"', 'time: "01:00:00"\n  reservation: "r\\nid"',
         "slurm.reservation", at=1),
    edit("directive-subst", 'time: "01:00:00"', 'time: "01:00:00"\n  extra_directives: ["--comment=$(id)"]',
         "slurm.extra_directives", at=1, says="one long option"),
    edit("directive-backtick", 'time: "01:00:00"', 'time: "01:00:00"\n  extra_directives: ["--comment=`id`"]',
         "slurm.extra_directives", at=1),
    edit("directive-semicolon", 'time: "01:00:00"', 'time: "01:00:00"\n  extra_directives: ["--x=1;id"]',
         "slurm.extra_directives", at=1),
    edit("directive-quote", 'time: "01:00:00"', 'time: "01:00:00"\n  extra_directives: ["--x=\'a\'"]',
         "slurm.extra_directives", at=1),
    edit("directive-short-option", 'time: "01:00:00"', 'time: "01:00:00"\n  extra_directives: ["-N 3"]',
         "slurm.extra_directives", at=1),
    edit("time-subst", 'time: "01:00:00"', 'time: "$(id)"', "slurm.time"),
    edit("time-trailing-newline", 'time: "01:00:00"', 'time: "01:00:00\\n"', "slurm.time", says="time must look like"),
    edit("name-trailing-newline", "name: adv", 'name: "adv\\n"', "name"),
    edit("env-name-trailing-newline", "  nodes: 1\norch", '  nodes: 1\n  env: {"A\\n": x}\norch', "trainer.env", at=1,
         says="not a valid shell name"),
    edit("run-dir-subst", "run_dir: {run}", "run_dir: /shared/$(touch pwned)", "run_dir"),
    edit("run-dir-semicolon", "run_dir: {run}", "run_dir: /shared/a;id", "run_dir"),
    edit("run-dir-newline", "run_dir: {run}", 'run_dir: "/shared/a\\nid"', "run_dir", says="control"),
    edit("run-dir-root", "run_dir: {run}", "run_dir: /", "run_dir"),
    edit("run-dir-slashes", "run_dir: {run}", "run_dir: ///", "run_dir"),
    edit("run-dir-empty", "run_dir: {run}", 'run_dir: ""', "run_dir"),
    edit("run-dir-dotdot", "run_dir: {run}", "run_dir: /shared/../etc", "run_dir", says="'..'"),
    edit("run-dir-under-proc", "run_dir: {run}", "run_dir: /proc/self/cwd/run", "run_dir", says="is under /proc"),
    edit("run-dir-under-sys", "run_dir: {run}", "run_dir: /sys/fs/run", "run_dir", says="is under /sys"),
    edit("run-dir-from-shared-root-under-proc", "run_dir: {run}\n", "", "run_dir", line=False,
         profile=PROFILE.replace("/shared", "/proc/1/root"), says="is under /proc"),
    edit("model-path-newline", "  path: /models/m", '  path: "/models/m\\ntouch pwned"', "model.path",
         says="control"),
    edit("env-name-subst", "  nodes: 1\norch", '  nodes: 1\n  env: {"A$(id)": x}\norch', "trainer.env", at=1),
    edit("env-name-space", "  nodes: 1\norch", '  nodes: 1\n  env: {"A B": x}\norch', "trainer.env", at=1),
    edit("env-value-newline", "  nodes: 1\norch", '  nodes: 1\n  env: {A: "x\\ntouch pwned"}\norch',
         "trainer.env.A", at=1, says="control"),
    edit("extra-arg-newline", "  tp: 2", '  tp: 2\n  extra_args: ["--seed", "1\\n2"]', "inference.extra_args[1]",
         at=1),
    edit("kv-connector-subst", "  tp: 2", '  tp: 2\n  kv_connector: {name: "X$(id)"}', "inference.kv_connector.name",
         at=1),
    prof("partition-subst", "trainer: gpu", 'trainer: "gpu$(id)"', "partitions.trainer"),
    prof("partition-space", "trainer: gpu", 'trainer: "gpu; id"', "partitions.trainer"),
    prof("constraint-backtick", "max_nodes: 16", 'max_nodes: 16\nconstraint: "a`id`"', "constraint", at=1),
    prof("container-image-subst", "max_nodes: 16", 'max_nodes: 16\ncontainer: {image: "img$(id)"}',
         "container.image", at=1),
    prof("container-mount-quote", "max_nodes: 16", 'max_nodes: 16\ncontainer: {image: img, mounts: ["/a:/b\'"]}',
         "container.mounts[0]", at=1),
    prof("profile-env-name", "max_nodes: 16", 'max_nodes: 16\nenv: {"X;id": x}', "env", at=1),
    prof("profile-name-subst", "name: advgpu", 'name: "adv$(id)"', "name"),
    prof("gres-name-subst", "max_nodes: 16", 'max_nodes: 16\ngres_name: "gpu$(id)"', "gres_name", at=1),
    prof("interface-newline", "max_nodes: 16", 'max_nodes: 16\nnetwork: {interface: "eth0\\nid"}',
         "network.interface", at=1),
    prof("python-newline", "max_nodes: 16", 'max_nodes: 16\npython: "python3\\nid"', "python", at=1),
    prof("setup-escape", "max_nodes: 16", 'max_nodes: 16\nsetup: ["echo \\e[2J"]', "setup[0]", at=1),
]


MARKUP_CASES = [
    edit("name-markup", "name: adv", 'name: "[bold]x[/]"', "name", says="'[bold]x[/]'"),
    edit("name-close-tag", "name: adv", 'name: "[/]"', "name", says="'[/]'"),
    edit("name-link", "name: adv", 'name: "[link=https://example.com]x[/link]"', "name", says="[link="),
    edit("name-ansi", "name: adv", 'name: "\\e[31mred\\e[0m"', "name", says="\\x1b[31m"),
    edit("key-markup", "name: adv\n", 'name: adv\n"[bold]k[/]": 1\n', "'[bold]k[/]'", at=1, says="unknown field"),
    edit("key-ansi", "name: adv\n", 'name: adv\n"\\e[2Jk": 1\n', "'\\x1b[2Jk'", at=1, says="unknown field"),
    edit("env-name-markup", "  nodes: 1\norch", '  nodes: 1\n  env: {"[red]X": x}\norch', "trainer.env", at=1,
         says="'[red]X'"),
    edit("env-value-ansi", "  nodes: 1\norch", '  nodes: 1\n  env: {A: "\\e[31m"}\norch', "trainer.env.A", at=1,
         says="\\x1b[31m"),
    edit("model-path-ansi", "  path: /models/m", '  path: "/models/\\e]0;title\\a"', "model.path",
         says="\\x1b]0;title"),
    edit("run-dir-ansi", "run_dir: {run}", 'run_dir: "/shared/\\e[1mr"', "run_dir", says="\\x1b[1mr"),
    edit("qos-markup-space", 'time: "01:00:00"', 'time: "01:00:00"\n  qos: "[bold] q"', "slurm.qos", at=1,
         says="'[bold] q'"),
    edit("time-markup", 'time: "01:00:00"', 'time: "[/]"', "slurm.time", says="'[/]'"),
    edit("directive-markup", 'time: "01:00:00"', 'time: "01:00:00"\n  extra_directives: ["[bold]--x[/]"]',
         "slurm.extra_directives", at=1, says="[bold]--x[/]"),
    edit("cluster-ansi", "cluster: ./prof.yaml", 'cluster: "\\e[31mprof"', "cluster", says="\\x1b[31mprof"),
    edit("cluster-markup-missing", "cluster: ./prof.yaml", 'cluster: "[bold]nosuch[/]"', "cluster",
         says="[bold]nosuch[/]"),
    edit("unicode-line-separator", "name: adv", 'name: "a\\u2028b"', "name"),
    edit("bidi-override", "  path: /models/m", '  path: "/models/\\u202Egpj.exe"', "model.path", says="\\u202e"),
    over("override-into-file-mapping", "trainer.ep=3", field="trainer.ep"),
    edit("model-error-beside-override", "  nodes: 1\n  tp: 2", "  prefill: {nodes: 1}", "inference", at=-1,
         overrides=("inference.prefill.tp=1",), says="needs both prefill and decode"),
    over("override-new-mapping", "inference.kv_offload.backend=native", field="inference.kv_offload",
         says="needs cpu_gb > 0"),
    over("override-ansi", "trainer.nodes=\x1b[31m", field="trainer.nodes"),
    over("override-markup-key", "[bold]x[/]=1", says="expected key.path=value"),
    prof("profile-shared-root-ansi", "shared_root: /shared", 'shared_root: "/shared/\\e[5m"', "shared_root",
         says="\\x1b[5m"),
    Case("file-name-markup", "{dir}/[bold red]t[link=x].yaml:10", "trainr",
         make=lambda d: _write_as(d, "[bold red]t[link=x].yaml", BASE.replace("trainer:", "trainr:"))),
    Case("file-name-ansi", "'{dir}/t\\x1b[31m.yaml':10", "trainr",
         make=lambda d: _write_as(d, "t\x1b[31m.yaml", BASE.replace("trainer:", "trainr:"))),
    Case("file-name-not-utf8", "'{dir}/t\\udcff.yaml':10", "trainr",
         make=lambda d: _write_as(d, "t\udcff.yaml", BASE.replace("trainer:", "trainr:"))),
    Case("file-name-newline", "'{dir}/t\\nx.yaml':10", "trainr",
         make=lambda d: _write_as(d, "t\nx.yaml", BASE.replace("trainer:", "trainr:"))),
]


def _write_as(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(text.replace("{run}", str(directory / "run")))
    (directory / "prof.yaml").write_text(PROFILE)
    return path


def _fifo(directory: Path) -> Path:
    path = directory / "topo.yaml"
    os.mkfifo(path)
    return path


def _sparse(directory: Path) -> Path:
    path = directory / "topo.yaml"
    with open(path, "wb") as handle:
        handle.truncate(10 << 30)  # 10 GiB of holes: nothing may read it
    return path


def _symlink_loop(directory: Path) -> Path:
    path = directory / "topo.yaml"
    path.symlink_to(directory / "other.yaml")
    (directory / "other.yaml").symlink_to(path)
    return path


def _under_a_file(directory: Path) -> Path:
    (directory / "file").write_text("x")
    return directory / "file" / "topo.yaml"


def _unreadable(directory: Path) -> Path:
    path = directory / "topo.yaml"
    path.write_text(BASE)
    path.chmod(0)
    return path


def _profile_fifo(directory: Path) -> Path:
    os.mkfifo(directory / "fifo.yaml")
    return _write_as(directory, "topo.yaml", BASE.replace("./prof.yaml", "./fifo.yaml"))


def _profile_huge(directory: Path) -> Path:
    path = _write_as(directory, "topo.yaml", BASE)
    (directory / "prof.yaml").write_text(PROFILE + "#" * (2 << 20) + "\n")
    return path


def _profile_directory(directory: Path) -> Path:
    (directory / "profdir.yaml").mkdir()
    return _write_as(directory, "topo.yaml", BASE.replace("./prof.yaml", "./profdir.yaml"))


ROOT = os.geteuid() == 0 if hasattr(os, "geteuid") else False

HUGE_NODES = PROFILE.replace("gpus: 8", "gpus: 1024").replace("max_nodes: 16", "max_nodes: 100000")
SIZE_CASES = [
    # Legal counts whose product is millions of records: bounded before anything is expanded.
    edit("derived-servers-over-bound", "  nodes: 1\n  tp: 2", "  nodes: 98\n  tp: 1", "inference.nodes",
         profile=HUGE_NODES, says="nodes(98) x 1024 servers per node (1024 GPUs / tp(1) * dp(1)) = 100352 servers"),
    edit("derived-servers-over-bound-no-write", "  nodes: 1\n  tp: 2", "  nodes: 98\n  tp: 1", "inference.nodes",
         profile=HUGE_NODES, overrides=("--no-write",), says="whether or not it writes the plan"),
    edit("derived-pd-servers-over-bound", "  nodes: 1\n  tp: 2", "  prefill: {nodes: 40}\n  decode: {nodes: 60}",
         "inference.decode.nodes", at=1, profile=HUGE_NODES, says="(102400 in all)"),
    edit("derived-gpus-over-bound", "  nodes: 1\n  tp: 2", "  nodes: 300\n  tp: 1024", "inference.nodes",
         profile=HUGE_NODES, says="inference nodes(300) x 1024 + trainer nodes(1) x 1024 = 308224 GPUs"),
    over("overrides-over-bound", *[f"trainer.env.V{i}=x" for i in range(1001)], blame="trainer.env.V1000=x",
         says="more than 1000 overrides (1001)"),
    append("over-1mib", "#" * (1 << 20) + "\n", line=False, says="1 MiB"),
    edit("list-of-1e5", '  tp: 2', "  tp: 2\n  extra_args: [" + ", ".join(["a"] * 100_000) + "]", line=ANY,
         says="more than 10000 values"),
    edit("list-of-1001", '  tp: 2', "  tp: 2\n  extra_args: [" + ", ".join(["a"] * 1001) + "]",
         "inference.extra_args", at=1, says="at most 1000 items"),
    edit("nesting-1000", "  id: prl_reverse_text", "  id: prl_reverse_text\n  args: {x: " + "[" * 1000 + "]" * 1000
         + "}", line=ANY, says="nested more than"),
    edit("nesting-block-40", "  id: prl_reverse_text", "  id: prl_reverse_text\n  args:\n"
         + "".join("  " * (i + 2) + f"k{i}:\n" for i in range(40)) + "  " * 42 + "v: 1", line=ANY,
         says="nested more than"),
    edit("string-1e6", "  path: /models/m", "  path: " + "m" * 1_000_000, "model.path",
         says="at most 4096 characters"),
    edit("key-1e5", "name: adv\n", "name: adv\n" + "k" * 100_000 + ": 1\n", at=1, says="invalid YAML"),
    edit("key-1000", "name: adv\n", "name: adv\n" + "k" * 1000 + ": 1\n", at=1, says="unknown field"),
    edit("env-1e4-keys", "  nodes: 1\norch", "  nodes: 1\n  env:\n" + "".join(f"    V{i}: x\n" for i in range(1001))
         + "orch", "trainer.env", at=1, says="at most 1000 items"),
    edit("nodes-1e12", "  nodes: 1\norch", "  nodes: 1000000000000\norch", "trainer.nodes"),
    edit("nodes-1e30", "  nodes: 1\norch", "  nodes: " + "9" * 30 + "\norch", "trainer.nodes"),
    edit("max-steps-huge", "  max_steps: 10", "  max_steps: 10000000000", "training.max_steps"),
    append("interpolation-doubling", _doubling(), "x16", at=16, says="expands to more than"),
    append("interpolation-chain", "".join(f"c{i}: ${{c{i - 1}}}\n" for i in range(3000, 0, -1)) + "c0: x\n",
           line=ANY, says="chains more than 16 references"),
    append("many-unknown-keys", "".join(f"k{i}: 1\n" for i in range(20_000)), line=ANY, says="more than 10000"),
    over("override-1e6-chars", "model.path=" + "m" * 1_000_000, field="model.path", says="at most 4096"),
    Case("fifo", "{topo}", make=_fifo, says="not a regular file"),
    Case("dev-zero", "/dev/zero", make=lambda d: Path("/dev/zero"), says="not a regular file"),
    Case("directory", "{dir}", make=lambda d: d, says="is a directory"),
    Case("missing-file", "{topo}", make=lambda d: d / "topo.yaml", says="no such file"),
    Case("sparse-10gib", "{topo}", make=_sparse, says="1 MiB"),
    Case("symlink-loop", "{topo}", make=_symlink_loop, says="cannot read"),
    Case("under-a-file", "{dir}/file/topo.yaml", make=_under_a_file, says="no such file"),
    Case("name-too-long", "{dir}/", make=lambda d: d / ("x" * 300 + ".yaml"), says="cannot read"),
    Case("unreadable", "{topo}", make=_unreadable, says="cannot read",
         marks=(pytest.mark.skipif(ROOT, reason="root reads a chmod 000 file; symlink-loop and name-too-long "
                                                "cover unreadable paths"),)),
    Case("profile-fifo", "{dir}/fifo.yaml", make=_profile_fifo, says="not a regular file"),
    Case("profile-over-1mib", "{prof}", make=_profile_huge, says="1 MiB"),
    Case("profile-directory", "{dir}/profdir.yaml", make=_profile_directory, says="is a directory"),
]


def _with_model_config(config: bytes, topology: str = BASE) -> Callable[[Path], Path]:
    """`topology` (BASE) with its model directory (in tmp_path) holding `config` as its config.json."""
    def make(tmp_path: Path) -> Path:
        model = tmp_path / "model"
        model.mkdir()
        (model / "config.json").write_bytes(config)
        (tmp_path / "prof.yaml").write_text(PROFILE)
        path = tmp_path / "topo.yaml"
        path.write_text(topology.replace("/models/m", str(model)).replace("{run}", str(tmp_path / "run")))
        return path
    return make


def _from_run_with_marker(marker: bytes) -> Callable[[Path], Path]:
    """A topology starting from a run (in tmp_path) whose only weights step carries `marker` as STABLE."""
    def make(tmp_path: Path) -> Path:
        step = tmp_path / "prev" / "weights" / "step_1"
        step.mkdir(parents=True)
        (tmp_path / "prev" / "plan.json").write_text('{"name": "prev"}')
        (step / "model.safetensors").write_bytes(b"x")
        (step / "STABLE").write_bytes(marker)
        (tmp_path / "prof.yaml").write_text(PROFILE)
        path = tmp_path / "topo.yaml"
        path.write_text(BASE.replace("  path: /models/m", f"  from_run: {tmp_path / 'prev'}")
                        .replace("{run}", str(tmp_path / "run")))
        return path
    return make


POOL = BASE[:BASE.index("trainer:")] + "pool:\n  max_loras: 2\n"
"""BASE as an inference pool: its model and servers, no trainer."""
ATTACHED = BASE.replace("  nodes: 1\n  tp: 2\n", "  attach: /pools/p\n").replace(
    "  max_model_len: 4096\n", "  max_model_len: 4096\n  lora: {rank: 8, alpha: 16}\n")
"""BASE as a run on an inference pool's servers (the schema refuses these before the pool is looked at)."""

GOOD_TOKENIZER = b'{"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}}, "added_tokens": [{"id": 2, "content": "<s>"}]}'


def _with_teacher_tokenizer(tokenizer: bytes) -> Callable[[Path], Path]:
    """A topology whose student has a good tokenizer.json and whose teacher (both in tmp_path) has `tokenizer`."""
    def make(tmp_path: Path) -> Path:
        for name, text in (("model", GOOD_TOKENIZER), ("teacher", tokenizer)):
            (tmp_path / name).mkdir()
            (tmp_path / name / "tokenizer.json").write_bytes(text)
        teacher = f"teacher:\n  path: {tmp_path / 'teacher'}\n  nodes: 1\nslurm:\n"
        return _write_as(tmp_path, "topo.yaml", BASE.replace("/models/m", str(tmp_path / "model"))
                         .replace("slurm:\n", teacher))
    return make


TEACHER_LINE = BASE.count("\n", 0, BASE.index("slurm:")) + 2
"""The line of `teacher.path` in `_with_teacher_tokenizer`'s topology."""


def _attached_to(make_pool: Callable[[Path], Path]) -> Callable[[Path], Path]:
    """A topology attached to the pool directory `make_pool` leaves in tmp_path."""
    def make(tmp_path: Path) -> Path:
        pool = make_pool(tmp_path)
        return _write_as(tmp_path, "topo.yaml", ATTACHED.replace("/pools/p", str(pool)))
    return make


def _pool_loop(tmp_path: Path) -> Path:
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    return tmp_path / "a"


def _pool_plan_sparse(tmp_path: Path) -> Path:
    (tmp_path / "pool").mkdir()
    with open(tmp_path / "pool" / "plan.json", "wb") as handle:
        handle.truncate(3 << 30)  # 3 GiB of holes: read whole, a MemoryError
    return tmp_path / "pool"


ATTACH_LINE = ATTACHED.count("\n", 0, ATTACHED.index("  attach:")) + 1

DEEP = b"[" * 200_000 + b"]" * 200_000
EXTERNAL_CASES = [
    # A tokenizer.json of unexpected types: one line naming the first value, at the teacher's field.
    Case("tokenizer-model-is-text", f"{{topo}}:{TEACHER_LINE}", "teacher.path",
         make=_with_teacher_tokenizer(b'{"model": "BPE"}'), says="got `str` - at `$.model`"),
    Case("tokenizer-added-tokens-a-number", f"{{topo}}:{TEACHER_LINE}", "teacher.path",
         make=_with_teacher_tokenizer(b'{"model": {}, "added_tokens": 5}'), says="at `$.added_tokens`"),
    Case("tokenizer-id-a-list", f"{{topo}}:{TEACHER_LINE}", "teacher.path",
         make=_with_teacher_tokenizer(b'{"model": {}, "added_tokens": [{"id": [1], "content": "a"}]}'),
         says="at `$.added_tokens[0].id`"),
    Case("tokenizer-id-missing", f"{{topo}}:{TEACHER_LINE}", "teacher.path",
         make=_with_teacher_tokenizer(b'{"model": {}, "added_tokens": [{"content": "a"}]}'), says="`id`"),
    Case("tokenizer-id-text", f"{{topo}}:{TEACHER_LINE}", "teacher.path",
         make=_with_teacher_tokenizer(b'{"model": {}, "added_tokens": [{"id": "2", "content": "a"}]}'),
         says="got `str`"),
    Case("tokenizer-vocab-a-number", f"{{topo}}:{TEACHER_LINE}", "teacher.path",
         make=_with_teacher_tokenizer(b'{"model": {"vocab": 3}}'), says="`$.model.vocab`"),
    Case("tokenizer-without-model", f"{{topo}}:{TEACHER_LINE}", "teacher.path",
         make=_with_teacher_tokenizer(b"{}"), says="`model`"),
    # An attach path that cannot be resolved, or a pool's plan.json too large to read.
    Case("attach-symlink-loop", f"{{topo}}:{ATTACH_LINE}", "inference.attach", make=_attached_to(_pool_loop),
         says="Too many levels of symbolic links"),
    Case("attach-plan-json-3gib", f"{{topo}}:{ATTACH_LINE}", "inference.attach", make=_attached_to(_pool_plan_sparse),
         says="over the 67108864 bytes that a prl plan.json may have"),
    # Files the planner reads besides the topology: read with a size bound and checked as typed data.
    Case("config-json-huge", "{topo}:5", "model.path", make=_with_model_config(b'{"a": "' + b"x" * (5 << 20) + b'"}'),
         says="over the 4194304 bytes that a model config.json may have"),
    Case("config-json-deep", "{topo}:5", "model.path", make=_with_model_config(b'{"a": ' + DEEP + b"}"),
         says="nests too deeply"),
    Case("config-json-wrong-type", "{topo}:5", "model.path",
         make=_with_model_config(b'{"architectures": ["LlamaForCausalLM"], "num_attention_heads": "eight"}'),
         says="num_attention_heads"),
    Case("config-json-architectures-text", "{topo}:5", "model.path",
         make=_with_model_config(b'{"architectures": "LlamaForCausalLM"}'), says="architectures"),
    Case("config-json-not-an-object", "{topo}:5", "model.path", make=_with_model_config(b"[1, 2]"),
         says="is not a model config.json prl can read"),
    Case("config-json-zero-heads", "{topo}:5", "model.path",
         make=_with_model_config(b'{"architectures": ["LlamaForCausalLM"], "num_attention_heads": 0}'),
         says="Expected `int` >= 1 - at `$.num_attention_heads`"),
    Case("config-json-zero-kv-heads-in-text-config", "{topo}:5", "model.path",
         make=_with_model_config(b'{"text_config": {"num_attention_heads": 8, "num_key_value_heads": 0}}'),
         says="at `$.text_config.num_key_value_heads`"),
    Case("config-json-heads-not-grouped", "{topo}:5", "model.path",
         make=_with_model_config(b'{"num_attention_heads": 12, "num_key_value_heads": 5}'),
         says="num_attention_heads(12) must be a multiple of num_key_value_heads(5)"),
    Case("stable-marker-deep", "{topo}:5", "model.from_run", make=_from_run_with_marker(DEEP),
         says="has published no weights"),
    Case("stable-marker-escapes-its-step", "{topo}:5", "model.from_run",
         make=_from_run_with_marker(b'{"files": {"../../plan.json": 16}}'), says="has published no weights"),
    Case("stable-marker-wrong-type", "{topo}:5", "model.from_run",
         make=_from_run_with_marker(b'{"files": ["model.safetensors"]}'), says="has published no weights"),
    # A path component longer than the filesystems' limit fails every system call on it.
    edit("run-dir-component-over-255", "run_dir: {run}", "run_dir: {run}/" + "a" * 256, "run_dir",
         says="a path component of 256 characters"),
    edit("model-path-component-over-255", "  path: /models/m", "  path: /models/" + "m" * 300, "model.path",
         says="a path component of 300 characters"),
]


CONTAINER = PROFILE + "container: {image: img}\n"
DOWNSTREAM_CASES = [
    # Characters that mean something to what reads the value next: Slurm's output patterns, pyxis's mount list,
    # the variables prl sets, a shell's '~' and '$', invisible Unicode, look-alike letters.
    edit("run-dir-percent-pattern", "run_dir: {run}", "run_dir: {run}-%j", "run_dir", says="Slurm reads %j"),
    edit("run-dir-percent-from-shared-root", "run_dir: {run}\n", "", "run_dir", line=False,
         profile=PROFILE.replace("/shared", "/shared/%x"), says="must not contain '%'"),
    edit("run-dir-comma-in-container", "run_dir: {run}", "run_dir: {run},/etc", "run_dir", profile=CONTAINER,
         says="another mount"),
    edit("run-dir-colon-in-container", "run_dir: {run}", "run_dir: {run}:ro", "run_dir", profile=CONTAINER,
         says="must not contain ':'"),
    prof("container-mount-adds-a-mount", "max_nodes: 16",
         'max_nodes: 16\ncontainer: {image: img, mounts: ["/data:/data,/etc:/host-etc"]}', "container.mounts", at=1,
         says="one SRC:DST[:FLAGS] mount"),
    edit("env-sets-prl-variable", "  nodes: 1\norch", "  nodes: 1\n  env: {PRL_RUN_DIR: /elsewhere}\norch",
         "trainer.env", at=1, says="set by prl"),
    edit("env-sets-role", "  tp: 2", "  tp: 2\n  env: {PRL_ROLE: trainer}", "inference.env", at=1, says="set by prl"),
    edit("env-sets-slurm-variable", "placement: own", "placement: own\n  env: {SLURM_PROCID: '0'}",
         "orchestrator.env", at=1, says="set by Slurm"),
    prof("profile-env-sets-gpus", "max_nodes: 16", "max_nodes: 16\nenv: {CUDA_VISIBLE_DEVICES: '0'}", "env", at=1,
         says="set by prl"),
    prof("network-env-sets-slurm", "max_nodes: 16", "max_nodes: 16\nnetwork: {env: {SLURM_JOB_ID: '1'}}",
         "network.env", at=1, says="set by Slurm"),
    edit("path-tilde", "  path: /models/m", "  path: ~/models/m", "model.path", says="does not expand '~'"),
    edit("path-home-variable", "  path: /models/m", "  path: $HOME/models/m", "model.path", says="${oc.env:HOME}"),
    edit("run-dir-tilde", "run_dir: {run}", "run_dir: ~/runs/adv", "run_dir", says="does not expand"),
    edit("cluster-tilde", "cluster: ./prof.yaml", "cluster: ~/prof.yaml", "cluster", says="does not expand"),
    edit("path-zero-width-space", "  path: /models/m", '  path: "/models/m\u200b"', "model.path", says="U+200B"),
    edit("env-value-bidi-isolate", "  nodes: 1\norch", '  nodes: 1\n  env: {A: "x\u2066y"}\norch',
         "trainer.env.A", at=1, says="U+2066"),
    edit("id-tag-character", "  id: prl_reverse_text", '  id: "prl_reverse_text\U000E0041"', "environment.id",
         says="U+E0041"),
    edit("name-cyrillic-a", "name: adv", "name: \u0430dv", "name", says="letters, digits"),
    edit("name-hangul-filler", "name: adv", 'name: "adv\u3164"', "name", says="U+3164 in"),
    edit("extra-arg-hangul-filler", "  tp: 2", '  tp: 2\n  extra_args: ["--seed", "1\u3164"]', "inference.extra_args[1]",
         at=1, says="U+3164"),
    edit("env-value-halfwidth-filler", "  nodes: 1\norch", '  nodes: 1\n  env: {A: "x\uffa0"}\norch', "trainer.env.A",
         at=1, says="U+FFA0"),
    edit("id-cyrillic-e", "  id: prl_reverse_text", "  id: prl_r\u0435verse_text", "environment.id",
         says="must be ASCII"),
    prof("partition-cyrillic-p", "trainer: gpu", "trainer: g\u0440u", "partitions.trainer", says="must be ASCII"),
    prof("setup-zero-width-joiner", "max_nodes: 16", 'max_nodes: 16\nsetup: ["echo ok\u200d"]', "setup[0]", at=1,
         says="U+200D"),
]


def directive(id: str, item: str, **kw: Any) -> Case:
    """A case that adds one `slurm.extra_directives` item; the error is expected at it."""
    return edit(id, 'time: "01:00:00"', f'time: "01:00:00"\n  extra_directives: ["{item}"]',
                "slurm.extra_directives[0]", at=1, **kw)


CPU_ONLY = PROFILE.replace("gpus: 8\n  cpus: 64", "gpus: 0\n  cpus: 4")
DENSE_CONFIG = b'{"architectures": ["LlamaForCausalLM"], "num_attention_heads": 8, "num_key_value_heads": 2}'
AUX_LOSS = BASE.replace("  max_tokens: 512", "  max_tokens: 512\n  router_aux_loss_coef: 0.01")
SEGMENTED = PROFILE.replace("max_nodes: 16", "max_nodes: 16\nsegment: 4")
CONTRADICTION_CASES = [
    # Values that contradict what the plan sets or what another field says, which would otherwise be ignored.
    edit("router-beside-unified", "  tp: 2", "  tp: 2\n  router: {port: 9000}", "inference.router", at=1,
         says="field of disaggregated inference"),
    edit("kv-connector-beside-unified", "  tp: 2", "  tp: 2\n  kv_connector: {name: NixlConnector}",
         "inference.kv_connector", at=1, says="would be ignored beside unified nodes"),
    edit("extra-arg-sets-tp", "  tp: 2", '  tp: 2\n  extra_args: ["--enforce-eager", "--tensor-parallel-size=4"]',
         "inference.extra_args[1]", at=1, says="--tensor-parallel-size is set by the plan"),
    edit("extra-arg-sets-port", "  nodes: 1\n  tp: 2", '  prefill: {nodes: 1}\n  decode: {nodes: 1, extra_args: '
         '["--port", "9000"]}', "inference.decode.extra_args[0]", at=1, says="--port is set"),
    edit("extra-arg-sets-served-name", "  tp: 2", '  tp: 2\n  extra_args: ["--served-model-name", "x"]',
         "inference.extra_args[0]", at=1),
    directive("directive-sets-output", "--output=/tmp/x", says="--output is set by the plan"),
    directive("directive-sets-array", "--array=1-4"),
    directive("directive-sets-nodes", "--nodes=4"),
    directive("directive-sets-rendered-mem", "--mem=10G", says="--mem is set"),
    edit("model-path-is-an-option", "  path: /models/m", "  path: --trust-remote-code", "model.path",
         says="read it as an option"),
    append("wandb-project-is-an-option", "wandb:\n  project: --help\n", "wandb.project", at=1,
           says="read it as an option"),
    edit("environment-id-is-an-option", "  id: prl_reverse_text", "  id: -h", "environment.id"),
    edit("shared-orchestrator-over-node-cpus", "placement: own", "placement: trainer\n  cpus: 65",
         "orchestrator.cpus", at=1, says="has 64"),
    Case("segment-not-dividing", "{prof}:16", "segment", topo=BASE.replace("  nodes: 1\norch", "  nodes: 6\norch"),
         profile=SEGMENTED, says="use 4 or 8 nodes"),
    edit("octal-count", "  max_steps: 10", "  max_steps: 0100", "training.max_steps",
         says="octal number 64; write 100 or '0100'"),
    edit("octal-in-env", "  nodes: 1\norch", "  nodes: 1\n  env: {UMASK: 0022}\norch", "trainer.env.UMASK", at=1,
         says="write 22 or '0022'"),
    over("override-octal", "training.max_steps=010", field="training.max_steps", says="octal"),
    edit("cpu-trainer-ranks-over-cpus", "  nodes: 1\norch", "  nodes: 1\n  gpus_per_node: 8\norch",
         "trainer.gpus_per_node", at=1, profile=CPU_ONLY, says="over-commit its 4 CPUs"),
    edit("cpu-inference-workers-over-cpus", "  tp: 2", "  tp: 2\n  dp: 4", "inference.tp", profile=CPU_ONLY,
         says="tp(2) * dp(4) = 8 CPU workers per server over-commit the 4 CPUs"),
    edit("overlong-penalty-without-buffer", "  max_tokens: 512", "  max_tokens: 512\n  advantage: {overlong_penalty: 0.5}",
         "training.advantage.overlong_penalty", at=1, says="off without overlong_buffer"),
    over("override-overlong-penalty-without-buffer", "training.advantage.overlong_penalty=1.0",
         field="training.advantage.overlong_penalty", says="set overlong_buffer, e.g. 128"),
    Case("aux-loss-on-dense-model", "{topo}:" + str(_line_of(AUX_LOSS, "  router_aux_loss_coef", 0)),
         "training.router_aux_loss_coef", make=_with_model_config(DENSE_CONFIG, AUX_LOSS),
         says="LlamaForCausalLM is dense"),
    edit("fail-beside-max-restarts", "  tp: 2", "  tp: 2\n  on_failure: {policy: fail, max_restarts: 5}",
         "inference.on_failure.max_restarts", at=1, says="would never be used"),
    edit("scorer-fail-beside-max-restarts", "slurm:\n", "teacher:\n  path: /t\n  nodes: 1\n  on_failure:\n"
         "    policy: fail\n    max_restarts: 3\nslurm:\n", "teacher.on_failure.max_restarts", at=5,
         says="use policy: restart"),
    over("override-fail-beside-max-restarts", "inference.on_failure.policy=fail", "inference.on_failure.max_restarts=1",
         field="inference.on_failure.max_restarts"),
    edit("time-zero", 'time: "01:00:00"', 'time: "00:00:00"', "slurm.time", says="Slurm reads as no time limit"),
    edit("time-zero-minutes", 'time: "01:00:00"', "time: 0", "slurm.time", says="is zero"),
    prof("default-time-zero-days", "max_nodes: 16", "max_nodes: 16\ndefault_time: 0-0", "default_time", at=1,
         says="is zero"),
    prof("gpu-directive-none-on-shared-nodes", "max_nodes: 16", "max_nodes: 16\ngpu_directive: none\nexclusive: false",
         "gpu_directive", at=1, says="the 8 GPUs of gpu_node would reach no role"),
    prof("python-with-arguments", "max_nodes: 16", "max_nodes: 16\npython: python3 -u", "python", at=1,
         says="is one command"),
    prof("python-relative-path", "max_nodes: 16", "max_nodes: 16\npython: env/bin/python", "python", at=1,
         says="relative path"),
    prof("venv-relative", "max_nodes: 16", "max_nodes: 16\nvenv: .venv", "venv", at=1, says="write it absolute"),
    edit("disk-gb-without-disk-path", "  tp: 2", "  tp: 2\n  kv_offload: {backend: lmcache, cpu_gb: 8, disk_gb: 100}",
         "inference.kv_offload.disk_gb", at=1, says="needs disk_path"),
]


LOCATED_CASES = [
    # A check across sections (Topology.__post_init__) blames the field by its full path, at the field's own line.
    edit("attach-without-lora", "  nodes: 1\n  tp: 2", "  attach: /pools/p", "inference.attach",
         says="set model.lora"),
    Case("attach-beside-teacher", "{topo}:" + str(_line_of(ATTACHED, "  attach:", 0)), "inference.attach",
         topo=ATTACHED.replace("slurm:\n", "teacher:\n  path: /t\n  nodes: 1\nslurm:\n"),
         says="teacher: or reference:"),
    edit("attached-orchestrator-on-inference", "placement: own", "placement: inference", "orchestrator.placement",
         base=ATTACHED, says="use own or trainer"),
    edit("attached-router-replay", "  max_tokens: 512", "  max_tokens: 512\n  router_replay: true",
         "training.router_replay", base=ATTACHED, at=1, says="the run's own servers"),
    edit("pool-that-attaches", "  nodes: 1\n  tp: 2", "  attach: /pools/q", "inference.attach", base=POOL,
         says="unified servers of its own"),
    edit("pool-disaggregated", "  nodes: 1\n  tp: 2", "  prefill: {nodes: 1}\n  decode: {nodes: 1}",
         "inference.prefill", base=POOL, says="unified servers of its own"),
    edit("pool-with-lora", "  max_model_len: 4096", "  max_model_len: 4096\n  lora: {rank: 8, alpha: 16}",
         "model.lora", base=POOL, at=1, says="attached runs set model.lora"),
    edit("teacher-without-path", 'slurm:\n', 'teacher:\n  nodes: 1\nslurm:\n', "teacher.path",
         says="set teacher.path"),
]


SECRET_CASES = [
    # One secret rule for every value the plan stores as written, as `env:` has: plan.json would keep it.
    edit("loss-args-api-key", "  max_tokens: 512", "  max_tokens: 512\n  loss:\n    import_path: my.loss:fn\n"
         "    args: {scale: 2, api_key: sk-live-1}", "training.loss.args.api_key", at=3, says="api_key looks like a secret"),
    edit("shaping-args-nested-token", "  max_tokens: 512", "  max_tokens: 512\n  advantage:\n    shaping:\n"
         "      import_path: my.shape:fn\n      args:\n        judge: {url: http://j, token: t0k}",
         "training.advantage.shaping.args.judge.token", at=5, says="token looks like a secret"),
    edit("environment-args-password", "  id: prl_reverse_text", "  id: prl_reverse_text\n  args: {db_password: pw}",
         "environment.args.db_password", at=1),
    edit("extra-args-token-option", "  tp: 2", '  tp: 2\n  extra_args: ["--enforce-eager", "--hf-token", "hf_x"]',
         "inference.extra_args[1]", at=1, says="--hf-token looks like a secret"),
    edit("scorer-extra-args-key-with-value", 'slurm:\n', 'teacher:\n  path: /t\n  nodes: 1\n'
         '  extra_args: ["--api-key=abc"]\nslurm:\n', "teacher.extra_args[0]", at=3, says="--api-key looks like"),
]


MESSAGE_CASES = [
    # The line says what is wrong in words a user can act on, and nothing is printed above it.
    edit("key-with-trailing-space", "trainer:\n  nodes: 1", 'trainer:\n  "nodes ": 1', at=1,
         says="'nodes ' has white space before or after 'nodes'; remove it"),
    edit("key-with-leading-tab", "  max_steps: 10", '  "\\tmax_steps": 10', says="white space before or after"),
    edit("omegaconf-empty-default", "name: adv", "name: x${oc.env:USER,}", "name",
         says="some elements are missing: please replace them with empty quoted strings"),
]


def _teacher_path_a_file(tmp_path: Path) -> Path:
    (tmp_path / "teacher.bin").write_bytes(b"weights")
    return _write_as(tmp_path, "topo.yaml", BASE.replace("slurm:\n", f"teacher:\n  path: {tmp_path / 'teacher.bin'}\n"
                                                                    f"  nodes: 1\nslurm:\n"))


CAUGHT_CASES = [
    # What would fail only at run time (vLLM at server start, a run that never does what it was asked), refused
    # at the field's line by the planner.
    edit("pool-max-cpu-loras-below-max-loras", "  max_loras: 2", "  max_loras: 2\n  max_cpu_loras: 1",
         "pool.max_cpu_loras", base=POOL, at=1, says="must be at least max_loras(2)"),
    edit("eval-every-past-max-steps", "  id: prl_reverse_text", "  id: prl_reverse_text\n  eval: {every: 11}",
         "environment.eval.every", at=1, says="past training.max_steps(10)"),
    Case("teacher-path-a-file", f"{{topo}}:{TEACHER_LINE}", "teacher.path", make=_teacher_path_a_file,
         says="is a file; the teacher's path is a model directory"),
]


ALL = {"located": LOCATED_CASES, "caught": CAUGHT_CASES, "message": MESSAGE_CASES, "secret": SECRET_CASES, "downstream": DOWNSTREAM_CASES, "contradiction": CONTRADICTION_CASES, "external": EXTERNAL_CASES, "yaml": YAML_CASES, "schema": SCHEMA_CASES, "resource": RESOURCE_CASES, "shell": SHELL_CASES,
       "markup": MARKUP_CASES, "size": SIZE_CASES, "sft": SFT_CASES}
PARAMS = [pytest.param(case, id=f"{kind}:{case.id}", marks=case.marks) for kind, cases in ALL.items()
          for case in cases]


def plan_in_process(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    """`prl plan ARGV` through prl.cli.main: exit code, stdout, stderr."""
    saved = sys.argv
    sys.argv = ["prl", "plan", *argv]
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.argv = saved
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory with its own run registry; the run directory is tmp_path/run."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PRL_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("PRL_ADVERSARIAL_UNSET", raising=False)
    return tmp_path


def _topology_path(case: Case, tmp_path: Path) -> Path:
    if case.make is not None:
        return case.make(tmp_path)
    (tmp_path / "prof.yaml").write_text(case.profile)
    path = tmp_path / "topo.yaml"
    if case.raw is not None:
        path.write_bytes(case.raw.replace(b"{run}", str(tmp_path / "run").encode()))
    else:
        path.write_text((BASE if case.topo is None else case.topo).replace("{run}", str(tmp_path / "run")))
    return path


def _expected_location(case: Case, tmp_path: Path) -> re.Pattern:
    text = case.where.format(topo=tmp_path / "topo.yaml", prof=tmp_path / "prof.yaml", dir=tmp_path)
    return re.compile(re.escape(text).replace(re.escape(ANY), r"\d+"))


def assert_refused(code: int, out: str, err: str, location: re.Pattern, field: Optional[str],
                   says: Optional[str], tmp_path: Path) -> str:
    """Exit 2, one `error:` line naming the location and field, nothing written anywhere."""
    assert "Traceback" not in err, err
    assert code == 2, err
    lines = err.split("\n")
    assert len(lines) == 2 and lines[1] == "", f"expected one line, got {err!r}"
    line = lines[0]
    assert line.startswith("error: "), line
    assert "\x1b" not in line and "\r" not in line, repr(line)
    assert location.search(line), f"{location.pattern!r} not in {line!r}"
    if field is not None:
        assert f"({field})" in line, f"field ({field}) not in {line!r}"
    if says is not None:
        assert says in line, f"{says!r} not in {line!r}"
    assert len(line) < 2000, f"message of {len(line)} characters"
    assert out == "", out
    assert not (tmp_path / "run").exists(), "a refused plan wrote its run directory"
    assert not (tmp_path / "home").exists(), "a refused plan touched the run registry"
    return line


@pytest.mark.timeout(10)
@pytest.mark.parametrize("case", PARAMS)
def test_hostile_input_is_refused_in_one_located_line(case: Case, sandbox: Path, capsys):
    path = _topology_path(case, sandbox)
    code, out, err = plan_in_process([str(path), *case.overrides], capsys)
    assert_refused(code, out, err, _expected_location(case, sandbox), case.field, case.says, sandbox)


@pytest.mark.timeout(10)
def test_the_base_topology_plans_and_writes(sandbox: Path, capsys):
    """The corpus's control: unedited, the same call succeeds and writes, so 'nothing written' can fail."""
    path = _topology_path(Case("base", ""), sandbox)
    code, out, err = plan_in_process([str(path)], capsys)
    assert code == 0, err
    assert (sandbox / "run" / "plan.json").exists()


def test_the_refused_format_characters_are_unicodes_category_cf():
    """Every format character (Cf) the running Python knows is refused in text, and nothing else is by that list."""
    import unicodedata

    from prl.config.types import FORMAT_CHARACTERS

    listed = re.compile(f"[{FORMAT_CHARACTERS}]")
    format_characters = [chr(c) for c in range(0x110000) if unicodedata.category(chr(c)) == "Cf"]
    assert [c for c in format_characters if not listed.match(c)] == []
    assert all(unicodedata.category(chr(c)) in ("Cf", "Cn") for c in range(0x110000) if listed.match(chr(c)))


@pytest.mark.timeout(10)
@pytest.mark.parametrize("old, new", [
    ("  path: /models/m", "  path: /models/caf\u00e9-\u6a21\u578b"),
    ("run_dir: {run}", "run_dir: {run}-\u00e9t\u00e9"),
    ("  path: /models/m", "  path: ${oc.env:HOME}/models/m"),
    ("  nodes: 1\norch", "  nodes: 1\n  env: {PRL_DEVICE: cpu, SLURM: x, MY_SLURM_ID: '1'}\norch"),
    ("  max_steps: 10", "  max_steps: 10\n  seed: 0"),
    ("  nodes: 1\norch", "  nodes: 1\n  env: {UMASK: '0022'}\norch"),
    ('time: "01:00:00"', 'time: "01:00:00"\n  extra_directives: ["--mail-type=END", "--exclude=n[1-2]"]'),
    ("  tp: 2", '  tp: 2\n  extra_args: ["--enforce-eager", "--seed", "1"]'),
], ids=["non-ascii-model-path", "non-ascii-run-dir", "home-reference", "env-near-reserved-names", "zero",
        "quoted-octal", "directives-the-plan-leaves", "extra-args-the-plan-leaves"])
def test_downstream_characters_that_mean_nothing_still_plan(sandbox: Path, capsys, old: str, new: str):
    """The downstream refusals are narrow: letters in paths, `${oc.env:HOME}` and names beside the reserved ones plan."""
    (sandbox / "prof.yaml").write_text(PROFILE)
    (sandbox / "topo.yaml").write_text(BASE.replace(old, new).replace("{run}", str(sandbox / "run")))
    code, out, err = plan_in_process([str(sandbox / "topo.yaml"), "--no-write"], capsys)
    assert code == 0, err


@pytest.mark.timeout(10)
def test_public_environment_reads_plan_in_the_cluster_fields(sandbox: Path, capsys, monkeypatch: pytest.MonkeyPatch):
    """`${oc.env:SCRATCH}` (a public variable: where you are, no secret) works in `cluster:` and in the profile's
    fields as it does in `run_dir`."""
    monkeypatch.setenv("SCRATCH", str(sandbox))
    (sandbox / "prof.yaml").write_text(PROFILE.replace("shared_root: /shared", "shared_root: ${oc.env:SCRATCH}"))
    text = BASE.replace("cluster: ./prof.yaml", "cluster: ${oc.env:SCRATCH}/prof.yaml")
    (sandbox / "topo.yaml").write_text(text.replace("run_dir: {run}\n", ""))
    code, out, err = plan_in_process([str(sandbox / "topo.yaml")], capsys)
    assert code == 0, err
    assert (sandbox / "prl-runs" / "adv" / "plan.json").is_file()


@pytest.mark.timeout(10)
def test_non_ascii_env_defaults_reach_the_node_quoted(sandbox: Path, capsys):
    """An `env:` default of any letters is written in OmegaConf's single quotes and reaches the launch script (and an
    evaluation's role env) without them; unquoted, OmegaConf's refusal says to quote it."""
    from prl.orchestrator.eval_task import role_env

    (sandbox / "prof.yaml").write_text(PROFILE)
    env = "  nodes: 1\n  env: {A: \"${oc.env:PRL_ADVERSARIAL_UNSET,'café au lait'}\"}\norch"
    (sandbox / "topo.yaml").write_text(BASE.replace("  nodes: 1\norch", env).replace("{run}", str(sandbox / "run")))
    code, out, err = plan_in_process([str(sandbox / "topo.yaml")], capsys)
    assert code == 0, err
    assert 'export A="${PRL_ADVERSARIAL_UNSET-café au lait}"' in (sandbox / "run/scripts/trainer.sh").read_text()
    assert role_env((("A", "${oc.env:PRL_ADVERSARIAL_UNSET,'café au lait'}"),), {}) == {"A": "café au lait"}
    code, out, err = plan_in_process([str(sandbox / "topo.yaml"), "trainer.env.A=${oc.env:NOPE,café}"], capsys)
    assert code == 2 and "in single quotes" in err, err


@pytest.mark.timeout(300)  # a hang guard, not a timing check: 6 s alone, over 30 s on the suite's loaded cores
def test_a_thousand_overrides_merge_in_one_pass(sandbox: Path, capsys, monkeypatch: pytest.MonkeyPatch):
    """Legal overrides are merged at once (one by one, a thousand took over 10 s); the one-by-one merge that names
    the culprit runs only when the merge fails."""
    from omegaconf import OmegaConf

    merges = []
    merge = OmegaConf.merge
    monkeypatch.setattr(OmegaConf, "merge", lambda *args: merges.append(1) or merge(*args))
    (sandbox / "prof.yaml").write_text(PROFILE)
    (sandbox / "topo.yaml").write_text(BASE.replace("{run}", str(sandbox / "run")))
    overrides = [f"trainer.env.V{i}=x{i}" for i in range(1000)]
    code, out, err = plan_in_process([str(sandbox / "topo.yaml"), "--no-write", *overrides], capsys)
    assert code == 0, err
    assert len(merges) == 1
    merges.clear()
    code, out, err = plan_in_process([str(sandbox / "topo.yaml"), "--no-write", *overrides[:500], "trainer=[1]",
                                      *overrides[500:999]], capsys)
    assert code == 2 and "override 'trainer=[1]' (trainer): cannot merge" in err, err


MERGE_OK = BASE.replace("inference:\n  nodes: 1\n  tp: 2", "group: &g {nodes: 1, tp: 2}\ninference:\n  <<: *g")


@pytest.mark.timeout(10)
@pytest.mark.parametrize("text, argv", [
    (BASE.replace("name: adv", "name: !!str adv"), []),
    ("\ufeff" + BASE, []),
    (BASE.replace('time: "01:00:00"', "time: 90"), []),
    (BASE, ["slurm.time='5:00'"]),
    (BASE, ['slurm.extra_directives=["--mail-type=END,FAIL","--exclude=node[01-04]"]']),
    (BASE.replace("  path: /models/m", "  path: /models/${name}"), []),
    (BASE.replace("run_dir: {run}", "run_dir: ${oc.env:HOME}/prl-adv"), []),
    (BASE.replace("  tp: 2", "  tp: 2\n  on_failure: {policy: fail, max_restarts: 0}"), []),
    (BASE.replace("  max_tokens: 512", "  max_tokens: 512\n  advantage: {overlong_buffer: 128, overlong_penalty: 0.5}"),
     []),
], ids=["str-tag", "utf8-bom", "minutes", "quoted-override", "directives", "interpolation", "run-dir-from-home",
        "fail-without-restarts", "overlong-penalty-with-buffer"])
def test_legitimate_yaml_still_plans(sandbox: Path, capsys, text: str, argv: list[str]):
    (sandbox / "prof.yaml").write_text(PROFILE)
    (sandbox / "topo.yaml").write_text(text.replace("{run}", str(sandbox / "run")))
    code, out, err = plan_in_process([str(sandbox / "topo.yaml"), "--no-write", *argv], capsys)
    assert code == 0, err


@pytest.mark.timeout(10)
def test_router_aux_loss_plans_on_an_moe_model(sandbox: Path, capsys):
    """The refusal of `router_aux_loss_coef` on a dense model reads the model: an MoE one's config.json plans."""
    moe = b'{"architectures": ["Qwen3MoeForCausalLM"], "num_attention_heads": 8, "num_experts": 4}'
    path = _with_model_config(moe, AUX_LOSS)(sandbox)
    code, out, err = plan_in_process([str(path), "--no-write"], capsys)
    assert code == 0, err


@pytest.mark.timeout(10)
def test_the_router_step_fits_a_one_core_node(sandbox: Path, capsys):
    """On a CPU profile of 1-core nodes the P/D router's step asks for the one core (srun refuses a step asking more
    cores than its node has: the job would fail at the router's start)."""
    import json

    (sandbox / "prof.yaml").write_text(PROFILE.replace("gpus: 8\n  cpus: 64", "gpus: 0\n  cpus: 1"))
    split = "  prefill: {nodes: 1}\n  decode: {nodes: 1}\n  kv_connector: {name: ExampleConnector}"
    (sandbox / "topo.yaml").write_text(BASE.replace("  nodes: 1\n  tp: 2", split).replace("{run}", str(sandbox / "run")))
    code, out, err = plan_in_process([str(sandbox / "topo.yaml")], capsys)
    assert code == 0, err
    launches = json.loads((sandbox / "run" / "plan.json").read_text())["launches"]
    assert [launch["cpus_per_task"] for launch in launches if launch["name"] == "router"] == [1]


def test_merge_keys_keep_their_anchor_lines(sandbox: Path, capsys):
    """Merged fields are located at the anchor that defines them, unless the mapping restates them."""
    (sandbox / "prof.yaml").write_text(PROFILE)
    (sandbox / "topo.yaml").write_text(MERGE_OK.replace("{run}", str(sandbox / "run")))
    code, out, err = plan_in_process([str(sandbox / "topo.yaml"), "--no-write"], capsys)
    assert "(group): unknown field" in err and f"{sandbox / 'topo.yaml'}:7" in err, err
    text = MERGE_OK.replace("group: &g {nodes: 1, tp: 2}\n", "").replace("<<: *g", "<<: {nodes: 1, tp: 3}")
    (sandbox / "topo.yaml").write_text(text.replace("{run}", str(sandbox / "run")))
    code, out, err = plan_in_process([str(sandbox / "topo.yaml"), "--no-write"], capsys)
    assert code == 2 and f"{sandbox / 'topo.yaml'}:8 (inference.tp)" in err, err


@pytest.mark.timeout(10)
@pytest.mark.parametrize("run_dir", ["run-[bold]x[/]", "run-[/]", "run-[link=https://example.com]x[/link]",
                                     "run-[red]"])
def test_markup_in_accepted_text_prints_literally(sandbox: Path, capsys, run_dir: str):
    """Text the schema accepts is printed as written: rich must not read it as markup (or crash on it)."""
    (sandbox / "prof.yaml").write_text(PROFILE)
    target = sandbox / run_dir
    (sandbox / "topo.yaml").write_text(BASE.replace("{run}", str(target)))
    code, out, err = plan_in_process([str(sandbox / "topo.yaml")], capsys)
    assert code == 0, err
    assert str(target) in out.replace("\n", ""), out


FUZZ_TOKENS = ["\n", " ", ":", "- ", "[", "]", "{", "}", ",", "&a ", "*a", "<<: ", "!!", "!x ", "'", '"', "#", "?",
               "|", ">", "${", "${name}", "%", "`", "\t", "-1", "1e9", ".inf", "yes", "~", "5:00", "\\", "---",
               "\x00", "\ufeff", "null", "[]", "{}"]


def _mutate(text: str, rng: "random.Random") -> str:
    for _ in range(rng.randint(1, 4)):
        pos = rng.randrange(len(text) or 1)
        choice = rng.random()
        if choice < 0.5:
            text = text[:pos] + rng.choice(FUZZ_TOKENS) + text[pos:]
        elif choice < 0.8:
            text = text[:pos] + text[pos + rng.randint(1, 5):]
        else:
            a, b = sorted(rng.randrange(len(text) or 1) for _ in range(2))
            text = text[:pos] + text[a:b] + text[pos:]
    return text


@pytest.mark.timeout(60)
def test_mutated_topologies_plan_or_fail_in_one_line(sandbox: Path, capsys):
    """Seeded random edits of BASE (YAML punctuation, anchors, tags, NULs): a plan, or one `error:` line."""
    import random

    rng = random.Random(13)
    (sandbox / "prof.yaml").write_text(PROFILE)
    path = sandbox / "topo.yaml"
    for _ in range(120):
        text = _mutate(BASE.replace("{run}", str(sandbox / "run")), rng)
        path.write_text(text)
        code, out, err = plan_in_process([str(path), "--no-write"], capsys)
        assert code in (0, 2), f"exit {code} for {text!r}: {err}"
        if code == 2:
            assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, (text, err)
    assert not (sandbox / "run").exists() and not (sandbox / "home").exists()


def prl_plan(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PRL_HOME": str(cwd / "home"), "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "prl.cli", "plan", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=60)


SUBPROCESS = ["python-tag", "alias-bomb", "non-utf8-byte", "fifo", "dev-zero", "override-bad-yaml",
              "nesting-1000", "file-name-ansi", "omegaconf-empty-default"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", [p for p in PARAMS if p.values[0].id in SUBPROCESS],
                         ids=lambda p: p.id)
def test_real_process_exits_2_without_traceback(case: Case, tmp_path: Path):
    path = _topology_path(case, tmp_path)
    result = prl_plan(str(path), *case.overrides, cwd=tmp_path)
    assert_refused(result.returncode, result.stdout, result.stderr, _expected_location(case, tmp_path),
                   case.field, case.says, tmp_path)


def _private(tmp_path: Path, kind: str) -> tuple[Path, int, str]:
    """A topology reaching into tmp_path/private (another user's, below) for `kind`: its path, the line and field
    that lead there."""
    private = tmp_path / "private"
    if kind == "teacher":
        (tmp_path / "model").mkdir()
        (tmp_path / "model" / "tokenizer.json").write_bytes(GOOD_TOKENIZER)
        (private / "teacher").mkdir(parents=True)
        teacher = f"teacher:\n  path: {private / 'teacher'}\n  nodes: 1\nslurm:\n"
        text = BASE.replace("/models/m", str(tmp_path / "model")).replace("slurm:\n", teacher)
        return _write_as(tmp_path, "topo.yaml", text), TEACHER_LINE, "teacher.path"
    if kind == "pool":
        (private / "pool").mkdir(parents=True)
        return _write_as(tmp_path, "topo.yaml", ATTACHED.replace("/pools/p", str(private / "pool"))), ATTACH_LINE, \
            "inference.attach"
    (private / "prev").mkdir(parents=True)
    return _write_as(tmp_path, "topo.yaml", BASE.replace("  path: /models/m", f"  from_run: {private / 'prev'}")), 5, \
        "model.from_run"


@pytest.mark.timeout(10)
@pytest.mark.parametrize("kind", ["teacher", "pool", "from_run"])
def test_another_users_private_directory_is_one_located_line(sandbox: Path, capsys, monkeypatch, kind: str):
    """PermissionError as an ordinary user on a shared cluster meets it. Root reads every directory, so the
    filesystem's refusal is injected at os.stat for paths under tmp_path/private (what EACCES looks like)."""
    path, line, field = _private(sandbox, kind)
    private, real_stat = str(sandbox / "private") + "/", os.stat

    def stat(target, *args, **kw):
        if os.fspath(target).startswith(private):
            raise PermissionError(13, "Permission denied", os.fspath(target))
        return real_stat(target, *args, **kw)

    monkeypatch.setattr(os, "stat", stat)
    code, out, err = plan_in_process([str(path)], capsys)
    where = re.compile(re.escape(f"{path}:{line}"))
    assert_refused(code, out, err, where, field, "Permission denied", sandbox)


@pytest.mark.timeout(10)
def test_a_nul_in_a_pools_model_path_is_one_located_line(sandbox: Path, capsys):
    import msgspec

    from prl.planner.prepare import prepare

    pool = sandbox / "pool"
    pool.mkdir()
    planned = prepare(REPO / "configs" / "local-pool.yaml", [f"run_dir={pool}"], cwd=sandbox).plan
    broken = msgspec.structs.replace(planned, pool=msgspec.structs.replace(planned.pool, model="/models/m\x00x"))
    (pool / "plan.json").write_text(broken.to_json())
    path = _write_as(sandbox, "topo.yaml", ATTACHED.replace("/pools/p", str(pool)))
    code, out, err = plan_in_process([str(path)], capsys)
    assert_refused(code, out, err, re.compile(re.escape(f"{path}:{ATTACH_LINE}")), "inference.attach",
                   "holds a NUL character", sandbox)


def test_pyyamls_own_nesting_bound_is_refused_in_our_words(monkeypatch):
    """PyYAML 6.0.4 bounds nesting itself and may raise before our event walk does: the refusal reads the
    same whichever bound fires first (the wording of the library's error is not ours to test)."""
    import yaml

    from prl.config import loader

    def parse(text, Loader):
        mark = yaml.Mark("topo.yaml", 0, 2, 7, None, None)
        raise yaml.parser.ParserError(None, None, "exceeded maximum nesting depth", mark)

    monkeypatch.setattr(loader.yaml, "parse", parse)
    with pytest.raises(loader._YamlProblem) as err:
        loader.check_yaml("a:\n  b: [[[1]]]\n")
    assert (err.value.line, err.value.message) == (3, f"nested more than {loader.MAX_DEPTH} levels deep")
