"""A loss of one's own for tests/test_loss.py, loaded by `training.loss.import_path: tests.custom_loss:scaled_pg`."""

from __future__ import annotations

import torch

CALLS: list[tuple[object, dict]] = []
"""(inputs, args) of every call, for the test to inspect."""

NOT_A_FUNCTION = 3


def scaled_pg(inputs, scale: float) -> torch.Tensor:
    """scale * plain policy gradient (-A logp per loss token), this micro-batch's share of the step's mean."""
    CALLS.append((inputs, {"scale": scale}))
    m = inputs.loss_mask.to(inputs.logprobs.dtype)
    return -scale * (m * inputs.advantages * inputs.logprobs).sum() / inputs.total_loss_tokens


def per_token(inputs) -> torch.Tensor:
    """Wrong on purpose: one value per token instead of the micro-batch's scalar share."""
    return -inputs.advantages * inputs.logprobs
