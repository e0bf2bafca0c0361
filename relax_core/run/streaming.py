"""Streaming scoring: the step's leading streaming stages run on each group's staged copies
as soon as it is generated; nothing they write reaches the originals before the batch commits."""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Sequence
from typing import Any

from relax_core._concurrent import gather_all
from relax_core.coordination.batch import Dropped, Streamed
from relax_core.coordination.sample import Sample
from relax_core.coordination.stages import RoleClients, Stage, StageContext, StageReport
from relax_core.coordination.timeline import Timeline


def streaming_prefix(
    stages: Sequence[Stage], *, deferred: Collection[str], generation_role: str
) -> int:
    """How many leading ``stages`` can score group by group: each declares ``streaming`` and
    takes no lease (its role is none, or neither deferred nor the generation role)."""
    count = 0
    for stage in stages:
        role = stage.role
        if not getattr(stage, "streaming", False):
            break
        if role is not None and (role in deferred or role == generation_role):
            break
        count += 1
    return count


def merge_reports(stage: str, reports: Sequence[StageReport]) -> StageReport:
    """One report of ``stage`` from its reports on each group: counts summed; details merged
    (tables updated, lists joined, other values the last one)."""
    counts: dict[str, float] = {}
    details: dict[str, Any] = {}
    for report in reports:
        for key, value in report.counts.items():
            counts[key] = counts.get(key, 0) + value
        for key, value in report.details.items():
            have = details.get(key)
            if isinstance(value, dict):
                details[key] = {**(have if isinstance(have, dict) else {}), **value}
            elif isinstance(value, list):
                details[key] = [*(have if isinstance(have, list) else []), *value]
            else:
                details[key] = value
    return StageReport(stage, counts, details)


class StreamScorer:
    """Runs ``stages[:count]`` on each group of batch ``batch_id`` as it is added;
    ``fields``: every field the step's stages write (cleared on the staged copies)."""

    def __init__(
        self,
        batch_id: int,
        stages: Sequence[Stage],
        count: int,
        *,
        fields: Collection[str],
        clients: RoleClients,
        concurrency: int = 8,
        timeline: Timeline | None = None,
    ) -> None:
        self.batch_id = batch_id
        self.stages = tuple(stages[:count])
        self.fields = tuple(fields)
        self.clients = clients
        self.timeline = timeline or Timeline()
        self._gate = asyncio.Semaphore(concurrency)
        self._staged: list[Sample] = []
        self._reports: list[list[StageReport]] = [[] for _ in self.stages]
        self._tasks: list[asyncio.Task[None]] = []
        self.dropped: list[Dropped] = []
        self.dropped_samples: list[Sample] = []

    def add(self, group: Sequence[Sample]) -> None:
        """Stage ``group`` (copies without the stages' fields) and queue its scoring."""
        staged = [s.staged_copy(self.fields) for s in group]
        self._staged.extend(staged)
        if self.stages:
            self._tasks.append(asyncio.ensure_future(self._score(staged)))

    def drop(self, group: Sequence[Sample], dropped: Dropped) -> None:
        """Record a group taken out before the batch (never staged, never committed)."""
        self.dropped.append(dropped)
        self.dropped_samples.extend(group)

    async def _score(self, staged: list[Sample]) -> None:
        async with self._gate:
            ctx = StageContext(self.batch_id, self.clients)
            for i, stage in enumerate(self.stages):
                with self.timeline.phase(self.batch_id, f"{stage.name}.stream", lane=stage.name):
                    self._reports[i].append(await stage.run(staged, ctx))

    async def finish(self) -> Streamed:
        """Wait for every queued group; the batch's :class:`Streamed`.

        :raises Exception: the first group's stage failure (the others are cancelled)."""
        await gather_all(self._tasks)
        return Streamed(
            staged=list(self._staged),
            stages=len(self.stages),
            reports=[
                merge_reports(s.name, r) for s, r in zip(self.stages, self._reports, strict=True)
            ],
            dropped=list(self.dropped),
            dropped_samples=list(self.dropped_samples),
        )

    async def cancel(self) -> None:
        """Stop every scoring in flight (the batch will not be committed)."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
