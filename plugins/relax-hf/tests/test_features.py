"""The hf backend says whether this install can provide an engine feature a job needs: the
constrained decoding of a guided turn is xgrammar's, an optional extra."""

from __future__ import annotations

import sys

import pytest
from relax_hf.plugin import HF_BACKEND

from relax_core import CONSTRAINED_DECODING


def test_constrained_decoding_without_xgrammar_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert HF_BACKEND.missing is not None
    # One install per machine: xgrammar is made unfindable (None in sys.modules), a mock of
    # an install without relax-hf[grammar].
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    why = HF_BACKEND.missing(CONSTRAINED_DECODING)
    assert why == "constrained decoding needs xgrammar: pip install 'relax-hf[grammar]'"


def test_constrained_decoding_with_xgrammar_is_provided() -> None:
    pytest.importorskip("xgrammar", reason="this install has no relax-hf[grammar]")
    assert HF_BACKEND.missing is not None and HF_BACKEND.missing(CONSTRAINED_DECODING) is None


def test_a_feature_the_engine_does_not_know_is_missing() -> None:
    assert HF_BACKEND.missing is not None
    assert "no feature 'speculative'" in str(HF_BACKEND.missing("speculative"))
