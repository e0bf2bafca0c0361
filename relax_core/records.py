"""Frozen records that plugins register through the ``relax_register_*`` hooks.

A record is a value: a name, a description and the callables or flags the core needs. Records
are validated where they are built, so a plugin with a bad record fails at load time.

This is the lowest layer of the core (it imports nothing from it), so the constants every layer
shares are defined here once: :data:`NAME_PATTERN` (record, role and policy names),
:class:`RouteMode` / :data:`ROUTE_MODES`, :data:`UPDATE_PATHS` and the engine features a job may
need (:data:`CONSTRAINED_DECODING`, :data:`ENGINE_FEATURES`).
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs

__all__ = [
    "CONSTRAINED_DECODING",
    "ENGINE_FEATURES",
    "NAME_PATTERN",
    "ROUTE_MODES",
    "UPDATE_PATHS",
    "BenchmarkSpec",
    "CommandSpec",
    "DataSourceSpec",
    "EngineBackend",
    "EngineLaunchSpec",
    "EngineOptions",
    "EngineProcess",
    "EnvironmentSpec",
    "OpenAPINotes",
    "PlacementMode",
    "PluginLookup",
    "ReplicaSelector",
    "RewardSpec",
    "RoleSpec",
    "RolloutShapeSpec",
    "RouteMode",
    "RouterBackend",
    "RouterLaunchSpec",
    "RouterMembership",
    "RouterProcess",
    "RoutingPolicy",
    "StageSpec",
    "TrackerSpec",
    "TrainerSpec",
    "WeightSource",
]

#: A record name (role, engine backend, weight source, policy, mode …): a letter first, then
#: letters, digits, ``_``, ``.`` and ``-``. Role names are also URL path segments and config keys.
NAME_PATTERN = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]*$")

#: Every weight-update path an engine can expose.
UPDATE_PATHS = frozenset({"tensor", "distributed", "disk", "lora", "seed_sync"})

#: An engine feature: grammar-constrained sampling (SGLang's ``regex`` / ``json_schema`` /
#: ``ebnf`` sampling parameters), e.g. an environment's guided turn.
CONSTRAINED_DECODING = "constrained_decoding"
#: The engine features the core names (what a rollout shape or an environment ``needs``, what
#: an :class:`EngineBackend` says it is ``missing``); a plugin may name others of its own.
ENGINE_FEATURES = frozenset({CONSTRAINED_DECODING})


class RouteMode(enum.StrEnum):
    """How requests reach a model: straight to a replica head, or through its SGLang router."""

    DIRECT = "DIRECT"
    SGLANG_ROUTER = "SGLANG_ROUTER"


#: The route-mode names, in declaration order (config choices, record validation).
ROUTE_MODES: tuple[str, ...] = tuple(mode.value for mode in RouteMode)


def _check_name(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not NAME_PATTERN.match(value):
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name}={value!r}: a name starts with a letter "
            "and holds only letters, digits, '_', '.' and '-'"
        )


def _frozenset_of_str(value: object) -> frozenset[str]:
    return frozenset(str(v) for v in value)  # type: ignore[attr-defined]


def _tuple_of_str(value: object) -> tuple[str, ...]:
    return tuple(str(v) for v in value)  # type: ignore[attr-defined]


def _optional_tuple_of_str(value: object) -> tuple[str, ...] | None:
    return None if value is None else _tuple_of_str(value)


def _json_copy(what: str, value: object) -> Any:
    """A private copy of a JSON value; ``ValueError`` naming ``OpenAPINotes.<what>`` if not."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"OpenAPINotes.{what}: not a JSON value ({exc})") from None


def _json_inputs(value: object) -> tuple[dict[str, Any], ...]:
    if not isinstance(value, list | tuple):
        raise ValueError(
            f"OpenAPINotes.generate_inputs: give a sequence of input schemas, got {value!r}"
        )
    return tuple(_json_copy("generate_inputs", list(value)))


def _json_fields(value: object) -> Any:
    return _json_copy("generate_fields", value)


def _json_answer(value: object) -> Any:
    return _json_copy("generate_answer", value)


