"""Parsing and validating SGLang-protocol request bodies.

Every parser raises :class:`BadRequest` naming the offending field (``sampling_params.top_p``)
and what is allowed; the server turns it into a 400. Unknown top-level fields of ``/generate``
are ignored (routers add their own, e.g. ``log_metrics``); unknown sampling parameters are
rejected, as SGLang does.

:class:`SamplingParams` has every API field of the pinned SGLang version's
``sglang.srt.sampling.sampling_params.SamplingParams`` (``SGLANG_VERSION``), with SGLang's
names, defaults and ``verify()`` rules; ``tests/test_sampling_params.py`` compares the list with
the installed SGLang source so that a version bump shows the difference.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

import attrs

__all__ = [
    "CUSTOM_LOGIT_PROCESSOR_REFUSED",
    "MEMORY_TAGS",
    "SAMPLING_MASK_MAX_TOKENS",
    "SGLANG_INTERNAL_SAMPLING_FIELDS",
    "SGLANG_VERSION",
    "BadRequest",
    "GenerateInput",
    "LogprobParams",
    "NotFound",
    "SamplingParams",
    "parse_dist_addr",
    "parse_generate",
    "parse_sampling_params",
    "parse_tags",
    "sampling_param_names",
]

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")

#: The SGLang release whose ``SamplingParams`` this module mirrors.
SGLANG_VERSION = "0.5.23"

#: Fields of SGLang's ``SamplingParams`` that its own code fills in (``normalize()``); callers do
#: not send them, and this engine refuses them as unknown.
SGLANG_INTERNAL_SAMPLING_FIELDS = (
    "stop_strs",
    "stop_regex_strs",
    "stop_str_max_len",
    "stop_regex_max_len",
    "is_normalized",
    "ebnf_full_assistant",
)

# SGLang's limits (sampling_params.py).
MAX_STOP_COUNT = 32
MAX_STOP_REGEX_COUNT = 32
MAX_STOP_REGEX_LEN = 256
_SAMPLING_EPS = 1e-6
_GRAMMARS = ("json_schema", "regex", "ebnf", "structural_tag")


class NotFound(LookupError):
    """A request names something this engine does not have (a 404); ``param`` names the field
    and ``code`` is the OpenAI error code (``model_not_found``)."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        self.message = message
        self.param = param
        self.code = code
        super().__init__(message)


class BadRequest(ValueError):
    """A request body is invalid; ``field`` names the offending field (a dotted path)."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}" if field else message)


@attrs.frozen
class SamplingParams:
    """Per-request sampling parameters: SGLang's API fields, names and defaults.

    ``top_k`` keeps SGLang's wire meaning (-1: the whole vocabulary); ``logit_bias`` is stored
    as ``((token_id, bias), …)``; ``stop``/``stop_regex`` as tuples. ``beam_width`` and an
    enabled ``watermark`` are refused by the parser (see ``docs/hf-engine.md``).
    """

    max_new_tokens: int | None = 128
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    stop_regex: tuple[str, ...] = ()
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    n: int = 1
    beam_width: int | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stream_interval: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    sampling_seed: int | None = None
    custom_params: Mapping[str, Any] | None = None
    watermark: Mapping[str, Any] | None = None

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature below 1e-6 or ``top_k`` 1 (SGLang's rule)."""
        return self.temperature < _SAMPLING_EPS or self.top_k == 1

    @property
    def grammar(self) -> tuple[str, str] | None:
        """``(field, source)`` of the constraint (at most one of the four is set)."""
        for name in _GRAMMARS:
            value = getattr(self, name)
            if value is not None:
                return name, value
        return None

    @property
    def penalized(self) -> bool:
        """Whether any of the three penalties is away from its neutral value."""
        return bool(
            self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0
        )

    def to_wire(self) -> dict[str, Any]:
        """A JSON-able dict that :meth:`from_wire` turns back into the same params."""
        out = attrs.asdict(self, recurse=False)
        out["logit_bias"] = [list(p) for p in self.logit_bias]
        return out

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> SamplingParams:
        """The params :meth:`to_wire` described."""
        kw = dict(wire)
        for key in ("stop", "stop_token_ids", "stop_regex"):
            kw[key] = tuple(kw[key])
        kw["logit_bias"] = tuple((int(t), float(b)) for t, b in kw["logit_bias"])
        return cls(**kw)


