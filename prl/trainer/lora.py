"""LoRA (Hu et al. 2021) on the engine's seam: adapters on the frozen model, published alone in PEFT's layout.

    transform_model  each target nn.Linear (named by the last part of its module name) gets two parameters,
                     lora_A [r, in] and lora_B [out, r], and a forward hook adding
                     (alpha / r) * B @ A @ dropout(x) to its output; every other parameter is frozen.
                     An MoE layer's routed experts (fused [E, ...] parameters, named by their per-expert
                     checkpoint names) get one A and B per expert, added by prl's experts module
                     (`attach_experts`; prl/trainer/moe.py)
    load             the loader fills lora_A / lora_B from `fresh_parameters` (not from the safetensors):
                     A uniform in +-1/sqrt(in) (PEFT's kaiming default), B zero, so step 0 is the base model;
                     each rank computes the full tensor from (seed, name) and keeps its FSDP2 rows
    parameters       the adapters only (the optimizer holds nothing else)
    publish          weights/step_N/ = adapter_model.safetensors + adapter_config.json (PEFT's names:
                     base_model.model.<module>.lora_A.weight, an expert's under its per-expert checkpoint name),
                     through the same STABLE protocol as full weights
    merge            W + (alpha / r) * B @ A: `prl export --merged` writes a plain HF model

Our own and not peft's: peft wraps each layer (`q_proj.base_layer.weight`), which breaks the name-for-name
sharded loading of prl/trainer/loading.py and the FSDP2 layout the engine builds on the meta device; the hook
keeps every base parameter under its checkpoint name, adds two parameters per layer, and needs no new
dependency. The files it writes are PEFT's, which vLLM and `peft.PeftModel.from_pretrained` both read.
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from prl.config.topology import Lora
from prl.errors import ConfigError
from prl.run.rundir import RunDir
from prl.weights.layout import ADAPTER_CONFIG

LEAVES = ("lora_A", "lora_B")
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def is_adapter(name: str) -> bool:
    """Whether a parameter name is one of the adapters' (`...q_proj.lora_A`, an expert's `...experts.w1_lora_A`)."""
    return name.rpartition(".")[2].endswith(LEAVES)


def _delta(module: nn.Linear, args: tuple, output: torch.Tensor) -> torch.Tensor:
    x = args[0]
    if module.lora_dropout > 0:
        x = F.dropout(x, module.lora_dropout, module.training)
    return output + F.linear(F.linear(x, module.lora_A), module.lora_B) * module.lora_scale


def _init(seed: int):
    """The full initial value of one adapter parameter from (seed, its name): the same on every rank."""
    def fresh(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name.endswith("lora_B"):
            return torch.zeros(shape)
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        bound = 1 / math.sqrt(shape[1])
        return torch.rand(shape, generator=g) * (2 * bound) - bound
    return fresh


def attach(model: nn.Module, lora: Lora, seed: int) -> list[str]:
    """Add an adapter to every target linear layer of the (meta-device) model's language model (a text model's
    every layer) and freeze the rest; returns the adapted modules' names. ConfigError when no layer matches
    `target_modules`."""
    from prl.trainer.vision import language_model

    targets = set(lora.target_modules)
    # A vision-language model's adapters go on its language model alone: what vLLM applies them to (its LoRA
    # manager wraps the tower and connector only with --enable-tower-connector-lora).
    text = {id(m) for m in language_model(model).modules()}
    adapted = attach_experts(model, lora, seed, text)
    for name, m in model.named_modules():
        if id(m) in text and type(m) is nn.Linear and name.rpartition(".")[2] in targets:
            device = m.weight.device
            m.lora_A = nn.Parameter(torch.empty(lora.rank, m.in_features, device=device))
            m.lora_B = nn.Parameter(torch.empty(m.out_features, lora.rank, device=device))
            m.lora_scale, m.lora_dropout = lora.scale, lora.dropout
            m.fresh_parameters = dict.fromkeys(LEAVES, _init(seed))
            m.register_forward_hook(_delta)
            adapted.append(name)
    found = {n.rpartition(".")[2] for n in adapted}
    missing = sorted(targets - found)
    if missing:
        have = sorted({n.rpartition(".")[2] for n, m in model.named_modules()
                       if id(m) in text and type(m) is nn.Linear} | set(expert_projections(model)))
        raise ConfigError(f"model.lora.target_modules: {type(model).__name__} has no linear layer named "
                          f"{', '.join(missing)}; its linear layers are {', '.join(have)}")
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
    return adapted


def expert_projections(model: nn.Module) -> tuple[str, ...]:
    """The names LoRA targets the routed experts by: their projections' on-disk names (gate_proj, up_proj,
    down_proj; Mixtral's w1, w3, w2). Empty for a model without experts, or whose checkpoints store them fused
    (GPT-OSS: transposed, biased, gate and up interleaved; no per-expert adapter maps onto that)."""
    from prl.trainer.moe import disk_layout, expert_modules

    return (disk_layout(model).split or ()) if expert_modules(model) else ()


def _expert_init(seed: int, disk_prefix: str, part: str, leaf: str, experts: nn.Module):
    """The initial value of one expert adapter parameter [E_local, ...]: each expert's as `_init` gives the
    per-expert layer `{disk_prefix}.{e}.{part}` (its PEFT name), so any ep degree starts from the same adapter."""
    dense = _init(seed)

    def fresh(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        first = experts.first
        return torch.stack([dense(f"{disk_prefix}.{first + e}.{part}.{leaf}", shape[1:]) for e in range(shape[0])])
    return fresh


def attach_experts(model: nn.Module, lora: Lora, seed: int, text: set[int]) -> list[str]:
    """Adapters on the routed experts of the language model (modules in `text`) whose projections are targeted
    (`expert_projections`): each targeted projection `p` of expert e gets A [r, in] and B [out, r], held for all
    of a module's experts as `{p}_lora_A` [E_local, r, in] and `{p}_lora_B` [E_local, out, r] (sharded along E
    under EP, like the experts). transformers' experts modules (ep=1) become prl's ExpertParallelExperts with
    every expert (prl/trainer/moe.py), whose projections add the update. Returns `<experts>.<p>` per adapter."""
    from prl.trainer.moe import ExpertParallelExperts, disk_layout, disk_name, is_fused_experts

    targets = set(lora.target_modules)
    projections = expert_projections(model)
    if not targets & set(projections):
        return []
    gate, up, down = projections
    wanted = {"gate_up_proj": tuple(p if p in targets else "" for p in (gate, up)),
              "down_proj": (down if down in targets else "",)}
    wanted = {fused: parts for fused, parts in wanted.items() if any(parts)}
    layout, adapted = disk_layout(model), []
    for name, m in [(n, m) for n, m in model.named_modules() if id(m) in text and is_fused_experts(m)]:
        if not isinstance(m, ExpertParallelExperts):
            parent, _, attr = name.rpartition(".")
            m = ExpertParallelExperts(m, 1, 0, None)
            setattr(model.get_submodule(parent), attr, m)
        m.adapters, m.lora_scale, m.lora_dropout = wanted, lora.scale, lora.dropout
        m.fresh_parameters = {}
        for fused, parts in wanted.items():
            w = getattr(m, fused)  # [E_local, out, in]: split layouts are never transposed (disk_layout)
            shapes = {"lora_A": (lora.rank, w.shape[2]), "lora_B": (w.shape[1] // len(parts), lora.rank)}
            for p in filter(None, parts):
                for leaf, shape in shapes.items():
                    setattr(m, f"{p}_{leaf}", nn.Parameter(torch.empty(m.num_local, *shape, device=w.device)))
                    m.fresh_parameters[f"{p}_{leaf}"] = _expert_init(seed, disk_name(layout, name), p, leaf, m)
                adapted.append(f"{name}.{p}")
    return adapted


def adapter_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for name, p in model.named_parameters() if is_adapter(name)]


def adapter_state(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Collective: every adapter tensor in full, on CPU, in `dtype`, under PEFT's names (every rank). An expert
    adapter is gathered over its EP group and written per expert, under the checkpoint's per-expert name:
    `...mlp.experts.3.gate_proj.lora_A.weight` (what vLLM reads for a MoE layer's LoRA)."""
    from prl.trainer.moe import disk_layout, disk_name, gather_experts

    layout, modules, out = disk_layout(model), dict(model.named_modules()), {}
    for name, p in model.named_parameters():
        if not is_adapter(name):
            continue
        full = p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()
        prefix, _, leaf = name.rpartition(".")
        if leaf in LEAVES:
            out[f"{PEFT_PREFIX}{name}.weight"] = full.to(dtype).cpu().contiguous()
            continue
        experts = modules[prefix]
        if experts.ep > 1:
            full = gather_experts(full, experts.ep, experts.group)
        part, _, ab = leaf.rpartition("_lora_")
        base = disk_name(layout, prefix)
        out.update({f"{PEFT_PREFIX}{base}.{e}.{part}.lora_{ab}.weight": t.to(dtype).cpu().contiguous()
                    for e, t in enumerate(full)})
    return out


