"""Which headers a hop forwards: the hop-by-hop rule of RFC 9110 section 7.6.1, the one rule of
the client, the gateways and the engines' admission servers."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

#: The header carrying a request's id end to end (kept by every hop).
REQUEST_ID_HEADER = "X-Request-ID"
#: Set by an admission server on its 502 when the engine behind it could not be connected to:
#: nothing reached the engine, so the caller may send the request to another replica.
NOT_SENT_HEADER = "X-Relax-Not-Sent"
#: The affinity header sglang-router / smg hash on (``consistent_hashing``); kept by every hop.
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"

#: Headers that describe one connection, not the message; a proxy never forwards them.
HOP_BY_HOP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
# Recomputed for the new message (accept-encoding: left out so that bytes forward as they are).
_RECOMPUTED_REQUEST_HEADERS = frozenset({"host", "content-length", "accept-encoding"})
_RECOMPUTED_RESPONSE_HEADERS = frozenset({"content-length"})


_DROP_REQUEST = HOP_BY_HOP_HEADERS | _RECOMPUTED_REQUEST_HEADERS
_DROP_RESPONSE = HOP_BY_HOP_HEADERS | _RECOMPUTED_RESPONSE_HEADERS
_DROP_RESPONSE_RAW = frozenset(name.encode() for name in _DROP_RESPONSE)


def forward_headers(
    headers: Mapping[str, str] | Iterable[tuple[str, str]], *, response: bool = False
) -> dict[str, str]:
    """Copy ``headers`` without hop-by-hop headers (and those named by ``Connection``) and
    those the new message recomputes (a request's ``Host``, ``Content-Length`` and
    ``Accept-Encoding``; a response's ``Content-Length``). Names keep their case."""
    return _split(headers, _DROP_RESPONSE if response else _DROP_REQUEST)[0]


def _split(
    headers: Mapping[str, str] | Iterable[tuple[str, str]], dropped: frozenset[str]
) -> tuple[dict[str, str], dict[str, str]]:
    """One pass over ``headers``: ``(kept, taken)``, those whose lower-case name is not in
    ``dropped`` and the others by lower-case name; those ``Connection`` names are in neither."""
    items = headers.items() if isinstance(headers, Mapping) else headers
    kept: dict[str, str] = {}
    taken: dict[str, str] = {}
    named: set[str] | None = None
    for name, value in items:
        low = name.lower()
        if low not in dropped:
            kept[name] = value
        elif low == "connection":
            named = (named or set()) | {t.strip().lower() for t in value.split(",")}
        else:
            taken[low] = value
    if named:
        kept = {k: v for k, v in kept.items() if k.lower() not in named}
        taken = {k: v for k, v in taken.items() if k not in named}
    return kept, taken


_TAKEN_FROM_CALLER = _DROP_REQUEST | {
    "x-request-id",
    "x-smg-routing-key",
    "content-type",
    "x-relax-min-weight-version",
}


def caller_headers(
    headers: Mapping[str, str] | Iterable[tuple[str, str]],
) -> tuple[dict[str, str], str | None, str | None, str | None]:
    """Split a gateway caller's request headers:
    ``(forwarded, request_id, routing_key, min_weight_version)``.

    ``forwarded`` is :func:`forward_headers` of them without ``Content-Type`` and the three
    headers whose values (``None`` when absent) are the others; one pass (hot path)."""
    out, taken = _split(headers, _TAKEN_FROM_CALLER)
    return (
        out,
        taken.get("x-request-id"),
        taken.get("x-smg-routing-key"),
        taken.get("x-relax-min-weight-version"),
    )
