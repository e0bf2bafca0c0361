"""ShutdownSignals: the one Ctrl-C / SIGTERM handler of relax serve and relax run."""

from __future__ import annotations

import asyncio
import io
import os
import signal

import pytest

from relax_core.jobs import ShutdownSignals


@pytest.fixture
def kept_handlers():
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield handlers
    for s, handler in handlers.items():
        signal.signal(s, handler)


def test_an_installed_handler_interrupts_until_the_shutdown_holds_it(kept_handlers) -> None:
    out = io.StringIO()
    signals = ShutdownSignals(out, command="relax run")
    signals.install()
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGTERM)
    signals.hold()
    os.kill(os.getpid(), signal.SIGINT)
    assert out.getvalue() == "relax run: still shutting down, please wait …\n"


def test_the_first_signal_cancels_the_running_task_and_later_ones_are_held(
    kept_handlers,
) -> None:
    said: list[str] = []
    signals = ShutdownSignals(io.StringIO(), command="relax run", say=said.append)
    signals.install()

    async def main() -> str:
        async with signals.cancelling():
            try:
                os.kill(os.getpid(), signal.SIGINT)
                await asyncio.sleep(5)
            except asyncio.CancelledError:
                os.kill(os.getpid(), signal.SIGINT)
                await asyncio.sleep(0.05)  # the second signal is held: no cancellation
                signals.handled()
                await asyncio.sleep(0)  # and the task's later awaits run as usual
                return "stopped"
        return "not cancelled"

    assert asyncio.run(main()) == "stopped"
    assert signals.received == 2
    assert said == ["relax run: still stopping the step in flight, please wait …"]
    # the installed handler is given back when the block ends
    assert signal.getsignal(signal.SIGINT) == signals._handle
