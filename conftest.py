"""Root pytest configuration shared by the core's and every plugin's tests."""

from __future__ import annotations

import os

import pytest

# Every Ray a test starts on this machine (local, or simulated nodes of ray.cluster_utils.Cluster)
# keeps its services, engines and admission servers on loopback; set before anything imports Ray.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # "No tests ran" is a failure of the suite, never a silent pass: a collection filter or a
    # missing install that hides every test must turn CI red.
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        print("\nerror: no tests ran (pytest exit code 5); failing the run", flush=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
