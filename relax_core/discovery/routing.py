"""Routing: from a schema-2 snapshot and a request's model / route key / affinity key to one
:class:`RouteTarget`, the same for the gateway and direct clients (the decision is
docs/discovery-and-routing.md's flowchart; the index a resolve needs is cached on the snapshot)."""

from __future__ import annotations

import collections
import re
import types
from collections.abc import Collection, Mapping
from typing import Any

import attrs

from relax_core.discovery.schema import ModelState, RoleSnapshot
from relax_core.errors import ModelNotReadyError, PluginError, RoutingError
from relax_core.plugins import PluginManager, get_plugin_manager
from relax_core.records import ReplicaSelector, RouteMode, RoutingPolicy

#: Seconds a client should wait before retrying a model in each non-READY state.
DEFAULT_RETRY_AFTER: Mapping[ModelState, float] = types.MappingProxyType(
    {
        ModelState.STARTING: 5.0,
        ModelState.ONLOADING: 2.0,
        ModelState.SLEEPING: 5.0,
        ModelState.DRAINING: 5.0,
        ModelState.FAILED: 30.0,
        ModelState.STOPPING: 30.0,
        ModelState.UNKNOWN: 1.0,
    }
)
#: Seconds to wait when a READY DIRECT model has no eligible head.
NO_REPLICA_RETRY_AFTER = 2.0
#: Seconds to wait when no replica serves the weight version a request requires yet.
WEIGHT_VERSION_RETRY_AFTER = 1.0

_VERSION_PART = re.compile(r"(\d+)")

#: The weight version an SGLang engine (and the ``hf`` engine) reports before any update: the
#: version of the weights it started with. It sorts below every version a trainer pushes.
INITIAL_WEIGHT_VERSION = "default"


def weight_version_key(version: str) -> tuple[Any, ...]:
    """The sort key of a weight version: the one total order of weight versions.

    :data:`INITIAL_WEIGHT_VERSION` sorts below every other version; the others compare digit
    runs as numbers and the rest as text (``"9" < "10"``, ``"v1.2" < "v1.10"``); equal keys
    only for equal strings (``"7"`` and ``"07"`` differ by their text)."""
    if version == INITIAL_WEIGHT_VERSION:
        return (0,)
    parts = tuple(
        (0, int(part)) if part.isdigit() else (1, part)
        for part in _VERSION_PART.split(version)
        if part
    )
    return (1, parts, version)


def weight_version_at_least(have: str | None, want: str) -> bool:
    """Whether weights of version ``have`` satisfy a request for at least ``want`` in the order
    of :func:`weight_version_key` (``None``: an unversioned model, which never does; the
    initial weights meet no requirement but ``"default"`` itself)."""
    return have is not None and (
        have == want or weight_version_key(have) >= weight_version_key(want)
    )


_WHY = {
    ModelState.STARTING: "its engines are still starting",
    ModelState.ONLOADING: "its weights are being loaded back onto the GPUs",
    ModelState.SLEEPING: "it is offloaded while another role uses the GPUs",
    ModelState.DRAINING: "it is draining before an offload or update",
    ModelState.FAILED: "its engines failed; see the manager's log",
    ModelState.STOPPING: "it is shutting down",
    ModelState.UNKNOWN: "discovery lost track of it (the registry was invalidated)",
}


@attrs.frozen
class RouteTarget:
    """Where one request goes.

    ``url`` is the router URL (``route_mode`` SGLANG_ROUTER; ``engine_id`` and ``generation``
    are ``None``) or the chosen head's base URL (DIRECT). ``weight_version`` is the head's
    (when it publishes one), else the model's. ``registry_epoch`` and ``topology_revision``
    identify the snapshot it came from."""

    role: str
    model_id: str
    url: str
    route_mode: RouteMode
    engine_id: str | None
    served_model_name: str
    weight_version: str | None
    generation: int | None
    registry_epoch: str
    topology_revision: int


class _ModelIndex:
    __slots__ = (
        "candidates",
        "model_id",
        "not_ready",
        "router_target",
        "summary",
        "weight_source",
        "weight_version",
    )

    def __init__(self, snapshot: RoleSnapshot, model_id: str) -> None:
        model = snapshot.models[model_id]
        self.model_id = model_id
        self.not_ready: ModelState | None = None if model.state is ModelState.READY else model.state
        self.router_target: RouteTarget | None = None
        self.candidates: tuple[RouteTarget, ...] = ()
        self.weight_version = model.weight_version
        self.weight_source = model.weight_source
        common: dict[str, Any] = {
            "role": snapshot.role,
            "model_id": model_id,
            "served_model_name": model.served_model_name,
            "registry_epoch": snapshot.registry_epoch,
            "topology_revision": snapshot.topology_revision,
        }
        if model.route_mode is RouteMode.SGLANG_ROUTER:
            if model.router_url is not None:
                self.router_target = RouteTarget(
                    url=model.router_url,
                    route_mode=RouteMode.SGLANG_ROUTER,
                    engine_id=None,
                    generation=None,
                    weight_version=model.weight_version,
                    **common,
                )
        else:
            eligible = sorted(
                (e for e in model.engines if e.direct_eligible and e.state is ModelState.READY),
                key=lambda e: e.engine_id,
            )
            self.candidates = tuple(
                RouteTarget(
                    url=e.base_url,
                    route_mode=RouteMode.DIRECT,
                    engine_id=e.engine_id,
                    generation=e.generation,
                    weight_version=(
                        e.weight_version if e.weight_version is not None else model.weight_version
                    ),
                    **common,
                )
                for e in eligible
                if e.base_url is not None
            )
        counts = collections.Counter(engine.state.value for engine in model.engines)
        self.summary = ", ".join(f"{n} {state}" for state, n in sorted(counts.items())) or "none"


