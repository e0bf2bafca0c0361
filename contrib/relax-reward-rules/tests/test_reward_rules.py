"""The rule-based reward adapters, found through their installed entry point."""

from __future__ import annotations

import pytest

from relax_core import PluginManager


@pytest.fixture
def rewards(plugin_manager: PluginManager) -> PluginManager:
    return plugin_manager


def test_adapters_are_registered_by_this_distribution(rewards: PluginManager) -> None:
    table = rewards.registered("reward_adapters")
    assert table["exact-match"].distribution == "relax-reward-rules"
    assert table["boxed-math"].distribution == "relax-reward-rules"
    assert table["digits"].distribution == "relax-reward-rules"
    assert rewards.reward_adapter("boxed-math").supports_deferred


def test_exact_match_ignores_surrounding_whitespace(rewards: PluginManager) -> None:
    fn = rewards.reward_adapter("exact-match").fn
    assert fn("  Paris\n", "Paris") == 1.0
    assert fn("paris", "Paris") == 0.0


@pytest.mark.parametrize(
    ("response", "label", "reward"),
    [
        ("so \\boxed{42}", "42", 1.0),
        ("\\boxed{1} then \\boxed{42.0}", "42", 1.0),  # the last box counts
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),  # nested braces, compared as text
        ("\\boxed{1/2}", "0.5", 1.0),  # compared as numbers
        ("\\boxed{1,000}", "1000", 1.0),
        ("\\boxed{41}", "42", 0.0),
        ("the answer is 42", "42", 0.0),  # no box, no reward
        ("\\boxed{42", "42", 0.0),  # unbalanced
    ],
)
def test_boxed_math(rewards: PluginManager, response: str, label: str, reward: float) -> None:
    assert rewards.reward_adapter("boxed-math").fn(response, label) == reward


def test_adapters_score_labelled_samples_only(rewards: PluginManager) -> None:
    for name in ("exact-match", "boxed-math"):
        matcher = rewards.reward_adapter(name).label_matcher
        assert matcher is not None and matcher("42") and not matcher(None)


@pytest.mark.parametrize(
    ("response", "reward"),
    [("42", 1.0), (" 4 2 ", 1.0), ("a1", 0.5), ("no digits", 0.0), ("", 0.0), ("  ", 0.0)],
)
def test_digits_is_the_share_of_non_space_characters_that_are_digits(
    rewards: PluginManager, response: str, reward: float
) -> None:
    spec = rewards.reward_adapter("digits")
    assert spec.fn(response, None) == reward
    # Every sample is scored, labelled or not: the rule reads no label.
    assert spec.label_matcher is None and spec.supports_deferred
