"""Continuous batching on the compute thread: prefill, decode, sampling, log-probs, stops.

A :class:`Batch` holds the running sequences. :meth:`Batch.step` either prefills newly
admitted sequences (and adds them to the running batch) or runs one decode step for every
running sequence. Each sequence owns a row of the KV cache pool and the slots of its positions
(reserved when it is prefilled: its prompt plus ``max_new_tokens``, within the context); the
``n`` samples of one request share the prompt's slots, so the prompt is prefilled once and each
sample then draws its own first token from the same logits. Finished and aborted sequences give
their row and slots back at once.

Sampling (:mod:`relax_hf.sampling`) draws each row's noise from a hash of its seed and the
token's index, so a seeded request's tokens do not depend on what else is in the batch.

A multi-node replica runs the same batch on every node: the head hands its followers each
step's new sequences (:meth:`Sequence.to_wire`) and the aborts it applies (``aborted``), and
every node calls :attr:`Batch.sync_tokens` with the tokens it sampled, after which all nodes
continue with the head's tokens (see :mod:`relax_hf.nodes`). Log-probs follow SGLang's
shapes: ``[logprob, token_id, text_or_None]`` entries; the first input position is ``None``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import numpy as np
import torch

from relax_hf.grammar import Constraint
from relax_hf.kvcache import to_device
from relax_hf.logit_processors import Processor, apply_processors
from relax_hf.modeling import DECODE_INPUTS
from relax_hf.prefixcache import CacheNode
from relax_hf.protocol import SAMPLING_MASK_MAX_TOKENS, LogprobParams, SamplingParams
from relax_hf.runner import ModelRunner
from relax_hf.sampling import (
    draw,
    process_logits,
    row_keys,
    sampling_support,
    scaled_logprobs,
)

__all__ = ["Batch", "Sequence", "reservation"]

#: Padded tokens a prefill forward pass may hold (longer prompts run alone).
PREFILL_TOKEN_BUDGET = 8192
#: Positions whose full-vocabulary logits input log-probs compute at a time.
INPUT_LOGPROB_CHUNK = 512


@attrs.define(eq=False)
class Sequence:
    """One generation (one sample of a request) as the compute thread sees it."""

    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    logprob: LogprobParams
    seed: int = 0
    stream: bool = False
    group: str | None = None  # n > 1: shared by the samples of one prompt (one prefill)
    index: int = 0  # the sample's index in its group
    created: float = attrs.field(factory=time.time)
    output_ids: list[int] = attrs.field(factory=list)
    text: str = ""
    finish_reason: dict[str, Any] | None = None
    abort_message: str | None = None
    input_token_logprobs: list[Any] | None = None
    input_top_logprobs: list[Any] | None = None
    input_token_ids_logprobs: list[Any] | None = None
    output_token_logprobs: list[Any] = attrs.field(factory=list)
    output_top_logprobs: list[Any] = attrs.field(factory=list)
    output_token_ids_logprobs: list[Any] = attrs.field(factory=list)
    # SGLang's sampling mask: each draw's support, and the drawn token's (selected) or every
    # support token's (support) log-prob in the distribution it was drawn from.
    output_token_sampling_mask: list[list[int]] = attrs.field(factory=list)
    output_token_sampling_logprobs: list[Any] = attrs.field(factory=list)
    retracted: bool = False  # its KV was dropped; the next prefill feeds its output too
    # (the weight version before an update, output tokens it had then), one per update that
    # landed while it generated: SGLang's weight version events (meta_info.weight_versions)
    weight_events: list[tuple[str, int]] = attrs.field(factory=list)
    # Prompt tokens it did not prefill itself: the prefix cache's match, or (samples 1…n-1 of
    # a group) the whole prompt, which sample 0 prefilled. Set once, at the first prefill.
    cached_tokens: int = 0
    prefilled: bool = False  # its first prefill ran (cached_tokens is final)
    delivered: int = 0  # output tokens at the last streamed snapshot
    # -- compute-thread state --
    row: int | None = None
    slots: list[np.ndarray] = attrs.field(factory=list)  # by position: input, then reserved
    cache_node: CacheNode | None = None  # the prefix cache node it locks
    cache_epoch: int = -1  # the prefix cache's epoch when it was prefilled
    counts: torch.Tensor | None = None  # output token counts (penalties)
    bias: torch.Tensor | None = None  # dense logit bias
    grammar: Constraint | None = None
    prepared: bool = False
    # A custom logit processor (``--enable-custom-logit-processor``): the loaded callable,
    # its serialized form (rows with the same one run together) and its error, if it raised.
    processor: Processor | None = None
    processor_key: str | None = None
    processor_error: str | None = None

    @property
    def finished(self) -> bool:
        """Whether a finish reason is set."""
        return self.finish_reason is not None

    @property
    def start(self) -> int:
        """``logprob_start_len`` resolved as SGLang does (-1 means the last prompt token)."""
        s = self.logprob.logprob_start_len
        return len(self.prompt_ids) - 1 if s < 0 else s

    def to_wire(self) -> dict[str, Any]:
        """What a follower needs to run this sequence exactly as the head does (JSON-able)."""
        return {
            "rid": self.rid,
            "prompt_ids": self.prompt_ids,
            "sampling": self.sampling.to_wire(),
            "logprob": attrs.asdict(self.logprob),
            "seed": self.seed,
            "stream": self.stream,
            "group": self.group,
            "index": self.index,
            "retracted": self.retracted,
        }

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> Sequence:
        """The sequence :meth:`to_wire` described."""
        lp = dict(wire["logprob"])
        if lp["token_ids_logprob"] is not None:
            lp["token_ids_logprob"] = tuple(lp["token_ids_logprob"])
        return cls(
            rid=wire["rid"],
            prompt_ids=list(wire["prompt_ids"]),
            sampling=SamplingParams.from_wire(wire["sampling"]),
            logprob=LogprobParams(**lp),
            seed=int(wire["seed"]),
            stream=bool(wire["stream"]),
            group=wire["group"],
            index=int(wire["index"]),
        )


def reservation(sampling: SamplingParams, fed: int, done: int, context_len: int) -> int:
    """KV slots one sample reserves beyond the ``fed`` tokens it is prefilled with.

    ``max_new_tokens`` less the ``done`` tokens it already has (a retracted sequence), within
    the context; ``None`` reserves up to the context length.
    """
    room = max(context_len - fed, 0)
    mnt = sampling.max_new_tokens
    return room if mnt is None else min(max(mnt - done, 0), room)


def _drawn_in_forward(s: Sequence) -> bool:
    """Whether the forward pass's own sampling is this sequence's draw (no processor, no
    filter, no sampling mask): its logits are the processed ones, its token the draw's."""
    sp = s.sampling
    if s.logprob.return_sampling_mask:
        return False
    if s.bias is not None or s.counts is not None or s.processor is not None:
        return False
    if s.grammar is not None or (sp.min_new_tokens and len(s.output_ids) < sp.min_new_tokens):
        return False
    return sp.greedy or (sp.top_k == -1 and sp.top_p == 1.0 and sp.min_p == 0.0)


