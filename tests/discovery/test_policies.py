"""Built-in DIRECT routing policies: round robin, rendezvous affinity, bounded-load rendezvous."""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Callable

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relax_core.discovery.policies import (
    BoundedRendezvousSelector,
    RendezvousSelector,
    RoundRobinSelector,
    rendezvous_order,
)
from relax_core.plugins import PluginManager
from relax_core.records import ReplicaSelector


@attrs.frozen
class Head:
    """A candidate as selectors see it: anything with a stable ``engine_id``."""

    engine_id: str


def heads(ids: list[str] | range) -> tuple[Head, ...]:
    names = [f"m/replica-{i}" if isinstance(i, int) else i for i in ids]
    return tuple(Head(name) for name in sorted(names))


def pick(
    selector: ReplicaSelector,
    candidates: tuple[Head, ...],
    key: str | None,
    inflight: dict[str, int] | None = None,
    *,
    role: str = "teacher",
    model: str = "m",
) -> str:
    chosen = selector.select(
        role=role,
        epoch="e1",
        model=model,
        candidates=candidates,
        affinity_key=key,
        inflight=inflight,
    )
    assert chosen in candidates
    return str(chosen.engine_id)


# -- registration ----------------------------------------------------------------------------


def test_core_registers_the_three_policies(core_plugin_manager: PluginManager) -> None:
    table = core_plugin_manager.registered("routing_policies")
    assert {"round_robin", "rendezvous", "bounded_rendezvous"} <= set(table)
    assert table["round_robin"].plugin == "relax-core"
    assert not table["round_robin"].record.uses_affinity
    assert table["rendezvous"].record.uses_affinity
    assert table["bounded_rendezvous"].record.uses_affinity


def test_policy_factories_build_fresh_selectors(core_plugin_manager: PluginManager) -> None:
    for name in ("round_robin", "rendezvous", "bounded_rendezvous"):
        policy = core_plugin_manager.routing_policy(name)
        first, second = policy.factory(), policy.factory()
        assert first is not second
        assert isinstance(first, ReplicaSelector)


# -- round robin -----------------------------------------------------------------------------


def test_round_robin_visits_every_candidate_in_turn() -> None:
    selector = RoundRobinSelector()
    cands = heads(range(4))
    picks = [pick(selector, cands, None) for _ in range(8)]
    assert picks == [c.engine_id for c in cands] * 2


def test_round_robin_keeps_one_cursor_per_role_epoch_and_model() -> None:
    selector = RoundRobinSelector()
    cands = heads(range(3))
    assert pick(selector, cands, None, model="a") == cands[0].engine_id
    assert pick(selector, cands, None, model="a") == cands[1].engine_id
    # Another model, and another role, start their own cursors.
    assert pick(selector, cands, None, model="b") == cands[0].engine_id
    assert pick(selector, cands, None, model="a", role="genrm") == cands[0].engine_id
    assert pick(selector, cands, None, model="a") == cands[2].engine_id


def test_round_robin_cursor_restarts_with_a_new_registry_epoch() -> None:
    selector = RoundRobinSelector()
    cands = heads(range(3))
    kwargs = {"role": "r", "model": "m", "candidates": cands, "affinity_key": None}
    selector.select(epoch="e1", inflight=None, **kwargs)
    assert selector.select(epoch="e2", inflight=None, **kwargs) is cands[0]


# -- rendezvous ------------------------------------------------------------------------------


def test_rendezvous_sends_one_key_to_one_head() -> None:
    selector = RendezvousSelector()
    cands = heads(range(16))
    for key in ("group-1", "group-2", "group-3"):
        assert len({pick(selector, cands, key) for _ in range(20)}) == 1


def test_rendezvous_choice_is_pinned_across_releases() -> None:
    # Gateways and clients of one deployment must agree; this pins the scoring function.
    order = rendezvous_order(
        "teacher", "math", tuple(f"math/replica-{i}" for i in range(8)), "g-42"
    )
    assert order == PINNED_ORDER


PINNED_ORDER = [
    "math/replica-4",
    "math/replica-3",
    "math/replica-7",
    "math/replica-6",
    "math/replica-1",
    "math/replica-2",
    "math/replica-0",
    "math/replica-5",
]


def documented_order(role: str, model: str, ids: list[str], key: str) -> list[str]:
    """The scoring the policies module documents, written out one engine at a time."""
    slot = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=2).digest(), "little")
    prefix = f"{role}\0{model}\0".encode()
    x = int.from_bytes(
        hashlib.blake2b(prefix + slot.to_bytes(2, "little"), digest_size=8).digest(), "little"
    )
    scored = []
    for rank, engine_id in enumerate(sorted(ids)):
        digest = hashlib.blake2b(prefix + engine_id.encode(), digest_size=16).digest()
        a = int.from_bytes(digest[:8], "little") | 1
        b = int.from_bytes(digest[8:], "little")
        score = ((a * x + b) % 2**64) >> 16 << 16 | rank
        scored.append((score, engine_id))
    return [engine_id for _, engine_id in sorted(scored, reverse=True)]