@attrs.frozen
class OpenAPINotes:
    """What a role's OpenAPI document says beyond the common one every role gateway shares.

    The common document (``relax_core.gateway.openapi``) describes SGLang's ``/generate`` with
    one of ``text`` or ``input_ids``, chat completions, models, engines, health and metrics.
    A role whose adapter accepts more on ``/generate`` says so here, as plain JSON Schema:

    ``generate_summary``: words appended to the ``/generate`` summary
    (``" (or the messages judge protocol)"``).
    ``batched_generate``: ``text`` and ``input_ids`` may also be lists (a batch of prompts).
    ``generate_inputs``: extra alternatives to ``text`` / ``input_ids``, each an object schema
    with ``required`` (the input field, first) and ``properties``; they must match the role
    adapter's ``generate_inputs``.
    ``generate_fields``: extra optional request fields, ``{name: JSON Schema}``.
    ``generate_answer``: the JSON Schema of a non-streamed ``200`` answer (``None``: the
    engine's own SGLang answer, an object or an array).

    Every value is copied on construction; :raises ValueError: a value is not JSON, or an input
    schema has no ``required`` field it also describes in ``properties``.
    """

    generate_summary: str = attrs.field(default="", validator=attrs.validators.instance_of(str))
    batched_generate: bool = attrs.field(
        default=False, validator=attrs.validators.instance_of(bool)
    )
    generate_inputs: tuple[dict[str, Any], ...] = attrs.field(
        default=(), converter=_json_inputs, hash=False
    )
    generate_fields: dict[str, Any] = attrs.field(factory=dict, converter=_json_fields, hash=False)
    generate_answer: dict[str, Any] | None = attrs.field(
        default=None, converter=_json_answer, hash=False
    )

    @generate_inputs.validator
    def _check_inputs(self, _a: object, value: tuple[Any, ...]) -> None:
        for i, branch in enumerate(value):
            where = f"OpenAPINotes.generate_inputs[{i}]"
            required = branch.get("required") if isinstance(branch, dict) else None
            props = branch.get("properties") if isinstance(branch, dict) else None
            if not (
                isinstance(required, list)
                and required
                and all(isinstance(r, str) for r in required)
                and isinstance(props, dict)
                and all(r in props for r in required)
            ):
                raise ValueError(
                    f"{where}: an input is an object schema whose 'required' lists its input "
                    "field (and any other required field), each described in 'properties', "
                    'e.g. {"required": ["messages"], "properties": {"messages": {...}}}'
                )

    @generate_fields.validator
    def _check_fields(self, _a: object, value: object) -> None:
        if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
            raise ValueError(
                "OpenAPINotes.generate_fields: give {field name: JSON Schema object}, e.g. "
                '{"token_ids_logprob": {"type": "array", "items": {"type": "integer"}}}'
            )

    @generate_answer.validator
    def _check_answer(self, _a: object, value: object) -> None:
        if value is not None and not isinstance(value, dict):
            raise ValueError("OpenAPINotes.generate_answer: give a JSON Schema object or None")

    @property
    def input_names(self) -> tuple[str, ...]:
        """The input field of each extra ``/generate`` input (the first of its ``required``)."""
        return tuple(branch["required"][0] for branch in self.generate_inputs)


def _route_mode(value: object) -> RouteMode:
    try:
        return RouteMode(str(value))
    except ValueError:
        raise ValueError(
            f"RoleSpec.default_route_mode={value!r}: must be one of {', '.join(ROUTE_MODES)}"
        ) from None


def _default_title(spec: RoleSpec) -> str:
    return spec.name.capitalize() if isinstance(spec.name, str) else ""


_BOOL = attrs.validators.instance_of(bool)


def _check_health_schema(_i: object, _a: object, value: object) -> None:
    if isinstance(value, bool) or value not in (1, 2):
        raise ValueError(f"RoleSpec.health_schema={value!r}: must be 1 or 2")


