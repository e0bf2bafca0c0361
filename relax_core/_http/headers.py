"""Which headers a hop forwards: the hop-by-hop rule of RFC 9110 section 7.6.1.

:func:`forward_headers` drops hop-by-hop headers (and every name ``Connection`` lists) and the
ones the next message recomputes, and keeps everything else, including ``X-Request-ID`` and
``X-SMG-Routing-Key``; :func:`caller_headers` is the same rule for a gateway's incoming request,
in one pass, also taking out the request id and the routing key. The one rule of every hop:
the client and the gateways (:mod:`relax_core.client.client`) and the engines' admission
servers (:mod:`relax_core.engine.admission`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = [
    "HOP_BY_HOP_HEADERS",
    "REQUEST_ID_HEADER",
    "ROUTING_KEY_HEADER",
    "caller_headers",
    "forward_headers",
]

#: The header carrying a request's id end to end (kept by every hop).
REQUEST_ID_HEADER = "X-Request-ID"
#: Set by an admission server on its 502 when the engine behind it could not be connected to:
#: nothing reached the engine, so the caller may send the request to another replica.
NOT_SENT_HEADER = "X-Relax-Not-Sent"
#: A request may require weights of at least this version (see ``RouteResolver``).
MIN_WEIGHT_VERSION_HEADER = "X-Relax-Min-Weight-Version"
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
# Recomputed by aiohttp for the new message (or, for accept-encoding, left out so that an
# upstream answers uncompressed bytes that can be forwarded as they are).
_RECOMPUTED_REQUEST_HEADERS = frozenset({"host", "content-length", "accept-encoding"})
_RECOMPUTED_RESPONSE_HEADERS = frozenset({"content-length"})


_DROP_REQUEST = HOP_BY_HOP_HEADERS | _RECOMPUTED_REQUEST_HEADERS
_DROP_RESPONSE = HOP_BY_HOP_HEADERS | _RECOMPUTED_RESPONSE_HEADERS
_DROP_RESPONSE_RAW = frozenset(name.encode() for name in _DROP_RESPONSE)


def forward_headers(
    headers: Mapping[str, str] | Iterable[tuple[str, str]], *, response: bool = False
) -> dict[str, str]:
    """Copy ``headers`` without hop-by-hop headers (and those named by ``Connection``).

    For a request (``response=False``) ``Host``, ``Content-Length`` and ``Accept-Encoding`` go
    too: the new message recomputes them. For a response ``Content-Length`` goes: the body is
    re-framed by the server that forwards it (bytes are never decoded, so ``Content-Encoding``
    stays true). Names keep their case; lookups elsewhere are case-insensitive.
    """
    return _split(headers, _DROP_RESPONSE if response else _DROP_REQUEST)[0]


def _split(
    headers: Mapping[str, str] | Iterable[tuple[str, str]], dropped: frozenset[str]
) -> tuple[dict[str, str], dict[str, str]]:
    """One pass over ``headers``: ``(kept, taken)``, the headers whose lower-case name is not in
    ``dropped`` (names keep their case) and the others by lower-case name (a repeated one keeps
    its last value). Headers named by ``Connection`` are left out of both."""
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

    ``forwarded`` is :func:`forward_headers` of them without ``X-Request-ID``,
    ``X-SMG-Routing-Key``, ``X-Relax-Min-Weight-Version`` and ``Content-Type`` (the client sets
    or uses those itself); the other three are the caller's values of those headers (``None``
    when absent or named by ``Connection``). One pass: this runs for every request a gateway
    forwards.
    """
    out, taken = _split(headers, _TAKEN_FROM_CALLER)
    return (
        out,
        taken.get("x-request-id"),
        taken.get("x-smg-routing-key"),
        taken.get("x-relax-min-weight-version"),
    )
