"""Do two model directories tokenize alike? Checked on the login node from the files alone (no transformers).

A teacher (or reference) scores the student's token ids, so its tokenizer must map ids to the same strings.
What is compared, in order of what the directories hold:

    tokenizer.json      its `model` (type, vocabulary, merges) and `added_tokens` (id, content, special)
    vocab.json, merges.txt, tokenizer.model, vocab.txt     the files' bytes (slow tokenizers)

Normalizers, pre-tokenizers and chat templates may differ (the orchestrator sends token ids, not text).
A directory this machine cannot read (a hub id, a path only the nodes see) is not compared.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

MAX_TOKENIZER_BYTES = 256 << 20
"""Largest tokenizer file read (a 256k-vocabulary tokenizer.json is about 35 MiB)."""
VOCAB_FILES = ("vocab.json", "merges.txt", "tokenizer.model", "vocab.txt")


def _read_json(path: Path) -> dict | None:
    if not path.is_file() or path.stat().st_size > MAX_TOKENIZER_BYTES:
        return None
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def _vocab(data: dict) -> dict[str, int]:
    vocab = (data.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        return {str(k): v for k, v in vocab.items()}
    if isinstance(vocab, list):  # unigram: [[piece, score], ...], the id is the index
        return {str(item[0]): i for i, item in enumerate(vocab) if isinstance(item, list) and item}
    return {}


def _added(data: dict) -> dict[int, str]:
    return {t.get("id"): str(t.get("content")) for t in data.get("added_tokens") or [] if isinstance(t, dict)}


def _json_difference(a: dict, b: dict) -> str | None:
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
    ma = {k: v for k, v in (a.get("model") or {}).items() if k != "vocab"}
    mb = {k: v for k, v in (b.get("model") or {}).items() if k != "vocab"}
    if ma != mb:
        keys = sorted(k for k in set(ma) | set(mb) if ma.get(k) != mb.get(k))
        return f"tokenizer models differ in {', '.join(keys[:4])}"
    return None


def _digest(path: Path) -> str | None:
    if not path.is_file() or path.stat().st_size > MAX_TOKENIZER_BYTES:
        return None
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tokenizer_difference(student: str, other: str) -> str | None:
    """Why `other`'s tokenizer is not `student`'s (directories), or None: alike, or not comparable here."""
    a, b = Path(student).expanduser(), Path(other).expanduser()
    if not (a.is_dir() and b.is_dir()):
        return None
    ja, jb = _read_json(a / "tokenizer.json"), _read_json(b / "tokenizer.json")
    if ja is not None and jb is not None:
        return _json_difference(ja, jb)
    for name in VOCAB_FILES:
        da, db = _digest(a / name), _digest(b / name)
        if da is not None and db is not None and da != db:
            return f"their {name} files differ"
    return None