@attrs.frozen
class RoleSpec:
    """An inference role: everything the core knows about it (the core names no role).

    ``allowed_weight_sources``: weight-source names a model of this role may use;
    ``default_weight_source`` (one of them) is used when a model does not name one.
    ``default_route_mode``: :class:`RouteMode` of a model that does not set ``route_mode``.
    ``deferrable``: the role may be listed in ``placement.defer_roles`` and then runs in a
    deferred phase of its own on GPUs it time-shares (a scorer: a reward model, a teacher).
    ``generation_phase``: the role generates the training batch (the policy's samples): under a
    deferring placement mode its models run in the generation phase, whose bundles the deferred
    roles reuse afterwards. Not deferrable at the same time.
    ``health_schema``: the schema ``GET /{role}/health`` answers without ``?schema=``: 2 (the
    unified readiness body) or 1 (the legacy ``{status, healthy_engines, total_engines}`` body,
    for roles whose old consumers read it).
    ``title``: how plans and listings name the role (default: the name, capitalised).
    ``openapi``: what the role's OpenAPI document adds to the common one (:class:`OpenAPINotes`).
    ``gateway_adapter``: zero-argument factory of the role's ``RoleAdapter`` (``None``: requests
    pass through unchanged).
    ``deterministic_inference``: engines of this role run batch-invariant, deterministic
    inference by default (a judge's verdict must not depend on what else is in the batch); a
    model's ``deterministic_inference`` key overrides it.

    :raises ValueError: a field is invalid; the message names the field.
    """

    name: str = attrs.field(validator=_check_name)
    allowed_weight_sources: frozenset[str] = attrs.field(converter=_frozenset_of_str)
    default_route_mode: RouteMode = attrs.field(converter=_route_mode)
    default_weight_source: str = "STATIC"
    deferrable: bool = attrs.field(default=False, validator=_BOOL)
    gateway_adapter: Callable[..., Any] | None = None
    description: str = ""
    generation_phase: bool = attrs.field(default=False, validator=_BOOL, kw_only=True)
    health_schema: int = attrs.field(default=2, validator=_check_health_schema, kw_only=True)
    title: str = attrs.field(
        default=attrs.Factory(_default_title, takes_self=True),
        validator=attrs.validators.instance_of(str),
        kw_only=True,
    )
    openapi: OpenAPINotes = attrs.field(
        factory=OpenAPINotes,
        validator=attrs.validators.instance_of(OpenAPINotes),
        kw_only=True,
    )
    deterministic_inference: bool = attrs.field(default=False, validator=_BOOL, kw_only=True)

    def __attrs_post_init__(self) -> None:
        if self.default_weight_source not in self.allowed_weight_sources:
            raise ValueError(
                f"RoleSpec {self.name!r}: default_weight_source {self.default_weight_source!r} "
                f"is not among allowed_weight_sources {sorted(self.allowed_weight_sources)}"
            )
        if self.deferrable and self.generation_phase:
            raise ValueError(
                f"RoleSpec {self.name!r}: a role that generates the batch (generation_phase) "
                "runs before the deferred phases; it cannot be deferrable as well"
            )
        if not self.title.strip():
            raise ValueError(f"RoleSpec {self.name!r}: title must not be empty")

    @property
    def static_weights(self) -> bool:
        """Whether the role's models always have fixed weights (STATIC is its only source)."""
        return self.allowed_weight_sources == frozenset({"STATIC"})


def _env(value: object) -> dict[str, str]:
    return {str(k): str(v) for k, v in dict(value).items()}  # type: ignore[call-overload]


