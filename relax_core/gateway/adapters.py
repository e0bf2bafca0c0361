"""Role adapters: how a role's gateway turns a caller's request into an engine request.

A role plugin's :class:`~relax_core.records.RoleSpec` ``gateway_adapter`` returns a
:class:`RoleAdapter`: the gateway validates a request's common shape, resolves the model, then
asks the adapter for the payload to forward. Light on imports (no aiohttp, no Starlette) so a
role plugin can import it without the gateway."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs

from relax_core.errors import InvalidRequestError

__all__ = [
    "AdaptContext",
    "Adapted",
    "RoleAdapter",
    "check_chat_payload",
    "check_generate_payload",
    "check_messages",
]


@attrs.frozen
class AdaptContext:
    """What an adapter knows about the request once the model is chosen.

    ``model``: the logical model id the request resolved to (``None`` unless
    :meth:`RoleAdapter.needs_model`). ``model_path``: its local checkpoint directory (``None``
    when unknown). ``served_model_name``: the engine's name for it. ``stream``: whether the
    caller asked to stream."""

    role: str
    model: str | None
    model_path: str | None
    served_model_name: str | None
    stream: bool


@attrs.frozen
class Adapted:
    """An adapter's answer.

    ``payload``: the JSON object to forward instead of the caller's (``None``: the caller's).
    ``response``: turns the engine's JSON answer into the caller's, for non-streamed answers
    (``None``: relay the engine's bytes unchanged)."""

    payload: dict[str, Any] | None = None
    response: Callable[[Any], Any] | None = None


PASS_THROUGH = Adapted()

_GENERATE_INPUTS = ("text", "input_ids")


def _is_int_list(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    )


def check_generate_payload(
    payload: object, *, extra_inputs: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Check the common shape of a ``/generate`` body and return it as a dict.

    Exactly one input among ``text``, ``input_ids`` and ``extra_inputs`` (genrm: ``messages``).

    :raises InvalidRequestError: naming the field and what to send instead."""
    if not isinstance(payload, dict):
        raise InvalidRequestError(
            f"the request body must be a JSON object, got {type(payload).__name__}; "
            'send e.g. {"text": "Hello", "sampling_params": {"max_new_tokens": 8}}'
        )
    inputs = [k for k in (*_GENERATE_INPUTS, *extra_inputs) if payload.get(k) is not None]
    allowed = ", ".join(repr(k) for k in (*_GENERATE_INPUTS, *extra_inputs))
    if len(inputs) != 1:
        raise InvalidRequestError(
            f"send exactly one input field among {allowed}; got "
            f"{', '.join(repr(k) for k in inputs) if inputs else 'none'}",
            field=inputs[1] if len(inputs) > 1 else None,
        )
    text = payload.get("text")
    if text is not None and not (isinstance(text, str) and text):
        raise _bad("text", "must be a non-empty string")
    ids = payload.get("input_ids")
    if ids is not None and not (_is_int_list(ids) and ids and all(0 <= v < 2**31 for v in ids)):
        raise _bad("input_ids", "must be a non-empty list of non-negative token ids (integers)")
    _check_common(payload)
    sp = payload.get("sampling_params")
    if sp is not None:
        _check_sampling_params(sp)
    _check_kind(payload, "return_logprob", bool, null=False)
    _check_int(payload.get("logprob_start_len"), "logprob_start_len", -1)
    _check_int(payload.get("top_logprobs_num"), "top_logprobs_num", 0)
    _check_kind(payload, "rid", str)
    return payload


def check_chat_payload(payload: object) -> dict[str, Any]:
    """Check the common shape of a chat-completions body and return it as a dict.

    :raises InvalidRequestError: naming the field (``messages``: see :func:`check_messages`)."""
    if not isinstance(payload, dict):
        raise InvalidRequestError(
            f"the request body must be a JSON object with 'messages', got {type(payload).__name__}"
        )
    check_messages(payload.get("messages"))
    _check_common(payload)
    for key in ("max_tokens", "max_completion_tokens", "n"):
        _check_int(payload.get(key), key, 0)
    _check_number(payload.get("temperature"), "temperature", low=0)
    _check_number(payload.get("top_p"), "top_p", low=0, high=1)
    return payload


def check_messages(messages: object, *, field: str = "messages") -> list[dict[str, Any]]:
    """Check a chat ``messages`` list: objects with a string ``role`` and string/list content."""
    if not isinstance(messages, list) or not messages:
        raise _bad(field, 'must be a non-empty list of {"role": ..., "content": ...} objects')
    for i, message in enumerate(messages):
        where = f"{field}[{i}]"
        if not isinstance(message, dict):
            raise _bad(where, "must be an object")
        if not isinstance(message.get("role"), str) or not message["role"]:
            raise _bad(f"{where}.role", "must be a non-empty string (system, user, assistant)")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise _bad(f"{where}.content", "must be a string or a list of content parts")
    return messages


def _bad(field: str, what: str) -> InvalidRequestError:
    """The 400 of one field: ``'field' <what>``."""
    return InvalidRequestError(f"'{field}' {what}", field=field)


def _check_kind(
    table: Mapping[str, Any], key: str, kind: type, *, where: str = "", null: bool = True
) -> None:
    """``table[key]`` is absent, a ``kind`` (``str`` or ``bool``) or, when ``null``, null."""
    if key in table and not isinstance(table[key], kind) and not (null and table[key] is None):
        raise _bad(where + key, "must be a string" if kind is str else "must be true or false")


def _check_common(payload: Mapping[str, Any]) -> None:
    _check_kind(payload, "model", str)
    _check_kind(payload, "route_key", str)
    _check_kind(payload, "stream", bool, null=False)


def _check_int(value: object, field: str, low: int) -> None:
    if value is not None and not (
        isinstance(value, int) and not isinstance(value, bool) and low <= value < 2**31
    ):
        raise _bad(field, f"must be an integer from {low} to {2**31 - 1}")


def _check_number(value: object, field: str, *, low: float, high: float | None = None) -> None:
    if value is None:
        return
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    number = float(value) if ok else 0.0  # type: ignore[arg-type]
    ok = ok and number >= low and (high is None or number <= high)
    if ok and field.endswith("top_p"):
        ok = number > 0
    if not ok:
        bound = f"in (0, {high}]" if field.endswith("top_p") else f">= {low}"
        raise _bad(field, f"must be a number {bound}")


def _check_sampling_params(sp: object) -> None:
    if not isinstance(sp, dict):
        raise _bad("sampling_params", "must be an object")
    for key in ("max_new_tokens", "min_new_tokens", "n"):
        _check_int(sp.get(key), f"sampling_params.{key}", 0)
    _check_int(sp.get("top_k"), "sampling_params.top_k", -1)
    _check_number(sp.get("temperature"), "sampling_params.temperature", low=0)
    _check_number(sp.get("top_p"), "sampling_params.top_p", low=0, high=1)
    for key in ("min_p", "frequency_penalty", "presence_penalty"):
        _check_number(sp.get(key), f"sampling_params.{key}", low=-float("inf"))
    stop = sp.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise _bad("sampling_params.stop", "must be a string or a list of strings")
    _check_kind(sp, "skip_special_tokens", bool, where="sampling_params.")


class RoleAdapter:
    """The default adapter: raw ``/generate`` and chat pass through unchanged.

    Subclass it in a role plugin and override what the role changes. Methods raise
    :class:`InvalidRequestError` for a bad request and never touch the network; they may load a
    tokenizer from local files (:meth:`preload` does so at start). An adapter whose
    :meth:`adapt_generate` does real CPU work (a chat template, tokenizing) sets ``blocking``:
    the gateway runs it in a thread pool (it must be thread-safe) and rechecks the chosen
    replica afterwards."""

    #: Extra ``/generate`` input fields this role accepts (genrm: ``("messages",)``).
    generate_inputs: tuple[str, ...] = ()
    #: Whether :meth:`adapt_generate` (when :meth:`needs_model`) runs in a thread pool.
    blocking: bool = False

    def preload(self, model_paths: Mapping[str, str]) -> None:
        """Load what :meth:`adapt_generate` needs for ``model_paths`` (model id -> local
        checkpoint directory): tokenizers, chat templates. Blocking; called once at start in a
        worker thread (``/health`` is not ready until it returns). Default: nothing."""

    def check_generate(self, payload: object) -> dict[str, Any]:
        """Validate a ``/generate`` body before routing (shape only; no model is known yet)."""
        return check_generate_payload(payload, extra_inputs=self.generate_inputs)

    def needs_model(self, payload: dict[str, Any]) -> bool:
        """Whether :meth:`adapt_generate` needs the resolved model (e.g. to load its tokenizer)."""
        return False

    def adapt_generate(self, payload: dict[str, Any], ctx: AdaptContext) -> Adapted:
        """The engine request for a validated ``/generate`` body (after :meth:`needs_model`)."""
        return PASS_THROUGH

    def check_chat(self, payload: object) -> dict[str, Any]:
        """Validate a chat-completions body before routing."""
        return check_chat_payload(payload)