#: ``{rid: abort message}`` of running sequences whose abort is applied at a step.
Aborts = Mapping[str, str]

#: A sampled token, its log-prob and log-prob row (``return_logprob``) and its sampling
#: support (``return_sampling_mask``: ids and their log-probs).
Sampled = tuple[int, float | None, torch.Tensor | None, tuple[list[int], list[float]] | None]


def _units(new: list[Sequence]) -> list[list[Sequence]]:
    """Prefill units: the samples of one group together, every other sequence alone."""
    units: list[list[Sequence]] = []
    by_group: dict[str, list[Sequence]] = {}
    for s in new:
        if s.group is not None and not s.retracted:
            unit = by_group.get(s.group)
            if unit is None:
                unit = by_group[s.group] = []
                units.append(unit)
            unit.append(s)
        else:
            units.append([s])
    return units


class Batch:
    """The running batch: sequences and their share of the KV cache pool (compute thread)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.pool = runner.pool
        self.cache = runner.prefix_cache
        self.seqs: list[Sequence] = []
        self.tokens_generated = 0
        self.peak_running = 0  # the most sequences ever decoded together
        self.prefill_tokens = 0  # tokens run through prefill forward passes
        self.prefill_sequences = 0  # prompts (prefill units) prefilled
        self.cached_tokens_total = 0  # sum of the sequences' cached_tokens (SGLang's counter)
        self.prompt_tokens_prefilled = 0  # prompt tokens of the sequences prefilled (first time)
        self.decode_steps = 0
        self.prefill_steps = 0  # steps that prefilled (with a decode of the running ones)
        #: Called with the tokens each sampling picked (one per row); returns the tokens the
        #: batch continues with (a multi-node replica's head tokens). ``None``: no sync.
        self.sync_tokens: Callable[[list[int]], list[int]] | None = None
        #: Asked with a decode step's sequences once its tokens are read, before they are
        #: appended: whether to start the next decode step now, so that the device runs it
        #: while this thread appends, checks and delivers (``None``: never; see
        #: :meth:`_start_ahead`). The engine sets it for a run of steps the loop leaves alone.
        self.run_ahead: Callable[[list[Sequence]], bool] | None = None
        self._ahead: tuple[list[Sequence], torch.Tensor, torch.Tensor] | None = None
        self.ahead_steps = 0  # decode steps started ahead
        self.ahead_dropped = 0  # of those, not used (the loop took over, a stop string matched)
        #: A step's decode outputs held while its prefill runs (:meth:`step`); a graph replay
        #: in that prefill (:meth:`_forward_one`, a prefill graph) copies them first
        #: (:meth:`_keep_held`).
        self._held: list[torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.seqs)

    # -- admission -------------------------------------------------------------------------

    def slots_needed(self, unit: list[Sequence]) -> int:
        """KV slots a prefill unit takes (its input once, then each sample's reservation)."""
        first = unit[0]
        done = len(first.output_ids) if first.retracted else 0
        fed = len(first.prompt_ids) + done
        ctx = self.runner.max_len
        return fed + sum(reservation(s.sampling, fed, done, ctx) for s in unit)

    # -- public --------------------------------------------------------------------------

    def aborting(self) -> dict[str, str]:
        """``{rid: message}`` of the running sequences whose abort was requested (a snapshot)."""
        return {s.rid: s.abort_message for s in self.seqs if s.abort_message is not None}

    def step(self, new: list[Sequence], aborted: Aborts | None = None) -> list[Sequence]:
        """Run one unit of work; return every sequence that changed (new token or finished).

        ``aborted`` (default: :meth:`aborting` now) are finished and removed first. A step with
        ``new`` sequences prefills them and decodes the running ones in the same step: their
        decode step is launched first (or was started ahead), the prefill's kernels queue
        behind it while the host builds them, and its tokens are read after the prefill's; the
        running sequences are not held a step for every prefill (requests arriving one by one
        as others end, as a reward stage sends them, made a prefill step per arrival).
        """
        changed = self._drop_aborted(aborted)
        if new:
            held = None
            if self.seqs:  # a replay in _prefill replaces the held outputs by copies in place
                seqs, logits, tokens = self._decode_launch()
                held = self._held = [logits, tokens]
            try:
                self._prefill(new)
            finally:
                self._held = None
            if held is not None:
                self._decode_finish(seqs, held[0], held[1], ahead=False)
                # _prefill appended the new sequences that go on after the running ones
                self.seqs = [s for s in seqs if not s.finished] + self.seqs[len(seqs) :]
                changed += seqs
            changed += new
        elif self.seqs:
            changed += self._decode()
        return changed

    def retract(self, aborted: Aborts | None = None) -> list[Sequence]:
        """Take every running sequence out of the batch and give its KV cache back.

        Aborted ones are finished; the others are marked ``retracted`` so that their next
        prefill feeds the prompt and every generated token.
        """
        self.drop_ahead()
        out = self._drop_aborted(aborted)
        for s in self.seqs:
            s.retracted = True
            self._free(s)
        out += self.seqs
        self.seqs = []
        return out

    def drop_aborted(self, aborted: Aborts | None = None) -> list[Sequence]:
        """Finish and remove the sequences whose abort was requested (no forward pass)."""
        return self._drop_aborted(aborted)

    def abort_all(self, message: str) -> list[Sequence]:
        """Finish every running sequence with an abort reason and empty the batch."""
        for s in self.seqs:
            s.abort_message = s.abort_message or message
        return self._drop_aborted()

    def fail(self, new: list[Sequence], message: str) -> list[Sequence]:
        """After a step raised: the KV it wrote is suspect, so the prefix cache is dropped first;
        then every running sequence and every new one ends with an abort (rows and slots go
        back). Returns them all."""
        self.drop_ahead()
        self.cache.clear()
        failed = self.abort_all(message)
        for s in new:
            if not s.finished:
                s.finish_reason = {"type": "abort", "message": message}
                self._finish(s)
                failed.append(s)
        return failed

    def clear(self) -> None:
        """Check that the batch is empty (its KV cache is then all free)."""
        assert not self.seqs and self._ahead is None

    @property
    def started_ahead(self) -> bool:
        """Whether a decode step was started ahead (:attr:`run_ahead`) and not yet used."""
        return self._ahead is not None

    def drop_ahead(self) -> None:
        """Forget the decode step started ahead, if one was and is not used: it finishes on the
        device first (it writes its rows' next KV slots, reserved until their rows are freed)."""
        if self._ahead is not None:
            self._ahead = None
            self.ahead_dropped += 1
            self.runner.synchronize()

    # -- text ----------------------------------------------------------------------------

    def decode(
        self, ids: list[int], skip_special_tokens: bool = True, spaces_between: bool = True
    ) -> str:
        """Detokenize, skipping ids the tokenizer does not know (padded vocabularies)."""
        n = len(self.runner.tokenizer)
        kw: dict[str, Any] = {"skip_special_tokens": skip_special_tokens}
        if not spaces_between:
            kw["spaces_between_special_tokens"] = False
        return str(self.runner.tokenizer.decode([i for i in ids if i < n], **kw))

    def _token_text(self, tid: int, want: bool) -> str | None:
        return self.decode([tid], skip_special_tokens=False) if want else None

    def refresh_text(self, s: Sequence) -> None:
        """Recompute ``s.text`` from its output ids, trimming a matched stop as SGLang does."""
        sp = s.sampling
        ids = s.output_ids
        matched = (s.finish_reason or {}).get("matched")
        if isinstance(matched, int) and not sp.no_stop_trim and ids and ids[-1] == matched:
            ids = ids[:-1]
        text = self.decode(ids, sp.skip_special_tokens, sp.spaces_between_special_tokens)
        if isinstance(matched, str):
            idx = text.find(matched)
            if idx >= 0:
                text = text[: idx + len(matched)] if sp.no_stop_trim else text[:idx]
        s.text = text

    # -- pool bookkeeping ----------------------------------------------------------------

    def _free(self, s: Sequence) -> None:
        if s.cache_node is not None:
            if self.cache.enabled and s.cache_epoch == self.cache.epoch and s.slots:
                # Its KV (prompt and outputs but the last, not fed yet) for later sequences.
                done = len(s.prompt_ids) + max(len(s.output_ids) - 1, 0)
                key = np.asarray((s.prompt_ids + s.output_ids)[:done], dtype=np.int64)
                self.cache.insert(key, np.concatenate(s.slots)[:done])
            self.cache.unlock(s.cache_node)
            s.cache_node = None
        for slots in s.slots:
            self.pool.free_slots_of(slots)
        s.slots = []
        if s.row is not None:
            self.pool.free_row(s.row)
            s.row = None

    def _finish(self, s: Sequence) -> None:
        self._free(s)
        self.refresh_text(s)

    def _drop_aborted(self, aborted: Aborts | None = None) -> list[Sequence]:
        # One snapshot decides: an abort requested while this runs waits for the next step (so
        # the head and its followers drop exactly the same sequences).
        if aborted is None:
            aborted = self.aborting()
        gone = [s for s in self.seqs if s.rid in aborted]
        for s in gone:
            s.finish_reason = {"type": "abort", "message": aborted[s.rid]}
            self._finish(s)
        if gone:
            self.seqs = [s for s in self.seqs if s.rid not in aborted]
        return gone

    def _prepare(self, s: Sequence) -> None:
        """Sampling state: dense logit bias, penalty counts, the grammar matcher."""
        if s.prepared:
            return
        sp, device, vocab = s.sampling, self.runner.device, self.runner.vocab_size
        if sp.logit_bias:
            bias = torch.zeros(vocab, dtype=torch.float32)
            for tid, b in sp.logit_bias:
                bias[tid] = b
            s.bias = bias.to(device)
        if sp.penalized:
            s.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        grammar = sp.grammar
        if grammar is not None:
            kind, source = grammar
            compiled = self.runner.grammar.compile(kind, source, f"sampling_params.{kind}")
            s.grammar = self.runner.grammar.constraint(compiled)
        s.prepared = True

    # -- prefill -------------------------------------------------------------------------

    def _place(
        self, unit: list[Sequence], writes: list[tuple[int, int, np.ndarray]]
    ) -> tuple[list[int], int]:
        """Rows and slots for a unit; returns its input ids and how many of them the prefix
        cache holds (they are not prefilled again). Each row's slots go to ``writes`` (for
        :meth:`KVPool.write_rows`)."""
        first = unit[0]
        fed = first.prompt_ids + first.output_ids if first.retracted else list(first.prompt_ids)
        done = len(first.output_ids) if first.retracted else 0
        key = np.asarray(fed, dtype=np.int64)
        # SGLang's bound: at least the last input token is computed (its logits are needed),
        # and input log-probs from logprob_start_len on need those positions' hidden states.
        limit = len(fed) - 1
        if not first.retracted and first.logprob.return_logprob:
            limit = min(limit, first.start)
        hit, prefix, node = self.cache.match(key, limit)
        for _ in unit:
            self.cache.lock(node)  # before any eviction, which must not take the match
        ctx = self.runner.max_len
        wants = [reservation(s.sampling, len(fed), done, ctx) for s in unit]
        self.cache.make_room(len(fed) - hit + sum(wants))
        computed = self.pool.alloc_slots(len(fed) - hit)
        self.pool.share(prefix, len(unit))  # each sample holds the prefix it reads
        if len(unit) > 1:
            self.pool.share(computed, len(unit) - 1)
        shared = np.concatenate((prefix, computed))
        for i, (s, want) in enumerate(zip(unit, wants, strict=True)):
            s.row = self.pool.alloc_row()
            mine = self.pool.alloc_slots(want)
            s.slots = [shared, mine]
            writes.append((s.row, 0, np.concatenate((shared, mine))))  # len(shared) == fed
            s.cache_node = node
            s.cache_epoch = self.cache.epoch
            if not s.prefilled:
                s.cached_tokens = len(first.prompt_ids) if i else hit
                s.prefilled = True
                self.cached_tokens_total += s.cached_tokens
                self.prompt_tokens_prefilled += len(s.prompt_ids)
        return fed, hit

    def _cache_inputs(self, unit: list[Sequence], fed: list[int]) -> None:
        """Insert a unit's input right after its prefill (its KV is now in the pool), so that
        a request arriving while it decodes reuses it; its samples lock the new node."""
        first = unit[0]
        if first.cache_node is None or first.cache_epoch != self.cache.epoch:
            return
        node = self.cache.insert(np.asarray(fed, dtype=np.int64), first.slots[0])
        for s in unit:
            self.cache.lock(node)
            if s.cache_node is not None:
                self.cache.unlock(s.cache_node)
            s.cache_node = node

    def _prefill(self, new: list[Sequence]) -> None:
        self.prefill_steps += 1
        for s in new:
            self._prepare(s)
        units = _units(new)
        writes: list[tuple[int, int, np.ndarray]] = []
        placed = [self._place(u, writes) for u in units]
        self.pool.write_rows(writes)  # every row's slots in one copy, before any forward
        inputs = [fed for fed, _ in placed]
        hits = [hit for _, hit in placed]

        def wants_input_logprobs(u: list[Sequence]) -> bool:
            s = u[0]
            return not s.retracted and s.logprob.return_logprob and s.start < len(s.prompt_ids) - 1

        def kind(i: int) -> tuple[bool, bool]:
            return wants_input_logprobs(units[i]), hits[i] > 0

        # Sequences that want input log-probs need logits at every position; the rest only at
        # the last one; those after a cached prefix attend it from the pool. Within each kind,
        # similar lengths share a padded forward pass.
        last: dict[int, torch.Tensor] = {}
        # A unit with one token to compute (a one-token prompt; a prompt cached but for its
        # last token) is a decode row: with decode graphs, one replay runs them all.
        ones = [
            i
            for i in range(len(units))
            if len(inputs[i]) - hits[i] == 1 and not wants_input_logprobs(units[i])
        ]
        if ones and self.runner.graphs is not None:
            last.update(self._forward_one(ones, units, inputs))
        rest = sorted(set(range(len(units))) - set(last))
        order = sorted(rest, key=lambda i: (kind(i), -len(inputs[i])))
        chunk: list[int] = []
        for i in order:
            if chunk:
                width = len(inputs[chunk[0]])
                if kind(i) != kind(chunk[0]) or width * (len(chunk) + 1) > PREFILL_TOKEN_BUDGET:
                    last.update(self._forward(chunk, units, inputs, hits, kind(chunk[0])[0]))
                    chunk = []
            chunk.append(i)
        if chunk:
            last.update(self._forward(chunk, units, inputs, hits, kind(chunk[0])[0]))
        for unit, fed in zip(units, inputs, strict=True):
            self._cache_inputs(unit, fed)

        # Every sample draws its first token from its unit's last-position logits.
        members = [s for u in units for s in u]
        where = [i for i, u in enumerate(units) for _ in u]
        logits = torch.stack([last[i] for i in where])
        picked = self._sample(logits, members)
        keep: list[Sequence] = []
        for s, tok in zip(members, picked, strict=True):
            s.retracted = False
            if s.sampling.max_new_tokens == 0:
                s.finish_reason = {"type": "length", "length": 0}
                self._finish(s)
                continue
            self._append(s, tok)
            if not s.finished:
                keep.append(s)
        self.seqs += keep
        self.peak_running = max(self.peak_running, len(self.seqs))

    def _forward(
        self,
        chunk: list[int],
        units: list[list[Sequence]],
        inputs: list[list[int]],
        hits: list[int],
        states: bool,
    ) -> dict[int, torch.Tensor]:
        """One padded prefill pass over the tokens of ``chunk``'s units after their cached
        prefixes (``hits``: all 0, or all > 0); the last position's logits of each. ``states``:
        the units want input log-probs (every position's hidden state). Units after cached
        prefixes that want only their last logits replay a prefill graph where one fits."""
        runner = self.runner
        device = runner.device
        width = max(len(inputs[i]) - hits[i] for i in chunk)
        # ids, then each row's length, pool row and cached prefix: one copy to the device
        # that does not wait for its queued work (this step's decode of the running ones)
        host = np.full((len(chunk), width + 3), runner.pad_id, dtype=np.int64)
        for r, i in enumerate(chunk):
            n = len(inputs[i]) - hits[i]
            host[r, :n] = inputs[i][hits[i] :]
            row = units[i][0].row
            assert row is not None  # placed
            host[r, width:] = (n, row, hits[i])
        self.prefill_tokens += int(host[:, width].sum())
        self.prefill_sequences += len(chunk)
        ctx = max(len(inputs[i]) for i in chunk)
        if hits[chunk[0]] and not states:
            captured = runner.prefill_captured(torch.from_numpy(host), ctx, self._keep_held)
            if captured is not None:
                copied = captured.clone()  # the graphs' buffer: the next replay writes it
                for i in chunk:
                    self._unit_input_logprobs(units[i], None)
                return {i: copied[r] for r, i in enumerate(chunk)}
        packed = to_device(torch.from_numpy(host), device)
        ids, lens, rows, starts = (
            packed[:, :width],
            packed[:, width],
            packed[:, width + 1],
            packed[:, width + 2],
        )
        if hits[chunk[0]]:
            hidden = runner.prefill(ids, lens, rows, starts, ctx)
        else:
            hidden = runner.prefill(ids, lens, rows)
        ends = lens - 1
        last_logits = runner.logits(hidden[torch.arange(len(chunk), device=device), ends])
        out: dict[int, torch.Tensor] = {}
        for r, i in enumerate(chunk):
            out[i] = last_logits[r]
            n, hit, start = len(inputs[i]), hits[i], units[i][0].start
            # The match stops at logprob_start_len (hit <= start).
            states_i = hidden[r, start - hit : n - 1 - hit] if start < n - 1 else None
            self._unit_input_logprobs(units[i], states_i)
        return out

    def _forward_one(
        self, chunk: list[int], units: list[list[Sequence]], inputs: list[list[int]]
    ) -> dict[int, torch.Tensor]:
        """The last input token of ``chunk``'s units (the rest cached, none wanting input
        log-probs) as one decode step (its graph when one fits); each one's logits."""
        self._keep_held()
        heads = [units[i][0] for i in chunk]
        positions = [len(inputs[i]) - 1 for i in chunk]
        packed = torch.tensor(
            [[inputs[i][-1] for i in chunk], positions, [h.row for h in heads], [0] * len(chunk)],
            dtype=torch.int64,
        )
        # Its own draw is not used: the first token is drawn below, as after a prefill.
        logits, _ = self.runner.decode(packed, torch.zeros(len(chunk)), max(positions) + 1)
        logits = logits.clone()  # the graph's buffer: a later replay in this prefill may write it
        self.prefill_tokens += len(chunk)
        self.prefill_sequences += len(chunk)
        for i in chunk:
            self._unit_input_logprobs(units[i], None)
        return {i: logits[r] for r, i in enumerate(chunk)}

    def _keep_held(self) -> None:
        """Copy this step's held decode outputs before a graph replays in its prefill: graphs
        share one memory pool, so any replay may write where another graph's outputs are."""
        if self._held is not None:
            self._held[:] = [t.clone() for t in self._held]
            self._held = None  # copies now: nothing more to keep

    def _unit_input_logprobs(self, unit: list[Sequence], states: torch.Tensor | None) -> None:
        """A prefilled unit's input log-probs (``return_logprob``), shared by its samples."""
        head = unit[0]
        if head.logprob.return_logprob and not head.retracted:
            self._input_logprobs(head, states)
            for other in unit[1:]:
                other.input_token_logprobs = head.input_token_logprobs
                other.input_top_logprobs = head.input_top_logprobs
                other.input_token_ids_logprobs = head.input_token_ids_logprobs

    # -- decode --------------------------------------------------------------------------

    def _decode(self) -> list[Sequence]:
        seqs, logits, tokens = self._decode_launch()
        self._decode_finish(seqs, logits, tokens, ahead=True)
        self.seqs = [s for s in seqs if not s.finished]
        return seqs

    def _decode_launch(self) -> tuple[list[Sequence], torch.Tensor, torch.Tensor]:
        """The running sequences' decode step, launched (or the one started ahead for them)."""
        seqs = list(self.seqs)
        ahead = self._ahead
        if ahead is not None and [id(s) for s in ahead[0]] != [id(s) for s in seqs]:
            self.drop_ahead()  # a sequence left the batch (aborted): its rows no longer match
            ahead = None
        self._ahead = None
        if ahead is not None:  # started while the last step's tokens were appended
            logits, tokens = ahead[1], ahead[2]
        else:
            logits, tokens = self._launch(seqs, [s.output_ids[-1] for s in seqs], 0)
        self.decode_steps += 1
        return seqs, logits, tokens

    def _decode_finish(
        self, seqs: list[Sequence], logits: torch.Tensor, tokens: torch.Tensor, *, ahead: bool
    ) -> None:
        """Read and append a launched decode step's tokens (``ahead``: the next step may be
        started before they are appended)."""
        if all(_drawn_in_forward(s) for s in seqs):
            # The forward pass sampled them (in the CUDA graph): the same draw as below, with
            # the log-probs of the rows that want them (rollout's requests) read in one gather.
            ids, picked = self._read_drawn(logits, tokens, seqs)
            if ahead:
                self._start_ahead(seqs, ids)  # after every read of this step's outputs
        else:
            picked = self._sample(logits, seqs)
        for s, tok in zip(seqs, picked, strict=True):
            self._append(s, tok)

    def _read_drawn(
        self, logits: torch.Tensor, tokens: torch.Tensor, seqs: list[Sequence]
    ) -> tuple[list[int], list[Sampled]]:
        """The tokens the forward pass drew, with the log-probs of the rows that want them
        (:meth:`_with_logprobs`). Where no node must agree on the tokens first, the log-probs
        are gathered at the drawn tokens on the device and read with them in one copy: the
        host waits once a step, and the device runs the gather before the step started ahead."""
        if self.sync_tokens is not None or not any(s.logprob.return_logprob for s in seqs):
            ids = tokens.tolist()
            if self.sync_tokens is not None:
                ids = self.sync_tokens(ids)
            return ids, self._with_logprobs(logits, seqs, ids)
        lp = scaled_logprobs(logits, seqs)
        values = lp.gather(1, tokens.view(-1, 1))[:, 0]
        # float64 holds every token id exactly, and every float32 log-prob
        read = torch.stack((tokens.view(-1).to(torch.float64), values.to(torch.float64)))
        drawn, got = read.tolist()
        ids = [int(t) for t in drawn]
        return ids, self._with_logprobs(logits, seqs, ids, (lp, got))

    def _launch(
        self, seqs: list[Sequence], tokens: list[int], ahead: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Start a decode step of ``seqs`` fed ``tokens``, each ``ahead`` tokens past its
        ``output_ids``: the runner's logits and tokens (a graph's: valid until its next replay)."""
        positions = [len(s.prompt_ids) + len(s.output_ids) - 1 + ahead for s in seqs]
        # The rows' part of the sampler's hash, here rather than in the step's kernels.
        keys = row_keys(
            np.array([s.seed for s in seqs], dtype=np.int64),
            np.array([len(s.output_ids) + ahead for s in seqs], dtype=np.int64),
        )
        host = np.array([tokens, positions, [s.row for s in seqs], keys], dtype=np.int64)
        assert len(host) == DECODE_INPUTS
        packed = torch.from_numpy(host)
        temps = torch.tensor(
            [0.0 if s.sampling.greedy else s.sampling.temperature for s in seqs],
            dtype=torch.float32,
        )
        return self.runner.decode(packed, temps, max(positions) + 1)

    def _start_ahead(self, seqs: list[Sequence], ids: list[int]) -> None:
        """Start the step after this one, fed ``ids``, before they are appended (SGLang's
        overlapped scheduling), for the sequences these tokens do not end (a stop token, a
        length): when each of them takes it with the forward pass's own draw (:meth:`_goes_on`),
        no node must agree on the tokens (``sync_tokens``) and :attr:`run_ahead` allows it.
        Requests that end one by one (a judge's) keep the schedule: the step after a finish is
        started for the rest. A sequence a stop string ends (known only once appended) or an
        abort leaves the step unused (:meth:`drop_ahead`)."""
        if self.run_ahead is None or self.sync_tokens is not None:
            return
        going = [
            (s, t)
            for s, t in zip(seqs, ids, strict=True)
            if self._token_or_length_end(s, t, len(s.output_ids) + 1) is None
        ]
        rows = [s for s, _ in going]
        if rows and all(self._goes_on(s, t) for s, t in going) and self.run_ahead(rows):
            self._ahead = (rows, *self._launch(rows, [t for _, t in going], 1))
            self.ahead_steps += 1

    def _goes_on(self, s: Sequence, tok: int) -> bool:
        """Whether ``s``, having drawn ``tok``, takes its next step with the forward pass's draw:
        no stop token, length or context limit ends it there (:meth:`_token_or_length_end`),
        and ``min_new_tokens`` is met (as :func:`_drawn_in_forward` asks)."""
        n = len(s.output_ids) + 1
        return self._token_or_length_end(s, tok, n) is None and n >= s.sampling.min_new_tokens

    # -- sampling and log-probs ----------------------------------------------------------

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[Sampled]:
        """Pick one token per row; returns (token, log-prob row or None, sampling support or
        None) per sequence."""
        z = process_logits(logits, seqs, self.runner.eos_ids)
        if any(s.processor is not None for s in seqs):
            z = apply_processors(z.clone() if z is logits else z, seqs)
        picked = draw(z, seqs).tolist()
        if self.sync_tokens is not None:
            picked = self.sync_tokens(picked)
        masked = [i for i, s in enumerate(seqs) if s.logprob.return_sampling_mask]
        support: dict[int, tuple[list[int], list[float]]] = {}
        if masked:
            rows = torch.tensor(masked, device=z.device)
            found = sampling_support(
                z.index_select(0, rows), [seqs[i] for i in masked], [picked[i] for i in masked]
            )
            support = dict(zip(masked, found, strict=True))
        out = self._with_logprobs(z, seqs, picked)
        return [(t, v, lp, support.get(i)) for i, (t, v, lp, _) in enumerate(out)]

    def _with_logprobs(
        self,
        z: torch.Tensor,
        seqs: list[Sequence],
        picked: list[int],
        read: tuple[torch.Tensor, list[float]] | None = None,
    ) -> list[Sampled]:
        """Each picked token with its log-prob under the processed logits ``z`` (for the
        sequences that want it) and its log-prob row (for those that want top or given ids'
        log-probs too): one gather and one copy to the host for the batch, not one per row.
        ``read``: the log-prob rows and the picked tokens' values, already gathered."""
        if not any(s.logprob.return_logprob for s in seqs):
            return [(t, None, None, None) for t in picked]
        if read is not None:
            lp, values = read
        else:
            lp = scaled_logprobs(z, seqs)
            chosen = torch.tensor(picked, device=lp.device)[:, None]
            values = lp.gather(1, chosen)[:, 0].tolist()
        out: list[Sampled] = []
        for i, (t, v, s) in enumerate(zip(picked, values, seqs, strict=True)):
            want = s.logprob
            if not want.return_logprob:
                out.append((t, None, None, None))
                continue
            row = want.top_logprobs_num or want.token_ids_logprob is not None
            out.append((t, v, lp[i] if row else None, None))
        return out

    @staticmethod
    def _finite(values: list[float]) -> list[float]:
        # Banned tokens (grammar, min_new_tokens, logit_bias -inf) have -inf log-probs: JSON
        # has no such number, so they are clamped to float32's lowest, as SGLang does.
        low = -3.4028234663852886e38
        return [v if v > low else low for v in values]

    def _entries(self, lp: torch.Tensor, ids: list[int], want_text: bool) -> list[list[Any]]:
        vals = self._finite(lp[torch.tensor(ids, device=lp.device)].tolist())
        return [[v, t, self._token_text(t, want_text)] for v, t in zip(vals, ids, strict=True)]

    def _top(self, lp: torch.Tensor, k: int, want_text: bool) -> list[list[Any]]:
        vals, idx = torch.topk(lp, k)
        return [
            [v, t, self._token_text(t, want_text)]
            for v, t in zip(self._finite(vals.tolist()), idx.tolist(), strict=True)
        ]

    def _input_logprobs(self, s: Sequence, hidden: torch.Tensor | None) -> None:
        """``hidden`` are the states of positions ``start … n-2`` (predicting ``start+1 …
        n-1``). Their logits are made :data:`INPUT_LOGPROB_CHUNK` positions at a time, so a
        long prompt never holds a full-vocabulary row for every position."""
        lpp: LogprobParams = s.logprob
        want = lpp.return_text_in_logprobs
        prompt = s.prompt_ids
        start = s.start
        tokens: list[list[Any]] = [[None, prompt[start], self._token_text(prompt[start], want)]]
        tops: list[Any] = [None]
        by_id: list[Any] = [None]
        if hidden is not None:
            temp = 1.0 if s.sampling.greedy else s.sampling.temperature
            targets = torch.tensor(prompt[start + 1 :], device=hidden.device)
            wanted = None
            by_ids = list(lpp.token_ids_logprob or ())
            if lpp.token_ids_logprob is not None:
                wanted = torch.tensor(by_ids, device=hidden.device)
            for c in range(0, hidden.shape[0], INPUT_LOGPROB_CHUNK):
                part = hidden[c : c + INPUT_LOGPROB_CHUNK]
                lp = torch.log_softmax(self.runner.logits(part) / temp, dim=-1)
                ids = prompt[start + 1 + c : start + 1 + c + part.shape[0]]
                vals = self._finite(lp.gather(1, targets[c : c + len(ids), None])[:, 0].tolist())
                for v, t in zip(vals, ids, strict=True):
                    tokens.append([v, t, self._token_text(t, want)])
                if lpp.top_logprobs_num:
                    top_vals, top_ids = torch.topk(lp, lpp.top_logprobs_num, dim=-1)
                    for vs, ts in zip(top_vals.tolist(), top_ids.tolist(), strict=True):
                        tops.append(
                            [
                                [v, t, self._token_text(t, want)]
                                for v, t in zip(self._finite(vs), ts, strict=True)
                            ]
                        )
                if wanted is not None:
                    picked = lp.index_select(1, wanted).tolist()
                    for vs in picked:
                        by_id.append(
                            [
                                [v, t, self._token_text(t, want)]
                                for v, t in zip(self._finite(vs), by_ids, strict=True)
                            ]
                        )
                del lp
        s.input_token_logprobs = tokens
        s.input_top_logprobs = tops if lpp.top_logprobs_num else None
        s.input_token_ids_logprobs = by_id if lpp.token_ids_logprob is not None else None

    def _append(self, s: Sequence, sampled: Sampled) -> None:
        tok, value, lp, support = sampled
        if s.processor_error is not None:
            # Drawn from logits its processor did not rewrite: not a token of this request.
            s.finish_reason = {"type": "abort", "message": s.processor_error}
            self._finish(s)
            return
        s.output_ids.append(tok)
        self.tokens_generated += 1
        if s.counts is not None:
            s.counts[tok] += 1
        lpp = s.logprob
        if value is not None:
            want = lpp.return_text_in_logprobs
            value = self._finite([value])[0]
            s.output_token_logprobs.append([value, tok, self._token_text(tok, want)])
            if lpp.top_logprobs_num and lp is not None:
                s.output_top_logprobs.append(self._top(lp, lpp.top_logprobs_num, want))
            if lpp.token_ids_logprob is not None and lp is not None:
                s.output_token_ids_logprobs.append(
                    self._entries(lp, list(lpp.token_ids_logprob), want)
                )
        if support is not None:
            ids, lps = support
            s.output_token_sampling_mask.append(ids)
            if s.logprob.sampling_logprobs_mode == "support":
                s.output_token_sampling_logprobs.append(lps)
            else:
                s.output_token_sampling_logprobs.append(lps[ids.index(tok)] if tok in ids else None)
        rejected = s.grammar is not None and not s.grammar.accept(tok)
        if support is not None and len(support[0]) > SAMPLING_MASK_MAX_TOKENS:
            s.finish_reason = {
                "type": "abort",
                "message": "Sampling support exceeds --sampling-mask-max-tokens="
                f"{SAMPLING_MASK_MAX_TOKENS}, commonly because of cutoff ties. Lower top_k to "
                "leave more headroom or increase the server limit.",
            }
        elif rejected:
            s.finish_reason = {
                "type": "abort",
                "message": f"token {tok} is not allowed by the request's grammar",
            }
        else:
            self._check_finish(s, tok)
        if s.finished:
            self._finish(s)
        elif s.stream:
            self.refresh_text(s)

    def _tail_text(self, s: Sequence, tokens: int) -> str:
        sp = s.sampling
        ids = s.output_ids[-tokens:] if tokens < len(s.output_ids) else s.output_ids
        return self.decode(ids, sp.skip_special_tokens, sp.spaces_between_special_tokens)

    def _check_finish(self, s: Sequence, tok: int) -> None:
        """SGLang's order: stop strings and regexes, stop tokens, length, grammar end."""
        sp = s.sampling
        if sp.stop or sp.stop_regex:
            # Decoding a tail long enough for any stop (SGLang decodes a bounded tail too).
            text = self._tail_text(s, _stop_window(sp))
            for stop in sp.stop:
                if stop in text:
                    s.finish_reason = {"type": "stop", "matched": stop}
                    return
            for pattern in sp.stop_regex:
                if re.search(pattern, text):
                    s.finish_reason = {"type": "stop", "matched": pattern}
                    return
        reason = self._token_or_length_end(s, tok, len(s.output_ids))
        if reason is None and s.grammar is not None and s.grammar.terminated:
            reason = {"type": "stop", "matched": tok}
        if reason is not None:
            s.finish_reason = reason

    def _token_or_length_end(self, s: Sequence, tok: int, n: int) -> dict[str, Any] | None:
        """Why ``s`` ends with ``tok`` as its ``n``-th output token, known without its text: a
        stop token, then ``max_new_tokens``, then the context (SGLang's order); else ``None``."""
        sp = s.sampling
        if not sp.ignore_eos and (tok in sp.stop_token_ids or tok in self.runner.eos_ids):
            return {"type": "stop", "matched": tok}
        if sp.max_new_tokens is not None and n >= sp.max_new_tokens:
            return {"type": "length", "length": sp.max_new_tokens}
        if len(s.prompt_ids) + n >= self.runner.max_len:
            return {"type": "length", "length": n}
        return None


_WINDOWS: dict[tuple[tuple[str, ...], tuple[str, ...]], int] = {}


def _stop_window(sp: SamplingParams) -> int:
    """Output tokens to decode for stop matching: enough for the longest stop (1 char ≥ 1 token
    in the worst case), or everything when a regex is unbounded."""
    key = (sp.stop, sp.stop_regex)
    hit = _WINDOWS.get(key)
    if hit is None:
        longest = max((len(st) for st in sp.stop), default=0)
        for pattern in sp.stop_regex:
            longest = max(longest, _regex_max_chars(pattern))
        hit = min(longest, 1 << 30) + 2
        _WINDOWS[key] = hit
    return hit


def _regex_max_chars(pattern: str) -> int:
    """An upper bound of the characters a match of ``pattern`` spans (huge when unbounded)."""
    import re._parser as sre_parse  # Python >= 3.11

    def walk(sub: Any) -> int:
        total = 0
        for op, value in sub:
            name = str(op)
            if name in ("LITERAL", "NOT_LITERAL", "IN", "ANY", "CATEGORY"):
                total += 1
            elif name == "SUBPATTERN":
                total += walk(value[-1])
            elif name == "BRANCH":
                total += max(walk(b) for b in value[1])
            elif name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
                _lo, hi, inner = value
                total += (1 << 30) if hi == sre_parse.MAXREPEAT else hi * walk(inner)
            elif name in ("AT",):
                continue
            else:
                total += 1 << 30
        return total

    return walk(sre_parse.parse(pattern))