@attrs.frozen
class EngineOptions:
    """The engine options of a model that every engine backend may read: the job file's model
    keys of the same names (docs/configuration.md), passed to each launch as
    :attr:`EngineLaunchSpec.options`.

    ``None`` means the backend's own default. ``dtype`` / ``kv_cache_dtype``: the weights' and
    the KV cache's dtype (``auto``: the checkpoint's). ``mem_fraction_static``,
    ``context_length``, ``max_running_requests``: the engine's memory pool and limits.
    ``dp`` / ``dp_attention``: data-parallel attention inside one engine.
    ``deterministic_inference``: batch-invariant inference (``None`` in a job file: the role's
    default; a launch always carries the decision). ``weights_cpu_backup``: keep a CPU copy of
    released weights (``None`` in a job file: the weight source decides; a launch always
    carries the decision, which a STATIC engine's spec forces on). ``extra_args``: the
    engine server's own flags, appended last. ``env``: extra environment of the engine
    process. ``pd_prefill_engines``: the first that many replicas are prefill workers, the
    rest decode workers (prefill/decode disaggregation).

    The job file's values are checked where they are read (:mod:`relax_core.config`); the
    options only one backend understands are its own record (:attr:`EngineBackend.options`).
    """

    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    mem_fraction_static: float | None = None
    context_length: int | None = None
    max_running_requests: int | None = None
    dp: int = 1
    dp_attention: bool = False
    deterministic_inference: bool | None = None
    weights_cpu_backup: bool | None = None
    extra_args: tuple[str, ...] = attrs.field(default=(), converter=_tuple_of_str)
    env: Mapping[str, str] = attrs.field(factory=dict, converter=_env)
    pd_prefill_engines: int | None = None


@attrs.frozen
class EngineLaunchSpec:
    """Everything an engine backend needs to start one engine server process.

    A multi-node replica has one launch per node: ``node_rank`` 0 is the head (it serves HTTP on
    ``host:port``), the others are followers that join ``dist_init_addr``.

    ``role`` and ``static`` say whose engine it is (``static``: the weight source allows no
    update path, so the backend must keep a CPU weight backup and refuse LoRA and dummy
    weights); ``replica_index`` is the logical replica's index in its model (stable across
    rebuilds). ``options`` are the model's :class:`EngineOptions` (dtype, memory, extra
    arguments, environment, …) with ``weights_cpu_backup`` and ``deterministic_inference``
    decided; ``backend_options`` is an instance of the backend's own options record
    (:attr:`EngineBackend.options`), read from the model's ``engine`` table, its defaults when
    the table is absent; ``None`` for a backend that declares no record, or a spec built by
    hand (the backend's defaults then).
    """

    engine_id: str
    model_path: str
    host: str = "127.0.0.1"
    port: int = 0
    device: str = "cpu"
    seed: int | None = None
    tp: int = 1
    pp: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    served_model_name: str | None = None
    weight_version: str | None = None
    log_path: str | None = None
    role: str | None = None
    static: bool = False
    replica_index: int = 0
    options: EngineOptions = attrs.field(
        factory=EngineOptions, validator=attrs.validators.instance_of(EngineOptions)
    )
    backend_options: object | None = None


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


def _check_options_record(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        return
    where = f"{type(instance).__name__}.{attribute.name}={value!r}"
    if not (isinstance(value, type) and attrs.has(value)):
        raise ValueError(f"{where}: give an attrs frozen class (the table's keys) or None")
    # A model without an ``engine`` table gets the record's defaults.
    missing = [f.name for f in attrs.fields(value) if f.default is attrs.NOTHING]
    if missing:
        raise ValueError(f"{where}: give every field a default; {', '.join(missing)} has none")


def _optional_callable(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not callable(value):
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name}={value!r}: give a callable or None"
        )


