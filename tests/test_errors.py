"""One error hierarchy: every error class the core raises on purpose lives in relax_core.errors."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import relax_core
from relax_core import errors


def _core_modules() -> list[str]:
    names = [relax_core.__name__]
    for info in pkgutil.walk_packages(relax_core.__path__, prefix="relax_core."):
        # The private data path keeps its low-level connection failures (they never leave it:
        # they are classified into relax_core.errors); `__main__` runs the CLI when imported.
        if info.name.startswith("relax_core._http") or info.name.endswith("__main__"):
            continue
        names.append(info.name)
    return names


def _defined_classes(path: str | None) -> set[str]:
    if path is None:
        return set()
    tree = ast.parse(Path(path).read_text())
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}


def _error_classes_outside_errors() -> set[str]:
    found = set()
    for name in _core_modules():
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                # Defined in this module's source (exported classes report their package).
                and attr in _defined_classes(module.__file__)
                and not attr.startswith("_")
                and name != errors.__name__
            ):
                found.add(f"{name}.{attr}")
    return found


def test_every_public_error_class_of_the_core_is_defined_in_relax_core_errors() -> None:
    assert _error_classes_outside_errors() == set()


@pytest.mark.parametrize("name", errors.__all__)
def test_every_error_is_a_documented_relax_error_exported_by_the_package(name: str) -> None:
    cls = getattr(errors, name)
    assert issubclass(cls, errors.RelaxError)
    assert cls.__doc__ and len(cls.__doc__.strip()) > 20
    assert getattr(relax_core, name) is cls and name in relax_core.__all__


def test_the_gateways_error_answer_is_a_relax_error_with_its_fields() -> None:
    err = errors.GatewayError(503, "wait", retry_after=2.0, field="model", request_id="r-1")
    assert isinstance(err, errors.RelaxError)
    assert (err.status, err.message, err.retry_after, err.field, err.request_id) == (
        503,
        "wait",
        2.0,
        "model",
        "r-1",
    )


def test_a_bad_request_is_a_400_routing_error_naming_its_field() -> None:
    err = errors.InvalidRequestError("'stream' must be true or false", field="stream")
    assert isinstance(err, errors.RoutingError)
    assert (err.status, err.field, err.retry_after) == (400, "stream", None)


def test_a_stalled_stream_is_a_timeout_naming_the_option_to_raise() -> None:
    first = errors.StreamStalledError(5.0, started=False)
    later = errors.StreamStalledError(60.0, started=True)
    assert isinstance(first, TimeoutError) and isinstance(first, errors.RelaxError)
    assert first.setting == "stream_first_chunk_timeout"
    assert later.setting == "stream_idle_timeout" and str(later) == "no data for 60s"


def test_upstream_errors_keep_the_status_and_the_request_id() -> None:
    unreachable = errors.UpstreamUnreachableError(502, "refused", request_id="r-2")
    status = errors.UpstreamStatusError(
        429, "busy", body=b'{"error": "busy"}', url="http://e/generate", retry_after=3.0
    )
    assert isinstance(unreachable, errors.UpstreamError) and unreachable.request_id == "r-2"
    assert status.json() == {"error": "busy"} and status.retry_after == 3.0


def test_an_error_body_is_quoted_whole_under_the_bound_and_never_cut_inside_a_string() -> None:
    quote_body = relax_core.quote_body
    small = b'{"error": {"message": "regex: needs xgrammar: pip install relax-hf[grammar]"}}'
    assert quote_body(small) == small.decode()
    assert quote_body(b"  ") == "<empty body>"
    words = ", ".join(f'"field {i} is wrong"' for i in range(100))
    body = f'{{"errors": [{words}]}}'.encode()
    quoted = quote_body(body, limit=200)
    head, marker = quoted.rsplit(" … (", 1)
    assert head.count('"') % 2 == 0 and head.endswith('wrong",'), head  # whole strings only
    assert body.startswith(head.encode())
    assert marker == f"{len(body) - len(head.encode())} more bytes)"
    one = quote_body(b'"' + b"x" * 500 + b'"', limit=100)
    assert one.endswith("(402 more bytes, cut inside a string)")
