"""SFT as a prl job: the plan of an `sft:` topology, its data order, and real runs on CPU (gloo).

The runs use the tiny model of tests/tiny_model.py with its real tokenizer and chat template, on the
shipped data (examples/sft/letters.jsonl) and the shipped topology (configs/sft-tiny.yaml). A 2-rank
FSDP2 run is checked against a plain single-process transformers loop over the same conversations
(unpacked, one at a time); a run killed after a checkpoint and resumed on 1 rank against the
uninterrupted one; its published weights by loading them with transformers; `prl submit --local` end
to end through the launcher and `prl status`.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from prl.planner.model import Plan
from prl.run.rundir import RunDir, is_stable
from tests.helpers import REPO, prl_cli as prl, run_to_the_end, wait_for
from testkit.plans import local_plan, write_plan
from tests.test_plot_wandb import finished_history
from tests.tiny_model import build_tiny_model, build_tiny_moe
from testkit.trainer_helpers import launch

DATA = REPO / "examples" / "sft" / "letters.jsonl"
STEPS = 6


def sft_plan(run_dir: Path, model_dir: Path, *overrides: str, world_size: int = 2, **training) -> Plan:
    """configs/sft-tiny.yaml on `world_size` CPU ranks; `training` overrides training fields by name."""
    training = {"max_steps": STEPS, "checkpoint_interval": 2, "batch_size": 8, "micro_batch_tokens": 128,
                "seed": 0, **training}
    return local_plan(run_dir, model_dir, [f"trainer.gpus_per_node={world_size}", f"sft.data={DATA}",
                                           *(f"training.{k}={v}" for k, v in training.items()), *overrides],
                      topology="sft-tiny")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


# ----------------------------------------------------------------------------- plan (fast)


def test_sft_topology_plans_the_trainer_alone(tmp_path):
    plan = sft_plan(tmp_path / "run", tmp_path / "model")
    assert [s.name for s in plan.launches] == ["trainer"]
    assert plan.launches[0].start_after == () and not plan.launches[0].overlap
    assert plan.orchestrator is None and plan.inference == () and plan.servers == () and plan.router_port is None
    assert plan.trainer.world_size == 2 and len(plan.groups) == 1
    settings = plan.settings()
    assert settings.environment is None and settings.sft is not None and settings.sft.data == str(DATA)
    # The plan survives its own JSON, as every role reads it.
    again = Plan.from_json(plan.to_json())
    assert again.to_json() == plan.to_json() and again.orchestrator is None and again.settings().sft == settings.sft


def test_sft_plan_on_slurm_is_one_component_with_the_trainer_srun(tmp_path):
    plan = local_plan(tmp_path / "run", "/models/m", ["cluster=lab", "trainer.nodes=2", f"sft.data={DATA}"],
                      topology="sft-tiny")
    assert [g.name for g in plan.groups] == ["trainer"] and plan.groups[0].nodes == 2
    # One component is a plain job: srun refuses --het-group outside a heterogeneous job.
    assert not plan.hetjob and plan.launches[0].srun_args[:2] == ("--relative=0", "--nodes=2")
    assert plan.trainer.world_size == 4  # 2 nodes x 2 ranks (gpus_per_node on a CPU cluster)


def test_relative_sft_data_becomes_absolute_where_prl_runs(tmp_path):
    from prl.planner.prepare import prepare

    plan = prepare(REPO / "configs" / "sft-tiny.yaml", [f"run_dir={tmp_path / 'run'}"], cwd=REPO).plan
    assert plan.settings().sft.data == str(DATA)


# ----------------------------------------------------------------------------- data order (fast)


def _data(n: int, batch_size: int, seed: int = 0):
    from prl.trainer.sft import SFTData

    conversations = [[{"role": "user", "content": str(i)}, {"role": "assistant", "content": "x"}] for i in range(n)]
    return SFTData(conversations, tokenizer=None, max_tokens=64, batch_size=batch_size, seed=seed)


def test_every_epoch_sees_every_conversation_once_in_a_new_order():
    data = _data(10, 4)
    stream = [i for step in range(1, 11) for i in data.indices(step)]  # 40 = 4 epochs of 10
    epochs = [stream[k * 10:(k + 1) * 10] for k in range(4)]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 4, "each epoch is shuffled anew"


def test_a_step_s_data_depends_only_on_seed_and_step():
    a, b = _data(10, 4), _data(10, 4)
    assert [b.indices(s) for s in (7, 3, 5)] == [a.indices(s) for s in (7, 3, 5)]
    assert _data(10, 4, seed=1).indices(1) != a.indices(1)


def test_epochs_end_the_run_before_max_steps():
    data = _data(10, 4)
    assert data.last_step(100, 2) == 5  # 20 conversations, 4 per step
    assert data.last_step(3, 2) == 3
    assert data.last_step(100, None) == 100


# ----------------------------------------------------------------------------- real runs (slow)


@pytest.fixture(scope="module")
def run_a(tiny, tmp_path_factory) -> RunDir:
    """2 ranks, steps 1..6, checkpoint every 2 steps, uninterrupted."""
    root = tmp_path_factory.mktemp("sft_a")
    run = write_plan(RunDir(root), sft_plan(root, tiny))
    launch(run, 2, resume="none")
    return run


def _reference(model_dir: Path, steps: int, lora=None, trained: list | None = None) -> list[float]:
    """Plain transformers, one process, one conversation at a time: the token-mean NLL of each step. With `lora`
    (a model.lora) only its adapters train, from the values the trainer's loader gives them; `trained` gets the
    model at the end."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from prl.trainer.sft import SFTData
    from prl.trainer.sft_data import read_conversations

    plan = sft_plan(Path("/unused"), model_dir)
    t = plan.settings().training
    data = SFTData(list(read_conversations(DATA)), AutoTokenizer.from_pretrained(model_dir), 256, t.batch_size, t.seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params = list(model.parameters())
    if lora is not None:
        from prl.trainer.lora import adapter_parameters, attach

        attach(model, lora, t.seed)
        with torch.no_grad():
            for prefix, m in model.named_modules():
                for leaf, fresh in getattr(m, "fresh_parameters", {}).items():
                    getattr(m, leaf).copy_(fresh(f"{prefix}.{leaf}", tuple(getattr(m, leaf).shape)))
        params = adapter_parameters(model)
    opt = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)
    losses = []
    for step in range(1, steps + 1):
        samples = data.samples(step)
        n = sum(sum(s.loss_mask) for s in samples)
        total = 0.0
        for s in samples:
            ids = torch.tensor(s.token_ids)[None]
            logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0, :-1].float(), -1)
            picked = logp.gather(-1, ids[0, 1:, None])[:, 0]
            loss = -(picked * torch.tensor(s.loss_mask[1:], dtype=torch.float32)).sum() / n
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    if trained is not None:
        trained.append(model)
    return losses


