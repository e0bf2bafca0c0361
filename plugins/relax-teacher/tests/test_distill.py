"""The teacher distillation stage: prefill requests routed by route key with one replica per
group, one discovery fetch per batch, fields written per sample.

The teachers are real HTTP servers on loopback speaking SGLang's prefill answer (log-probs
derived from the token ids), so each test knows which server scored which sample — the routing,
the client and the sockets are the real ones. The same stage against real hf engines is in
test_deferred_real.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from relax_teacher import DistillationStage
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from relax_core import (
    RegistryPublisher,
    RoleClients,
    RoutingSpec,
    Sample,
    ScoringError,
    StageContext,
    validate_samples,
)
from relax_core.testing import serve_app


def teacher_app(name: str, seen: list[tuple[str, list[int]]], *, short: bool = False) -> Any:
    async def generate(request: Request) -> JSONResponse:
        body = await request.json()
        ids = body["input_ids"]
        start = body["logprob_start_len"]
        k = body.get("top_logprobs_num") or 0
        seen.append((name, ids))
        positions = ids[start:] if not short else ids[start + 1 :]
        lps = [[None if i == 0 else -0.1 * (i % 5 + 1), t, None] for i, t in enumerate(positions)]
        tops = [
            None if i == 0 else [[-0.05 * (j + 1), 100 + j, None] for j in range(k)]
            for i in range(len(positions))
        ]
        meta = {"input_token_logprobs": lps, "input_top_logprobs": tops}
        return JSONResponse({"text": "", "output_ids": [], "meta_info": meta})

    return Starlette(routes=[Route("/generate", generate, methods=["POST"])])


@contextlib.contextmanager
def teachers(short: bool = False) -> Iterator[tuple[Any, list[tuple[str, list[int]]], list[int]]]:
    seen: list[tuple[str, list[int]]] = []
    fetches: list[int] = []
    publisher = RegistryPublisher(
        "teacher",
        RoutingSpec(default_model="math", route_key_map={"math": "math", "code": "code"}),
    )
    with contextlib.ExitStack() as stack:
        for model, replicas in (("math", 2), ("code", 1)):
            publisher.set_model(
                model, state="READY", route_mode="DIRECT", weight_source="STATIC",
                served_model_name=model,
            )  # fmt: skip
            for i in range(replicas):
                name = f"{model}/replica-{i}"
                url = stack.enter_context(serve_app(teacher_app(name, seen, short=short)))
                publisher.set_engine(model, name, base_url=url, state="READY")

        def provider() -> Any:
            fetches.append(1)
            return publisher.snapshot()

        yield provider, seen, fetches


def batch(groups: int = 6, n: int = 3) -> list[Sample]:
    def key(g: int) -> str:
        return "code" if g % 3 == 2 else "math"

    return [
        Sample(
            f"g{g}-s{i}", f"g{g}", [1, 2, 3], [10 + g, 20 + i, 30], metadata={"route_key": key(g)}
        )
        for g in range(groups)
        for i in range(n)
    ]


def test_prefills_follow_the_route_key_and_keep_each_group_on_one_replica() -> None:
    with teachers() as (provider, seen, fetches):
        samples = batch()
        stage = DistillationStage("teacher", top_k=3)
        clients = RoleClients({"teacher": provider}, ttl=600.0)
        report = asyncio.run(stage.run(samples, StageContext(0, clients)))

    by_ids = {tuple(ids): server for server, ids in seen}
    assert len(seen) == len(samples)  # one request per sample, none replayed
    for group in {s.group_id for s in samples}:
        members = [s for s in samples if s.group_id == group]
        servers = {by_ids[(*s.prompt_ids, *s.response_ids)] for s in members}
        assert len(servers) == 1, (group, servers)  # one replica per group
        model = members[0].metadata["route_key"]
        assert servers.pop().startswith(f"{model}/")  # the route key picked the model
    engines = report.details["group_engines"]
    assert set(engines.values()) == {"math/replica-0", "math/replica-1", "code/replica-0"}
    assert fetches == [1]  # one discovery fetch for 18 prefills
    assert validate_samples(samples, stage.fields) == []
    s = samples[0]
    assert s.fields["teacher_logprobs"] == pytest.approx((-0.2, -0.3, -0.4))
    assert s.fields["teacher_topk_ids"] == ((100, 101, 102),) * 3
    assert report.counts == {"requests": 18, "groups": 6}


def test_a_prefill_answer_with_the_wrong_number_of_logprobs_fails_the_stage_naming_the_sample() -> (
    None
):
    with teachers(short=True) as (provider, _, _):
        stage = DistillationStage("teacher")
        clients = RoleClients({"teacher": provider})
        with pytest.raises(ScoringError, match=r"prefill of sample g0-s0 \(group g0\).*expected"):
            asyncio.run(stage.run(batch(1, 1), StageContext(0, clients)))


def test_a_student_stage_writes_student_logprobs_only() -> None:
    with teachers() as (provider, _, _):
        samples = batch(2, 1)
        stage = DistillationStage("teacher", student=True)
        asyncio.run(stage.run(samples, StageContext(0, RoleClients({"teacher": provider}))))
    assert [f.name for f in stage.fields] == ["student_logprobs"]
    assert all(
        len(s.fields["student_logprobs"]) == 3 and "teacher_logprobs" not in s.fields
        for s in samples
    )


def test_a_trajectory_is_prefilled_whole_and_distilled_on_the_policys_tokens_only() -> None:
    # A multi-turn trajectory: tokens 1-2 of the response are an environment's (mask 0).
    trajectory = Sample(
        "g0-s0", "g0", [1, 2, 3], [10, 11, 12, 13], metadata={"route_key": "math"},
        loss_mask=(1, 0, 0, 1),
    )  # fmt: skip
    plain = Sample("g1-s0", "g1", [1, 2, 3], [10, 11, 12, 13], metadata={"route_key": "math"})
    with teachers() as (provider, seen, _):
        stage = DistillationStage("teacher")
        clients = RoleClients({"teacher": provider})
        asyncio.run(stage.run([trajectory, plain], StageContext(0, clients)))
    # The teacher read the whole sequence, the environment's tokens as context.
    assert sorted(ids for _, ids in seen) == [[1, 2, 3, 10, 11, 12, 13]] * 2
    full = plain.fields["teacher_logprobs"]
    assert all(v < 0 for v in full)
    assert trajectory.fields["teacher_logprobs"] == (full[0], 0.0, 0.0, full[3])
    assert validate_samples([trajectory, plain], stage.fields) == []


def test_a_group_whose_first_resolution_found_the_teacher_starting_resolves_anew_on_retry() -> None:
    """The teacher's replica is being rebuilt as a group's first prefill resolves its target
    (the model STARTING: nothing sent); its retry resolves again and finds it READY, instead of
    meeting the group's failed resolution once more."""
    with teachers() as (provider, seen, _):
        spec = RoutingSpec(default_model="math", route_key_map={"math": "math"})
        starting = RegistryPublisher("teacher", spec)
        starting.set_model(
            "math", state="STARTING", route_mode="DIRECT", weight_source="STATIC",
            served_model_name="math",
        )  # fmt: skip
        fetches: list[int] = []

        def rebuilt_after_two_fetches() -> Any:
            fetches.append(1)
            return starting.snapshot() if len(fetches) <= 2 else provider()

        samples = [s for s in batch(groups=2, n=2) if s.metadata["route_key"] == "math"]
        stage = DistillationStage("teacher", top_k=0, retries=2)  # the stage kind's default
        clients = RoleClients({"teacher": rebuilt_after_two_fetches}, ttl=0.0)
        asyncio.run(stage.run(samples, StageContext(0, clients)))
    assert len(seen) == len(samples)  # each prefilled once, once the teacher was READY
    assert all("teacher_logprobs" in s.fields for s in samples)


