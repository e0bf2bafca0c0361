"""Weight buckets: a push cut into flat byte buffers of a bounded size (SGLang's
``flattened_bucket`` layout), planned without torch; filling a buffer is a trainer plugin's."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import attrs


@attrs.frozen
class WeightBucket:
    """One bucket of a weight push: its tensors' ``names``, ``dtypes``, ``shapes`` and byte
    ``offsets`` in its flat buffer of ``nbytes``. Built by :func:`plan_weight_buckets`.
    :raises ValueError: the fields disagree (lengths, offsets not back to back)."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    nbytes: int

    def __attrs_post_init__(self) -> None:
        n = len(self.names)
        if not n or not len(self.dtypes) == len(self.shapes) == len(self.offsets) == n:
            raise ValueError(
                f"WeightBucket: names, dtypes, shapes and offsets must be equally long and not "
                f"empty, got {n}, {len(self.dtypes)}, {len(self.shapes)}, {len(self.offsets)}"
            )
        ends = (*self.offsets[1:], self.nbytes)
        if self.offsets[0] != 0 or any(e < o for o, e in zip(self.offsets, ends, strict=True)):
            raise ValueError(f"WeightBucket: offsets {self.offsets} are not back to back")

    def sizes(self) -> tuple[int, ...]:
        """Each tensor's byte count."""
        ends = (*self.offsets[1:], self.nbytes)
        return tuple(e - o for o, e in zip(self.offsets, ends, strict=True))


def plan_weight_buckets(
    named_tensors: Iterable[tuple[str, Any]], bucket_bytes: int
) -> list[WeightBucket]:
    """Group ``(name, tensor)`` pairs, in order, into buckets of at most ``bucket_bytes`` (a
    larger tensor: a bucket of its own). Pure.
    :raises ValueError: a bad ``bucket_bytes``, no tensors, or a name given twice."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be a positive integer, got {bucket_bytes!r}")
    buckets: list[WeightBucket] = []
    seen: set[str] = set()
    rows: list[tuple[str, str, tuple[int, ...], int]] = []  # name, dtype, shape, offset
    size = 0
    for name, tensor in named_tensors:
        if name in seen:
            raise ValueError(f"plan_weight_buckets: {name!r} is given twice")
        seen.add(name)
        shape = tuple(int(d) for d in tensor.shape)
        nbytes = math.prod(shape) * int(tensor.element_size())
        if rows and size + nbytes > bucket_bytes:
            buckets.append(_bucket(rows, size))
            rows, size = [], 0
        rows.append((name, str(tensor.dtype).removeprefix("torch."), shape, size))
        size += nbytes
    if not rows:
        raise ValueError("plan_weight_buckets: no tensors to push")
    return [*buckets, _bucket(rows, size)]


def _bucket(rows: list[tuple[str, str, tuple[int, ...], int]], size: int) -> WeightBucket:
    names, dtypes, shapes, offsets = zip(*rows, strict=True)
    return WeightBucket(names, dtypes, shapes, offsets, size)
