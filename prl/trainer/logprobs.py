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

With `trainer.compile` the per-chunk arithmetic is compiled (`fused_arithmetic`): eager mode runs about a dozen
ops per chunk, each reading or writing a [chunk, V] fp32 tensor (a GiB on a GPU), where the compiled forward
reads the chunk's logits for one max and one pass of sums and the backward turns them into dL/dz in one
elementwise kernel; no fp32 [chunk, V] buffer is made.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

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


def chunk_stats(z: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A chunk's logits z [C, V] (the compute dtype) -> (logZ, logp of the targets, entropy) [C], in fp32."""
    z = z.float()
    lz = torch.logsumexp(z, dim=-1)
    return lz, z.gather(-1, targets[:, None]).squeeze(-1) - lz, lz - (torch.softmax(z, dim=-1) * z).sum(-1)


def chunk_logits_grad(z: torch.Tensor, logz: torch.Tensor, entropy: torch.Tensor, grad_logp: torch.Tensor,
                      grad_entropy: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """dL/dz [C, V] in z's dtype: g_lp ([j = target] - p) - g_h p (log p + H), written in place over one fp32
    [C, V] buffer."""
    logp_all = z.float() - logz[:, None]
    p = torch.exp(logp_all)
    gz = logp_all.add_(entropy[:, None]).mul_(grad_entropy[:, None]).add_(grad_logp[:, None]).mul_(p).neg_()
    return gz.scatter_add_(-1, targets[:, None], grad_logp[:, None]).to(z.dtype)


def _fusable_stats(z: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`chunk_stats` as one max and one pass of sums over z, for the compiler to fuse (no [C, V] buffer)."""
    z = z.float()
    m = z.amax(dim=-1, keepdim=True)
    e = torch.exp(z - m)
    s = e.sum(-1)
    lz = m.squeeze(-1) + torch.log(s)
    return lz, z.gather(-1, targets[:, None]).squeeze(-1) - lz, lz - (e * z).sum(-1) / s


def _fusable_logits_grad(z: torch.Tensor, logz: torch.Tensor, entropy: torch.Tensor, grad_logp: torch.Tensor,
                         grad_entropy: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """`chunk_logits_grad` as one elementwise expression (the target's term a comparison, not a scatter)."""
    logp_all = z.float() - logz[:, None]
    hit = torch.arange(z.shape[-1], device=z.device) == targets[:, None]
    gz = torch.where(hit, grad_logp[:, None], 0.0) - torch.exp(logp_all) * (
        grad_logp[:, None] + grad_entropy[:, None] * (logp_all + entropy[:, None]))
    return gz.to(z.dtype)


@functools.cache
def fused_arithmetic() -> tuple[Callable, Callable]:
    """`chunk_stats` and `chunk_logits_grad` compiled (`trainer.compile`): each a kernel or two that reads a
    chunk's logits once or twice, where eager mode runs a dozen ops, each over a [C, V] fp32 tensor. The row
    count is dynamic from the first call (a step's last chunk is shorter), the vocabulary static (a kernel
    specialized to it; another vocabulary compiles its own), so each compiles once per dtype and vocabulary
    (and once more for a chunk of one row, which the compiler specializes)."""

    def rows_dynamic(fn: Callable) -> Callable:
        compiled = torch.compile(fn)

        def call(*tensors: torch.Tensor):
            for t in tensors:
                torch._dynamo.maybe_mark_dynamic(t, 0)
                if t.dim() == 2:
                    torch._dynamo.mark_static(t, 1)
            return compiled(*tensors)

        return call

    return rows_dynamic(_fusable_stats), rows_dynamic(_fusable_logits_grad)


class ChunkedLogprobs(torch.autograd.Function):
    """(hidden [T, H], weight [V, H], targets [T]) -> (logp [T], entropy [T]) in fp32, `chunk` tokens at a time."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int, fused: bool):
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logp)
        logz = torch.empty_like(logp)
        stats = fused_arithmetic()[0] if fused else chunk_stats
        for a in range(0, n, chunk):
            logz[a:a + chunk], logp[a:a + chunk], entropy[a:a + chunk] = stats(
                F.linear(hidden[a:a + chunk], weight), targets[a:a + chunk])
        ctx.save_for_backward(hidden, weight, targets, logz, entropy)
        ctx.chunk, ctx.fused = chunk, fused
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, logz, entropy = ctx.saved_tensors
        chunk = ctx.chunk
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        logits_grad = fused_arithmetic()[1] if ctx.fused else chunk_logits_grad
        for a in range(0, hidden.shape[0], chunk):
            rows = slice(a, a + chunk)
            h = hidden[rows]
            gz = logits_grad(F.linear(h, weight), logz[rows], entropy[rows], grad_logp[rows], grad_entropy[rows],
                             targets[rows])
            if grad_hidden is not None:
                grad_hidden[rows] = gz @ weight
            if grad_weight is not None:  # the product in the compute dtype (fp32 accumulation inside the GEMM),
                grad_weight += (gz.t() @ h).float()  # summed over chunks in fp32: a bf16 GEMM, not an fp32 one
        return grad_hidden, grad_weight.to(weight.dtype) if grad_weight is not None else None, None, None, None


def chunked_logprobs_and_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                 chunk: int | None = None, fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """logprob of `targets` [T] and entropy per token, in fp32, from hidden [T, H] and the output weight [V, H];
    `fused`: the per-chunk arithmetic compiled (`fused_arithmetic`)."""
    chunk = chunk or chunk_tokens(weight.shape[0], hidden.device.type)
    return ChunkedLogprobs.apply(hidden, weight, targets.long(), chunk, fused)


def supports_chunked_head(model: torch.nn.Module) -> bool:
    """Whether the model's logits are its `lm_head` (a plain bias-free Linear) applied to the hidden states."""
    head = getattr(model, "lm_head", None)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return model_type in HEAD_ONLY_MODEL_TYPES and isinstance(head, torch.nn.Linear) and head.bias is None


@contextlib.contextmanager
def logprob_head(model: torch.nn.Module, targets: torch.Tensor, fused: bool = False,
                 temperature: float = 1.0) -> Iterator[None]:
    """Within: the model's `lm_head` returns [1, T, 2] = (logp of `targets`, entropy) instead of [1, T, V] logits,
    of the logits / `temperature` (the head has no bias: the hidden states / `temperature`).

    The forward that runs inside sees the head as part of the model (FSDP2 gathers its weight as usual).
    """
    head = model.lm_head

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        if temperature != 1.0:  # in bf16 one rounding more, of the size of the bf16 logits' own (exact for 2^k)
            hidden = hidden / temperature
        logp, entropy = chunked_logprobs_and_entropy(hidden.reshape(-1, hidden.shape[-1]), head.weight, targets,
                                                     fused=fused)
        # Stacked last: a new tensor, not a view (FSDP2 warns of a root output that is a view).
        return torch.stack([t.reshape(hidden.shape[:-1]) for t in (logp, entropy)], dim=-1)

    head.forward = forward
    try:
        yield
    finally:
        del head.forward  # back to the class's own