@attrs.frozen
class EngineBackend:
    """An engine backend (``hf``, ``sglang``, …).

    ``launch(spec) -> EngineProcess`` starts one engine server process and returns at once.
    ``control_client(base_url)`` builds the SGLang-protocol control client for a head.
    ``devices``: the devices it can run on (``cpu``, ``cuda``). ``model_hint``: how a user
    makes a model directory this backend serves, shown by the job preflight when a
    ``model_path`` is missing (e.g. a command that writes a tiny model for a try-out).
    ``loads_model_dir``: whether an engine loads its model from the directory ``model_path``
    names (checked by the job preflight); ``False`` for a backend that serves no checkpoint (a
    simulator), whose ``model_path`` is only a name.
    ``options``: the backend's own options record, an ``attrs`` frozen class whose fields (each
    with a default) are the keys of a model's ``engine`` table
    (``[roles.R.models.M.engine]``): their names, types (``bool``, ``int``, ``float``, ``str``,
    ``X | None``, ``tuple[str, ...]``, a ``Literal`` of strings) and defaults are what the job
    file accepts, checked before anything starts, and each launch gets an instance as
    :attr:`EngineLaunchSpec.backend_options`. ``None``: the backend reads no options of its
    own, and a model of it may have no ``engine`` table.
    ``missing(feature) -> str | None``: whether this install of the backend can provide an
    engine feature a job needs (:data:`ENGINE_FEATURES`, e.g. :data:`CONSTRAINED_DECODING`):
    ``None`` when it can, else what is missing and how to install it (``"constrained decoding
    needs xgrammar: pip install 'relax-hf[grammar]'"``). Asked by the run's preflight on the
    machine running ``relax``, before anything starts; ``missing=None``: the backend provides
    every feature.

    :raises ValueError: a bad name, or ``options`` is not an attrs class whose every field has
        a default.
    """

    name: str = attrs.field(validator=_check_name)
    launch: Callable[[EngineLaunchSpec], EngineProcess]
    control_client: Callable[[str], Any]
    devices: frozenset[str] = attrs.field(default=frozenset({"cuda"}), converter=_frozenset_of_str)
    multi_node: bool = False
    description: str = ""
    model_hint: str = ""
    loads_model_dir: bool = True
    options: type[Any] | None = attrs.field(default=None, validator=_check_options_record)
    missing: Callable[[str], str | None] | None = attrs.field(
        default=None, validator=_optional_callable
    )


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


def _retries(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if type(value) is not int or value < 0:
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name}={value!r}: give an int >= 0 (how many "
            "times a failed idempotent request is sent again)"
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
    ``retries``: how many times the reward stage may call ``fn`` again for a sample after it
    failed for a transport reason or a 5xx (``relax_core.coordination.retries.retryable``),
    the role's dead replicas rebuilt in between; only for an adapter whose call is idempotent
    (one judge request). A stage's own ``retries`` key overrides it. Default 0.
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
    retries: int = attrs.field(default=0, kw_only=True, validator=_retries)

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


# -- trainers ----------------------------------------------------------------------------------

#: The methods every trainer class has (``relax_core.Trainer``, the Protocol ``relax run`` calls).
TRAINER_METHODS = ("train", "push")


def _check_trainer_class(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    missing = [m for m in TRAINER_METHODS if not callable(getattr(value, m, None))]
    if not isinstance(value, type) or missing:
        what = (
            f"it has no {' and no '.join(missing)} method"
            if isinstance(value, type)
            else "it is not a class"
        )
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name}={value!r}: {what}; give the trainer "
            "class, built from a TrainerContext, with train(batch_id) and push(weight_version)"
        )


@attrs.frozen
class TrainerSpec:
    """A trainer ``relax run`` can start by name (``[run] trainer = "grpo"``).

    ``trainer_class`` is built ``trainer_class(context)`` from a
    :class:`~relax_core.TrainerContext` inside its own Ray actor (a class, because Ray makes
    the actor of it) and implements :class:`~relax_core.Trainer`: ``train(batch_id) -> dict``
    and ``push(weight_version) -> dict``. The module that defines it must be importable in
    the actor's worker process (a module of an installed distribution), and should not import
    torch or a training framework at module level: plugins load in every ``relax`` command.

    ``options``: the trainer's own options record, an ``attrs`` frozen class whose fields (each
    with a default) are keys of the ``[run]`` table the trainer reads (``learning_rate``,
    ``clip``…), read as :meth:`~relax_core.ConfigReader.record` reads a record and checked
    before anything starts, at their key path (``run.learning_rate``); the trainer gets the
    instance as ``context.options``. ``None``: it reads no keys of its own. ``check(run) ->
    list[ConfigProblem]``: the problems across its options (``run.trainer_options``) and the
    rest of the table (its stages, its mode), found before anything starts; ``None``: none.
    ``default``: the trainer a job file that names none gets when several are installed (with
    one installed, that one is used either way); two installed defaults make the job name one.

    :raises ValueError: a bad name, ``trainer_class`` is not a class with both methods, or
        ``options`` is not an attrs class whose every field has a default.
    """

    name: str = attrs.field(validator=_check_name)
    trainer_class: type[Any] = attrs.field(validator=_check_trainer_class)
    description: str = ""
    options: type[Any] | None = attrs.field(default=None, validator=_check_options_record)
    check: Callable[[Any], Sequence[Any]] | None = attrs.field(
        default=None, validator=_optional_callable
    )
    default: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))


