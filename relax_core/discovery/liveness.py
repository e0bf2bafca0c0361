"""Manager liveness: a model whose manager is gone (its ping says so, or misses in a row) is
published UNKNOWN instead of left routable; a later answer asks the manager to republish."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import attrs

log = logging.getLogger("relax.discovery")


@attrs.define
class _Watched:
    ping: Callable[[], bool]
    republish: Callable[[], None] | None
    misses: int = 0
    invalidated: bool = False
    gone: bool = False


class ManagerLiveness:
    """Pings the managers of one registry every ``interval`` seconds (see the module docstring).

    ``publisher``: what ``invalidate(model_ids)`` is called on. ``misses``: failed pings in a
    row before the model is marked UNKNOWN. A ping must bound its own time. Runs on a daemon
    thread once :meth:`start` is called; :meth:`check` runs one round."""

    def __init__(self, publisher: Any, *, interval: float = 2.0, misses: int = 3) -> None:
        if not interval > 0:
            raise ValueError(f"interval={interval!r}: give a positive number of seconds")
        if misses < 1:
            raise ValueError(f"misses={misses!r}: give at least 1")
        self.publisher = publisher
        self.interval = interval
        self.misses = misses
        self._watched: dict[str, _Watched] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(
        self,
        model_id: str,
        ping: Callable[[], bool],
        *,
        republish: Callable[[], None] | None = None,
    ) -> None:
        """Watch ``model_id``'s manager: ``ping()`` returns ``True`` when it answered, ``False``
        when it is definitely gone (its actor died), and raises when it did not answer;
        ``republish()`` asks it to publish its state again. Replaces an earlier watch."""
        with self._lock:
            self._watched[model_id] = _Watched(ping, republish)

    def watching(self) -> list[str]:
        """The model ids watched and not found gone."""
        with self._lock:
            return [m for m, w in self._watched.items() if not w.gone]

    def check(self) -> dict[str, str]:
        """One round: ping every watched manager; model id -> ``alive``, ``missed``, ``gone``."""
        with self._lock:
            watched = [(m, w) for m, w in self._watched.items() if not w.gone]
        out = {}
        for model_id, w in watched:
            try:
                alive = w.ping()
            except Exception as exc:  # no answer: counted, like a replica's failed probe
                w.misses += 1
                out[model_id] = "missed"
                if w.misses >= self.misses and not w.invalidated:
                    log.warning(
                        "manager of model %s did not answer %d pings in a row (%s): published "
                        "UNKNOWN",
                        model_id,
                        w.misses,
                        exc,
                    )
                    self._invalidate(model_id, w)
                continue
            if not alive:
                w.gone = True
                log.warning("manager of model %s is gone: its model is published UNKNOWN", model_id)
                self._invalidate(model_id, w)
                out[model_id] = "gone"
                continue
            w.misses = 0
            out[model_id] = "alive"
            if w.invalidated and w.republish is not None:
                try:
                    w.republish()
                    w.invalidated = False
                except Exception as exc:  # it answered a ping but not this: next round again
                    log.warning("manager of model %s could not republish: %s", model_id, exc)
        return out

    def _invalidate(self, model_id: str, w: _Watched) -> None:
        w.invalidated = True
        self.publisher.invalidate([model_id])

    def start(self) -> None:
        """Ping on a daemon thread every ``interval`` seconds. Idempotent."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="manager-liveness", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.check()
            except Exception:  # the watch must go on; the error is logged with its traceback
                log.exception("manager liveness round failed")

    def stop(self) -> None:
        """Stop the thread (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval + 10.0)
            self._thread = None


def actor_ping(actor: Any, timeout: float = 10.0) -> Callable[[], bool]:
    """A ping of a manager actor (:class:`~relax_core.manager.actor.ManagerActor`): its
    lock-free ``ping()``; ``False`` once the actor is dead."""

    def ping() -> bool:
        import ray

        from relax_core.manager.fanout import is_terminal_actor_death

        try:
            ray.get(actor.ping.remote(), timeout=timeout)
        except ray.exceptions.RayError as exc:
            if is_terminal_actor_death(exc):
                return False
            raise
        return True

    return ping


def actor_republish(actor: Any, timeout: float = 30.0) -> Callable[[], None]:
    """Ask a manager actor to publish its model again."""

    def republish() -> None:
        import ray

        ray.get(actor.republish.remote(), timeout=timeout)

    return republish
