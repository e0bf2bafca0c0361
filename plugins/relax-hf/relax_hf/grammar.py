"""Constrained decoding with xgrammar, the grammar engine SGLang uses.

:class:`GrammarBackend` compiles a request's ``json_schema``, ``regex``, ``ebnf`` or
``structural_tag`` for the model's tokenizer (compiled grammars are cached by source); a
:class:`Constraint` is one sequence's matcher: before each sampling it gives the allowed tokens
(a bitmask xgrammar fills on the CPU, unpacked into a boolean row), after it accepts the sampled
token. A grammar that does not compile raises :class:`~relax_hf.protocol.BadRequest` naming the
field (a 400). xgrammar is an optional dependency (``pip install relax-hf[grammar]``); without
it a constrained request is refused with a 400 that says so.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

import torch

from relax_hf.protocol import BadRequest

__all__ = ["Constraint", "GrammarBackend"]

_CACHE_SIZE = 128


class Constraint:
    """One sequence's grammar state (compute thread only)."""

    def __init__(self, matcher: Any, vocab_size: int, xgr: Any) -> None:
        self._matcher = matcher
        self._vocab = vocab_size
        self._xgr = xgr
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def allowed(self) -> torch.Tensor:
        """Boolean ``[vocab]`` (CPU) of the tokens the grammar allows next."""
        self._matcher.fill_next_token_bitmask(self._bitmask, 0)
        words = self._bitmask[0].to(torch.int64) & 0xFFFFFFFF
        bits = (words[:, None] >> torch.arange(32, dtype=torch.int64)) & 1
        return bits.reshape(-1)[: self._vocab].bool()

    def accept(self, token: int) -> bool:
        """Advance past ``token``; ``False`` if the grammar rejects it."""
        return bool(self._matcher.accept_token(token))

    @property
    def terminated(self) -> bool:
        """The grammar accepted a stop token: the output is complete."""
        return bool(self._matcher.is_terminated())


class GrammarBackend:
    """Compiles grammars for one tokenizer; thread-safe (HTTP threads compile, compute uses)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: frozenset[int],
        *,
        any_whitespace: bool = True,
        max_whitespace_cnt: int | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab = vocab_size
        self._stop = sorted(stop_token_ids)
        self._any_whitespace = any_whitespace
        self._max_ws = max_whitespace_cnt
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._xgr: Any = None
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()

    def _load(self, field: str) -> Any:
        if self._compiler is None:
            try:
                import xgrammar as xgr
            except ImportError:
                raise BadRequest(
                    field,
                    "constrained decoding needs xgrammar, which is not installed with this "
                    "engine (pip install 'relax-hf[grammar]')",
                ) from None
            info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer, vocab_size=self._vocab, stop_token_ids=self._stop
            )
            self._xgr = xgr
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def compile(self, kind: str, source: str, field: str) -> Any:
        """The compiled grammar of ``source`` (cached). :raises BadRequest: naming ``field``."""
        key = (kind, source)
        with self._lock:
            compiler = self._load(field)
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            try:
                if kind == "json_schema":
                    if source == "$$ANY$$":
                        compiled = compiler.compile_builtin_json_grammar()
                    else:
                        compiled = compiler.compile_json_schema(
                            source,
                            any_whitespace=self._any_whitespace,
                            max_whitespace_cnt=self._max_ws,
                        )
                elif kind == "regex":
                    compiled = compiler.compile_regex(source)
                elif kind == "ebnf":
                    compiled = compiler.compile_grammar(source)
                elif kind == "structural_tag":
                    json.loads(source)
                    compiled = compiler.compile_structural_tag(source)
                else:  # pragma: no cover - the parser knows the four kinds
                    raise BadRequest(field, f"unknown grammar kind {kind!r}")
            except BadRequest:
                raise
            except (RuntimeError, ValueError, TypeError) as exc:
                lines = str(exc).strip().splitlines() or [repr(exc)]
                # xgrammar prefixes its messages with "[time] source.cc:line: ".
                detail = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", lines[0])
                raise BadRequest(field, f"the {kind} does not compile: {detail}") from exc
            self._cache[key] = compiled
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
            return compiled

    def constraint(self, compiled: Any) -> Constraint:
        """A matcher at the start of ``compiled``."""
        return Constraint(self._xgr.GrammarMatcher(compiled), self._vocab, self._xgr)
