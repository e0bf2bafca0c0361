"""How an error message quotes an answer's body: whole up to a bound, never cut inside a
string (exported as :func:`relax_core.quote_body`)."""

from __future__ import annotations

#: How much of an answer's body an error message quotes (characters).
QUOTE_LIMIT = 2000


def quote_body(body: bytes | str, limit: int = QUOTE_LIMIT) -> str:
    """An answer's body as an error message quotes it: whole when it fits ``limit``
    characters, else cut at the last point before ``limit`` outside a JSON string (at the
    limit when that is under half of it, the marker saying so), then ``… (N more bytes)``;
    ``<empty body>`` for an empty one."""
    raw = body.encode("utf-8", "replace") if isinstance(body, str) else bytes(body)
    text = raw.decode("utf-8", "replace").strip()
    if not text:
        return "<empty body>"
    if len(text) <= limit:
        return text
    cut = _outside_strings(text, limit)
    inside = cut < limit // 2
    if inside:
        cut = limit
    head = text[:cut].rstrip()
    rest = len(text.encode("utf-8")) - len(head.encode("utf-8"))
    where = ", cut inside a string" if inside else ""
    return f"{head} … ({rest} more bytes{where})"


def _outside_strings(text: str, limit: int) -> int:
    """The last offset ``<= limit`` of ``text`` that is outside every JSON string."""
    safe, in_string, escaped = 0, False, False
    for i, ch in enumerate(text[:limit]):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                safe = i + 1
        elif ch == '"':
            in_string = True
            safe = i
        else:
            safe = i + 1
    return safe
