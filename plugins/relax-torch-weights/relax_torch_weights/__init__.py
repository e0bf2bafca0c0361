"""The torch side of a weight push: payloads of ``(name, tensor)`` pairs, and the flat buffers
of :class:`relax_core.WeightBucket` records (SGLang's ``flattened_bucket``).

The core plans a push without torch (:func:`relax_core.plan_weight_buckets`); this library is
for whoever holds the tensors (a trainer, an engine's benchmark) and imports torch.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterable, Mapping
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace
from typing import Any

import torch
import torch.multiprocessing  # registers torch's reductions with ForkingPickler

from relax_core import WeightBucket

__all__ = ["flatten_bucket", "serialize_bucket", "serialize_named_tensors"]


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def serialize_named_tensors(
    named_tensors: Iterable[tuple[str, Any]], *, load_format: str | None = None
) -> str:
    """Encode ``(name, tensor)`` pairs for ``/update_weights_from_tensor``.

    ``load_format=None`` is SGLang's own format: a ``torch.multiprocessing`` pickle, base64.
    CUDA tensors travel as IPC handles (the engine must be on the same host and GPU, and the
    caller must keep the tensors alive until the call returns); CPU tensors travel as shared
    memory and need ``torch.multiprocessing.set_sharing_strategy("file_system")`` in the sender.
    ``load_format="safetensors"`` copies the bytes (any host, any device; understood by the
    ``hf`` engine, not by SGLang).

    :raises ValueError: an unknown ``load_format``.
    """
    pairs = list(named_tensors)
    if load_format == "safetensors":
        from safetensors.torch import save

        data = save({name: t.detach().contiguous().cpu() for name, t in pairs})
        return base64.b64encode(data).decode("ascii")
    if load_format is None:
        buf = io.BytesIO()
        ForkingPickler(buf).dump(pairs)
        return base64.b64encode(buf.getvalue()).decode("ascii")
    raise ValueError(f"load_format={load_format!r}: use None (SGLang's format) or 'safetensors'")


def flatten_bucket(
    bucket: WeightBucket, tensors: Mapping[str, Any], *, device: Any = None
) -> torch.Tensor:
    """A new flat ``uint8`` tensor of ``bucket.nbytes`` holding the bucket's tensors (looked up
    by name in ``tensors``) back to back, on ``device`` (default: the first tensor's). The
    tensors are read, never kept.

    :raises ValueError: a tensor's dtype or shape is not the bucket's.
    :raises KeyError: a name of the bucket is missing from ``tensors``.
    """
    first = tensors[bucket.names[0]]
    flat = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device or first.device)
    for name, dtype, shape, start, size in zip(
        bucket.names, bucket.dtypes, bucket.shapes, bucket.offsets, bucket.sizes(), strict=True
    ):
        tensor = tensors[name]
        if _dtype_name(tensor.dtype) != dtype or tuple(tensor.shape) != shape:
            raise ValueError(
                f"flatten_bucket: {name!r} is {_dtype_name(tensor.dtype)} "
                f"{list(tensor.shape)}, the bucket has {dtype} {list(shape)}"
            )
        # Bytes, not elements: a tensor's offset need not be a multiple of its item size.
        source = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        flat[start : start + size].copy_(source, non_blocking=True)
    return flat


def serialize_bucket(bucket: WeightBucket, flat: torch.Tensor) -> str:
    """SGLang's ``flattened_bucket`` payload of ``flat`` (``bucket``'s buffer, from
    :func:`flatten_bucket`) for ``update_weights_from_tensor``: a ``torch.multiprocessing``
    pickle (base64) of ``{"flattened_tensor": flat, "metadata": [...]}``, each metadata entry
    with SGLang's fields ``name``, ``shape``, ``dtype``, ``start_idx``, ``end_idx``, ``numel``
    (bytes).

    The entries are ``types.SimpleNamespace`` (which SGLang's safe unpickler admits), so
    neither end needs the other's classes. A CUDA ``flat`` travels as one IPC handle (the
    caller keeps it alive until the update returned); a CPU one as shared memory (the sender
    needs ``torch.multiprocessing.set_sharing_strategy("file_system")``).

    :raises ValueError: ``flat`` is not a 1-D ``uint8`` tensor of ``bucket.nbytes``.
    """
    if flat.dtype != torch.uint8 or tuple(flat.shape) != (bucket.nbytes,):
        raise ValueError(
            f"serialize_bucket: the buffer must be uint8 [{bucket.nbytes}], got "
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
            bucket.names, bucket.dtypes, bucket.shapes, bucket.offsets, bucket.sizes(), strict=True
        )
    ]
    buf = io.BytesIO()
    ForkingPickler(buf).dump({"flattened_tensor": flat, "metadata": metadata})
    return base64.b64encode(buf.getvalue()).decode("ascii")
