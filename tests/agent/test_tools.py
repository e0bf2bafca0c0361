"""Tool calls parsed from the policy's text (the Hermes/Qwen ``<tool_call>`` format), the tool
registry's timeout per call and its errors as observations; the calculator's safe arithmetic."""

from __future__ import annotations

import asyncio
import threading

import pytest

from relax_core.agent import Tool, ToolBox, ToolCall, evaluate, format_tool_call, parse_tool_calls
from relax_core.agent.calculator import CalculatorEnvironment
from relax_core.agent.environment import EnvironmentConfig, Turn
from relax_core.run.data import Prompt


def test_tool_calls_are_parsed_in_order_and_malformed_ones_are_calls_with_an_error() -> None:
    text = (
        "Let me compute. "
        + format_tool_call("calculator", {"expression": "1 + 2"})
        + ' then <tool_call>{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}</tool_call>'
        + " and <tool_call>{not json}</tool_call> <tool_call>[1]</tool_call>"
        + ' <tool_call>{"name": "x", "arguments": 3}</tool_call>'
    )
    calls = parse_tool_calls(text)
    assert calls[0] == ToolCall("calculator", {"expression": "1 + 2"}, raw=calls[0].raw)
    assert calls[1].name == "search" and calls[1].arguments == {"q": "x"}
    assert calls[2].error is not None and calls[2].error.startswith("not JSON")
    assert calls[3].error == 'not an object with a "name" string'
    assert calls[4].error == '"arguments" is not an object'
    assert parse_tool_calls("no call here <tool_call> unterminated") == []


def test_every_failure_is_a_result_never_an_exception() -> None:
    def broken(**_: object) -> str:
        raise RuntimeError("disk on fire")

    box = ToolBox([Tool("broken", broken), Tool("add", lambda a, b: a + b)], timeout=5)
    run = asyncio.run
    assert run(box.run(ToolCall("add", {"a": 2, "b": 3}))).text == "5"
    unknown = run(box.run(ToolCall("nope", {})))
    assert unknown.error and "no tool 'nope' (the tools: add, broken)" in unknown.text
    assert run(box.run(ToolCall("broken", {}))).text == "error: broken: RuntimeError: disk on fire"
    bad_args = run(box.run(ToolCall("add", {"c": 1})))
    assert bad_args.error and "TypeError" in bad_args.text
    malformed = run(box.run(ToolCall(None, error="not JSON (x)")))
    assert malformed.error and malformed.text == "error: malformed tool call: not JSON (x)"
    box.close()


def test_a_hanging_tool_is_cut_at_its_timeout_and_the_box_goes_on() -> None:
    release = threading.Event()

    async def hangs() -> str:
        await asyncio.Event().wait()  # never set: only the timeout ends it
        return "never"

    def blocks() -> str:
        release.wait(60)  # a plain function stuck in a thread
        return "late"

    box = ToolBox(
        [Tool("hangs", hangs, timeout=0.2), Tool("blocks", blocks), Tool("ok", lambda: "fine")],
        timeout=0.3,
    )

    async def calls() -> list[object]:
        return [
            await box.run(ToolCall("hangs", {})),
            await box.run(ToolCall("blocks", {})),
            await box.run(ToolCall("ok", {})),
        ]

    try:
        hung, blocked, ok = asyncio.run(calls())
    finally:
        release.set()
        box.close()
    assert hung.timed_out and hung.text == "error: hangs timed out after 0.2s"  # type: ignore[attr-defined]
    assert blocked.timed_out and blocked.text == "error: blocks timed out after 0.3s"  # type: ignore[attr-defined]
    assert ok.text == "fine" and not ok.error  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("expression", "value"),
    [("3 * 4", 12), ("(1 + 2) ** 3 - 4 / 2", 25.0), ("-7 // 2", -4), ("10 % 4", 2)],
)
def test_the_calculator_evaluates_arithmetic(expression: str, value: float) -> None:
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    ("expression", "why"),
    [
        ("__import__('os').system('true')", "Call is not arithmetic"),
        ("x + 1", "Name is not arithmetic"),
        ("(1).__class__", "Attribute is not arithmetic"),
        ("2 ** 100", "exponent 100 is above 64"),
        ("9 ** 60", "out of range"),
        ("1 / 0", "division by zero"),
        ("1 +", "not an arithmetic expression"),
        ("1" * 201, "longer than 200"),
        ("'a' * 3", "Constant is not arithmetic"),
    ],
)
def test_the_calculator_executes_nothing_but_arithmetic(expression: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        evaluate(expression)


def test_the_calculator_environment_answers_calls_and_scores_the_answer() -> None:
    env = CalculatorEnvironment(EnvironmentConfig({"tool_reward": 0.1}, "b0-p0-s0"))
    reset = env.reset(Prompt("Question: what is 3 * 4? Answer:", "12"))
    assert [m["role"] for m in reset.messages] == ["system", "user"] and reset.guide is None

    def turn(k: int, text: str) -> Turn:
        return Turn(k, text, (), "b0-p0-s0", reset.messages)

    call = format_tool_call("calculator", {"expression": "3 * 4"})
    bad = format_tool_call("calculator", {"expression": "open('x')"})
    first = asyncio.run(env.step(turn(0, call + bad)))
    assert [m["content"] for m in first.messages] == [
        "<tool_response>\n12\n</tool_response>",
        "<tool_response>\nerror: calculator: ValueError: Call is not arithmetic\n</tool_response>",
    ]
    assert first.tool_calls == 2 and first.reward == pytest.approx(0.1) and not first.done
    assert asyncio.run(env.step(turn(1, "It is 12"))).reward == 1.0
    assert asyncio.run(env.step(turn(1, "It is 13"))).done
    env.close()
    guided = CalculatorEnvironment(EnvironmentConfig({"guided_first_turn": True}, "t"))
    regex = guided.reset(Prompt("q", "1")).guide
    assert regex is not None and regex["regex"].startswith("<tool_call>")
