"""Admission of arrivals while sequences run: ``--num-continuous-decode-steps`` (SGLang's flag).

Requests that arrive one by one while others decode (a reward stage's, sent as earlier ones
end) each cost a prefill step at the default (1); with N they wait at most N - 1 steps and are
prefilled together. The engine is driven step by step in process (its scheduler loop's own
calls, ``_admit`` and ``_step``), so each arrival lands between two known steps; the flag's way
from the command line to ``/server_info`` runs on a real engine server. Last, the loop keeps
no request alive once its answer is delivered.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from relax_hf import engine as engine_module
from relax_hf.batch import Sequence
from relax_hf.engine import Engine
from relax_hf.protocol import LogprobParams, SamplingParams
from relax_hf.runner import ModelRunner

LONG = SamplingParams(temperature=0.0, max_new_tokens=400, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def runner(tiny_model: Path) -> ModelRunner:
    return ModelRunner(str(tiny_model), max_total_tokens=8192)


def _engine(runner: ModelRunner, steps: int, max_running: int = 64) -> Engine:
    runner.prefix_cache.clear()
    return Engine(
        runner,
        served_model_name="t",
        max_running_requests=max_running,
        num_continuous_decode_steps=steps,
    )


def _running(
    runner: ModelRunner,
    monkeypatch: pytest.MonkeyPatch,
    steps: int,
    *,
    run_on: float = 0.0,
    max_running: int = 64,
) -> tuple[Engine, Sequence]:
    """An engine at N = ``steps`` with one long request submitted; ``RUN_ON_SECONDS`` set to
    ``run_on`` (0: one step per ``_step`` call, so each arrival lands between two steps)."""
    monkeypatch.setattr(engine_module, "RUN_ON_SECONDS", run_on)
    engine = _engine(runner, steps, max_running)
    ((seq, _),) = engine.submit([3, 4, 5], LONG, LogprobParams())
    return engine, seq


def _arrivals(
    engine: Engine, count: int, prompt: Callable[[int], list[int]]
) -> tuple[list[int], list[Sequence]]:
    """One long request, then one arrival before each of ``count`` single steps (the loop's
    ``_admit`` then ``_step``): how many each step admitted, and the arrivals."""
    engine._step(engine._admit() or [])
    admitted, arrived = [], []
    for i in range(count):
        ((seq, _),) = engine.submit(prompt(i), SHORT, LogprobParams())
        arrived.append(seq)
        new = engine._admit()
        admitted.append(len(new))
        engine._step(new)
    return admitted, arrived


def _prompt(i: int) -> list[int]:
    return [5 + i, 17, 23 + i, 40]


def _drain(engine: Engine) -> None:
    """Abort what is left and free its rows and slots (the runner's pool outlives the engine)."""
    engine.abort_all()
    engine._step([])
    assert not len(engine.batch)


def test_arrivals_wait_for_companions_at_most_n_minus_one_steps(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, _ = _running(runner, monkeypatch, 1)
    at_once, _ = _arrivals(engine, 8, _prompt)
    assert at_once == [1] * 8  # the default: a prefill step for every arrival
    prefills = engine.batch.prefill_steps
    _drain(engine)

    engine, _ = _running(runner, monkeypatch, 4)
    waited, seqs = _arrivals(engine, 8, _prompt)
    # After the long one's prefill, three steps decode only; the fourth admits the four
    # arrivals held since, then three more wait.
    assert waited == [0, 0, 0, 4, 0, 0, 0, 4]
    assert engine.batch.prefill_steps == 3 and prefills == 9
    while not all(s.finished for s in seqs):
        engine._step([])
    _drain(engine)
    # What the held arrivals draw is what they draw admitted at once (greedy; other batches).
    engine = _engine(runner, 1)
    alone = [engine.submit(_prompt(i), SHORT, LogprobParams())[0][0] for i in range(8)]
    engine._step(engine._admit())
    while len(engine.batch):
        engine._step([])
    assert [s.output_ids for s in seqs] == [s.output_ids for s in alone]
    assert all(len(s.output_ids) == SHORT.max_new_tokens for s in seqs)


def test_nothing_waits_when_nothing_runs_or_the_arrivals_fill_the_batch(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, first = _running(runner, monkeypatch, 100, max_running=4)
    assert engine._admit() == [first]  # an idle engine admits at once
    engine._step([first])
    ((second, _),) = engine.submit(_prompt(0), LONG, LogprobParams())
    assert engine._admit() == []  # one arrival, three free rows: it waits
    engine._step([])
    more = [engine.submit(_prompt(i), LONG, LogprobParams())[0][0] for i in (1, 2)]
    # Three arrivals fill the three free rows: waiting longer would gather nothing more.
    assert engine._admit() == [second, *more]
    _drain(engine)


def test_held_arrivals_do_not_end_a_run_of_decode_steps_before_they_are_due(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A run of decode steps (the compute thread's, between two hand-overs to the scheduler
    # loop) goes on while its arrivals are held, and ends at the step that may admit them.
    engine, _ = _running(runner, monkeypatch, 5, run_on=600.0)
    engine._step(engine._admit())  # the prefill (the submit's wake ends this run at once)
    steps = engine.batch.decode_steps
    engine.submit(_prompt(0), SHORT, LogprobParams())
    assert engine._admit() == []
    runs = engine.runs
    engine._step([])
    # Steps 2, 3 and 4 after the prefill decode in one run; the fifth is the loop's, admitting.
    assert engine.runs == runs + 1 and engine.batch.decode_steps == steps + 4
    assert engine._admission_due()
    new = engine._admit()
    assert len(new) == 1
    engine._step(new)
    _drain(engine)


def test_the_flag_reaches_the_engine_and_is_refused_below_one(start_server: Any) -> None:
    from relax_hf.cli import main

    server = start_server("hf-continuous-4", extra_args=("--num-continuous-decode-steps", "4"))
    assert server.http.ok("/server_info")["num_continuous_decode_steps"] == 4
    out = server.http.generate("Hi", sampling_params={"max_new_tokens": 3, "ignore_eos": True})
    assert len(out["output_ids"]) == 3
    assert main(["serve", "--model", "/nowhere", "--num-continuous-decode-steps", "0"]) == 2


def test_a_full_batch_decodes_on_while_requests_wait_for_a_row(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    # At the default N = 1 too: a waiting request that no row can take does not end the run
    # of decode steps at every step; the finish that frees a row does.
    monkeypatch.setattr(engine_module, "RUN_ON_SECONDS", 600.0)
    engine = _engine(runner, 1, max_running=1)
    ((first, _),) = engine.submit([3, 4, 5], SHORT, LogprobParams())
    engine._step(engine._admit())  # its prefill (the submit's wake ends this run at once)
    ((second, _),) = engine.submit(_prompt(0), SHORT, LogprobParams())
    assert engine._admit() == []  # no free row
    runs = engine.runs
    engine._step([])
    assert engine.runs == runs + 1 and first.finished  # one run, to the finish
    assert engine._admit() == [second]
    engine._step([second])
    _drain(engine)


def test_the_scheduler_loop_frees_a_delivered_request_before_its_next_step(
    runner: ModelRunner,
) -> None:
    # The loop once held its last step's sequences while it waited for work: a phase's last
    # requests (the teacher's top-k log-probs at every position) lived on until the next
    # step, and the first request after the phase (a switch's generation check) paid ~3 ms
    # freeing them. Once the answer has come, nothing of the request is left in the engine.
    asked = LogprobParams(return_logprob=True, logprob_start_len=0, top_logprobs_num=4)

    async def drive() -> tuple[bool, bool]:
        engine = _engine(runner, 1)
        engine.start()
        try:
            ((seq, queue),) = engine.submit([3, 4, 5, 6, 7], SHORT, asked)
            ref = weakref.ref(seq)
            del seq
            while (await queue.get())["meta_info"]["finish_reason"] is None:
                pass
            # The compute thread's executor lets go of its last call's arguments just after
            # handing back the result: a call behind it waits for that, and steps nothing.
            await engine.compute(lambda: None, reads_only=True)
            freed = ref() is None
            # The loop is idle again, waiting; the next request runs as before.
            out = await engine.generate_one([3, 4, 5], SHORT, LogprobParams())
            return freed, len(out["output_ids"]) == SHORT.max_new_tokens
        finally:
            await engine.stop()

    assert asyncio.run(drive()) == (True, True)
