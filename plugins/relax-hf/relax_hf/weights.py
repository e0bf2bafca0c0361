"""Weight-update transports: serialized tensors and a torch.distributed broadcast group.

``/update_weights_from_tensor`` payloads are base64 strings in one of two formats:

- ``load_format`` null / ``"default"``: SGLang's own, a ``torch.multiprocessing`` pickle of
  ``[(name, tensor), …]``. CUDA tensors arrive as IPC handles (zero-copy on the same GPU).
  Unpickling runs code chosen by the sender: serve this engine only to trusted callers, as
  with SGLang.
- ``"safetensors"``: the bytes of a safetensors file (no pickle; any host, any device).
- ``"flattened_bucket"``: SGLang's bucket, the same pickle of ``{"flattened_tensor": a 1-D
  uint8 tensor, "metadata": [...]}``, each metadata entry naming a tensor's ``name``,
  ``shape``, ``dtype`` and byte range ``start_idx``/``end_idx`` (``numel``: its bytes) in the
  flat buffer, as attributes (SGLang's ``FlattenedTensorMetadata``, a ``SimpleNamespace``) or
  keys. A CUDA bucket is one IPC handle; :func:`unflatten` cuts it into its tensors (views).

The broadcast group (``/init_weights_update_group``) is this process's default
``torch.distributed`` group: the trainer is rank 0, the engine ``rank_offset``; gloo on CPU,
NCCL on CUDA. One group at a time. With ``load_format: "flattened_bucket"`` an update's
tensors arrive as one broadcast of their flat buffer (SGLang's), not one each.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from relax_hf.runner import WeightsError

__all__ = ["WeightsGroup", "decode_named_tensors", "parse_dtype", "unflatten"]

LOAD_FORMATS = (None, "default", "safetensors", "flattened_bucket")
#: The ``load_format`` of a bucket: one flat buffer for several tensors (SGLang's name).
FLATTENED = "flattened_bucket"


def parse_dtype(name: Any, field: str) -> torch.dtype:
    """``"bfloat16"`` or ``"torch.bfloat16"`` → ``torch.bfloat16``. :raises WeightsError:"""
    text = str(name).removeprefix("torch.")
    dtype = getattr(torch, text, None)
    if not isinstance(dtype, torch.dtype):
        raise WeightsError(f"{field}: unknown dtype {name!r} (e.g. 'bfloat16', 'float32')")
    return dtype


def decode_named_tensors(
    payload: Any, load_format: str | None, field: str
) -> list[tuple[str, torch.Tensor]]:
    """Decode one serialized payload into ``(name, tensor)`` pairs. :raises WeightsError:"""
    if load_format not in LOAD_FORMATS:
        raise WeightsError(
            f"load_format: {load_format!r} is not supported; use null (SGLang's), "
            "'flattened_bucket' or 'safetensors'"
        )
    if not isinstance(payload, str):
        raise WeightsError(f"{field}: must be a base64 string, got {type(payload).__name__}")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise WeightsError(f"{field}: not valid base64 ({exc})") from exc
    if load_format == "safetensors":
        from safetensors.torch import load

        try:
            return list(load(raw).items())
        except Exception as exc:  # safetensors raises its own SafetensorError
            raise WeightsError(f"{field}: not a safetensors payload ({exc})") from exc
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing

    try:
        obj = ForkingPickler.loads(raw)
    except Exception as exc:  # any unpickling failure is the caller's payload
        raise WeightsError(
            f"{field}: cannot unpickle the payload ({type(exc).__name__}: {exc})"
        ) from exc
    if load_format == FLATTENED:
        return _bucket_of(obj, field)
    items = list(obj.items()) if isinstance(obj, dict) else obj
    if not isinstance(items, list | tuple) or not all(
        isinstance(it, list | tuple)
        and len(it) == 2
        and isinstance(it[0], str)
        and isinstance(it[1], torch.Tensor)
        for it in items
    ):
        raise WeightsError(f"{field}: expected a list of (name, tensor) pairs")
    return [(str(n), t) for n, t in items]


def _meta(entry: Any, key: str) -> Any:
    """A metadata entry's field: an attribute (SGLang's record) or a key (a dict)."""
    if isinstance(entry, Mapping):
        return entry.get(key)
    return getattr(entry, key, None)


def _bucket_of(obj: Any, field: str) -> list[tuple[str, torch.Tensor]]:
    """The tensors of an unpickled ``flattened_bucket`` payload. :raises WeightsError:"""
    if not isinstance(obj, Mapping) or not {"flattened_tensor", "metadata"} <= set(obj):
        raise WeightsError(
            f"{field}: a flattened_bucket payload is a dict with 'flattened_tensor' and 'metadata'"
        )
    metadata = obj["metadata"]
    if not isinstance(metadata, list | tuple):
        raise WeightsError(f"{field}.metadata: must be a list, got {type(metadata).__name__}")
    entries = []
    for i, entry in enumerate(metadata):
        name, shape, start, end = (
            _meta(entry, k) for k in ("name", "shape", "start_idx", "end_idx")
        )
        where = f"{field}.metadata[{i}]"
        if not isinstance(name, str) or not name:
            raise WeightsError(f"{where}.name: must be a non-empty string, got {name!r}")
        if not isinstance(shape, list | tuple) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise WeightsError(f"{where}.shape: must be a list of sizes, got {shape!r}")
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (start, end)):
            raise WeightsError(f"{where}: start_idx and end_idx must be integers")
        dtype = _meta(entry, "dtype")
        entries.append(
            (
                name,
                tuple(shape),
                dtype if isinstance(dtype, torch.dtype) else parse_dtype(dtype, f"{where}.dtype"),
                start,
                end,
            )
        )
    return unflatten(obj["flattened_tensor"], entries, f"{field}.metadata")


def unflatten(
    flat: Any,
    entries: Sequence[tuple[str, tuple[int, ...], torch.dtype, int, int]],
    field: str,
) -> list[tuple[str, torch.Tensor]]:
    """Cut a bucket's flat ``uint8`` buffer into its ``(name, tensor)`` pairs: each entry's
    ``(name, shape, dtype, start, end)`` names its byte range. Views of ``flat`` where the
    range is aligned to the dtype, copies otherwise.

    :raises WeightsError: ``flat`` is not a 1-D uint8 tensor, or a range is outside it, does
        not hold ``shape`` of ``dtype``, overlaps another or names a tensor twice.
    """
    if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1:
        described = (
            f"{str(flat.dtype).removeprefix('torch.')} {list(flat.shape)}"
            if isinstance(flat, torch.Tensor)
            else type(flat).__name__
        )
        raise WeightsError(
            f"{field}: the bucket's buffer must be a 1-D uint8 tensor, got {described}"
        )
    if not entries:
        raise WeightsError(f"{field}: an empty bucket")
    size = flat.numel()
    out: list[tuple[str, torch.Tensor]] = []
    seen: set[str] = set()
    covered = 0
    for name, shape, dtype, start, end in sorted(entries, key=lambda e: e[3]):
        want = math.prod(shape) * dtype.itemsize
        if not 0 <= start <= end <= size:
            raise WeightsError(
                f"{field}: {name!r} spans bytes [{start}, {end}) of a {size}-byte bucket"
            )
        if end - start != want:
            raise WeightsError(
                f"{field}: {name!r} is {str(dtype).removeprefix('torch.')} {list(shape)} "
                f"({want} bytes) but spans {end - start} bytes [{start}, {end})"
            )
        if start < covered or name in seen:
            raise WeightsError(
                f"{field}: {name!r} overlaps another tensor of the bucket or is given twice"
            )
        seen.add(name)
        covered = end
        raw = flat[start:end]
        if start % dtype.itemsize:
            raw = raw.clone()  # a view of another dtype needs an aligned start
        out.append((name, raw.view(dtype).view(shape)))
    return out


class WeightsGroup:
    """The broadcast group a trainer pushes weights through (one at a time)."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.backend: str | None = None
        self.rank: int | None = None
        self.world_size: int | None = None

    def init(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
        device: torch.device,
        timeout_s: float,
    ) -> None:
        """Join the trainer's rendezvous (blocks until every rank joined or ``timeout_s``)."""
        import torch.distributed as dist

        if self.name is not None:
            raise WeightsError(
                f"group_name: group {self.name!r} is already initialized; destroy it first"
            )
        if backend not in ("gloo", "nccl"):
            raise WeightsError(f"backend: {backend!r} is not supported; use 'gloo' or 'nccl'")
        if backend == "nccl" and device.type != "cuda":
            raise WeightsError("backend: 'nccl' needs an engine on CUDA; use 'gloo' on CPU")
        if not 1 <= rank_offset < world_size:
            raise WeightsError(
                f"rank_offset: must be in [1, world_size={world_size}), got {rank_offset}"
            )
        extra: dict[str, Any] = {}
        if backend == "nccl":
            # Bind the group to the engine GPU (eager NCCL init; current device is per thread).
            torch.cuda.set_device(device)
            extra["device_id"] = device
        try:
            dist.init_process_group(
                backend=backend,
                init_method=f"tcp://{master_address}:{master_port}",
                world_size=world_size,
                rank=rank_offset,
                timeout=datetime.timedelta(seconds=timeout_s),
                **extra,
            )
        except Exception as exc:  # rendezvous failures come as RuntimeError/DistStoreError/…
            raise WeightsError(
                f"init_weights_update_group: joining tcp://{master_address}:{master_port} as rank "
                f"{rank_offset}/{world_size} failed: {type(exc).__name__}: {exc}"
            ) from exc
        self.name, self.backend, self.rank, self.world_size = (
            group_name,
            backend,
            rank_offset,
            world_size,
        )

    def check(self, group_name: str) -> None:
        """:raises WeightsError: no group, or a different one, is initialized."""
        if self.name is None:
            raise WeightsError(
                "group_name: no weights update group; call init_weights_update_group first"
            )
        if group_name != self.name:
            raise WeightsError(
                f"group_name: {group_name!r} is not the initialized group {self.name!r}"
            )

    def receive(
        self,
        names: Sequence[str],
        dtypes: Sequence[torch.dtype],
        shapes: Sequence[Sequence[int]],
        device: torch.device,
        *,
        flattened: bool = False,
    ) -> list[tuple[str, torch.Tensor]]:
        """Receive each tensor by a broadcast from rank 0, in order; ``flattened``: all of
        them by one broadcast of their flat buffer, back to back (SGLang's
        ``flattened_bucket``)."""
        import torch.distributed as dist

        nccl = self.backend == "nccl"
        where = device if nccl else torch.device("cpu")
        if nccl:
            torch.cuda.set_device(device)
        out = []
        if flattened:
            entries = []
            offset = 0
            for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
                end = offset + math.prod(shape) * dtype.itemsize
                entries.append((name, tuple(shape), dtype, offset, end))
                offset = end
            flat = torch.empty(offset, dtype=torch.uint8, device=where)
            dist.broadcast(flat, src=0)
            out = unflatten(flat, entries, "names")
        else:
            for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
                buf = torch.empty(tuple(shape), dtype=dtype, device=where)
                dist.broadcast(buf, src=0)
                out.append((name, buf))
        if nccl:
            torch.cuda.synchronize(device)
        return out

    def destroy(self, group_name: str) -> None:
        """Leave the group (idempotent for the initialized name)."""
        import torch.distributed as dist

        self.check(group_name)
        dist.destroy_process_group()
        self.name = self.backend = self.rank = self.world_size = None
