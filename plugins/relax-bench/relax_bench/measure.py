"""``relax run --measure``: what each phase switch costs, against one pinned copy of the bytes
it moves measured by the trainer in the same run (``docs/run.md``: each key). :class:`SwitchProbe`
is the run probe ``switching`` this plugin registers (``relax_register_run_probes``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import attrs

from relax_core import ControlClient

if TYPE_CHECKING:
    from relax_core import Coordinator, LeaseState, LifecycleResult, ManagerHandle, RunProbe

__all__ = [
    "MeasuredCoordinator",
    "MeasuredHandle",
    "Switch",
    "SwitchProbe",
    "switch_hops",
    "switch_report",
]

_T = TypeVar("_T")

#: A switch may take this many times the copy of its bytes ...
COPY_FACTOR = 1.25
#: ... plus this many seconds.
FIXED_SECONDS = 0.05


@attrs.frozen
class Switch:
    """One measured switch: byte counts summed over the role's engine heads; ``device_*`` as
    the first head reports it (``None`` on CPU)."""

    step: int
    role: str
    direction: str
    seconds: float
    weight_bytes: int
    kv_cache_bytes: int
    held_before: int
    held_after: int
    device_free_before: int | None
    device_free_after: int | None
    device_total: int | None
    #: The engines' own seconds (the longest head's sum of its ``memory_log``; ``None``: none)
    engine_seconds: float | None = None
    #: The first head's operations during the switch: ``{"op", "detail"}`` each.
    engine_ops: tuple[dict[str, Any], ...] = ()
    #: The slowest manager's seconds and its slowest replica worker's (``None``: not known)
    manager_seconds: float | None = None
    worker_seconds: float | None = None
    #: Each hop's seconds, outermost first (:func:`switch_hops`; ``docs/run.md``: each key).
    hops: Mapping[str, float] = attrs.field(factory=dict)
    #: What the role's engines had parked for another engine to take, before and after.
    parked_before: int = 0
    parked_after: int = 0
    #: The role's engines' token, step and CUDA graph counters before and after the switch.
    counters_before: Mapping[str, float] = attrs.field(factory=dict)
    counters_after: Mapping[str, float] = attrs.field(factory=dict)
    #: When the switch began (``time.time()``): to place it beside the run's trace, whose
    #: phases overlap some switches (rollout's onload runs beside the trainer's step)
    started: float = 0.0

    @property
    def handed_over_bytes(self) -> int:
        """Memory the switch parked for the next engine on the GPU."""
        return max(0, self.parked_after - self.parked_before)

    @property
    def freed_bytes(self) -> int:
        """Memory this switch gave back or handed over (negative for an onload)."""
        if self.device_free_before is not None and self.device_free_after is not None:
            return self.device_free_after - self.device_free_before + self.handed_over_bytes
        return self.held_before - self.held_after


def _held(memory: Mapping[str, Any]) -> int:
    if "cuda_memory_held" in memory:
        return int(memory["cuda_memory_held"])
    if "cuda_memory_reserved" in memory:
        return int(memory["cuda_memory_reserved"])
    kv = memory.get("kv_cache") or {}
    return int(memory.get("resident_param_bytes", 0)) + int(kv.get("bytes", 0))


def _parked(memory: Mapping[str, Any]) -> int:
    return int((memory.get("memory_handoff") or {}).get("parked_bytes", 0))


#: The ``/server_info`` counters a switch records (top-level keys).
_COUNTERS = (
    "generation_tokens_total",
    "prefill_tokens_total",
    "prefill_steps_total",
    "decode_steps_total",
    "step_seconds_total",
)


def _counters(infos: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The counters of :attr:`Switch.counters_before`, summed over ``infos``."""
    out: dict[str, float] = {}
    for info in infos:
        graphs = (info.get("memory") or {}).get("cuda_graphs") or {}
        values = {k: info.get(k) for k in _COUNTERS}
        values["cuda_graph_captures"] = graphs.get("captures")
        values["cuda_graph_replays"] = graphs.get("replays")
        for key, value in values.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                out[key] = out.get(key, 0) + value
    return out


