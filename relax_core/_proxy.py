"""Clients of one Protocol: their methods generated from it, Ray's errors unwrapped in one place.

A thing that runs in process and behind Ray has one ``typing.Protocol``; its forwarders are
generated from it by :func:`generate`, never typed out again. Every client of an actor wraps its
calls in :func:`remote_errors`, so a caller sees the callee's own error or one of the client's
error type that says which actor and what to do."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

T = TypeVar("T", bound=type)


def contract(protocol: type) -> dict[str, Callable[..., Any]]:
    """The public methods a Protocol declares (its Protocol bases' too), by name."""
    methods: dict[str, Callable[..., Any]] = {}
    for base in reversed(protocol.__mro__):
        if base is not Protocol and getattr(base, "_is_protocol", False):
            methods.update(
                (name, value)
                for name, value in vars(base).items()
                if not name.startswith("_") and callable(value)
            )
    return methods


def generate(protocol: type, forward: Callable[[str], Callable[..., Any]]) -> Callable[[T], T]:
    """A class decorator: every method of ``protocol`` the class does not define itself
    becomes ``forward(name)``, with the Protocol's name, docstring and signature."""

    def decorate(cls: T) -> T:
        for name, declared in contract(protocol).items():
            if name not in vars(cls):
                method = functools.update_wrapper(forward(name), declared)
                method.__qualname__ = f"{cls.__qualname__}.{name}"
                setattr(cls, name, method)
        return cls

    return decorate


@contextlib.contextmanager
def remote_errors(
    error: Callable[[str], BaseException],
    *,
    actor: str = "its actor",
    keep: type[BaseException] | tuple[type[BaseException], ...] = BaseException,
    timeout: float | None = None,
) -> Iterator[None]:
    """Around a ``ray.get`` (or an ``await``) of one actor call: re-raise what the callee
    raised when it is a ``keep`` (Ray's wrapper dropped), else ``error(why)``, ``why`` naming
    ``actor`` and what happened (it failed there, it did not answer within ``timeout``
    seconds, it is dead or unreachable). Ray is imported only once an error is seen."""
    try:
        yield
    except Exception as exc:
        import ray

        if isinstance(exc, ray.exceptions.RayTaskError):
            if isinstance(exc.cause, keep):
                raise exc.cause from None
            raise error(f"failed in {actor}: {exc}") from exc
        if isinstance(exc, ray.exceptions.GetTimeoutError):
            bound = "its timeout" if timeout is None else f"{timeout:g}s"
            raise error(f"{actor} did not answer within {bound}") from None
        if isinstance(exc, ray.exceptions.RayError):
            raise error(f"{actor} is unreachable ({type(exc).__name__}: {exc})") from exc
        raise


def actor_error_line(error: BaseException) -> str:
    """The last non-blank line of ``error``'s text (a ``RayActorError``'s is its creation
    task's own error), else its type's name."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__
