"""How a package's public classes report the package they are exported from."""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def claim(package: str, namespace: Mapping[str, object], names: Iterable[str]) -> None:
    """Make every class among ``names`` in ``namespace`` report ``package`` as its module.

    Called at the end of a package's ``__init__`` on its ``__all__``: ``repr``, tracebacks and
    pickles then name the public path (``relax_core.InferenceClient``), not the private module
    that defines the class. Every such class is reachable under that name, so pickling by
    reference keeps working."""
    for name in names:
        value = namespace[name]
        if isinstance(value, type):
            value.__module__ = package