def _ops_since(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The head's memory operations in its ``after`` log that its ``before`` log lacks (by the
    engine's own clock), each with its ``seconds`` (from its start to its entry; ``None``
    where the entry has no start); ``None``: it logs none."""
    log = after.get("memory_log")
    if not isinstance(log, list):
        return None
    seen = {
        (e.get("op"), e.get("at")) for e in before.get("memory_log") or () if isinstance(e, Mapping)
    }
    return [
        {"op": e.get("op"), "detail": e.get("detail") or {}, "seconds": _op_seconds(e)}
        for e in log
        if isinstance(e, Mapping) and (e.get("op"), e.get("at")) not in seen
    ]


def _op_seconds(entry: Mapping[str, Any]) -> float | None:
    started, at = entry.get("started"), entry.get("at")
    if isinstance(started, int | float) and isinstance(at, int | float):
        return float(at) - float(started)
    return None


#: The hops a manager reports of an onload or offload (``LifecycleResult.timings``), and its
#: workers (``ReplicaResult.timings``), in the order they run.
_MANAGER_HOPS = ("publish_begin", "heads", "publish_wait", "publish")
_WORKER_HOPS = ("drain", "engine_calls")


def switch_hops(
    seconds: float,
    coordinator: float | None,
    results: Sequence[LifecycleResult],
    ops: Sequence[list[dict[str, Any]] | None],
) -> dict[str, float]:
    """Where one switch's ``seconds`` went, outermost first: the ``switch`` as the run saw it,
    the ``coordinator``'s (its lease engine's switch: a deferred role's), each manager hop of
    ``results`` and each worker hop of their replicas (the slowest of each), then from the
    engines' memory logs (``ops``; the longest head's): ``engine_op``, their operations from
    start to end, ``engine``, what the operations' tags took of it, and the
    ``generation_check`` after a resume (``generation_check_step``: the engine's seconds in
    steps during it). A hop nothing reported is left out."""
    hops = {"switch": seconds}
    if coordinator is not None:
        hops["coordinator"] = coordinator

    def slowest(name: str, values: Sequence[float]) -> None:
        if values:
            hops[name] = max(values)

    slowest("manager", [r.seconds for r in results])
    for key in _MANAGER_HOPS:
        slowest(key, [r.timings[key] for r in results if key in r.timings])
    replicas = [x for r in results for x in r.replicas if x.timings]
    slowest("worker", [x.seconds for x in replicas])
    for key in _WORKER_HOPS:
        slowest(key, [x.timings[key] for x in replicas if key in x.timings])
    if ops and all(head is not None for head in ops):
        spans = [[op["seconds"] for op in head or ()] for head in ops]
        if all(None not in head for head in spans):
            hops["engine_op"] = max(sum(head) for head in spans)
    engine = _engine_seconds(ops)
    if engine is not None:
        hops["engine"] = engine
    for hop in ("generation_check", "generation_check_step"):
        key = f"{hop}_seconds"
        slowest(
            hop,
            [float(op["detail"][key]) for head in ops for op in head or () if key in op["detail"]],
        )
    return hops


def _engine_seconds(ops: Sequence[list[dict[str, Any]] | None]) -> float | None:
    """The longest head's sum of its operations' per-tag seconds."""
    if not ops or any(o is None for o in ops):
        return None
    return max(
        sum(
            float(tag.get("seconds", 0.0))
            for op in head or ()
            for tag in op["detail"].values()
            # An ``overlapped`` tag ran inside another's seconds.
            if isinstance(tag, Mapping) and not tag.get("overlapped")
        )
        for head in ops
    )


@attrs.define
class SwitchProbe:
    """The run probe of ``relax run --measure``: reads the memory reports (``/server_info``) of
    a role's engine heads around each switch of the run's coordinator and generation handle;
    ``heads(role)``: their base URLs; ``step_of(direction)``: the step of a generation switch."""

    heads: Callable[[str], Awaitable[list[str]]]
    generation_role: str
    step_of: Callable[[str], int]
    timeout: float = attrs.field(default=30.0, kw_only=True)
    switches: list[Switch] = attrs.field(init=False, factory=list)

    def coordinator(self, coordinator: Coordinator) -> MeasuredCoordinator:
        """``coordinator`` with measured ``activate`` / ``deactivate``."""
        return MeasuredCoordinator(coordinator, self)

    def rollout(self, handle: ManagerHandle) -> MeasuredHandle:
        """The generation model's ``handle`` with measured ``onload`` / ``offload``."""
        return MeasuredHandle(handle, self, self.generation_role, self.step_of)

    async def report(self, trainer: Any, step_seconds: float) -> dict[str, Any]:
        """:func:`switch_report` of the run's switches, against the trainer's ``measure_copy``
        of each switch's weight bytes."""
        copies = await trainer.measure_copy(sorted({s.weight_bytes for s in self.switches}))
        return switch_report(self.switches, copies, step_seconds)

    async def _info(self, role: str) -> dict[str, dict[str, Any]]:
        """Each head's ``/server_info``, by its URL (in the role's order)."""

        async def one(url: str) -> dict[str, Any]:
            async with ControlClient(url, timeout=self.timeout) as client:
                return await client.server_info()

        urls = await self.heads(role)
        return dict(zip(urls, await asyncio.gather(*(one(u) for u in urls)), strict=True))

    async def around(
        self,
        step: int,
        role: str,
        direction: str,
        call: Callable[[], Awaitable[_T]],
        details: Callable[[], Awaitable[tuple[float | None, Sequence[LifecycleResult]]]]
        | None = None,
    ) -> _T:
        """Run ``call()`` (the switch) and record it; its result returned, its error raised
        (a failed switch is not recorded). ``details()``, once the switch is timed: the
        coordinator's seconds of it and the managers' results (default: ``None`` and the
        switch's own result, a ``LifecycleResult``)."""
        infos_before = await self._info(role)
        before = [info.get("memory") or {} for info in infos_before.values()]
        began, started = time.perf_counter(), time.time()
        result = await call()
        seconds = time.perf_counter() - began
        infos = await self._info(role)
        after = [info.get("memory") or {} for info in infos.values()]
        ops = [_ops_since(infos_before.get(url, {}), info) for url, info in infos.items()]
        first = after[0] if after else {}
        if details is not None:
            coordinator, results = await details()
        else:
            lifecycle: Any = result
            coordinator, results = None, [lifecycle] if hasattr(lifecycle, "replicas") else []
        hops = switch_hops(seconds, coordinator, results, ops)
        kv = sum(int((m.get("kv_cache") or {}).get("pool_bytes", 0)) for m in (after or before))
        self.switches.append(
            Switch(
                step=step,
                role=role,
                direction=direction,
                seconds=seconds,
                weight_bytes=sum(int(m.get("param_bytes", 0)) for m in before),
                kv_cache_bytes=kv,
                held_before=sum(_held(m) for m in before),
                held_after=sum(_held(m) for m in after),
                device_free_before=before[0].get("cuda_device_free") if before else None,
                device_free_after=first.get("cuda_device_free"),
                device_total=first.get("cuda_device_total"),
                engine_seconds=hops.get("engine"),
                engine_ops=tuple(ops[0]) if ops and ops[0] is not None else (),
                manager_seconds=hops.get("manager"),
                worker_seconds=hops.get("worker"),
                hops=hops,
                parked_before=sum(_parked(m) for m in before),
                parked_after=sum(_parked(m) for m in after),
                counters_before=_counters(list(infos_before.values())),
                counters_after=_counters(list(infos.values())),
                started=started,
            )
        )
        return result


