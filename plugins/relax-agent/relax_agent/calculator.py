"""The built-in ``calculator`` environment: the arithmetic dataset with a calculator tool.

The policy is asked the dataset's question and told it may call ``calculator`` with an
``expression``; each call is evaluated by :func:`evaluate` — a parser of arithmetic alone
(numbers, ``+ - * / // % **``, parentheses, unary signs; bounded length, exponent and result),
never Python's ``eval``: nothing the model writes is executed — and the result goes back as a
``tool`` message. A turn without a tool call is the answer: the trajectory is done, rewarded
1.0 when the last number in it equals the label, else 0.0.

Options (``[run.generation.env]``):

- ``guided_first_turn`` (``false``): constrain the first policy turn to a calculator call
  with the engine's constrained decoding (a ``regex`` guide: ``<tool_call>{"name":
  "calculator", "arguments": {"expression": "A op B"}}</tool_call>`` with numbers of up to
  three digits). A tiny random model never writes a tool call by itself; guided, it still
  samples every token (digits, operator) from its own distribution restricted to the
  pattern, so the trajectory holds a real tool call and a real observation. The engine needs
  constrained decoding (the hf engine: ``pip install relax-hf[grammar]``; the run's preflight
  refuses the job, naming the extra, when it is missing).
- ``tool_reward`` (``0.0``): a reward for each tool call that returned a value, recorded as
  the turn's reward (``None`` when 0).
- ``system_prompt``: the instructions (default: :data:`SYSTEM_PROMPT`).
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Callable, Mapping
from typing import Any

from relax_agent.environment import EnvironmentConfig, Observation, Reset, Turn
from relax_agent.tools import Tool, ToolBox, parse_tool_calls, tool_message
from relax_core import CONSTRAINED_DECODING, ConfigProblem, ConfigReader, EnvironmentSpec, Prompt

__all__ = ["CALCULATOR", "GUIDED_CALL", "SYSTEM_PROMPT", "CalculatorEnvironment", "evaluate"]

SYSTEM_PROMPT = (
    "You can use a calculator. To call it, write "
    '<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3"}}</tool_call> '
    "and wait for its answer. When you know the answer, reply with the number alone."
)

#: The first turn's pattern with ``guided_first_turn``: one calculator call, any numbers of up
#: to three digits, one operator.
GUIDED_CALL = (
    r'<tool_call>\{"name": "calculator", "arguments": \{"expression": '
    r'"[0-9]{1,3} [-+*] [0-9]{1,3}"\}\}</tool_call>'
)

_MAX_LENGTH = 200
_MAX_EXPONENT = 64
_MAX_MAGNITUDE = 1e18
_BINARY: Mapping[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: Mapping[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic ``expression``, computed by walking its syntax tree (only
    numbers, the operators ``+ - * / // % **``, unary signs and parentheses are accepted).

    :raises ValueError: anything else (names, calls, attributes…), a division by zero, an
        expression longer than 200 characters, an exponent above 64 or a value above 1e18.
    """
    if not isinstance(expression, str):
        raise ValueError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > _MAX_LENGTH:
        raise ValueError(f"expression longer than {_MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression: {exc.msg}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _bounded(_UNARY[type(node.op)](_value(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ValueError(f"exponent {right} is above {_MAX_EXPONENT}")
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
    raise ValueError(f"{type(node).__name__} is not arithmetic")


def _bounded(value: Any) -> int | float:
    if isinstance(value, complex) or not math.isfinite(value) or abs(value) > _MAX_MAGNITUDE:
        raise ValueError("the value is out of range")
    out: int | float = value
    return out


def _calculator(expression: str) -> str:
    value = evaluate(expression)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


class CalculatorEnvironment:
    """One trajectory of the ``calculator`` environment (see the module docstring)."""

    def __init__(self, config: EnvironmentConfig) -> None:
        o = config.options
        self.guided = bool(o.get("guided_first_turn", False))
        self.tool_reward = float(o.get("tool_reward", 0.0))
        self.system_prompt = str(o.get("system_prompt", SYSTEM_PROMPT))
        self.tools = ToolBox(
            [Tool("calculator", _calculator, "evaluates an arithmetic expression")],
            timeout=config.tool_timeout,
        )
        self.label: str | None = None

    def reset(self, prompt: Prompt) -> Reset:
        """The system prompt and the question (the first turn guided to a call, if asked)."""
        self.label = prompt.label
        messages = [
            {"role": "system", "content": self.system_prompt},
            {"role": "user", "content": prompt.prompt},
        ]
        return Reset(messages, guide={"regex": GUIDED_CALL} if self.guided else None)

    async def step(self, turn: Turn) -> Observation:
        """Run the turn's tool calls, or score its answer."""
        calls = parse_tool_calls(turn.text)
        if not calls:
            numbers = _NUMBER.findall(turn.text)
            correct = self.label is not None and bool(numbers) and numbers[-1] == self.label
            return Observation(reward=1.0 if correct else 0.0, done=True)
        results = [await self.tools.run(call) for call in calls]
        good = sum(not r.error for r in results)
        return Observation(
            [tool_message(r.text) for r in results],
            reward=self.tool_reward * good if self.tool_reward else None,
            tool_calls=len(calls),
            tool_errors=sum(r.error for r in results),
            tool_timeouts=sum(r.timed_out for r in results),
            info={"tool_results": [r.text for r in results]},
        )

    def close(self) -> None:
        """Let the tool box's threads go."""
        self.tools.close()


def _check(config: EnvironmentConfig) -> list[ConfigProblem]:
    r = ConfigReader()
    t, p = dict(config.options), config.path
    r.value(t, p, "guided_first_turn", bool, False)
    r.value(t, p, "tool_reward", float, 0.0)
    r.value(t, p, "system_prompt", str, SYSTEM_PROMPT, check=ConfigReader.non_empty)
    return list(r.problems)


def _needs(options: Mapping[str, Any]) -> dict[str, str]:
    """A guided first turn needs the engine's constrained decoding."""
    if options.get("guided_first_turn") is True:
        return {CONSTRAINED_DECODING: "guided_first_turn"}
    return {}


CALCULATOR = EnvironmentSpec(
    name="calculator",
    make=CalculatorEnvironment,
    options=("guided_first_turn", "tool_reward", "system_prompt"),
    check=_check,
    needs=_needs,
    description="arithmetic questions with a calculator tool (safe evaluation, no eval)",
)
