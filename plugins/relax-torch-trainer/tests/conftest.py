"""Fixtures: one micro Llama checkpoint per session (made as a user makes one, with relax-hf)."""

from __future__ import annotations

from pathlib import Path

import pytest
from relax_hf.tiny import make_tiny_model


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A micro random Llama checkpoint (seed 0) and its tokenizer."""
    return make_tiny_model(tmp_path_factory.mktemp("trainer") / "policy", seed=0, size="micro")