def _published(path: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.slow  # a 2-rank torchrun run on CPU per mesh (~25 s each)
@pytest.mark.parametrize("mesh", ["cp", "ep"])
def test_context_and_expert_parallel_sft_match_a_plain_loop(tmp_path, mesh):
    """SFT shares the RL trainer's mesh: Ulysses cp=2 on a dense model (2 kv heads) and ep=2 on a
    Qwen3-MoE give the single-process loop's losses."""
    if mesh == "ep":
        model = build_tiny_moe(tmp_path / "moe")
    else:
        model = build_tiny_model(tmp_path / "dense", num_kv_heads=2)
    steps = 3
    run = write_plan(RunDir(tmp_path / "run"),
                     sft_plan(tmp_path / "run", model, f"trainer.{mesh}=2", max_steps=steps, checkpoint_interval=steps))
    assert Plan.read(run).trainer.mesh.dp == (1 if mesh == "cp" else 2)
    launch(run, 2, resume="none")
    losses = [m["loss"] for m in run.read_metrics("trainer")]
    assert losses == pytest.approx(_reference(model, steps), rel=1e-4, abs=1e-6)


@pytest.mark.slow  # a 2-rank torchrun run on CPU (~35 s)
def test_two_rank_sft_matches_a_plain_loop_and_lowers_the_loss(tiny, run_a):
    metrics = run_a.read_metrics("trainer")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    losses = [m["loss"] for m in metrics]
    assert losses == pytest.approx(_reference(tiny, STEPS), rel=1e-4, abs=1e-6)
    assert losses[-1] < losses[0] - 0.5, losses
    for key in ("tokens_per_s", "step_s", "train_s", "grad_norm", "entropy", "loss_tokens", "epoch"):
        assert metrics[-1][key] is not None, key
    # Weights go with the checkpoints: steps 2, 4, 6 (cleanup keeps those of the kept checkpoints, 4 and 6).
    assert run_a.stable_steps("weights") == [4, 6] and run_a.stable_steps("checkpoints") == [4, 6]
    state = run_a.read_state("trainer")
    assert state.status == "exited" and state.exit_code == 0 and state.step == STEPS


@pytest.mark.slow  # needs the 2-rank run
def test_published_weights_are_a_hf_model_that_learned_the_data(tiny, run_a):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from prl.trainer.sft_data import read_conversations, tokenize_conversation

    tokenizer = AutoTokenizer.from_pretrained(run_a.weights(STEPS))
    samples = [tokenize_conversation(tokenizer, m, 256) for m in list(read_conversations(DATA))[:16]]

    def nll(model_dir) -> float:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        total = count = 0.0
        with torch.no_grad():
            for s in samples:
                ids = torch.tensor(s.token_ids)[None]
                logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
                mask = torch.tensor(s.loss_mask[1:], dtype=torch.float32)
                total += float(-(logp * mask).sum())
                count += float(mask.sum())
        return total / count

    before, after = nll(tiny), nll(run_a.weights(STEPS))
    assert after < before - 0.5, (before, after)


@pytest.mark.slow  # two more torchrun runs (~60 s)
def test_kill_after_a_checkpoint_then_resume_on_one_rank_equals_the_uninterrupted_run(tiny, run_a, tmp_path):
    import psutil
    import torch

    run = write_plan(RunDir(tmp_path / "run_b"), sft_plan(tmp_path / "run_b", tiny))
    proc = launch(run, 2, resume="none", wait=False)
    wait_for("checkpoint 2", lambda: proc.poll() is not None or is_stable(run.checkpoints(2, "trainer")), 180)
    # SIGKILL torchrun and its workers at once, as a node failure or Slurm's step kill would.
    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for p in tree:
        p.send_signal(signal.SIGKILL)
    proc.wait()
    psutil.wait_procs(tree, timeout=10)
    killed_at = max(m["step"] for m in run.read_metrics("trainer"))
    assert killed_at < STEPS and not is_stable(run.weights(STEPS)), f"killed too late (step {killed_at})"

    # The job comes back with 1 rank (a requeue onto fewer nodes) and resumes from the last checkpoint.
    write_plan(run, sft_plan(run.root, tiny, world_size=1))
    launch(run, 1, resume="latest")
    metrics = run.read_metrics("trainer")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1)), "each step once, none lost or repeated"
    want = [m["loss"] for m in run_a.read_metrics("trainer")]
    assert [m["loss"] for m in metrics] == pytest.approx(want, rel=1e-5, abs=1e-7)
    a, b = _published(run_a.weights(STEPS)), _published(run.weights(STEPS))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6)


