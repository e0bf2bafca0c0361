"""The step driver of ``relax run``: every step, sync (``max_staleness = 0``, no streaming) or
async, runs through its three lanes: generation behind the staleness gate, commit, training and
push (``docs/run.md``, "Asynchronous steps")."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs

from relax_core._concurrent import gather_all
from relax_core.coordination import (
    BatchResult,
    BatchSink,
    DeferredBatch,
    DeferredCollector,
    Dropped,
    ManagerHandle,
    Producer,
    RoleClients,
    Sample,
    Stage,
    Timeline,
    abort_generation,
    stage_fields,
)
from relax_core.coordination.batch import describe_failure, interrupted, onload_generation
from relax_core.coordination.coordinator import Coordinator
from relax_core.coordination.retries import Regeneration, retryable
from relax_core.errors import BatchFailedError, EmptyBatchError, LifecycleError
from relax_core.run.background import BackgroundEvals
from relax_core.run.streaming import StreamScorer, streaming_prefix

#: The ``stage`` a staleness drop is reported under (``dropped.reasons`` of a step).
STALENESS_STAGE = "staleness"


class TrainerPort(Protocol):
    """The trainer as the driver calls it: ``train(N)`` waits for batch ``N``'s commit and
    trains on it; ``push(version)`` sends the current weights to rollout and returns what the
    manager published (``weight_version``)."""

    async def train(self, batch_id: int) -> dict[str, Any]: ...

    async def push(self, version: str) -> dict[str, Any]: ...


class StepProducerLike(Producer, Protocol):
    """What generates a step (:class:`~relax_core.run.generate.StepProducer`)."""

    async def first(
        self,
        batch_id: int,
        collector: DeferredCollector,
        *,
        on_group: Callable[[int], None] | None = None,
    ) -> None: ...


@runtime_checkable
class _RegeneratesGroups(Protocol):
    """A step producer that regenerates a group whose generation failed."""

    def regenerate_failed(self, regeneration: Regeneration | None) -> None: ...


@attrs.frozen
class DriverSettings:
    """The ``[run]`` keys the driver reads (:class:`~relax_core.run.config.RunConfig`)."""

    steps: int
    prompts_per_step: int
    max_staleness: int = 1
    stale_action: str = "regenerate"
    stream_scoring: bool = True
    stream_concurrency: int = 8
    release_timeout: float = 180.0
    #: the first step to run (``--resume``: the first unfinished one, rollout's version index)
    first_step: int = 0
    max_failed_steps: int = 0
    #: a resumed run's failed steps gone past before ``first_step``
    failed_before: tuple[int, ...] = ()
    on_empty_batch: str = "fail"
    generation_retries: int = 0

    @classmethod
    def of(
        cls, run: Any, steps: int, first_step: int = 0, failed_before: Sequence[int] = ()
    ) -> DriverSettings:
        """The settings of ``run`` for steps ``first_step`` to ``steps - 1`` (``failed_before``:
        a resumed run's failed steps); ``mode = "sync"``: ``max_staleness = 0``, no streaming."""
        sync = run.mode != "async"
        return cls(
            steps=steps,
            first_step=first_step,
            failed_before=tuple(failed_before),
            prompts_per_step=run.prompts_per_step,
            max_staleness=0 if sync else run.max_staleness,
            stale_action=run.stale_action,
            stream_scoring=False if sync else run.stream_scoring,
            stream_concurrency=run.stream_concurrency,
            release_timeout=run.operation_timeout,
            max_failed_steps=getattr(run, "max_failed_steps", 0),
            on_empty_batch=getattr(run, "on_empty_batch", "fail"),
            generation_retries=getattr(run, "generation_retries", 0),
        )


class VersionClock:
    """Weight versions as step indexes (rollout starts at 0, the push after batch ``N`` is
    ``N+1``); generation waits here for the version it needs."""

    def __init__(self, initial: str | None, start: int = 0) -> None:
        self._index: dict[str | None, int] = {initial: start}
        self.current = start
        self._changed = asyncio.Event()
        #: the steps that trained nothing (failed or skipped, the run went on past them)
        self.untrained: set[int] = set()

    def index(self, version: str | None) -> int | None:
        """The step index of ``version`` (``None``: not a version the trainer pushed)."""
        return self._index.get(version)

    def expect(self, version: str, index: int) -> None:
        """``version`` is being pushed as the weights of step ``index``."""
        self._index.setdefault(version, index)

    def pushed(self, version: str | None, index: int) -> None:
        """Rollout now serves ``version``, the weights of step ``index``."""
        self._index[version] = index
        self.current = max(self.current, index)
        self._changed.set()

    def untrained_step(self, index: int) -> None:
        """Step ``index`` trained nothing: rollout's weights are also those of ``index + 1``."""
        self.untrained.add(index)
        self.current = max(self.current, index + 1)
        self._changed.set()

    def staleness(self, step: int, index: int) -> int:
        """How many optimizer steps the trainer took between the weights of step ``index``
        and those it trains batch ``step`` with (steps that trained nothing do not count)."""
        return step - index - sum(1 for n in self.untrained if index <= n < step)

    async def wait_for(self, index: int) -> None:
        """Until rollout serves the weights of step ``index`` or newer."""
        while self.current < index:
            self._changed.clear()
            await self._changed.wait()


@attrs.frozen
class Finished:
    """Step ``step`` is over, every step before it too (the trainer is idle): ``trained``, or
    gone past; ``failed_steps``: every failed step gone past so far (a resumed run's too)."""

    step: int
    trained: bool
    failed_steps: tuple[int, ...]
    weight_version: str | None


@attrs.define
class StepOutcome:
    """A committed and trained step; ``pushed_before``: the push before it (``None`` for step
    0); ``began``: its generation's start (``perf_counter``); ``seconds``: since the previous
    step trained."""

    step: int
    batch: DeferredBatch
    result: BatchResult
    trained: dict[str, Any]
    pushed_before: dict[str, Any] | None
    began: float
    seconds: float
    metrics: dict[str, Any]


class _StepFailure(Exception):
    """Step ``step`` failed or was interrupted (``error``); nothing of it was committed."""

    def __init__(
        self,
        step: int,
        error: BaseException,
        samples: Sequence[Sample],
        batch: DeferredBatch | None = None,
        trainer: str = "not asked: the trainer is asked for a batch once it committed",
    ) -> None:
        super().__init__(f"step {step}: {describe_failure(error)}")
        self.step = step
        self.error = error
        self.samples = list(samples)
        self.batch = batch
        self.trainer = trainer
        #: the samples of later steps, generated ahead and never begun at the coordinator
        self.ahead: list[Sample] = []
        #: the run went on past it: an empty batch skipped (``on_empty_batch = "skip"``)
        self.skipped = False


@attrs.define
class _Generated:
    step: int
    producer: StepProducerLike
    gate: _Gate
    scorer: StreamScorer
    began: float
    regenerated: int = 0


class _Gate(DeferredCollector):
    """Step ``step``'s collector behind the staleness gate: a stale group is dropped and
    counted for regeneration."""

    def __init__(self, step: int, driver: StepDriver, scorer: StreamScorer) -> None:
        super().__init__(step)
        self.driver = driver
        self.scorer = scorer
        self.wanted = 0

    def add(self, group: Sequence[Sample]) -> None:
        reason = self.driver.stale_reason(self.batch_id, group)
        if reason is None:
            super().add(group)
            self.scorer.add(group)
            return
        gid = group[0].group_id if group else "?"
        self.scorer.drop(group, Dropped(gid, tuple(s.id for s in group), STALENESS_STAGE, reason))
        self.wanted += 1

    @property
    def all_samples(self) -> list[Sample]:
        """Every sample generated: captured and dropped."""
        return [*self.samples, *self.scorer.dropped_samples]


class StepDriver:
    """Runs ``settings.steps`` steps with bounded staleness (see the module docstring).

    ``coordinator`` is the commit gate; ``rollout`` the generation role's manager handle;
    ``producer()`` a new step producer per step; ``deferred_roles``' stages never stream;
    ``switching``: the generation role takes turns on its GPUs (``discards``: its offload loses
    its weights, so each step it onloads for generates after a push since); ``finalizer`` gets
    every batch.
    ``on_step`` gets each :class:`StepOutcome` once trained; ``on_trained(step)`` is awaited
    after it, before the push and the next ``train`` (the trainer is idle); ``on_progress(step,
    groups_done)``; ``background`` runs the ``background = true`` stages, settled at the end;
    ``on_failed`` is awaited with each failed or skipped step the run goes past;
    ``on_finished`` with a :class:`Finished` for each step in order.

    :raises ConfigError: a background stage where its work would need a lease."""

    def __init__(
        self,
        settings: DriverSettings,
        *,
        coordinator: Coordinator,
        rollout: ManagerHandle,
        stages: Sequence[Stage],
        sink: BatchSink,
        clients: RoleClients,
        producer: Callable[[], StepProducerLike],
        trainer: TrainerPort,
        generation_role: str,
        deferred_roles: Sequence[str] = (),
        initial_version: str | None = None,
        switching: bool = False,
        discards: bool = False,
        timeline: Timeline | None = None,
        finalizer: Callable[[int, Sequence[Sample]], Any] | None = None,
        on_step: Callable[[StepOutcome], None] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
        on_trained: Callable[[int], Awaitable[None]] | None = None,
        background: BackgroundEvals | None = None,
        on_failed: Callable[[_StepFailure], Awaitable[None]] | None = None,
        on_finished: Callable[[Finished], Awaitable[None]] | None = None,
    ) -> None:
        BackgroundEvals.check(stages, switching=switching, deferred_roles=deferred_roles)
        self.background = background or BackgroundEvals()
        self.settings, self.stages, self.timeline = settings, tuple(stages), timeline or Timeline()
        self.coordinator, self.rollout, self.clients = coordinator, rollout, clients
        self.sink, self.producer, self.trainer = sink, producer, trainer
        self.generation_role = generation_role
        self.finalizer, self.on_step, self.on_progress = finalizer, on_step, on_progress
        self.on_trained, self.on_failed, self.on_finished = on_trained, on_failed, on_finished
        self.clock = VersionClock(initial_version, settings.first_step)
        #: the version of the trainer's weights now (what a rebuilt rollout replica is given)
        self.trainer_version = initial_version
        #: not switching: held by a push (a rebuilt replica's push does not cross another)
        self._push_lock = asyncio.Lock()
        #: the generation of the step before failed on rollout's transport: heal it first
        self._heal_rollout = False
        #: the heal of rollout in flight (concurrent failed groups wait for the same one)
        self._healing: asyncio.Future[str | None] | None = None
        #: the run is ending (a lane failed, or it was cancelled): no new step begins
        self._stopping = False
        #: the failed steps the run went past (not the skipped ones; a resumed run's first)
        self.failed_steps: list[int] = list(settings.failed_before)
        self.switching, self.discards = switching, discards
        #: ``discards``: rollout was onloaded and no push came since
        self._refill_due = False
        #: switching: step -> whether its batch committed (the next generation's turn)
        self._turn: dict[int, asyncio.Future[bool]] = {}
        #: switching: the steps whose batch the generation lane opened (rollout's lease)
        self._opened: set[int] = set()
        #: switching: rollout is onloaded (a push may go through)
        self._awake = asyncio.Event()
        #: switching: held by a push, and by the commit lane while it takes rollout's turn
        self._rollout_lock = asyncio.Lock()
        #: the generation lane ended (no step will onload rollout again)
        self._generation_over = asyncio.Event()
        self.fields = stage_fields(self.stages)
        self.prefix = 0
        if settings.stream_scoring:
            self.prefix = streaming_prefix(
                self.stages, deferred=set(deferred_roles), generation_role=generation_role
            )
        self._generated: dict[int, asyncio.Future[_Generated]] = {}
        #: committed steps for the training lane (a bare step index: one the run went past)
        self._committed: asyncio.Queue[
            tuple[_Generated, DeferredBatch, BatchResult] | int | None
        ] = asyncio.Queue()
        #: the step the commit lane works on (an interruption reports it)
        self.committing = settings.first_step
        #: the step the generation lane works on (rollout's switches are this step's)
        self.generating = settings.first_step
        self._last_end, self._last_end_us = time.perf_counter(), time.time_ns() // 1000
        #: lane -> when its phase in flight began (wall µs): generation, not recorded yet
        self._open: dict[str, int] = {}

    # -- the staleness gate ----------------------------------------------------------------

    def stale_reason(self, step: int, group: Sequence[Sample]) -> str | None:
        """Why ``group`` of step ``step`` must not be trained on, or ``None``."""
        k = self.settings.max_staleness
        oldest: int | None = None
        for s in group:
            for _, version in s.versions:
                index = self.clock.index(version)
                if index is None:
                    return (
                        f"weight version {version!r} is not one rollout was given (known: "
                        f"{sorted(map(str, self.clock._index))})"
                    )
                oldest = index if oldest is None else min(oldest, index)
        if oldest is None:
            return None
        staleness = self.clock.staleness(step, oldest)
        if staleness > k:
            return (
                f"stale: generated with the weights of step {oldest}, trained at step {step} "
                f"(staleness {staleness} > max_staleness {k})"
            )
        return None

    # -- the lanes -------------------------------------------------------------------------

    async def run(self) -> None:
        """Every step, then the background evaluations settled.

        :raises _StepFailure: a step failed or was interrupted (after every step before it
            that committed was trained)."""
        try:
            await self._steps()
        except BaseException as exc:
            stopped = interrupted(exc.error if isinstance(exc, _StepFailure) else exc)
            try:
                await self.background.settle(cancel=stopped)
            except Exception as err:
                exc.add_note(f"reporting a background evaluation failed: {err}")
            raise
        await self.background.settle()

    async def _steps(self) -> None:
        first, steps = self.settings.first_step, self.settings.steps
        loop = asyncio.get_running_loop()
        self._generated = {n: loop.create_future() for n in range(first, steps)}
        self._turn = {n: loop.create_future() for n in range(first, steps)}
        self._awake.set()  # rollout starts awake (the deferred roles were put to sleep)
        self._last_end, self._last_end_us = time.perf_counter(), time.time_ns() // 1000
        gen = asyncio.ensure_future(self._generation_lane())
        commit = asyncio.ensure_future(self._commit_lane())
        train = asyncio.ensure_future(self._training_lane())
        lanes = (gen, commit, train)
        try:
            await asyncio.wait((commit, train), return_when=asyncio.FIRST_EXCEPTION)
            if train.done() and train.exception() is not None:
                self._stop(gen, commit)
            await asyncio.gather(commit, train, return_exceptions=True)
        except asyncio.CancelledError:
            self._stop(*lanes)
            results = await asyncio.gather(*lanes, return_exceptions=True)
            failure = next((r for r in results if isinstance(r, _StepFailure)), None)
            if failure is not None:
                failure.ahead = await self._ahead(failure)
                raise failure from None
            raise
        finally:
            if not self._stopping:  # once is enough: a second cancel cut short its cleanup
                gen.cancel()
            await asyncio.gather(gen, return_exceptions=True)
        # The training lane's failure first: the commit lane was cancelled because of it.
        for lane in (train, commit):
            error = None if lane.cancelled() else lane.exception()
            if error is not None and not isinstance(error, _StepFailure):
                error = _StepFailure(self.committing, error, [])
            if error is not None:
                error.ahead = await self._ahead(error)
                raise error

    def _stop(self, *lanes: asyncio.Future[None]) -> None:
        """Cancel ``lanes`` and the generations of steps the generation lane has not reached:
        a commit lane whose cancellation was lost (Python 3.11's ``asyncio.wait_for`` drops
        one that lands as its call completes) wakes on its next step's generation instead of
        waiting for ever, and begins no new step."""
        self._stopping = True
        for lane in lanes:
            lane.cancel()
        for n, fut in self._generated.items():
            if n > self.generating:
                fut.cancel()

    async def _ahead(self, failure: _StepFailure) -> list[Sample]:
        """The samples of the failed step and later ones not in ``failure.samples``."""
        known = {s.id for s in failure.samples}
        out: list[Sample] = []
        for n, fut in self._generated.items():
            if not fut.done() or fut.cancelled():
                fut.cancel()
                continue
            if n < failure.step:
                continue
            error = fut.exception()
            if isinstance(error, _GenerationFailed):
                out += error.samples
            elif error is None:
                generated = fut.result()
                await generated.scorer.cancel()
                out += generated.gate.all_samples
        return [s for s in out if s.id not in known]

    async def _generation_lane(self) -> None:
        k = self.settings.max_staleness
        try:
            for m in range(self.settings.first_step, self.settings.steps):
                fut = self._generated[m]
                self.generating = m
                try:
                    if self.switching and not await self._take_turn(m):
                        fut.cancel()  # step m-1 failed: the run ends there
                        return
                    await self.clock.wait_for(m - k)
                    if self._refill_due:
                        await self._refill(m)
                    generated = await self._generate(m)
                except asyncio.CancelledError:
                    fut.cancel()
                    raise
                except BaseException as exc:
                    cause = exc.error if isinstance(exc, _GenerationFailed) else exc
                    self._heal_rollout = not self.switching and retryable(cause)
                    if not fut.done():
                        failed = exc if isinstance(exc, _GenerationFailed) else None
                        fut.set_exception(failed or _GenerationFailed(exc, []))
                    if self.settings.max_failed_steps == 0 or interrupted(exc) or self._stopping:
                        return
                    continue  # the commit lane decides whether the run goes past it
                if not fut.done():
                    fut.set_result(generated)
        finally:
            self._generation_over.set()

    async def _take_turn(self, m: int) -> bool:
        """Switching: once step ``m-1`` committed, open batch ``m`` and onload rollout;
        ``False``: step ``m-1`` failed and the run ends there."""
        first = self.settings.first_step
        if m > first and not await self._turn[m - 1]:
            return False
        await self.coordinator.begin_batch(m)
        self._opened.add(m)
        if m > first:
            await self._onload_healed(m)
            self._awake.set()
        return True

    async def _onload_healed(self, m: int) -> None:
        """Switching: onload rollout for step ``m``; an unconfirmed one is healed and tried
        again."""
        gen, recovery = self.generation_role, self.clients.recovery
        timeout = self.settings.release_timeout
        try:
            await onload_generation(self.rollout, gen, self.timeline, m, timeout=timeout)
            self._refill_due = self.discards
            return
        except (LifecycleError, TimeoutError) as exc:
            if recovery is None:
                raise
            first = exc
        before = recovery.rebuilds[m][gen]
        why = await recovery.recover(m, gen)
        try:
            await onload_generation(self.rollout, gen, self.timeline, m, timeout=timeout)
            self._refill_due = self.discards
        except Exception as again:
            said = f"the first failed ({describe_failure(first)}) and {gen} was rebuilt between"
            again.add_note(f"onloaded twice, {said}" + (f": {why}" if why else ""))
            raise
        version = self.trainer_version
        if recovery.rebuilds[m][gen] != before and version is not None:
            await self._push_now(version, m)

    async def _generate(self, m: int) -> _Generated:
        s, tl = self.settings, self.timeline
        producer = self.producer()
        regeneration = self._regeneration(m)
        regenerating = producer if isinstance(producer, _RegeneratesGroups) else None
        if regeneration is not None and regenerating is not None:
            regenerating.regenerate_failed(regeneration)
        scorer = StreamScorer(
            m,
            self.stages,
            self.prefix,
            fields=self.fields,
            clients=self.clients,
            concurrency=s.stream_concurrency,
            timeline=tl,
        )
        gate = _Gate(m, self, scorer)
        began = time.perf_counter()
        regenerated = 0

        progress = None if self.on_progress is None else functools.partial(self.on_progress, m)
        self._open["generate"] = time.time_ns() // 1000
        healed = None
        try:
            if self._heal_rollout:
                self._heal_rollout = False
                healed = await self._heal_shared(m)
            with tl.phase(m, "generate", lane="generate"):
                await producer.first(m, gate, on_group=progress)
                while gate.wanted and s.stale_action == "regenerate":
                    count = min(gate.wanted, s.prompts_per_step - regenerated)
                    gate.wanted = 0
                    if count <= 0:
                        break
                    regenerated += count
                    await _regenerate(producer, m, count, gate)
        except BaseException as exc:
            await scorer.cancel()
            if healed is not None:
                exc.add_note(healed)
            raise _GenerationFailed(exc, gate.all_samples) from exc
        finally:
            self._open.pop("generate", None)
            if self.switching and regenerating is not None:
                # the batch's own requests for more groups come while the commit lane holds
                # rollout's turn: a heal's push there would wait for it
                regenerating.regenerate_failed(None)
        return _Generated(m, producer, gate, scorer, began, regenerated)

    async def _commit_lane(self) -> None:
        try:
            for n in range(self.settings.first_step, self.settings.steps):
                if self._stopping:
                    raise asyncio.CancelledError(f"the run stopped before step {n}")
                self.committing = n
                try:
                    generated, batch, result = await self._commit(n)
                except _StepFailure as failure:
                    went_on = await self._go_on(failure)
                    self._end_turn(n, committed=went_on)
                    if not went_on:
                        raise
                    await self._committed.put(n)  # the training lane: nothing to train
                    continue
                except BaseException:
                    self._end_turn(n, committed=False)
                    raise
                self._end_turn(n, committed=True)
                await self._committed.put((generated, batch, result))
        finally:
            for n in self._turn:
                self._end_turn(n, committed=False)
            self._committed.put_nowait(None)

    async def _go_on(self, failure: _StepFailure) -> bool:
        """Whether the run goes on past the failed step (``max_failed_steps``,
        ``on_empty_batch``; never after an interruption or with a lease BLOCKED); if so, the
        coordinator lets the next batch begin and ``on_failed`` reports it."""
        s = self.settings
        if interrupted(failure.error):
            return False
        skip = isinstance(failure.error, EmptyBatchError) and s.on_empty_batch == "skip"
        if not skip and len(self.failed_steps) >= s.max_failed_steps:
            return False
        try:
            if (await self.coordinator.describe()).blocked:
                return False
            await self.coordinator.go_on_after(failure.step)
        except Exception as exc:
            failure.error.add_note(f"the run could not go on past step {failure.step}: {exc}")
            return False
        failure.skipped = skip
        if not skip:
            self.failed_steps.append(failure.step)
        if self.on_failed is not None:
            await self.on_failed(failure)
        return True

    def _end_turn(self, n: int, *, committed: bool) -> None:
        turn = self._turn.get(n)
        if turn is not None and not turn.done():
            turn.set_result(committed)

    async def _commit(self, n: int) -> tuple[_Generated, DeferredBatch, BatchResult]:
        s = self.settings
        try:
            # shielded: a cancelled lane keeps it (a failure report lists samples generated ahead)
            generated = await asyncio.shield(self._generated[n])
        except _GenerationFailed as exc:
            reported = await self._fail(n, exc.error, generation=True)
            if reported is not exc.error:  # what was tried before it failed (regenerations)
                for note in getattr(exc.error, "__notes__", ()):
                    reported.add_note(note)
            raise _StepFailure(n, reported, exc.samples) from exc.error
        except asyncio.CancelledError as exc:
            if n in self._opened:  # rollout's turn: released, its requests aborted
                await self._fail(n, exc)
            raise _StepFailure(n, exc, []) from exc
        gate = generated.gate
        try:
            streamed = await generated.scorer.finish()
            if n not in self._opened:  # switching opened it already (no round trip)
                await self.coordinator.begin_batch(n)
        except BaseException as exc:
            await self._fail(n, exc)
            raise _StepFailure(n, exc, gate.all_samples) from exc
        batch = DeferredBatch(
            n,
            gate.samples,
            coordinator=self.coordinator,
            rollout=self.rollout,
            stages=self.background.stages(
                n, self.stages, producer=generated.producer, clients=self.clients
            ),
            sink=self.sink,
            clients=self.clients,
            finalizer=self.finalizer,
            timeline=self.timeline,
            release_timeout=s.release_timeout,
            producer=generated.producer,
            target_groups=s.prompts_per_step,
            streamed=streamed,
        )
        try:
            # switching: rollout's turn ends here (the batch offloads it first): no push in flight
            async with self._rollout_lock if self.switching else contextlib.nullcontext():
                self._awake.clear()
                result = await batch.run()
        except BaseException as exc:
            raise _StepFailure(n, exc, batch.generated_samples(), batch) from exc
        return generated, batch, result

    async def _fail(self, n: int, exc: BaseException, *, generation: bool = False) -> BaseException:
        """Fail batch ``n`` at the coordinator (releasing rollout where it was opened); the
        error the step's report carries."""
        failed = generation and not interrupted(exc)
        if n in self._opened:
            async with self._rollout_lock:
                self._awake.clear()
                error = await abort_generation(
                    self.coordinator,
                    n,
                    self.rollout,
                    exc,
                    timeline=self.timeline,
                    timeout=self.settings.release_timeout,
                )
            if failed:
                return error
            if error.cause != f"generation failed: {describe_failure(exc)}":
                exc.add_note(f"releasing {self.generation_role}: {error.cause}")
            return exc
        reason = f"generation failed: {describe_failure(exc)}" if failed else describe_failure(exc)
        try:
            await self.coordinator.fail_batch(n, reason)
        except Exception as err:
            exc.add_note(f"failing batch {n} at the coordinator failed: {err}")
        return BatchFailedError(n, reason) if failed else exc

    def _regeneration(self, m: int) -> Regeneration | None:
        """How step ``m``'s producer regenerates a failed group (``None``: it does not)."""
        recovery = self.clients.recovery
        if recovery is None or self.settings.generation_retries == 0:
            return None
        heal = functools.partial(self._heal_shared, m)
        return Regeneration(m, self.settings.generation_retries, recovery, heal)

    async def _heal_shared(self, index: int) -> str | None:
        """:meth:`heal_rollout`, one at a time (a regeneration must not reach a rebuilt
        replica before its weights do)."""
        healing = self._healing
        if healing is None or healing.done():
            healing = self._healing = asyncio.ensure_future(self.heal_rollout(index))
        return await asyncio.shield(healing)

    async def heal_rollout(self, index: int) -> str | None:
        """Rebuild rollout's dead replicas (counted for step ``index``) and push the trainer's
        weights again where one was rebuilt (switching: only during rollout's turn); why the
        rebuild did not help, or ``None``."""
        recovery, gen = self.clients.recovery, self.generation_role
        if recovery is None:
            return None
        before = recovery.rebuilds[index][gen]
        why = await recovery.recover(index, gen)
        version = self.trainer_version
        if recovery.rebuilds[index][gen] == before or version is None:
            return why
        try:
            await self._push_now(version, index)
        except Exception as exc:
            return (
                f"the weights {version} pushed again to the rebuilt {gen} failed: "
                f"{describe_failure(exc)}"
            )
        return why

    async def _push_now(self, version: str, index: int) -> dict[str, Any]:
        """The trainer's push of ``version``, one at a time, as phase ``weight_push``."""
        async with self._rollout_lock if self.switching else self._push_lock:
            return await self._send(version, index)

    async def _send(self, version: str, index: int) -> dict[str, Any]:
        with self.timeline.phase(index, "weight_push", lane="push"):
            pushed = await self.trainer.push(version)
        self._refill_due = False
        return pushed

    async def _refill(self, m: int) -> None:
        """``discards``: no push came since rollout's onload for step ``m`` (the step before
        trained nothing, or a step runs ahead of the trainer): the trainer's weights now."""
        async with self._rollout_lock:
            if self._refill_due and self.trainer_version is not None:
                await self._send(self.trainer_version, m)

    async def _push_once_healed(self, version: str, index: int) -> dict[str, Any]:
        """Not switching: the push; a failed one heals rollout and is sent once more."""
        try:
            return await self._push_now(version, index)
        except Exception as exc:
            if self.clients.recovery is None:
                raise
            # counted in the first step not reported yet (the step ``index`` may be gone past)
            why = await self._heal_shared(max(index, self.committing))
            try:
                return await self._push_now(version, index)
            except Exception as again:
                said = f"the first failed ({describe_failure(exc)}) and {self.generation_role}"
                said += " was rebuilt in between" + ("" if why is None else f": {why}")
                again.add_note(f"sent twice, {said}")
                raise

    async def _push(self, version: str, index: int) -> dict[str, Any] | None:
        """The trainer's push of ``version``; switching, only while rollout is onloaded
        (``None``: skipped, no step will onload it again)."""
        if not self.switching:
            return await self._push_once_healed(version, index)
        while True:
            if not self._awake.is_set():
                awake = asyncio.ensure_future(self._awake.wait())
                over = asyncio.ensure_future(self._generation_over.wait())
                try:
                    await asyncio.wait((awake, over), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    awake.cancel()
                    over.cancel()
                if not self._awake.is_set():
                    return None
            async with self._rollout_lock:
                if self._awake.is_set():
                    return await self._send(version, index)

    async def _training_lane(self) -> None:
        tl = self.timeline
        pushed_before: dict[str, Any] | None = None
        while True:
            item = await self._committed.get()
            if item is None:
                return
            if isinstance(item, int):  # a step the run went past: nothing trained, no push
                self.clock.untrained_step(item)  # (the push before it stays the last one)
                await self._finished(item, trained=False)
                continue
            generated, batch, result = item
            n = generated.step
            try:
                with tl.phase(n, "train", lane="trainer"):
                    trained = await self.trainer.train(n)
            except BaseException as exc:
                if interrupted(exc):  # batch n is committed: the run stops after it
                    raise
                raise _StepFailure(
                    n, exc, batch.generated_samples(), batch, trainer=describe_failure(exc)
                ) from exc
            end, end_us = time.perf_counter(), time.time_ns() // 1000
            metrics = self._metrics(generated, batch, end_us)
            outcome = StepOutcome(
                n, batch, result, trained, pushed_before, generated.began, end - self._last_end,
                metrics,
            )  # fmt: skip
            self._last_end, self._last_end_us = end, end_us
            tl.counter("staleness", outcome.metrics["staleness"])
            tl.counter("stale groups", outcome.metrics["stale"])
            if self.on_step is not None:
                self.on_step(outcome)
            if self.on_trained is not None:
                await self.on_trained(n)
            self.trainer_version = str(n + 1)
            await self._finished(n, trained=True)
            if n + 1 < self.settings.steps:
                self.clock.expect(str(n + 1), n + 1)
                try:
                    pushed_before = await self._push(str(n + 1), n + 1)
                except BaseException as exc:
                    if interrupted(exc):
                        raise
                    raise _StepFailure(
                        n + 1, exc, [], trainer=f"its push failed: {describe_failure(exc)}"
                    ) from exc
                if pushed_before is not None:
                    version = pushed_before.get("weight_version")
                    self.clock.pushed(str(n + 1) if version is None else str(version), n + 1)

    async def _finished(self, n: int, *, trained: bool) -> None:
        if self.on_finished is not None:
            # the commit lane may have gone past later steps already
            failed = tuple(f for f in self.failed_steps if f <= n)
            await self.on_finished(Finished(n, trained, failed, self.trainer_version))

    # -- metrics ---------------------------------------------------------------------------

    def _metrics(self, generated: _Generated, batch: DeferredBatch, end_us: int) -> dict[str, Any]:
        n = generated.step
        histogram: collections.Counter[str] = collections.Counter()
        partial = span = 0
        for s in batch.originals:
            indexes = [self.clock.index(v) for _, v in s.versions]
            known = [i for i in indexes if i is not None]
            if known:
                histogram[str(self.clock.staleness(n, min(known)))] += 1
                span = max(span, self.clock.staleness(max(known), min(known)))
            if len(s.versions) > 1:
                partial += 1
        stale = [d for d in batch.dropped if d.stage == STALENESS_STAGE]
        seen = max((int(k) for k in histogram), default=0)
        return {
            "max_staleness": self.settings.max_staleness,
            "staleness": dict(sorted(histogram.items())),
            "max_staleness_seen": seen,
            "stale": {
                "dropped_groups": len(stale),
                "dropped_samples": sum(len(d.samples) for d in stale),
                "regenerated_groups": generated.regenerated,
            },
            "partial_samples": partial,
            "max_version_span": span,
            "streamed_stages": [s.name for s in self.stages[: self.prefix]],
            "idle": idle_ratios(
                self.timeline, self._lanes(), self._last_end_us, end_us, open=self._open
            ),
        }

    def _lanes(self) -> dict[str, tuple[str, ...]]:
        """Role -> the timeline lanes that are its work."""
        lanes: dict[str, list[str]] = {self.generation_role: ["generate"], "trainer": ["trainer"]}
        for stage in self.stages:
            lanes.setdefault(stage.role or stage.name, []).append(stage.name)
        return {role: tuple(names) for role, names in lanes.items()}


async def _regenerate(producer: StepProducerLike, m: int, count: int, gate: _Gate) -> None:
    """``count`` groups in place of stale ones, each through the gate."""

    async def one() -> None:
        for group in await producer.generate(m, groups=1):
            gate.add(group)

    await gather_all(one() for _ in range(count))


class _GenerationFailed(Exception):
    def __init__(self, error: BaseException, samples: list[Sample]) -> None:
        super().__init__(str(error))
        self.error = error
        self.samples = samples


def idle_ratios(
    timeline: Timeline,
    lanes: Mapping[str, Sequence[str]],
    start_us: int,
    end_us: int,
    *,
    open: Mapping[str, int] | None = None,
) -> dict[str, float]:
    """Each role's idle share of ``[start_us, end_us]`` (its lanes' phases; ``open``: lane ->
    the start of its phase still in flight)."""
    doc = timeline.trace()
    tids = {
        e["args"]["name"]: e["tid"] for e in doc["traceEvents"] if e.get("name") == "thread_name"
    }
    window = max(1, end_us - start_us)
    out: dict[str, float] = {}
    for role, names in lanes.items():
        wanted = {tids[name] for name in names if name in tids}
        spans = sorted(
            (max(start_us, e["ts"]), min(end_us, e["ts"] + e["dur"]))
            for e in doc["traceEvents"]
            if e.get("ph") == "X" and e.get("tid") in wanted
        )
        spans += [(max(start_us, at), end_us) for lane, at in (open or {}).items() if lane in names]
        spans.sort()
        busy, reach = 0, start_us
        for a, b in spans:
            a = max(a, reach)
            if b > a:
                busy += b - a
                reach = b
        out[role] = round(max(0.0, 1.0 - busy / window), 4)
    return out
