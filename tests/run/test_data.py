"""The prompt sources of ``relax run``: generated arithmetic with right answers, JSONL files with
errors that name the line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax_core.errors import ConfigError
from relax_core.plugins import PluginManager
from relax_core.run.data import ArithmeticSource, JsonlSource, Prompt, open_source, read_jsonl


def test_arithmetic_questions_are_deterministic_and_labelled_with_their_answers() -> None:
    first = ArithmeticSource(seed=7).take(50)
    assert first == ArithmeticSource(seed=7).take(50)
    assert first != ArithmeticSource(seed=8).take(50)
    for p in first:
        a, op, b = p.prompt.removeprefix("Question: what is ").removesuffix("? Answer:").split()
        value = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert p.label == str(value) and value >= 0
    source = ArithmeticSource(seed=7)
    assert source.take(3) + source.take(2) == first[:5]  # take() continues where it left
    assert [p.origin for p in first[:2]] == ["arithmetic#0", "arithmetic#1"]


def test_a_jsonl_file_gives_its_prompts_in_order_then_again_from_the_first(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    rows = [
        {"prompt": "2+2?", "label": "4", "metadata": {"route_key": "math"}},
        {"prompt": "hello"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    source = open_source(str(path), PluginManager.create())
    assert isinstance(source, JsonlSource)
    got = source.take(3)
    assert got[0] == Prompt("2+2?", "4", {"route_key": "math"}, f"{path}:1")
    assert got[1] == Prompt("hello", None, {}, f"{path}:2")
    assert got[2] == got[0]


@pytest.mark.parametrize(
    ("line", "where", "message"),
    [
        ("not json", ":2", "not valid JSON"),
        ('["a list"]', ":2", "must be a JSON object"),
        ('{"text": "x"}', ":2", "unknown field(s) ['text']"),
        ('{"prompt": ""}', ":2", "prompt must be a non-empty string"),
        ('{"prompt": "x", "label": 4}', ":2", "quote numbers"),
        ('{"prompt": "x", "metadata": [1]}', ":2", "metadata must be an object"),
    ],
)
def test_a_bad_line_is_refused_naming_the_file_and_line(
    tmp_path: Path, line: str, where: str, message: str
) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(ConfigError) as info:
        JsonlSource(path)
    assert info.value.path == f"{path}{where}" and message in info.value.message


def test_every_bad_line_is_named_and_past_the_cap_the_rest_are_counted(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    bad = ["{broken", '{"prompt": 3}', "[]"] * 5  # 15 bad lines among good ones
    path.write_text("\n".join(f'{{"prompt": "ok {i}"}}\n{b}' for i, b in enumerate(bad)) + "\n")
    prompts, problems = read_jsonl(path, limit=4)
    assert len(prompts) == 15
    assert [p.path for p in problems[:4]] == [f"{path}:{n}" for n in (2, 4, 6, 8)]
    assert problems[4].path == "run.dataset" and "11 more bad line(s)" in problems[4].message
    assert "15 in all" in problems[4].message and len(problems) == 5


def test_a_missing_or_empty_file_is_refused_at_run_dataset(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read") as info:
        JsonlSource(tmp_path / "nope.jsonl")
    assert info.value.path == "run.dataset"
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ConfigError, match="holds no prompt"):
        JsonlSource(tmp_path / "empty.jsonl")
