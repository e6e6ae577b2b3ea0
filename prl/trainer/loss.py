"""The trainer's loss: importance-weighted policy gradient, in the kind `training.loss.kind` names.

For every token t that the inference engine sampled (loss_mask m_t = 1), with
the trainer's logprob logp_t = log pi_theta(x_t | x_<t), the engine's
sampling logprob q_t, the advantage A_t (its sample's), and [lo, hi] the
ratio bounds (`Loss.bounds()`):

    r_t    = exp(logp_t - q_t)                       importance ratio trainer / engine
    sg()   stops gradients

    token, mode "mask":  keep_t = m_t [lo <= r_t <= hi]   pg_t = -keep_t r_t A_t    gradient -keep_t r_t A_t
    token, mode "clip":  c_t = clamp(r_t, lo, hi)         pg_t = -m_t sg(c_t / r_t) r_t A_t   gradient -m_t c_t A_t
          kl_t = keep_t (r_t - 1 - log r_t)  (k3 estimate of KL(pi_engine || pi_theta), unbiased under the
                                             engine's samples; mode "clip": keep_t = m_t)
    gspo (Zheng et al. 2025, GSPO): per sample i with n_i loss tokens,
          s_i    = exp((1/n_i) sum_{t in i} m_t log r_t)          sequence ratio: geometric mean of r_t
          clip_i = (A > 0 and s_i > hi) or (A < 0 and s_i < lo)   PPO's pessimistic min, at sequence level
          pg_t   = -m_t A_t (sg(clamp(s_i, lo, hi)) if clip_i else s_i)
          d/dlogp_t of sum_{t' in i} pg_t' = -A s_i (unclipped): each token's gradient is s_i A grad(logp_t)
          kl_t   = m_t (r_t - 1 - log r_t)
    cispo (MiniMax-M1, 2025): c_t = clamp(r_t, lo, hi)
          pg_t   = -m_t sg(c_t) A_t logp_t                        gradient -m_t c_t A_t, as mode "clip"
          kl_t   = m_t (r_t - 1 - log r_t)
    dppo (prime-rl's default loss; DPPO, arXiv 2602.04879): d_t = exp(logp_t) - exp(q_t), the change
          of the token's probability; [dl, dh] = `Loss.prob_deltas()`
          masked_t = d_t > dh if A_t > 0 else d_t < -dl
          pg_t   = -m_t (1 - masked_t) r_t A_t
          kl_t   = m_t (log r_t)^2                                (prime-rl's KL term)

    L      = (1 / N) * sum_t (pg_t + kl_coef * kl_t + kl_ref_coef * kr_t)

On-policy distillation and a frozen reference (the logprobs of the sampled tokens come in the batch,
scored by the `teacher:` / `reference:` servers, docs/orchestrator.md):

    distillation (`distill_coef` c > 0): every kind above trains on the advantage
          A_t <- reward_coef * A_t + c * m_t (T_t - q_t)            T_t: the teacher's logprob of the token
          the per-token reverse KL to the teacher as a reward (Agarwal et al. 2024, GKD; Thinking Machines'
          "On-Policy Distillation", 2025): at r_t = 1 the gradient is that of c * KL(pi_theta || pi_teacher)
    reference KL (`kl_ref_coef` > 0): d_t = R_t - logp_t          R_t: the reference model's logprob
          kr_t   = m_t (exp(d_t) - d_t - 1)                       k3 estimate of KL(pi_theta || pi_ref)
                                                                  (DeepSeekMath's GRPO), gradient m_t (1 - exp(d_t))

N is the number of loss tokens (m_t = 1) of the whole step, summed over all
micro-batches and all data-parallel ranks, counted before ratio masking:
every sampled token weighs the same whatever rank or micro-batch it lands on,
and masking a token removes its gradient without re-weighting the others.
GSPO's sequences therefore weigh by their loss tokens (sum_i n_i l_i / N,
verl's token-mean aggregation), where the paper averages sequences (1/G).
The trainer all-reduces N once per step; each micro-batch's loss is its
partial sum divided by N, so summing micro-batches (and gradients across
ranks) gives exactly L. GSPO needs each sample whole on one rank (the
planner refuses it with context parallelism, which splits samples).

A loss of your own (`training.loss.import_path: pkg.mod:fn`, `args`) is
called as fn(inputs: LossInputs, **args) and returns this micro-batch's share
of the step's loss, a scalar tensor (the built-ins return their sum / N).

Entropy is that of the trainer's next-token distribution at the positions
that produced loss tokens. All statistics are returned as sums/min/max so
they can be reduced across micro-batches and ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from prl.config.topology import Loss
from prl.errors import ConfigError
from prl.plugins import load_function
from prl.states import Role


@dataclass(frozen=True)
class LossInputs:
    """What every loss gets for one micro-batch on one rank: [T] tensors over the same positions."""

    logprobs: torch.Tensor
    """The trainer's logprob of each position's target token (gradients flow through it)."""
    inference_logprobs: torch.Tensor
    """The engine's sampling logprob of the same token (0 where loss_mask is 0)."""
    advantages: torch.Tensor
    """The advantage of the token's sample."""
    loss_mask: torch.Tensor
    """1 where the engine sampled the token (trained on)."""
    sample_ids: torch.Tensor
    """Which packed sample each position belongs to (0, 1, ... in order within the micro-batch; with context
    parallelism, within this rank's chunk of it)."""
    total_loss_tokens: float
    """N: loss tokens of the whole step, all micro-batches and ranks."""
    teacher_logprobs: torch.Tensor | None = None
    """The teacher's logprob of the same token (0 where loss_mask is 0); None without a `teacher:`."""
    reference_logprobs: torch.Tensor | None = None
    """The frozen reference model's logprob of the same token; None without a `reference:`."""


