"""What a step stage is: the fields it writes, the role whose lease it needs, and what it gets to
reach the roles' engines and the batch it runs in.

A stage (:class:`Stage`) scores or reshapes the staged copies of a batch's samples: the reward
stage (reward adapters, possibly a genrm judge), the teacher's distillation prefill, a process
reward model, a filter that drops groups and has more generated, an evaluation on held-out
prompts. A step runs its stages in the order the job file lists them. A stage whose ``role``
is a deferred role runs inside that role's lease (its ``models`` only, when it names some); one
whose role is the generation role runs with the policy restored (a student prefill).

``fields`` declares what a stage writes on every sample it keeps (:class:`SampleField`: a name
in :attr:`~relax_core.coordination.sample.Sample.fields` and its check); the batch checks
exactly those before anything is written back (:mod:`~relax_core.coordination.validation`).
Two stages may write one field only when they declare the same :class:`SampleField` (two
reward stages both adding to ``reward``).

:class:`StageContext` hands a stage the batch id, the loop's clients of each role
(:class:`RoleClients`: one :class:`~relax_core.client.client.InferenceClient` per role and
event loop, so a stage that sends one request per sample reuses one connection pool and one
discovery snapshot) and, inside a :class:`~relax_core.coordination.batch.DeferredBatch`, the
batch itself (:class:`BatchControl`): generate more groups, add them to the batch, drop groups,
run another stage with its lease.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, TypedDict, Unpack, runtime_checkable

import attrs

from relax_core.client.client import InferenceClient
from relax_core.client.pool import get_client
from relax_core.coordination.retries import Recovery, retrying
from relax_core.coordination.sample import Sample
from relax_core.errors import CoordinationError
from relax_core.records import NAME_PATTERN

__all__ = [
    "BatchControl",
    "RoleClients",
    "SampleField",
    "Stage",
    "StageContext",
    "StageReport",
    "check_stages",
    "stage_fields",
]

#: ``check(value, sample) -> problem or None``: what is wrong with one sample's value.
FieldCheck = Callable[[Any, Sample], "str | None"]


def _field_name(_i: object, _a: object, value: Any) -> None:
    if not isinstance(value, str) or not NAME_PATTERN.match(value):
        raise ValueError(
            f"SampleField.name={value!r}: a field name starts with a letter and holds only "
            "letters, digits, '_', '.' and '-'"
        )


@attrs.frozen
class SampleField:
    """A field a stage writes on every sample it keeps (``sample.fields[name]``), and how the
    batch checks it before anything is written back.

    ``check(value, sample)`` returns what is wrong (``"teacher_logprobs[3] = 0.5 is not a
    log-prob"``) or ``None``; it is not called for a sample without the field. ``required``: a
    sample without it is a problem (``f"{name} {missing}"``); ``False`` for a field a stage
    writes on some samples only. ``description`` is what ``relax plugins`` and the docs show.

    :raises ValueError: a bad name.
    """

    name: str = attrs.field(validator=_field_name)
    check: FieldCheck | None = None
    description: str = ""
    required: bool = True
    missing: str = "is missing"


@attrs.frozen
class StageReport:
    """What a stage reports about its run: named counts (``parse_failures``, ``requests``,
    ``dropped_groups``) and details (``group_engines``: which engine scored each group).

    A step's JSON line shows every stage's counts under ``stages``."""

    stage: str
    counts: Mapping[str, float] = attrs.field(factory=dict)
    details: Mapping[str, Any] = attrs.field(factory=dict)


class RoleClients:
    """Where each role's engines are discovered, and the loop's shared client for each.

    :param sources: role -> a discovery source: a base URL serving ``/engines?schema=2`` (a
        role gateway ``http://host:port/teacher`` or a registry), or a snapshot provider
        callable (sync or async) returning a ``RoleSnapshot`` or a schema-2 dict.
    :param recovery: the run's :class:`~relax_core.coordination.retries.Recovery` (``None``:
        a stage's retries are neither counted nor preceded by a rebuild).
    :param options: :class:`~relax_core.client.client.InferenceClient` options (``ttl``,
        ``timeout``, …), the same for every role.
    """

    def __init__(
        self, sources: Mapping[str, Any], *, recovery: Recovery | None = None, **options: Any
    ) -> None:
        self.sources = dict(sources)
        self.options = options
        #: the run's retries and rebuilds (:class:`~relax_core.coordination.retries.Recovery`):
        #: what :meth:`StageContext.retrying` counts in and rebuilds a role's replicas with
        self.recovery = recovery

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


@runtime_checkable
class Stage(Protocol):
    """A step stage.

    ``name``: unique in the step; shown in the timeline, the step's line and errors.
    ``role``: the role whose engines it uses (``None``: CPU only); when that role is deferred
    the batch activates it first and deactivates it afterwards, whatever happened.
    ``models``: the role's models it uses (empty: every one); only those are onloaded for it.
    ``fields``: the :class:`SampleField` records it writes.
    """

    @property
    def name(self) -> str: ...

    @property
    def role(self) -> str | None: ...

    @property
    def models(self) -> tuple[str, ...]: ...

    @property
    def fields(self) -> tuple[SampleField, ...]: ...

    async def run(self, samples: Sequence[Sample], ctx: StageContext) -> StageReport:
        """Write ``fields`` on every staged sample (or reshape the batch through ``ctx``);
        raise on any failure (the batch then fails and nothing is committed)."""
        ...


class MoreGroups(TypedDict, total=False):
    """What a stage asks its batch to generate (:meth:`BatchControl.generate`): ``groups``
    more groups from the step's prompt source, or one group per prompt of ``prompts``
    (``relax_core.run`` ``Prompt`` records), not both; ``samples_per_prompt`` and
    ``temperature`` override the step's."""

    groups: int | None
    prompts: Sequence[Any] | None
    samples_per_prompt: int | None
    temperature: float | None


class BatchControl(Protocol):
    """What a stage may do to the batch it runs in (a
    :class:`~relax_core.coordination.batch.DeferredBatch` gives each stage its own view).

    Every operation keeps the commit gate: more generation takes the generation role's lease
    back (every other role on its slice sleeping), a stage run through :meth:`run_stage` takes
    its own role's lease, and nothing is committed before every stage passed.
    """

    @property
    def upstream(self) -> tuple[Stage, ...]:
        """The stages that ran before this one, in order (to score added samples with)."""
        ...

    @property
    def target_groups(self) -> int:
        """How many groups the step wants committed (``prompts_per_step``)."""
        ...

    async def generate(self, **request: Unpack[MoreGroups]) -> list[Sample]:
        """Generate the groups ``request`` asks for (:class:`MoreGroups`) with the policy that
        generated the batch; return their samples (new ids), not yet in the batch."""
        ...

    def add(self, samples: Sequence[Sample]) -> list[Sample]:
        """Add generated ``samples`` (whole groups) to the batch; return their staged copies,
        which the later stages see and which the caller scores (:meth:`run_stage`)."""
        ...

    def drop(self, group_ids: Iterable[str], reason: str) -> int:
        """Take these groups out of the batch (never committed; counted in the step's report
        with ``reason``); return how many samples left."""
        ...

    async def run_stage(self, stage: Stage, samples: Sequence[Sample]) -> StageReport:
        """Run ``stage`` on ``samples`` (staged copies, or samples never in the batch) with
        its role's lease, as the batch runs its own stages."""
        ...


@attrs.frozen
class StageContext:
    """What a stage gets besides the samples: the batch id, the role clients and, in a
    deferred batch, the batch itself (``batch``; see :class:`BatchControl`, whose operations
    are forwarded here).

    :raises CoordinationError: (from the forwarded operations) the stage runs outside a batch.
    """

    batch_id: int
    clients: RoleClients
    batch: BatchControl | None = None

    def _control(self, what: str) -> BatchControl:
        if self.batch is None:
            raise CoordinationError(
                f"{what}: this stage reshapes its batch, so it runs inside a DeferredBatch "
                "(relax run gives it one); here it got samples only"
            )
        return self.batch

    @property
    def upstream(self) -> tuple[Stage, ...]:
        """:attr:`BatchControl.upstream`."""
        return self._control("upstream").upstream

    @property
    def target_groups(self) -> int:
        """:attr:`BatchControl.target_groups`."""
        return self._control("target_groups").target_groups

    async def generate(self, **request: Unpack[MoreGroups]) -> list[Sample]:
        """:meth:`BatchControl.generate`."""
        return await self._control("generate").generate(**request)

    def add(self, samples: Sequence[Sample]) -> list[Sample]:
        """:meth:`BatchControl.add`."""
        return self._control("add").add(samples)

    def drop(self, group_ids: Iterable[str], reason: str) -> int:
        """:meth:`BatchControl.drop`."""
        return self._control("drop").drop(group_ids, reason)

    async def run_stage(self, stage: Stage, samples: Sequence[Sample]) -> StageReport:
        """:meth:`BatchControl.run_stage`."""
        return await self._control("run_stage").run_stage(stage, samples)

    async def retrying(
        self,
        send: Callable[[], Awaitable[Any]],
        *,
        stage: str,
        role: str | None,
        retries: int,
    ) -> Any:
        """``send()`` — ONE idempotent request of ``stage`` (a judgement, a prefill; never a
        generation) —, sent again up to ``retries`` times while it fails for a transport
        reason or a 5xx (:func:`~relax_core.coordination.retries.retryable`); before each new
        attempt ``role``'s dead replicas are rebuilt through its manager and the retry is
        counted for this batch (the step's ``retries``). ``send`` must resolve its target
        anew when called again (a target chosen before a failure may be the dead replica).

        :raises Exception: the last attempt's failure (with a note of the attempts).
        """
        return await retrying(
            send,
            batch_id=self.batch_id,
            stage=stage,
            role=role,
            retries=retries,
            recovery=self.clients.recovery,
        )


def stage_fields(stages: Iterable[Stage]) -> dict[str, SampleField]:
    """Field name -> its declaration, over ``stages`` (checked by :func:`check_stages`)."""
    return {f.name: f for stage in stages for f in stage.fields}


def check_stages(stages: Sequence[Stage]) -> None:
    """Refuse two stages of one name, a stage that declares no name or fields properly, and
    one field declared differently by two stages.

    :raises ValueError: naming the stage (and the other stage, for a field).
    """
    names: set[str] = set()
    declared: dict[str, tuple[str, SampleField]] = {}
    for stage in stages:
        name = getattr(stage, "name", None)
        if not isinstance(name, str) or not name:
            raise ValueError(f"stage {stage!r} has no name")
        if name in names:
            raise ValueError(f"two stages are called {name!r}")
        names.add(name)
        fields = stage.fields
        if not isinstance(fields, tuple) or not all(isinstance(f, SampleField) for f in fields):
            raise ValueError(
                f"stage {name!r}: fields must be a tuple of SampleField records, got {fields!r}"
            )
        for field in fields:
            seen = declared.get(field.name)
            if seen is not None and seen[1] != field:
                raise ValueError(
                    f"stages {seen[0]!r} and {name!r} both write field {field.name!r} but "
                    "declare it differently; rename one stage's field"
                )
            declared.setdefault(field.name, (name, field))
