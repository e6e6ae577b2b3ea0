"""The rollout batch file format and the micro-batch packing."""

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from prl.run.batch import BATCH_FILE, BatchError, Sample, pack, publish_batch, read_batch, write_batch
from prl.run.rundir import RunDir, is_stable


def _samples(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [
        Sample(
            token_ids=rng.integers(0, 100, n).tolist(),
            loss_mask=[0] + [1] * (n - 1),
            inference_logprobs=rng.normal(-2, 0.1, n).tolist(),
            advantage=float(i),
            policy_version=i % 3,
        )
        for i, n in enumerate(lengths)
    ]


@pytest.mark.parametrize("dp_size, cap", [(1, 64), (2, 64), (3, 50), (4, 1000), (2, 10)])
def test_pack_covers_every_sample_once_balanced_with_equal_micro_batch_counts(dp_size, cap):
    lengths = np.random.default_rng(dp_size).integers(1, 40, 37).tolist()
    ranks = pack(lengths, dp_size, cap)
    assert len(ranks) == dp_size
    assert len({len(r) for r in ranks}) == 1, "every rank runs the same number of micro-batches"
    seen = sorted(i for r in ranks for mb in r for i in mb)
    assert seen == list(range(len(lengths)))
    for r in ranks:
        for mb in r:
            assert len(mb) <= 1 or sum(lengths[i] for i in mb) <= cap
    loads = [sum(lengths[i] for mb in r for i in mb) for r in ranks]
    assert max(loads) - min(loads) <= max(lengths)


def test_pack_pads_ranks_with_fewer_samples_than_ranks():
    ranks = pack([5], 2, 100)
    assert ranks == [[[0]], [[]]]
    assert pack([], 2, 100) == [[[]], [[]]]


def test_pack_is_deterministic_and_refuses_bad_sizes():
    lengths = [7, 3, 9, 9, 1, 4]
    assert pack(lengths, 2, 12) == pack(list(lengths), 2, 12)
    with pytest.raises(BatchError):
        pack(lengths, 0, 12)


def test_round_trip_and_micro_batches(tmp_path):
    samples = _samples([5, 9, 3, 12, 7])
    path = write_batch(tmp_path, samples, step=3, dp_size=2, micro_batch_tokens=16)
    b = read_batch(tmp_path)
    assert path.name == BATCH_FILE and b.step == 3 and b.num_samples == 5 and b.num_tokens == 36
    assert b.num_loss_tokens == 36 - 5
    assert b.arrays["input_ids"].dtype == np.int32 and b.arrays["advantages"].dtype == np.float32
    assert b.arrays["policy_version"].tolist() == [0, 1, 2, 0, 1]
    assert b.arrays["policy_version_end"].tolist() == [0, 1, 2, 0, 1]  # unset: the start version
    per_rank = [b.micro_batches(r, 2, 16) for r in range(2)]
    assert len(per_rank[0]) == len(per_rank[1])
    got = {}
    for mbs in per_rank:
        for mb in mbs:
            if mb is None:
                continue
            assert mb.num_tokens <= 16 or len(mb.sample_ids) == 1
            start = 0
            for i in mb.sample_ids:
                n = len(samples[i].token_ids)
                assert mb.input_ids[start : start + n].tolist() == samples[i].token_ids
                assert mb.position_ids[start : start + n].tolist() == list(range(n))
                assert np.all(mb.advantages[start : start + n] == i)
                got[i] = True
                start += n
    assert sorted(got) == list(range(5))
    # Another dp size (a resume on fewer ranks) repacks deterministically.
    one = b.micro_batches(0, 1, 16)
    assert sorted(i for mb in one for i in mb.sample_ids) == list(range(5))


def test_file_is_plain_safetensors_not_pickle(tmp_path):
    write_batch(tmp_path, _samples([4, 4]), step=1, dp_size=1, micro_batch_tokens=8)
    raw = (tmp_path / BATCH_FILE).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    assert header["__metadata__"]["format"] == "prl.rollouts/1"
    assert set(header) - {"__metadata__"} == {
        "input_ids",
        "loss_mask",
        "advantages",
        "inference_logprobs",
        "position_ids",
        "sample_offsets",
        "policy_version",
        "policy_version_end",
    }


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(loss_mask=[1, 1, 1]), "first token"),
        (dict(loss_mask=[0, 1]), "field lengths"),
        (dict(inference_logprobs=[0.0, float("nan"), 0.0]), "NaN"),
        (dict(token_ids=[]), "empty"),
    ],
)
def test_malformed_samples_are_refused(tmp_path, bad, match):
    fields = dict(token_ids=[1, 2, 3], loss_mask=[0, 1, 1], inference_logprobs=[0.0, -1.0, -1.0], advantage=1.0)
    fields.update(bad)
    if bad.get("token_ids") == []:
        fields.update(loss_mask=[], inference_logprobs=[])
    with pytest.raises(BatchError, match=match):
        write_batch(tmp_path, [Sample(**fields)], step=1, dp_size=1, micro_batch_tokens=8)


