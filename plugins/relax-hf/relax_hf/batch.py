"""Continuous batching on the compute thread: prefill, decode, sampling, log-probs, stops.

A :class:`Batch` holds the running sequences, their left-padded attention mask and one
transformers ``DynamicCache``. :meth:`Batch.step` either prefills newly admitted sequences
(and merges them into the running batch) or runs one decode step for every running sequence.
Finished and aborted sequences leave the batch at once.

Sampling uses one ``torch.Generator`` per sequence, drawn from once per generated token, so a
seeded request's tokens do not depend on what else is in the batch.

A multi-node replica runs the same batch on every node: the head hands its followers each
step's new sequences (:meth:`Sequence.to_wire`) and the aborts it applies (``aborted``), and
every node calls :attr:`Batch.sync_tokens` with the tokens it sampled, after which all nodes
continue with the head's tokens (see :mod:`relax_hf.nodes`). Log-probs follow SGLang's
shapes: ``[logprob, token_id, text_or_None]`` entries; the first input position is ``None``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch

from relax_hf.protocol import LogprobParams, SamplingParams
from relax_hf.runner import ModelRunner

__all__ = ["Batch", "Sequence"]


@attrs.define(eq=False)
class Sequence:
    """One generation request as the compute thread sees it."""

    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    logprob: LogprobParams
    generator: torch.Generator | None
    stream: bool = False
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
    position: int = 0
    retracted: bool = False  # its KV cache was dropped; the next prefill feeds its output too
    seed: int | None = None  # the sampling generator's seed (None: greedy, no generator)

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
            "sampling": attrs.asdict(self.sampling),
            "logprob": attrs.asdict(self.logprob),
            "seed": self.seed,
            "stream": self.stream,
            "retracted": self.retracted,
        }

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any], device: torch.device) -> Sequence:
        """The sequence :meth:`to_wire` described, with a fresh generator of the same seed."""
        sp = dict(wire["sampling"])
        sp["stop"] = tuple(sp["stop"])
        sp["stop_token_ids"] = tuple(sp["stop_token_ids"])
        lp = dict(wire["logprob"])
        if lp["token_ids_logprob"] is not None:
            lp["token_ids_logprob"] = tuple(lp["token_ids_logprob"])
        seed = wire["seed"]
        return cls(
            rid=wire["rid"],
            prompt_ids=list(wire["prompt_ids"]),
            sampling=SamplingParams(**sp),
            logprob=LogprobParams(**lp),
            generator=None if seed is None else seeded_generator(seed, device),
            stream=bool(wire["stream"]),
            seed=seed,
        )


def seeded_generator(seed: int, device: torch.device) -> torch.Generator:
    """A sampling generator on ``device`` seeded with ``seed``."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


#: ``{rid: abort message}`` of running sequences whose abort is applied at a step.
Aborts = Mapping[str, str]


