"""Parsing and validating SGLang-protocol request bodies.

Every parser raises :class:`BadRequest` naming the offending field (``sampling_params.top_p``)
and what is allowed; the server turns it into a 400. Unknown top-level fields of ``/generate``
are ignored (routers add their own, e.g. ``log_metrics``); unknown sampling parameters are
rejected, as SGLang does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs

__all__ = [
    "BadRequest",
    "GenerateInput",
    "LogprobParams",
    "SamplingParams",
    "parse_dist_addr",
    "parse_generate",
    "parse_sampling_params",
    "parse_tags",
]

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


class BadRequest(ValueError):
    """A request body is invalid; ``field`` names the offending field (a dotted path)."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}" if field else message)


@attrs.frozen
class SamplingParams:
    """Per-request sampling parameters (SGLang's names and defaults)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        """Temperature 0 (or top_k 1) means argmax."""
        return self.temperature == 0.0 or self.top_k == 1


@attrs.frozen
class LogprobParams:
    """What log-probabilities a request wants back."""

    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: tuple[int, ...] | None = None
    return_text_in_logprobs: bool = False


@attrs.frozen
class GenerateInput:
    """One parsed ``/generate`` request (``prompts`` has one entry unless the body was a batch)."""

    prompts: tuple[str | tuple[int, ...], ...]
    batch: bool
    sampling: SamplingParams
    logprob: LogprobParams
    stream: bool
    rids: tuple[str | None, ...]


# -- scalar checks ---------------------------------------------------------------------------


def _bool(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise BadRequest(field, f"must be true or false, got {value!r}")
    return value


def _int(value: Any, field: str, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise BadRequest(field, f"must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise BadRequest(field, f"must be >= {minimum}, got {value}")
    return int(value)


def _float(value: Any, field: str, *, lo: float, hi: float, lo_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise BadRequest(field, f"must be a finite number, got {value!r}")
    v = float(value)
    if v < lo or v > hi or (lo_open and v == lo):
        bracket = "(" if lo_open else "["
        raise BadRequest(field, f"must be in {bracket}{lo}, {hi}], got {v}")
    return v


def _token_ids(value: Any, field: str, vocab_size: int) -> tuple[int, ...]:
    if not isinstance(value, list | tuple):
        raise BadRequest(field, f"must be a list of token ids, got {type(value).__name__}")
    out = []
    for i, tid in enumerate(value):
        t = _int(tid, f"{field}[{i}]", minimum=0)
        if t >= vocab_size:
            raise BadRequest(
                f"{field}[{i}]", f"token id {t} is outside the vocabulary (size {vocab_size})"
            )
        out.append(t)
    return tuple(out)


# -- sampling params -------------------------------------------------------------------------

_NEUTRAL = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "n": 1}
_IGNORED = {
    "spaces_between_special_tokens",
    "regex",
    "json_schema",
    "ebnf",
    "custom_params",
    "stream_interval",
}


def parse_sampling_params(
    raw: Any, *, vocab_size: int, field: str = "sampling_params"
) -> SamplingParams:
    """Validate SGLang sampling parameters. :raises BadRequest: naming the field."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise BadRequest(field, f"must be an object, got {type(raw).__name__}")
    kw: dict[str, Any] = {}
    for key, value in raw.items():
        f = f"{field}.{key}"
        if value is None:
            continue
        if key == "temperature":
            kw[key] = _float(value, f, lo=0.0, hi=100.0)
        elif key == "top_p":
            kw[key] = _float(value, f, lo=0.0, hi=1.0, lo_open=True)
        elif key == "min_p":
            kw[key] = _float(value, f, lo=0.0, hi=1.0)
        elif key == "top_k":
            k = _int(value, f)
            if k == 0 or k < -1:
                raise BadRequest(f, f"must be -1 (no limit) or >= 1, got {k}")
            kw[key] = k
        elif key in ("max_new_tokens", "min_new_tokens"):
            kw[key] = _int(value, f, minimum=0)
        elif key == "stop":
            stops = [value] if isinstance(value, str) else value
            if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
                raise BadRequest(f, "must be a non-empty string or a list of non-empty strings")
            kw[key] = tuple(stops)
        elif key == "stop_token_ids":
            kw[key] = _token_ids(value, f, vocab_size)
        elif key in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
            kw[key] = _bool(value, f)
        elif key in ("seed", "sampling_seed"):
            kw["seed"] = _int(value, f, minimum=0)
        elif key in _NEUTRAL:
            if value != _NEUTRAL[key]:
                raise BadRequest(f, f"is not supported by the hf engine (only {_NEUTRAL[key]!r})")
        elif key in _IGNORED:
            if key in ("regex", "json_schema", "ebnf"):
                raise BadRequest(f, "constrained decoding is not supported by the hf engine")
        else:
            raise BadRequest(f, "unknown sampling parameter")
    params = SamplingParams(**kw)
    if params.min_new_tokens > params.max_new_tokens:
        raise BadRequest(
            f"{field}.min_new_tokens", f"must be <= max_new_tokens ({params.max_new_tokens})"
        )
    return params


# -- /generate -------------------------------------------------------------------------------


