"""Batch sinks (:class:`BatchSink`): where a deferred batch publishes its scored samples; batch
``N`` goes to partition ``train_N``, readable once a put with ``is_last`` closed it."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, cast, runtime_checkable

import attrs

from relax_core._proxy import remote_errors
from relax_core.errors import SinkError

_PARTITION = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]*$")


def partition_name(batch_id: int) -> str:
    """The training partition of batch ``batch_id``: ``train_{batch_id}``."""
    return f"train_{batch_id}"


@attrs.frozen
class SinkReceipt:
    """What a successful put returns: the partition, the samples it holds, whether it closed."""

    partition: str
    count: int
    is_last: bool


@runtime_checkable
class BatchSink(Protocol):
    """Where committed training batches are read from."""

    async def put(self, partition: str, samples: Sequence[Any], *, is_last: bool) -> SinkReceipt:
        """Append ``samples`` to ``partition`` (``is_last`` closes it); raise on failure."""
        ...

    async def get(self, partition: str) -> list[Any]:
        """Every sample of a closed partition; raise if it is missing or still open."""
        ...

    async def delete(self, partition: str) -> bool:
        """Remove ``partition``; whether it existed. Idempotent."""
        ...


class MemoryBatchSink:
    """A batch sink in this process, also the store a :class:`RayBatchSink` actor holds. Every
    failure is a ``SinkError``: a bad name, a closed or missing partition."""

    def __init__(self) -> None:
        self._data: dict[str, tuple[list[Any], bool, int]] = {}

    async def put(
        self, partition: str, samples: Sequence[Any], *, is_last: bool, count: int | None = None
    ) -> SinkReceipt:
        """Append to ``partition`` (``is_last`` closes it); ``count``: the samples ``samples``
        stand for (a :class:`RayBatchSink`'s one reference to them), default their number."""
        if not isinstance(partition, str) or not _PARTITION.match(partition):
            raise SinkError(str(partition), "a partition name starts with a letter")
        items = list(samples)
        held, closed, n = self._data.get(partition, ([], False, 0))
        if closed:
            raise SinkError(
                partition, "already closed by a put with is_last=True; delete it first to rewrite"
            )
        n += len(items) if count is None else count
        self._data[partition] = (held + items, bool(is_last), n)
        return SinkReceipt(partition, n, bool(is_last))

    async def get(self, partition: str) -> list[Any]:
        """The samples of a closed partition (a new list of the same sample objects)."""
        entry = self._data.get(partition)
        if entry is None:
            raise SinkError(partition, f"no such partition (held: {sorted(self._data) or 'none'})")
        if not entry[1]:
            raise SinkError(partition, "still open: its last put (is_last=True) has not arrived")
        return list(entry[0])

    async def delete(self, partition: str) -> bool:
        """Remove ``partition``; whether it existed."""
        return self._data.pop(partition, None) is not None

    def partitions(self) -> dict[str, int]:
        """Partition name -> samples held."""
        return {name: n for name, (_, _, n) in self._data.items()}


class RayBatchSink:
    """The built-in batch sink: partitions held by a CPU-only Ray actor (:meth:`start`, or
    :meth:`connect` by name); picklable. Every failure is a ``SinkError`` naming the partition."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    @classmethod
    def start(cls, *, name: str | None = None, namespace: str | None = None) -> RayBatchSink:
        """Create the store actor (no CPU, no GPU reserved) on the connected Ray."""
        import ray

        options: dict[str, Any] = {"num_cpus": 0, "num_gpus": 0, "max_restarts": 0}
        if name is not None:
            options.update(name=name, namespace=namespace)
        return cls(ray.remote(MemoryBatchSink).options(**options).remote())

    @classmethod
    def connect(cls, name: str, *, namespace: str | None = None) -> RayBatchSink:
        """The store actor called ``name``; :class:`SinkError` when there is none."""
        import ray

        try:
            return cls(ray.get_actor(name, namespace=namespace))
        except ValueError as exc:
            raise SinkError(name, f"no batch-store actor of that name: {exc}") from None

    def _errors(self, method: str, partition: str) -> AbstractContextManager[None]:
        def error(why: str) -> SinkError:
            return SinkError(partition, f"{method}: {why}")

        return remote_errors(error, actor="the store actor", keep=SinkError)

    async def put(self, partition: str, samples: Sequence[Any], *, is_last: bool) -> SinkReceipt:
        """Append ``samples`` to ``partition`` (all or nothing): put into Ray's object store
        once, the actor holding a reference (only the reader unpickles them)."""
        import ray

        items = list(samples)
        with self._errors("put", partition):
            ref = [ray.put(items)]  # in a list: the actor gets the reference, not the samples
            receipt = await self.actor.put.remote(partition, ref, is_last=is_last, count=len(items))
        return cast("SinkReceipt", receipt)

    async def get(self, partition: str) -> list[Any]:
        """The samples of a closed partition."""
        with self._errors("get", partition):
            refs = await self.actor.get.remote(partition)
            return [s for part in await asyncio.gather(*refs) for s in part]

    async def delete(self, partition: str) -> bool:
        """Remove ``partition``; whether it existed."""
        with self._errors("delete", partition):
            return cast("bool", await self.actor.delete.remote(partition))

    async def partitions(self) -> dict[str, int]:
        """Partition name -> samples held."""
        with self._errors("partitions", "*"):
            return cast("dict[str, int]", await self.actor.partitions.remote())

    def stop(self, *, timeout: float = 10.0) -> None:
        """Kill the store actor (its partitions lost) and wait up to ``timeout`` s until it
        answers no more. Idempotent. Blocking.

        :raises SinkError: (partition ``*``) the actor still answered after ``timeout``."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        ray.kill(self.actor, no_restart=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                ray.get(
                    self.actor.partitions.remote(), timeout=max(0.01, deadline - time.monotonic())
                )
            except (RayActorError, GetTimeoutError):
                return
        raise SinkError("*", f"the batch store actor still answers {timeout:g}s after its kill")
