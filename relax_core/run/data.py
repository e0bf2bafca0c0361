"""Where ``relax run`` takes each step's prompts from.

Two sources, both deterministic:

- :class:`ArithmeticSource` (``dataset = "arithmetic"``): generated questions with known
  answers (``What is 7 + 5?`` → label ``12``), so a rule reward can check them; needs no
  download. The same seed gives the same questions.
- :class:`JsonlSource` (``dataset = "path/to/file.jsonl"``): one JSON object per line,
  ``{"prompt": "...", "label": "...", "metadata": {...}}`` (``label`` and ``metadata``
  optional; ``metadata["route_key"]`` picks a role's model by its route key). Every line is
  checked when the source is opened (and by the job preflight, before anything starts), and
  the bad ones are refused naming the file and line of each. The
  file is read in order and starts again from its first line when it runs out.

A source hands out :class:`Prompt` records, ``take(n)`` at a time.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import attrs

from relax_core.config import ConfigProblem
from relax_core.errors import ConfigValidationError

__all__ = [
    "MAX_LINE_PROBLEMS",
    "ArithmeticSource",
    "JsonlSource",
    "Prompt",
    "PromptSource",
    "open_source",
    "read_jsonl",
]


@attrs.frozen
class Prompt:
    """One prompt of a step: its text, the label a rule reward checks (if any), free-form
    metadata copied into every sample of its group, and where it came from (``file:line``
    or ``arithmetic#N``)."""

    prompt: str
    label: str | None = None
    metadata: Mapping[str, Any] = attrs.field(factory=dict)
    origin: str = ""


@runtime_checkable
class PromptSource(Protocol):
    """Hands out prompts in a fixed order."""

    def take(self, n: int) -> list[Prompt]:
        """The next ``n`` prompts."""
        ...


class ArithmeticSource:
    """Generated arithmetic questions with their answers as labels.

    Each question is ``"Question: what is A + B? Answer:"`` (``+``, ``-`` or ``*`` of
    integers 0-20, ``-`` never below zero); the label is the answer in decimal.
    """

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)
        self._count = 0

    def take(self, n: int) -> list[Prompt]:
        """The next ``n`` questions."""
        out = []
        for _ in range(n):
            op = self._rng.choice("+-*")
            a, b = self._rng.randint(0, 20), self._rng.randint(0, 20)
            if op == "-" and b > a:
                a, b = b, a
            value = a + b if op == "+" else a - b if op == "-" else a * b
            out.append(
                Prompt(
                    f"Question: what is {a} {op} {b}? Answer:",
                    str(value),
                    {"source": "arithmetic"},
                    f"arithmetic#{self._count}",
                )
            )
            self._count += 1
        return out


class JsonlSource:
    """Prompts from a JSONL file (see the module docstring).

    :raises ConfigValidationError: the file cannot be read, is empty, or has bad lines (each
        bad line a problem whose path names the file and line, ``data.jsonl:12``; see
        :func:`read_jsonl`).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.prompts, problems = read_jsonl(self.path)
        if problems:
            raise ConfigValidationError(problems, str(self.path))
        self._next = 0

    def take(self, n: int) -> list[Prompt]:
        """The next ``n`` prompts, from the first line again once the file runs out."""
        out = []
        for _ in range(n):
            out.append(self.prompts[self._next % len(self.prompts)])
            self._next += 1
        return out


#: Bad lines of a JSONL dataset named one by one; the rest are counted.
MAX_LINE_PROBLEMS = 10


def read_jsonl(
    path: str | Path, *, key: str = "run.dataset", limit: int = MAX_LINE_PROBLEMS
) -> tuple[list[Prompt], list[ConfigProblem]]:
    """Every prompt of a JSONL dataset and every problem with it, reading the whole file.

    A problem's path is ``key`` for the file as a whole (unreadable, empty) and ``FILE:LINE``
    for a bad line (not JSON, not an object, an unknown field, an empty ``prompt``, a
    ``label`` that is not a string, a ``metadata`` that is not an object); the first ``limit``
    bad lines are named and one more problem counts the rest. Pure: reads the file only.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = getattr(exc, "strerror", None) or exc
        return [], [ConfigProblem(key, "dataset", f"cannot read {p}: {why}")]
    prompts: list[Prompt] = []
    problems: list[ConfigProblem] = []
    bad = 0
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{p}:{number}"
        parsed = _parse_line(line, where)
        if isinstance(parsed, Prompt):
            prompts.append(parsed)
            continue
        bad += 1
        if bad <= limit:
            problems.append(ConfigProblem(where, "dataset-line", parsed))
    if bad > limit:
        problems.append(
            ConfigProblem(
                key, "dataset-line", f"{bad - limit} more bad line(s) in {p} ({bad} in all)"
            )
        )
    if not prompts and not bad:
        problems.append(
            ConfigProblem(key, "dataset", f"{p} holds no prompt (one JSON object per line)")
        )
    return prompts, problems


def _parse_line(line: str, where: str) -> Prompt | str:
    """The prompt on one line, or what is wrong with it."""
    try:
        item = json.loads(line)
    except ValueError as exc:
        return f"not valid JSON: {exc}"
    if not isinstance(item, dict):
        return f"must be a JSON object, got {type(item).__name__}"
    unknown = sorted(set(item) - {"prompt", "label", "metadata"})
    if unknown:
        return f"unknown field(s) {unknown}; a line has prompt, label and metadata"
    prompt = item.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        return f"prompt must be a non-empty string, got {prompt!r}"
    label = item.get("label")
    if label is not None and not isinstance(label, str):
        return f"label must be a string or null, got {label!r} (quote numbers)"
    metadata = item.get("metadata", {})
    if not isinstance(metadata, dict):
        return f"metadata must be an object, got {metadata!r}"
    return Prompt(prompt, label, metadata, where)


def open_source(dataset: str, *, seed: int = 0) -> PromptSource:
    """The source ``dataset`` names: ``arithmetic`` or a JSONL file path.

    :raises ConfigValidationError: see :class:`JsonlSource`.
    """
    if dataset == "arithmetic":
        return ArithmeticSource(seed)
    return JsonlSource(dataset)