@settings(max_examples=60, deadline=None)
@given(
    ids=st.lists(
        st.from_regex(r"[a-z0-9/-]{1,12}", fullmatch=True), min_size=1, max_size=70, unique=True
    ),
    key=st.text(max_size=20),
)
def test_rendezvous_order_follows_the_documented_scoring(ids: list[str], key: str) -> None:
    assert rendezvous_order("teacher", "m", tuple(ids), key) == documented_order(
        "teacher", "m", ids, key
    )


def test_rendezvous_selector_agrees_with_rendezvous_order() -> None:
    selector = RendezvousSelector()
    cands = heads(range(10))
    ids = tuple(c.engine_id for c in reversed(cands))  # order of the input does not matter
    for i in range(200):
        key = f"k{i}"
        assert pick(selector, cands, key) == rendezvous_order("teacher", "m", ids, key)[0]


def test_rendezvous_spreads_keys_evenly() -> None:
    selector = RendezvousSelector()
    cands = heads(range(64))
    counts = Counter(pick(selector, cands, f"sample-group-{i}") for i in range(32_000))
    assert len(counts) == 64
    mean = 32_000 / 64
    # 65,536 slots over 64 heads: each holds ~1024 +- 32 slots; keys add binomial noise.
    assert max(counts.values()) < 1.3 * mean
    assert min(counts.values()) > 0.7 * mean


def test_rendezvous_depends_on_role_and_model() -> None:
    ids = tuple(f"r{i}" for i in range(32))
    keys = [f"k{i}" for i in range(200)]
    base = [rendezvous_order("teacher", "a", ids, k)[0] for k in keys]
    other_model = [rendezvous_order("teacher", "b", ids, k)[0] for k in keys]
    other_role = [rendezvous_order("genrm", "a", ids, k)[0] for k in keys]
    assert base != other_model
    assert base != other_role


def test_rendezvous_refuses_unsorted_candidates() -> None:
    with pytest.raises(ValueError, match="sorted by engine_id"):
        pick(RendezvousSelector(), (Head("b"), Head("a")), "k")


_replica_sets = st.lists(
    st.from_regex(r"[a-z]{1,3}/replica-[0-9]{1,3}", fullmatch=True),
    min_size=2,
    max_size=40,
    unique=True,
)
_keys = st.lists(st.text(min_size=0, max_size=12), min_size=1, max_size=40)


def _drawn_sets_and_keys(test: Callable[..., None]) -> Callable[..., None]:
    """``test`` over 80 examples of a replica set, keys and one more draw (the test's own)."""
    drawn = given(ids=_replica_sets, keys=_keys, data=st.data())(test)
    return settings(max_examples=80, deadline=None)(drawn)


@_drawn_sets_and_keys
def test_removing_a_replica_moves_only_the_keys_it_owned(
    ids: list[str], keys: list[str], data: st.DataObject
) -> None:
    removed = data.draw(st.sampled_from(ids))
    before = heads(ids)
    after = heads([i for i in ids if i != removed])
    selector = RendezvousSelector()
    for key in keys:
        owner = pick(selector, before, key)
        new_owner = pick(selector, after, key)
        if owner != removed:
            assert new_owner == owner
        else:
            # The key goes to its second choice.
            assert new_owner == rendezvous_order("teacher", "m", tuple(ids), key)[1]


@_drawn_sets_and_keys
def test_same_key_and_replica_set_give_the_same_target(
    ids: list[str], keys: list[str], data: st.DataObject
) -> None:
    shuffled = data.draw(st.permutations(ids))
    first = RendezvousSelector()
    second = RendezvousSelector()  # another process's selector: no shared state
    for key in keys:
        assert pick(first, heads(ids), key) == pick(second, heads(shuffled), key)


@settings(max_examples=40, deadline=None)
@given(ids=_replica_sets, keys=_keys)
def test_adding_a_replica_moves_keys_only_onto_it(ids: list[str], keys: list[str]) -> None:
    selector = RendezvousSelector()
    before = heads(ids)
    after = heads([*ids, "zz/new-replica"])
    for key in keys:
        new_owner = pick(selector, after, key)
        assert new_owner in (pick(selector, before, key), "zz/new-replica")


# -- bounded rendezvous ----------------------------------------------------------------------


