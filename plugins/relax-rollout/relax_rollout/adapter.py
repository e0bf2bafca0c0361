"""The rollout gateway adapter: raw generation and chat, passed through.

Rollout requests are the policy's own SGLang requests; the gateway only validates their shape,
picks the model (router or DIRECT head) and relays bytes. What the adapter adds is a check that
a batched ``/generate`` (a list of prompts) is well formed, since rollout sends batches.
"""

from __future__ import annotations

from typing import Any

from relax_core import InvalidRequestError, RoleAdapter, check_generate_payload

__all__ = ["RolloutAdapter"]


class RolloutAdapter(RoleAdapter):
    """Raw ``/generate`` (single or batched ``text``/``input_ids``) and chat pass through."""

    def check_generate(self, payload: object) -> dict[str, Any]:
        if isinstance(payload, dict):
            text, ids = payload.get("text"), payload.get("input_ids")
            if isinstance(text, list) or (
                isinstance(ids, list) and ids and isinstance(ids[0], list)
            ):
                return _check_batch(payload)
        return check_generate_payload(payload)


def _check_batch(payload: dict[str, Any]) -> dict[str, Any]:
    """A batched body: ``text`` is a list of strings or ``input_ids`` a list of id lists."""
    text, ids = payload.get("text"), payload.get("input_ids")
    if text is not None and ids is not None:
        raise InvalidRequestError("send 'text' or 'input_ids', not both", field="input_ids")
    items = text if text is not None else ids
    field = "text" if text is not None else "input_ids"
    if not isinstance(items, list) or not items:
        raise InvalidRequestError(f"a batched '{field}' must be a non-empty list", field=field)
    for i, item in enumerate(items):
        probe: dict[str, Any] = {field: item}
        try:
            check_generate_payload(probe)
        except InvalidRequestError as exc:
            raise InvalidRequestError(
                f"batch item {field}[{i}]: {exc.message}", field=f"{field}[{i}]"
            ) from None
    if payload.get("stream"):
        raise InvalidRequestError(
            "a batched /generate cannot be streamed; send one prompt per streamed request",
            field="stream",
        )
    rest = {k: v for k, v in payload.items() if k != field}
    rest["text"] = "x"  # checked above; validate the remaining common fields
    check_generate_payload(rest)
    return payload
