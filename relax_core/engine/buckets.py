"""Weight buckets: a push cut into flat byte buffers of a bounded size (SGLang's
``flattened_bucket``).

A trainer that pushes a model in one payload holds every tensor's handle or bytes at once and
makes the engine open one CUDA IPC handle per tensor; cut into buckets, the push is one flat
``uint8`` buffer per bucket — one IPC handle, one ``broadcast`` or one safetensors file each —
and the engine unflattens each into its parameters.

:func:`plan_weight_buckets` groups ``(name, tensor)`` pairs, in their order, into
:class:`WeightBucket` records (pure Python: it reads each tensor's shape, dtype and element
size, and imports no torch). A bucket's tensors lie back to back in its buffer, in order, with
no padding: SGLang's layout, so the same record describes the buffer of
``update_weights_from_tensor`` (``load_format="flattened_bucket"``: :meth:`WeightBucket.serialize`)
and the one broadcast of ``update_weights_from_distributed`` with that ``load_format`` (its
``names``, ``dtypes`` and ``shapes`` are the record's).

A tensor larger than the bucket size is not split: it gets a bucket of its own, so a bucket is
at most ``max(bucket_bytes, largest tensor)`` bytes.
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

__all__ = ["WeightBucket", "plan_weight_buckets"]


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


@attrs.frozen
class WeightBucket:
    """One bucket of a weight push: its tensors' ``names``, ``dtypes`` (``"bfloat16"``),
    ``shapes`` and byte ``offsets`` in the bucket's flat buffer (back to back, in order), and
    the buffer's size ``nbytes``. Picklable, torch-free; build it with
    :func:`plan_weight_buckets`.

    :raises ValueError: the fields disagree (lengths, offsets not back to back).
    """

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

    def flatten(self, tensors: Mapping[str, Any], *, device: Any = None) -> Any:
        """A new flat ``uint8`` tensor of ``nbytes`` holding the bucket's tensors (looked up by
        name in ``tensors``) back to back, on ``device`` (default: the first tensor's). The
        tensors are read, never kept.

        :raises ValueError: a tensor's dtype or shape is not the bucket's.
        :raises KeyError: a name of the bucket is missing from ``tensors``.
        """
        import torch

        first = tensors[self.names[0]]
        flat = torch.empty(self.nbytes, dtype=torch.uint8, device=device or first.device)
        for name, dtype, shape, start, size in zip(
            self.names, self.dtypes, self.shapes, self.offsets, self.sizes(), strict=True
        ):
            tensor = tensors[name]
            if _dtype_name(tensor.dtype) != dtype or tuple(tensor.shape) != shape:
                raise ValueError(
                    f"WeightBucket.flatten: {name!r} is {_dtype_name(tensor.dtype)} "
                    f"{list(tensor.shape)}, the bucket has {dtype} {list(shape)}"
                )
            # Bytes, not elements: a tensor's offset need not be a multiple of its item size.
            source = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            flat[start : start + size].copy_(source, non_blocking=True)
        return flat

    def serialize(self, flat: Any) -> str:
        """SGLang's ``flattened_bucket`` payload of ``flat`` (this bucket's buffer) for
        ``update_weights_from_tensor``: a ``torch.multiprocessing`` pickle (base64) of
        ``{"flattened_tensor": flat, "metadata": [...]}``, each metadata entry with SGLang's
        fields ``name``, ``shape``, ``dtype``, ``start_idx``, ``end_idx``, ``numel`` (bytes).

        The entries are ``types.SimpleNamespace`` (which SGLang's safe unpickler admits), so
        neither end needs the other's classes. A CUDA ``flat`` travels as one IPC handle (the
        caller keeps it alive until the update returned); a CPU one as shared memory (the sender
        needs ``torch.multiprocessing.set_sharing_strategy("file_system")``).

        :raises ValueError: ``flat`` is not a 1-D ``uint8`` tensor of ``nbytes``.
        """
        from multiprocessing.reduction import ForkingPickler
        from types import SimpleNamespace

        import torch
        import torch.multiprocessing  # registers torch's reductions

        if flat.dtype != torch.uint8 or tuple(flat.shape) != (self.nbytes,):
            raise ValueError(
                f"WeightBucket.serialize: the buffer must be uint8 [{self.nbytes}], got "
                f"{_dtype_name(flat.dtype)} {list(flat.shape)}"
            )
        metadata = [
            SimpleNamespace(
                name=name,
                shape=torch.Size(shape),
                dtype=getattr(torch, dtype),
                start_idx=start,
                end_idx=start + size,
                numel=size,
            )
            for name, dtype, shape, start, size in zip(
                self.names, self.dtypes, self.shapes, self.offsets, self.sizes(), strict=True
            )
        ]
        buf = io.BytesIO()
        ForkingPickler(buf).dump({"flattened_tensor": flat, "metadata": metadata})
        return base64.b64encode(buf.getvalue()).decode("ascii")


def plan_weight_buckets(
    named_tensors: Iterable[tuple[str, Any]], bucket_bytes: int
) -> list[WeightBucket]:
    """Group ``(name, tensor)`` pairs, in order, into buckets of at most ``bucket_bytes``
    (a tensor larger than that gets a bucket of its own). Reads shapes, dtypes and element
    sizes only; pure.

    :raises ValueError: ``bucket_bytes`` is not a positive integer, no tensors, or a name
        given twice.
    """
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be a positive integer, got {bucket_bytes!r}")
    buckets: list[WeightBucket] = []
    seen: set[str] = set()
    names: list[str] = []
    dtypes: list[str] = []
    shapes: list[tuple[int, ...]] = []
    offsets: list[int] = []
    size = 0

    def close() -> None:
        nonlocal size
        if names:
            buckets.append(
                WeightBucket(tuple(names), tuple(dtypes), tuple(shapes), tuple(offsets), size)
            )
        names.clear()
        dtypes.clear()
        shapes.clear()
        offsets.clear()
        size = 0

    for name, tensor in named_tensors:
        if name in seen:
            raise ValueError(f"plan_weight_buckets: {name!r} is given twice")
        seen.add(name)
        shape = tuple(int(d) for d in tensor.shape)
        nbytes = math.prod(shape) * int(tensor.element_size())
        if names and size + nbytes > bucket_bytes:
            close()
        names.append(name)
        dtypes.append(_dtype_name(tensor.dtype))
        shapes.append(shape)
        offsets.append(size)
        size += nbytes
    close()
    if not buckets:
        raise ValueError("plan_weight_buckets: no tensors to push")
    return buckets
