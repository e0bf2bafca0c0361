"""Replica states, resident tags and transitions: the pure part of the InferenceManager."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from relax_core.errors import InferenceRecoveryRequired, LifecycleError, NotApplicable
from relax_core.manager import (
    ALL_TAGS,
    TAG_ORDER,
    HealthReport,
    LifecycleResult,
    Outcome,
    Replica,
    ReplicaHealth,
    ReplicaResult,
    ReplicaState,
    normalize_tags,
    plan_offload,
    plan_onload,
)

S = ReplicaState


def ready_replica() -> Replica:
    rep = Replica(index=0, engine_id="m/replica-0", base_url="http://127.0.0.1:1")
    rep.resident = ALL_TAGS
    rep.weights_valid = True
    rep.became_ready()
    return rep


def test_ready_needs_every_tag_valid_weights_and_open_admission() -> None:
    rep = ready_replica()
    assert rep.is_ready and rep.direct_eligible
    rep.admission_open = False
    assert not rep.is_ready and not rep.direct_eligible
    rep.admission_open = True
    rep.weights_valid = False
    assert not rep.is_ready


def test_became_ready_refuses_missing_tags_or_invalid_weights() -> None:
    rep = Replica(index=0, engine_id="m/replica-0")
    rep.resident = frozenset({"weights", "kv_cache"})
    rep.weights_valid = True
    with pytest.raises(LifecycleError, match="cuda_graph"):
        rep.became_ready()
    rep.resident = ALL_TAGS
    rep.weights_valid = False
    with pytest.raises(LifecycleError, match="weights_valid=False"):
        rep.became_ready()


def test_reference_state_diagram_edges_are_allowed() -> None:
    edges = [
        (S.STARTING, S.READY),
        (S.READY, S.DRAINING),
        (S.DRAINING, S.SLEEPING),
        (S.SLEEPING, S.ONLOADING),
        (S.ONLOADING, S.READY),
        (S.STARTING, S.FAILED),
        (S.DRAINING, S.FAILED),
        (S.ONLOADING, S.FAILED),
        (S.READY, S.STOPPING),
        (S.SLEEPING, S.STOPPING),
        (S.FAILED, S.STOPPING),
    ]
    for src, dst in edges:
        rep = Replica(index=0, engine_id="m/replica-0", state=src)
        rep.advance(dst)
        assert rep.state is dst


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        (S.FAILED, S.READY),
        (S.FAILED, S.SLEEPING),
        (S.SLEEPING, S.READY),
        (S.STARTING, S.SLEEPING),
        (S.STOPPING, S.READY),
    ],
)
def test_transitions_outside_the_state_machine_are_refused(src: S, dst: S) -> None:
    rep = Replica(index=0, engine_id="m/replica-0", state=src)
    with pytest.raises(LifecycleError, match=f"no transition {src} -> {dst}"):
        rep.advance(dst)
    assert rep.state is src


def test_failed_closes_admission_and_keeps_the_error() -> None:
    rep = ready_replica()
    rep.advance(S.FAILED, error="engine died")
    assert not rep.admission_open and not rep.direct_eligible
    assert rep.error == "engine died"


def test_offload_releases_only_resident_tags_so_a_repeat_is_a_noop() -> None:
    rep = ready_replica()
    first = plan_offload(rep, None)
    assert first.tags == TAG_ORDER and not first.noop
    rep.advance(S.DRAINING)
    rep.resident -= frozenset(first.tags)
    rep.advance(S.SLEEPING)
    assert plan_offload(rep, None).noop


def test_partial_offload_then_full_offload_releases_the_rest() -> None:
    rep = ready_replica()
    assert plan_offload(rep, ["kv_cache"]).tags == ("kv_cache",)
    rep.resident -= {"kv_cache"}
    rep.advance(S.DRAINING)
    rep.advance(S.SLEEPING)
    assert plan_offload(rep, None).tags == ("weights", "cuda_graph")


def test_onload_restores_only_missing_tags_in_resume_order() -> None:
    rep = ready_replica()
    rep.advance(S.DRAINING)
    rep.resident = frozenset({"kv_cache"})
    rep.advance(S.SLEEPING)
    plan = plan_onload(rep, None)
    assert plan.tags == ("weights", "cuda_graph") and plan.reopen


def test_onload_of_a_subset_does_not_reopen_admission() -> None:
    rep = ready_replica()
    rep.advance(S.DRAINING)
    rep.resident = frozenset()
    rep.advance(S.SLEEPING)
    plan = plan_onload(rep, ["weights"])
    assert plan.tags == ("weights",) and not plan.reopen


def test_onload_of_a_ready_replica_is_a_noop() -> None:
    assert plan_onload(ready_replica(), None).noop


@pytest.mark.parametrize("state", [S.STARTING, S.DRAINING, S.ONLOADING, S.FAILED, S.STOPPING])
def test_onload_and_offload_do_not_apply_to_busy_or_failed_replicas(state: S) -> None:
    rep = Replica(index=0, engine_id="m/replica-0", state=state)
    with pytest.raises(NotApplicable, match=str(state)):
        plan_offload(rep, None)
    with pytest.raises(NotApplicable, match=str(state)):
        plan_onload(rep, None)


def test_unknown_or_empty_tags_are_rejected_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"offload\(tags\): unknown resident tags \['gpu'\]"):
        normalize_tags(["gpu"], where="offload(tags)")
    with pytest.raises(ValueError, match="at least one tag"):
        normalize_tags([])
    assert normalize_tags("weights") == {"weights"}
    assert normalize_tags(None) == ALL_TAGS


@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["offload", "onload"]),
            st.one_of(st.none(), st.sets(st.sampled_from(TAG_ORDER), min_size=1)),
        ),
        max_size=12,
    )
)
def test_any_sequence_of_confirmed_onloads_and_offloads_keeps_ready_iff_all_tags(
    ops: list[tuple[str, set[str] | None]],
) -> None:
    rep = ready_replica()
    for op, tags in ops:
        if op == "offload":
            plan = plan_offload(rep, tags)
            if plan.noop:
                continue
            rep.admission_open = False
            rep.advance(S.DRAINING)
            rep.resident -= frozenset(plan.tags)
            rep.advance(S.SLEEPING)
        else:
            onload = plan_onload(rep, tags)
            if onload.noop:
                continue
            rep.advance(S.ONLOADING)
            rep.resident |= frozenset(onload.tags)
            if onload.reopen:
                rep.became_ready()
            else:
                rep.advance(S.SLEEPING)
        assert rep.is_ready == (rep.resident == ALL_TAGS)
        assert rep.state in (S.READY, S.SLEEPING)


def test_lifecycle_result_names_every_failed_replica() -> None:
    result = LifecycleResult(
        "offload",
        "judge",
        (
            ReplicaResult("judge/replica-0", Outcome.DONE, "SLEEPING"),
            ReplicaResult("judge/replica-1", Outcome.FAILED, "FAILED", error="timeout"),
        ),
    )
    assert not result.ok
    assert result.states == {"judge/replica-0": "SLEEPING", "judge/replica-1": "FAILED"}
    with pytest.raises(LifecycleError, match=r"1 of 2 .*judge/replica-1: timeout.*not known"):
        result.raise_for_failures()


def test_a_fence_error_keeps_its_result_and_report_across_a_pickle() -> None:
    # Ray pickles an exception raised in an actor: a manager running as one must not lose the
    # per-replica results a caller needs to decide what to do.
    result = LifecycleResult(
        "offload", "judge", (ReplicaResult("judge/replica-0", Outcome.FAILED, "FAILED"),)
    )
    report = HealthReport(
        "judge", (ReplicaHealth("judge/replica-0", healthy=False, state="FAILED", action="fenced"),)
    )
    error = InferenceRecoveryRequired("model 'judge': fenced", result=result, report=report)
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is InferenceRecoveryRequired and str(again) == str(error)
    assert again.result == result and again.report == report
    assert InferenceRecoveryRequired("refused").result is None