def _prompt_list(
    body: Mapping[str, Any], vocab_size: int
) -> tuple[tuple[str | tuple[int, ...], ...], bool]:
    has_text = body.get("text") is not None
    has_ids = body.get("input_ids") is not None
    if has_text and has_ids:
        raise BadRequest("text", "give either text or input_ids, not both")
    if not has_text and not has_ids:
        raise BadRequest("text", "one of text or input_ids is required")
    if has_text:
        text = body["text"]
        if isinstance(text, str):
            return (text,), False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return tuple(text), True
        raise BadRequest("text", "must be a string or a non-empty list of strings")
    ids = body["input_ids"]
    if isinstance(ids, list) and ids and all(isinstance(x, list) for x in ids):
        out = tuple(_token_ids(x, f"input_ids[{i}]", vocab_size) for i, x in enumerate(ids))
        for i, x in enumerate(out):
            if not x:
                raise BadRequest(f"input_ids[{i}]", "must not be empty")
        return out, True
    parsed = _token_ids(ids, "input_ids", vocab_size)
    if not parsed:
        raise BadRequest("input_ids", "must not be empty")
    return (parsed,), False


def parse_generate(body: Any, *, vocab_size: int) -> GenerateInput:
    """Validate a ``/generate`` body. :raises BadRequest: naming the first offending field."""
    if not isinstance(body, Mapping):
        raise BadRequest("", f"the body must be a JSON object, got {type(body).__name__}")
    prompts, batch = _prompt_list(body, vocab_size)
    sp_raw = body.get("sampling_params")
    if batch and isinstance(sp_raw, list):
        raise BadRequest(
            "sampling_params", "per-prompt sampling params are not supported; give one object"
        )
    sampling = parse_sampling_params(sp_raw, vocab_size=vocab_size)

    rl = body.get("return_logprob")
    return_logprob = False if rl is None else _bool(rl, "return_logprob")
    lsl = body.get("logprob_start_len")
    start = -1 if lsl is None else _int(lsl, "logprob_start_len", minimum=-1)
    tln = body.get("top_logprobs_num")
    top = 0 if tln is None else _int(tln, "top_logprobs_num", minimum=0)
    if top > vocab_size:
        raise BadRequest("top_logprobs_num", f"must be <= the vocabulary size {vocab_size}")
    til = body.get("token_ids_logprob")
    token_ids = None if til is None else _token_ids(til, "token_ids_logprob", vocab_size)
    rtl = body.get("return_text_in_logprobs")
    text_in = False if rtl is None else _bool(rtl, "return_text_in_logprobs")
    if not return_logprob:
        if top:
            raise BadRequest("top_logprobs_num", "needs return_logprob: true")
        if token_ids is not None:
            raise BadRequest("token_ids_logprob", "needs return_logprob: true")
    for i, p in enumerate(prompts):
        if return_logprob and not isinstance(p, str) and start >= len(p):
            where = f"input_ids[{i}]" if batch else "input_ids"
            raise BadRequest(
                "logprob_start_len", f"must be < the prompt length ({len(p)} tokens of {where})"
            )
    logprob = LogprobParams(return_logprob, start, top, token_ids, text_in)

    st = body.get("stream")
    stream = False if st is None else _bool(st, "stream")
    if stream and batch:
        raise BadRequest(
            "stream", "streaming a batch of prompts is not supported; send one prompt per request"
        )

    rid = body.get("rid")
    if rid is None:
        rids: tuple[str | None, ...] = (None,) * len(prompts)
    elif batch:
        if (
            not isinstance(rid, list)
            or len(rid) != len(prompts)
            or not all(isinstance(r, str) and r for r in rid)
        ):
            raise BadRequest(
                "rid", f"must be a list of {len(prompts)} non-empty strings for a batch"
            )
        rids = tuple(rid)
    else:
        if not isinstance(rid, str) or not rid:
            raise BadRequest("rid", "must be a non-empty string")
        rids = (rid,)
    if body.get("image_data") is not None:
        raise BadRequest("image_data", "the hf engine serves text-only models")
    if body.get("lora_path") is not None:
        raise BadRequest("lora_path", "LoRA adapters are not supported by the hf engine")
    return GenerateInput(prompts, batch, sampling, logprob, stream, rids)


def parse_tags(body: Any) -> tuple[str, ...]:
    """The ``tags`` of a release/resume body; ``None`` or a missing body means all tags."""
    if body is None:
        return MEMORY_TAGS
    if not isinstance(body, Mapping):
        raise BadRequest("", "the body must be a JSON object")
    tags = body.get("tags")
    if tags is None:
        return MEMORY_TAGS
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise BadRequest("tags", "must be null or a list of strings")
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        raise BadRequest("tags", f"unknown memory tag(s) {unknown}; known: {list(MEMORY_TAGS)}")
    return tuple(dict.fromkeys(tags))


def parse_dist_addr(addr: str | None, field: str = "dist_init_addr") -> tuple[str, int]:
    """``"host:port"`` → ``(host, port)``. :raises ValueError: naming ``field``."""
    host, sep, port = (addr or "").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"{field}: {addr!r} is not host:port (e.g. 10.0.0.1:29500); a multi-node engine "
            "needs the address its head hosts the node group at"
        )
    return host.strip("[]"), int(port)
