"""The Ray a job runs on (:func:`ray_session`) and the signals that stop it
(:class:`ShutdownSignals`), the same for ``relax serve`` and ``relax run``."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TextIO

from relax_core.config import JobConfig

Say = Callable[[str], None]


@contextlib.contextmanager
def ray_session(address: str | None, config: JobConfig, out: TextIO = sys.stdout) -> Iterator[str]:
    """Connect to ``address``, or start a new local Ray declaring the config's GPUs (never
    an existing local cluster); yield a description; stop the Ray this call started."""
    import logging

    loaded = sys.modules.get("ray")
    connected = loaded is not None and loaded.is_initialized()
    gpus = config.cluster.total_gpus
    local = f"a new local Ray ({gpus} GPU{'s' if gpus != 1 else ''} declared)"
    # Said before Ray is imported: its import and start are a newcomer's first 10-15 s.
    if not connected:
        doing = f"connecting to the Ray cluster at {address}" if address else f"starting {local}"
        print(f"  {doing} …", file=out, flush=True)
    import ray

    if connected:
        what = "the Ray this process is connected to"
    elif address:
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
        what = f"the Ray cluster at {address}"
    else:
        from relax_core.net import keep_local_ray_on_loopback

        keep_local_ray_on_loopback()
        ray.init(
            address="local",
            num_gpus=gpus,
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.WARNING,
        )
        what = local
    try:
        yield what
    finally:
        if not connected:
            ray.shutdown()
            if not address:
                print("  local Ray stopped", file=out, flush=True)


class ShutdownSignals:
    """Ctrl-C and SIGTERM for ``relax serve`` and ``relax run``: once :meth:`install`-ed a
    signal raises ``KeyboardInterrupt``; inside :meth:`cancelling` the first cancels that task
    and later ones are held; after :meth:`hold` every one is held, its line (naming
    ``command``) going to ``say`` (default: printed to ``out``)."""

    def __init__(
        self, out: TextIO, *, command: str = "relax serve", say: Say | None = None
    ) -> None:
        self.out = out
        self.command = command
        self.holding = False
        #: Signals that cancelled (or were held while cancelling) the task of :meth:`cancelling`.
        self.received = 0
        self._say = say
        self._task: asyncio.Task[Any] | None = None
        self._uncancelled = False

    def install(self) -> None:
        """Handle SIGINT and SIGTERM (main thread only)."""
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)

    def hold(self) -> None:
        """From now on, say "still shutting down" instead of interrupting. Idempotent."""
        self.holding = True

    @contextlib.asynccontextmanager
    async def cancelling(self) -> AsyncIterator[None]:
        """Within the block, SIGINT and SIGTERM cancel the running task (the first) or are
        held (later ones); the handlers before are given back on exit. Outside the main thread
        nothing is installed."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        self._task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        for sig in previous:
            loop.add_signal_handler(sig, self._cancel)
        try:
            yield
        finally:
            for sig, handler in previous.items():
                loop.remove_signal_handler(sig)
                signal.signal(sig, signal.SIG_DFL if handler is None else handler)

    def handled(self) -> None:
        """The cancellation was dealt with: the task's later awaits are not cancelled again
        (``Task.uncancel``, so ``asyncio.timeout`` blocks after it work as usual). Idempotent."""
        if self._task is not None and self.received and not self._uncancelled:
            self._uncancelled = True
            self._task.uncancel()

    def _cancel(self) -> None:
        self.received += 1
        if self.received == 1 and not self.holding and self._task is not None:
            self._task.cancel()
            return
        self._held("still stopping the step in flight")

    def _handle(self, signum: int, frame: Any) -> None:
        if self.holding:
            self._held("still shutting down")
            return
        raise KeyboardInterrupt

    def _held(self, doing: str) -> None:
        line = f"{self.command}: {doing}, please wait …"
        if self._say is not None:
            self._say(line)
        else:
            print(line, file=self.out, flush=True)