class MeasuredCoordinator:
    """A :class:`~relax_core.coordination.coordinator.Coordinator` whose ``activate`` /
    ``deactivate`` are measured switches; every other call goes to ``inner``."""

    def __init__(self, inner: Coordinator, probe: SwitchProbe) -> None:
        self._inner = inner
        self._probe = probe
        #: role -> the number of its last switch recorded
        self._seen: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def _switched(self, role: str) -> tuple[float | None, Sequence[LifecycleResult]]:
        """The coordinator's seconds of ``role``'s switch and the managers' results (none for
        a call that switched nothing: its last switch is the one seen before)."""
        record = (await self._inner.describe()).switches.get(role)
        if record is None or self._seen.get(role) == record.number:
            return None, ()
        self._seen[role] = record.number
        return record.seconds, record.results

    async def activate(
        self, role: str, operation_id: str, *, batch_id: int, models: Sequence[str] = ()
    ) -> LeaseState:
        """The coordinator's ``activate``, measured as ``role``'s onload."""
        return await self._probe.around(
            batch_id,
            role,
            "onload",
            lambda: self._inner.activate(role, operation_id, batch_id=batch_id, models=models),
            lambda: self._switched(role),
        )

    async def deactivate(self, role: str, operation_id: str, *, batch_id: int) -> LeaseState:
        """The coordinator's ``deactivate``, measured as ``role``'s offload."""
        return await self._probe.around(
            batch_id,
            role,
            "offload",
            lambda: self._inner.deactivate(role, operation_id, batch_id=batch_id),
            lambda: self._switched(role),
        )


