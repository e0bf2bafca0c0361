"""Where ``relax run`` takes each step's prompts from.

Two sources, both deterministic:

- :class:`ArithmeticSource` (``dataset = "arithmetic"``): generated questions with known
  answers (``What is 7 + 5?`` → label ``12``), so a rule reward can check them; needs no
  download. The same seed gives the same questions.
- :class:`JsonlSource` (``dataset = "path/to/file.jsonl"``): one JSON object per line,
  ``{"prompt": "...", "label": "...", "metadata": {...}}`` (``label`` and ``metadata``
  optional; ``metadata["route_key"]`` picks a role's model by its route key). Every line is
  checked when the source is opened, and a bad one is refused naming the file and line. The
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

from relax_core.errors import ConfigError

__all__ = ["ArithmeticSource", "JsonlSource", "Prompt", "PromptSource", "open_source"]


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

    :raises ConfigError: the file cannot be read, is empty, or a line is not a JSON object
        with a non-empty string ``prompt``, a string (or null) ``label`` and an object
        ``metadata`` — ``path`` names the file and line (``data.jsonl:12``).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(
                "run.dataset", f"cannot read {self.path}: {getattr(exc, 'strerror', None) or exc}"
            ) from None
        self.prompts: list[Prompt] = []
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                self.prompts.append(self._parse(line, f"{self.path}:{number}"))
        if not self.prompts:
            raise ConfigError(
                "run.dataset", f"{self.path} holds no prompt (one JSON object per line)"
            )
        self._next = 0

    @staticmethod
    def _parse(line: str, where: str) -> Prompt:
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise ConfigError(where, f"not valid JSON: {exc}") from None
        if not isinstance(item, dict):
            raise ConfigError(where, f"must be a JSON object, got {type(item).__name__}")
        unknown = sorted(set(item) - {"prompt", "label", "metadata"})
        if unknown:
            raise ConfigError(
                where, f"unknown field(s) {unknown}; a line has prompt, label and metadata"
            )
        prompt = item.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise ConfigError(f"{where}: prompt", f"must be a non-empty string, got {prompt!r}")
        label = item.get("label")
        if label is not None and not isinstance(label, str):
            raise ConfigError(
                f"{where}: label", f"must be a string or null, got {label!r} (quote numbers)"
            )
        metadata = item.get("metadata", {})
        if not isinstance(metadata, dict):
            raise ConfigError(f"{where}: metadata", f"must be an object, got {metadata!r}")
        return Prompt(prompt, label, metadata, where)

    def take(self, n: int) -> list[Prompt]:
        """The next ``n`` prompts, from the first line again once the file runs out."""
        out = []
        for _ in range(n):
            out.append(self.prompts[self._next % len(self.prompts)])
            self._next += 1
        return out


def open_source(dataset: str, *, seed: int = 0) -> PromptSource:
    """The source ``dataset`` names: ``arithmetic`` or a JSONL file path.

    :raises ConfigError: see :class:`JsonlSource`.
    """
    if dataset == "arithmetic":
        return ArithmeticSource(seed)
    return JsonlSource(dataset)
