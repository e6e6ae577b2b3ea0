"""Token logprobs and entropy straight from the last hidden states, a chunk of tokens at a time.

The plain way (`prl.trainer.loss.token_logprobs_and_entropy`) takes the model's [T, V] logits, casts them to
fp32, and autograd keeps that tensor and the softmax until the backward: at T = 16k tokens and V = 150k that is
about 10 GiB per copy. Here the output layer runs inside the model's forward (so FSDP2 has its weight gathered,
and a tied embedding stays one parameter) on `chunk` tokens at a time: each chunk's logits are made in the
model's compute dtype, taken to fp32, reduced to the target's logprob and the entropy, and dropped; the
backward recomputes them chunk by chunk. Peak extra memory: a few [chunk, V] fp32 buffers, plus a [V, H] fp32
gradient accumulator for the weight.

Per token t with logits z (fp32), logZ = logsumexp(z), p = softmax(z):

    logp_t = z[target_t] - logZ           H_t = logZ - sum_j p_j z_j
    d logp_t / dz_j = [j = target_t] - p_j
    d H_t / dz_j    = -p_j (log p_j + H_t)

Only models whose causal-LM forward is `logits = lm_head(hidden_states)` with nothing after (no soft-capping, no
logit scale) take this path: `HEAD_ONLY_MODEL_TYPES`; others keep the full logits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

CHUNK_ELEMENTS = {"cpu": 2**24, "cuda": 2**28}
"""Logit elements per chunk, by device: chunk tokens = elements // vocab (at least 16). On CPU 64 MiB of fp32
logits (about 110 tokens at a 150k vocabulary), which keeps a chunk in cache; on a GPU 1 GiB (about 1,770
tokens), enough rows for the output layer's matrix products to run near the GPU's rate: on an H200 at 16k tokens
x 151,936 vocabulary, forward + backward, CPU-sized chunks took 301 ms, these 134 ms, the full logits 138 ms,
with 0.09x the full logits' memory (bench/gpu_kernels.py, docs/trainer.md)."""

HEAD_ONLY_MODEL_TYPES = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "olmo", "olmo2", "olmoe",
    "deepseek_v3", "glm4_moe", "smollm3", "phi3", "idefics3",
})
"""Model types whose causal-LM forward applies `lm_head` to the hidden states and returns that as the logits."""


def chunk_tokens(vocab: int, device_type: str = "cpu") -> int:
    return max(16, CHUNK_ELEMENTS.get(device_type, CHUNK_ELEMENTS["cpu"]) // max(vocab, 1))


class ChunkedLogprobs(torch.autograd.Function):
    """(hidden [T, H], weight [V, H], targets [T]) -> (logp [T], entropy [T]) in fp32, `chunk` tokens at a time."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int):
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logp)
        logz = torch.empty_like(logp)
        for a in range(0, n, chunk):
            z = F.linear(hidden[a:a + chunk], weight).float()
            lz = torch.logsumexp(z, dim=-1)
            logz[a:a + chunk] = lz
            logp[a:a + chunk] = z.gather(-1, targets[a:a + chunk, None]).squeeze(-1) - lz
            entropy[a:a + chunk] = lz - (torch.softmax(z, dim=-1) * z).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, logz, entropy)
        ctx.chunk = chunk
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, logz, entropy = ctx.saved_tensors
        chunk = ctx.chunk
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        for a in range(0, hidden.shape[0], chunk):
            h = hidden[a:a + chunk]
            logp_all = F.linear(h, weight).float() - logz[a:a + chunk, None]
            p = torch.exp(logp_all)
            g_lp, g_h = grad_logp[a:a + chunk, None], grad_entropy[a:a + chunk, None]
            # dL/dz = g_lp ([j = target] - p) - g_h p (log p + H), written in place over logp_all.
            gz = logp_all.add_(entropy[a:a + chunk, None]).mul_(g_h).add_(g_lp).mul_(p).neg_()
            gz.scatter_add_(-1, targets[a:a + chunk, None], g_lp)
            gz = gz.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[a:a + chunk] = gz @ weight
            if grad_weight is not None:  # the product in the compute dtype (fp32 accumulation inside the GEMM),
                grad_weight += (gz.t() @ h).float()  # summed over chunks in fp32: a bf16 GEMM, not an fp32 one
        return grad_hidden, grad_weight.to(weight.dtype) if grad_weight is not None else None, None, None


def chunked_logprobs_and_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                 chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logprob of `targets` [T] and entropy per token, in fp32, from hidden [T, H] and the output weight [V, H]."""
    chunk = chunk or chunk_tokens(weight.shape[0], hidden.device.type)
    return ChunkedLogprobs.apply(hidden, weight, targets.long(), chunk)


def supports_chunked_head(model: torch.nn.Module) -> bool:
    """Whether the model's logits are its `lm_head` (a plain bias-free Linear) applied to the hidden states."""
    head = getattr(model, "lm_head", None)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return model_type in HEAD_ONLY_MODEL_TYPES and isinstance(head, torch.nn.Linear) and head.bias is None


@contextlib.contextmanager
def logprob_head(model: torch.nn.Module, targets: torch.Tensor) -> Iterator[None]:
    """Within: the model's `lm_head` returns [1, T, 2] = (logp of `targets`, entropy) instead of [1, T, V] logits.

    The forward that runs inside sees the head as part of the model (FSDP2 gathers its weight as usual).
    """
    head = model.lm_head

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        logp, entropy = chunked_logprobs_and_entropy(hidden.reshape(-1, hidden.shape[-1]), head.weight, targets)
        # Stacked last: a new tensor, not a view (FSDP2 warns of a root output that is a view).
        return torch.stack([t.reshape(hidden.shape[:-1]) for t in (logp, entropy)], dim=-1)

    head.forward = forward
    try:
        yield
    finally:
        del head.forward  # back to the class's own