def token_logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logprob of `targets` [T] under `logits` [T, V] and each row's entropy, in fp32."""
    logits = logits.float()
    logz = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1) - logz
    probs = torch.softmax(logits, dim=-1)
    entropy = logz - (probs * logits).sum(-1)
    return logp, entropy


def sample_ids_of(position_ids: torch.Tensor) -> torch.Tensor:
    """Each position's packed sample (0, 1, ...): positions restart at 0 for every sample (prl/run/batch.py).

    A context-parallel chunk that starts inside a sample numbers that part 0 too: ids are the chunk's own.
    """
    starts = torch.cumsum((position_ids == 0).long(), 0)
    return starts - starts[:1]


def policy_loss(
    logp: torch.Tensor,
    inference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: Loss,
    total_loss_tokens: int | float,
    entropy: torch.Tensor | None = None,
    sample_ids: torch.Tensor | None = None,
    teacher_logprobs: torch.Tensor | None = None,
    reference_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """This micro-batch's share of L (see module doc) and its statistics (sums, min, max).

    All inputs are [T] tensors over the same tokens; `total_loss_tokens` is N; `sample_ids` (kind gspo)
    says which sample each token belongs to; `teacher_logprobs` (`distill_coef` > 0) and
    `reference_logprobs` (`kl_ref_coef` > 0) are the scoring servers' logprobs of the same tokens.
    """
    m = loss_mask.to(logp.dtype)
    is_loss = loss_mask.bool()
    log_ratio = masked_log_ratio(logp, inference_logprobs, loss_mask)
    ratio = torch.exp(log_ratio)
    adv, scored = scored_advantages(advantages.to(logp.dtype), logp, inference_logprobs, m, cfg, teacher_logprobs)
    if cfg.kind == "gspo":
        if sample_ids is None:
            raise ValueError("kind gspo needs sample_ids: which sample each token belongs to")
        pg, kl, excluded, shown_ratio = _gspo(ratio, log_ratio, m, adv, cfg, sample_ids)
    elif cfg.kind == "cispo":
        pg, kl, excluded, shown_ratio = _cispo(logp, ratio, log_ratio, m, adv, cfg)
    elif cfg.kind == "dppo":
        pg, kl, excluded, shown_ratio = _dppo(logp, inference_logprobs.to(logp.dtype), ratio, log_ratio, m, adv, cfg)
    else:
        pg, kl, excluded, shown_ratio = _token(ratio, log_ratio, m, adv, cfg)
    excluded = excluded & is_loss
    n = float(max(total_loss_tokens, 1))
    total = pg.sum() + cfg.kl_coef * kl.sum()
    if cfg.kl_ref_coef > 0:
        kr = reference_kl(logp, reference_logprobs, m)
        total = total + cfg.kl_ref_coef * kr.sum()
        scored["ref_kl_sum"] = float(kr.detach().sum())
    return total / n, {
        "loss_sum": float(total.detach()),
        "masked_tokens": float(excluded.sum()),
        "kl_sum": float((kl.detach() * m).sum()),
        **scored,
        **_token_stats(shown_ratio, loss_mask, entropy),
    }


def scored_advantages(adv: torch.Tensor, logp: torch.Tensor, inference_logprobs: torch.Tensor, m: torch.Tensor,
                      cfg: Loss, teacher_logprobs: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, float]]:
    """The advantage every kind trains on: the reward's, plus `distill_coef` times the teacher's per-token
    reverse-KL reward T_t - q_t (module doc); with the statistic `teacher_kl_sum`, sum of logp_t - T_t (the
    trainer's own estimate of KL(pi_theta || pi_teacher) on the sampled tokens)."""
    if cfg.distill_coef <= 0:
        return adv, {}
    if teacher_logprobs is None:
        raise ValueError("training.loss.distill_coef needs the teacher's logprobs: the batch has none")
    teacher = teacher_logprobs.to(logp.dtype)
    q = inference_logprobs.to(logp.dtype)
    shaped = cfg.reward_coef * adv + cfg.distill_coef * m * (teacher - q)
    return shaped, {"teacher_kl_sum": float(((logp.detach() - teacher) * m).sum())}


