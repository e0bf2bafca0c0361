"""The Ray a job runs on and the signals that stop it: what ``relax serve`` and ``relax run``
do around their job, the same way.

:func:`ray_session` connects to a given cluster or starts a new local Ray declaring the job's
GPUs (never attaching to another local cluster implicitly) and stops the Ray it started;
:class:`ShutdownSignals` turns Ctrl-C and SIGTERM into ``KeyboardInterrupt`` until the shutdown
begins, then holds them.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator
from typing import Any, TextIO

from relax_core.config import JobConfig

__all__ = ["ShutdownSignals", "ray_session"]


@contextlib.contextmanager
def ray_session(address: str | None, config: JobConfig, out: TextIO = sys.stdout) -> Iterator[str]:
    """Connect to ``address``, or start a new local Ray declaring the config's GPUs (never
    an existing local cluster); yield a description; stop the Ray this call started."""
    import logging

    loaded = sys.modules.get("ray")
    connected = loaded is not None and loaded.is_initialized()
    gpus = config.cluster.total_gpus
    # Said before Ray is imported: its import and start are a newcomer's first 10-15 s.
    if not connected:
        doing = (
            f"connecting to the Ray cluster at {address}"
            if address
            else f"starting a new local Ray ({gpus} GPU{'s' if gpus != 1 else ''} declared)"
        )
        print(f"  {doing} …", file=out, flush=True)
    import ray

    started = not connected
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
        what = f"a new local Ray ({gpus} GPU{'s' if gpus != 1 else ''} declared)"
    try:
        yield what
    finally:
        if started:
            ray.shutdown()
            if not address:
                print("  local Ray stopped", file=out, flush=True)


class ShutdownSignals:
    """Ctrl-C and SIGTERM interrupt the job (``KeyboardInterrupt``); once :meth:`hold` is
    called (the shutdown began) they are held, because an interrupted shutdown would leave
    engines running. ``command`` names the command in the line printed for a held signal."""

    def __init__(self, out: TextIO, *, command: str = "relax serve") -> None:
        self.out = out
        self.command = command
        self.holding = False

    def install(self) -> None:
        """Handle SIGINT and SIGTERM (main thread only)."""
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)

    def hold(self) -> None:
        """From now on, say "still shutting down" instead of interrupting. Idempotent."""
        self.holding = True

    def _handle(self, signum: int, frame: Any) -> None:
        if self.holding:
            print(f"{self.command}: still shutting down, please wait …", file=self.out, flush=True)
            return
        raise KeyboardInterrupt
