"""The placement groups a manager's workers use, and removing the ones it *owns* (created);
borrowed ones are never removed, and an unconfirmed removal is retried by the next shutdown."""

from __future__ import annotations

import time
from typing import Any

import attrs

from relax_core.errors import LifecycleError

#: Seconds to wait for a removed group to be reported REMOVED.
_REMOVE_DEADLINE = 10.0


@attrs.define
class PlacementGroups:
    """The placement groups one model's workers use, by group id. Not thread-safe."""

    model_id: str
    #: group id -> (group, owned)
    _groups: dict[str, tuple[Any, bool]] = attrs.field(factory=dict, init=False)

    def use(self, group: Any, *, owned: bool) -> None:
        """Record that workers go on ``group`` (``None``: no group); the first record stands."""
        if group is not None:
            self._groups.setdefault(group.id.hex(), (group, owned))

    def owned(self) -> list[Any]:
        """The groups this manager owns and has not removed yet."""
        return [group for group, owned in self._groups.values() if owned]

    def remove_owned(self) -> None:
        """Remove every owned group and confirm it is gone. Blocking.
        :raises LifecycleError: a removal was not confirmed (call again)."""
        import ray
        from ray.util import remove_placement_group

        errors = []
        for gid, (group, owned) in list(self._groups.items()):
            if not owned:
                continue
            try:
                remove_placement_group(group)
                deadline = time.monotonic() + _REMOVE_DEADLINE
                while ray.util.placement_group_table(group).get("state", "REMOVED") != "REMOVED":
                    if time.monotonic() > deadline:
                        raise LifecycleError(f"still not REMOVED after {_REMOVE_DEADLINE:g}s")
                    time.sleep(0.05)
            except Exception as exc:  # reported below and kept listed: shutdown() retries it
                errors.append(f"placement group {gid}: {type(exc).__name__}: {exc}")
                continue
            del self._groups[gid]
        if errors:
            raise LifecycleError(
                f"model {self.model_id!r}: removing its owned placement group(s) was not "
                f"confirmed ({'; '.join(errors)}); they stay pending: call shutdown() again"
            )
