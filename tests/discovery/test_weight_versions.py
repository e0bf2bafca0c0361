"""The one order of weight versions (``relax_core.discovery.routing.weight_version_key``):
a total order, numbers by value, the engines' initial version below every pushed one."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from relax_core.discovery.routing import (
    INITIAL_WEIGHT_VERSION,
    weight_version_at_least,
    weight_version_key,
)

#: Versions as trainers spell them: plain numbers, prefixed steps, dotted releases, any text.
versions = st.one_of(
    st.integers(min_value=0, max_value=10**12).map(str),
    st.builds(
        lambda p, n: f"{p}{n}",
        st.sampled_from(["step-", "v", "w-", "tensor-"]),
        st.integers(0, 10**6),
    ),
    st.builds(lambda a, b: f"v{a}.{b}", st.integers(0, 99), st.integers(0, 99)),
    st.text(alphabet="0123456789abcdefault-._", min_size=1, max_size=12),
    st.just(INITIAL_WEIGHT_VERSION),
)


@settings(max_examples=400, deadline=None)
@given(versions, versions)
def test_two_versions_are_equal_in_the_order_only_when_they_are_the_same_string(
    a: str, b: str
) -> None:
    assert (weight_version_key(a) == weight_version_key(b)) == (a == b)
    # Total: exactly one of <, ==, > holds, and "at least" agrees with it.
    ka, kb = weight_version_key(a), weight_version_key(b)
    assert (ka < kb) + (ka == kb) + (ka > kb) == 1
    assert weight_version_at_least(a, b) == (ka >= kb)


@settings(max_examples=300, deadline=None)
@given(versions, versions, versions)
def test_the_order_is_transitive(a: str, b: str, c: str) -> None:
    x, y, z = sorted((a, b, c), key=weight_version_key)
    assert weight_version_at_least(y, x) and weight_version_at_least(z, y)
    assert weight_version_at_least(z, x)


@settings(max_examples=300, deadline=None)
@given(versions.filter(lambda v: v != INITIAL_WEIGHT_VERSION))
def test_the_initial_weights_sort_below_every_pushed_version(pushed: str) -> None:
    assert weight_version_key(INITIAL_WEIGHT_VERSION) < weight_version_key(pushed)
    assert not weight_version_at_least(INITIAL_WEIGHT_VERSION, pushed)
    assert weight_version_at_least(pushed, INITIAL_WEIGHT_VERSION)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 10**9), st.integers(0, 10**9), st.sampled_from(["", "step-", "v"]))
def test_numbered_versions_compare_by_value(m: int, n: int, prefix: str) -> None:
    assert (weight_version_key(f"{prefix}{m}") < weight_version_key(f"{prefix}{n}")) == (m < n)


def test_a_stale_weights_guard_is_not_met_by_the_initial_weights() -> None:
    # The version key of "default" once sorted above every number: a request for version 12
    # was served by the weights the engine started with.
    assert not weight_version_at_least("default", "12")
    assert not weight_version_at_least(None, "12")
    assert weight_version_at_least("12", "12") and weight_version_at_least("13", "12")
    assert weight_version_key("9") < weight_version_key("10")
    assert weight_version_key("v1.2") < weight_version_key("v1.10")
