"""Deltas (`weights.delta`): what changed in a tensor since the previous step, element by element, and back.

    change = encode(old, new)            # the trainer's feed, at a publish: None where `new` goes whole
    where = positions(form, raw, numel, changed)    # a worker, reading a delta: which elements changed
    tensor = rebuild(base, where, values)           # ... applied to a copy of the tensor it kept

A change is `(form, where, values)`: `values` the changed elements of `new` (flat, in order) and `where`
their positions, as int32 flat indices (form "index") or a bit per element in numpy's packbits order (form
"mask"), whichever is smaller. Elements are compared by their bits, so -0.0, NaN and a value that rounds to
the same bf16 all count right. A tensor whose delta would not be smaller than itself goes whole (None).

Torch and numpy are imported when a delta is made or read: the control plane imports this module without them.
"""

from __future__ import annotations

import math

FORMS = ("index", "mask")
"""How a delta says where its values go."""


class BadDelta(ValueError):
    """A delta whose positions do not fit the tensor it is for (out of range, or a mask of another count)."""


def encode(old, new):
    """(form, where, values) for the elements of `new` whose bits differ from `old`'s; None where sending `new`
    whole is no larger (or `old` is not the same kind of tensor)."""
    import numpy as np
    import torch

    if old is None or old.dtype != new.dtype or old.shape != new.shape or new.numel() >= 2**31:
        return None
    bits = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[new.element_size()]
    flat_new, flat_old = new.reshape(-1), old.reshape(-1)
    if new.dtype == torch.bool:
        flat_new, flat_old = flat_new.view(torch.uint8), flat_old.view(torch.uint8)
    moved = flat_new.view(bits) != flat_old.view(bits)
    changed = int(moved.sum())
    mask_bytes, index_bytes = (new.numel() + 7) // 8, 4 * changed
    if min(mask_bytes, index_bytes) + changed * new.element_size() >= new.numel() * new.element_size():
        return None
    if index_bytes <= mask_bytes:
        index = torch.nonzero(moved).reshape(-1)
        return "index", index.to(torch.int32), new.reshape(-1)[index].contiguous()
    return "mask", torch.from_numpy(np.packbits(moved.numpy())), new.reshape(-1)[moved].contiguous()


def where_bytes(form: str, numel: int, changed: int) -> int:
    """How many bytes a delta's positions take: 4 per changed element, or a bit per element."""
    return 4 * changed if form == "index" else (numel + 7) // 8


def positions(form: str, raw, numel: int, changed: int):
    """The positions a delta's `raw` bytes (a uint8 tensor of `where_bytes`) name: int64 flat indices, or a bool
    mask; BadDelta when they do not fit a tensor of `numel` elements with `changed` of them changed."""
    import numpy as np
    import torch

    if form == "index":
        where = raw.view(torch.int32).long()
        if changed and not (0 <= int(where.min()) and int(where.max()) < numel):
            raise BadDelta("a delta index out of range")
        return where
    where = torch.from_numpy(np.unpackbits(raw.numpy(), count=numel).view(np.bool_))
    if int(where.sum()) != changed:
        raise BadDelta(f"the mask marks {int(where.sum())} elements, the header {changed}")
    return where


def rebuild(base, where, values):
    """A copy of `base` with the elements at `where` set to `values` (the base itself is never written)."""
    tensor = base.clone()
    tensor.view(-1)[where] = values
    return tensor


def narrow_change(change, shape: tuple[int, ...], dim: int, start: int, end: int):
    """The part of a whole tensor's `change` (encode's) that falls in `tensor.narrow(dim, start, end - start)`, as a
    change of that piece (None: the piece goes whole, its delta no smaller); dim 0 or 1 of `shape`."""
    import numpy as np
    import torch

    form, where, values = change
    numel = math.prod(shape)
    flat = (torch.nonzero(positions(form, where, numel, values.numel())).reshape(-1) if form == "mask"
            else where.long())
    inner = math.prod(shape[dim + 1:])
    outer_len = shape[dim]
    coord = (flat // inner) % outer_len
    keep = (coord >= start) & (coord < end)
    kept, piece_values = flat[keep], values[keep]
    width = end - start
    new = (kept // (outer_len * inner)) * (width * inner) + (coord[keep] - start) * inner + kept % inner
    piece_numel = numel // outer_len * width
    changed, size = int(new.numel()), values.element_size()
    mask_bytes, index_bytes = (piece_numel + 7) // 8, 4 * changed
    if min(mask_bytes, index_bytes) + changed * size >= piece_numel * size:
        return None
    if index_bytes <= mask_bytes:
        return "index", new.to(torch.int32), piece_values.contiguous()
    bits = torch.zeros(piece_numel, dtype=torch.bool)
    bits[new] = True
    return "mask", torch.from_numpy(np.packbits(bits.numpy())), piece_values.contiguous()