def test_the_top_k_fields_are_checked_whole_and_each_problem_named_as_before() -> None:
    # A step's top-k fields are checked over all their rows at once (C loops: the Python loop
    # per row was most of a GPU step's 46-85 ms of validation); any doubt falls back to the
    # row-by-row walk, whose messages name the first bad row and column.
    from relax_teacher.distill import _topk_fine, teacher_topk_fields

    k, tokens = 4, 5
    ids_field, lps_field = teacher_topk_fields(k)

    def problems(ids: Any, lps: Any) -> list[str]:
        sample = Sample("g0-s0", "g0", [1, 2], [7] * tokens)
        sample.fields.update(teacher_topk_ids=ids, teacher_topk_logprobs=lps)
        return validate_samples([sample], (ids_field, lps_field))

    good_ids = [[3, 9, 0, 12]] * tokens
    good_lps = [[-0.1, -0.5, -0.5, -3.0]] * tokens
    assert problems(good_ids, good_lps) == [] and _topk_fine(good_ids, good_lps, k)
    assert problems(tuple(map(tuple, good_ids)), tuple(map(tuple, good_lps))) == []

    def row(rows: list[Any], at: int, value: Any) -> list[Any]:
        return [value if i == at else r for i, r in enumerate(rows)]

    def cell(rows: list[list[Any]], t: int, j: int, value: Any) -> list[list[Any]]:
        return row(rows, t, [value if c == j else v for c, v in enumerate(rows[t])])

    cases = {
        "teacher_topk_ids[2][1] = True is not a token id": (cell(good_ids, 2, 1, True), good_lps),
        "teacher_topk_ids[0][3] = -1 is not a token id": (cell(good_ids, 0, 3, -1), good_lps),
        "teacher_topk_ids[4][0] = 3.0 is not a token id": (cell(good_ids, 4, 0, 3.0), good_lps),
        "teacher_topk_ids[1] is not 4 ids": (row(good_ids, 1, [1, 2, 3]), good_lps),
        "teacher_topk_logprobs[3] is not 4 log-probs": (good_ids, row(good_lps, 3, "abcd")),
        "teacher_topk_logprobs[1] is not sorted descending (at 3)": (
            good_ids, cell(good_lps, 1, 3, -0.2),
        ),
        "teacher_topk_logprobs[0][0] = 0.5 is not a finite log-prob <= 0": (
            good_ids, cell(good_lps, 0, 0, 0.5),
        ),
        "teacher_topk_logprobs[4][2] = nan is not a finite log-prob <= 0": (
            good_ids, cell(good_lps, 4, 2, float("nan")),
        ),
        "teacher_topk_logprobs[2][3] = -inf is not a finite log-prob <= 0": (
            good_ids, cell(good_lps, 2, 3, float("-inf")),
        ),
        "teacher_topk_ids has 4 rows for 5 response tokens": (good_ids[:4], good_lps),
    }  # fmt: skip
    for message, (ids, lps) in cases.items():
        (problem,) = problems(ids, lps)
        assert message in problem, (message, problem)
        assert not _topk_fine(ids, lps, k), message
