"""The rollout batch: what the orchestrator hands the trainer for one step.

One step is one directory, `rollouts/step_N/` (published with
`RunDir.publish_dir`, so it has a STABLE marker), holding `batch.safetensors`.
safetensors because it is a JSON header plus raw little-endian arrays: no
pickle (a reader cannot be made to run code), memory-mappable, readable from
numpy without torch, and fast (a copy of the bytes). T is the number of
tokens of all samples together, S the number of samples:

    input_ids           int32   [T]    token ids, samples concatenated
    loss_mask           uint8   [T]    1 = sampled by the policy and trained on
    advantages          float32 [T]    per-token advantage (a sample's, repeated)
    inference_logprobs  float32 [T]    logprob of the token under the engine's sampling
                                       policy; 0 where loss_mask is 0
    position_ids        int32   [T]    positions inside each sample, from 0
    teacher_logprobs    float32 [T]    (with a `teacher:`) the teacher's logprob of each sampled token, 0
                                       where loss_mask is 0: on-policy distillation
    reference_logprobs  float32 [T]    (with a `reference:`) the frozen reference model's, likewise
    sample_offsets      int64   [S+1]  sample i is tokens [off[i], off[i+1])
    policy_version      int32   [S]    weights step that generated sample i (when its rollout started)
    policy_version_end  int32   [S]    weights step the server served when the rollout finished: newer
                                       than policy_version when a weight update landed mid-rollout
                                       (absent in batches written before it existed)
    images              uint8   [B]    (vision-language rollouts) every picture of every sample, as the
                                       encoded file bytes the server was sent (PNG, JPEG, ...), back to back
    image_offsets       int64   [I+1]  picture j is images[off[j]:off[j+1]]
    sample_images       int64   [S+1]  sample i's pictures are [si[i], si[i+1]), in prompt order (the order of
                                       their placeholders in its token ids)
    routed_experts      uint8   [T,L,K] (router replay) the experts the inference server's MoE layer l routed
                                       token t to (its top-k ids; uint16 for models of over 256 experts);
                                       rows of dense layers are unused
    routed_mask         uint8   [T]    1 where routed_experts holds the server's routes, 0 where the trainer
                                       routes the token itself (a sample whose server returned none)

and string metadata: `format` ("prl.rollouts/1"), `step`, `packing`, the
JSON of the split into per-rank micro-batches (below) for the `dp_size` and
`micro_batch_tokens` it was made for, and `data_order`, the JSON of which
tasks of the orchestrator's task stream this step consumed (its resume point,
prl/orchestrator/continuous.py). The first token of a sample never has
loss (nothing predicts it), which also keeps packed samples independent.

Packing: samples go to data-parallel ranks longest first, each to the rank
with the fewest tokens so far (balanced token counts), then into micro-batches
of at most `micro_batch_tokens` tokens (first fit; a longer sample gets a
micro-batch of its own). Every rank gets the same number of micro-batches
(FSDP ranks must run the same number of forward/backward passes), padded with
empty ones. A micro-batch is the samples concatenated into one row whose
position ids restart at 0 for every sample; transformers then builds a
block-diagonal causal mask. A trainer with another `dp_size` (a resume on a
different number of ranks) repacks with the same deterministic function.

Pictures travel as the bytes the server decoded, not as pixel tensors: a 56x56 PNG is a few hundred bytes
where its processed pixels are 37 KB in fp32; the trainer re-runs the model's own image processor on them
(prl/trainer/vision.py), as vLLM did. A sample's pictures may hold at most MAX_SAMPLE_IMAGE_BYTES.

Routes (router replay, `training.router_replay`) are L x K bytes per token (a 48-layer top-8 model: 384 B,
next to the 17 B of the other per-token arrays); they cover every token of a sample whose rollout returned
them, the last one a copy of the one before (no forward pass of the server follows it; verifiers pads so).

numpy and safetensors are imported lazily; this module imports without them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from prl.errors import RunDirError
from prl.states import Role

if TYPE_CHECKING:
    import numpy as np

    from prl.run.rundir import RunDir

FORMAT = "prl.rollouts/1"
BATCH_FILE = "batch.safetensors"

_DTYPES = {
    "input_ids": "int32",
    "loss_mask": "uint8",
    "advantages": "float32",
    "inference_logprobs": "float32",
    "position_ids": "int32",
}
TOKEN_FIELDS = tuple(_DTYPES)
IMAGE_FIELDS = ("images", "image_offsets", "sample_images")
ROUTE_FIELDS = ("routed_experts", "routed_mask")
ROUTE_DTYPES = ("uint8", "uint16")
MAX_SAMPLE_IMAGE_BYTES = 64 * 2**20
"""A sample's pictures, encoded, at most (the most a server takes in one request's pictures)."""
SCORE_FIELDS = {Role.TEACHER: "teacher_logprobs", Role.REFERENCE: "reference_logprobs"}
"""Per-token logprobs of the scoring servers (by role), present when the run has them."""


class BatchError(RunDirError):
    """A rollout batch is malformed (lengths, masks, format)."""


@dataclass
class Sample:
    """One trajectory branch as the orchestrator produced it."""

    token_ids: Sequence[int]
    """Prompt and completion token ids."""
    loss_mask: Sequence[int]
    """1 for tokens the policy sampled (trained on), 0 for prompt / tool / env tokens."""
    inference_logprobs: Sequence[float]
    """The engine's sampling logprob of each token (any value where loss_mask is 0)."""
    advantage: float | Sequence[float]
    """The sample's advantage, or one per token."""
    policy_version: int = 0
    """Weights step that generated it (0 = base model), when its rollout started."""
    policy_version_end: int | None = None
    """Weights step the server served when the rollout finished (None: `policy_version`)."""
    position_ids: Sequence[int] | None = None
    """Defaults to 0..len-1."""
    scores: dict[str, Sequence[float]] = field(default_factory=dict)
    """Scoring role (`teacher`, `reference`) -> its logprob of each token (0 where loss_mask is 0)."""
    images: Sequence[bytes] = ()
    """The prompt's pictures as encoded files (PNG, JPEG, ...), in the order of their placeholders."""
    routed_experts: np.ndarray | None = None
    """[len(token_ids), layers, top_k] expert ids the server routed each token to (None: it returned none)."""