@pytest.mark.vllm
@pytest.mark.slow  # the launcher, torchrun, 2 ranks (~40 s), an eval (~45 s), a 2-step RL run with vLLM (~60 s)
def test_submit_local_sft_then_rl_from_its_weights_completes(tiny, tmp_path, env):
    """SFT -> eval -> RL as a user chains them: the shipped SFT topology, `prl eval --run` on its weights,
    then an RL run whose `model.from_run` is the SFT run (its newest published weights): vLLM serves them and
    the trainer trains from them."""
    run = tmp_path / "run"
    # With `wandb:` the launcher keeps `prl wandb --follow` going beside the trainer (offline here: no internet).
    env = {**env, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    out = prl(env, "submit", "configs/sft-tiny.yaml", f"run_dir={run}", f"model.path={tiny}",
              "training.max_steps=4", "wandb.project=prl-sft-test", "--local", "--detach").stdout
    assert "submitted local run" in out

    def status() -> dict:
        return json.loads(prl(env, "status", run, "--json").stdout)

    final = wait_for("COMPLETED", lambda: (s := status())["state"] in ("COMPLETED", "FAILED") and s, 240)
    assert final["state"] == "COMPLETED", final
    assert [(r["role"], r["exit_code"]) for r in final["roles"]] == [("trainer", 0)]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if m["role"] == "trainer"] == [1, 2, 3, 4]
    assert is_stable(RunDir(run).weights(4))
    assert "step 4 loss" in prl(env, "logs", run, "--role", "trainer").stdout
    (wandb_file,) = RunDir(run).wandb_dir.glob("offline-run-*/run-*.wandb")
    rows = finished_history(wandb_file)
    assert [r["_step"] for r in rows] == [1, 2, 3, 4] and all("trainer/loss" in r for r in rows), rows

    # The usual next step: evaluate the SFT weights. The run has no inference servers to copy; the evaluation
    # server serves weights/step_4 with the model's own settings.
    prl(env, "eval", "prl_letters", "--run", run, "--steps", "4", "--examples", "4", "--max-tokens", "16",
        timeout=600)
    (sweep,) = RunDir(run).evals_dir.glob("sweep-*.json")
    result = json.loads(sweep.read_text())
    assert result["failed"] == [] and [(r["step"], r["rollouts"]) for r in result["rows"]] == [(4, 4)], result

    rl = tmp_path / "rl"
    prl(env, "submit", "configs/local-tiny.yaml", f"run_dir={rl}", "model.path=null", f"model.from_run={run}", "training.max_steps=2",
        "cluster.port_base=19400", "--local", timeout=600)
    done = json.loads(prl(env, "status", rl, "--json").stdout)
    assert done["state"] == "COMPLETED", prl(env, "logs", rl, "-n", "30", check=False).stdout
    assert Plan.read(RunDir(rl)).settings().model.path == str(RunDir(run).weights(4))
    assert f"from_run: {run}" in (rl / "topology.yaml").read_text()
    assert f"--model {RunDir(run).weights(4)}" in prl(env, "logs", rl, "--role", "inference", "-n", "400").stdout
    assert [m["step"] for m in RunDir(rl).read_metrics("trainer")] == [1, 2]