class _SnapshotIndex:
    __slots__ = ("aliases", "default", "epoch", "lookup", "models", "policy", "role", "route_keys")

    def __init__(self, snapshot: RoleSnapshot) -> None:
        routing = snapshot.routing
        self.role = snapshot.role
        self.epoch = snapshot.registry_epoch
        self.policy = routing.policy
        self.models = {model_id: _ModelIndex(snapshot, model_id) for model_id in snapshot.models}
        self.lookup: dict[str, str] = {model_id: model_id for model_id in snapshot.models}
        self.lookup.update(routing.aliases)
        self.aliases = dict(routing.aliases)
        self.route_keys = dict(routing.route_key_map)
        self.default = routing.default_model


def _names(values: Any) -> str:
    return ", ".join(f'"{v}"' for v in sorted(values)) or "(none)"


def _no_model(index: _SnapshotIndex, model: str | None, route_key: str | None) -> RoutingError:
    """The 400 of a request naming an unknown model or route key, or none without a default."""
    role = index.role
    if model is not None:
        text = (
            f'unknown model "{model}" for role "{role}"; known models: {_names(index.models)}; '
            f"aliases: {_names(index.aliases)}"
        )
    elif route_key is not None:
        text = (
            f'unknown route key "{route_key}" for role "{role}"; known route keys: '
            f"{_names(index.route_keys)}. Pass model= instead, or add the key to "
            "routing.route_key_map"
        )
    else:
        text = (
            f'role "{role}" has no default_model and the request names no model or route key; '
            f"pass model= one of {_names(index.models)} (aliases: {_names(index.aliases)})"
        )
    return RoutingError(400, text)


