"""Frozen records that plugins register through the ``relax_register_*`` hooks.

A record is a value: a name, a description and the callables or flags the core needs. Records
are validated where they are built, so a plugin with a bad record fails at load time.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import attrs

__all__ = [
    "UPDATE_PATHS",
    "EngineBackend",
    "EngineLaunchSpec",
    "EngineProcess",
    "PlacementMode",
    "ReplicaSelector",
    "RewardSpec",
    "RoleSpec",
    "RouterBackend",
    "RouterLaunchSpec",
    "RouterMembership",
    "RouterProcess",
    "RoutingPolicy",
    "WeightSource",
]

_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]*$")

#: Every weight-update path an engine can expose.
UPDATE_PATHS = frozenset({"tensor", "distributed", "disk", "lora", "seed_sync"})

ROUTE_MODES = frozenset({"DIRECT", "SGLANG_ROUTER"})


def _check_name(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not _NAME.match(value):
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name}={value!r}: a name starts with a letter "
            "and holds only letters, digits, '_', '.' and '-'"
        )


def _frozenset_of_str(value: object) -> frozenset[str]:
    return frozenset(str(v) for v in value)  # type: ignore[attr-defined]


def _tuple_of_str(value: object) -> tuple[str, ...]:
    return tuple(str(v) for v in value)  # type: ignore[attr-defined]


@attrs.frozen
class RoleSpec:
    """An inference role (rollout, genrm, teacher, or a third party's).

    ``allowed_weight_sources``: weight-source names a model of this role may use.
    ``default_route_mode``: ``DIRECT`` or ``SGLANG_ROUTER``.
    ``deferrable``: whether the role may run in a deferred phase on shared GPUs.
    ``gateway_adapter``: optional factory the gateway calls to build the role's request adapter.
    ``deterministic_inference``: engines of this role run batch-invariant, deterministic
    inference by default (a judge's verdict must not depend on what else is in the batch); a
    model's ``deterministic_inference`` key overrides it.
    """

    name: str = attrs.field(validator=_check_name)
    allowed_weight_sources: frozenset[str] = attrs.field(converter=_frozenset_of_str)
    default_route_mode: str = attrs.field(validator=attrs.validators.in_(ROUTE_MODES))
    default_weight_source: str = "STATIC"
    deferrable: bool = False
    gateway_adapter: Callable[..., Any] | None = None
    description: str = ""
    deterministic_inference: bool = False

    def __attrs_post_init__(self) -> None:
        if self.default_weight_source not in self.allowed_weight_sources:
            raise ValueError(
                f"RoleSpec {self.name!r}: default_weight_source {self.default_weight_source!r} "
                f"is not among allowed_weight_sources {sorted(self.allowed_weight_sources)}"
            )


@attrs.frozen
class EngineLaunchSpec:
    """Everything an engine backend needs to start one engine server process.

    A multi-node replica has one launch per node: ``node_rank`` 0 is the head (it serves HTTP on
    ``host:port``), the others are followers that join ``dist_init_addr``.

    ``role`` and ``static`` say whose engine it is (``static``: the weight source allows no
    update path, so the backend must keep a CPU weight backup and refuse LoRA and dummy
    weights); ``replica_index`` is the logical replica's index in its model (stable across
    rebuilds); ``options`` are the model's settings only some backends read
    (``mem_fraction_static``, ``context_length``, ``max_running_requests``, ``kv_cache_dtype``,
    ``dp``, ``dp_attention``, ``deterministic_inference``, ``pd_prefill_engines``; see
    docs/configuration.md), absent keys meaning the backend's default.
    """

    engine_id: str
    model_path: str
    host: str = "127.0.0.1"
    port: int = 0
    device: str = "cpu"
    dtype: str = "auto"
    seed: int | None = None
    tp: int = 1
    pp: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    weights_cpu_backup: bool = False
    served_model_name: str | None = None
    weight_version: str | None = None
    log_path: str | None = None
    extra_args: tuple[str, ...] = attrs.field(default=(), converter=_tuple_of_str)
    env: Mapping[str, str] = attrs.field(factory=dict)
    role: str | None = None
    static: bool = False
    replica_index: int = 0
    options: Mapping[str, Any] = attrs.field(factory=dict)


@runtime_checkable
class EngineProcess(Protocol):
    """A running engine server process, as returned by ``EngineBackend.launch``."""

    @property
    def pid(self) -> int: ...

    @property
    def base_url(self) -> str | None:
        """``http://host:port`` of the head; ``None`` for a follower."""
        ...

    def wait_ready(self, timeout: float) -> None:
        """Block until the server answers ``/health``; raise ``LifecycleError`` on timeout/exit."""
        ...

    def poll(self) -> int | None:
        """The exit code, or ``None`` while the process runs."""
        ...

    def terminate(self, timeout: float) -> int:
        """Stop the process (SIGTERM, then SIGKILL after ``timeout``); return its exit code."""
        ...


@attrs.frozen
class EngineBackend:
    """An engine backend (``hf``, ``sglang``, …).

    ``launch(spec) -> EngineProcess`` starts one engine server process and returns at once.
    ``control_client(base_url)`` builds the SGLang-protocol control client for a head.
    ``devices``: the devices it can run on (``cpu``, ``cuda``).
    """

    name: str = attrs.field(validator=_check_name)
    launch: Callable[[EngineLaunchSpec], EngineProcess]
    control_client: Callable[[str], Any]
    devices: frozenset[str] = attrs.field(default=frozenset({"cuda"}), converter=_frozenset_of_str)
    multi_node: bool = False
    description: str = ""


@attrs.frozen
class WeightSource:
    """Where a model's weights come from and which update paths it allows.

    ``update_paths`` is a subset of :data:`UPDATE_PATHS`; ``publishes_version`` says whether the
    snapshot carries a ``weight_version`` for models of this source.
    """

    name: str = attrs.field(validator=_check_name)
    update_paths: frozenset[str] = attrs.field(converter=_frozenset_of_str)
    publishes_version: bool
    description: str = ""

    @update_paths.validator
    def _check_paths(
        self, attribute: attrs.Attribute[frozenset[str]], value: frozenset[str]
    ) -> None:
        unknown = value - UPDATE_PATHS
        if unknown:
            raise ValueError(
                f"WeightSource {self.name!r}: unknown update paths {sorted(unknown)}; "
                f"known: {sorted(UPDATE_PATHS)}"
            )


@attrs.frozen
class RewardSpec:
    """A reward adapter: turns a judged sample into a reward.

    ``mode`` is ``sync`` or ``async``; ``supports_deferred`` says whether it can score a staged
    batch in a deferred phase.
    """

    name: str = attrs.field(validator=_check_name)
    fn: Callable[..., Any]
    mode: str = attrs.field(default="sync", validator=attrs.validators.in_({"sync", "async"}))
    supports_deferred: bool = False
    description: str = ""


@runtime_checkable
class ReplicaSelector(Protocol):
    """Picks one replica among DIRECT candidates. One instance per process (its state is local)."""

    def select(
        self,
        *,
        role: str,
        epoch: str,
        model: str,
        candidates: tuple[Any, ...],
        affinity_key: str | None,
        inflight: Mapping[str, int] | None,
    ) -> Any: ...


@attrs.frozen
class RoutingPolicy:
    """A DIRECT replica-selection policy. ``factory()`` builds a fresh process-local selector."""

    name: str = attrs.field(validator=_check_name)
    factory: Callable[[], ReplicaSelector]
    uses_affinity: bool = False
    description: str = ""


@attrs.frozen
class PlacementMode:
    """A placement mode (decoupled, split, defer, …).

    ``assign(ctx: relax_core.placement.ModeContext) -> relax_core.placement.ModeResult`` picks
    each GPU model's pool, phase and first bundle; the planner checks every generic rule.
    ``shares_training_pool``: inference lives inside the actor pool (training must colocate
    and offload). ``supports_defer``: roles may be listed in ``placement.defer_roles``.
    """

    name: str = attrs.field(validator=_check_name)
    assign: Callable[..., Any]
    shares_training_pool: bool = False
    supports_defer: bool = False
    description: str = ""


# -- routers -----------------------------------------------------------------------------------

#: The runtime worker APIs a router can speak: ``workers`` is ``POST /workers {"url"}`` →
#: ``worker_id``, ``GET /workers``, ``DELETE /workers/{worker_id}``.
ROUTER_WORKER_APIS = frozenset({"workers"})


@attrs.frozen
class RouterLaunchSpec:
    """Everything a router backend needs to start the router in front of one model's heads.

    ``router_id`` names the router in logs and errors (``rollout/policy``). ``port`` and
    ``metrics_port`` 0 pick free ports (two routers on one host never share a metrics port).
    ``pd``: prefill/decode disaggregation (heads register as prefill or decode workers).
    ``allow_dropped_fields``: request fields (``sampling_params.logit_bias``) the caller accepts
    the router dropping; any other dropped field refuses the router at start.
    ``health_check_interval``: seconds between the router's own health checks of its workers.
    ``extra_args`` are appended to the router's command line; retries and the circuit breaker
    stay disabled whatever they say. ``served_model_name`` and ``model_path`` are what the
    model's heads report (``/model_info``): a router's own probe workers report the same, so the
    router never sees a second model (smg 1.13 handles requests differently, dropping some
    sampling parameters, while it knows more than one model).
    """

    router_id: str
    policy: str
    served_model_name: str | None = None
    model_path: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int = 0
    pd: bool = False
    allow_dropped_fields: tuple[str, ...] = attrs.field(default=(), converter=_tuple_of_str)
    health_check_interval: float = 10.0
    extra_args: tuple[str, ...] = attrs.field(default=(), converter=_tuple_of_str)
    env: Mapping[str, str] = attrs.field(factory=dict)
    log_path: str | None = None


@runtime_checkable
class RouterMembership(Protocol):
    """Which replica heads a router sends traffic to; what an InferenceManager drives.

    The manager calls :meth:`sync` every time it publishes: ``heads`` maps each engine id to
    the public URL of a head that has been READY and is not stopping, failing or being scaled
    in (READY, DRAINING, SLEEPING, ONLOADING). A head that became READY is registered (and
    waited for until the router reports it healthy) before the manager publishes it READY; a
    head that left ``heads`` is removed from the router before its engine is stopped.
    """

    def sync(self, heads: Mapping[str, str]) -> None:
        """Register new heads, remove the ones gone. Blocking, idempotent; never raises: a
        failed registration is kept and reported by the router's ``check()``."""
        ...


@runtime_checkable
class RouterProcess(RouterMembership, Protocol):
    """A running router, as returned by ``RouterBackend.launch`` (it returns at once)."""

    @property
    def url(self) -> str:
        """``http://host:port`` callers send requests to (published as the model's
        ``router_url``)."""
        ...

    def wait_ready(self, timeout: float) -> None:
        """Block until the router serves, speaks a known worker API and keeps every request
        field; raise ``ConfigError`` (a field is dropped) or ``LifecycleError``."""
        ...

    def check(self) -> list[str]:
        """Supervise: restart a router that died (re-registering its heads), retry failed
        registrations; return what is wrong now (empty when all is well)."""
        ...

    def pids(self) -> list[int]:
        """The router's process ids (empty once stopped)."""
        ...

    def terminate(self, timeout: float) -> None:
        """Stop the router (SIGTERM, then SIGKILL after ``timeout``). Idempotent."""
        ...


@attrs.frozen
class RouterBackend:
    """A router that fronts a model's replica heads (``sglang-router``, ``smg``, …).

    ``launch(spec) -> RouterProcess`` starts it and returns at once. ``policies``: the routing
    policies it supports (a model's ``router_policy`` must be one); ``default_policy`` is used
    when the model names none. ``worker_api``: the runtime membership API it speaks (one of
    :data:`ROUTER_WORKER_APIS`). ``keeps_unknown_fields``: whether it forwards request fields
    it does not know (its field probe checks the ones that matter either way). ``pd``: it can
    route prefill/decode disaggregated workers. ``version``: the installed version, ``None``
    when the router is not installed (the record is still listed, and refused at start).
    ``default``: chosen for a model that names no router (at most one installed default).
    """

    name: str = attrs.field(validator=_check_name)
    launch: Callable[[RouterLaunchSpec], RouterProcess]
    policies: frozenset[str] = attrs.field(converter=_frozenset_of_str)
    default_policy: str
    worker_api: str = attrs.field(
        default="workers", validator=attrs.validators.in_(ROUTER_WORKER_APIS)
    )
    keeps_unknown_fields: bool = True
    pd: bool = False
    version: str | None = None
    default: bool = False
    description: str = ""

    def __attrs_post_init__(self) -> None:
        if self.default_policy not in self.policies:
            raise ValueError(
                f"RouterBackend {self.name!r}: default_policy {self.default_policy!r} is not "
                f"among its policies {sorted(self.policies)}"
            )
