"""An :class:`~relax_core.engine.admission.AdmissionServer` on a private event loop in a daemon
thread, for tests that drive one from synchronous code."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from relax_core.engine.admission import AdmissionServer

__all__ = ["AdmissionThread"]


async def _on_loop(call: Any, *args: Any) -> None:
    call(*args)


class AdmissionThread:
    """Runs an :class:`AdmissionServer` on a private event loop in a daemon thread; every
    method is thread-safe and blocking."""

    def __init__(self, server: AdmissionServer) -> None:
        self.server = server
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"admission-{server.engine_id}", daemon=True
        )

    def start(self, timeout: float = 10.0) -> str:
        """Start the loop and the server; return the public base URL."""
        self._thread.start()
        return str(self._call(self.server.start(), timeout))

    def _call(self, coro: Any, timeout: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def open(self) -> None:
        """Admit generation requests; blocks until the loop has applied it."""
        self._call(_on_loop(self.server.open), 5.0)

    def close(self, reason: str = "DRAINING") -> None:
        """Refuse new generation requests; blocks until the loop has applied it."""
        self._call(_on_loop(self.server.close, reason), 5.0)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing is in flight; ``False`` on timeout."""
        return bool(self._call(self.server.wait_idle(timeout), timeout + 5.0))

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server and the loop and join the thread. Idempotent."""
        if not self._thread.is_alive():
            return
        try:
            self._call(self.server.stop(), timeout)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self._loop.close()

    def __enter__(self) -> AdmissionThread:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
