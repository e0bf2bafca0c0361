"""Weight-update transports: serialized tensors and a torch.distributed broadcast group.

``/update_weights_from_tensor`` payloads are base64 strings in one of two formats:

- ``load_format`` null / ``"default"``: SGLang's own, a ``torch.multiprocessing`` pickle of
  ``[(name, tensor), …]``. CUDA tensors arrive as IPC handles (zero-copy on the same GPU).
  Unpickling runs code chosen by the sender: serve this engine only to trusted callers, as
  with SGLang.
- ``"safetensors"``: the bytes of a safetensors file (no pickle; any host, any device).

The broadcast group (``/init_weights_update_group``) is this process's default
``torch.distributed`` group: the trainer is rank 0, the engine ``rank_offset``; gloo on CPU,
NCCL on CUDA. One group at a time.
"""

from __future__ import annotations

import base64
import binascii
import datetime
from collections.abc import Sequence
from typing import Any

import torch

from relax_hf.runner import WeightsError

__all__ = ["WeightsGroup", "decode_named_tensors", "parse_dtype"]

LOAD_FORMATS = (None, "default", "safetensors")


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
            f"load_format: {load_format!r} is not supported; use null (SGLang's) or 'safetensors'"
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
    ) -> list[tuple[str, torch.Tensor]]:
        """Receive each tensor by a broadcast from rank 0, in order."""
        import torch.distributed as dist

        nccl = self.backend == "nccl"
        where = device if nccl else torch.device("cpu")
        if nccl:
            torch.cuda.set_device(device)
        out = []
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