# -- trackers ----------------------------------------------------------------------------------


@attrs.frozen
class TrackerSpec:
    """An experiment tracker ``relax run`` reports to, named in ``[run] trackers`` (``trackers
    = ["tensorboard", { tracker = "wandb", project = "rl" }]``) or by ``--tracker``.

    ``open(context) -> Tracker`` opens one for a run: ``context`` is a
    :class:`~relax_core.TrackerContext` (the run's directory, under which the tracker keeps
    its files; the job's name; the entry's ``options``); the tracker it returns implements
    :class:`~relax_core.Tracker` (``log_config``, ``log_metrics``, ``log_span``,
    ``log_samples``, ``close``). Called in the driver when the steps begin, never at import:
    import the tracking library inside ``open``, since plugins load in every ``relax``
    command. ``options``: the keys an entry may hold besides ``tracker`` (checked before
    anything starts, with a did-you-mean hint); ``None``: any.

    :raises ValueError: a bad name, or an option named ``tracker``.
    """

    name: str = attrs.field(validator=_check_name)
    open: Callable[[Any], Any] = attrs.field(validator=attrs.validators.is_callable())
    options: tuple[str, ...] | None = attrs.field(default=(), converter=_optional_tuple_of_str)
    description: str = ""

    @options.validator
    def _check_tracker_options(self, _a: object, value: tuple[str, ...] | None) -> None:
        bad = [k for k in value or () if k == "tracker" or not NAME_PATTERN.match(k)]
        if bad:
            raise ValueError(
                f"TrackerSpec {self.name!r}.options: option names are keys of the tracker's "
                f"entry (not {bad}; 'tracker' names the tracker itself)"
            )


# -- step stages -------------------------------------------------------------------------------


@runtime_checkable
class PluginLookup(Protocol):
    """Where a stage's or a source's builder looks records up: the job's plugin manager
    (``registered("reward_adapters")["exact-match"].record``)."""

    def registered(self, kind: str) -> Mapping[str, Any]: ...


def _check_options(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    bad = [k for k in value if not isinstance(k, str) or not NAME_PATTERN.match(k)]
    common = {"stage", "name", "role", "models", "retries"} & set(value)
    if bad or common:
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name}: option names are keys of the stage's "
            f"table (not {sorted(map(str, bad)) or sorted(common)}; stage, name, role, models "
            "and retries are every stage's own)"
        )


@attrs.frozen
class StageSpec:
    """A kind of step stage that ``[[run.stages]]`` lists by name (``stage = "distill"``).

    ``build(config) -> Stage`` builds one from its table: ``config`` is a
    :class:`~relax_core.StageConfig` (its ``options``: the table's own keys; its ``name``,
    ``role`` and ``models``; the run's settings; the plugin manager), read with
    :class:`~relax_core.ConfigReader`; it raises :class:`~relax_core.ConfigValidationError`
    naming each key path. Pure: ``relax run`` builds every stage before anything starts, to
    check the job. The stage it returns implements :class:`~relax_core.Stage`.
    ``options``: the keys the table may hold besides ``stage``, ``name``, ``role`` and
    ``models`` (checked by the core, with a did-you-mean hint); ``None``: any, ``build`` checks.
    ``needs_role``: the stage calls a role's engines, so ``role`` is required.
    ``retries``: the default of a stage's ``retries`` key — how many times one of its requests
    that failed for a transport reason or a 5xx is sent again (the stage reads
    ``StageConfig.retries`` and sends through ``StageContext.retrying``); give a number only
    when the kind's requests are idempotent. Default 0.

    :raises ValueError: a bad name, an option named like a common key, ``retries`` < 0.
    """

    name: str = attrs.field(validator=_check_name)
    build: Callable[[Any], Any] = attrs.field(validator=attrs.validators.is_callable())
    options: tuple[str, ...] | None = attrs.field(
        default=(), converter=_optional_tuple_of_str, validator=_check_options
    )
    needs_role: bool = attrs.field(default=False, validator=_BOOL)
    description: str = ""
    retries: int = attrs.field(default=0, kw_only=True, validator=_retries)