def sampling_param_names() -> tuple[str, ...]:
    """The sampling parameter names ``/generate`` accepts (SGLang's API fields)."""
    return tuple(f.name for f in attrs.fields(SamplingParams))


#: SGLang's ``--sampling-mask-max-tokens`` default: the largest sampling support returned.
SAMPLING_MASK_MAX_TOKENS = 4096


@attrs.frozen
class LogprobParams:
    """What log-probabilities a request wants back (and SGLang's sampling mask: the tokens in
    each draw's sampling support, with ``sampling_logprobs_mode`` ``selected`` or
    ``support``)."""

    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: tuple[int, ...] | None = None
    return_text_in_logprobs: bool = False
    return_sampling_mask: bool = False
    sampling_logprobs_mode: str = "selected"


@attrs.frozen
class GenerateInput:
    """One parsed ``/generate`` request.

    ``prompts`` has one entry unless the body was a batch; ``sampling`` and ``logprobs`` have
    one entry per prompt (SGLang takes each log-prob field as one value for all or a list
    with one per prompt). Every prompt runs ``n`` samples (SGLang requires the same ``n``).
    ``explicit_max`` says, per prompt, whether ``max_new_tokens`` was given (SGLang checks
    prompt + ``max_new_tokens`` against the context only then). ``processors``: each prompt's
    ``custom_logit_processor`` (one string for all, or a list with one per prompt).
    """

    prompts: tuple[str | tuple[int, ...], ...]
    batch: bool
    sampling: tuple[SamplingParams, ...]
    logprobs: tuple[LogprobParams, ...]
    stream: bool
    rids: tuple[str | None, ...]
    explicit_max: tuple[bool, ...] = ()
    #: each prompt's ``custom_logit_processor`` (serialized; loaded by the engine if enabled)
    processors: tuple[str | None, ...] = ()

    @property
    def n(self) -> int:
        """Samples per prompt."""
        return self.sampling[0].n


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
                f"{field}[{i}]",
                f"out-of-vocabulary token id {t}; valid range is [0, {vocab_size})",
            )
        out.append(t)
    return tuple(out)


def _strings(value: Any, field: str, limit: int) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise BadRequest(field, "must be a non-empty string or a list of non-empty strings")
    if len(items) > limit:
        raise BadRequest(field, f"at most {limit} are allowed, got {len(items)}")
    return tuple(items)


def _json_safe(value: Any, field: str, depth: int = 0) -> Any:
    scalar = (type(None), bool, int, float, str)
    if isinstance(value, scalar):
        return value
    if depth == 0 and isinstance(value, Mapping):
        return {str(k): _json_safe(v, f"{field}.{k}", 1) for k, v in value.items()}
    if depth == 1 and isinstance(value, list | Mapping):
        items = value.values() if isinstance(value, Mapping) else value
        if all(isinstance(v, scalar) for v in items):
            return value
    raise BadRequest(field, "must hold JSON scalars, or lists / objects of scalars")


# -- sampling params -------------------------------------------------------------------------

_SAMPLING_HINTS = {
    "seed": "SGLang's name is sampling_seed (the OpenAI endpoints take seed)",
    "max_tokens": "SGLang's name is max_new_tokens",
    "min_tokens": "SGLang's name is min_new_tokens",
}


