"""SFT data: chat conversations -> token samples with loss on the assistant's tokens only.

    examples = read_conversations(Path("data/train.jsonl"))      # or .parquet, or a datasets dir
    samples = [tokenize_conversation(tokenizer, m, max_tokens=2048) for m in examples]

The samples are `prl.run.batch.Sample`s with advantage 1: the RL trainer's packing
(`prl.run.batch.pack`, one row per micro-batch, position ids restarting at 0 for every sample,
hence a block-diagonal causal mask) and its checkpoints and weight publishing serve SFT too.

Sources, each a list of conversations in the chat `messages` format
(`[{"role": "system"|"user"|"assistant"|"tool", "content": "..."}, ...]`):

- `*.jsonl`: one JSON object per line with a `messages` list (read here, no extra package);
- `*.parquet`, or a directory written by `datasets.save_to_disk` or holding data files for
  `datasets.load_dataset(dir)`: through Hugging Face `datasets` (the `sft` extra), offline.

Masking: the conversation is rendered once with the tokenizer's chat template and tokenized
once with character offsets; a token is trained if it starts inside an assistant turn's own
text, from the end of its header (`<|im_start|>assistant\\n` with ChatML) through its
end-of-turn marker, so the model learns to stop. The spans come from rendering prefixes of the
conversation: the template must render `messages[:i]` as a prefix of `messages[:i+1]` (true of
ChatML and Llama 3; not of templates that rewrite earlier turns, which are refused by name).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from prl.errors import ConfigError
from prl.run.batch import Sample

ROLES = ("system", "user", "assistant", "tool")


class DataError(ConfigError):
    """An SFT example is malformed; the message names the file and line or row."""


def check_messages(messages: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: messages[{i}] must have a role in {ROLES} and string content")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: no assistant message, nothing to train on")
    return messages


def read_conversations(path: Path, split: str = "train") -> Iterator[list[dict[str, str]]]:
    """The `messages` of every example in a JSONL file, a Parquet file or a local datasets directory."""
    if not path.exists():
        raise DataError(f"{path}: no such file or directory")
    if path.is_file() and path.suffix in (".jsonl", ".json"):
        yield from _jsonl(path)
        return
    for row, example in enumerate(_hf_rows(path, split)):
        yield check_messages(example.get("messages"), f"{path} row {row}")


def _jsonl(path: Path) -> Iterator[list[dict[str, str]]]:
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                example = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: not JSON ({exc.msg})") from None
            if not isinstance(example, dict):
                raise DataError(f"{where}: expected an object with 'messages'")
            yield check_messages(example.get("messages"), where)


def _hf_rows(path: Path, split: str) -> Iterator[dict[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise DataError(f"{path}: Parquet files and datasets directories need the datasets package "
                        f"(pip install 'prl[sft]')") from None
    if path.is_file():
        if path.suffix != ".parquet":
            raise DataError(f"{path}: expected .jsonl, .parquet or a datasets directory")
        data = datasets.load_dataset("parquet", data_files=str(path), split="train")
    elif (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists():
        data = datasets.load_from_disk(str(path))
        if isinstance(data, datasets.DatasetDict):
            if split not in data:
                raise DataError(f"{path}: no split {split!r} (splits: {', '.join(data)})")
            data = data[split]
    else:
        data = datasets.load_dataset(str(path), split=split)
    if "messages" not in data.column_names:
        raise DataError(f"{path}: no 'messages' column (columns: {', '.join(data.column_names)})")
    yield from data


def assistant_spans(tokenizer: Any, messages: Sequence[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans [start, end) the model is trained on."""
    text = tokenizer.apply_chat_template(list(messages), tokenize=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(list(messages[:i]), tokenize=False, add_generation_prompt=True)
        through = tokenizer.apply_chat_template(list(messages[:i + 1]), tokenize=False)
        if not (through.startswith(before) and text.startswith(through)):
            raise DataError(f"the tokenizer's chat template does not render a conversation's messages "
                            f"as a prefix of the longer conversation (message {i}): it cannot be masked per "
                            f"turn; use a template that keeps earlier turns as they were")
        spans.append((len(before), len(through)))
    return text, spans


def tokenize_conversation(tokenizer: Any, messages: Sequence[dict[str, str]], max_tokens: int) -> Sample:
    """One conversation as a training sample: token ids and a loss mask that is 1 on assistant tokens only.

    Longer than `max_tokens`: cut at `max_tokens` (the mask is cut with it)."""
    text, spans = assistant_spans(tokenizer, messages)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"][:max_tokens], encoded["offset_mapping"][:max_tokens]
    mask = [int(any(lo <= start < hi for lo, hi in spans)) for start, _ in offsets]
    if ids:
        mask[0] = 0  # nothing predicts the first token
    return Sample(token_ids=ids, loss_mask=mask, inference_logprobs=[0.0] * len(ids), advantage=1.0)
