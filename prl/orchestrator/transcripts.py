"""Rollouts as a person reads them: each episode's conversation as text, and a step's bounded sample of them.

    turns, clipped = conversation(traces)         # verifiers traces -> Turn records (text, tool calls, pictures)
    sample = step_sample(step, groups, env, ...)   # whole groups, up to `limit` rollouts and ROLLOUT_SAMPLE_BYTES
    run.write_rollout_sample(sample)               # samples/step_N.json (prl/run/handoffs.py), `prl rollouts` reads it

A step's sample holds whole groups (a group's rollouts share a task: side by side they show what the
advantages compared), taken in the step's order, trained and dropped alike, each with what became of it
(`RolloutRecord.fate`). Text is bounded per message (ROLLOUT_TEXT_CHARS, the middle cut out) and the sample
per step (ROLLOUT_SAMPLE_BYTES: groups past it are left out), so a long-context run's records stay small.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from prl.run.records import RolloutRecord, RolloutSample, ToolCallText, Turn

ROLLOUT_TEXT_CHARS = 8000
"""Most characters kept of one message's text (its start and end; the middle is cut out and marked)."""
ROLLOUT_SAMPLE_BYTES = 4 << 20
"""Most bytes of one step's sample (whole groups; below prl.run.handoffs.MAX_SAMPLE_BYTES)."""
CUT = "\n[... {n} characters cut ...]\n"


def clip(text: str) -> tuple[str, bool]:
    """`text` within ROLLOUT_TEXT_CHARS (its head and tail), and whether it was cut."""
    if len(text) <= ROLLOUT_TEXT_CHARS:
        return text, False
    half = ROLLOUT_TEXT_CHARS // 2
    return text[:half] + CUT.format(n=len(text) - 2 * half) + text[-half:], True


def _text(content: Any) -> tuple[str, int]:
    """A message's content as text, and its pictures (counted, not kept)."""
    if content is None:
        return "", 0
    if isinstance(content, str):
        return content, 0
    texts, pictures = [], 0
    for part in content:
        if getattr(part, "type", None) == "image_url":
            pictures += 1
        elif getattr(part, "text", None) is not None:
            texts.append(part.text)
    return "\n".join(texts), pictures


def turn_of(message: Any) -> tuple[Turn, bool]:
    """One verifiers message (system, user, assistant, tool) as a Turn, and whether its text was cut."""
    text, pictures = _text(getattr(message, "content", None))
    text, cut = clip(text)
    reasoning, cut_reasoning = clip(getattr(message, "reasoning_content", None) or "")
    calls = [ToolCallText(name=c.name, arguments=clip(c.arguments)[0])
             for c in getattr(message, "tool_calls", None) or ()]
    return Turn(role=message.role, text=text, reasoning=reasoning, tool_calls=calls,
                tool_call_id=getattr(message, "tool_call_id", "") or "", pictures=pictures), cut or cut_reasoning


def conversation(traces: Iterable[Any]) -> tuple[list[Turn], bool]:
    """The conversation of an episode's traces of trainable agents (each its final branch's messages, one trace
    after another), and whether any text was cut."""
    turns: list[Turn] = []
    clipped = False
    for trace in traces:
        if not trace.agent.trainable:
            continue
        for message in trace.messages:
            turn, cut = turn_of(message)
            turns.append(turn)
            clipped = clipped or cut
    return turns, clipped


def record_of(rollout: Any, group: int, index: int, env: str, step: int, advantage: float | None,
              fate: str) -> RolloutRecord:
    """A RolloutRecord of one `prl.orchestrator.rollouts.Rollout` of step `step` (0: an evaluation)."""
    rewards = {k.removeprefix("reward/"): v for k, v in rollout.metrics.items() if k.startswith("reward/")}
    metrics = {k: v for k, v in rollout.metrics.items() if not k.startswith("reward/")}
    return RolloutRecord(group=group, index=index, env=env, reward=rollout.reward, rewards=rewards, metrics=metrics,
                         advantage=advantage, fate=fate, completion_tokens=rollout.completion_tokens,
                         turns=rollout.turns, truncated=rollout.truncated, policy_version=rollout.version,
                         policy_version_end=rollout.version_end or rollout.version,
                         lag=max(0, step - 1 - rollout.version) if step else 0, error=rollout.error,
                         conversation=rollout.conversation, clipped=rollout.clipped)


def step_sample(step: int, fates: Sequence[tuple[Sequence[Any], Sequence[float] | None, str]], env: str, *,
                limit: int, rollouts: int) -> RolloutSample:
    """Step `step`'s sample: whole groups of `fates` ((rollouts, advantages or None, fate) per group, the step's
    order) while they fit in `limit` rollouts (at least one group) and ROLLOUT_SAMPLE_BYTES; `rollouts`: every
    rollout the step ran."""
    sample = RolloutSample(step=step, rollouts=rollouts)
    size = 0
    for g, (group, advantages, fate) in enumerate(fates):
        if limit <= 0 or (sample.records and len(sample.records) + len(group) > limit):
            break
        records = [record_of(r, g, i, env, step, None if advantages is None else float(advantages[i]), fate)
                   for i, r in enumerate(group)]
        sizes = [len(msgspec.json.encode(r)) for r in records]
        if sample.records and size + sum(sizes) > ROLLOUT_SAMPLE_BYTES:
            break
        if not sample.records:  # the first group: as many of its rollouts as fit, at least one
            while len(records) > 1 and sum(sizes) > ROLLOUT_SAMPLE_BYTES:
                records.pop(), sizes.pop()
        sample.records.extend(records)
        size += sum(sizes)
    return sample