def adapter_config(lora: Lora, modules: list[str], base: str) -> dict:
    """PEFT's adapter_config.json for this adapter (what vLLM and peft read)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "r": lora.rank, "lora_alpha": lora.alpha if lora.alpha is not None else lora.rank,
        "lora_dropout": lora.dropout, "target_modules": sorted({m.rpartition(".")[2] for m in modules}),
        "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "modules_to_save": None,
        "use_rslora": False, "use_dora": False,
    }


def publish_adapter(run: RunDir, step: int, model: nn.Module, lora: Lora, base: str, dtype: torch.dtype,
                    is_main: bool) -> Path:
    """Collective: weights/step_N as a PEFT adapter directory, published atomically by rank 0."""
    from safetensors.torch import save_file

    state = adapter_state(model, dtype)
    dest = run.weights(step)
    if is_main:
        modules = sorted({k.removeprefix(PEFT_PREFIX).rpartition(".lora_")[0] for k in state})

        def write(tmp: Path) -> None:
            save_file(state, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
            (tmp / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(lora, modules, base), indent=2) + "\n")

        run.publish_dir(dest, write, step=step)
    return dest


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def merged_state(base: dict[str, torch.Tensor], adapter_dir: str | Path) -> dict[str, torch.Tensor]:
    """The base model's tensors (HF names) with the adapter in `adapter_dir` merged: W + (alpha / r) * B @ A."""
    from safetensors.torch import load_file

    config = json.loads((Path(adapter_dir) / ADAPTER_CONFIG).read_text())
    scale = config["lora_alpha"] / config["r"]
    tensors = load_file(str(Path(adapter_dir) / ADAPTER_WEIGHTS))
    out = dict(base)
    for key, a in tensors.items():
        if ".lora_A." not in key:
            continue
        module = key.removeprefix(PEFT_PREFIX).rpartition(".lora_A.")[0]
        b = tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"]
        w = out[f"{module}.weight"]
        out[f"{module}.weight"] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
    return out


