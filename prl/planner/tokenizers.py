"""Do two model directories tokenize alike? Checked on the login node from the files alone (no transformers).

A teacher (or reference) scores the student's token ids, so its tokenizer must map ids to the same strings.
What is compared, in order of what the directories hold:

    tokenizer.json      its `model` (type, vocabulary, merges) and `added_tokens` (id, content, special)
    vocab.json, merges.txt, tokenizer.model, vocab.txt     the files' bytes (slow tokenizers)

Normalizers, pre-tokenizers and chat templates may differ (the orchestrator sends token ids, not text).
A directory this machine does not have (a hub id, a path only the nodes see) is not compared; one it may not read,
or a file of unexpected types, is refused in one line (prl/config/external.py).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Optional, Union

import msgspec

from prl.config.external import Unreadable, is_dir, read_bytes, read_json

MAX_TOKENIZER_BYTES = 256 << 20
"""Largest tokenizer file read (a 256k-vocabulary tokenizer.json is about 35 MiB)."""
VOCAB_FILES = ("vocab.json", "merges.txt", "tokenizer.model", "vocab.txt")
TOKENIZER_JSON = "a tokenizer.json"

Vocab = Union[dict[str, int], list[tuple[str, float]]]
"""`model.vocab`: token -> id (BPE, WordPiece), or [piece, score] pairs whose index is the id (Unigram)."""


class AddedToken(msgspec.Struct):
    id: int
    content: str
    special: bool = False


class TokenizerJson(msgspec.Struct):
    """What of a tokenizer.json maps ids to tokens, typed: a file of other types is refused in one line."""

    model: dict[str, Any]
    added_tokens: list[AddedToken] = []


def _read_json(path: Path) -> TokenizerJson | None:
    data = read_json(path, TokenizerJson, MAX_TOKENIZER_BYTES, TOKENIZER_JSON)
    if data is not None:
        try:
            msgspec.convert(data.model.get("vocab"), Optional[Vocab], strict=True)
        except msgspec.ValidationError as exc:
            raise Unreadable(f"{path} is not {TOKENIZER_JSON} prl can read: {exc} in `$.model.vocab`") from None
    return data


def _vocab(data: TokenizerJson) -> dict[str, int]:
    vocab = data.model.get("vocab")
    if isinstance(vocab, dict):
        return vocab
    return {str(item[0]): i for i, item in enumerate(vocab or [])}  # unigram: the id is the index


def _added(data: TokenizerJson) -> dict[int, str]:
    return {t.id: t.content for t in data.added_tokens}


def _json_difference(a: TokenizerJson, b: TokenizerJson) -> str | None:
    """How two tokenizer.json files differ in what maps ids to tokens (None: they agree)."""
    va, vb = _vocab(a), _vocab(b)
    if va != vb:
        moved = sum(1 for token, i in va.items() if vb.get(token) != i)
        return f"vocabularies of {len(va)} and {len(vb)} entries, {moved} of the first with another id or missing"
    aa, ab = _added(a), _added(b)
    if aa != ab:
        ids = sorted(i for i in set(aa) | set(ab) if aa.get(i) != ab.get(i))
        shown = ", ".join(f"{i}: {aa.get(i)!r} vs {ab.get(i)!r}" for i in ids[:3])
        return f"added tokens differ at {len(ids)} ids ({shown})"
    ma = {k: v for k, v in a.model.items() if k != "vocab"}
    mb = {k: v for k, v in b.model.items() if k != "vocab"}
    if ma != mb:
        keys = sorted(k for k in set(ma) | set(mb) if ma.get(k) != mb.get(k))
        return f"tokenizer models differ in {', '.join(keys[:4])}"
    return None


def _digest(path: Path) -> str | None:
    raw = read_bytes(path, MAX_TOKENIZER_BYTES, f"a tokenizer's {path.name}")
    return None if raw is None else hashlib.sha256(raw).hexdigest()


def tokenizer_difference(student: str, other: str) -> str | None:
    """Why `other`'s tokenizer is not `student`'s (directories), or None: alike, or not comparable here.
    Unreadable (prl/config/external.py) for a directory or file this machine may not read, or a mistyped file."""
    a, b = Path(student).expanduser(), Path(other).expanduser()
    if not (is_dir(a) and is_dir(b)):
        return None
    ja, jb = _read_json(a / "tokenizer.json"), _read_json(b / "tokenizer.json")
    if ja is not None and jb is not None:
        return _json_difference(ja, jb)
    for name in VOCAB_FILES:
        da, db = _digest(a / name), _digest(b / name)
        if da is not None and db is not None and da != db:
            return f"their {name} files differ"
    return None
