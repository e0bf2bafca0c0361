"""Ray's errors of an actor call, as the callee's own: the one place that unwraps them.

An actor method that raises reaches its caller as Ray's ``RayTaskError`` wrapping the error;
an actor that died, or cannot be reached, as another ``RayError``; a ``ray.get`` past its
timeout as ``GetTimeoutError``. Every client of an actor (the manager's, the coordinator's,
the batch store's, the registry's) wraps its calls in :func:`remote_errors`, so a caller sees
the callee's own error (``LifecycleError``, ``InferenceRecoveryRequired`` with its result, …)
or one of the client's error type that says which actor and what to do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

__all__ = ["remote_errors"]


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
