"""Custom logit processors: SGLang's ``custom_logit_processor``, only behind
``--enable-custom-logit-processor``.

A request may carry serialized Python code that rewrites the logits of its rows before they are
sampled. The wire format and calling convention are SGLang's: ``custom_logit_processor`` is
the JSON ``{"callable": HEX}`` where ``HEX`` is ``dill.dumps(cls).hex()`` (what SGLang's
``CustomLogitProcessor.to_str()`` writes), the engine builds ``cls()`` once per distinct string,
and at every sampled token calls ``processor(logits, custom_param_list)`` on the rows of the
batch that carry that processor: ``logits`` is a float32 ``[rows, vocab]`` tensor after logit
bias, penalties, ``min_new_tokens`` and grammar masks (SGLang's order: the processor sees what
the sampler would), ``custom_param_list`` one entry per row — the request's
``sampling_params.custom_params`` with ``"__req__"`` added (a view with ``rid``,
``origin_input_ids`` and ``output_ids``, the attributes SGLang's own processors read), or
``None`` when the request gave no ``custom_params`` object. It returns a tensor of the same
shape, written back row for row.

Loading runs code the client sent, so a server started without the flag refuses the field with
SGLang's message (:data:`~relax_hf.protocol.CUSTOM_LOGIT_PROCESSOR_REFUSED`) and loads nothing.
A processor written as SGLang documents it subclasses SGLang's ``CustomLogitProcessor``, which
``dill`` pickles by reference: loading it imports ``sglang.srt.sampling.custom_logit_processor``
(pure Python: dill, orjson, torch). Where SGLang is installed without its GPU runtime (its package
``__init__`` imports triton), that module is imported from the installed files with the
package's ``__init__`` left out (:func:`_sglang_importable`), so SGLang's own processors
(``DisallowedTokensLogitsProcessor``, the thinking-budget ones) load on a CPU host too.
A processor that cannot be loaded is a 400 naming the field; one that raises, or returns a
tensor of another shape, while a request runs ends that request with an ``abort`` finish
reason quoting the error (the rest of the batch goes on).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs
import torch

from relax_hf.protocol import SamplingParams

__all__ = ["ProcessorRow", "RequestView", "apply_processors", "load_processor"]

#: A loaded processor: ``processor(logits, custom_param_list) -> logits``.
Processor = Callable[[torch.Tensor, list[dict[str, Any] | None]], torch.Tensor]


class ProcessorRow(Protocol):
    """What :func:`apply_processors` reads from a sequence (:class:`relax_hf.batch.Sequence`)."""

    rid: str
    prompt_ids: list[int]
    output_ids: list[int]
    sampling: SamplingParams
    processor: Processor | None
    processor_key: str | None
    processor_error: str | None


@attrs.frozen
class RequestView:
    """``custom_params["__req__"]``: the request, as SGLang's processors read it (its id, its
    prompt's ids and the ids generated so far, live)."""

    rid: str
    origin_input_ids: list[int]
    output_ids: list[int]


def load_processor(serialized: Any, field: str = "custom_logit_processor") -> Processor:
    """The processor ``serialized`` (SGLang's ``{"callable": HEX}`` string) names, built once
    per distinct string.

    :raises ValueError: it is not such a string, ``dill`` is not installed, or the code does
        not load (the error quoted; the caller answers 400 naming ``field``).
    """
    if not isinstance(serialized, str):
        raise ValueError(
            f"{field}: must be the string CustomLogitProcessor.to_str() returns, got "
            f"{type(serialized).__name__}"
        )
    return _load(serialized, field)


@functools.lru_cache(maxsize=64)
def _load(serialized: str, field: str) -> Processor:
    try:
        data = json.loads(serialized)
        payload = bytes.fromhex(data["callable"])
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(
            f'{field}: not a serialized processor (SGLang\'s {{"callable": HEX}} JSON): {exc}'
        ) from None
    try:
        import dill
    except ImportError:
        raise ValueError(
            f"{field}: loading a processor needs dill on the engine's host: pip install "
            "'relax-hf[custom-logit-processor]'"
        ) from None
    _sglang_importable()
    try:
        loaded = dill.loads(payload)
        processor = loaded() if isinstance(loaded, type) else loaded
    except Exception as exc:
        raise ValueError(
            f"{field}: the processor does not load here: {type(exc).__name__}: {exc}"
        ) from None
    if not callable(processor):
        raise ValueError(f"{field}: {type(processor).__name__} is not callable")
    return processor  # type: ignore[no-any-return]


def _sglang_importable() -> None:
    """Make SGLang's pure-Python modules importable where its package ``__init__`` is not
    (it imports the GPU runtime): register the installed package without running it."""
    if "sglang" in sys.modules:
        return
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return  # not installed: a processor that needs it fails to load, quoting the import
    try:
        importlib.import_module("sglang")
    except ImportError:
        package = types.ModuleType("sglang")
        package.__path__ = list(spec.submodule_search_locations)
        package.__spec__ = spec
        sys.modules["sglang"] = package


def _params(s: ProcessorRow) -> dict[str, Any] | None:
    custom = s.sampling.custom_params
    if not isinstance(custom, dict):  # SGLang adds __req__ only to a dict
        return None
    return {**custom, "__req__": RequestView(s.rid, s.prompt_ids, s.output_ids)}


def apply_processors(z: torch.Tensor, rows: Sequence[ProcessorRow]) -> torch.Tensor:
    """``z`` with each processor's rows rewritten (in place: ``z`` is the sampler's own
    float32 copy). A processor that raises or answers another shape leaves its rows as they
    were and sets ``processor_error`` on them (the caller aborts those requests)."""
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        if r.processor is not None and r.processor_key is not None:
            groups.setdefault(r.processor_key, []).append(i)
    for members in groups.values():
        processor = rows[members[0]].processor
        assert processor is not None
        idx = torch.tensor(members, device=z.device)
        selected = z.index_select(0, idx)
        try:
            result = processor(selected, [_params(rows[i]) for i in members])
            if not isinstance(result, torch.Tensor) or result.shape != selected.shape:
                got = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result)
                raise ValueError(
                    f"returned {got}; a processor returns logits of the shape it was given "
                    f"({tuple(selected.shape)})"
                )
        except Exception as exc:
            for i in members:
                rows[
                    i
                ].processor_error = f"custom_logit_processor failed: {type(exc).__name__}: {exc}"
            continue
        z.index_copy_(0, idx, result.to(z.dtype))
    return z
