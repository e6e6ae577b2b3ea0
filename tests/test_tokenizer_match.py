"""prl/planner/tokenizers.py: a teacher's tokenizer against the student's, from the files alone."""

from __future__ import annotations

import json
from pathlib import Path

from prl.planner.tokenizers import tokenizer_difference


def _tokenizer(directory: Path, vocab: dict[str, int], added: dict[int, str], **model) -> str:
    directory.mkdir(parents=True)
    data = {"version": "1.0", "normalizer": None, "added_tokens": [{"id": i, "content": c, "special": True}
                                                                   for i, c in added.items()],
            "model": {"type": "BPE", "vocab": vocab, "merges": ["a b"], **model}}
    (directory / "tokenizer.json").write_text(json.dumps(data))
    return str(directory)


VOCAB = {"a": 0, "b": 1, "ab": 2}


def test_alike_tokenizers_pass_whatever_their_normalizer(tmp_path):
    student = _tokenizer(tmp_path / "s", VOCAB, {3: "<|im_end|>"})
    teacher = _tokenizer(tmp_path / "t", dict(reversed(VOCAB.items())), {3: "<|im_end|>"})
    data = json.loads((Path(teacher) / "tokenizer.json").read_text())
    (Path(teacher) / "tokenizer.json").write_text(json.dumps({**data, "normalizer": {"type": "NFC"}}))
    assert tokenizer_difference(student, teacher) is None


def test_a_vocabulary_with_other_ids_is_named(tmp_path):
    student = _tokenizer(tmp_path / "s", VOCAB, {3: "<|im_end|>"})
    teacher = _tokenizer(tmp_path / "t", {"a": 0, "b": 2, "ab": 1, "c": 4}, {3: "<|im_end|>"})
    assert tokenizer_difference(student, teacher) == ("vocabularies of 3 and 4 entries, 2 of the first with another "
                                                      "id or missing")


def test_added_tokens_and_merges_count(tmp_path):
    student = _tokenizer(tmp_path / "s", VOCAB, {3: "<|im_end|>"})
    teacher = _tokenizer(tmp_path / "t", VOCAB, {3: "<|endoftext|>"})
    assert tokenizer_difference(student, teacher) == "added tokens differ at 1 ids (3: '<|im_end|>' vs '<|endoftext|>')"
    other = _tokenizer(tmp_path / "o", VOCAB, {3: "<|im_end|>"}, merges=["b a"])
    assert tokenizer_difference(student, other) == "tokenizer models differ in merges"


def test_slow_tokenizer_files_are_compared_by_content(tmp_path):
    for name, merges in (("s", "a b\n"), ("t", "b a\n"), ("u", "a b\n")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "vocab.json").write_text(json.dumps(VOCAB))
        (tmp_path / name / "merges.txt").write_text(merges)
    assert tokenizer_difference(str(tmp_path / "s"), str(tmp_path / "t")) == "their merges.txt files differ"
    assert tokenizer_difference(str(tmp_path / "s"), str(tmp_path / "u")) is None


def test_what_this_machine_cannot_read_is_not_compared(tmp_path):
    student = _tokenizer(tmp_path / "s", VOCAB, {})
    assert tokenizer_difference(student, "Qwen/Qwen3-8B") is None