# -- data sources ------------------------------------------------------------------------------


def _check_suffixes(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    bad = [s for s in value if not s.startswith(".") or len(s) < 2]
    if bad:
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name}: file suffixes start with a dot "
            f"('.jsonl'), got {bad}"
        )


@attrs.frozen
class DataSourceSpec:
    """A prompt source ``relax run`` reads: named by ``dataset = "arithmetic"``, or chosen for a
    file whose name ends in one of its ``suffixes`` (``dataset = "train.jsonl"``).

    ``open(request) -> PromptSource``: ``request`` is a :class:`~relax_core.SourceRequest`
    (the dataset as written, the file resolved against the job file, the seed, the key path);
    the source hands out :class:`~relax_core.Prompt` records ``take(n)`` at a time.
    ``check(request) -> list[ConfigProblem]``: every problem with the source's data, found
    before anything starts (the JSONL source reads every line); ``None``: ``open`` is cheap
    and raises :class:`~relax_core.ConfigValidationError` itself.

    :raises ValueError: a bad name or suffix.
    """

    name: str = attrs.field(validator=_check_name)
    open: Callable[[Any], Any] = attrs.field(validator=attrs.validators.is_callable())
    suffixes: tuple[str, ...] = attrs.field(
        default=(), converter=_tuple_of_str, validator=_check_suffixes
    )
    check: Callable[[Any], Any] | None = attrs.field(default=None, validator=_optional_callable)
    description: str = ""


# -- rollout shapes and environments ---------------------------------------------------------


def _check_shape_options(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    bad = [k for k in value if not isinstance(k, str) or not NAME_PATTERN.match(k)]
    if bad or "shape" in value:
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name}: option names are keys of the "
            f"[run.generation] table (not {sorted(map(str, bad)) or ['shape']}; 'shape' names the "
            "shape itself)"
        )


@attrs.frozen
class RolloutShapeSpec:
    """How a step's prompts become groups of samples, named by ``[run.generation] shape``
    (default ``"single-turn"``: one completion per sample; the ``relax-agent`` plugin registers
    ``"multi-turn"``: a trajectory of policy turns and environment observations per sample).

    ``build(config) -> RolloutShape``: ``config`` is a :class:`~relax_core.RolloutShapeConfig`
    (the table's other keys as ``options``, the run's settings, the plugin manager, the
    generation model's directory); it raises :class:`~relax_core.ConfigValidationError`
    naming each key path. Pure: built when the run is checked, before anything starts, and
    again in the driver. The shape it returns implements :class:`~relax_core.RolloutShape`:
    ``await shape.group(request) -> list[Sample]``, one group (one prompt's samples) per call.
    ``options``: the keys the table may hold besides ``shape``; ``None``: any.
    ``needs(config) -> Mapping[str, str]``: the engine features (:data:`ENGINE_FEATURES`) the
    shape needs from the generation model's engine with this table, each with the key path that
    asks for it (``{"constrained_decoding": "run.generation.env.guided_first_turn"}``); called
    once the table builds, and each feature is checked against the model's backend
    (:attr:`EngineBackend.missing`) before anything starts. ``None``: none.

    :raises ValueError: a bad name or option name.
    """

    name: str = attrs.field(validator=_check_name)
    build: Callable[[Any], Any] = attrs.field(validator=attrs.validators.is_callable())
    options: tuple[str, ...] | None = attrs.field(
        default=(), converter=_optional_tuple_of_str, validator=_check_shape_options
    )
    description: str = ""
    needs: Callable[[Any], Mapping[str, str]] | None = attrs.field(
        default=None, validator=_optional_callable
    )


