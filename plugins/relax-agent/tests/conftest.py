"""Fixtures of the multi-turn tests: one tiny model (made locally, as a user makes one)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def agent_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random model (seed 0) with its byte-level BPE tokenizer and ChatML template."""
    from relax_hf.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("agent-model") / "policy", seed=0)
