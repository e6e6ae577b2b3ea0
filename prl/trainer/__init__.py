"""The trainer role: FSDP2 policy-gradient training from the run directory.

`main(run_dir, resume="latest") -> int` is the entry point (the `prl trainer`
command and `python -m prl.trainer` call it, one process per rank under
torchrun). torch and transformers load only when it is called.

    train.py        `prl trainer`'s entry: read the plan, pick the spec (SFT for an `sft:` plan, else RL), run the engine
    engine.py       the training engine: one FSDP2 step loop every kind of training runs, the kind plugged in as a `Spec`
    rl.py           RL as a spec: policy-gradient steps on the orchestrator's rollouts
    sft.py          SFT as a spec: supervised fine-tuning on conversations
    sft_data.py     SFT data: conversations -> token samples, loss on the assistant's tokens only
    loss.py         the loss: importance-weighted policy gradient, of the kind `training.loss.kind` names
    logprobs.py     token logprobs and entropy from the last hidden states, a chunk of tokens at a time
    attention.py    packed attention: each sample of a micro-batch attends to itself only
    recurrent.py    packed rows through linear-attention / state-space mixers: each sample from a zero state
    config.py       the trainer's view of the plan: model, mesh, training settings
    parallel.py     process group, device meshes, FSDP2 wrapping
    context_parallel.py  context parallelism: a micro-batch's sequence split over the cp ranks (Ulysses)
    moe.py          expert parallelism for transformers' fused-expert MoE blocks
    replay.py       router replay: tokens go to the experts the inference server chose
    float8.py       `trainer.precision: fp8`: the blocks' linear layers in float8
    lora.py         LoRA adapters on the frozen model, published alone in PEFT's layout
    vision.py       vision-language models: the model class, the image encoder, the pixels
    loading.py      the model built on the meta device, sharded, each rank's shards read from safetensors
    weights.py      publishing full weights in Hugging Face layout (weights/step_N + STABLE)
    checkpoint.py   trainer checkpoints (checkpoints/step_N/trainer + STABLE) and the step to resume from
    torchrun.py     `python -m prl.trainer.torchrun`: torchrun, its rendezvous store on the node's address only
    tiny_model.py   a tiny Qwen3-style model and byte-level BPE tokenizer, built in-process (tests, benches)
"""

from __future__ import annotations


def main(run_dir: str, resume: str = "latest") -> int:
    """Train on RUN to its last step; see prl/trainer/train.py (the spec) and prl/trainer/engine.py (the loop)."""
    from prl.trainer.train import main as _main

    return _main(run_dir, resume)


__all__ = ["main"]
