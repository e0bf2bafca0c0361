"""The asyncio side of the engine: admission, the scheduler loop, lifecycle and weight operations.

:class:`Engine` owns one :class:`~relax_hf.runner.ModelRunner` and one
:class:`~relax_hf.batch.Batch`. Every piece of model compute (prefill/decode steps, memory
release/resume, weight loads) runs on one single-thread executor, so the event loop stays free
for health checks, aborts and streaming, and weight operations happen between two steps.

In a multi-node replica (``nodes`` given) the engine is the head: every operation on the compute
thread that changes the batch, the memory or the weights is first sent to the followers (see
:mod:`relax_hf.nodes`), and once a follower is lost the engine refuses to generate (503).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from relax_hf.batch import Batch, Sequence, reservation
from relax_hf.kvcache import PoolUnavailable
from relax_hf.logit_processors import Processor, load_processor
from relax_hf.nodes import HeadNodes, NodeLost
from relax_hf.protocol import (
    CUSTOM_LOGIT_PROCESSOR_REFUSED,
    MEMORY_TAGS,
    BadRequest,
    LogprobParams,
    SamplingParams,
)
from relax_hf.runner import ModelRunner, WeightsError
from relax_hf.sampling import derive_seed
from relax_hf.weights import FLATTENED, WeightsGroup, decode_named_tensors, parse_dtype

__all__ = ["Conflict", "Engine", "NotResident", "Unavailable"]

T = TypeVar("T")

#: A prompt sharing this many leading tokens with one admitted in the same round waits a step
#: (SGLang's in-batch prefix caching threshold), so that it reuses that one's prefill.
IN_BATCH_PREFIX_TOKENS = 32


class NotResident(RuntimeError):
    """Memory is released: generation is refused with 503 until it is resumed."""


class Conflict(RuntimeError):
    """An operation is refused in the engine's current state (a 400 with this message)."""


class Unavailable(RuntimeError):
    """The engine cannot serve: a node of its multi-node replica is lost (a 503)."""


#: The longest run of decode steps the compute thread takes without handing back to the
#: scheduler loop (which admits, aborts and delivers between runs).
RUN_ON_SECONDS = 0.05


