"""Schema and plan checks: every invalid topology or profile gets its own message and YAML line."""

from __future__ import annotations

from pathlib import Path

import pytest

from prl.errors import ConfigError, PlanError
from prl.planner.prepare import prepare

BASE = """\
name: t
cluster: ./prof.yaml
run_dir: /shared/runs/t
model:
  path: /models/m
  dtype: bfloat16
  max_model_len: 4096
inference:
  nodes: 1
  tp: 2
trainer:
  nodes: 2
  dp_shard: -1
  ep: 1
  cp: 1
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
name: testgpu
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


def _write(tmp_path: Path, topo: str = BASE, profile: str = PROFILE) -> Path:
    (tmp_path / "prof.yaml").write_text(profile)
    path = tmp_path / "topo.yaml"
    path.write_text(topo)
    return path


def _edit(text: str, old: str, new: str) -> str:
    assert old in text, f"case edits text that is not there: {old!r}"
    return text.replace(old, new, 1)


# id, which file, (old, new), overrides, expected location suffix, expected message fragment
CASES = [
    ("missing-name", "topo", ("name: t\n", ""), [], "topo.yaml:1 (name)", "required field is missing"),
    ("bad-name", "topo", ("name: t", "name: my run"), [], "topo.yaml:1 (name)", "only letters, digits"),
    ("unknown-top", "topo", ("slurm:\n", "slurmm:\n"), [], "topo.yaml:25 (slurmm)", "unknown field"),
    ("unknown-nested", "topo", ("  dtype: bfloat16", "  dtyp: bfloat16"), [], "topo.yaml:6 (model.dtyp)",
     "unknown field"),
    ("bad-dtype", "topo", ("  dtype: bfloat16", "  dtype: bf17"), [], "topo.yaml:6 (model.dtype)", "'bfloat16'"),
    ("short-len", "topo", ("max_model_len: 4096", "max_model_len: 8"), [], "topo.yaml:7 (model.max_model_len)",
     "greater than or equal to 16"),
    ("both-forms", "topo", ("  tp: 2\n", "  tp: 2\n  prefill: {nodes: 1}\n  decode: {nodes: 1}\n"), [],
     "topo.yaml:8 (inference)", "not both"),
    ("prefill-only", "topo", ("  nodes: 1\n  tp: 2\n", "  prefill: {nodes: 1}\n"), [], "topo.yaml:8 (inference)",
     "needs both prefill and decode"),
    ("no-inference-nodes", "topo", ("  nodes: 1\n  tp: 2\n", "  tp: 2\n"), [], "topo.yaml:8 (inference)",
     "give nodes"),
    ("tp-not-dividing", "topo", ("  tp: 2", "  tp: 3"), [], "topo.yaml:10 (inference.tp)",
     "tp(3) must divide the 8 GPUs"),
    ("tp-over-node", "topo", ("  tp: 2", "  tp: 16"), [], "topo.yaml:10 (inference.tp)",
     "larger than a node's 8 GPUs"),
    ("replica-not-dividing", "topo", ("  tp: 2", "  tp: 2\n  dp: 3"), [], "topo.yaml:11 (inference.dp)",
     "tp(2) * dp(3) = 6 GPUs per replica"),
    ("replica-nodes", "topo", ("  tp: 2", "  tp: 8\n  dp: 2"), [], "topo.yaml:9 (inference.nodes)",
     "use a multiple of 2 nodes"),
    ("dp-shard-zero", "topo", ("  dp_shard: -1", "  dp_shard: 0"), [], "topo.yaml:13 (trainer.dp_shard)",
     "-1 to fill"),
    ("mesh-product", "topo", ("  dp_shard: -1", "  dp_shard: 4"), [], "topo.yaml:13 (trainer.dp_shard)",
     "dp_replicate(1) * dp_shard(4) * cp(1) = 4 != world size 16 (2 nodes x 8 GPUs"),
    ("ep-not-dividing", "topo", ("  ep: 1", "  ep: 3"), [], "topo.yaml:14 (trainer.ep)",
     "ep(3) to divide dp_shard(16) * cp(1) = 16"),
    ("cp-not-dividing", "topo", ("  cp: 1", "  cp: 3"), [], "topo.yaml:15 (trainer.cp)",
     "dp_replicate(1) * cp(3) = 3 to divide its 16 GPUs"),
    ("replicate-not-dividing", "topo", ("  dp_shard: -1", "  dp_shard: -1\n  dp_replicate: 3"), [],
     "topo.yaml:14 (trainer.dp_replicate)", "dp_replicate(3) * cp(1) = 3 to divide its 16 GPUs"),
    ("trainer-gpus", "topo", ("  nodes: 2\n", "  nodes: 2\n  gpus_per_node: 16\n"), [],
     "topo.yaml:13 (trainer.gpus_per_node)", "more than the 8 GPUs"),
    ("precision", "topo", ("  cp: 1", "  cp: 1\n  precision: fp16"), [], "topo.yaml:16 (trainer.precision)",
     "'bf16', 'fp32' or 'fp8'"),
    ("trainer-zero-nodes", "topo", ("  nodes: 2", "  nodes: 0"), [], "topo.yaml:12 (trainer.nodes)",
     "greater than or equal to 1"),
    ("placement", "topo", ("placement: own", "placement: elsewhere"), [],
     "topo.yaml:17 (orchestrator.placement)", "'own', 'trainer' or 'inference'"),
    ("orchestrator-cpus", "topo", ("placement: own", "placement: own\n  cpus: 64"), [],
     "topo.yaml:18 (orchestrator.cpus)", "asks for 64 CPUs but a node of its partition has 32"),
    ("batch-multiple", "topo", ("batch_size: 64", "batch_size: 60"), [], "topo.yaml:21 (training.batch_size)",
     "batch_size(60) must be a multiple of rollouts_per_example(8); use 56"),
    ("batch-too-small", "topo", ("batch_size: 64", "batch_size: 8"), [], "topo.yaml:21 (training.batch_size)",
     "no sample; use at least 16"),
    ("max-tokens", "topo", ("max_tokens: 512", "max_tokens: 5000"), [], "topo.yaml:24 (training.max_tokens)",
     "leaves no room for the prompt"),
    ("ratio-bounds", "topo", ("  max_tokens: 512", "  max_tokens: 512\n  loss: {ratio_low: 2, ratio_high: 1}"), [],
     "topo.yaml:25 (training.loss.ratio_low)", "ratio_low (2.0) must be below ratio_high (1.0)"),
    ("loss-mode-of-token", "topo", ("  max_tokens: 512", "  max_tokens: 512\n  loss:\n    kind: gspo\n    mode: clip"),
     [], "topo.yaml:27 (training.loss.mode)", "mode applies to kind token"),
    ("loss-kind", "topo", ("  max_tokens: 512", "  max_tokens: 512\n  loss: {kind: ppo}"), [],
     "topo.yaml:25 (training.loss.kind)", "'token', 'gspo', 'cispo' or 'dppo'"),
    ("loss-import-path", "topo", ("  max_tokens: 512", "  max_tokens: 512\n  loss:\n    import_path: mylosses.pg"),
     [], "topo.yaml:26 (training.loss.import_path)", "must read package.module:function"),
    ("loss-gspo-cp", "topo", ("  cp: 1", "  cp: 2"), ["training.loss.kind=gspo"], "(training.loss.kind)",
     "kind gspo takes one ratio per sample"),
    ("distill-without-teacher", "topo", ("  max_tokens: 512", "  max_tokens: 512\n  loss: {distill_coef: 1.0}"), [],
     "topo.yaml:25 (training.loss.distill_coef)", "distill_coef(1) needs the teacher's logprobs"),
    ("kl-ref-without-reference", "topo", ("  max_tokens: 512", "  max_tokens: 512\n  loss:\n    kl_ref_coef: 0.1"),
     [], "topo.yaml:26 (training.loss.kl_ref_coef)", "kl_ref_coef(0.1) needs the reference's logprobs"),
    ("reward-coef-alone", "topo", ("  max_tokens: 512", "  max_tokens: 512\n  loss: {reward_coef: 0.5}"), [],
     "topo.yaml:25 (training.loss.reward_coef)", "set distill_coef too"),
    ("teacher-without-path", "topo", ("trainer:\n", "teacher: {nodes: 1}\ntrainer:\n"), [],
     "topo.yaml:11 (teacher.path)", "teacher needs a model"),
    ("teacher-context", "topo", ("trainer:\n", "teacher:\n  path: /models/t\n  nodes: 1\n  max_model_len: 4096\ntrainer:\n"),
     [], "topo.yaml:14 (teacher.max_model_len)", "must exceed the student's model.max_model_len(4096)"),
    ("teacher-tp", "topo", ("trainer:\n", "teacher:\n  path: /models/t\n  nodes: 1\n  tp: 16\ntrainer:\n"),
     [], "topo.yaml:14 (teacher.tp)", "teacher tp(16) is larger than a node's 8 GPUs"),
    ("advantage-baseline", "topo", ("  max_tokens: 512", "  max_tokens: 512\n  advantage: {baseline: others}"), [],
     "topo.yaml:25 (training.advantage.baseline)", "'group_mean' or 'leave_one_out'"),
    ("time-format", "topo", ('time: "01:00:00"', 'time: "1 hour"'), [], "topo.yaml:26 (slurm.time)",
     "time must look like"),
    ("qos-space", "topo", ('  time: "01:00:00"', '  time: "01:00:00"\n  qos: "a b"'), [], "topo.yaml:27 (slurm.qos)",
     "must not contain spaces"),
    ("extra-directive", "topo", ('  time: "01:00:00"', '  time: "01:00:00"\n  extra_directives: [mail]'), [],
     "topo.yaml:27 (slurm.extra_directives)", "one long option"),
    ("env-name", "topo", ("  cp: 1", "  cp: 1\n  env: {1BAD: x}"), [], "topo.yaml:16 (trainer.env)",
     "'1BAD' is not a valid shell name"),
    ("offload-size-missing", "topo", ("  tp: 2", "  tp: 2\n  kv_offload: {backend: native}"), [],
     "topo.yaml:11 (inference.kv_offload)", "needs cpu_gb > 0"),
    ("offload-memory", "topo", ("  tp: 2", "  tp: 2\n  kv_offload: {backend: native, cpu_gb: 900}"), [],
     "topo.yaml:11 (inference.kv_offload.cpu_gb)", "cpu_gb(900) * 4 servers per node = 3600 GiB"),
    ("too-many-nodes", "topo", ("  nodes: 2", "  nodes: 20"), [], "prof.yaml:15 (max_nodes)",
     "inference 1 + orchestrator 1 + trainer 20 = 22 nodes, over cluster 'testgpu' max_nodes(16)"),
    ("unknown-cluster", "topo", ("cluster: ./prof.yaml", "cluster: nosuch"), [], "topo.yaml:2 (cluster)",
     "no cluster profile 'nosuch'"),
    ("run-dir-space", "topo", ("run_dir: /shared/runs/t", "run_dir: /shared/my runs/t"), [],
     "topo.yaml:3 (run_dir)", "without spaces"),
    ("invalid-yaml", "topo", ("model:\n", "model: [\n"), [], "topo.yaml:6", "invalid YAML"),
    ("bad-override-value", "topo", None, ["trainer.nodes=abc"], "override 'trainer.nodes=abc' (trainer.nodes)",
     "valid integer"),
    ("bad-override-syntax", "topo", None, ["trainer.nodes"], "override 'trainer.nodes'", "expected key.path=value"),
    ("missing-interpolation", "topo", ("run_dir: /shared/runs/t", "run_dir: /shared/${nope}"), [],
     "topo.yaml:3 (run_dir)", "nope"),
    ("wrong-type", "topo", ("  nodes: 2", "  nodes: two"), [], "topo.yaml:12 (trainer.nodes)", "valid integer"),
    ("not-a-mapping", "topo", (BASE, "- a\n- b\n"), [], "topo.yaml:1", "expected a mapping"),
    ("renderer-without-name", "topo", ("  max_model_len: 4096", "  max_model_len: 4096\n  renderer: {enable_thinking: false}"),
     [], "topo.yaml:8 (model.renderer)", "renderer needs a `name`"),
    ("empty-model-path", "topo", ("path: /models/m", 'path: ""'), [], "topo.yaml:5 (model.path)",
     "at least 1 character"),
    ("profile-directive", "profile", ("max_nodes: 16", "max_nodes: 16\ngpu_directive: gpus"), [],
     "prof.yaml:16 (gpu_directive)", "'gpus-per-node', 'gres' or 'none'"),
    ("profile-missing-root", "profile", ("shared_root: /shared\n", ""), [], "prof.yaml:1 (shared_root)",
     "required field is missing"),
    ("profile-partition", "profile", ("trainer: gpu", 'trainer: "gpu;rm"'), [], "prof.yaml:4 (partitions.trainer)",
     "must not contain spaces, quotes, '$', ';'"),
    ("profile-no-hetjob", "profile", ("max_nodes: 16", "max_nodes: 16\nhetjob: false"), [],
     "prof.yaml:16 (hetjob)", "allows no hetjobs"),
    ("profile-time", "profile", ("max_nodes: 16", "max_nodes: 16\ndefault_time: soon"), [],
     "prof.yaml:16 (default_time)", "time must look like"),
    ("delta-without-memory", "topo", ("slurm:\n", "weights:\n  delta: true\nslurm:\n"), [],
     "topo.yaml:26 (weights.delta)", "set weights.transport: memory"),
    ("group-timeout", "topo", ("slurm:\n", "weights:\n  transport: broadcast\n  group_timeout_s: 0\nslurm:\n"), [],
     "topo.yaml:27 (weights.group_timeout_s)", "greater than or equal to 1"),
    ("profile-override", "topo", None, ["cluster.max_nodes=0"], "override 'max_nodes=0' (max_nodes)",
     "greater than or equal to 1"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_invalid_input_is_located(tmp_path, case):
    _, which, edit, overrides, where, fragment = case
    topo, profile = BASE, PROFILE
    if edit is not None:
        if which == "topo":
            topo = _edit(topo, *edit)
        else:
            profile = _edit(profile, *edit)
    path = _write(tmp_path, topo, profile)
    with pytest.raises(ConfigError) as err:
        prepare(path, overrides, cwd=tmp_path)
    message = str(err.value)
    assert "\n" not in message, message
    location = message.split(": ", 1)[0] if not message.startswith("override") else message
    assert where in location, message
    assert fragment in message, message
    if which == "topo" and "prof.yaml" not in where:
        assert str(tmp_path / "topo.yaml") in message or message.startswith("override"), message


def test_base_is_valid(tmp_path):
    prepared = prepare(_write(tmp_path), cwd=tmp_path)
    expected = {"nodes": 4, "gpus": 24, "inference_servers": 4, "inference_gpus": 8, "trainer_world_size": 16}
    totals = prepared.plan.totals
    assert {key: totals[key] if isinstance(totals, dict) else getattr(totals, key) for key in expected} == expected


def test_plan_errors_are_plan_errors(tmp_path):
    path = _write(tmp_path, _edit(BASE, "  ep: 1", "  ep: 3"))
    with pytest.raises(PlanError):
        prepare(path, cwd=tmp_path)


def test_each_tiny_moe_family_a_topology_may_build_is_one_tiny_model_builds():
    """`model.build_tiny` takes every family of TINY_MOE_FAMILIES (the Literal lists them by hand), and `prl submit`
    passes it to prl.trainer.tiny_model, which must know it."""
    import msgspec

    from prl.config.topology import TINY_MOE_FAMILIES, Model
    from prl.trainer.tiny_model import MOE_FAMILIES

    assert set(TINY_MOE_FAMILIES) <= set(MOE_FAMILIES)
    for family in TINY_MOE_FAMILIES:
        assert msgspec.convert({"path": "m", "build_tiny": family}, Model).build_tiny == family