def export(run: RunDir, step: int | None, out: Path, merged: bool) -> Path:
    """Write a published weights step to `out` as a model of its own: as published (an adapter, or a whole model),
    or with `merged` a LoRA step merged into its base model (a plain Hugging Face directory that transformers and
    vLLM load). `step` None: the newest. ConfigError when there is no such step or `out` exists."""
    import shutil

    from prl.planner.model import Plan
    from prl.run.rundir import MARKER, is_stable
    from prl.trainer.loading import weight_map
    from prl.trainer.weights import write_hf_dir

    step = run.latest_stable("weights") if step is None else step
    if step is None or not is_stable(run.weights(step)):
        raise ConfigError(f"{run.root} has no published weights step {'' if step is None else step} "
                          f"(published: {run.stable_steps('weights') or 'none'})")
    if out.exists():
        raise ConfigError(f"{out} exists; export writes a new directory")
    src = run.weights(step)
    if not merged:
        shutil.copytree(src, out, ignore=shutil.ignore_patterns(MARKER))
        return out
    if not is_adapter_dir(src):
        raise ConfigError(f"{src} is a whole model (the run has no model.lora): export it without --merged")
    from safetensors.torch import load_file

    base = Plan.read(run).settings().model.path
    state: dict[str, torch.Tensor] = {}
    for file in sorted(set(weight_map(base).values())):
        state.update(load_file(str(file)))
    dtype = next(iter(state.values())).dtype
    write_hf_dir(out, merged_state(state, src), base, dtype)
    return out
