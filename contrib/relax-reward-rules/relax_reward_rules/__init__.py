"""Rule-based reward adapters: ``exact-match``, ``boxed-math`` and ``digits``."""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction

from relax_core import RewardSpec, hookimpl

__all__ = [
    "boxed_answer",
    "boxed_math",
    "digit_share",
    "exact_match",
    "has_label",
    "relax_register_reward_adapters",
]


def has_label(label: str | None) -> bool:
    """The adapters' label matcher: they compare with a label, so they score labelled samples."""
    return isinstance(label, str)


def exact_match(response: str, label: str) -> float:
    """1.0 when ``response`` equals ``label`` after trimming whitespace, else 0.0."""
    return 1.0 if response.strip() == label.strip() else 0.0


def boxed_answer(response: str) -> str | None:
    """The content of the last ``\\boxed{…}`` in ``response`` (braces balanced), or ``None``."""
    start = response.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    begin = start + len("\\boxed{")
    for i in range(begin, len(response)):
        ch = response[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            if depth == 0:
                return response[begin:i].strip()
            depth -= 1
    return None  # unbalanced: no answer


def _as_number(text: str) -> Fraction | None:
    cleaned = text.replace(",", "").replace(" ", "")
    try:
        if "/" in cleaned:
            num, den = cleaned.split("/", 1)
            return Fraction(Fraction(num), Fraction(den))
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def boxed_math(response: str, label: str) -> float:
    """1.0 when the last boxed answer equals ``label`` (as numbers when both parse), else 0.0."""
    answer = boxed_answer(response)
    if answer is None:
        return 0.0
    a, b = _as_number(answer), _as_number(label)
    if a is not None and b is not None:
        return 1.0 if a == b else 0.0
    return 1.0 if answer == label.strip() else 0.0


def digit_share(response: str, label: str | None) -> float:
    """The share of ``response``'s non-space characters that are digits (0.0 for an empty one).

    Partial credit for answering a numeric question with a number, whatever the number; the
    label is not read. Dense enough for a small random policy to learn from in a few dozen
    steps (``nox -s learn``).
    """
    chars = [c for c in response if not c.isspace()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0


@hookimpl
def relax_register_reward_adapters(register: Callable[[RewardSpec], None]) -> None:
    """Register ``exact-match``, ``boxed-math`` and ``digits`` (synchronous, usable in deferred
    scoring)."""
    register(
        RewardSpec(
            name="exact-match",
            fn=exact_match,
            mode="sync",
            label_matcher=has_label,
            supports_deferred=True,
            description="1.0 when the trimmed response equals the label.",
        )
    )
    register(
        RewardSpec(
            name="boxed-math",
            fn=boxed_math,
            mode="sync",
            label_matcher=has_label,
            supports_deferred=True,
            description="1.0 when the last \\boxed{} answer equals the label (numerically).",
        )
    )
    register(
        RewardSpec(
            name="digits",
            fn=digit_share,
            mode="sync",
            supports_deferred=True,
            description="The share of the response's non-space characters that are digits.",
        )
    )
