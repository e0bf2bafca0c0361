"""What a client or a gateway reads every request body for: JSON, and the minimum weight version
it asks for, so a bad body is the same error whichever way a request comes in."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from relax_core.errors import InvalidRequestError

#: The body field a request requires a minimum weight version with (or the header
#: ``X-Relax-Min-Weight-Version``).
MIN_WEIGHT_VERSION_FIELD = "min_weight_version"


def decode_json_body(raw: bytes) -> Any:
    """A request body decoded as JSON: the one check for a body that is not JSON.

    :raises InvalidRequestError: the body is empty or not valid JSON."""
    if not raw:
        raise InvalidRequestError("the request body is empty; send a JSON object")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from None


def weight_version(body: Mapping[str, Any], header: str | None) -> str | None:
    """The minimum weight version a request requires: its body's ``min_weight_version`` (an
    integer taken as its digits), else ``header`` (``X-Relax-Min-Weight-Version``) stripped,
    else ``None``.

    :raises InvalidRequestError: the field is not a non-empty string or a non-negative
        integer, or the header is empty."""
    value = body.get(MIN_WEIGHT_VERSION_FIELD)
    if value is None and header is not None and not header.strip():
        raise InvalidRequestError(
            "header X-Relax-Min-Weight-Version is empty; give a weight version (e.g. 12) or "
            "leave the header out",
            field="X-Relax-Min-Weight-Version",
        )
    if value is None:
        return None if header is None else header.strip()
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return str(value)
    if isinstance(value, str) and value:
        return value
    raise InvalidRequestError(
        f"request field {MIN_WEIGHT_VERSION_FIELD!r} must be a non-empty string or a "
        f'non-negative integer (a weight version, e.g. "12"), got {value!r}',
        field=MIN_WEIGHT_VERSION_FIELD,
    )