def reference_kl(logp: torch.Tensor, reference_logprobs: torch.Tensor | None, m: torch.Tensor) -> torch.Tensor:
    """k3 estimate of KL(pi_theta || pi_ref) per loss token: exp(d) - d - 1 with d = R_t - logp_t (module doc)."""
    if reference_logprobs is None:
        raise ValueError("training.loss.kl_ref_coef needs the reference model's logprobs: the batch has none")
    d = torch.where(m.bool(), reference_logprobs.to(logp.dtype) - logp, torch.zeros_like(logp))
    return m * (torch.exp(d) - d - 1.0)


def _token(ratio, log_ratio, m, adv, cfg: Loss):
    """Today's token-level ratio, masked or clipped at [lo, hi]."""
    low, high = cfg.bounds()
    r = ratio.detach()
    if cfg.mode == "mask":
        in_bounds = (r >= low) & (r <= high)
        keep = m * in_bounds.to(m.dtype)
        coef = torch.ones_like(r)
        excluded = ~in_bounds
    else:
        keep = m
        clamped = r.clamp(low, high)
        coef = clamped / r
        excluded = clamped != r
    pg = -keep * coef * ratio * adv
    return pg, keep * (ratio - 1.0 - log_ratio), excluded, r


def masked_log_ratio(logp: torch.Tensor, inference_logprobs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """log r_t = logp_t - q_t on loss tokens, 0 elsewhere (only their ratios mean anything; exp() cannot
    overflow on the others)."""
    log_ratio = logp - inference_logprobs.to(logp.dtype)
    return torch.where(loss_mask.bool(), log_ratio, torch.zeros_like(log_ratio))


def _gspo(ratio, log_ratio, m, adv, cfg: Loss, sample_ids):
    """One ratio per sample: the geometric mean of its loss tokens' ratios, clipped PPO-style per sample."""
    low, high = cfg.bounds()
    ids = sample_ids.long()
    count = max(ids.numel(), 1)  # at most one sample per position; no host sync to find the real count
    tokens = torch.zeros(count, dtype=m.dtype, device=m.device).index_add(0, ids, m)
    log_sum = torch.zeros(count, dtype=m.dtype, device=m.device).index_add(0, ids, m * log_ratio)
    seq_ratio = torch.exp(log_sum / tokens.clamp(min=1.0))[ids]  # s_i on each of its tokens, with gradient
    s = seq_ratio.detach()
    clipped = ((adv > 0) & (s > high)) | ((adv < 0) & (s < low))
    weight = torch.where(clipped, s.clamp(low, high), seq_ratio)
    return -m * weight * adv, m * (ratio - 1.0 - log_ratio), clipped, s


def _cispo(logp, ratio, log_ratio, m, adv, cfg: Loss):
    """The clipped ratio as a stop-gradient weight on the logprob: every token keeps a gradient."""
    low, high = cfg.bounds()
    r = ratio.detach()
    clamped = r.clamp(low, high)
    return -m * clamped * adv * logp, m * (ratio - 1.0 - log_ratio), clamped != r, r


def _dppo(logp, q, ratio, log_ratio, m, adv, cfg: Loss):
    """Tokens whose probability moved too far in the advantage's direction are masked (prime-rl's default)."""
    low, high = cfg.prob_deltas()
    delta = (torch.exp(logp) - torch.exp(q)).detach()
    masked = torch.where(adv > 0, delta > high, delta < -low)
    keep = m * (~masked).to(m.dtype)
    return -keep * ratio * adv, m * log_ratio * log_ratio, masked, ratio.detach()


def _token_stats(ratio: torch.Tensor, loss_mask: torch.Tensor, entropy: torch.Tensor | None) -> dict[str, float]:
    """Sums, min and max over the loss tokens of the ratio the loss used, and the entropy sum."""
    m = loss_mask.to(ratio.dtype)
    is_loss = loss_mask.bool()
    r = ratio.detach()
    big = torch.finfo(r.dtype).max
    return {
        "loss_tokens": float(m.sum()),
        "ratio_sum": float((r * m).sum()),
        "ratio_min": float(torch.where(is_loss, r, torch.full_like(r, big)).min()) if r.numel() else big,
        "ratio_max": float(torch.where(is_loss, r, torch.full_like(r, -big)).max()) if r.numel() else -big,
        "entropy_sum": float((entropy.detach() * m).sum()) if entropy is not None else 0.0,
    }


CustomLoss = Callable[..., torch.Tensor]


def load_custom_loss(cfg: Loss) -> CustomLoss | None:
    """The function `training.loss.import_path` names, checked against `args` (None: a built-in loss).

    Called by the trainer at start; a path that does not load is a ConfigError naming the setting.
    """
    if cfg.import_path is None:
        return None
    return load_function(cfg.import_path, "training.loss.import_path", cfg.args, ("inputs",), Role.TRAINER)


def custom_loss(fn: CustomLoss, inputs: LossInputs, cfg: Loss, entropy: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """This micro-batch's share of the step's loss from a loss of your own, and the token statistics."""
    loss = fn(inputs, **cfg.args)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ConfigError(f"training.loss.import_path ({cfg.import_path}) returned {type(loss).__name__}, not a "
                          f"scalar tensor: return this micro-batch's share of the step's loss (its sum / "
                          f"inputs.total_loss_tokens)")
    r = torch.exp(masked_log_ratio(inputs.logprobs, inputs.inference_logprobs, inputs.loss_mask))
    return loss.reshape(()), {"loss_sum": float(loss.detach()) * float(max(inputs.total_loss_tokens, 1)),
                              **_token_stats(r, inputs.loss_mask, entropy)}


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