@attrs.frozen
class EnvironmentSpec:
    """An environment a multi-turn rollout drives, named by ``[run.generation] environment``.

    ``make(config) -> Environment`` makes the environment of one trajectory: ``config`` is an
    :class:`~relax_core.EnvironmentConfig` (the ``[run.generation.env]`` table as ``options``,
    the trajectory's id, the tool timeout). The environment implements
    :class:`~relax_core.Environment`: ``reset(prompt) -> Reset`` (the first messages, from a
    dataset row) and ``await step(turn) -> Observation`` (the policy's turn in; messages to
    append, an optional reward for the turn, ``done``). ``check(config) ->
    list[ConfigProblem]``: the problems of ``config.options`` (an ``EnvironmentConfig`` of the
    ``[run.generation.env]`` table, its key path ``config.path``, trajectory id ``"-"``), each
    at its key path, found before anything starts (``None``: ``make`` raises itself).
    ``options``: the keys ``[run.generation.env]`` may hold; ``None``: any.
    ``needs(options) -> Mapping[str, str]``: the engine features (:data:`ENGINE_FEATURES`) the
    environment needs with these options, each with the option that asks for it
    (``{"constrained_decoding": "guided_first_turn"}``; ``""``: the table as a whole); the
    ``multi-turn`` shape reports them as its own needs, so a backend that cannot provide one is
    refused before anything starts. ``None``: none.

    :raises ValueError: a bad name.
    """

    name: str = attrs.field(validator=_check_name)
    make: Callable[[Any], Any] = attrs.field(validator=attrs.validators.is_callable())
    options: tuple[str, ...] | None = attrs.field(default=(), converter=_optional_tuple_of_str)
    check: Callable[[Any], Any] | None = attrs.field(default=None, validator=_optional_callable)
    description: str = ""
    needs: Callable[[Mapping[str, Any]], Mapping[str, str]] | None = attrs.field(
        default=None, validator=_optional_callable
    )


# -- benchmarks --------------------------------------------------------------------------------


@attrs.frozen
class BenchmarkSpec:
    """A benchmark ``relax bench NAME`` runs (``relax bench`` alone lists them).

    ``run(quick=..., **options) -> dict`` measures and returns the JSON object ``relax bench
    NAME --json`` prints (JSON-serialisable); ``quick`` asks for a shorter run (smoke tests).
    ``add_arguments(parser)``, if given, adds the benchmark's own command-line options to its
    ``argparse`` parser; each option's value reaches ``run`` as a keyword argument of the
    option's ``dest``. ``format_result(result) -> str``, if given, is what ``relax bench NAME``
    prints without ``--json`` (else the JSON, indented). Report each number next to a baseline
    measured in the same run: shared machines are noisy. Import heavy dependencies inside
    ``run``, since plugins load in every ``relax`` command.

    :raises ValueError: a bad name.
    """

    name: str = attrs.field(validator=_check_name)
    run: Callable[..., Mapping[str, Any]] = attrs.field(validator=attrs.validators.is_callable())
    description: str = ""
    add_arguments: Callable[[Any], None] | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.is_callable())
    )
    format_result: Callable[[Mapping[str, Any]], str] | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.is_callable())
    )


# -- commands ----------------------------------------------------------------------------------


@attrs.frozen
class CommandSpec:
    """A sub-command of ``relax`` a plugin adds (``relax report RUN_DIR``).

    ``help``: its one line in ``relax --help`` (and its ``--help``'s description).
    ``add_arguments(parser)`` adds its arguments to its ``argparse`` parser; ``run(args) ->
    int`` runs it with the parsed ``argparse.Namespace`` and returns the exit status (a
    :class:`~relax_core.RelaxError` it raises is printed as ``relax NAME: error: …``, exit
    status 2). Import heavy libraries inside ``run``: every ``relax`` command builds its parser
    from every plugin's commands. A name the core's own commands have, or another plugin's, is
    refused with both named.

    :raises ValueError: a bad name, or ``add_arguments`` / ``run`` is not callable.
    """

    name: str = attrs.field(validator=_check_name)
    help: str = attrs.field(validator=attrs.validators.instance_of(str))
    add_arguments: Callable[[Any], None] = attrs.field(validator=attrs.validators.is_callable())
    run: Callable[[Any], int] = attrs.field(validator=attrs.validators.is_callable())

    @property
    def description(self) -> str:
        """What ``relax plugins`` shows of it: its ``help``."""
        return self.help
