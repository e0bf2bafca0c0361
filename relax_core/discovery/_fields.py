"""Field checks of schema 2 (see :mod:`relax_core.discovery.schema`): each raises
:class:`~relax_core.errors.SnapshotError` naming the JSON field, and the path helpers that
make those names (``models.math.engines[0].base_url``)."""

from __future__ import annotations

import contextlib
import enum
import json
import re
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar
from urllib.parse import urlsplit

from relax_core.errors import SnapshotError

_PLAIN_SEGMENT = re.compile(r"^[A-Za-z0-9_-]+$")
# Model and engine ids: no whitespace, no control characters ("math/replica-0" is fine).
_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:/@+-]{0,255}$")

T = TypeVar("T")
E = TypeVar("E", bound=enum.Enum)

Validator = Callable[[Any, Any, Any], None]


def segment(key: str) -> str:
    """One path segment for a mapping key: ``.math`` or ``["odd key"]``."""
    return f".{key}" if _PLAIN_SEGMENT.match(key) else f"[{json.dumps(key)}]"


def join_path(prefix: str, path: str) -> str:
    """Join a path prefix and a relative path (``models.m`` + ``engines[0].x``)."""
    if not prefix:
        return path
    if not path:
        return prefix
    return prefix + path if path.startswith("[") else f"{prefix}.{path}"


def to_enum(kind: type[E], field: str, value: object) -> E:
    """``value`` as a member of ``kind`` (by value), or an error listing the allowed values."""
    if isinstance(value, kind):
        return value
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return kind(value)
    raise SnapshotError(
        field, f"unknown {field} {value!r}; expected one of {', '.join(m.value for m in kind)}"
    )


def check_url(field: str, value: object) -> None:
    """``value`` is null or an http(s) URL with a host, no credentials, query or port 0."""
    if value is None:
        return
    if not isinstance(value, str):
        raise SnapshotError(field, f"must be a URL string or null, got {type(value).__name__}")
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError as exc:
        raise SnapshotError(field, f"{value!r} is not a valid URL ({exc})") from None
    if parts.scheme not in ("http", "https"):
        raise SnapshotError(
            field, f"{value!r} must be an http:// or https:// URL (scheme {parts.scheme!r})"
        )
    if not parts.hostname:
        raise SnapshotError(field, f"{value!r} has no host; publish http://host:port")
    if parts.username is not None or parts.password is not None:
        raise SnapshotError(field, f"{value!r} must not carry credentials")
    if parts.query or parts.fragment:
        raise SnapshotError(field, f"{value!r} must not carry a query or fragment")
    if port is not None and port == 0:
        raise SnapshotError(field, f"{value!r} has port 0; publish the bound port")


def check_str(field: str, value: object) -> str:
    """``value`` is a non-empty string; return it."""
    if not isinstance(value, str):
        raise SnapshotError(field, f"must be a string, got {type(value).__name__}")
    if not value:
        raise SnapshotError(field, "must not be empty")
    return value


def check_id(field: str, value: object, what: str) -> str:
    """``value`` is a model or engine id (up to 256 plain characters); return it."""
    text = check_str(field, value)
    if not _ID.match(text):
        raise SnapshotError(
            field,
            f"{what} {text!r} is not valid: up to 256 characters, starting with a letter, digit "
            "or '_', then letters, digits and _ . : / @ + -",
        )
    return text


def check_int(field: str, value: object) -> int:
    """``value`` is an integer >= 0 (not a bool); return it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise SnapshotError(field, f"must be an integer, got {type(value).__name__}")
    if value < 0:
        raise SnapshotError(field, f"must be >= 0, got {value}")
    return value


def validator(check: Callable[..., object], field: str, *args: Any) -> Validator:
    """An attrs validator running ``check(field, value, *args)``."""

    def run(_i: Any, _a: Any, value: Any) -> None:
        check(field, value, *args)

    return run


def check_bool(field: str, value: object) -> bool:
    """``value`` is true or false; return it."""
    if not isinstance(value, bool):
        raise SnapshotError(field, f"must be true or false, got {value!r}")
    return value


def frozen_map(value: object) -> Mapping[str, Any]:
    """A read-only copy of a mapping (a caller's dict must not change a frozen record)."""
    if not isinstance(value, Mapping):
        # The validator reports the field; keep the bad value for it to name.
        return value  # type: ignore[return-value]
    return types.MappingProxyType(dict(value))


def to_tuple(value: object) -> tuple[Any, ...]:
    """A list of engines as a tuple (a string or mapping is refused)."""
    if isinstance(value, tuple):
        return value
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise SnapshotError("engines", f"must be a list of engines, got {type(value).__name__}")
    return tuple(value)


def child_path(prefix: str, key: str) -> str:
    """The path of ``key`` under ``prefix`` (``models`` + ``math`` → ``models.math``)."""
    return join_path(prefix, segment(key).removeprefix("."))


def object_fields(
    data: object, path: str, names: tuple[str, ...], optional: tuple[str, ...] = ()
) -> Mapping[str, Any]:
    """``data`` as a JSON object with exactly the fields ``names``, and maybe some of
    ``optional`` (path-named errors)."""
    if not isinstance(data, Mapping):
        raise SnapshotError(path, f"must be a JSON object, got {type(data).__name__}")
    for key in data:
        if key not in names and key not in optional:
            raise SnapshotError(
                child_path(path, str(key)),
                f"unknown field {key!r}; schema 2 allows here: {', '.join(names + optional)}",
            )
    for name in names:
        if name not in data:
            raise SnapshotError(child_path(path, name), "required field is missing")
    return data


def build_at(path: str, factory: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``factory(*args, **kwargs)``, with any :class:`SnapshotError` re-rooted at ``path``."""
    try:
        return factory(*args, **kwargs)
    except SnapshotError as exc:
        raise SnapshotError(join_path(path, exc.path), exc.message) from None
