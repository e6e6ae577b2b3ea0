"""Expert parallelism, context parallelism, meta-device sharded load and sharded publish, on CPU (gloo).

Every run is the real trainer (`python -m prl.trainer` under torchrun) on a tiny model built
in-process:

- EP=2 on a tiny Qwen3-MoE against a single-process transformers reference (no EP, no
  packing): losses over 4 steps and the published weights;
- the 2-rank sharded publish of that run, reloaded with `from_pretrained`, against the
  trainer's own checkpoint (exact);
- CP=2 (Ulysses, the one KV head repeated for the two ranks) against CP=1 on packed micro-batches
  whose samples straddle the two ranks' halves: losses, gradient norms and weights;
- the sharded load's peak RSS per rank against the model's size;
- SIGKILL of one rank in the middle of a sharded publish: no step is accepted, and the next
  attempt publishes it;
- the router load-balancing loss (router_aux_loss_coef) against transformers' own.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from prl.run.batch import read_batch
from prl.run.rundir import is_stable
from tests.helpers import free_port
from tests.test_trainer import _reference
from tests.tiny_model import build_tiny_model, build_tiny_moe
from testkit.trainer_helpers import REPO, launch, setup_run

STEPS = 4


def _vocab(path) -> int:
    return json.loads((path / "config.json").read_text())["vocab_size"]


def _files_state(path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files of `path`."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    path = build_tiny_moe(tmp_path_factory.mktemp("moe") / "moe")
    return path, _vocab(path)


@pytest.fixture(scope="module")
def run_ep(moe, tmp_path_factory):
    """Tiny MoE, 2 ranks, ep=2 (each rank holds 2 of the 4 experts), steps 1..4, checkpoints at 2 and 4."""
    model, vocab = moe
    run = setup_run(tmp_path_factory.mktemp("run_ep"), model, range(1, STEPS + 1), vocab, max_steps=STEPS,
                    overrides=["trainer.ep=2"])
    launch(run, 2, resume="none")
    return run


@pytest.mark.slow  # run_ep is a 2-rank torchrun run: 30-70 s on 2 shared cores
def test_ep2_matches_single_process_reference(moe, run_ep):
    from transformers import AutoModelForCausalLM

    model_dir, vocab = moe
    ref_losses, ref_model = _reference(model_dir, vocab, STEPS)
    metrics = run_ep.read_metrics("trainer")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert [m["loss"] for m in metrics] == pytest.approx(ref_losses, rel=1e-4, abs=1e-6)
    published = AutoModelForCausalLM.from_pretrained(run_ep.weights(STEPS), dtype=torch.float32).state_dict()
    ref = ref_model.state_dict()
    assert published.keys() == ref.keys()
    # As the dense FSDP parity test: Adam divides by sqrt(v), so where a gradient is ~0 (an expert that saw
    # a few tokens) fp32 summation-order noise moves an element by a few % of lr (1e-2). Bound every
    # element by 3% of lr, the mean far tighter, and allow almost no element beyond 1e-5.
    for k, v in ref.items():
        diff = (published[k] - v).abs()
        torch.testing.assert_close(published[k], v, rtol=0, atol=3e-4, msg=lambda m: f"{k}: {m}")
        assert diff.mean() < 1e-6, k
        assert (diff > 1e-5).float().mean() < 1e-3, k
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    assert not torch.allclose(base["model.layers.0.mlp.experts.gate_up_proj"],
                              published["model.layers.0.mlp.experts.gate_up_proj"]), "experts were trained"
    m = metrics[-1]
    for key in ("mismatch_ratio_mean", "mismatch_ratio_min", "mismatch_ratio_max", "mismatch_kl"):
        assert m[key] is not None and m[key] >= 0, key
    assert m["mismatch_ratio_min"] <= m["mismatch_ratio_mean"] <= m["mismatch_ratio_max"]


@pytest.mark.slow  # run_ep
def test_sharded_publish_reloads_equal_to_the_trainer_state(moe, run_ep, tmp_path):
    """Both ranks wrote a file of the step's weights; from_pretrained of it equals the checkpoint exactly."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM

    wdir = run_ep.weights(STEPS)
    assert is_stable(wdir)
    index = json.loads((wdir / "model.safetensors.index.json").read_text())["weight_map"]
    files = sorted(set(index.values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert "lm_head.weight" not in index, "a tied lm_head is stored once"
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in index, "experts are stored per expert (HF layout)"
    # Balanced: neither rank wrote the bulk of the model.
    sizes = [(wdir / f).stat().st_size for f in files]
    assert max(sizes) < 0.75 * sum(sizes), sizes

    dcp_to_torch_save(str(run_ep.checkpoints(STEPS, "trainer") / "dcp"), str(tmp_path / "ckpt.pt"))
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)["model"]
    trainer = {}
    for k, v in saved.items():
        name, _, part = k.rpartition(".")
        if re.fullmatch(r"ep\d+of\d+", part):  # each EP rank's experts, saved apart
            trainer.setdefault(name, {})[int(part[2:].split("of")[0])] = v
        else:
            trainer[k] = v
    trainer = {k: torch.cat([v[i] for i in sorted(v)]) if isinstance(v, dict) else v for k, v in trainer.items()}
    fresh = AutoModelForCausalLM.from_pretrained(wdir, dtype=torch.float32)
    state = fresh.state_dict()
    assert set(trainer) == set(state)
    for k, v in trainer.items():
        assert torch.equal(state[k], v), k
    assert fresh.lm_head.weight.data_ptr() == fresh.model.embed_tokens.weight.data_ptr(), "tied weights stay tied"


@pytest.mark.slow
def test_ep_checkpoint_resumes_to_the_uninterrupted_run(moe, run_ep, tmp_path):
    """Stop after checkpoint 2, resume with ep=2: steps 3-4 equal the uninterrupted run's (experts saved per EP rank)."""
    from prl.run.batch import publish_batch
    from testkit.plans import write_plan
    from testkit.trainer_helpers import make_plan, make_samples

    model, vocab = moe
    run = setup_run(tmp_path / "run", model, range(1, 3), vocab, max_steps=2, overrides=["trainer.ep=2"])
    launch(run, 2, resume="none")
    for s in (3, 4):
        publish_batch(run, s, make_samples(s, vocab), dp_size=2, micro_batch_tokens=64)
    write_plan(run, make_plan(model, run.root, max_steps=STEPS, overrides=["trainer.ep=2"]))
    launch(run, 2, resume="latest")
    want = [m["loss"] for m in run_ep.read_metrics("trainer")]
    assert [m["loss"] for m in run.read_metrics("trainer")] == pytest.approx(want, rel=1e-6, abs=1e-8)


def _straddles(run, step: int, micro_batch_tokens: int, cp: int) -> bool:
    """Whether some packed sample of `step` crosses the boundary between cp ranks' shares."""
    for mb in read_batch(run.rollouts(step)).micro_batches(0, 1, micro_batch_tokens):
        if mb is None:
            continue
        share = (mb.num_tokens + (-mb.num_tokens) % cp) // cp
        starts = [i for i, p in enumerate(mb.position_ids) if p == 0] + [mb.num_tokens]
        if any(a < share < b for a, b in zip(starts, starts[1:])):
            return True
    return False


@pytest.mark.slow
def test_context_parallel_cp2_matches_cp1(tmp_path):
    """Ulysses CP=2 on 2 ranks vs one rank: same losses, gradient norms and weights, on a model with one
    key/value head (fewer than cp: each is repeated twice, each copy serving 2 of the 4 query heads).
    tests/test_moe_families.py runs cp=2 where the KV heads divide (no repeat)."""
    model = build_tiny_model(tmp_path / "model", num_heads=4, num_kv_heads=1)
    vocab = _vocab(model)
    one = setup_run(tmp_path / "cp1", model, range(1, 3), vocab, max_steps=2, checkpoint_interval=0, world_size=1)
    two = setup_run(tmp_path / "cp2", model, range(1, 3), vocab, max_steps=2, checkpoint_interval=0,
                    overrides=["trainer.cp=2"])
    assert all(_straddles(two, s, 64, 2) for s in (1, 2)), "test data must put samples across the cp split"
    launch(one, 1, resume="none")
    launch(two, 2, resume="none")
    a, b = one.read_metrics("trainer"), two.read_metrics("trainer")
    assert [m["loss"] for m in b] == pytest.approx([m["loss"] for m in a], rel=1e-5, abs=1e-7)
    assert [m["grad_norm"] for m in b] == pytest.approx([m["grad_norm"] for m in a], rel=1e-5)
    assert [m["loss_tokens"] for m in b] == [m["loss_tokens"] for m in a], "every loss token counted once"
    wa, wb = _files_state(one.weights(2)), _files_state(two.weights(2))
    assert wa.keys() == wb.keys()
    for k in wa:
        # 2e-4: after 2 Adam steps at lr 5e-3, the per-sample attention kernel's sums over another split of the
        # heads move single weights by up to ~1.3e-4 (one of 8192 in one run); a wrong split moves them by 1e-3+.
        torch.testing.assert_close(wb[k], wa[k], rtol=0, atol=2e-4, msg=lambda m: f"{k}: {m}")


@pytest.mark.slow
def test_sharded_load_peak_rss_is_about_one_shard(tmp_path):
    """2 ranks load a ~75 MB fp32 model: each rank's peak RSS grows by about half of it, not all of it."""
    model = build_tiny_model(tmp_path / "model", hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4,
                             head_dim=64)
    model_mb = (model / "model.safetensors").stat().st_size / 2**20
    assert model_mb > 60
    run = setup_run(tmp_path / "run", model, range(1, 2), _vocab(model), max_steps=1, checkpoint_interval=0)
    out = launch(run, 2, resume="none").stdout
    grown = float(re.search(r"loading raised peak RSS by ([\d.]+) MiB", out).group(1))
    # A full load on every rank would need at least model_mb; a shard is model_mb / 2.
    assert grown < 0.5 * model_mb + 0.15 * model_mb, f"peak RSS grew {grown:.1f} MiB for a {model_mb:.1f} MiB model"


KILL_MID_PUBLISH = textwrap.dedent("""
    import os, signal, sys
    import safetensors.torch as st
    real = st.save_file
    def save_then_die(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        # Rank 1 dies right after writing its part of weights/step_1, before the step is published.
        if os.environ["RANK"] == "1" and os.path.basename(filename).startswith("model-"):
            os.kill(os.getpid(), signal.SIGKILL)
    st.save_file = save_then_die
    from prl.trainer.__main__ import cli
    sys.exit(cli())
""")


@pytest.mark.slow
def test_kill_in_the_middle_of_a_sharded_publish_accepts_no_partial_step(moe, tmp_path):
    model, vocab = moe
    run = setup_run(tmp_path / "run", model, range(1, 3), vocab, max_steps=2, checkpoint_interval=0)
    script = tmp_path / "die_mid_publish.py"
    script.write_text(KILL_MID_PUBLISH)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(script), "--run-dir", str(run.root), "--resume", "none"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0
    leftovers = list(run.weights(1).parent.glob(".step_1.tmp-*"))
    assert leftovers and any(f.name.startswith("model-") for f in leftovers[0].iterdir()), "killed mid-publish"
    assert not run.weights(1).exists() and run.stable_steps("weights") == []
    assert run.latest_stable("weights") is None, "inference would not see a partial step"

    launch(run, 2, resume="none")
    assert run.stable_steps("weights") == [1, 2]
    assert not list(run.weights(1).parent.glob(".step_*.tmp-*")), "leftovers removed"
    state = _files_state(run.weights(2))
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in state


ROUTER_AUX = textwrap.dedent("""
    import json, os, sys, types
    import torch, torch.distributed as dist
    from prl.config.topology import Loss
    from prl.run.batch import RolloutBatch, pack, to_arrays
    from prl.planner.model import Mesh
    from prl.trainer.engine import load_model, train_step
    from prl.trainer.parallel import init_distributed
    from prl.trainer.rl import RLSpec
    from prl.trainer.sft import SFTSpec
    from testkit.trainer_helpers import make_samples

    model_dir, vocab, coef, mode = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[5]
    training = types.SimpleNamespace(loss=Loss(), max_grad_norm=0.0, router_aux_loss_coef=coef, router_replay=False,
                                     temperature=1.0)
    cfg = types.SimpleNamespace(model_path=model_dir, mesh=Mesh(dp_replicate=1, dp_shard=1, cp=1, ep=1, world_size=1),
                                precision="fp32", activation_checkpointing=False, master_port=int(sys.argv[4]),
                                training=training, scorers=(), train_vision=False, compile=False)
    d = init_distributed(cfg)
    model, _ = load_model(cfg, d)
    arrays = to_arrays(make_samples(1, vocab))
    batch = RolloutBatch(1, arrays, {})
    mbs = batch.micro_batches(0, 1, 10_000)  # one micro-batch: its aux loss is the step's
    spec = (RLSpec if mode == "rl" else SFTSpec)(cfg)
    out = train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), mbs, spec, cfg, d)
    print(json.dumps(out))
""")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["rl", "sft"])
def test_router_aux_loss_is_transformers_load_balancing_loss(moe, tmp_path, mode):
    """router_aux_loss_coef > 0 adds transformers' aux loss (reported as router_aux_loss) and changes gradients,
    on the RL loss and on the SFT loss alike."""
    from transformers import AutoModelForCausalLM

    from prl.run.batch import to_arrays
    from testkit.trainer_helpers import make_samples

    model, vocab = moe
    script = tmp_path / "aux.py"
    script.write_text(ROUTER_AUX)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}

    def step(coef: float) -> dict:
        cmd = [sys.executable, str(script), str(model), str(vocab), str(coef), str(free_port()), mode]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    off, on = step(0.0), step(0.5)
    assert "router_aux_loss" not in off
    arrays = to_arrays(make_samples(1, vocab))
    ref = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    out = ref(input_ids=torch.from_numpy(arrays["input_ids"]).long()[None],
              position_ids=torch.from_numpy(arrays["position_ids"]).long()[None], output_router_logits=True)
    # The aux loss counts top-k picks: fp32 noise between the two forwards can flip a near-tie pick
    # (one token of ~200 in one layer moves it by ~5e-4 relative), so not bit-equal.
    assert on["router_aux_loss"] == pytest.approx(float(out.aux_loss.detach()), rel=2e-3)
    assert on["loss"] == pytest.approx(off["loss"], rel=1e-6), "the policy (or NLL) loss itself is unchanged"
    assert on["grad_norm"] != pytest.approx(off["grad_norm"], rel=1e-3), "the aux loss reaches the gradients"
