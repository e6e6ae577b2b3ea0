"""SFT data: conversations from JSONL / Parquet / datasets dirs, loss on assistant tokens only, packed like RL batches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prl.run.batch import pack, to_arrays
from prl.trainer.sft_data import DataError, read_conversations, tokenize_conversation
from tests.tiny_model import build_tokenizer

CONVERSATION = [
    {"role": "system", "content": "You answer with numbers."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "The answer is 5."},
    {"role": "user", "content": "And 4 + 5?"},
    {"role": "assistant", "content": "9"},
]

LLAMA3_STYLE = (
    "{{ '<|endoftext|>' }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '<|im_end|>\n\n' + message['content'] + '<|endoftext|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant<|im_end|>\n\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def trained_text(tok, sample) -> list[str]:
    """The decoded runs of consecutive trained tokens, one string per run."""
    runs, current = [], []
    for token, m in zip(sample.token_ids, sample.loss_mask):
        if m:
            current.append(token)
        elif current:
            runs.append(tok.decode(current)), current.clear()
    if current:
        runs.append(tok.decode(current))
    return runs


def test_only_assistant_turns_and_their_end_marker_carry_loss_token_by_token(tokenizer):
    sample = tokenize_conversation(tokenizer, CONVERSATION, max_tokens=4096)
    assert len(sample.token_ids) == len(sample.loss_mask)
    assert trained_text(tokenizer, sample) == ["The answer is 5.<|im_end|>\n", "9<|im_end|>\n"]
    # token by token: the decoded untrained tokens are exactly the rest of the rendered conversation
    untrained = "".join(tokenizer.decode([t]) for t, m in zip(sample.token_ids, sample.loss_mask) if not m)
    rendered = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert untrained == rendered.replace("The answer is 5.<|im_end|>\n", "").replace("9<|im_end|>\n", "")
    for text in ("You answer with numbers.", "What is 2 + 3?", "And 4 + 5?", "<|im_start|>assistant\n"):
        assert text in untrained
    assert sample.advantage == 1.0 and sample.loss_mask[0] == 0


def test_another_template_family_masks_the_same_way(tokenizer):
    tokenizer = build_tokenizer()
    tokenizer.chat_template = LLAMA3_STYLE
    sample = tokenize_conversation(tokenizer, CONVERSATION, max_tokens=4096)
    assert trained_text(tokenizer, sample) == ["The answer is 5.<|endoftext|>", "9<|endoftext|>"]


def test_a_template_that_rewrites_earlier_turns_is_refused_by_name(tokenizer):
    tokenizer = build_tokenizer()
    # Like templates that drop earlier reasoning: an assistant turn renders differently once it is not the last.
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}{{ '<|im_start|>assistant\n'"
        " + m['content'][:1] + '<|im_end|>\n' }}{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] +"
        " '<|im_end|>\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
        "{% endif %}")
    with pytest.raises(DataError, match="not render a conversation's messages as a prefix"):
        tokenize_conversation(tokenizer, CONVERSATION, max_tokens=4096)


def test_long_conversations_are_cut_with_their_mask(tokenizer):
    full = tokenize_conversation(tokenizer, CONVERSATION, max_tokens=4096)
    cut = tokenize_conversation(tokenizer, CONVERSATION, max_tokens=20)
    assert cut.token_ids == full.token_ids[:20] and cut.loss_mask == full.loss_mask[:20]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_parquet_and_datasets_dirs_give_the_same_conversations(tmp_path):
    import datasets

    rows = [{"messages": CONVERSATION}, {"messages": CONVERSATION[1:3]}]
    jsonl = write_jsonl(tmp_path / "train.jsonl", rows)
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "train.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "dict"))
    expected = [CONVERSATION, CONVERSATION[1:3]]
    for source in (jsonl, tmp_path / "train.parquet", tmp_path / "saved", tmp_path / "dict"):
        assert list(read_conversations(source)) == expected, source
    with pytest.raises(DataError, match="no split 'eval'"):
        list(read_conversations(tmp_path / "dict", split="eval"))


@pytest.mark.parametrize("line, message", [
    ("{not json", r"train.jsonl:2: not JSON"),
    ('["a list"]', r"train.jsonl:2: expected an object with 'messages'"),
    ('{"messages": []}', r"train.jsonl:2: 'messages' must be a non-empty list"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', r"train.jsonl:2: messages\[0\] must have a role"),
    ('{"messages": [{"role": "user", "content": 3}]}', r"train.jsonl:2: messages\[0\] must have a role"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', r"train.jsonl:2: no assistant message"),
])
def test_a_bad_jsonl_line_is_named_with_file_and_line(tmp_path, line, message):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATION}) + "\n" + line + "\n")
    with pytest.raises(DataError, match=message):
        list(read_conversations(path))


def test_missing_sources_and_columns_are_named(tmp_path):
    import datasets

    with pytest.raises(DataError, match="no such file"):
        list(read_conversations(tmp_path / "nope.jsonl"))
    datasets.Dataset.from_list([{"text": "x"}]).to_parquet(str(tmp_path / "t.parquet"))
    with pytest.raises(DataError, match="no 'messages' column \\(columns: text\\)"):
        list(read_conversations(tmp_path / "t.parquet"))


def test_sft_samples_pack_into_rows_whose_positions_restart_per_conversation(tokenizer):
    samples = [tokenize_conversation(tokenizer, c, 4096) for c in (CONVERSATION, CONVERSATION[1:3], CONVERSATION)]
    lengths = [len(s.token_ids) for s in samples]
    ranks = pack(lengths, dp_size=1, micro_batch_tokens=sum(lengths))
    assert sorted(i for mb in ranks[0] for i in mb) == [0, 1, 2]
    arrays = to_arrays(samples)
    starts = [i for i, p in enumerate(arrays["position_ids"]) if p == 0]
    assert starts == [0, lengths[0], lengths[0] + lengths[1]]
    assert arrays["loss_mask"].sum() == sum(sum(s.loss_mask) for s in samples)
