"""SFT data: chat conversations -> token samples with loss on the assistant's tokens only.

    examples = read_conversations(Path("data/train.jsonl"))      # or .parquet, or a datasets dir
    samples = [tokenize_conversation(tokenizer, m, max_tokens=2048) for m in examples]

The samples are `prl.run.batch.Sample`s with advantage 1: the RL trainer's packing
(`prl.run.batch.pack`, one row per micro-batch, position ids restarting at 0 for every sample,
hence a block-diagonal causal mask) and its checkpoints and weight publishing serve SFT too.

Sources, each a list of conversations in the chat `messages` format
(`[{"role": "system"|"user"|"assistant"|"tool", "content": "..."}, ...]`; an assistant message may carry
`tool_calls` in OpenAI's form and `reasoning_content`, a tool message its `tool_call_id`, all handed to the
chat template as they are, as `prl export-data` writes them):

- `*.jsonl`: one JSON object per line with a `messages` list (read here, no extra package);
- `*.parquet`, or a directory written by `datasets.save_to_disk` or holding data files for
  `datasets.load_dataset(dir)`: through Hugging Face `datasets` (the `sft` extra), offline.

Pictures (vision-language models): a message's `content` may be a list of parts, `{"type": "text", "text":
...}` and pictures, `{"type": "image", "path": "pics/1.png"}` (relative to the data file's directory, or
absolute) or `{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}` (embedded; nothing
is fetched). Each picture is read and decoded when the data is read: a missing or undecodable one is a
DataError naming the file, line (or row), message and part. The conversation is rendered with the model's
processor, which expands each picture's placeholder; the sample keeps the pictures (prl/run/batch.py) and the
trainer re-runs the image processor on them, as in RL (prl/trainer/vision.py). Its loss spans come from
its rendered prefixes, tokenized as text and mapped into the expanded ids (`picture_spans`: one processor
call per conversation).

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
from prl.run.batch import NotADataURL, Sample, picture_bytes

ROLES = ("system", "user", "assistant", "tool")


class DataError(ConfigError):
    """An SFT example is malformed; the message names the file and line or row."""


def check_messages(messages: Any, where: str, base: Path | None = None) -> list[dict[str, Any]]:
    """The conversation, checked; picture parts read (paths relative to `base`) into `{"type": "image",
    "bytes": ...}`."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), (str, list)):
            raise DataError(f"{where}: messages[{i}] must have a role in {ROLES} and string content (or a list "
                            f"of text and image parts)")
        content = m["content"]
        if isinstance(content, list):
            content = [check_part(part, f"{where}: messages[{i}].content[{j}]", base or Path.cwd())
                       for j, part in enumerate(content)]
            if m["role"] != "user" and any(p["type"] == "image" for p in content):
                raise DataError(f"{where}: messages[{i}] ({m['role']}) has a picture; pictures go in user messages")
        out.append({"role": m["role"], "content": content, **tool_fields(m, f"{where}: messages[{i}]")})
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{where}: no assistant message, nothing to train on")
    return out


def tool_fields(m: dict[str, Any], where: str) -> dict[str, Any]:
    """A message's tool-call fields, checked, for the chat template: an assistant's `tool_calls` (OpenAI's form,
    `{"type": "function", "function": {"name": ..., "arguments": ...}}`, an `id` optional), `reasoning_content`,
    and a tool message's `tool_call_id`."""
    out: dict[str, Any] = {}
    calls = m.get("tool_calls")
    if calls is not None:
        if m["role"] != "assistant" or not isinstance(calls, list):
            raise DataError(f"{where}: tool_calls must be a list, on an assistant message")
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)
                    and isinstance(fn.get("arguments"), (str, dict))):
                raise DataError(f"{where}.tool_calls[{j}]: expected {{\"type\": \"function\", \"function\": "
                                f"{{\"name\": str, \"arguments\": str or object}}}}")
        out["tool_calls"] = calls
    for key, role in (("tool_call_id", "tool"), ("reasoning_content", "assistant")):
        if m.get(key) is not None:
            if m["role"] != role or not isinstance(m[key], str):
                raise DataError(f"{where}: {key} must be a string, on a {role} message")
            out[key] = m[key]
    return out


