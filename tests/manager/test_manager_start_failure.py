"""A replica whose engine fails to start reports why: the last error in the engine's own log.

The first test runs a real hf engine on a model it cannot load through the whole manager (a
real local Ray): the replica's result and ``raise_for_failures()`` — what ``relax serve`` and
``relax run`` print — quote the engine's exception and name its log. The second starts an
:class:`EngineWorker` in this process with a backend whose process errors say nothing of its
log: the worker quotes the log itself.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from relax_core.engine.spec import InferenceEngineSpec
from relax_core.errors import LifecycleError
from relax_core.manager import InferenceManager, ModelLaunch, Outcome, ReplicaPlacement
from relax_core.plugins import PluginManager
from relax_core.records import EngineLaunchSpec
from tests.support import manager as support

#: What the hf engine's exception says (transformers) about an unknown ``model_type``.
UNKNOWN_MODEL_TYPE = (
    "ValueError: The checkpoint you are trying to load has model type `no-such-arch`"
)


@pytest.fixture
def unloadable_model(tmp_path: Path) -> Path:
    """A tiny hf model whose config.json is valid JSON naming a ``model_type`` nobody knows."""
    model = tmp_path / "unloadable"
    shutil.copytree(support.tiny_model(), model)
    config = json.loads((model / "config.json").read_text())
    config["model_type"] = "no-such-arch"
    (model / "config.json").write_text(json.dumps(config))
    return model


@pytest.mark.ray
def test_an_engine_that_fails_at_start_fails_its_replica_quoting_its_log(
    ray_local: Any, unloadable_model: Path, tmp_path: Path
) -> None:
    pm = support.plugins()
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    manager = InferenceManager(
        "judge",
        spec=InferenceEngineSpec(role="genrm", weight_source=pm.weight_source("STATIC")),
        backend=pm.engine_backend("hf"),
        launch=ModelLaunch(model_path=str(unloadable_model), log_dir=str(log_dir)),
        placement=ReplicaPlacement(
            support.placement_group(1), [[[0]]], ray_gpu_fraction=1.0, owned=True
        ),
        timeouts=support.FAST,
    )
    with support.managed(manager, start=False):
        result = manager.start()
        (failed,) = result.failed
        assert failed.engine_id == "judge/replica-0" and failed.outcome is Outcome.FAILED
        (log,) = log_dir.glob("*.log")
        error = failed.error or ""
        assert "start of judge/replica-0: LifecycleError:" in error
        assert f"last error in its log ({log}):" in error
        assert error.count(UNKNOWN_MODEL_TYPE) == 1
        with pytest.raises(LifecycleError) as info:
            result.raise_for_failures()
        assert UNKNOWN_MODEL_TYPE in str(info.value) and str(log) in str(info.value)


class _BareProcess:
    """An engine process of a backend's own (no ``SubprocessEngineProcess``): its start-up
    error names neither its log nor the cause."""

    def __init__(self, argv: list[str], log_path: str) -> None:
        with open(log_path, "ab") as log:
            self._popen = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def base_url(self) -> str | None:
        return None

    def wait_ready(self, timeout: float) -> None:
        code = self._popen.wait(timeout)
        raise LifecycleError(f"the engine exited with code {code}")

    def poll(self) -> int | None:
        return self._popen.poll()

    def terminate(self, timeout: float) -> int:
        if self._popen.poll() is None:
            self._popen.kill()
        return self._popen.wait(timeout)


def test_a_worker_quotes_the_log_of_an_engine_whose_own_error_does_not(
    core_plugin_manager: PluginManager, tmp_path: Path
) -> None:
    script = "raise RuntimeError('the weights are not where config.json says')"
    started: list[_BareProcess] = []

    def launch(spec: EngineLaunchSpec) -> _BareProcess:
        assert spec.log_path is not None
        started.append(_BareProcess([sys.executable, "-c", script], spec.log_path))
        return started[-1]

    worker = support.bare_worker(core_plugin_manager, launch)
    log = tmp_path / "judge_replica-0.log"
    spec = EngineLaunchSpec(engine_id="judge/replica-0", model_path="unused", log_path=str(log))
    try:
        with pytest.raises(LifecycleError) as info:
            asyncio.run(worker.start(spec, 60))
    finally:
        for process in started:
            process.terminate(10)
    msg = str(info.value)
    assert "exited with code 1 during its start" in msg
    assert "(LifecycleError: the engine exited with code 1)" in msg
    assert f"last error in its log ({log}):" in msg
    assert msg.splitlines()[-1] == "    RuntimeError: the weights are not where config.json says"
    assert worker.reaper_pid is None
