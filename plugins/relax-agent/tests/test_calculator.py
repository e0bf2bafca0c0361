"""The ``calculator`` environment: safe arithmetic (no eval), tool calls answered, the final
answer scored."""

from __future__ import annotations

import asyncio

import pytest
from relax_agent import EnvironmentConfig, Turn, format_tool_call
from relax_agent.calculator import CalculatorEnvironment, evaluate

from relax_core import Prompt


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
    assert (first.tool_errors, first.tool_timeouts) == (1, 0)  # the call that is not arithmetic
    assert asyncio.run(env.step(turn(1, "It is 12"))).reward == 1.0
    assert asyncio.run(env.step(turn(1, "It is 13"))).done
    env.close()
    guided = CalculatorEnvironment(EnvironmentConfig({"guided_first_turn": True}, "t"))
    regex = guided.reset(Prompt("q", "1")).guide
    assert regex is not None and regex["regex"].startswith("<tool_call>")
