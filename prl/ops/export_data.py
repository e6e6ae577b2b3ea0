"""`prl export-data`: the rollouts that scored well, as chat JSONL an `sft:` topology trains on as it is.

    prl export-data RUN --min-reward 1 -o good.jsonl                    # a run's sampled rollouts, every step
    prl export-data eval.json --min-reward 0.8 --best-per-task -o best.jsonl   # `prl eval --records eval.json`

Rejection sampling / best-of-n: evaluate (or train), keep what passed, fine-tune on it (`sft: {data: good.jsonl}`).
Each line is `{"messages": [...]}` in the chat format prl/trainer/sft_data.py reads: system, user and assistant
messages, an assistant's `tool_calls` (OpenAI's form; each call's id is the one its tool message answers) and
`reasoning_content` where the server returned reasoning apart, and tool messages with their `tool_call_id`.

Left out, and counted by reason: rollouts below `--min-reward`, failed ones, truncated ones (a limit stopped them:
the model did not finish, and the data would teach it to stop there), ones whose text was cut to the record's bound
(ROLLOUT_TEXT_CHARS), ones with pictures (a record counts pictures, it does not keep them) and ones with no
assistant turn. Control plane: msgspec records in, JSON lines out.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from typing import Any

from prl.run.records import RolloutRecord, Turn


def left_out(record: RolloutRecord, min_reward: float) -> str | None:
    """Why `record` is not exported (None: it is)."""
    if record.error is not None or record.fate == "failed":
        return "failed"
    if record.reward < min_reward:
        return "below --min-reward"
    if record.truncated:
        return "truncated"
    if record.clipped:
        return "text cut to the record's bound"
    if any(t.pictures for t in record.conversation):
        return "has pictures"
    if not any(t.role == "assistant" for t in record.conversation):
        return "no assistant turn"
    return None


def _calls(turn: Turn, answers: Sequence[Turn]) -> list[dict[str, Any]]:
    """An assistant turn's tool calls in OpenAI's form; ids from the tool messages that answer them, in order."""
    ids = [t.tool_call_id for t in answers]
    out = []
    for i, call in enumerate(turn.tool_calls):
        item: dict[str, Any] = {"type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        if len(ids) == len(turn.tool_calls) and ids[i]:
            item["id"] = ids[i]
        out.append(item)
    return out


def messages_of(record: RolloutRecord) -> list[dict[str, Any]]:
    """The rollout's conversation as chat messages (prl/trainer/sft_data.py's format)."""
    turns = record.conversation
    out = []
    for i, turn in enumerate(turns):
        message: dict[str, Any] = {"role": turn.role, "content": turn.text}
        if turn.role == "assistant" and turn.tool_calls:
            following = []
            for later in turns[i + 1:]:
                if later.role != "tool":
                    break
                following.append(later)
            message["tool_calls"] = _calls(turn, following)
        if turn.role == "assistant" and turn.reasoning:
            message["reasoning_content"] = turn.reasoning
        if turn.role == "tool" and turn.tool_call_id:
            message["tool_call_id"] = turn.tool_call_id
        out.append(message)
    return out


def choose(records: Sequence[tuple[int, RolloutRecord]], min_reward: float,
           best_per_task: bool) -> tuple[list[RolloutRecord], Counter]:
    """The records to export from (step, record) pairs, and how many were left out by reason. `best_per_task`:
    of each task's rollouts (a group of one step), only the highest-scoring that passes."""
    skipped: Counter = Counter()
    kept: dict[tuple, RolloutRecord] = {}
    for n, (step, r) in enumerate(records):
        why = left_out(r, min_reward)
        if why is not None:
            skipped[why] += 1
            continue
        key = (step, r.env, r.group) if best_per_task else (n,)
        if key in kept:
            skipped["not the best of its task"] += 1
            if r.reward <= kept[key].reward:
                continue
        kept[key] = r
    return list(kept.values()), skipped


def jsonl(records: Sequence[RolloutRecord]) -> str:
    """One `{"messages": [...]}` line per record."""
    return "".join(json.dumps({"messages": messages_of(r)}, ensure_ascii=False) + "\n" for r in records)


def summary(written: int, total: int, skipped: Counter) -> str:
    reasons = ", ".join(f"{n} {why}" for why, n in skipped.most_common())
    return f"{written} of {total} rollout(s)" + (f" (left out: {reasons})" if reasons else "")
