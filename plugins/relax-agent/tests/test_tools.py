"""Tool calls parsed from the policy's text (the Hermes/Qwen ``<tool_call>`` format), the tool
registry's timeout per call and its errors as observations (the calculator: relax-agent)."""

from __future__ import annotations

import asyncio
import threading

from relax_agent import Tool, ToolBox, ToolCall, format_tool_call, parse_tool_calls


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
