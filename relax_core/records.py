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
    """

    name: str = attrs.field(validator=_check_name)
    allowed_weight_sources: frozenset[str] = attrs.field(converter=_frozenset_of_str)
    default_route_mode: str = attrs.field(validator=attrs.validators.in_(ROUTE_MODES))
    default_weight_source: str = "STATIC"
    deferrable: bool = False
    gateway_adapter: Callable[..., Any] | None = None
    description: str = ""

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


def _optional_callable(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not callable(value):
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name}={value!r}: give a callable or None"
        )


@attrs.frozen
class RewardSpec:
    """A reward adapter: turns a response (and its label) into a reward.

    ``fn`` is called ``fn(response, label)`` — the response text and the sample's label (or
    ``None``) — plus ``metadata=`` (the sample's metadata dict) when ``pass_metadata`` is true.
    It returns a number, or a :class:`~relax_core.coordination.RewardResult` (a value and
    whether the judge's answer could be parsed).

    ``mode``: ``sync`` adapters are plain functions and run in Ray worker processes (remote
    tasks); ``async`` adapters are coroutine functions run on the scoring event loop and get
    ``context=`` (a :class:`~relax_core.coordination.RewardContext`: the prompt, the sample,
    and the loop's shared client of each role, to call a judge model).
    ``label_matcher``: ``label_matcher(label) -> bool``; the adapter scores only samples whose
    label it accepts (``None``: every sample).
    ``supports_deferred``: it may score a staged batch in a deferred phase (side-effect free
    apart from its requests); the defer preflight refuses adapters without it.
    """

    name: str = attrs.field(validator=_check_name)
    fn: Callable[..., Any] = attrs.field(validator=attrs.validators.is_callable())
    mode: str = attrs.field(default="sync", validator=attrs.validators.in_({"sync", "async"}))
    pass_metadata: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    label_matcher: Callable[[str | None], bool] | None = attrs.field(
        default=None, validator=_optional_callable
    )
    supports_deferred: bool = attrs.field(
        default=False, validator=attrs.validators.instance_of(bool)
    )
    description: str = ""

    def __attrs_post_init__(self) -> None:
        import inspect

        is_coroutine = inspect.iscoroutinefunction(self.fn)
        if self.mode == "async" and not is_coroutine:
            raise ValueError(
                f"RewardSpec {self.name!r}: mode='async' needs a coroutine function (async def); "
                f"{self.fn!r} is not one — use mode='sync'"
            )
        if self.mode == "sync" and is_coroutine:
            raise ValueError(
                f"RewardSpec {self.name!r}: fn is a coroutine function; give mode='async'"
            )


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