def test_publish_batch_goes_through_the_run_dir(tmp_path):
    run = RunDir(tmp_path / "run").create()
    d = publish_batch(run, 1, _samples([3, 4]), dp_size=1, micro_batch_tokens=8)
    assert d == run.rollouts(1) and is_stable(d)
    assert read_batch(run.wait_for_step("rollouts", 1, timeout=1)).num_samples == 2


def test_control_plane_imports_stay_light():
    code = (
        "import sys, prl.run.rundir, prl.run.batch, prl.errors; "
        "bad = {'torch', 'numpy', 'safetensors', 'transformers'} & set(sys.modules); assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


def test_end_versions_and_metadata_round_trip(tmp_path):
    """`policy_version_end` (the version a rollout finished on) and extra string metadata survive the file;
    an end version older than the start is refused."""
    from prl.run.batch import read_meta

    samples = _samples([4, 5])
    samples[0].policy_version_end = 3
    write_batch(tmp_path, samples, step=2, dp_size=1, micro_batch_tokens=16, meta={"data_order": '{"below": 2}'})
    b = read_batch(tmp_path)
    assert b.arrays["policy_version_end"].tolist() == [3, 1] and b.meta == {"data_order": '{"below": 2}'}
    assert read_meta(tmp_path)["data_order"] == '{"below": 2}' and read_meta(tmp_path / "nothing") == {}
    samples[1].policy_version_end = 0  # sample 1 started on version 1
    with pytest.raises(BatchError, match="policy_version_end"):
        write_batch(tmp_path / "bad", samples, step=2, dp_size=1, micro_batch_tokens=16)


def test_scored_samples_carry_each_scorers_logprobs_into_the_micro_batches(tmp_path):
    samples = [Sample([1, 2, 3], [0, 1, 1], [0, -0.5, -0.25], 1.0, scores={"teacher": [0, -1.0, -2.0]}),
               Sample([4, 5], [0, 1], [0, -0.75], -1.0, scores={"teacher": [0, -3.0]})]
    write_batch(tmp_path, samples, step=1, dp_size=1, micro_batch_tokens=16)
    batch = read_batch(tmp_path)
    assert batch.arrays["teacher_logprobs"].tolist() == [0, -1.0, -2.0, 0, -3.0]
    (mb,) = batch.micro_batches(0, 1, 16)
    assert mb.teacher_logprobs.tolist() == [0, -1.0, -2.0, 0, -3.0] and mb.reference_logprobs is None
    unscored = [Sample([1, 2], [0, 1], [0, -0.5], 1.0)]
    write_batch(tmp_path, unscored, step=1, dp_size=1, micro_batch_tokens=16)
    assert "teacher_logprobs" not in read_batch(tmp_path).arrays


def test_samples_scored_by_different_roles_or_lengths_are_refused(tmp_path):
    a = Sample([1, 2], [0, 1], [0, -0.5], 1.0, scores={"teacher": [0, -1.0]})
    with pytest.raises(BatchError, match=r"sample 1 is scored by \[\], sample 0 by \['teacher'\]"):
        write_batch(tmp_path, [a, Sample([1, 2], [0, 1], [0, -0.5], 1.0)], step=1, dp_size=1, micro_batch_tokens=16)
    with pytest.raises(BatchError, match="field lengths {'teacher_logprobs': 1}"):
        write_batch(tmp_path, [Sample([1, 2], [0, 1], [0, -0.5], 1.0, scores={"teacher": [0]})], step=1, dp_size=1,
                    micro_batch_tokens=16)