def pack(lengths: Sequence[int], dp_size: int, micro_batch_tokens: int) -> list[list[list[int]]]:
    """Split samples into `dp_size` ranks x equal numbers of micro-batches (lists of sample indices)."""
    if dp_size < 1 or micro_batch_tokens < 1:
        raise BatchError(f"pack needs dp_size >= 1 and micro_batch_tokens >= 1, got {dp_size}, {micro_batch_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    loads = [0] * dp_size
    per_rank: list[list[int]] = [[] for _ in range(dp_size)]
    for i in order:
        r = min(range(dp_size), key=lambda k: (loads[k], k))
        per_rank[r].append(i)
        loads[r] += lengths[i]
    ranks = []
    for samples in per_rank:
        bins: list[list[int]] = []
        fill: list[int] = []
        for i in samples:
            for b, used in enumerate(fill):
                if used + lengths[i] <= micro_batch_tokens:
                    bins[b].append(i)
                    fill[b] += lengths[i]
                    break
            else:
                bins.append([i])
                fill.append(lengths[i])
        ranks.append([sorted(b) for b in bins])
    n_micro = max(1, max(len(r) for r in ranks))
    return [r + [[] for _ in range(n_micro - len(r))] for r in ranks]


@dataclass
class MicroBatch:
    """Samples concatenated into one packed row (numpy arrays of length num_tokens)."""

    sample_ids: list[int]
    input_ids: np.ndarray
    position_ids: np.ndarray
    loss_mask: np.ndarray
    advantages: np.ndarray
    inference_logprobs: np.ndarray
    teacher_logprobs: np.ndarray | None = None
    reference_logprobs: np.ndarray | None = None
    images: list[bytes] = field(default_factory=list)
    """The row's pictures (encoded), in row order: sample by sample, each in its prompt order."""
    routed_experts: np.ndarray | None = None
    """[num_tokens, layers, top_k] server routes (router replay), with `routed_mask`; None without."""
    routed_mask: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class RolloutBatch:
    """A step's samples (flat arrays as in the file) plus the packing it was written with."""

    step: int
    arrays: dict[str, np.ndarray]
    packing: dict
    meta: dict[str, str] = field(default_factory=dict)
    """The file's other string metadata (`data_order`)."""

    @property
    def offsets(self) -> np.ndarray:
        return self.arrays["sample_offsets"]

    @property
    def num_samples(self) -> int:
        return int(self.offsets.shape[0] - 1)

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def num_loss_tokens(self) -> int:
        return int(self.arrays["loss_mask"].sum())

    def lengths(self) -> list[int]:
        return [int(n) for n in (self.offsets[1:] - self.offsets[:-1])]

    def micro_batches(self, rank: int, dp_size: int, micro_batch_tokens: int) -> list[MicroBatch | None]:
        """This rank's micro-batches (None = padding: run a dummy pass, contribute nothing)."""
        import numpy as np

        p = self.packing
        if p.get("dp_size") == dp_size and p.get("micro_batch_tokens") == micro_batch_tokens:
            ranks = p["ranks"]
        else:
            ranks = pack(self.lengths(), dp_size, micro_batch_tokens)
        out: list[MicroBatch | None] = []
        for ids in ranks[rank]:
            if not ids:
                out.append(None)
                continue
            spans = [slice(int(self.offsets[i]), int(self.offsets[i + 1])) for i in ids]
            fields = TOKEN_FIELDS + tuple(k for k in (*SCORE_FIELDS.values(), *ROUTE_FIELDS) if k in self.arrays)
            cat = {k: np.concatenate([self.arrays[k][s] for s in spans]) for k in fields}
            out.append(MicroBatch(sample_ids=list(ids), **cat, images=[p for i in ids for p in self.images_of(i)]))
        return out

    def images_of(self, sample: int) -> list[bytes]:
        """Sample `sample`'s pictures (encoded), in prompt order; [] for a text-only batch."""
        if "sample_images" not in self.arrays:
            return []
        first, last = (int(j) for j in self.arrays["sample_images"][sample:sample + 2])
        off, data = self.arrays["image_offsets"], self.arrays["images"]
        return [data[int(off[j]):int(off[j + 1])].tobytes() for j in range(first, last)]


def to_arrays(samples: Sequence[Sample]) -> dict[str, np.ndarray]:
    """Flatten samples into the file's arrays, checking each one."""
    import numpy as np

    scored = sorted(samples[0].scores) if samples else []
    cols: dict[str, list] = {k: [] for k in (*TOKEN_FIELDS, *(SCORE_FIELDS[r] for r in scored))}
    offsets, versions, ends = [0], [], []
    for i, s in enumerate(samples):
        n = len(s.token_ids)
        adv = [float(s.advantage)] * n if isinstance(s.advantage, (int, float)) else list(s.advantage)
        pos = list(range(n)) if s.position_ids is None else list(s.position_ids)
        fields = {
            "input_ids": list(s.token_ids),
            "loss_mask": list(s.loss_mask),
            "advantages": adv,
            "inference_logprobs": list(s.inference_logprobs),
            "position_ids": pos,
        }
        if sorted(s.scores) != scored:
            raise BatchError(f"sample {i} is scored by {sorted(s.scores)}, sample 0 by {scored}")
        fields |= {SCORE_FIELDS[role]: list(values) for role, values in s.scores.items()}
        bad = {k: len(v) for k, v in fields.items() if len(v) != n}
        if n == 0 or bad:
            raise BatchError(f"sample {i}: {n} token ids but field lengths {bad}" if bad else f"sample {i} is empty")
        for k, v in fields.items():
            cols[k].extend(v)
        offsets.append(offsets[-1] + n)
        versions.append(int(s.policy_version))
        ends.append(int(s.policy_version if s.policy_version_end is None else s.policy_version_end))
    arrays = {k: np.asarray(v, dtype=_DTYPES.get(k, "float32")) for k, v in cols.items()}
    arrays |= image_arrays(samples)
    arrays |= route_arrays(samples)
    arrays["sample_offsets"] = np.asarray(offsets, dtype="int64")
    arrays["policy_version"] = np.asarray(versions, dtype="int32")
    arrays["policy_version_end"] = np.asarray(ends, dtype="int32")
    validate(arrays)
    return arrays


class NotADataURL(ValueError):
    """A picture named by a URL prl would have to fetch (it never does)."""


def picture_bytes(url: str) -> bytes:
    """The encoded picture of a `data:image/...;base64,` URL, the one form in which pictures reach prl (the
    server's generate route, the orchestrator's rollouts, SFT data); NotADataURL for any other URL,
    binascii.Error (a ValueError) for a payload that is not base64."""
    import base64

    head, _, data = url.partition(",")
    if not (head.startswith("data:image/") and head.endswith(";base64")):
        raise NotADataURL(f"only data:image/...;base64 URLs are read (nothing is fetched), got {url[:40]!r}")
    return base64.b64decode(data, validate=True)


def image_arrays(samples: Sequence[Sample]) -> dict[str, np.ndarray]:
    """The pictures' arrays ({} when no sample has one), refusing a sample over MAX_SAMPLE_IMAGE_BYTES."""
    import numpy as np

    if not any(s.images for s in samples):
        return {}
    pictures, per_sample = [], [0]
    for i, s in enumerate(samples):
        size = sum(len(p) for p in s.images)
        if size > MAX_SAMPLE_IMAGE_BYTES:
            raise BatchError(f"sample {i}: its {len(s.images)} pictures hold {size / 2**20:.1f} MiB, over the "
                             f"batch format's {MAX_SAMPLE_IMAGE_BYTES // 2**20} MiB per sample")
        pictures += [bytes(p) for p in s.images]
        per_sample.append(len(pictures))
    sizes = np.asarray([0] + [len(p) for p in pictures], dtype="int64")
    return {"images": np.frombuffer(b"".join(pictures), dtype="uint8").copy(),
            "image_offsets": np.cumsum(sizes), "sample_images": np.asarray(per_sample, dtype="int64")}


def route_arrays(samples: Sequence[Sample]) -> dict[str, np.ndarray]:
    """The routes' arrays ({} when no sample has routes): every sample's, zeros under mask 0 for one without."""
    import numpy as np

    have = [s.routed_experts for s in samples if s.routed_experts is not None]
    if not have:
        return {}
    shape, dtype = have[0].shape[1:], have[0].dtype
    rows, mask = [], []
    for i, s in enumerate(samples):
        n, r = len(s.token_ids), s.routed_experts
        if r is None:
            rows.append(np.zeros((n, *shape), dtype=dtype))
            mask.append(np.zeros(n, dtype="uint8"))
            continue
        if r.shape != (n, *shape) or r.dtype != dtype:
            raise BatchError(f"sample {i}: routed_experts {r.dtype}{list(r.shape)}, expected {dtype}{[n, *shape]} "
                             f"(one row per token, the layers and top-k of sample 0's)")
        rows.append(r)
        mask.append(np.ones(n, dtype="uint8"))
    return {"routed_experts": np.concatenate(rows), "routed_mask": np.concatenate(mask)}


def validate_routes(arrays: dict[str, np.ndarray], total: int) -> None:
    """Raise BatchError unless the routes' arrays (both or none) hold one [layers, top_k] row and a mask per token."""
    present = [k for k in ROUTE_FIELDS if k in arrays]
    missing = [k for k in ROUTE_FIELDS if k not in arrays]
    if not present:
        return
    if missing:
        raise BatchError(f"rollout batch has {present[0]} without {missing[0]}")
    routes, mask = arrays["routed_experts"], arrays["routed_mask"]
    if routes.ndim != 3 or routes.shape[0] != total or str(routes.dtype) not in ROUTE_DTYPES:
        raise BatchError(f"routed_experts is {routes.dtype}{list(routes.shape)}, expected uint8 or uint16 "
                         f"[{total} tokens, layers, top_k]")
    if mask.shape != (total,) or str(mask.dtype) != "uint8":
        raise BatchError(f"routed_mask is {mask.dtype}{list(mask.shape)}, expected uint8 [{total}]")


def validate_images(arrays: dict[str, np.ndarray], samples: int) -> None:
    """Raise BatchError unless the pictures' arrays (all three or none) index the bytes and the samples."""
    import numpy as np

    present = [k for k in IMAGE_FIELDS if k in arrays]
    if not present:
        return
    if len(present) != len(IMAGE_FIELDS):
        raise BatchError(f"rollout batch has {', '.join(present)} without the other picture arrays")
    off, per, data = arrays["image_offsets"], arrays["sample_images"], arrays["images"]
    if off.ndim != 1 or off.size < 1 or off[0] != 0 or np.any(np.diff(off) <= 0) or off[-1] != data.size:
        raise BatchError("image_offsets must start at 0, strictly increase and end at the size of images")
    if per.shape != (samples + 1,) or per[0] != 0 or np.any(np.diff(per) < 0) or per[-1] != off.size - 1:
        raise BatchError(f"sample_images needs {samples + 1} entries from 0 to the {off.size - 1} pictures")


def validate(arrays: dict[str, np.ndarray]) -> None:
    """Raise BatchError unless the arrays form a well-formed batch."""
    import numpy as np

    missing = [k for k in (*TOKEN_FIELDS, "sample_offsets", "policy_version") if k not in arrays]
    if missing:
        raise BatchError(f"rollout batch lacks {', '.join(missing)}")
    off = arrays["sample_offsets"]
    total = int(off[-1]) if off.size else -1
    if off.ndim != 1 or off.size < 1 or off[0] != 0 or np.any(np.diff(off) <= 0):
        raise BatchError("sample_offsets must start at 0 and strictly increase")
    if arrays["policy_version"].shape != (off.size - 1,):
        raise BatchError(f"policy_version has {arrays['policy_version'].shape} entries for {off.size - 1} samples")
    end = arrays.get("policy_version_end")
    if end is not None and (end.shape != arrays["policy_version"].shape or np.any(end < arrays["policy_version"])):
        raise BatchError("policy_version_end needs one entry per sample, none older than its policy_version")
    for k in (*TOKEN_FIELDS, *(f for f in SCORE_FIELDS.values() if f in arrays)):
        if arrays[k].shape != (total,):
            raise BatchError(f"{k} has shape {arrays[k].shape}, expected ({total},) tokens")
    if np.any(arrays["loss_mask"][off[:-1]] != 0):
        first = int(np.flatnonzero(arrays["loss_mask"][off[:-1]])[0])
        raise BatchError(f"sample {first}: its first token has loss_mask 1, but nothing predicts a first token")
    for k in ("advantages", "inference_logprobs", *(f for f in SCORE_FIELDS.values() if f in arrays)):
        if not np.all(np.isfinite(arrays[k])):
            raise BatchError(f"{k} contains NaN or inf")
    if np.any(arrays["input_ids"] < 0) or np.any(arrays["position_ids"] < 0):
        raise BatchError("input_ids and position_ids must be >= 0")
    validate_images(arrays, off.size - 1)
    validate_routes(arrays, total)


def write_batch(
    out_dir: str | Path, samples: Sequence[Sample], *, step: int, dp_size: int, micro_batch_tokens: int,
    meta: dict[str, str] | None = None,
) -> Path:
    """Write `out_dir/batch.safetensors` (use inside `RunDir.publish_dir`, or see `publish_batch`)."""
    from safetensors.numpy import save_file

    arrays = to_arrays(samples)
    lengths = [int(n) for n in (arrays["sample_offsets"][1:] - arrays["sample_offsets"][:-1])]
    packing = {
        "dp_size": dp_size,
        "micro_batch_tokens": micro_batch_tokens,
        "ranks": pack(lengths, dp_size, micro_batch_tokens),
    }
    path = Path(out_dir) / BATCH_FILE
    header = {**(meta or {}), "format": FORMAT, "step": str(step), "packing": json.dumps(packing)}
    save_file(arrays, str(path), metadata=header)
    return path


def publish_batch(run: RunDir, step: int, samples: Sequence[Sample], *, dp_size: int, micro_batch_tokens: int,
                  meta: dict[str, str] | None = None) -> Path:
    """Atomically publish `rollouts/step_N` for the trainer (`meta`: more string metadata)."""
    return run.publish_dir(
        run.rollouts(step),
        lambda d: write_batch(d, samples, step=step, dp_size=dp_size, micro_batch_tokens=micro_batch_tokens,
                              meta=meta),
        step=step,
        samples=len(samples),
    )


def read_batch(step_dir: str | Path) -> RolloutBatch:
    """Read and validate a published step's batch."""
    from safetensors import safe_open

    path = Path(step_dir) / BATCH_FILE
    if not path.is_file():
        raise BatchError(f"{path} is missing")
    with safe_open(str(path), framework="np") as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise BatchError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
        arrays = {k: f.get_tensor(k) for k in f.keys()}
    validate(arrays)
    extra = {k: v for k, v in meta.items() if k not in ("format", "step", "packing")}
    return RolloutBatch(step=int(meta.get("step", -1)), arrays=arrays, packing=json.loads(meta.get("packing", "{}")),
                        meta=extra)


def read_meta(step_dir: str | Path) -> dict[str, str]:
    """A published step's string metadata, without reading its arrays ({} when it has no batch file)."""
    from safetensors import safe_open

    path = Path(step_dir) / BATCH_FILE
    if not path.is_file():
        return {}
    with safe_open(str(path), framework="np") as f:
        return dict(f.metadata() or {})