def parse_sampling_params(
    raw: Any, *, vocab_size: int, field: str = "sampling_params"
) -> SamplingParams:
    """Validate SGLang sampling parameters (``SamplingParams.verify``'s rules).

    ``null`` for a field means its default, as in SGLang. :raises BadRequest: naming the field.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise BadRequest(field, f"must be an object, got {type(raw).__name__}")
    known = set(sampling_param_names())
    kw: dict[str, Any] = {}
    for key, value in raw.items():
        f = f"{field}.{key}" if field else str(key)
        if key not in known:
            if key in SGLANG_INTERNAL_SAMPLING_FIELDS:
                raise BadRequest(f, "is internal to SGLang, not a sampling parameter")
            hint = _SAMPLING_HINTS.get(key)
            raise BadRequest(f, "unknown sampling parameter" + (f"; {hint}" if hint else ""))
        if value is None:
            continue
        if key in ("max_new_tokens", "min_new_tokens"):
            kw[key] = _int(value, f, minimum=0)
        elif key == "stop":
            kw[key] = _strings(value, f, MAX_STOP_COUNT)
        elif key == "stop_regex":
            patterns = _strings(value, f, MAX_STOP_REGEX_COUNT)
            for i, p in enumerate(patterns):
                where = f if isinstance(value, str) else f"{f}[{i}]"
                if len(p.encode()) > MAX_STOP_REGEX_LEN:
                    raise BadRequest(where, f"is over the {MAX_STOP_REGEX_LEN}-byte limit")
                try:
                    re.compile(p)
                except re.error as exc:
                    raise BadRequest(where, f"is not a valid regular expression: {exc}") from exc
            kw[key] = patterns
        elif key == "stop_token_ids":
            kw[key] = tuple(sorted(set(_token_ids(value, f, vocab_size))))
        elif key == "temperature":
            kw[key] = _float(value, f, lo=0.0, hi=math.inf)
        elif key == "top_p":
            kw[key] = _float(value, f, lo=0.0, hi=1.0, lo_open=True)
        elif key == "min_p":
            kw[key] = _float(value, f, lo=0.0, hi=1.0)
        elif key == "top_k":
            k = _int(value, f)
            if k == 0 or k < -1:
                raise BadRequest(f, f"must be -1 (disable) or at least 1, got {k}")
            kw[key] = k
        elif key in ("frequency_penalty", "presence_penalty"):
            kw[key] = _float(value, f, lo=-2.0, hi=2.0)
        elif key == "repetition_penalty":
            kw[key] = _float(value, f, lo=0.0, hi=2.0, lo_open=True)
        elif key == "n":
            kw[key] = _int(value, f, minimum=1)
        elif key == "beam_width":
            _int(value, f, minimum=1)
            raise BadRequest(
                f, "beam search is not supported by the hf engine; use n samples instead"
            )
        elif key in _GRAMMARS:
            if not isinstance(value, str):
                raise BadRequest(f, f"must be a string, got {type(value).__name__}")
            if value:  # SGLang: an empty constraint means unset
                kw[key] = value
        elif key in (
            "ignore_eos",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "no_stop_trim",
        ):
            kw[key] = _bool(value, f)
        elif key == "stream_interval":
            kw[key] = _int(value, f, minimum=1)
        elif key == "logit_bias":
            if not isinstance(value, Mapping):
                raise BadRequest(f, "must be an object {token_id: bias}")
            bias: dict[int, float] = {}
            for tid, b in value.items():
                try:
                    t = int(tid)
                except (TypeError, ValueError):
                    raise BadRequest(f, f"key {tid!r} is not a token id") from None
                if not 0 <= t < vocab_size:
                    raise BadRequest(f, f"keys must be in [0, {vocab_size - 1}], got {tid!r}")
                bias[t] = _float(b, f"{f}.{tid}", lo=-math.inf, hi=math.inf)
            kw[key] = tuple(sorted(bias.items()))
        elif key == "sampling_seed":
            seed = _int(value, f)
            if not -(2**63) <= seed <= 2**63 - 1:
                raise BadRequest(f, f"must be in [-2**63, 2**63 - 1], got {seed}")
            kw[key] = seed
        elif key == "custom_params":
            if not isinstance(value, Mapping):
                raise BadRequest(f, "must be an object")
            kw[key] = _json_safe(value, f)
        elif key == "watermark":
            if not isinstance(value, Mapping):
                raise BadRequest(f, "must be an object")
            unknown = set(value) - {"enabled", "key", "context_window"}
            if unknown:
                raise BadRequest(f, f"unknown fields {sorted(unknown)}")
            if value.get("enabled") is not False:
                raise BadRequest(
                    f, "watermarking needs a server watermark key; the hf engine has none"
                )
            kw[key] = dict(value)
    prefix = f"{field}." if field else ""
    grammars = [g for g in _GRAMMARS if g in kw]
    if len(grammars) > 1:
        raise BadRequest(
            f"{prefix}{grammars[1]}",
            "only one of json_schema, regex, ebnf or structural_tag can be set",
        )
    if "json_schema" in kw and kw["json_schema"] != "$$ANY$$":
        try:
            json.loads(kw["json_schema"])
        except ValueError as exc:
            raise BadRequest(f"{prefix}json_schema", f"is not valid JSON: {exc}") from exc
    params = SamplingParams(**kw)
    if params.max_new_tokens is not None and params.min_new_tokens > params.max_new_tokens:
        raise BadRequest(
            f"{prefix}min_new_tokens",
            f"must be in [0, max_new_tokens({params.max_new_tokens})], got {params.min_new_tokens}",
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
    if isinstance(sp_raw, list):
        if not batch or len(sp_raw) != len(prompts):
            raise BadRequest(
                "sampling_params",
                f"a list needs a batch of prompts and one object per prompt ({len(prompts)})",
            )
        sampling = tuple(
            parse_sampling_params(sp, vocab_size=vocab_size, field=f"sampling_params[{i}]")
            for i, sp in enumerate(sp_raw)
        )
        if len({s.n for s in sampling}) > 1:
            raise BadRequest("sampling_params", "n must be the same for every prompt")
    else:
        one = parse_sampling_params(sp_raw, vocab_size=vocab_size)
        sampling = (one,) * len(prompts)

    logprobs = _logprob_params(body, prompts, batch, vocab_size)
    explicit = (
        tuple(isinstance(sp, Mapping) and sp.get("max_new_tokens") is not None for sp in sp_raw)
        if isinstance(sp_raw, list)
        else (isinstance(sp_raw, Mapping) and sp_raw.get("max_new_tokens") is not None,)
        * len(prompts)
    )

    st = body.get("stream")
    stream = False if st is None else _bool(st, "stream")

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
        named: tuple[str, ...] = tuple(rid)
        rids = named
        duplicates = sorted({r for r in named if named.count(r) > 1})
        if duplicates:
            raise BadRequest(
                "rid", f"Duplicate request IDs detected within the request: {duplicates}"
            )
    else:
        if not isinstance(rid, str) or not rid:
            raise BadRequest("rid", "must be a non-empty string")
        rids = (rid,)
    for name, what in (
        ("image_data", "the hf engine serves text-only models"),
        ("video_data", "the hf engine serves text-only models"),
        ("audio_data", "the hf engine serves text-only models"),
        ("input_embeds", "the hf engine takes text or input_ids"),
        ("lora_path", "LoRA adapters are not supported by the hf engine"),
    ):
        if body.get(name) is not None:
            raise BadRequest(name, what)
    processors = _processors(body.get("custom_logit_processor"), len(prompts), batch)
    return GenerateInput(prompts, batch, sampling, logprobs, stream, rids, explicit, processors)


def _processors(value: Any, count: int, batch: bool) -> tuple[str | None, ...]:
    """``custom_logit_processor`` as one (serialized) processor or ``None`` per prompt."""
    if value is None or isinstance(value, str):
        return (value,) * count
    if (
        batch
        and isinstance(value, list)
        and len(value) == count
        and all(v is None or isinstance(v, str) for v in value)
    ):
        return tuple(value)
    raise BadRequest(
        "custom_logit_processor",
        "must be the string CustomLogitProcessor.to_str() returns"
        + (f", or a list of {count} such strings or nulls for a batch" if batch else ""),
    )


def _per_prompt(body: Mapping[str, Any], key: str, count: int, batch: bool) -> list[Any]:
    """A log-prob field as one value per prompt: a list (one per prompt of a batch) or one
    value for all."""
    value = body.get(key)
    if batch and isinstance(value, list) and key != "token_ids_logprob":
        if len(value) != count:
            raise BadRequest(key, f"a list needs one value per prompt ({count})")
        return list(value)
    nested = isinstance(value, list) and all(isinstance(v, list) for v in value)
    if key == "token_ids_logprob" and isinstance(value, list) and value and nested:
        if not batch or len(value) != count:
            raise BadRequest(key, f"a list of lists needs a batch, one list per prompt ({count})")
        return list(value)
    return [value] * count


def _logprob_params(
    body: Mapping[str, Any],
    prompts: tuple[str | tuple[int, ...], ...],
    batch: bool,
    vocab_size: int,
) -> tuple[LogprobParams, ...]:
    n = len(prompts)
    columns = {
        key: _per_prompt(body, key, n, batch)
        for key in (
            "return_logprob",
            "logprob_start_len",
            "top_logprobs_num",
            "token_ids_logprob",
            "return_sampling_mask",
            "sampling_logprobs_mode",
        )
    }
    rtl = body.get("return_text_in_logprobs")
    text_in = False if rtl is None else _bool(rtl, "return_text_in_logprobs")
    out = []
    for i, p in enumerate(prompts):
        at = f"[{i}]" if batch and n > 1 else ""

        def value(key: str, i: int = i) -> Any:
            return columns[key][i]

        rl = value("return_logprob")
        return_logprob = False if rl is None else _bool(rl, f"return_logprob{at}")
        lsl = value("logprob_start_len")
        start = -1 if lsl is None else _int(lsl, f"logprob_start_len{at}", minimum=-1)
        tln = value("top_logprobs_num")
        top = 0 if tln is None else _int(tln, f"top_logprobs_num{at}", minimum=0)
        if top > vocab_size:
            raise BadRequest("top_logprobs_num", f"must be <= the vocabulary size {vocab_size}")
        til = value("token_ids_logprob")
        token_ids = None if til is None else _logprob_ids(til, f"token_ids_logprob{at}", vocab_size)
        if return_logprob and not isinstance(p, str) and start >= len(p):
            where = f"input_ids[{i}]" if batch else "input_ids"
            raise BadRequest(
                "logprob_start_len", f"must be < the prompt length ({len(p)} tokens of {where})"
            )
        rsm = value("return_sampling_mask")
        mask = False if rsm is None else _bool(rsm, f"return_sampling_mask{at}")
        mode = value("sampling_logprobs_mode")
        if mode is not None and not mask:
            raise BadRequest(
                "sampling_logprobs_mode",
                "sampling_logprobs_mode can only be set when return_sampling_mask=true.",
            )
        if mode not in (None, "selected", "support"):
            raise BadRequest(
                "sampling_logprobs_mode", f"must be 'selected' or 'support', got {mode!r}"
            )
        # SGLang ignores top_logprobs_num and token_ids_logprob without return_logprob.
        out.append(
            LogprobParams(return_logprob, start, top, token_ids, text_in, mask, mode or "selected")
        )
    return tuple(out)


def _logprob_ids(value: Any, field: str, vocab_size: int) -> tuple[int, ...]:
    """``token_ids_logprob`` with SGLang's message for an id outside the vocabulary."""
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise BadRequest(field, "token_ids_logprob must be a flat list of integers.")
    for t in value:
        if not 0 <= t < vocab_size:
            raise BadRequest(
                field,
                f"token_ids_logprob contains out-of-vocabulary token id {t}; "
                f"valid range is [0, {vocab_size}).",
            )
    return tuple(value)


#: SGLang's answer to a custom logit processor on a server started without the flag.
CUSTOM_LOGIT_PROCESSOR_REFUSED = (
    "The server is not configured to enable custom logit processor. Please set "
    "`--enable-custom-logit-processor` to enable this feature."
)


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
