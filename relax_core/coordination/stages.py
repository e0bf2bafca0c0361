"""What a deferred scoring stage is, and what it gets to reach the roles' engines.

A stage (:class:`Stage`) scores the staged copies of a batch's samples in place: a reward stage
(reward adapters, possibly a genrm judge), a teacher stage (distillation prefill), a student
stage (prefill on the policy itself). Stages run in the reference's order — every ``reward``
stage, then ``distill``, then ``student`` (:data:`PHASES`) — and a stage whose ``role`` is a
deferred role runs inside that role's lease. ``writes`` names the fields it fills; the batch
validates exactly those before anything is written back.

:class:`RoleClients` hands each stage the running event loop's one
:class:`~relax_core.client.client.InferenceClient` per role
(:func:`~relax_core.client.pool.get_client`), so a stage that sends one request per sample
reuses one connection pool and one discovery snapshot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs

from relax_core.client.client import InferenceClient
from relax_core.client.pool import get_client
from relax_core.coordination.sample import SCORED_FIELDS, Sample

__all__ = ["PHASES", "RoleClients", "Stage", "StageContext", "StageReport"]

#: The stage phases, in the order a batch runs them.
PHASES: tuple[str, ...] = ("reward", "distill", "student")


@attrs.frozen
class StageReport:
    """What a stage reports about its run: named counts (``parse_failures``, ``requests``) and
    details (``group_engines``: which engine scored each group)."""

    stage: str
    counts: Mapping[str, float] = attrs.field(factory=dict)
    details: Mapping[str, Any] = attrs.field(factory=dict)


class RoleClients:
    """Where each role's engines are discovered, and the loop's shared client for each.

    :param sources: role -> a discovery source: a base URL serving ``/engines?schema=2`` (a
        role gateway ``http://host:port/teacher`` or a registry), or a snapshot provider
        callable (sync or async) returning a ``RoleSnapshot`` or a schema-2 dict.
    :param options: :class:`~relax_core.client.client.InferenceClient` options (``ttl``,
        ``timeout``, …), the same for every role.
    """

    def __init__(self, sources: Mapping[str, Any], **options: Any) -> None:
        self.sources = dict(sources)
        self.options = options

    def client(self, role: str) -> InferenceClient:
        """The running event loop's client for ``role`` (one per loop, reused).

        :raises KeyError: no discovery source was given for ``role``.
        """
        source = self.sources.get(role)
        if source is None:
            raise KeyError(
                f"no discovery source for role {role!r} (have: {sorted(self.sources)}); give one "
                "in RoleClients(sources)"
            )
        if isinstance(source, str):
            return get_client(source, role=role, **self.options)
        return get_client(snapshot_provider=source, role=role, **self.options)


@attrs.frozen
class StageContext:
    """What a stage gets besides the samples: the batch id and the role clients."""

    batch_id: int
    clients: RoleClients


@runtime_checkable
class Stage(Protocol):
    """A deferred scoring stage.

    ``name``: shown in the timeline and in errors. ``phase``: one of :data:`PHASES`. ``role``:
    the role whose engines it uses (``None``: CPU only); when that role is deferred the batch
    activates it first and deactivates it afterwards, whatever happened. ``writes``: the
    :data:`~relax_core.coordination.sample.SCORED_FIELDS` it fills. ``top_k``: the top-k width
    it writes (0: none).
    """

    @property
    def name(self) -> str: ...

    @property
    def phase(self) -> str: ...

    @property
    def role(self) -> str | None: ...

    @property
    def writes(self) -> frozenset[str]: ...

    @property
    def top_k(self) -> int: ...

    async def run(self, samples: Sequence[Sample], ctx: StageContext) -> StageReport:
        """Fill ``writes`` on every staged sample; raise on any failure."""
        ...


def check_stages(stages: Sequence[Stage]) -> None:
    """Refuse stages out of the reference's order or writing unknown fields.

    :raises ValueError: naming the stage.
    """
    rank = -1
    names: set[str] = set()
    for stage in stages:
        if stage.phase not in PHASES:
            raise ValueError(f"stage {stage.name!r}: phase {stage.phase!r} is not one of {PHASES}")
        if PHASES.index(stage.phase) < rank:
            raise ValueError(
                f"stage {stage.name!r} ({stage.phase}) comes after a later phase; stages run "
                f"in the order {' -> '.join(PHASES)}"
            )
        rank = PHASES.index(stage.phase)
        unknown = set(stage.writes) - set(SCORED_FIELDS)
        if unknown:
            raise ValueError(
                f"stage {stage.name!r} writes unknown fields {sorted(unknown)}; scored fields "
                f"are {SCORED_FIELDS}"
            )
        if stage.name in names:
            raise ValueError(f"two stages are called {stage.name!r}")
        names.add(stage.name)