@pytest.mark.slurm
@pytest.mark.slow  # a real Slurm job of 2 nodes (~60 s)
def test_lab_slurm_sft_across_two_nodes_completes(tiny, tmp_path, env, slurm_cluster):
    run = tmp_path / "run"
    prl(env, "submit", "configs/sft-lab.yaml", f"run_dir={run}", f"model.path={tiny}", "training.max_steps=3")
    final = run_to_the_end(env, run)
    assert final["state"] == "COMPLETED", (final, prl(env, "logs", run, "-n", "40", check=False).stdout)
    (trainer,) = final["roles"]
    assert trainer["role"] == "trainer" and trainer["exit_code"] == 0
    assert len(trainer["nodes"].split(",")) == 2 or "[" in trainer["nodes"], trainer["nodes"]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["role"] == "trainer"] == [1, 2, 3]
    assert "world 2 (dp 2" in prl(env, "logs", run, "--role", "trainer", "-n", "200").stdout
    assert is_stable(RunDir(run).weights(3))


@pytest.mark.slow  # one 2-rank trainer run: ~20 s
def test_sft_with_lora_trains_and_publishes_only_the_adapter(tmp_path):
    """`model.lora` on an `sft:` job: 2 ranks train only the adapter (the base model's weights never move: the
    adapter is all that is published, in PEFT's layout, and all the checkpoint holds besides AdamW's state), and
    the SFT loss falls. The base is the tiny model with 8x embeddings (`build_tiny: dense-lora`), which an adapter
    can move."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader

    from prl.trainer.tiny_model import LORA_EMBED_SCALE
    from tests.test_lora import LORA

    model = build_tiny_model(tmp_path / "model", embed_scale=LORA_EMBED_SCALE)
    run = write_plan(RunDir(tmp_path / "run"), sft_plan(tmp_path / "run", model, *LORA, lr="2.0e-2"))
    launch(run, 2, resume="none")
    losses = [m["loss"] for m in run.read_metrics("trainer")]
    print("SFT + LoRA losses:", [round(x, 3) for x in losses])
    assert len(losses) == STEPS and sum(losses[-2:]) / 2 < 0.8 * sum(losses[:2]) / 2, losses
    last = run.weights(STEPS)
    assert sorted(p.name for p in last.iterdir()) == ["STABLE", "adapter_config.json", "adapter_model.safetensors"]
    adapter = load_file(str(last / "adapter_model.safetensors"))
    assert len(adapter) == 2 * 2 * 3 and all(".lora_A." in k or ".lora_B." in k for k in adapter), sorted(adapter)
    keys = FileSystemReader(str(run.checkpoints(STEPS, "trainer") / "dcp")).read_metadata().state_dict_metadata
    assert all(k.endswith(("lora_A", "lora_B")) for k in keys if k.startswith("model.")), sorted(keys)[:5]


@pytest.mark.slow  # two 2-rank trainer runs: ~20 s
def test_lora_on_routed_experts_with_ep2_matches_a_plain_loop_resumes_and_merges(tmp_path, env):
    """`model.lora` on a Qwen3-MoE's routed experts (gate_proj, up_proj, down_proj: per-expert adapters on the
    fused [E, ...] weights) with ep=2, each rank holding 2 of the 4 experts and their adapters: the losses of the
    single-process loop (transformers, the same adapters attached at ep=1); the published adapter in PEFT's
    per-expert layout (all 4 experts, gathered over the EP group) equal to the loop's; a resume from the step-2
    checkpoint trains step 3 to the same adapter; `prl export --merged` gives a plain model whose logits are the
    adapted model's."""
    import shutil

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from prl.trainer.lora import adapter_state

    model = build_tiny_moe(tmp_path / "moe")
    lora = ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.target_modules=[q_proj,gate_proj,up_proj,down_proj]"]
    steps = 3
    plan = sft_plan(tmp_path / "run", model, "trainer.ep=2", *lora, max_steps=steps, checkpoint_interval=2)
    run = write_plan(RunDir(tmp_path / "run"), plan)
    launch(run, 2, resume="none")
    losses = [m["loss"] for m in run.read_metrics("trainer")]
    trained: list = []
    assert losses == pytest.approx(_reference(model, steps, plan.settings().model.lora, trained), rel=1e-4, abs=1e-6)

    published = load_file(str(run.weights(steps) / "adapter_model.safetensors"))
    expected = adapter_state(trained[0], torch.float32)
    assert published.keys() == expected.keys()
    assert "base_model.model.model.layers.1.mlp.experts.3.down_proj.lora_B.weight" in published
    assert len(published) == 2 * (1 + 4 * 3) * 2, "2 layers x (q_proj + 4 experts x 3 projections) x (A, B)"
    for k, v in expected.items():
        torch.testing.assert_close(published[k], v, rtol=1e-4, atol=1e-6, msg=lambda m: f"{k}: {m}")
    assert float(published["base_model.model.model.layers.0.mlp.experts.2.up_proj.lora_B.weight"].abs().max()) > 0
    config = json.loads((run.weights(steps) / "adapter_config.json").read_text())
    assert config["target_modules"] == ["down_proj", "gate_proj", "q_proj", "up_proj"]

    # Each EP rank's expert adapters and their AdamW state are checkpointed under names of their own.
    shutil.copytree(run.weights(steps), tmp_path / "first")
    launch(run, 2, resume="2")
    again = load_file(str(run.weights(steps) / "adapter_model.safetensors"))
    for k, v in published.items():
        torch.testing.assert_close(again[k], v, rtol=1e-5, atol=1e-7, msg=lambda m: f"{k}: {m}")

    prl(env, "export", str(run.root), "--merged", "-o", str(tmp_path / "merged"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, trained[0].eval()(input_ids=ids).logits,
                                   rtol=1e-4, atol=1e-4)
