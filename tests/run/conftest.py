"""Fixtures of the relax run tests that run the example job's three tiny models."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import run as support


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example's three tiny models, made once for the session (runs only read them)."""
    return support.make_models(tmp_path_factory.mktemp("run-models"))


@pytest.fixture
def root(models: Path, tmp_path: Path) -> Path:
    """A job directory of this test with the session's models beside it."""
    (tmp_path / "tiny").symlink_to(models / "tiny", target_is_directory=True)
    return tmp_path
