"""Tool calls in the policy's output (Hermes' and Qwen's format, any number per turn), and the
tools an environment runs for them::

    <tool_call>{"name": "calculator", "arguments": {"expression": "12 * 7"}}</tool_call>
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import threading
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

import attrs

from relax_core import NAME_PATTERN

__all__ = [
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "Tool",
    "ToolBox",
    "ToolCall",
    "ToolResult",
    "format_tool_call",
    "parse_tool_calls",
    "tool_message",
]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.S)


@attrs.frozen
class ToolCall:
    """One ``<tool_call>`` block of a policy turn: the tool's ``name`` and ``arguments``, or
    ``error`` (why the block is not a call) with the block's raw text."""

    name: str | None
    arguments: Mapping[str, Any] = attrs.field(factory=dict)
    error: str | None = None
    raw: str = ""


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>{"name": …, "arguments": {…}}</tool_call>`` block of ``text``, in
    order (a malformed block is a call with ``error`` set; text outside blocks is ignored)."""
    calls = []
    for match in _BLOCK.finditer(text):
        raw = match.group(1).strip()
        try:
            value = json.loads(raw)
        except ValueError as exc:
            calls.append(ToolCall(None, error=f"not JSON ({exc})", raw=raw))
            continue
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            calls.append(ToolCall(None, error='not an object with a "name" string', raw=raw))
            continue
        arguments = value.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
        if not isinstance(arguments, dict):
            calls.append(ToolCall(value["name"], error='"arguments" is not an object', raw=raw))
            continue
        calls.append(ToolCall(value["name"], arguments, raw=raw))
    return calls


def format_tool_call(name: str, arguments: Mapping[str, Any]) -> str:
    """A tool call written in the format :func:`parse_tool_calls` reads."""
    body = json.dumps({"name": name, "arguments": dict(arguments)})
    return f"{TOOL_CALL_OPEN}{body}{TOOL_CALL_CLOSE}"


def tool_message(content: str) -> dict[str, str]:
    """A tool result as the message that goes back to the policy."""
    return {"role": "tool", "content": f"<tool_response>\n{content}\n</tool_response>"}


@attrs.frozen
class Tool:
    """A tool an environment offers: ``fn(**arguments)`` returns its result (anything
    ``str()`` turns into text; a coroutine function is awaited). ``timeout``: its own, else
    the box's."""

    name: str = attrs.field()
    fn: Callable[..., Any] = attrs.field(validator=attrs.validators.is_callable())
    description: str = ""
    timeout: float | None = None

    @name.validator
    def _check(self, _a: object, value: str) -> None:
        if not isinstance(value, str) or not NAME_PATTERN.match(value):
            raise ValueError(f"Tool.name={value!r}: a letter first, then letters, digits, _.-")


@attrs.frozen
class ToolResult:
    """What one call gave: its text, and whether it failed (``error``: the text is why)."""

    call: ToolCall
    text: str
    error: bool = False
    timed_out: bool = False


class ToolBox:
    """An environment's tools by name; :meth:`run` runs a call with a timeout (an async
    tool is cancelled, a plain function's daemon thread abandoned).

    :raises ValueError: two tools of one name, or a timeout that is not positive.
    """

    def __init__(self, tools: Iterable[Tool], *, timeout: float = 10.0) -> None:
        if not timeout > 0:
            raise ValueError(f"ToolBox timeout={timeout!r}: give seconds > 0")
        self.timeout = float(timeout)
        self.tools: dict[str, Tool] = {}
        for tool in tools:
            if tool.name in self.tools:
                raise ValueError(f"two tools are called {tool.name!r}")
            self.tools[tool.name] = tool

    async def run(self, call: ToolCall) -> ToolResult:
        """The call's result; every failure is a result with ``error`` (never raised)."""
        if call.error is not None:
            return ToolResult(call, f"error: malformed tool call: {call.error}", error=True)
        tool = self.tools.get(call.name or "")
        if tool is None:
            known = ", ".join(sorted(self.tools)) or "none"
            return ToolResult(
                call, f"error: no tool {call.name!r} (the tools: {known})", error=True
            )
        timeout = tool.timeout or self.timeout
        try:
            async with asyncio.timeout(timeout):
                value = await self._call(tool, call.arguments)
        except TimeoutError:
            return ToolResult(
                call, f"error: {tool.name} timed out after {timeout:g}s", error=True, timed_out=True
            )
        except Exception as exc:  # a tool's failure is the policy's observation
            return ToolResult(call, f"error: {tool.name}: {type(exc).__name__}: {exc}", error=True)
        return ToolResult(call, str(value))

    def _call(self, tool: Tool, arguments: Mapping[str, Any]) -> Awaitable[Any]:
        if inspect.iscoroutinefunction(tool.fn):
            coro: Awaitable[Any] = tool.fn(**arguments)
            return coro
        # A plain function runs in a daemon thread of its own: one that never returns is
        # abandoned at the timeout and cannot hold the process at exit (a pool's would).
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()

        def settle(value: Any, error: BaseException | None) -> None:
            if future.done():  # cancelled at the timeout
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(value)

        def work() -> None:
            try:
                value, error = tool.fn(**arguments), None
            except Exception as exc:
                value, error = None, exc
            try:
                loop.call_soon_threadsafe(settle, value, error)
            except RuntimeError:  # the loop is gone: nobody waits for the result
                pass

        threading.Thread(target=work, name=f"relax-tool-{tool.name}", daemon=True).start()
        return future

    def close(self) -> None:
        """Nothing to release (each call's thread is a daemon); kept so environments may close
        their box."""