class RouteResolver:
    """Resolves requests against schema-2 snapshots (see the module docstring for the rules).

    :param plugin_manager: where routing policies come from; default the process-wide one.
    :param retry_after: seconds per non-READY model state; default :data:`DEFAULT_RETRY_AFTER`.
    :param sleeping_note: set when nothing will wake a SLEEPING model of this role: why, and
        what to do. Its 503 then says so and carries no ``retry_after``.

    Selectors keep process-local state (round-robin cursors). Thread-safe. ``resolve`` does no
    I/O, except that a resolver built without a plugin manager loads the process-wide one."""

    def __init__(
        self,
        plugin_manager: PluginManager | None = None,
        *,
        retry_after: Mapping[ModelState, float] | None = None,
        sleeping_note: str | None = None,
    ) -> None:
        self._pm = plugin_manager
        self._sleeping_note = sleeping_note
        self._retry_after = dict(DEFAULT_RETRY_AFTER if retry_after is None else retry_after)
        self._last: tuple[RoleSnapshot | None, _SnapshotIndex | None] = (None, None)
        # (policy name, has affinity key) -> selector to use
        self._selectors: dict[tuple[str, bool], ReplicaSelector] = {}
        self._instances: dict[str, ReplicaSelector] = {}

    def _policy(self, name: str, role: str) -> RoutingPolicy:
        if self._pm is None:
            self._pm = get_plugin_manager()
        pm = self._pm
        try:
            return pm.routing_policy(name)
        except PluginError:
            known = ", ".join(sorted(pm.registered("routing_policies"))) or "(none)"
            raise RoutingError(
                503,
                f'role "{role}" routes DIRECT requests with policy "{name}", which no installed '
                "plugin registers. Install and enable the plugin that provides it, or set "
                f"routing.policy to a registered policy ({known})",
                retry_after=None,
            ) from None

    def selector(self, policy: str, *, affinity: bool, role: str = "?") -> ReplicaSelector:
        """The selector a DIRECT request uses under snapshot policy ``policy``.

        :raises RoutingError: 503 when ``policy`` (or the fallback it needs) is not registered."""
        found = self._selectors.get((policy, affinity))
        if found is not None:
            return found
        record = self._policy(policy, role)
        if record.uses_affinity != affinity:
            record = self._policy("rendezvous" if affinity else "round_robin", role)
        selector = self._instances.get(record.name)
        if selector is None:
            selector = self._instances.setdefault(record.name, record.factory())
        self._selectors[(policy, affinity)] = selector
        return selector

    def resolve(
        self,
        snapshot: RoleSnapshot,
        *,
        model: str | None = None,
        route_key: str | None = None,
        affinity_key: str | None = None,
        inflight: Mapping[str, int] | None = None,
        min_weight_version: str | None = None,
        avoid: Collection[str] | None = None,
    ) -> RouteTarget:
        """The target for one request.

        ``model`` (an id or alias) wins over ``route_key``; ``affinity_key``: the same key goes
        to the same DIRECT head; ``inflight``: in-flight requests per engine id;
        ``min_weight_version``: the least weight version that may serve it; ``avoid``: DIRECT
        base URLs to leave out unless no other head is eligible.

        :raises RoutingError: 400 for an unknown model, alias or route key, or no model at all;
            503 (with ``retry_after``) when nothing can serve it now; 503 (without) when the
            snapshot's policy is not installed."""
        last = self._last
        if last[0] is snapshot:
            index: _SnapshotIndex = last[1]  # type: ignore[assignment]
        else:
            index = snapshot.derived("relax_core.discovery.routing", _SnapshotIndex)
            self._last = (snapshot, index)

        if model is not None:
            model_id = index.lookup.get(model)
        elif route_key is not None:
            model_id = index.route_keys.get(route_key)
        else:
            model_id = index.default
        if model_id is None:
            raise _no_model(index, model, route_key)

        entry = index.models[model_id]
        if entry.not_ready is not None:
            raise self._not_ready(index, entry)
        if min_weight_version is not None and entry.weight_source == "STATIC":
            raise RoutingError(
                400,
                f'model "{model_id}" of role "{index.role}" has STATIC weights, which carry no '
                f'version; min_weight_version "{min_weight_version}" can never be met. Drop it '
                "(or the X-Relax-Min-Weight-Version header) for this model",
            )
        target = entry.router_target
        if target is not None:
            if min_weight_version is not None and not weight_version_at_least(
                entry.weight_version, min_weight_version
            ):
                raise self._too_old(index, entry, min_weight_version, f"{entry.weight_version}")
            return target
        candidates = entry.candidates
        if not candidates:
            raise RoutingError(
                503,
                f'model "{model_id}" of role "{index.role}" has no READY direct-eligible replica '
                f"(engines: {entry.summary}); retry after {NO_REPLICA_RETRY_AFTER:g} s",
                retry_after=NO_REPLICA_RETRY_AFTER,
            )
        if min_weight_version is not None:
            fresh = tuple(
                c
                for c in candidates
                if weight_version_at_least(c.weight_version, min_weight_version)
            )
            if not fresh:
                heads = ", ".join(f"{c.engine_id} on {c.weight_version}" for c in candidates)
                raise self._too_old(index, entry, min_weight_version, heads)
            candidates = fresh
        if avoid:
            kept = tuple(c for c in candidates if c.url not in avoid)
            if kept:
                candidates = kept
        affinity = affinity_key is not None
        selector = self._selectors.get((index.policy, affinity))
        if selector is None:
            selector = self.selector(index.policy, affinity=affinity, role=index.role)
        chosen = selector.select(
            role=index.role,
            epoch=index.epoch,
            model=model_id,
            candidates=candidates,
            affinity_key=affinity_key,
            inflight=inflight,
        )
        if chosen.__class__ is not RouteTarget:
            raise RoutingError(
                503,
                f'routing policy "{index.policy}" returned {type(chosen).__name__}, not one of '
                "the candidates it was given; fix or disable the plugin that provides it",
            )
        return chosen  # type: ignore[no-any-return]

    @staticmethod
    def _too_old(index: _SnapshotIndex, entry: _ModelIndex, wanted: str, have: str) -> RoutingError:
        return RoutingError(
            503,
            f'model "{entry.model_id}" of role "{index.role}" has no READY replica with weight '
            f'version >= "{wanted}" yet (serving: {have or "none"}); a weight update is being '
            f"applied or not pushed yet. Nothing sent; retry after "
            f"{WEIGHT_VERSION_RETRY_AFTER:g} s",
            retry_after=WEIGHT_VERSION_RETRY_AFTER,
        )

    def _not_ready(self, index: _SnapshotIndex, entry: _ModelIndex) -> RoutingError:
        state = entry.not_ready
        assert state is not None
        where = {"role": index.role, "model": entry.model_id, "state": state.value}
        if state is ModelState.SLEEPING and self._sleeping_note is not None:
            return ModelNotReadyError(
                f'model "{entry.model_id}" of role "{index.role}" is SLEEPING and nothing will '
                f"wake it: {self._sleeping_note}. No request was sent",
                retry_after=None,
                **where,
            )
        seconds = self._retry_after.get(state, 1.0)
        return ModelNotReadyError(
            f'model "{entry.model_id}" of role "{index.role}" is {state.value} ({_WHY[state]}); '
            f"no request was sent. Refresh discovery and retry after {seconds:g} s",
            retry_after=seconds,
            **where,
        )
