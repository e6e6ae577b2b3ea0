"""The trainer's loss: token-level importance-weighted policy gradient.

For every token t that the inference engine sampled (loss_mask m_t = 1), with
the trainer's logprob logp_t = log pi_theta(x_t | x_<t), the engine's
sampling logprob q_t, and the advantage A_t:

    r_t    = exp(logp_t - q_t)                       importance ratio trainer / engine
    mode "mask":  keep_t = m_t * [ratio_low <= r_t <= ratio_high]      c_t = r_t
    mode "clip":  keep_t = m_t                                          c_t = clamp(r_t, ratio_low, ratio_high)
    pg_t   = - keep_t * sg(c_t / r_t) * r_t * A_t    value -c_t A_t, gradient -c_t A_t grad(logp_t)
    kl_t   = keep_t * (r_t - 1 - log r_t)            k3 estimate of KL(pi_engine || pi_theta),
                                                     unbiased under the engine's samples
    L      = (1 / N) * sum_t (pg_t + kl_coef * kl_t)

sg() stops gradients. N is the number of loss tokens (m_t = 1) of the whole
step, summed over all micro-batches and all data-parallel ranks, counted
before ratio masking: every sampled token weighs the same whatever rank or
micro-batch it lands on, and masking a token removes its gradient without
re-weighting the others. The trainer all-reduces N once per step; each
micro-batch's loss is its partial sum divided by N, so summing micro-batches
(and gradients across ranks) gives exactly L.

Entropy is that of the trainer's next-token distribution at the positions
that produced loss tokens. All statistics are returned as sums/min/max so
they can be reduced across micro-batches and ranks.
"""

from __future__ import annotations

import torch

from prl.config.topology import Loss


def token_logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logprob of `targets` [T] under `logits` [T, V] and each row's entropy, in fp32."""
    logits = logits.float()
    logz = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1) - logz
    probs = torch.softmax(logits, dim=-1)
    entropy = logz - (probs * logits).sum(-1)
    return logp, entropy


def policy_loss(
    logp: torch.Tensor,
    inference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: Loss,
    total_loss_tokens: int | float,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """This micro-batch's share of L (see module doc) and its statistics (sums, min, max).

    All inputs are [T] tensors over the same tokens; `total_loss_tokens` is N.
    """
    m = loss_mask.to(logp.dtype)
    is_loss = loss_mask.bool()
    log_ratio = logp - inference_logprobs.to(logp.dtype)
    # Only loss tokens' ratios are meaningful; zero the others so exp() cannot overflow.
    log_ratio = torch.where(is_loss, log_ratio, torch.zeros_like(log_ratio))
    ratio = torch.exp(log_ratio)
    r = ratio.detach()
    if cfg.mode == "mask":
        in_bounds = (r >= cfg.ratio_low) & (r <= cfg.ratio_high)
        keep = m * in_bounds.to(m.dtype)
        coef = torch.ones_like(r)
        excluded = is_loss & ~in_bounds
    else:
        keep = m
        clamped = r.clamp(cfg.ratio_low, cfg.ratio_high)
        coef = clamped / r
        excluded = is_loss & (clamped != r)
    pg = -keep * coef * ratio * advantages.to(logp.dtype)
    kl = keep * (ratio - 1.0 - log_ratio)
    n = float(max(total_loss_tokens, 1))
    loss = (pg.sum() + cfg.kl_coef * kl.sum()) / n

    big = torch.finfo(r.dtype).max
    stats = {
        "loss_sum": float((pg.sum() + cfg.kl_coef * kl.sum()).detach()),
        "loss_tokens": float(m.sum()),
        "masked_tokens": float(excluded.sum()),
        "ratio_sum": float((r * m).sum()),
        "ratio_min": float(torch.where(is_loss, r, torch.full_like(r, big)).min()) if r.numel() else big,
        "ratio_max": float(torch.where(is_loss, r, torch.full_like(r, -big)).max()) if r.numel() else -big,
        "kl_sum": float((kl.detach() * m).sum()),
        "entropy_sum": float((entropy.detach() * m).sum()) if entropy is not None else 0.0,
    }
    return loss, stats


def merge_stats(parts: list[dict[str, float]]) -> dict[str, float]:
    """Combine micro-batch statistics: sums add, min/max fold."""
    out: dict[str, float] = {}
    for p in parts:
        for k, v in p.items():
            if k not in out:
                out[k] = v
            elif k.endswith("_min"):
                out[k] = min(out[k], v)
            elif k.endswith("_max"):
                out[k] = max(out[k], v)
            else:
                out[k] += v
    return out


def nll_loss(logp: torch.Tensor, loss_mask: torch.Tensor, total_loss_tokens: int | float,
             entropy: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """SFT: this micro-batch's share of the token-mean negative log-likelihood over the step's N loss tokens
    (`total_loss_tokens`, all ranks), and its statistics (sums)."""
    m = loss_mask.to(logp.dtype)
    nll = -(logp * m).sum()
    stats = {
        "loss_sum": float(nll.detach()),
        "loss_tokens": float(m.sum()),
        "entropy_sum": float((entropy.detach() * m).sum()) if entropy is not None else 0.0,
    }
    return nll / float(max(total_loss_tokens, 1)), stats
