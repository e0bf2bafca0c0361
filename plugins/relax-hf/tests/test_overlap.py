"""The overlapped schedule (``Batch.run_ahead``): the next decode step starts before the last
one's tokens are appended, and must give exactly the tokens, log-probs and finish reasons of the
steps taken one after the other.

In process on CPU, with the decode-graph machinery emulated (``emulate_cuda_graph``): a started
step replays a graph whose static buffers hold the outputs the last step's reads must be done
with, as on a GPU. On CPU the started step runs at once; on a GPU it overlaps the appends (the
speed is ``relax-hf gpu-bench``'s to measure, on the H200)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from relax_hf.batch import Batch, Sequence
from relax_hf.protocol import LogprobParams, SamplingParams
from relax_hf.runner import ModelRunner

PROMPTS = ["Once upon a time", "Question: what is two plus two?", "def add(a, b):", "The sky"]


@pytest.fixture(scope="module")
def runner(tiny_model: Path) -> ModelRunner:
    return ModelRunner(str(tiny_model), max_total_tokens=2048, emulate_cuda_graph=True)


def _ids(runner: ModelRunner, text: str) -> list[int]:
    return list(runner.tokenizer(text, add_special_tokens=False)["input_ids"])


def _run(
    runner: ModelRunner, requests: list[tuple[str, SamplingParams, LogprobParams]], ahead: bool
) -> tuple[list[Sequence], Batch]:
    """Every request to its end in one batch, each step started ahead when ``ahead``."""
    runner.prefix_cache.clear()  # both runs prefill in full
    batch = Batch(runner)
    if ahead:
        batch.run_ahead = lambda seqs: True
    seqs = [
        Sequence(rid=str(i), prompt_ids=_ids(runner, p), sampling=sp, logprob=lp, seed=11 + i)
        for i, (p, sp, lp) in enumerate(requests)
    ]
    batch.step(seqs)
    while len(batch):
        batch.step([])
    batch.drop_ahead()
    assert batch.pool.free_slots + batch.cache.tokens == batch.pool.capacity
    return seqs, batch


def _outcome(seqs: list[Sequence]) -> list[tuple[Any, ...]]:
    return [
        (s.output_ids, s.output_token_logprobs, s.output_top_logprobs, s.finish_reason, s.text)
        for s in seqs
    ]


Requests = Callable[[ModelRunner], list[tuple[str, SamplingParams, LogprobParams]]]


def _greedy_lengths(runner: ModelRunner) -> list[tuple[str, SamplingParams, LogprobParams]]:
    # Rows that end at different steps: the batch shrinks under the started steps.
    return [
        (p, SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True), LogprobParams())
        for p, n in zip(PROMPTS, (5, 9, 16, 1), strict=True)
    ]


def _sampled_logprobs(runner: ModelRunner) -> list[tuple[str, SamplingParams, LogprobParams]]:
    # Seeded draws in the forward pass, with their log-probs read before the next step starts.
    sp = SamplingParams(temperature=0.9, max_new_tokens=12, ignore_eos=True)
    plain, top = LogprobParams(return_logprob=True), LogprobParams(True, top_logprobs_num=3)
    return [(PROMPTS[0], sp, plain), (PROMPTS[1], sp, top), (PROMPTS[2], sp, plain)]


def _stops(runner: ModelRunner) -> list[tuple[str, SamplingParams, LogprobParams]]:
    # A stop token, min_new_tokens holding it off, and a stop string (known only once appended).
    free = SamplingParams(temperature=0.0, max_new_tokens=14, ignore_eos=True)
    seqs, _ = _run(runner, [(PROMPTS[1], free, LogprobParams())], ahead=False)
    out = seqs[0].output_ids
    text = runner.tokenizer.decode(out[4:7])
    return [
        (PROMPTS[1], SamplingParams(temperature=0.0, stop_token_ids=(out[3],)), LogprobParams()),
        (
            PROMPTS[1],
            SamplingParams(
                temperature=0.0, stop_token_ids=(out[3],), min_new_tokens=6, max_new_tokens=20
            ),
            LogprobParams(),
        ),
        (
            PROMPTS[1],
            SamplingParams(temperature=0.0, stop=(text,), max_new_tokens=14),
            LogprobParams(),
        ),
        (PROMPTS[3], free, LogprobParams()),
    ]


@pytest.mark.parametrize("requests", [_greedy_lengths, _sampled_logprobs, _stops])
def test_steps_started_ahead_change_no_token_log_prob_or_finish(
    runner: ModelRunner, requests: Requests
) -> None:
    asked = requests(runner)
    one_by_one, plain = _run(runner, asked, ahead=False)
    overlapped, batch = _run(runner, asked, ahead=True)
    assert _outcome(overlapped) == _outcome(one_by_one)
    assert plain.ahead_steps == 0 and plain.decode_steps == batch.decode_steps
    # Every step but those after a row's known last token started ahead.
    assert batch.ahead_steps > 0
    assert batch.ahead_steps - batch.ahead_dropped <= batch.decode_steps


def test_a_stop_string_leaves_the_step_started_ahead_unused(runner: ModelRunner) -> None:
    asked = _stops(runner)
    seqs, batch = _run(runner, asked, ahead=True)
    stop = asked[1][1].stop_token_ids[0]
    assert seqs[0].output_ids[-1] == stop and seqs[0].finish_reason == {
        "type": "stop",
        "matched": stop,
    }
    assert len(seqs[1].output_ids) >= 6 and stop not in seqs[1].output_ids[:6]  # min_new_tokens
    assert seqs[2].finish_reason is not None and seqs[2].finish_reason["type"] == "stop"
    assert batch.ahead_dropped >= 1  # the step started with the stop string's row in it


def test_no_step_starts_ahead_unless_asked_or_where_nodes_agree_on_tokens(
    runner: ModelRunner,
) -> None:
    asked = _greedy_lengths(runner)
    _, refused = _run(runner, asked, ahead=False)
    assert refused.ahead_steps == 0
    runner.prefix_cache.clear()
    batch = Batch(runner)
    batch.run_ahead = lambda seqs: True
    batch.sync_tokens = lambda ids: ids  # a multi-node replica's head: followers mirror steps
    seqs = [
        Sequence(
            rid="0",
            prompt_ids=_ids(runner, PROMPTS[0]),
            sampling=asked[2][1],
            logprob=LogprobParams(),
        )
    ]
    batch.step(seqs)
    while len(batch):
        batch.step([])
    assert batch.ahead_steps == 0 and len(seqs[0].output_ids) == 16


def test_an_engine_starts_steps_ahead_unless_told_not_to(
    shared_server: Any, start_server: Any
) -> None:
    # The same model and seed in two real engines; the one with SGLang's flag starts none.
    off = start_server("hf-no-overlap", extra_args=("--disable-overlap-schedule",))
    body = {
        "text": PROMPTS,
        "sampling_params": {"max_new_tokens": 20, "temperature": 0.0, "ignore_eos": True},
        "return_logprob": True,
    }
    keys = ("decode_steps_total", "decode_steps_ahead_total", "decode_steps_ahead_dropped_total")
    outputs, counters = [], []
    for server in (shared_server, off):
        before = server.http.ok("/server_info")
        out = server.http.ok("/generate", body)
        outputs.append([(o["output_ids"], o["meta_info"]["output_token_logprobs"]) for o in out])
        after = server.http.ok("/server_info")
        counters.append([after[k] - before[k] for k in keys])
    assert [ids for ids, _ in outputs[0]] == [ids for ids, _ in outputs[1]]
    for (_, a), (_, b) in zip(outputs[0], outputs[1], strict=True):
        assert [e[0] for e in a] == pytest.approx([e[0] for e in b], abs=1e-4)
    # Every decode step but the last started the next, across the compute thread's hand-overs
    # to the scheduler loop too, and none was thrown away; the flag's engine started none.
    (steps, ahead, dropped), off_counters = counters
    assert steps == 19 and (ahead, dropped) == (18, 0)
    assert off_counters == [19, 0, 0]


@pytest.mark.parametrize("ahead", [False, True])
def test_a_prefill_step_decodes_the_running_sequences_as_steps_apart_would(
    runner: ModelRunner, ahead: bool
) -> None:
    # Requests arriving while others run (a reward stage's, as others end): each step that
    # prefills one also decodes the running ones, which end with the tokens and log-probs of a
    # batch without arrivals. A one-token prompt (the onload's generation check) runs through
    # the decode graph of the running row's shape, whose outputs that step reads after it.
    sp = SamplingParams(temperature=0.9, max_new_tokens=10, ignore_eos=True)
    lp = LogprobParams(return_logprob=True)
    alone, _ = _run(runner, [(PROMPTS[0], sp, lp)], ahead)
    runner.prefix_cache.clear()
    batch = Batch(runner)
    if ahead:
        batch.run_ahead = lambda seqs: True
    first = Sequence(rid="0", prompt_ids=_ids(runner, PROMPTS[0]), sampling=sp, logprob=lp, seed=11)
    batch.step([first])
    batch.step([])
    one = SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True)
    arrivals = [
        Sequence(rid="a", prompt_ids=_ids(runner, "The")[:1], sampling=one, logprob=lp),
        Sequence(rid="b", prompt_ids=_ids(runner, PROMPTS[1]), sampling=one, logprob=lp),
    ]
    for new in arrivals:
        had = len(first.output_ids)
        steps = (batch.prefill_steps, batch.decode_steps)
        batch.step([new])
        assert len(first.output_ids) == had + 1  # decoded in the prefill's step
        assert (batch.prefill_steps, batch.decode_steps) == (steps[0] + 1, steps[1] + 1)
        assert new.output_ids and new in batch.seqs
    while len(batch):
        batch.step([])
    batch.drop_ahead()
    # The same draws; the log-probs to rounding (rows of other batch sizes sum in other orders).
    (want,) = alone
    assert (first.output_ids, first.finish_reason) == (want.output_ids, want.finish_reason)
    got = [e[0] for e in first.output_token_logprobs]
    assert got == pytest.approx([e[0] for e in want.output_token_logprobs], abs=1e-4)
    assert batch.pool.free_slots + batch.cache.tokens == batch.pool.capacity


def test_the_steps_after_a_finish_start_ahead_for_the_rows_that_go_on(
    runner: ModelRunner,
) -> None:
    # Rows that end one by one (a judge phase's): each step but the last starts the next for
    # the rows its tokens do not end, and every one of those steps is used.
    seqs, batch = _run(runner, _greedy_lengths(runner), ahead=True)
    assert [len(s.output_ids) for s in seqs] == [5, 9, 16, 1]
    assert batch.decode_steps == 15  # the longest row's tokens after the prefill's
    assert (batch.ahead_steps, batch.ahead_dropped) == (14, 0)