class Engine:
    """Scheduler, lifecycle state and control operations of one engine server."""

    def __init__(
        self,
        runner: ModelRunner,
        *,
        served_model_name: str,
        weight_version: str = "default",
        max_running_requests: int = 64,
        seed: int = 0,
        dist_timeout_s: float = 600.0,
        nodes: HeadNodes | None = None,
        enable_custom_logit_processor: bool = False,
        overlap_schedule: bool = True,
        num_continuous_decode_steps: int = 1,
    ) -> None:
        self.runner = runner
        #: ``--num-continuous-decode-steps``: while sequences run, arrivals are admitted at most
        #: once every that many steps (:meth:`_admission_due`).
        self.num_continuous_decode_steps = num_continuous_decode_steps
        self._since_admit = 0  # steps since the last one that admitted
        #: Start a run's next decode step before the last one's tokens are appended
        #: (``--disable-overlap-schedule``: off; see :attr:`Batch.run_ahead`).
        self.overlap_schedule = overlap_schedule
        #: ``--enable-custom-logit-processor``: requests may carry code to run on their logits.
        self.enable_custom_logit_processor = enable_custom_logit_processor
        self.batch = Batch(runner)
        self.nodes = nodes
        if nodes is not None:
            self.batch.sync_tokens = nodes.sync_tokens
        self.served_model_name = served_model_name
        self.weight_version = weight_version
        self.checkpoint_version = weight_version
        self.max_running_requests = max_running_requests
        self.resident = dict.fromkeys(MEMORY_TAGS, True)
        self.paused = False
        self.group = WeightsGroup()
        self.dist_timeout_s = dist_timeout_s
        self.started = time.time()
        #: SGLang's ``/server_info`` ``startup_time``: the runner's phases and the whole start.
        self.startup_seconds: dict[str, Any] = {
            **runner.startup_time,
            "tokenizer_e2e": runner.startup_time["scheduler_e2e"],
        }
        self.last_resume: dict[str, Any] = {}
        self.last_release: dict[str, Any] = {}
        # The last memory operations, each {"op", "tags", "started" and "at" (epoch seconds: the
        # call began, its memory was freed or taken), "detail"}: an onload of one tag at a time
        # leaves one entry per tag (``/server_info`` ``memory_log``).
        self.memory_log: deque[dict[str, Any]] = deque(maxlen=16)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="relax-hf-compute")
        #: Calls of :meth:`compute` waiting for the compute thread (a run of decode steps
        #: hands it back to them, see :meth:`_step`).
        self._waiting = 0
        #: Seconds the compute thread spent in steps (``/server_info`` ``step_seconds_total``):
        #: over a phase's seconds, how busy the engine was.
        self.step_seconds = 0.0
        #: Runs of steps (:meth:`_step` calls): each one ends with a hand-over to the scheduler
        #: loop, which admits, aborts and delivers (``/server_info`` ``scheduler_runs_total``).
        self.runs = 0
        self._pending: deque[Sequence] = deque()
        self._live: dict[str, Sequence] = {}
        self._sinks: dict[str, asyncio.Queue[dict[str, Any]]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._rng = random.Random(seed)
        self._ops = asyncio.Lock()
        self._groups: dict[str, list[str]] = {}  # rid of an n > 1 request -> its samples' rids
        self._forget: deque[str] = deque()  # retracted rids aborted while queued (followers)
        #: a request needs the discarded weights the checkpoint holds: read before the next step
        self._reload_due = False
        self.requests_total = 0
        self.prompt_tokens_total = 0

    # -- lifecycle of the loop -------------------------------------------------------------

    def start(self) -> None:
        """Start the scheduler loop on the running event loop."""
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._loop(), name="relax-hf-scheduler")
        if self.nodes is not None:

            def on_lost(reason: str) -> None:
                try:
                    loop.call_soon_threadsafe(self._wake.set)
                except RuntimeError:  # the loop is closed: the server is stopping
                    pass

            self.nodes.on_lost = on_lost

    @property
    def broken(self) -> str | None:
        """Why this multi-node replica cannot serve (a lost follower); ``None`` while healthy."""
        return self.nodes.lost if self.nodes is not None else None

    async def stop(self) -> None:
        """Abort everything, stop the loop and the compute thread."""
        self.abort_all("Engine is shutting down")
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self.nodes is not None:
            await self.compute(self.nodes.close)
        if self.runner.exchange is not None:
            await self.compute(self.runner.exchange.close)
        if self.runner.warmer is not None:
            self.runner.warmer.stop()
        self._executor.shutdown(wait=True)

    async def compute(self, fn: Any, *args: Any, reads_only: bool = False) -> Any:
        """Run ``fn(*args)`` on the compute thread (between two scheduler steps). A decode step
        started ahead is dropped first (the call may change the batch, its memory or the
        weights), unless ``reads_only``."""

        def call() -> Any:
            if not reads_only:
                self.batch.drop_ahead()
            return fn(*args)

        self._waiting += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, call)
        finally:
            self._waiting -= 1

    # -- admission ---------------------------------------------------------------------------

    def not_resident(self) -> list[str]:
        """The memory tags that are released now."""
        return [t for t, on in self.resident.items() if not on]

    def token_usage(self) -> float:
        """The fraction of the KV cache pool's slots held by sequences (SGLang's: what the
        prefix cache could evict counts as free)."""
        pool = self.runner.pool
        if not pool.resident:
            return 0.0
        return 1.0 - self.runner.prefix_cache.available / pool.capacity

    @property
    def num_running(self) -> int:
        """Sequences in the running batch."""
        return len(self.batch)

    @property
    def num_waiting(self) -> int:
        """Sequences admitted but not yet prefilled."""
        return len(self._pending)

    async def check_grammar(self, sampling: SamplingParams, field: str) -> None:
        """Compile the request's grammar off the event loop (cached for the compute thread).

        :raises BadRequest: the grammar does not compile (naming ``field``).
        """
        grammar = sampling.grammar
        if grammar is not None:
            kind, source = grammar
            where = f"{field}.{kind}" if field else kind
            await asyncio.to_thread(self.runner.grammar.compile, kind, source, where)

    def submit(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        logprob: LogprobParams,
        *,
        rid: str | None = None,
        stream: bool = False,
        field: str = "sampling_params",
        queue: asyncio.Queue[dict[str, Any]] | None = None,
        processor: str | None = None,
        check: bool = False,
    ) -> list[tuple[Sequence, asyncio.Queue[dict[str, Any]]]]:
        """Admit one prompt with its ``n`` samples; each sample's snapshots arrive on its queue.

        The samples of one prompt (rids ``{rid}-{i}`` when ``n`` > 1) are prefilled together,
        once. ``queue`` (default: one per sample) receives every sample's snapshots.
        ``check``: the generation check after a resume, which runs on whatever the weights
        hold (discarded ones too: it checks the engine, not the model).
        :raises NotResident: memory is released, or the weights were discarded with updates
        that no push has written again. :raises BadRequest: ``rid`` is in use, the prompt
        exceeds the context, or the request can never fit the KV cache pool.
        :raises Unavailable: a node of this multi-node replica is lost.
        """
        if self.broken:
            raise Unavailable(
                f"this multi-node replica cannot generate: {self.broken}; restart the replica"
            )
        released = self.not_resident()
        if released:
            raise NotResident(
                f"memory {released} is released; call resume_memory_occupation before generating"
            )
        if self.runner.weights_pending and not check:
            lost = self.runner.pending_error()
            if lost is not None:
                raise NotResident(lost)
            self._reload_due = True
        loaded = None if processor is None else self.load_processor(processor)
        rid = rid or uuid.uuid4().hex
        n = sampling.n
        rids = [rid] if n == 1 else [f"{rid}-{i}" for i in range(n)]
        busy = [r for r in [rid, *rids] if r in self._live or r in self._groups]
        if busy:  # SGLang's words (clients match on them)
            raise BadRequest("rid", f"Duplicate request ID detected: {busy[0]}")
        runner = self.runner
        if len(prompt_ids) >= runner.max_len:
            raise BadRequest(
                "input",
                f"The input ({len(prompt_ids)} tokens) is longer than the model's context "
                f"length ({runner.max_len} tokens).",
            )
        if n > self.max_running_requests:
            raise BadRequest(
                f"{field}.n",
                f"must be <= --max-running-requests ({self.max_running_requests}): the samples "
                "of one prompt run together",
            )
        need = len(prompt_ids) + n * reservation(sampling, len(prompt_ids), 0, runner.max_len)
        if need > runner.pool.capacity:
            raise BadRequest(
                f"{field}.max_new_tokens",
                f"{n} sample(s) of this prompt need {need} KV cache slots, the pool has "
                f"{runner.pool.capacity}; lower max_new_tokens or n, or start the engine with "
                "a larger --mem-fraction-static / --max-total-tokens",
            )
        base = sampling.sampling_seed
        if base is None:
            base = self._rng.randrange(-(1 << 63), 1 << 63)
        out = []
        for i, r in enumerate(rids):
            seq = Sequence(
                rid=r,
                prompt_ids=list(prompt_ids),
                sampling=sampling,
                logprob=logprob,
                seed=0 if sampling.greedy else derive_seed(base, i),
                stream=stream,
                group=rid if n > 1 else None,
                index=i,
                processor=loaded,
                processor_key=processor if loaded is not None else None,
            )
            sink: asyncio.Queue[dict[str, Any]] = queue if queue is not None else asyncio.Queue()
            self._live[r] = seq
            self._sinks[r] = sink
            self._pending.append(seq)
            out.append((seq, sink))
        if n > 1:
            self._groups[rid] = rids
        self.requests_total += 1
        self.prompt_tokens_total += len(prompt_ids)
        self._wake.set()
        return out

    def load_processor(self, serialized: str) -> Processor:
        """The request's custom logit processor, loaded.

        :raises BadRequest: the server was started without ``--enable-custom-logit-processor``
            (SGLang's words), the replica is multi-node, or the processor does not load.
        """
        if not self.enable_custom_logit_processor:
            raise BadRequest("custom_logit_processor", CUSTOM_LOGIT_PROCESSOR_REFUSED)
        if self.nodes is not None:
            raise BadRequest(
                "custom_logit_processor",
                "custom logit processors run on single-node replicas only (every node of a "
                "multi-node replica would have to load and run the client's code in step)",
            )
        try:
            return load_processor(serialized)
        except ValueError as exc:
            raise BadRequest("custom_logit_processor", str(exc).split(": ", 1)[-1]) from None

    def abort(self, rid: str, message: str = "Abort by user request") -> bool:
        """Abort one request (pending or running; a request of ``n`` samples by its rid or a
        sample's); ``False`` if no such request is in flight."""
        rids = self._groups.get(rid, [rid])
        seqs = [self._live[r] for r in rids if r in self._live]
        for seq in seqs:
            self._abort(seq, message)
        return bool(seqs)

    def abort_all(self, message: str = "Abort by user request") -> int:
        """Abort every request in flight; returns how many."""
        seqs = list(self._live.values())
        for seq in seqs:
            self._abort(seq, message)
        return len(seqs)

    def _abort(self, seq: Sequence, message: str) -> None:
        if seq in self._pending:
            self._pending.remove(seq)
            if seq.retracted and self.nodes is not None:
                self._forget.append(seq.rid)  # the followers hold it since the retract
            seq.finish_reason = {"type": "abort", "message": message}
            self.batch.refresh_text(seq)  # a retracted request has output already
            self._deliver([seq])
        else:
            seq.abort_message = message  # the compute thread finishes it before the next step
            self._wake.set()

    # -- the scheduler loop -----------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self.broken and self._live:
                self.abort_all(f"this multi-node replica cannot generate: {self.broken}")
            aborting = any(s.abort_message is not None for s in self.batch.seqs)
            if self._blocked():
                if aborting:
                    self._deliver(await self.compute(self._drop_aborted))
                continue
            new = self._admit()
            if not new and not len(self.batch):
                continue
            try:
                # Not through compute(): that counts the calls a run of steps must yield to.
                loop = asyncio.get_running_loop()
                changed = await loop.run_in_executor(self._executor, self._step, new)
            except Exception as exc:  # a failed step must not kill the server; fail its requests
                changed = await self.compute(
                    self._fail_step, new, f"engine error: {type(exc).__name__}: {exc}"
                )
            self._deliver(changed)
            # Held across the wait below, this step's lists would keep a phase's last requests
            # (their log-probs: top-k at every position) alive until the next step, whose
            # caller (a switch's generation check) would then pay for freeing them, ~3 ms.
            del changed, new
            if len(self.batch) or self._pending:
                self._wake.set()

    def _admit(self) -> list[Sequence]:
        """Take pending sequences, first come first served, while rows and KV slots last.

        The samples of one prompt are taken together or not at all. Slots the prefix cache
        could evict count as free (a unit needs at most its whole input: a cache hit needs
        less). With the prefix cache on, a prompt that shares its first
        :data:`IN_BATCH_PREFIX_TOKENS` tokens with one taken in this round waits for the next
        step (SGLang's in-batch prefix check), where it reuses what that one prefilled; once
        the cache holds those tokens, prompts sharing them are taken together (as SGLang checks
        only prompts whose cached prefix is that short): the judge prompts of one system prompt
        are admitted in one step, not one a step. Nothing is taken before
        :meth:`_admission_due`.
        """
        new: list[Sequence] = []
        if not self._admission_due():
            return new
        kept: list[Sequence] = []
        rows = len(self.batch)
        cache = self.runner.prefix_cache
        free_slots = cache.available
        taken: set[tuple[int, ...]] = set()
        pending = self._pending
        while pending:
            head = pending[0]
            unit = [head]
            if head.group is not None and not head.retracted:
                for seq in itertools.islice(pending, 1, None):
                    if seq.group != head.group or seq.retracted:
                        break
                    unit.append(seq)
            prefix: tuple[int, ...] | None = None
            if (
                cache.enabled
                and not head.retracted
                and len(head.prompt_ids) > IN_BATCH_PREFIX_TOKENS
            ):
                first = head.prompt_ids[:IN_BATCH_PREFIX_TOKENS]
                if cache.cached(first) < IN_BATCH_PREFIX_TOKENS:
                    prefix = tuple(first)
            if prefix is not None and prefix in taken:
                for _ in unit:
                    kept.append(pending.popleft())
                continue
            need = self.batch.slots_needed(unit)
            if rows + len(unit) > self.max_running_requests or need > free_slots:
                break
            for _ in unit:
                new.append(pending.popleft())
            if prefix is not None:
                taken.add(prefix)
            rows += len(unit)
            free_slots -= need
        pending.extendleft(reversed(kept))
        return new

    # -- compute-thread operations that the followers mirror --------------------------------

    def _tell(self, op: str, **fields: Any) -> None:
        """Send ``op`` to the followers first (compute thread; a no-op on a single node)."""
        if self.nodes is not None:
            forget = []
            while self._forget:
                forget.append(self._forget.popleft())
            self.nodes.send(op, forget=forget, **fields)

    def _step(self, new: list[Sequence]) -> list[Sequence]:
        """One step, then more decode steps while nothing waits for the scheduler loop (no
        arrival it may admit, nothing paused or released, no other compute call queued)
        and nothing is to be delivered (no sequence finished, no stream chunk due), for at most
        :data:`RUN_ON_SECONDS`: a hand-over between the loop and this thread and back leaves the
        device idle between two decode steps (at concurrency 1 a third of a CPU step). A decode
        step started ahead outlives the hand-over: the loop's next step uses it (with the
        arrivals it admits, :meth:`Batch.step`), and a compute call that may change the batch
        drops it (:meth:`compute`)."""
        began = time.monotonic()
        until = began + RUN_ON_SECONDS
        self.runs += 1
        if self.overlap_schedule:  # the next step starts while this one's tokens are appended
            self.batch.run_ahead = lambda seqs: not (self._waiting or self._blocked())
        try:
            changed = self._one_step(new)
            while self._decode_on(changed) and time.monotonic() < until:
                changed = self._one_step([])
        finally:
            self.batch.run_ahead = None
        self.step_seconds += time.monotonic() - began
        return changed

    def _blocked(self) -> bool:
        """Paused, a node lost, or memory released: no step may run."""
        return bool(self.paused or self.broken or self.not_resident())

    def _admission_due(self) -> bool:
        """Whether arrivals may be admitted now: a row is free, and nothing runs,
        ``num_continuous_decode_steps`` steps have passed since the last admission, or the
        arrivals fill the free rows (waiting longer would gather no more of them). Requests
        that arrive one by one, as a reward stage sends them while others end, are then
        prefilled together, a prefill step's fixed cost paid once for them (SGLang's
        ``--num-continuous-decode-steps``)."""
        free = self.max_running_requests - len(self.batch)
        return free > 0 and (
            free == self.max_running_requests
            or self._since_admit + 1 >= self.num_continuous_decode_steps
            or len(self._pending) >= free
        )

    def _decode_on(self, changed: list[Sequence]) -> bool:
        """Whether :meth:`_step` may decode again without the loop (see there). Arrivals
        stop the run only once they may be admitted (:meth:`_admission_due`)."""
        if self._waiting or not len(self.batch) or self._blocked():
            return False
        if self._pending:
            if self._admission_due():
                return False
        elif self._wake.is_set():
            return False
        return not any(
            s.finished
            or (s.stream and len(s.output_ids) - s.delivered >= (s.sampling.stream_interval or 1))
            for s in changed
        )

    def _one_step(self, new: list[Sequence]) -> list[Sequence]:
        if self._reload_due:
            self._reload_due = False
            self._reload_pending()
        aborted = self.batch.aborting()
        self._tell("step", aborted=aborted, new=[s.to_wire() for s in new])
        self._since_admit = 0 if new else self._since_admit + 1
        try:
            return self.batch.step(new, aborted)
        except NodeLost:
            raise
        except Exception as exc:
            if self.nodes is not None:  # the followers ran (part of) it: they may be out of step
                self.nodes.fail(f"a step failed on the head: {type(exc).__name__}: {exc}")
            raise

    def _reload_pending(self) -> None:
        """Read back the discarded weights no push wrote (followers first)."""
        self.batch.drop_ahead()  # started with the weights as they were
        self._tell("reload")
        self.runner.reload_pending()

    def _drop_aborted(self) -> list[Sequence]:
        aborted = self.batch.aborting()
        if not self.broken:
            self._tell("drop", aborted=aborted)
        return self.batch.drop_aborted(aborted)

    def _retract(self) -> list[Sequence]:
        aborted = self.batch.aborting()
        self._tell("retract", aborted=aborted)
        return self.batch.retract(aborted)

    def _flush(self) -> None:
        self._tell("flush")
        self.runner.flush_cache()

    def _resume_on_compute_thread(self, tags: tuple[str, ...], graphs: bool) -> dict[str, Any]:
        self._tell("resume", tags=list(tags), graphs=graphs)  # idempotent on a follower
        return self.runner.resume(tags, graphs=graphs)

    def _load_named(self, named: list[tuple[str, torch.Tensor]], field: str) -> int:
        if self.nodes is not None:
            # Refuse here what the load would refuse, before any follower receives a byte.
            if not self.runner.weights_resident:
                raise WeightsError(
                    "weights are released; resume_memory_occupation(['weights']) first"
                )
            self.runner.check_named(((n, tuple(t.shape)) for n, t in named), field)
            self.nodes.send_tensors(named)
        return self.runner.load_named_tensors(named, field)

    def _versioned(self, load: Callable[[], int], version: str) -> int:
        """Run ``load`` (on the compute thread, between two steps), then move the weight
        version there too: every live sequence with output records the version its tokens so
        far came from, so its answer carries both (``meta_info.weight_versions``)."""
        nbytes = load()
        old = self.weight_version
        if version != old:
            for seq in list(self._live.values()):
                if seq.output_ids:
                    seq.weight_events.append((old, len(seq.output_ids)))
        self.weight_version = version
        return nbytes

    def _load_disk(self, path: str) -> int:
        nbytes = self.runner.load_from_disk(path)  # a bad path fails here, followers untouched
        self._tell("load_disk", path=path)
        return nbytes

    def _fail_step(self, new: list[Sequence], message: str) -> list[Sequence]:
        return self.batch.fail(new, message)

    def snapshot(self, s: Sequence) -> dict[str, Any]:
        """The SGLang ``/generate`` answer object for ``s`` as of now (cumulative)."""
        meta: dict[str, Any] = {
            "id": s.rid,
            "finish_reason": s.finish_reason,
            "prompt_tokens": len(s.prompt_ids),
            "completion_tokens": len(s.output_ids),
            "cached_tokens": s.cached_tokens,
            "e2e_latency": time.time() - s.created,
        }
        spans = weight_spans(s.weight_events, self.weight_version, len(s.output_ids))
        meta["weight_versions"] = spans
        meta["weight_version"] = spans[-1]["version"]
        lp = s.logprob
        if lp.return_logprob:
            meta["input_token_logprobs"] = s.input_token_logprobs or []
            meta["output_token_logprobs"] = list(s.output_token_logprobs)
            if lp.top_logprobs_num:
                meta["input_top_logprobs"] = s.input_top_logprobs or []
                meta["output_top_logprobs"] = list(s.output_top_logprobs)
            if lp.token_ids_logprob is not None:
                meta["input_token_ids_logprobs"] = s.input_token_ids_logprobs or []
                meta["output_token_ids_logprobs"] = list(s.output_token_ids_logprobs)
        if lp.return_sampling_mask:
            meta["output_token_sampling_mask"] = list(s.output_token_sampling_mask)
            meta["output_token_sampling_logprobs"] = list(s.output_token_sampling_logprobs)
            meta["output_token_sampling_mask_length"] = len(s.output_token_sampling_mask)
        return {"text": s.text, "output_ids": list(s.output_ids), "meta_info": meta}

    def _deliver(self, changed: list[Sequence]) -> None:
        for s in changed:
            sink = self._sinks.get(s.rid)
            if sink is None or self._live.get(s.rid) is not s:
                continue
            interval = s.sampling.stream_interval or 1
            if s.finished or (s.stream and len(s.output_ids) - s.delivered >= interval):
                s.delivered = len(s.output_ids)
                sink.put_nowait(self.snapshot(s))
            if s.finished:
                del self._live[s.rid]
                del self._sinks[s.rid]
                if s.group is not None:
                    rids = self._groups.get(s.group, [])
                    if not any(r in self._live for r in rids):
                        self._groups.pop(s.group, None)

    # -- generation helpers -----------------------------------------------------------------

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        logprob: LogprobParams,
        rid: str | None = None,
        processor: str | None = None,
        *,
        check: bool = False,
    ) -> list[dict[str, Any]]:
        """Submit one prompt and wait for the final snapshot of each of its ``n`` samples
        (``check``: as :meth:`submit`'s).

        Every sample is aborted if the caller is cancelled.
        """
        subs = self.submit(prompt_ids, sampling, logprob, rid=rid, processor=processor, check=check)
        try:
            out = []
            for _seq, queue in subs:
                while True:
                    snap = await queue.get()
                    if snap["meta_info"]["finish_reason"] is not None:
                        out.append(snap)
                        break
            return out
        except asyncio.CancelledError:
            for seq, _ in subs:
                self.abort(seq.rid, "Abort: the client went away")
            raise

    async def generate_one(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        logprob: LogprobParams,
        rid: str | None = None,
        *,
        check: bool = False,
    ) -> dict[str, Any]:
        """:meth:`generate` of a single sample (``n`` must be 1)."""
        return (await self.generate(prompt_ids, sampling, logprob, rid, check=check))[0]

    # -- control operations -----------------------------------------------------------------

    def _in_flight(self) -> int:
        return len(self._live)

    async def pause(self, mode: str) -> str:
        """``pause_generation`` with SGLang's modes.

        ``abort`` aborts everything in flight; ``in_place`` keeps the running batch and its KV
        cache; ``retract`` moves running requests back to the queue and drops their KV cache
        (memory can then be released and weights updated; on continue they are prefilled again
        with their tokens so far and carry on).
        """
        if mode not in ("abort", "in_place", "retract"):
            raise Conflict(
                f"mode: {mode!r} is not a pause mode; use 'abort', 'in_place' or 'retract'"
            )
        self.paused = True
        if mode == "abort":
            n = self.abort_all("Abort by pause_generation")
            self._deliver(await self.compute(self._drop_aborted))
            return f"Generation paused; {n} request(s) aborted."
        if mode == "retract":
            retracted = await self.compute(self._retract)
            self._deliver([s for s in retracted if s.finished])
            self._pending.extendleft(reversed([s for s in retracted if not s.finished]))
            return f"Generation paused; {len(retracted)} running request(s) retracted to the queue."
        await self.compute(lambda: None, reads_only=True)  # wait for the step in progress
        return f"Generation paused in place; {self._in_flight()} request(s) kept."

    def resume_generation(self) -> str:
        """``continue_generation``."""
        self.paused = False
        self._wake.set()
        return "Generation continued."

    async def flush_cache(self) -> str:
        """Refused (``Conflict``) while requests run or wait to run (retracted ones may wait)."""
        if len(self.batch) or (self._pending and not self.paused):
            raise Conflict(
                f"Cache not flushed: {self._in_flight()} request(s) are pending or running; "
                "abort them or wait"
            )
        await self.compute(self._flush)
        return "Cache flushed."

    async def release(self, tags: tuple[str, ...]) -> dict[str, Any]:
        """Release ``tags``; refused while sequences are running. Idempotent."""
        async with self._ops:
            started = time.time()
            refused = Conflict(
                f"cannot release memory while {self._in_flight()} request(s) are in flight; "
                "pause_generation (mode 'abort') first"
            )
            if len(self.batch) or (self._pending and not self.paused):
                raise refused
            # Stop admission and scheduling first; then, on the compute thread (after any step
            # already queued), check again that nothing runs before freeing anything.
            before = dict(self.resident)
            for tag in tags:
                self.resident[tag] = False

            def release_on_compute_thread() -> dict[str, Any]:
                if len(self.batch):
                    raise refused
                self._tell("release", tags=list(tags))
                return self.runner.release(tags)

            try:
                detail = await self.compute(release_on_compute_thread)
            except BaseException:
                self.resident.update(before)
                self._wake.set()
                raise
            self.last_release = detail
            self._log_graphs("release", tags)
            self.memory_log.append(
                {
                    "op": "release",
                    "tags": list(tags),
                    "started": started,
                    "at": time.time(),
                    "detail": detail,
                }
            )
            return detail

    def _log_graphs(self, op: str, tags: tuple[str, ...]) -> None:
        # One line per switch in the engine's log: whether it captured (``/server_info`` has
        # the same counts while the engine runs).
        graphs = self.runner.graphs
        if graphs is not None:
            print(
                f"relax-hf: {op} {','.join(tags)}: decode graphs held {graphs.captured}, "
                f"captures {graphs.captures}, replays {graphs.replays}",
                flush=True,
            )

    async def resume(self, tags: tuple[str, ...]) -> dict[str, Any]:
        """Resume ``tags``, weights first. Idempotent."""
        async with self._ops:
            started = time.time()
            graphs = "cuda_graph" in tags or self.resident["cuda_graph"]
            try:
                detail: dict[str, Any] = await self.compute(
                    self._resume_on_compute_thread, tags, graphs
                )
            except PoolUnavailable as exc:  # the tags stay released; the caller can retry
                raise Conflict(f"kv_cache: {exc}") from exc
            info = detail.get("weights", {})
            if info.get("source") == "discarded":
                if info.get("updates_lost"):
                    info["message"] = (
                        f"weights discarded (no CPU backup): the updates since the checkpoint "
                        f"(version {self.weight_version}) were lost; generation is refused until "
                        "a push writes every parameter"
                    )
                self.weight_version = self.checkpoint_version
            for tag in sorted(tags, key=lambda t: t != "weights"):
                self.resident[tag] = True
            self.last_resume = detail
            self._log_graphs("resume", tags)
            self.memory_log.append(
                {
                    "op": "resume",
                    "tags": list(tags),
                    "started": started,
                    "at": time.time(),
                    "detail": detail,
                }
            )
            self._wake.set()
            return detail

    # -- weight updates ---------------------------------------------------------------------

    def _next_version(self, requested: Any) -> str:
        if requested is not None:
            return str(requested)
        current = self.weight_version
        return str(int(current) + 1) if current.isdigit() else f"{current}+1"

    def _prepare_update(self, abort_all_requests: bool) -> None:
        if not self.resident["weights"]:
            raise Conflict(
                "weights are released; resume_memory_occupation(['weights']) before updating them"
            )
        if abort_all_requests:
            self.abort_all("Abort by a weight update")

    async def update_from_tensor(
        self, payloads: Any, load_format: Any, *, abort_all_requests: bool, weight_version: Any
    ) -> dict[str, Any]:
        """Decode the payload (off the compute thread), then load it between two steps."""
        if not isinstance(payloads, list) or not payloads:
            raise WeightsError(
                "serialized_named_tensors: must be a non-empty list (one payload per TP rank)"
            )
        if load_format is not None and not isinstance(load_format, str):
            raise WeightsError("load_format: must be null or a string")
        async with self._ops:
            self._prepare_update(abort_all_requests)
            start = time.perf_counter()
            named = await asyncio.to_thread(
                decode_named_tensors, payloads[0], load_format, "serialized_named_tensors[0]"
            )
            decoded = time.perf_counter()
            nbytes = await self.compute(
                self._versioned,
                lambda: self._load_named(named, "serialized_named_tensors[0]"),
                self._next_version(weight_version),
            )
            end = time.perf_counter()
            return {
                "bytes": nbytes,
                "tensors": len(named),
                "decode_seconds": decoded - start,
                "load_seconds": end - decoded,
            }

    async def update_from_disk(
        self, model_path: Any, *, abort_all_requests: bool, weight_version: Any
    ) -> dict[str, Any]:
        """Load a checkpoint directory between two steps."""
        if not isinstance(model_path, str) or not model_path:
            raise WeightsError("model_path: must be a non-empty string")
        async with self._ops:
            self._prepare_update(abort_all_requests)
            start = time.perf_counter()
            nbytes = await self.compute(
                self._versioned,
                lambda: self._load_disk(model_path),
                self._next_version(weight_version),
            )
            self.checkpoint_version = self.weight_version
            return {"bytes": nbytes, "seconds": time.perf_counter() - start}

    async def init_group(self, body: dict[str, Any]) -> None:
        """Join the trainer's broadcast group (blocks a worker thread, not the loop)."""

        def req(key: str, kind: type) -> Any:
            value = body.get(key)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise WeightsError(f"{key}: required, a {kind.__name__}")
            return value

        kwargs = {
            "master_address": req("master_address", str),
            "master_port": req("master_port", int),
            "rank_offset": req("rank_offset", int),
            "world_size": req("world_size", int),
            "group_name": body.get("group_name") or "weight_update_group",
            "backend": body.get("backend")
            or ("nccl" if self.runner.device.type == "cuda" else "gloo"),
        }
        await asyncio.to_thread(
            lambda: self.group.init(
                **kwargs, device=self.runner.device, timeout_s=self.dist_timeout_s
            )
        )

    async def update_from_distributed(self, body: dict[str, Any]) -> dict[str, Any]:
        """Receive every tensor by broadcast, then load them all (all-or-nothing)."""
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or not names:
            raise WeightsError("names: must be a non-empty list of parameter names")
        if not isinstance(dtypes, list) or len(dtypes) != len(names):
            raise WeightsError(f"dtypes: must be a list of {len(names)} dtypes (one per name)")
        if (
            not isinstance(shapes, list)
            or len(shapes) != len(names)
            or not all(
                isinstance(s, list) and all(isinstance(d, int) and d >= 0 for d in s)
                for s in shapes
            )
        ):
            raise WeightsError(f"shapes: must be a list of {len(names)} shapes (lists of ints)")
        parsed = [parse_dtype(d, f"dtypes[{i}]") for i, d in enumerate(dtypes)]
        load_format = body.get("load_format")
        if load_format not in (None, "default", FLATTENED):
            raise WeightsError(
                f"load_format: {load_format!r} is not supported here; use null (a broadcast per "
                f"tensor) or {FLATTENED!r} (one broadcast of their flat buffer)"
            )
        self.group.check(body.get("group_name") or "weight_update_group")
        async with self._ops:
            self._prepare_update(bool(body.get("abort_all_requests")))
            start = time.perf_counter()

            def receive_and_load() -> int:
                # Receive everything first so the trainer's broadcasts never hang on a bad name.
                named = self.group.receive(
                    names,
                    parsed,
                    shapes,
                    self.runner.device,
                    flattened=load_format == FLATTENED,
                )
                return self._load_named(named, "names")

            nbytes = await self.compute(
                self._versioned, receive_and_load, self._next_version(body.get("weight_version"))
            )
            return {"bytes": nbytes, "seconds": time.perf_counter() - start}

    async def destroy_group(self, group_name: str) -> None:
        """Leave the broadcast group."""
        await asyncio.to_thread(self.group.destroy, group_name)

    async def weights_by_name(self, name: Any, truncate_size: Any) -> list[Any]:
        """SGLang's ``/get_weights_by_name``: parameter ``name`` as nested lists of floats, its
        first dimension cut to ``truncate_size`` rows (read between two steps).

        :raises WeightsError: no such parameter, a bad ``truncate_size``, or the weights are
            released.
        """
        if not isinstance(name, str) or not name:
            raise WeightsError("name: must be a non-empty parameter name")
        if isinstance(truncate_size, bool) or not isinstance(truncate_size, int):
            raise WeightsError(f"truncate_size: must be an integer, got {truncate_size!r}")
        if truncate_size < 1:
            raise WeightsError(f"truncate_size: must be >= 1, got {truncate_size}")

        def read() -> list[Any]:
            if name in self.runner.weights_pending:
                self._reload_pending()  # refused (WeightsError) where the updates were lost
            tensor = self.runner.parameter(name)
            rows = tensor[:truncate_size] if tensor.dim() else tensor
            values: list[Any] = rows.detach().float().cpu().tolist()
            return values

        async with self._ops:
            return await self.compute(read, reads_only=True)


def weight_spans(events: list[tuple[str, int]], current: str, tokens: int) -> list[dict[str, Any]]:
    """SGLang's ``meta_info.weight_versions`` of a response of ``tokens`` tokens: one
    ``{version, start, end}`` span per weight version its tokens came from, in order, from the
    updates that landed while it generated (``events``: the version before each, and the
    output tokens it had then) and the ``current`` version."""
    spans: list[dict[str, Any]] = []
    for version, end in [*events, (current, tokens)]:
        end = min(end, tokens)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        start = spans[-1]["end"] if spans else 0
        spans.append({"version": version, "start": start, "end": end})
    return spans or [{"version": current, "start": 0, "end": 0}]