@attrs.define
class MeasuredHandle:
    """The generation model's manager handle with measured ``onload`` / ``offload``;
    ``step(direction)``: the step a switch belongs to."""

    _inner: ManagerHandle
    _probe: SwitchProbe
    _role: str
    _step: Callable[[str], int]

    @property
    def name(self) -> str:
        """The handle's name."""
        return str(self._inner.name)

    async def onload(self) -> LifecycleResult:
        """The manager's onload, measured."""
        return await self._probe.around(
            self._step("onload"), self._role, "onload", self._inner.onload
        )

    async def offload(self) -> LifecycleResult:
        """The manager's offload, measured."""
        return await self._probe.around(
            self._step("offload"), self._role, "offload", self._inner.offload
        )


#: A switch's row: its own keys, the copy's between the first six and the rest.
_ROW = (
    "step", "role", "direction", "seconds", "weight_bytes", "kv_cache_bytes", "held_before",
    "held_after", "device_free_before", "device_free_after", "device_total", "freed_bytes",
    "handed_over_bytes", "engine_seconds", "manager_seconds", "worker_seconds", "hops",
    "engine_ops", "counters_before", "counters_after", "started",
)  # fmt: skip


def switch_report(
    switches: Sequence[Switch], copies: Mapping[int, Mapping[str, float]], step_seconds: float
) -> dict[str, Any]:
    """Every switch against its copy baseline (``copies[bytes]``: ``h2d`` and ``d2h``
    seconds), and the totals."""
    rows = []
    for s in switches:
        copy = copies.get(s.weight_bytes, {}).get("h2d" if s.direction == "onload" else "d2h")
        limit = None if copy is None else COPY_FACTOR * copy + FIXED_SECONDS
        row: dict[str, Any] = {k: getattr(s, k) for k in _ROW[:6]}
        row |= {
            "copy_seconds": copy,
            "copy_gb_per_s": None if not copy else s.weight_bytes / copy / 1e9,
            "over_copy": None if not copy else s.seconds / copy,
            "limit_seconds": limit,
            "within_limit": None if limit is None else s.seconds <= limit,
        }
        row |= {k: getattr(s, k) for k in _ROW[6:]}
        row["engine_ops"] = list(s.engine_ops)
        for key in ("hops", "counters_before", "counters_after"):
            row[key] = dict(row[key])
        if s.direction == "offload":
            row["freed_fraction"] = s.freed_bytes / s.held_before if s.held_before else None
        rows.append(row)
    total = sum(s.seconds for s in switches)
    offloads = [r["freed_fraction"] for r in rows if r.get("freed_fraction") is not None]
    checks = [r["within_limit"] for r in rows if r["within_limit"] is not None]
    return {
        "switches": rows,
        "switch_seconds": total,
        "step_seconds": step_seconds,
        "share_of_step": total / step_seconds if step_seconds > 0 else None,
        "all_within_limit": all(checks) if checks else None,
        "min_freed_fraction": min(offloads) if offloads else None,
        "limit": f"{COPY_FACTOR} x copy + {FIXED_SECONDS} s",
    }


if TYPE_CHECKING:
    # mypy checks the probe and its wrappers against the contracts they stand in for.

    def _coordinator(measured: MeasuredCoordinator) -> Coordinator:
        return measured

    def _handle(measured: MeasuredHandle) -> ManagerHandle:
        return measured

    def _probe(probe: SwitchProbe) -> RunProbe:
        return probe
