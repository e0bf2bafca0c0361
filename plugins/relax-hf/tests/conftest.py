"""Fixtures: one tiny model per session, real hf engine servers on loopback."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from relax_hf.testing import EngineServer, start_engine
from relax_hf.tiny import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny random model (seed 0) for the whole session."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)


StartServer = Callable[..., EngineServer]


@pytest.fixture(scope="module")
def start_server(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[StartServer]:
    """Start hf engine servers for one module; every one is terminated when the module ends."""
    started: list[EngineServer] = []
    tmp = tmp_path_factory.mktemp("engine-logs")

    def start(
        engine_id: str = "hf-test", *, model: Path | None = None, **spec: Any
    ) -> EngineServer:
        server = start_engine(model or tiny_model, tmp, f"{engine_id}-{len(started)}", **spec)
        started.append(server)
        return server

    yield start
    for server in started:
        server.process.terminate(10)


@pytest.fixture(scope="session")
def shared_server(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineServer]:
    """One engine for tests that do not change its state (weights, memory, pause)."""
    log_dir = tmp_path_factory.mktemp("shared-engine")
    # At most one whitespace character in a row in JSON-schema output: a random model would
    # otherwise wander in whitespace (SGLang's --constrained-json-max-whitespace-cnt).
    server = start_engine(
        tiny_model,
        log_dir,
        "hf-shared",
        served_model_name="tiny",
        seed=0,
        extra_args=("--constrained-json-max-whitespace-cnt", "1"),
    )
    yield server
    server.process.terminate(10)


@pytest.fixture(scope="session")
def sglang_source() -> ModuleType:
    """``sglang_source.py`` beside this file: the installed SGLang's source, read unimported."""
    path = Path(__file__).with_name("sglang_source.py")
    spec = importlib.util.spec_from_file_location("relax_hf_tests_sglang_source", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
