"""Where ``relax run`` takes each step's prompts from: the prompt sources plugins register;
``[run] dataset`` names one, or a file whose suffix one claims (:func:`find_source`)."""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import attrs

from relax_core.errors import ConfigProblem, ConfigValidationError
from relax_core.hookspecs import hookimpl
from relax_core.records import DataSourceSpec, PluginLookup


@attrs.frozen
class Prompt:
    """One prompt of a step; ``metadata`` is copied into every sample of its group."""

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
    """Generated arithmetic questions with their answers as labels; the same seed gives the
    same questions."""

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
            question = f"Question: what is {a} {op} {b}? Answer:"
            out.append(
                Prompt(question, str(value), {"source": "arithmetic"}, f"arithmetic#{self._count}")
            )
            self._count += 1
        return out


class JsonlSource:
    """Prompts from a JSONL file, in order, from the first line again once it runs out.

    :raises ConfigValidationError: the problems of :func:`read_jsonl`."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.prompts, problems = read_jsonl(self.path)
        if problems:
            raise ConfigValidationError(problems, str(self.path))
        self._next = 0

    def take(self, n: int) -> list[Prompt]:
        """The next ``n`` prompts."""
        first, self._next = self._next, self._next + n
        return [self.prompts[i % len(self.prompts)] for i in range(first, first + n)]


#: Bad lines of a JSONL dataset named one by one; the rest are counted.
MAX_LINE_PROBLEMS = 10


def read_jsonl(
    path: str | Path, *, key: str = "run.dataset", limit: int = MAX_LINE_PROBLEMS
) -> tuple[list[Prompt], list[ConfigProblem]]:
    """Every prompt of a JSONL dataset and every problem with it (at ``FILE:LINE`` for each of
    the first ``limit`` bad lines, then counted). Reads the file only."""
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
    if unknown := sorted(set(item) - {"prompt", "label", "metadata"}):
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


@attrs.frozen
class SourceRequest:
    """What a source is opened with: ``dataset`` as written, ``file`` the file it names
    resolved (``None``: a source's own name), the key path of problems."""

    dataset: str
    file: str | None = None
    seed: int = 0
    key: str = "run.dataset"


def find_source(
    dataset: str,
    lookup: PluginLookup,
    *,
    seed: int = 0,
    key: str = "run.dataset",
    base: str | None = None,
) -> tuple[DataSourceSpec, SourceRequest] | ConfigProblem:
    """The source ``dataset`` names and its request: a registered source's name, or a file
    (relative to ``base``) whose suffix a source claims (the longest wins); else the problem
    at ``key``. Reads nothing."""
    registered = lookup.registered("data_sources")
    entry = registered.get(dataset)
    if entry is not None:
        return entry.record, SourceRequest(dataset, None, seed, key)
    claims = sorted(
        ((suffix, reg.record) for reg in registered.values() for suffix in reg.record.suffixes),
        key=lambda pair: -len(pair[0]),
    )
    for suffix, spec in claims:
        if dataset.endswith(suffix):
            path = Path(dataset)
            if not path.is_absolute():
                path = (Path(base) if base else Path.cwd()) / path
            return spec, SourceRequest(dataset, str(path.resolve()), seed, key)
    known = ", ".join(
        f"{name} ({', '.join(reg.record.suffixes)} files)" if reg.record.suffixes else name
        for name, reg in sorted(registered.items())
    )
    return ConfigProblem(
        key,
        "dataset",
        f"{dataset!r} is neither a registered prompt source nor a file one reads (sources: "
        f"{known or 'none'}); install the plugin of the source you mean",
    )


def open_source(dataset: str, lookup: PluginLookup, **where: Any) -> PromptSource:
    """Open the source ``dataset`` names (``where``: as :func:`find_source`'s).

    :raises ConfigValidationError: no source reads it, or the source refuses its data."""
    found = find_source(dataset, lookup, **where)
    if isinstance(found, ConfigProblem):
        raise ConfigValidationError([found])
    source: PromptSource = found[0].open(found[1])
    return source


def source_problems(dataset: str, lookup: PluginLookup, **where: Any) -> list[ConfigProblem]:
    """Every problem with ``dataset`` found before anything starts (its source's own check
    reads the data)."""
    found = find_source(dataset, lookup, **where)
    if isinstance(found, ConfigProblem):
        return [found]
    spec, request = found
    return list(spec.check(request)) if spec.check is not None else []


def _open_arithmetic(request: SourceRequest) -> ArithmeticSource:
    return ArithmeticSource(request.seed)


def _open_jsonl(request: SourceRequest) -> JsonlSource:
    assert request.file is not None
    return JsonlSource(request.file)


def _check_jsonl(request: SourceRequest) -> list[ConfigProblem]:
    assert request.file is not None
    return read_jsonl(request.file, key=request.key)[1]


#: Generated arithmetic questions with their answers as labels (``dataset = "arithmetic"``).
ARITHMETIC = DataSourceSpec(
    name="arithmetic",
    open=_open_arithmetic,
    description="Generated arithmetic questions (+, -, * of 0-20) with their answers as labels.",
)
#: Prompts from a JSONL file (``dataset = "train.jsonl"``), every line checked up front.
JSONL = DataSourceSpec(
    name="jsonl",
    open=_open_jsonl,
    suffixes=(".jsonl",),
    check=_check_jsonl,
    description="One JSON object per line: prompt, label, metadata; every line checked first.",
)


@hookimpl
def relax_register_data_sources(register: Any) -> None:
    """Register the core's prompt sources: ``arithmetic`` and ``jsonl``."""
    register(ARITHMETIC)
    register(JSONL)
