"""A generic engine server running as a child process in its own process group: start, wait
until ready, stop (:class:`SubprocessEngineProcess`, for every backend whose server is a local
command)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence

import attrs

from relax_core.engine._logtail import quote_log, read_end
from relax_core.errors import LifecycleError

_TAIL_BYTES = 4000
#: How long a follower without a readiness URL must stay alive to count as started.
FOLLOWER_GRACE_S = 1.0


def safe_file_name(text: str) -> str:
    """``text`` with every character but letters, digits, ``-``, ``_`` and ``.`` replaced by
    ``_`` (an engine id such as ``judge/replica-0`` becomes ``judge_replica-0``)."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text) or "engine"


@attrs.define(eq=False)
class SubprocessEngineProcess:
    """An engine server process started from a command line (implements ``EngineProcess``):
    build one with :meth:`start` (returns at once), then :meth:`wait_ready`. :meth:`terminate`
    and :meth:`kill` are idempotent and always reap the process."""

    _popen: subprocess.Popen[bytes]
    #: ``http://host:port`` of the server; ``None`` for a follower.
    base_url: str | None = attrs.field(kw_only=True, on_setattr=attrs.setters.frozen)
    #: The engine id given at start (used in error messages).
    engine_id: str = attrs.field(kw_only=True, on_setattr=attrs.setters.frozen)
    #: The file that receives the server's stdout and stderr.
    log_path: str = attrs.field(kw_only=True, on_setattr=attrs.setters.frozen)
    _health_path: str = attrs.field(default="/health", kw_only=True)
    _ready_url: str | None = attrs.field(default=None, kw_only=True)
    _returncode: int | None = attrs.field(default=None, init=False)

    @classmethod
    def start(
        cls,
        argv: Sequence[str],
        *,
        base_url: str | None,
        engine_id: str,
        env: Mapping[str, str] | None = None,
        log_path: str | None = None,
        cwd: str | None = None,
        health_path: str = "/health",
        ready_url: str | None = None,
        reaped: bool = False,
    ) -> SubprocessEngineProcess:
        """Start ``argv`` in a new process group and return without waiting.

        :param base_url: ``http://host:port`` the server answers on (``None``: a follower).
        :param engine_id: names the engine in every error message (and the default log file).
        :param env: variables added to (and overriding) this process's environment.
        :param log_path: where stdout and stderr go (appended); a temporary file if ``None``.
        :param ready_url: a follower's private URL that answers 200 once it joined its head.
        :param reaped: a detached reaper SIGKILLs the process group once this process is gone
            (a SIGKILLed owner leaves nothing running: a router's owner, say).
        :raises LifecycleError: the command cannot be started (not found, not executable)."""
        if log_path is None:
            fd, log_path = tempfile.mkstemp(
                prefix=f"relax-engine-{safe_file_name(engine_id)}-", suffix=".log"
            )
            os.close(fd)
        try:
            with open(log_path, "ab") as log:
                popen = subprocess.Popen(
                    list(argv),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, **(env or {})},
                    cwd=cwd,
                    start_new_session=True,
                )
        except OSError as exc:
            raise LifecycleError(
                f"engine {engine_id}: cannot start {argv[0]!r}: {exc}; check the command and "
                "that its interpreter is installed"
            ) from exc
        if reaped:
            from relax_core.manager.reaper import start_reaper

            start_reaper(os.getpid(), popen.pid)
        return cls(
            popen,
            base_url=base_url,
            engine_id=engine_id,
            log_path=log_path,
            health_path=health_path,
            ready_url=ready_url,
        )

    @property
    def pid(self) -> int:
        """The process id of the server (the leader of its process group)."""
        return self._popen.pid

    @property
    def ready_url(self) -> str | None:
        """The URL :meth:`wait_ready` polls: ``{base_url}/health``, a follower's private
        readiness URL, or ``None`` (a follower that only has to stay alive)."""
        if self.base_url is not None:
            return self.base_url + self._health_path
        return self._ready_url

    def log_tail(self, max_bytes: int = _TAIL_BYTES) -> str:
        """The last ``max_bytes`` of the server's log ("" if it cannot be read)."""
        try:
            return read_end(self.log_path, max_bytes)[0]
        except OSError:
            return ""

    def poll(self) -> int | None:
        """The exit code, or ``None`` while the process runs (never blocks); an exited leader's
        group is killed before the leader is reaped."""
        if self._returncode is None and self._leader_exited():
            self._reap()
        return self._returncode

    def _leader_exited(self) -> bool:
        if self._popen.returncode is not None:
            return True
        try:
            info = os.waitid(os.P_PID, self._popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return True
        return info is not None

    def _reap(self) -> int:
        self._signal_group(signal.SIGKILL)
        self._returncode = self._popen.wait()
        return self._returncode

    def _health_once(self, url: str, timeout: float) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=timeout) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def wait_ready(self, timeout: float, *, interval: float = 0.1) -> None:
        """Block until ``GET {base_url}/health`` (a follower: its ``ready_url``) answers 200;
        a follower without one: once alive for :data:`FOLLOWER_GRACE_S` seconds.
        :raises LifecycleError: the process exited first (quoting its log), or ``timeout``
            passed (the process is left running: call :meth:`terminate`)."""
        start = time.monotonic()
        deadline = start + timeout
        url = self.ready_url
        grace_end = start + min(timeout, FOLLOWER_GRACE_S)
        while True:
            code = self.poll()
            if code is not None:
                raise LifecycleError(
                    f"engine {self.engine_id}: server process {self.pid} exited with code {code} "
                    f"before it was ready{self._where()}; {quote_log(self.log_path)}"
                )
            now = time.monotonic()
            if url is None:
                # A follower with nothing to ask: staying alive through the grace is all we check.
                if now >= grace_end:
                    return
                time.sleep(min(interval, grace_end - now))
                continue
            if self._health_once(url, timeout=max(0.05, min(2.0, deadline - now))):
                return
            if time.monotonic() >= deadline:
                raise LifecycleError(
                    f"engine {self.engine_id}: {url} did not answer 200 within {timeout:.1f}s "
                    f"(process {self.pid} still running); raise the start-up timeout or read "
                    f"the whole log; {quote_log(self.log_path)}"
                )
            time.sleep(min(interval, max(0.0, deadline - time.monotonic())))

    def terminate(self, timeout: float = 10.0) -> int:
        """SIGTERM the process group, SIGKILL it after ``timeout`` seconds; reap; return the
        code. Idempotent; every process left in the group is killed."""
        if self.poll() is not None:
            assert self._returncode is not None
            return self._returncode
        self._signal_group(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while not self._leader_exited() and time.monotonic() < deadline:
            time.sleep(0.02)
        # Children that outlived the leader (or ignored SIGTERM) die with the group.
        return self._reap()

    def kill(self) -> int:
        """SIGKILL the whole process group at once, reap, and return the exit code."""
        if self._returncode is not None:
            return self._returncode
        return self._reap()

    def _signal_group(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._popen.pid, sig)

    def _where(self) -> str:
        if self.base_url:
            return f" (serving {self.base_url})"
        return f" (follower, ready at {self._ready_url})" if self._ready_url else " (follower)"

    def __repr__(self) -> str:
        state = "running" if self.poll() is None else f"exited {self._returncode}"
        where = self.base_url or "follower"
        return f"SubprocessEngineProcess({self.engine_id!r}, pid={self.pid}, {where}, {state})"