def check_part(part: Any, where: str, base: Path) -> dict[str, Any]:
    """A content part as the template sees it: a text part, or a picture read and decoded."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if kind == "image" and isinstance(part.get("path"), str):
        path = base / part["path"]
        try:
            data = path.read_bytes()
        except OSError as e:
            raise DataError(f"{where}: cannot read the picture {path}: {e.strerror or e}") from None
        return {"type": "image", "bytes": decodable(data, f"{where}: {path}")}
    url = (part.get("image_url") or {}).get("url") if kind == "image_url" else None
    if isinstance(url, str):
        try:
            data = picture_bytes(url)
        except NotADataURL as e:
            raise DataError(f"{where}: {e}") from None
        except ValueError:  # binascii.Error
            raise DataError(f"{where}: the data URL is not valid base64") from None
        return {"type": "image", "bytes": decodable(data, where)}
    raise DataError(f"{where}: a part must be {{\"type\": \"text\", \"text\": ...}}, {{\"type\": \"image\", "
                    f"\"path\": ...}} or {{\"type\": \"image_url\", \"image_url\": {{\"url\": \"data:...\"}}}}")


def decodable(data: bytes, where: str) -> bytes:
    """`data` when PIL decodes it as a picture; DataError naming `where` otherwise."""
    import io

    from PIL import Image

    try:
        Image.open(io.BytesIO(data)).convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise DataError(f"{where}: not a picture PIL can decode ({str(e)[:120]})") from None
    return data


def has_pictures(messages: Sequence[dict[str, Any]]) -> bool:
    return any(isinstance(m["content"], list) and any(p["type"] == "image" for p in m["content"]) for m in messages)


def read_conversations(path: Path, split: str = "train") -> Iterator[list[dict[str, str]]]:
    """The `messages` of every example in a JSONL file, a Parquet file or a local datasets directory."""
    if not path.exists():
        raise DataError(f"{path}: no such file or directory")
    if path.is_file() and path.suffix in (".jsonl", ".json"):
        yield from _jsonl(path)
        return
    base = path.parent if path.is_file() else path
    for row, example in enumerate(_hf_rows(path, split)):
        yield check_messages(example.get("messages"), f"{path} row {row}", base)


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
            yield check_messages(example.get("messages"), where, path.parent)


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


def template_view(messages: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[bytes]]:
    """The messages as a chat template renders them (a picture part is `{"type": "image"}`) and the pictures."""
    pictures: list[bytes] = []
    view = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            pictures += [p["bytes"] for p in content if p["type"] == "image"]
            content = [p if p["type"] == "text" else {"type": "image"} for p in content]
        view.append({**m, "content": content})
    return view, pictures


def picture_spans(processor: Any, messages: Sequence[dict[str, Any]]) -> tuple[list[int], list[tuple[int, int]]]:
    """A conversation with pictures: its token ids (placeholders expanded by the processor) and the token spans
    [start, end) of its assistant turns.

    The processor runs once, on the whole conversation (its image processor is what costs); each turn's bounds
    come from tokenizing the rendered prefixes' *text* and mapping those tokens into the expanded ids
    (`expanded_positions`). Where that mapping is not certain, every prefix is run through the processor
    instead (`picture_spans_exact`)."""
    import io

    from PIL import Image

    view, pictures = template_view(messages)
    text = processor.apply_chat_template(view, tokenize=False)
    images = [Image.open(io.BytesIO(p)).convert("RGB") for p in pictures] or None
    whole = [int(t) for t in processor(text=text, images=images, return_tensors="np")["input_ids"][0]]
    image = processor.tokenizer.convert_tokens_to_ids(getattr(processor, "image_token", None) or "<image>")
    for special in (False, True):
        plain = list(processor.tokenizer(text, add_special_tokens=special)["input_ids"])
        where = expanded_positions(plain, whole, image)
        if where is not None:
            break
    else:
        return picture_spans_exact(processor, messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        bounds = []
        for prefix, generation in ((messages[:i], True), (messages[:i + 1], False)):
            prefix_text = processor.apply_chat_template(template_view(prefix)[0], tokenize=False,
                                                        add_generation_prompt=generation)
            ids = list(processor.tokenizer(prefix_text, add_special_tokens=special)["input_ids"])
            if not text.startswith(prefix_text) or plain[:len(ids)] != ids or where[len(ids)] < 0:
                return picture_spans_exact(processor, messages)  # raises, naming the message, if it cannot mask
            bounds.append(where[len(ids)])
        spans.append((bounds[0], bounds[1]))
    return whole, spans


def expanded_positions(plain: list[int], whole: list[int], image: int) -> list[int] | None:
    """For each position b of `plain` (the rendered text's tokens, each picture one `image` placeholder), where it
    is in `whole` (the processor's ids, each placeholder expanded), b = len(plain) included; -1 between two
    adjacent placeholders (where one run ends and the next begins is not known). None unless `whole` starts and
    ends with `plain`'s text and the text between two placeholders is found exactly once where it can be."""
    cuts = [i for i, t in enumerate(plain) if t == image]
    segments = [plain[a + 1:b] for a, b in zip([-1, *cuts], [*cuts, len(plain)])]
    first, last = segments[0], segments[-1]
    if not cuts or whole[:len(first)] != first or (last and whole[-len(last):] != last):
        return None
    starts: list[int | None] = [0]
    lo = len(first)  # the earliest the next segment can start
    for k, segment in enumerate(segments[1:], 1):
        hi = len(whole) - sum(len(s) for s in segments[k:])  # the latest start that leaves room for the rest
        if k == len(segments) - 1:
            found = [hi]  # the last segment ends `whole` (checked above)
        elif not segment:
            starts.append(None)  # adjacent pictures: unknown, and no turn ends there
            continue
        else:
            found = [j for j in range(lo, hi + 1) if whole[j:j + len(segment)] == segment]
        if len(found) != 1:
            return None
        starts.append(found[0])
        lo = found[0] + len(segment)
    where = [-1] * (len(plain) + 1)
    for start, a, segment in zip(starts, [-1, *cuts], segments):
        if start is not None:
            where[a + 1:a + 2 + len(segment)] = range(start, start + len(segment) + 1)
    return where


def picture_spans_exact(processor: Any, messages: Sequence[dict[str, Any]]
                        ) -> tuple[list[int], list[tuple[int, int]]]:
    """`picture_spans` by running the processor on every rendered prefix (1 + 2 x turns calls, pictures included)."""
    import io

    from PIL import Image

    decoded: dict[int, Any] = {}

    def ids(prefix: Sequence[dict[str, Any]], generation: bool = False) -> list[int]:
        view, pictures = template_view(prefix)
        text = processor.apply_chat_template(view, tokenize=False, add_generation_prompt=generation)
        images = [decoded.setdefault(i, Image.open(io.BytesIO(p)).convert("RGB"))
                  for i, p in enumerate(pictures)] or None
        return list(processor(text=text, images=images, return_tensors="np")["input_ids"][0])

    whole = ids(messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, through = ids(messages[:i], generation=True), ids(messages[:i + 1])
        if through[:len(before)] != before or whole[:len(through)] != through:
            raise DataError(f"the processor's chat template does not render a conversation's messages as a prefix "
                            f"of the longer conversation (message {i}): it cannot be masked per turn")
        spans.append((len(before), len(through)))
    return [int(t) for t in whole], spans


def tokenize_conversation(tokenizer: Any, messages: Sequence[dict[str, Any]], max_tokens: int,
                          image_token_id: int | None = None) -> Sample:
    """One conversation as a training sample: token ids and a loss mask that is 1 on assistant tokens only.
    `tokenizer` is the model's processor for a conversation with pictures (and `image_token_id` its image token).

    Longer than `max_tokens`: cut at `max_tokens` (the mask is cut with it; a cut inside the pictures'
    placeholders is a DataError)."""
    if has_pictures(messages):
        ids, spans = picture_spans(tokenizer, messages)
        mask = [int(any(lo <= t < hi for lo, hi in spans)) for t in range(len(ids))]
        if ids[max_tokens:].count(image_token_id):
            raise DataError(f"a conversation with pictures is {len(ids)} tokens, and its pictures' placeholders run "
                            f"past model.max_model_len ({max_tokens}): it cannot be cut there")
        ids, mask = ids[:max_tokens], mask[:max_tokens]
        if ids:
            mask[0] = 0
        _, pictures = template_view(messages)
        return Sample(token_ids=ids, loss_mask=mask, inference_logprobs=[0.0] * len(ids), advantage=1.0,
                      images=pictures)
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's own tokenizer for text alone
    messages = [{**m, "content": m["content"] if isinstance(m["content"], str)
                 else "".join(p["text"] for p in m["content"])} for m in messages]  # text parts: their text
    text, spans = assistant_spans(tokenizer, messages)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"][:max_tokens], encoded["offset_mapping"][:max_tokens]
    mask = [int(any(lo <= start < hi for lo, hi in spans)) for start, _ in offsets]
    if ids:
        mask[0] = 0  # nothing predicts the first token
    return Sample(token_ids=ids, loss_mask=mask, inference_logprobs=[0.0] * len(ids), advantage=1.0)