class Batch:
    """The running batch: sequences, attention mask, KV cache (compute thread only)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.seqs: list[Sequence] = []
        self.cache: Any = None
        self.mask: torch.Tensor | None = None
        self.last: torch.Tensor | None = None
        self.tokens_generated = 0
        self.peak_running = 0  # the most sequences ever decoded together
        #: Called with the tokens each sampling picked (one per row); returns the tokens the
        #: batch continues with (a multi-node replica's head tokens). ``None``: no sync.
        self.sync_tokens: Callable[[list[int]], list[int]] | None = None

    def __len__(self) -> int:
        return len(self.seqs)

    # -- public --------------------------------------------------------------------------

    def aborting(self) -> dict[str, str]:
        """``{rid: message}`` of the running sequences whose abort was requested (a snapshot)."""
        return {s.rid: s.abort_message for s in self.seqs if s.abort_message is not None}

    def step(self, new: list[Sequence], aborted: Aborts | None = None) -> list[Sequence]:
        """Run one unit of work; return every sequence that changed (new token or finished).

        ``aborted`` (default: :meth:`aborting` now) are finished and removed first.
        """
        changed = self._drop_aborted(aborted)
        if new:
            self._prefill(new)
            changed += new
        elif self.seqs:
            changed += self._decode()
        return changed

    def retract(self, aborted: Aborts | None = None) -> list[Sequence]:
        """Take every running sequence out of the batch and drop the KV cache.

        Aborted ones are finished; the others are marked ``retracted`` so that their next
        prefill feeds the prompt and every generated token.
        """
        out = self._drop_aborted(aborted)
        for s in self.seqs:
            s.retracted = True
        out += self.seqs
        self.seqs = []
        self.clear()
        return out

    def drop_aborted(self, aborted: Aborts | None = None) -> list[Sequence]:
        """Finish and remove the sequences whose abort was requested (no forward pass)."""
        return self._drop_aborted(aborted)

    def abort_all(self, message: str) -> list[Sequence]:
        """Finish every running sequence with an abort reason and empty the batch."""
        for s in self.seqs:
            s.abort_message = s.abort_message or message
        return self._drop_aborted()

    def clear(self) -> None:
        """Drop the KV cache of an empty batch."""
        assert not self.seqs
        self.cache = self.mask = self.last = None

    # -- text ----------------------------------------------------------------------------

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Detokenize, skipping ids the tokenizer does not know (padded vocabularies)."""
        n = len(self.runner.tokenizer)
        return str(
            self.runner.tokenizer.decode(
                [i for i in ids if i < n], skip_special_tokens=skip_special_tokens
            )
        )

    def _token_text(self, tid: int, want: bool) -> str | None:
        return self.decode([tid], skip_special_tokens=False) if want else None

    def refresh_text(self, s: Sequence) -> None:
        """Recompute ``s.text`` from its output ids (trimming a matched stop, as SGLang does)."""
        ids = s.output_ids
        matched = (s.finish_reason or {}).get("matched")
        if isinstance(matched, int) and not s.sampling.no_stop_trim and ids and ids[-1] == matched:
            ids = ids[:-1]
        text = self.decode(ids, s.sampling.skip_special_tokens)
        if isinstance(matched, str) and not s.sampling.no_stop_trim:
            idx = text.find(matched)
            if idx >= 0:
                text = text[:idx]
        s.text = text

    # -- batch surgery -------------------------------------------------------------------

    def _drop_aborted(self, aborted: Aborts | None = None) -> list[Sequence]:
        # One snapshot decides: an abort requested while this runs waits for the next step (so
        # the head and its followers drop exactly the same sequences).
        if aborted is None:
            aborted = self.aborting()
        gone = [s for s in self.seqs if s.rid in aborted]
        for s in gone:
            s.finish_reason = {"type": "abort", "message": aborted[s.rid]}
            self.refresh_text(s)
        if gone:
            self._keep([i for i, s in enumerate(self.seqs) if s.rid not in aborted])
        return gone

    def _keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` of the batch (a no-op when every row stays)."""
        if len(rows) == len(self.seqs):
            return
        self.seqs = [self.seqs[i] for i in rows]
        if not rows:
            self.clear()
            return
        assert self.mask is not None and self.last is not None
        idx = torch.tensor(rows, device=self.mask.device)
        self.mask = self.mask[idx]
        self.last = self.last[idx]
        for layer in self.cache.layers:
            layer.keys = layer.keys[idx]
            layer.values = layer.values[idx]
        self._trim()

    def _trim(self) -> None:
        """Cut the leading columns that are padding in every row."""
        if self.mask is None or not self.seqs:
            return
        cols = int(torch.nonzero(self.mask.any(0))[0, 0])
        if cols:
            self.mask = self.mask[:, cols:]
            for layer in self.cache.layers:
                layer.keys = layer.keys[:, :, cols:, :]
                layer.values = layer.values[:, :, cols:, :]

    def _merge(
        self, seqs: list[Sequence], cache: Any, mask: torch.Tensor, last: torch.Tensor
    ) -> None:
        if not self.seqs:
            self.seqs, self.cache, self.mask, self.last = list(seqs), cache, mask, last
            self.peak_running = max(self.peak_running, len(self.seqs))
            return
        assert self.mask is not None and self.last is not None
        length = max(self.mask.shape[1], mask.shape[1])

        def pad(t: torch.Tensor, dim: int) -> torch.Tensor:
            missing = length - t.shape[dim]
            if missing == 0:
                return t
            shape = list(t.shape)
            shape[dim] = missing
            return torch.cat([t.new_zeros(shape), t], dim=dim)

        for mine, theirs in zip(self.cache.layers, cache.layers, strict=True):
            mine.keys = torch.cat([pad(mine.keys, 2), pad(theirs.keys, 2)], dim=0)
            mine.values = torch.cat([pad(mine.values, 2), pad(theirs.values, 2)], dim=0)
        self.mask = torch.cat([pad(self.mask, 1), pad(mask, 1)], dim=0)
        self.last = torch.cat([self.last, last], dim=0)
        self.seqs += seqs
        self.peak_running = max(self.peak_running, len(self.seqs))

    # -- prefill and decode --------------------------------------------------------------

    def _prefill(self, new: list[Sequence]) -> None:
        # Sequences that want input log-probs need logits at every position; the rest only at
        # the last one, so they are prefilled apart (bounded logits memory).
        def wants_input_logprobs(s: Sequence) -> bool:
            return not s.retracted and s.logprob.return_logprob and s.start < len(s.prompt_ids) - 1

        full = [s for s in new if wants_input_logprobs(s)]
        rest = [s for s in new if not wants_input_logprobs(s)]
        for group in (full, rest):
            if group:
                self._prefill_group(group, full=group is full)

    def _prefill_group(self, new: list[Sequence], *, full: bool) -> None:
        runner = self.runner
        device = runner.device
        # A retracted sequence is prefilled with its output so far and continues from there.
        inputs = [s.prompt_ids + s.output_ids if s.retracted else s.prompt_ids for s in new]
        length = max(len(x) for x in inputs)
        ids = torch.full((len(new), length), runner.pad_id, dtype=torch.long)
        mask = torch.zeros((len(new), length), dtype=torch.long)
        for i, (s, x) in enumerate(zip(new, inputs, strict=True)):
            n = len(x)
            ids[i, length - n :] = torch.tensor(x, dtype=torch.long)
            mask[i, length - n :] = 1
            s.position = n
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = runner.new_cache()
        logits = runner.forward(ids, mask, positions, cache, logits_to_keep=0 if full else 1)
        for i, s in enumerate(new):
            if s.logprob.return_logprob and not s.retracted:
                self._input_logprobs(s, logits[i], length - len(s.prompt_ids) if full else None)
        tokens = self._sample(logits[:, -1, :].float(), new)
        keep = []
        for i, s in enumerate(new):
            s.retracted = False
            if s.sampling.max_new_tokens == 0:
                s.finish_reason = {"type": "length", "length": 0}
                self.refresh_text(s)
                continue
            self._append(s, tokens[i])
            if not s.finished:
                keep.append(i)
        if keep:
            idx = torch.tensor(keep, device=device)
            for layer in cache.layers:
                layer.keys = layer.keys[idx]
                layer.values = layer.values[idx]
            last = torch.tensor(
                [[new[i].output_ids[-1]] for i in keep], dtype=torch.long, device=device
            )
            self._merge([new[i] for i in keep], cache, mask[idx], last)
            self._trim()

    def _decode(self) -> list[Sequence]:
        assert self.mask is not None and self.last is not None
        device = self.runner.device
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(self.seqs), 1))], dim=1)
        positions = torch.tensor([[s.position] for s in self.seqs], dtype=torch.long, device=device)
        logits = self.runner.forward(self.last, self.mask, positions, self.cache)
        tokens = self._sample(logits[:, -1, :].float(), self.seqs)
        seqs = list(self.seqs)
        for s, tok in zip(seqs, tokens, strict=True):
            s.position += 1
            self._append(s, tok)
        self.last = torch.tensor([[t for t, _ in tokens]], dtype=torch.long).T.to(device)
        self._keep([i for i, s in enumerate(seqs) if not s.finished])
        return seqs

    # -- sampling and log-probs ----------------------------------------------------------

    def _scaled(self, z: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
        return z if sp.greedy else z / sp.temperature

    def _sample(
        self, logits: torch.Tensor, seqs: list[Sequence]
    ) -> list[tuple[int, torch.Tensor | None]]:
        """Pick one token per row; returns (token, log-prob row or None) per sequence.

        Batched: temperature, top-k, top-p and min-p are applied to all rows at once and the
        draw is an exponential race (``argmax p / E`` with ``E ~ Exp(1)``), which samples
        exactly from ``p``. Each row's noise comes from its own generator, so a seeded row's
        token does not depend on the other rows. One device sync per step.
        """
        device = logits.device
        z = logits
        banned_rows = [
            (i, s)
            for i, s in enumerate(seqs)
            if s.sampling.min_new_tokens and len(s.output_ids) < s.sampling.min_new_tokens
        ]
        if banned_rows:
            z = z.clone()
            for i, s in banned_rows:
                banned = set(s.sampling.stop_token_ids) | (
                    set() if s.sampling.ignore_eos else set(self.runner.eos_ids)
                )
                if banned:
                    z[i, torch.tensor(sorted(banned), device=device)] = float("-inf")
        temps = torch.tensor(
            [1.0 if s.sampling.greedy else s.sampling.temperature for s in seqs], device=device
        )
        scaled = z / temps[:, None]
        want_lp = any(s.logprob.return_logprob for s in seqs)
        lp = torch.log_softmax(scaled, dim=-1) if want_lp else None
        tokens = torch.argmax(z, dim=-1)
        rows = [i for i, s in enumerate(seqs) if not s.sampling.greedy]
        if rows:
            sub = [seqs[i] for i in rows]
            idx = torch.tensor(rows, device=device)
            filt = scaled[idx]
            ks = [s.sampling.top_k if 0 < s.sampling.top_k < filt.shape[-1] else 0 for s in sub]
            if any(ks):
                kmax = max(ks)
                top = torch.topk(filt, kmax, dim=-1).values
                k_idx = torch.tensor([max(k, 1) - 1 for k in ks], device=device)
                kth = top.gather(1, k_idx[:, None])
                kth = torch.where(
                    torch.tensor(ks, device=device)[:, None] > 0,
                    kth,
                    torch.full_like(kth, float("-inf")),
                )
                filt = filt.masked_fill(filt < kth, float("-inf"))
            probs = torch.softmax(filt, dim=-1)
            top_ps = [s.sampling.top_p for s in sub]
            if any(p < 1.0 for p in top_ps):
                sorted_p, order = torch.sort(probs, dim=-1, descending=True)
                drop = (sorted_p.cumsum(-1) - sorted_p) > torch.tensor(top_ps, device=device)[
                    :, None
                ]
                probs = probs.scatter(1, order, sorted_p.masked_fill(drop, 0.0))
            min_ps = [s.sampling.min_p for s in sub]
            if any(min_ps):
                floor = (
                    torch.tensor(min_ps, device=device)[:, None]
                    * probs.max(dim=-1, keepdim=True).values
                )
                probs = probs.masked_fill(probs < floor, 0.0)
            noise = torch.stack(
                [
                    torch.empty(probs.shape[-1], device=device).exponential_(generator=s.generator)
                    for s in sub
                ]
            )
            tokens[idx] = torch.argmax(probs / noise, dim=-1)
        picked = tokens.tolist()
        if self.sync_tokens is not None:
            picked = self.sync_tokens(picked)
        return [
            (tok, None if lp is None or not s.logprob.return_logprob else lp[i])
            for i, (tok, s) in enumerate(zip(picked, seqs, strict=True))
        ]

    def _entries(self, lp: torch.Tensor, ids: list[int], want_text: bool) -> list[list[Any]]:
        vals = lp[torch.tensor(ids, device=lp.device)].tolist()
        return [[v, t, self._token_text(t, want_text)] for v, t in zip(vals, ids, strict=True)]

    def _top(self, lp: torch.Tensor, k: int, want_text: bool) -> list[list[Any]]:
        vals, idx = torch.topk(lp, k)
        return [
            [v, t, self._token_text(t, want_text)]
            for v, t in zip(vals.tolist(), idx.tolist(), strict=True)
        ]

    def _input_logprobs(self, s: Sequence, logits: torch.Tensor, offset: int | None) -> None:
        lpp: LogprobParams = s.logprob
        want = lpp.return_text_in_logprobs
        prompt = s.prompt_ids
        start, n = s.start, len(prompt)
        first = [None, prompt[start], self._token_text(prompt[start], want)]
        tokens: list[list[Any]] = [first]
        tops: list[Any] = [None]
        by_id: list[Any] = [None]
        if start < n - 1:
            assert offset is not None
            rows = self._scaled(logits[offset + start : offset + n - 1].float(), s.sampling)
            lp = torch.log_softmax(rows, dim=-1)
            targets = torch.tensor(prompt[start + 1 :], device=lp.device)
            vals = lp.gather(1, targets[:, None])[:, 0].tolist()
            for v, t in zip(vals, prompt[start + 1 :], strict=True):
                tokens.append([v, t, self._token_text(t, want)])
            for r in range(lp.shape[0]):
                if lpp.top_logprobs_num:
                    tops.append(self._top(lp[r], lpp.top_logprobs_num, want))
                if lpp.token_ids_logprob is not None:
                    by_id.append(self._entries(lp[r], list(lpp.token_ids_logprob), want))
        s.input_token_logprobs = tokens
        s.input_top_logprobs = tops if lpp.top_logprobs_num else None
        s.input_token_ids_logprobs = by_id if lpp.token_ids_logprob is not None else None

    def _append(self, s: Sequence, sampled: tuple[int, torch.Tensor | None]) -> None:
        tok, lp = sampled
        s.output_ids.append(tok)
        self.tokens_generated += 1
        lpp = s.logprob
        if lp is not None:
            want = lpp.return_text_in_logprobs
            s.output_token_logprobs.append([float(lp[tok]), tok, self._token_text(tok, want)])
            if lpp.top_logprobs_num:
                s.output_top_logprobs.append(self._top(lp, lpp.top_logprobs_num, want))
            if lpp.token_ids_logprob is not None:
                s.output_token_ids_logprobs.append(
                    self._entries(lp, list(lpp.token_ids_logprob), want)
                )
        self._check_finish(s, tok)
        if s.finished or s.stream:
            self.refresh_text(s)

    def _check_finish(self, s: Sequence, tok: int) -> None:
        sp = s.sampling
        if tok in sp.stop_token_ids or (not sp.ignore_eos and tok in self.runner.eos_ids):
            s.finish_reason = {"type": "stop", "matched": tok}
            return
        if sp.stop:
            text = self.decode(s.output_ids, sp.skip_special_tokens)
            hits = [(text.find(stop), stop) for stop in sp.stop if stop in text]
            if hits:
                s.finish_reason = {"type": "stop", "matched": min(hits)[1]}
                return
        if len(s.output_ids) >= sp.max_new_tokens:
            s.finish_reason = {"type": "length", "length": sp.max_new_tokens}
        elif len(s.prompt_ids) + len(s.output_ids) >= self.runner.max_len:
            s.finish_reason = {"type": "length", "length": len(s.output_ids)}
