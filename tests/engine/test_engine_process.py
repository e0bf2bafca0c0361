"""SubprocessEngineProcess: start, readiness with a deadline, early exit, process-group stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from relax_core.engine.process import SubprocessEngineProcess
from relax_core.errors import LifecycleError
from relax_core.records import EngineProcess
from relax_core.testing import free_port, wait_for


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line for line in f)
    except FileNotFoundError:
        return True


@pytest.fixture
def procs():
    started: list[SubprocessEngineProcess] = []
    yield started
    for p in started:
        p.kill()


def test_wait_ready_returns_once_health_answers_200(procs: list, tmp_path: Path) -> None:
    port = free_port()
    # http.server answers 200 for "/" (a directory listing) and 404 for anything else.
    p = SubprocessEngineProcess.start(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        base_url=f"http://127.0.0.1:{port}", engine_id="web", health_path="/", cwd=str(tmp_path),
    )  # fmt: skip
    procs.append(p)
    assert isinstance(p, EngineProcess)
    p.wait_ready(30)
    assert p.poll() is None and p.pid > 0 and p.base_url == f"http://127.0.0.1:{port}"


def test_an_early_exit_raises_with_the_exit_code_and_log_tail(procs: list) -> None:
    p = SubprocessEngineProcess.start(
        _py("print('model file is corrupt', flush=True); raise SystemExit(3)"),
        base_url=f"http://127.0.0.1:{free_port()}", engine_id="bad-engine",
    )  # fmt: skip
    procs.append(p)
    with pytest.raises(LifecycleError) as info:
        p.wait_ready(30)
    msg = str(info.value)
    assert "bad-engine" in msg and "exited with code 3" in msg and "model file is corrupt" in msg
    assert p.poll() == 3


def test_a_server_that_never_answers_times_out_naming_the_url(procs: list) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    p = SubprocessEngineProcess.start(
        _py("import time; time.sleep(60)"), base_url=url, engine_id="slow"
    )
    procs.append(p)
    start = time.monotonic()
    with pytest.raises(LifecycleError, match=f"{url}/health did not answer 200 within 1.0s"):
        p.wait_ready(1.0)
    assert time.monotonic() - start < 10
    assert p.poll() is None  # left running for the caller to stop
    assert p.terminate(5) == -signal.SIGTERM


def test_terminate_kills_children_that_ignore_sigterm(procs: list, tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    code = f"""
        import signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen([sys.executable, "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"])
        open({str(pidfile)!r}, "w").write(str(child.pid))
        time.sleep(120)
    """
    p = SubprocessEngineProcess.start(_py(code), base_url=None, engine_id="stubborn")
    procs.append(p)
    wait_for(
        lambda: pidfile.exists() and pidfile.read_text().strip() != "",
        timeout=30,
        what="the child pid",
    )
    child = int(pidfile.read_text())
    assert p.terminate(timeout=0.5) == -signal.SIGKILL
    wait_for(lambda: _gone(child), timeout=10, what=f"child {child} to die with its group")
    assert p.terminate(5) == -signal.SIGKILL  # idempotent
    assert p.kill() == -signal.SIGKILL


def test_a_follower_without_a_ready_url_is_ready_once_alive_through_a_short_grace(
    procs: list,
) -> None:
    p = SubprocessEngineProcess.start(
        _py("import time; time.sleep(60)"), base_url=None, engine_id="follower"
    )
    procs.append(p)
    start = time.monotonic()
    p.wait_ready(60)
    # It returns after the grace, not at the 60 s deadline (the bound is loose on purpose).
    assert time.monotonic() - start < 30
    assert p.base_url is None and p.ready_url is None
    assert p.terminate(5) == -signal.SIGTERM


def test_a_follower_is_ready_when_its_private_ready_url_answers(
    procs: list, tmp_path: Path
) -> None:
    port = free_port()
    # The "follower" opens its readiness port only after a marker file appears (it "joins").
    marker = tmp_path / "joined"
    code = f"""
        import http.server, os, time
        while not os.path.exists({str(marker)!r}):
            time.sleep(0.02)
        http.server.HTTPServer(("127.0.0.1", {port}), http.server.SimpleHTTPRequestHandler
                               ).serve_forever()
    """
    url = f"http://127.0.0.1:{port}/"
    p = SubprocessEngineProcess.start(
        _py(code), base_url=None, engine_id="follower", ready_url=url, cwd=str(tmp_path)
    )
    procs.append(p)
    assert p.ready_url == url and p.base_url is None
    with pytest.raises(LifecycleError, match=f"{url} did not answer 200 within 0.5s"):
        p.wait_ready(0.5)
    marker.write_text("")
    p.wait_ready(30)
    assert p.poll() is None


def test_a_follower_that_exits_before_joining_raises_with_its_log(procs: list) -> None:
    p = SubprocessEngineProcess.start(
        _py("print('cannot reach the head', flush=True); raise SystemExit(4)"),
        base_url=None,
        engine_id="judge/replica-0/node-1",
        ready_url=f"http://127.0.0.1:{free_port()}/health",
    )
    procs.append(p)
    with pytest.raises(LifecycleError) as info:
        p.wait_ready(30)
    msg = str(info.value)
    assert "judge/replica-0/node-1" in msg and "exited with code 4" in msg
    assert "cannot reach the head" in msg and "follower, ready at" in msg


def test_the_default_log_file_of_an_engine_id_with_slashes_is_created(procs: list) -> None:
    p = SubprocessEngineProcess.start(
        _py("print('hello from the replica')"), base_url=None, engine_id="judge/replica-0"
    )
    procs.append(p)
    wait_for(lambda: p.poll() is not None, timeout=30, what="the process to exit")
    assert p.poll() == 0
    name = os.path.basename(p.log_path)
    assert name.startswith("relax-engine-judge_replica-0-") and name.endswith(".log")
    assert "hello from the replica" in p.log_tail()
    os.unlink(p.log_path)


def test_a_missing_command_raises_lifecycle_error() -> None:
    with pytest.raises(LifecycleError, match="cannot start '/no/such/engine'"):
        SubprocessEngineProcess.start(["/no/such/engine"], base_url=None, engine_id="ghost")


def test_the_log_file_collects_stdout_and_stderr(procs: list, tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    p = SubprocessEngineProcess.start(
        _py("import sys; print('out'); print('err', file=sys.stderr)"),
        base_url=None,
        engine_id="log",
        log_path=str(log),
    )
    procs.append(p)
    wait_for(lambda: p.poll() is not None, timeout=30, what="the process to exit")
    assert p.poll() == 0 and os.path.samefile(p.log_path, log)
    assert "out" in p.log_tail() and "err" in p.log_tail()


@pytest.mark.parametrize("reaped", [True, False])
def test_a_reaped_process_is_killed_once_its_owner_is_sigkilled(reaped: bool) -> None:
    # The owner (a router's manager actor, say) is a process of its own that starts a server
    # and prints its pid; then it is SIGKILLed, as a driver killed with its Ray would be.
    owner = subprocess.Popen(
        _py(f"""
            import sys, time
            from relax_core.engine.process import SubprocessEngineProcess
            server = SubprocessEngineProcess.start(
                [sys.executable, "-c", "import time; time.sleep(120)"],
                base_url=None, engine_id="router-test", reaped={reaped},
            )
            print(server.pid, flush=True)
            time.sleep(120)
            """),
        stdout=subprocess.PIPE,
        text=True,
    )
    server = 0
    try:
        assert owner.stdout is not None
        server = int(owner.stdout.readline())
        owner.kill()
        owner.wait(timeout=10)
        if reaped:
            wait_for(lambda: _gone(server), timeout=10, what="the reaped server to be killed")
        else:  # the control case: nothing kills an orphan that was not reaped
            time.sleep(1.0)
            assert not _gone(server)
    finally:
        owner.kill()
        if server and not _gone(server):
            os.killpg(server, signal.SIGKILL)