def test_bounded_rendezvous_rejects_a_load_factor_below_one() -> None:
    with pytest.raises(ValueError, match="c must be a finite number >= 1"):
        BoundedRendezvousSelector(c=0.9)
    with pytest.raises(ValueError):
        BoundedRendezvousSelector(c=float("nan"))


def test_bounded_rendezvous_without_load_is_plain_rendezvous() -> None:
    cands = heads(range(12))
    plain, bounded = RendezvousSelector(), BoundedRendezvousSelector()
    for i in range(300):
        key = f"k{i}"
        assert pick(bounded, cands, key, {}) == pick(plain, cands, key)
        assert pick(bounded, cands, key, None) == pick(plain, cands, key)


def test_bounded_rendezvous_keeps_affinity_while_the_head_is_within_bound() -> None:
    cands = heads(range(4))
    selector = BoundedRendezvousSelector()
    owner = pick(selector, cands, "group-7")
    # total 8 -> bound ceil(1.25 * 9 / 4) = 3; the owner at 2 may take one more.
    inflight = {c.engine_id: 2 for c in cands}
    assert pick(selector, cands, "group-7", inflight) == owner


def test_bounded_rendezvous_moves_a_hot_key_to_its_next_choice() -> None:
    cands = heads(range(4))
    selector = BoundedRendezvousSelector()
    order = rendezvous_order("teacher", "m", tuple(c.engine_id for c in cands), "hot")
    inflight = {order[0]: 5, order[1]: 0, order[2]: 0, order[3]: 0}
    # total 5 -> bound ceil(1.25 * 6 / 4) = 2: the owner (5) is skipped.
    assert pick(selector, cands, "hot", inflight) == order[1]
    inflight[order[1]] = 3
    # total 8 -> bound ceil(1.25 * 9 / 4) = 3: the second choice (3) is skipped too.
    assert pick(selector, cands, "hot", inflight) == order[2]


def test_one_hot_key_spreads_over_replicas_instead_of_piling_up() -> None:
    cands = heads(range(8))
    selector = BoundedRendezvousSelector(c=1.25)
    inflight = {c.engine_id: 0 for c in cands}
    for _ in range(400):
        inflight[pick(selector, cands, "the-one-hot-group", inflight)] += 1
    bound = math.ceil(1.25 * 400 / 8)
    assert max(inflight.values()) <= bound
    # Plain rendezvous would put all 400 on one head; here at least 400 / bound heads share it.
    assert sum(1 for load in inflight.values() if load) >= math.ceil(400 / bound)


_events = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), st.integers(0, 30).map(lambda i: f"key-{i}")),
        st.tuples(st.just("finish"), st.integers(0, 10_000).map(str)),
    ),
    min_size=1,
    max_size=150,
)


@settings(max_examples=80, deadline=None)
@given(
    n=st.integers(1, 12),
    c=st.sampled_from([1.0, 1.1, 1.25, 1.5, 2.0]),
    events=_events,
)
def test_a_request_never_lands_above_the_bound_and_keeps_the_best_affinity(
    n: int, c: float, events: list[tuple[str, str]]
) -> None:
    cands = heads(range(n))
    ids = tuple(h.engine_id for h in cands)
    selector = BoundedRendezvousSelector(c=c)
    inflight = dict.fromkeys(ids, 0)
    for kind, value in events:
        if kind == "finish":
            busy = [i for i in ids if inflight[i] > 0]
            if busy:
                inflight[busy[int(value) % len(busy)]] -= 1
            continue
        total = sum(inflight.values())
        bound = math.ceil(c * (total + 1) / n)
        chosen = pick(selector, cands, value, inflight)
        # The chosen head stays within the bound after taking the request ...
        assert inflight[chosen] + 1 <= bound
        # ... and it is the best-scoring head that does (affinity is kept where possible).
        order = rendezvous_order("teacher", "m", ids, value)
        assert chosen == next(i for i in order if inflight[i] < bound)
        inflight[chosen] += 1


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 16), keys=st.lists(st.integers(0, 5).map(str), min_size=1, max_size=120))
def test_no_replica_goes_above_the_bound_while_another_is_below_it(n: int, keys: list[str]) -> None:
    cands = heads(range(n))
    selector = BoundedRendezvousSelector()
    inflight = {h.engine_id: 0 for h in cands}
    for key in keys:
        inflight[pick(selector, cands, key, inflight)] += 1
        bound = math.ceil(1.25 * sum(inflight.values()) / n)
        above = [i for i, load in inflight.items() if load > bound]
        below = [i for i, load in inflight.items() if load < bound]
        assert not (above and below), (above, below, bound)
        assert not above
