"""What a step stage is: the fields it writes (checked on every staged sample before the
write-back), the role whose lease it needs, and what it gets to reach the roles' engines and its
batch (``docs/coordination.md``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, TypedDict, Unpack, runtime_checkable

import attrs

from relax_core.client.client import InferenceClient
from relax_core.client.pool import get_client
from relax_core.coordination.retries import Recovery, retrying
from relax_core.coordination.sample import Sample
from relax_core.errors import CoordinationError, ScoringError
from relax_core.records import NAME_PATTERN

#: The problems a validation failure shows (their count is given).
_SHOWN = 5
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
    """A field a stage writes on every sample it keeps (``sample.fields[name]``), checked before
    the write-back: ``check(value, sample)`` says what is wrong or ``None``; ``required``: a
    sample without it is a problem (``f"{name} {missing}"``).

    :raises ValueError: a bad name."""

    name: str = attrs.field(validator=_field_name)
    check: FieldCheck | None = None
    description: str = ""
    required: bool = True
    missing: str = "is missing"


@attrs.frozen
class StageReport:
    """What a stage reports about its run: named counts (the step's ``stages``) and details."""

    stage: str
    counts: Mapping[str, float] = attrs.field(factory=dict)
    details: Mapping[str, Any] = attrs.field(factory=dict)


class RoleClients:
    """Where each role's engines are discovered, and the loop's shared client for each.

    :param sources: role -> a base URL serving ``/engines?schema=2`` or a snapshot provider.
    :param recovery: the run's ``Recovery`` (``None``: retries neither counted nor preceded by
        a rebuild).
    :param options: ``InferenceClient`` options, every role's."""

    def __init__(
        self, sources: Mapping[str, Any], *, recovery: Recovery | None = None, **options: Any
    ) -> None:
        self.sources = dict(sources)
        self.options = options
        self.recovery = recovery

    def client(self, role: str) -> InferenceClient:
        """The running event loop's client for ``role`` (one per loop, reused).

        :raises KeyError: no discovery source was given for ``role``."""
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
    """A step stage: ``name`` unique in the step; ``role`` whose engines it uses (``None``: CPU
    only); ``models`` of that role it uses (empty: every one); ``fields`` it writes."""

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
    """What a stage asks its batch to generate: ``groups`` more groups, or one per prompt of
    ``prompts`` (not both); the others override the step's."""

    groups: int | None
    prompts: Sequence[Any] | None
    samples_per_prompt: int | None
    temperature: float | None


def more_groups(stage: str, request: MoreGroups) -> MoreGroups:
    """``request`` with every key (``None``: the step's own), as a producer hears it.

    :raises ValueError: it asks for both or neither of ``groups`` and ``prompts``."""
    if (request.get("groups") is None) == (request.get("prompts") is None):
        raise ValueError(f"stage {stage!r}: generate() takes groups or prompts")
    return {
        "groups": None, "prompts": None, "samples_per_prompt": None, "temperature": None,
        **request,
    }  # fmt: skip


class BatchControl(Protocol):
    """What a stage may do to the batch it runs in (each operation takes the lease it needs)."""

    @property
    def upstream(self) -> tuple[Stage, ...]:
        """The stages that ran before this one, in order (to score added samples with)."""
        ...

    @property
    def target_groups(self) -> int:
        """How many groups the step wants committed (``prompts_per_step``)."""
        ...

    async def generate(self, **request: Unpack[MoreGroups]) -> list[Sample]:
        """Generate the groups ``request`` asks for with the batch's policy; their samples,
        not yet in the batch."""
        ...

    def add(self, samples: Sequence[Sample]) -> list[Sample]:
        """Add generated ``samples`` (whole groups) to the batch; their staged copies."""
        ...

    def drop(self, group_ids: Iterable[str], reason: str) -> int:
        """Take these groups out of the batch (counted with ``reason``); samples left."""
        ...

    async def run_stage(self, stage: Stage, samples: Sequence[Sample]) -> StageReport:
        """Run ``stage`` on ``samples`` with its role's lease, as the batch runs its own."""
        ...


@attrs.frozen
class StageContext:
    """What a stage gets besides the samples: the batch id, the role clients and, in a deferred
    batch, the batch (its :class:`BatchControl` operations forwarded here).

    :raises CoordinationError: (from the forwarded operations) the stage runs outside a batch."""

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
        self, send: Callable[[], Awaitable[Any]], *, stage: str, role: str | None, retries: int
    ) -> Any:
        """``retrying`` of ``send()``: ONE idempotent request (never a generation) that resolves
        its target anew each time. :raises Exception: the last attempt's failure."""
        recovery = self.clients.recovery
        return await retrying(
            send, batch_id=self.batch_id, stage=stage, role=role, retries=retries, recovery=recovery
        )


def stage_fields(stages: Iterable[Stage]) -> dict[str, SampleField]:
    """Field name -> its declaration, over ``stages`` (checked by :func:`check_stages`)."""
    return {f.name: f for stage in stages for f in stage.fields}


def check_stages(stages: Sequence[Stage]) -> None:
    """Refuse two stages of one name, a bad name or fields, one field declared two ways.

    :raises ValueError: naming the stage (and the other stage, for a field)."""
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


def validate_samples(samples: Iterable[Sample], fields: Iterable[SampleField]) -> list[str]:
    """Every problem of ``fields`` over ``samples``, as ``sample <id> (group <g>): <problem>``;
    empty when all are valid."""
    specs = tuple(fields)
    problems = []
    for s in samples:
        values = s.fields
        for spec in specs:
            if spec.name not in values:
                problem = f"{spec.name} {spec.missing}" if spec.required else None
            else:
                problem = spec.check(values[spec.name], s) if spec.check is not None else None
            if problem:
                problems.append(f"sample {s.id} (group {s.group_id}): {problem}")
    return problems


def check_samples(samples: Sequence[Sample], fields: Iterable[SampleField]) -> None:
    """Raise :class:`~relax_core.errors.ScoringError` (stage ``validation``) listing the first
    problems and their count; return when every field is valid."""
    if problems := validate_samples(samples, fields):
        more = f" (and {len(problems) - _SHOWN} more)" if len(problems) > _SHOWN else ""
        raise ScoringError(
            "validation",
            f"{len(problems)} problem(s) in {len(samples)} staged samples; nothing was written "
            f"back: " + "; ".join(problems[:_SHOWN]) + more,
        )
