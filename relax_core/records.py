"""Frozen records that plugins register through the ``relax_register_*`` hooks.

Records are validated where they are built, so a plugin with a bad record fails at load time.
The lowest layer of the core (it imports none of it): the constants every layer shares live here."""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypedDict, Unpack, runtime_checkable

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
    "RunProbe",
    "RunProbeSpec",
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


_Validator = Callable[[object, "attrs.Attribute[Any]", Any], None]


def _rule(ok: Callable[[Any], bool], what: str) -> _Validator:
    """An attrs validator: ``ValueError("Record.field=value: <what>")`` unless ``ok(value)``."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not ok(value):
            raise ValueError(f"{type(instance).__name__}.{attribute.name}={value!r}: {what}")

    return check


_check_name = _rule(
    lambda v: isinstance(v, str) and NAME_PATTERN.match(v) is not None,
    "a name starts with a letter and holds only letters, digits, '_', '.' and '-'",
)
_optional_callable = _rule(lambda v: v is None or callable(v), "give a callable or None")
_callable = _rule(callable, "give a callable")
_retries = _rule(
    lambda v: type(v) is int and v >= 0,
    "give an int >= 0 (how many times a failed idempotent request is sent again)",
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
    inputs = tuple(_json_copy("generate_inputs", list(value)))
    for i, branch in enumerate(inputs):
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
                f"OpenAPINotes.generate_inputs[{i}]: an input is an object schema whose 'required' "
                "lists its input field (and any other required field), each described in "
                '\'properties\', e.g. {"required": ["messages"], "properties": {"messages": {...}}}'
            )
    return inputs


def _json_fields(value: object) -> Any:
    value = _json_copy("generate_fields", value)
    if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
        raise ValueError(
            "OpenAPINotes.generate_fields: give {field name: JSON Schema object}, e.g. "
            '{"token_ids_logprob": {"type": "array", "items": {"type": "integer"}}}'
        )
    return value


def _json_answer(value: object) -> Any:
    value = _json_copy("generate_answer", value)
    if value is not None and not isinstance(value, dict):
        raise ValueError("OpenAPINotes.generate_answer: give a JSON Schema object or None")
    return value


_BOOL = attrs.validators.instance_of(bool)


@attrs.frozen
class OpenAPINotes:
    """What a role's OpenAPI document adds to the common one (``relax_core.gateway.openapi``).

    ``generate_summary``: words appended to the ``/generate`` summary. ``batched_generate``:
    ``text`` and ``input_ids`` may also be lists. ``generate_inputs``: extra alternatives to
    ``text`` / ``input_ids``, each an object schema whose ``required`` names the input field first
    and whose ``properties`` describe it (matching the role adapter's ``generate_inputs``).
    ``generate_fields``: extra optional request fields, ``{name: JSON Schema}``.
    ``generate_answer``: the JSON Schema of a non-streamed ``200`` answer (``None``: SGLang's).

    Every value is copied on construction; :raises ValueError: a value is not JSON, or an input
    schema has no ``required`` field it also describes in ``properties``."""

    generate_summary: str = attrs.field(default="", validator=attrs.validators.instance_of(str))
    batched_generate: bool = attrs.field(default=False, validator=_BOOL)
    generate_inputs: tuple[dict[str, Any], ...] = attrs.field(
        default=(), converter=_json_inputs, hash=False
    )
    generate_fields: dict[str, Any] = attrs.field(factory=dict, converter=_json_fields, hash=False)
    generate_answer: dict[str, Any] | None = attrs.field(
        default=None, converter=_json_answer, hash=False
    )

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


_check_health_schema = _rule(lambda v: not isinstance(v, bool) and v in (1, 2), "must be 1 or 2")


@attrs.frozen
class RoleSpec:
    """An inference role: everything the core knows about it (the core names no role).

    ``allowed_weight_sources``: weight sources a model of this role may use;
    ``default_weight_source`` (one of them) when a model names none. ``default_route_mode``: the
    :class:`RouteMode` of a model without ``route_mode``. ``deferrable``: the role may be listed
    in ``placement.defer_roles`` (a scorer on GPUs it time-shares). ``generation_phase``: the role
    generates the training batch; its models run in the generation phase, whose bundles deferred
    roles reuse (never deferrable too). ``health_schema``: what ``GET /{role}/health`` answers
    without ``?schema=``: 2 (the unified readiness body) or 1 (the legacy ``{status,
    healthy_engines, total_engines}``). ``title``: the role's name in plans (default: the name,
    capitalised). ``openapi``: :class:`OpenAPINotes`. ``gateway_adapter``: zero-argument factory of
    the role's ``RoleAdapter`` (``None``: requests pass unchanged). ``deterministic_inference``:
    the role's engines run batch-invariant by default (a model's key overrides it).

    :raises ValueError: a field is invalid; the message names the field."""

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
        factory=OpenAPINotes, validator=attrs.validators.instance_of(OpenAPINotes), kw_only=True
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
    """The engine options every backend may read: the job file's model keys of the same names
    (docs/configuration.md), passed to each launch as :attr:`EngineLaunchSpec.options`.

    ``None`` means the backend's default. ``deterministic_inference`` (``None``: the role's default)
    and ``weights_cpu_backup`` (``None``: the weight source decides) are always decided in a launch.
    ``offload_weights = False``: an offload keeps the weights on the GPU (the manager's).
    ``pd_prefill_engines``: the first that many replicas are prefill workers, the rest decode.
    Options one backend alone reads are its own record (:attr:`EngineBackend.options`)."""

    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    mem_fraction_static: float | None = None
    context_length: int | None = None
    max_running_requests: int | None = None
    dp: int = 1
    dp_attention: bool = False
    deterministic_inference: bool | None = None
    weights_cpu_backup: bool | None = None
    offload_weights: bool = True
    extra_args: tuple[str, ...] = attrs.field(default=(), converter=_tuple_of_str)
    env: Mapping[str, str] = attrs.field(factory=dict, converter=_env)
    pd_prefill_engines: int | None = None


@attrs.frozen
class EngineLaunchSpec:
    """Everything an engine backend needs to start one engine server process.

    A multi-node replica has one launch per node: ``node_rank`` 0 is the head (HTTP on
    ``host:port``), the others join ``dist_init_addr``. ``static``: the weight source allows no
    update path (keep a CPU weight backup, refuse LoRA and dummy weights). ``replica_index`` is
    stable across rebuilds. ``options``: the model's :class:`EngineOptions`, decided;
    ``backend_options``: an instance of :attr:`EngineBackend.options` read from the model's
    ``engine`` table (``None``: no such record, or a spec built by hand)."""

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

    def wait_ready(self, timeout: float) -> None:
        """Block until the server answers ``/health``; raise ``LifecycleError`` on timeout/exit."""

    def poll(self) -> int | None:
        """The exit code, or ``None`` while the process runs."""

    def terminate(self, timeout: float) -> int:
        """Stop the process (SIGTERM, then SIGKILL after ``timeout``); return its exit code."""


def _check_options_record(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        return
    where = f"{type(instance).__name__}.{attribute.name}={value!r}"
    if not (isinstance(value, type) and attrs.has(value)):
        raise ValueError(f"{where}: give an attrs frozen class (the table's keys) or None")
    # A model without an ``engine`` table gets the record's defaults.
    if missing := [f.name for f in attrs.fields(value) if f.default is attrs.NOTHING]:
        raise ValueError(f"{where}: give every field a default; {', '.join(missing)} has none")


@attrs.frozen
class EngineBackend:
    """An engine backend (``hf``, ``sglang``, …).

    ``launch(spec) -> EngineProcess`` starts one engine server and returns at once;
    ``control_client(base_url)`` builds the control client of a head. ``devices``: where it runs.
    ``model_hint``: how a user makes a model directory it serves (shown by the preflight when
    ``model_path`` is missing). ``loads_model_dir``: an engine loads ``model_path`` (``False``: a
    simulator, for which it is only a name). ``options``: the backend's options record, an attrs
    frozen class whose fields (each with a default, of a type :meth:`ConfigReader.record
    <relax_core.config.ConfigReader.record>` reads) are the keys of a model's ``engine`` table; each
    launch gets an instance as :attr:`EngineLaunchSpec.backend_options` (``None``: no ``engine``
    table). ``missing(feature) -> str | None``: ``None`` when this install provides an
    :data:`ENGINE_FEATURES` feature, else what to install; asked by the run's preflight
    (``missing=None``: every feature). ``keeps_graphs(options, extra_args) -> bool``: a model's
    CUDA graphs stay on its GPUs while it sleeps (the budget counts them in every other phase).

    :raises ValueError: a bad name, or ``options`` is not an attrs class whose every field has a
        default."""

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
    keeps_graphs: Callable[[Any, tuple[str, ...]], bool] | None = attrs.field(
        default=None, validator=_optional_callable
    )


@attrs.frozen
class WeightSource:
    """Where a model's weights come from and which update paths it allows.

    ``update_paths`` is a subset of :data:`UPDATE_PATHS`; ``publishes_version`` says whether the
    snapshot carries a ``weight_version`` for models of this source."""

    name: str = attrs.field(validator=_check_name)
    update_paths: frozenset[str] = attrs.field(converter=_frozenset_of_str)
    publishes_version: bool
    description: str = ""

    @update_paths.validator
    def _check_paths(self, _a: object, value: frozenset[str]) -> None:
        if unknown := value - UPDATE_PATHS:
            raise ValueError(
                f"WeightSource {self.name!r}: unknown update paths {sorted(unknown)}; "
                f"known: {sorted(UPDATE_PATHS)}"
            )

    def cpu_backup(self, offload_weights: bool, asked: bool | None, /) -> bool:
        """Whether a model of this source keeps a CPU copy of its weights: always where an
        offload releases them and no update path could bring them back; else as ``asked``."""
        return (not self.update_paths and offload_weights) or bool(asked)


@attrs.frozen
class RewardSpec:
    """A reward adapter: turns a response (and its label) into a reward.

    ``fn(response, label)`` (plus ``metadata=`` when ``pass_metadata``) returns a number or a
    :class:`~relax_core.coordination.RewardResult`. ``mode``: ``sync`` functions run in Ray worker
    tasks; ``async`` coroutine functions run on the scoring loop and get ``context=``
    (:class:`~relax_core.coordination.RewardContext`). ``label_matcher(label) -> bool``: the
    samples it scores (``None``: all). ``supports_deferred``: it may score a staged batch in a
    deferred phase. ``retries``: how many times the reward stage calls ``fn`` again after a
    transport failure or a 5xx (only for an idempotent call; a stage's ``retries`` overrides it).

    :raises ValueError: a bad name or field, or ``mode`` does not match ``fn``."""

    name: str = attrs.field(validator=_check_name)
    fn: Callable[..., Any] = attrs.field(validator=attrs.validators.is_callable())
    mode: str = attrs.field(default="sync", validator=attrs.validators.in_({"sync", "async"}))
    pass_metadata: bool = attrs.field(default=False, validator=_BOOL)
    label_matcher: Callable[[str | None], bool] | None = attrs.field(
        default=None, validator=_optional_callable
    )
    supports_deferred: bool = attrs.field(default=False, validator=_BOOL)
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

    def select(self, **request: Unpack[Selection]) -> Any:
        """The chosen one of ``candidates`` (keyword arguments: :class:`Selection`)."""


class Selection(TypedDict):
    """What :meth:`ReplicaSelector.select` is asked with (each a keyword argument)."""

    role: str
    epoch: str
    model: str
    candidates: tuple[Any, ...]
    affinity_key: str | None
    inflight: Mapping[str, int] | None


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

    ``assign(ctx: ModeContext) -> ModeResult`` picks each GPU model's pool, phase and first
    bundle (the planner checks the rules). ``shares_training_pool``: inference lives in the actor
    pool. ``supports_defer``: roles may be deferred."""

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

    ``router_id`` names it in logs (``rollout/policy``). ``port`` / ``metrics_port`` 0: free
    ports. ``pd``: heads register as prefill or decode workers. ``allow_dropped_fields``: request
    fields the caller lets the router drop (any other refuses the router at start).
    ``extra_args`` are appended to its command line (retries and the circuit breaker stay off).
    ``served_model_name`` / ``model_path``: what the heads report, so the router's probe workers
    report the same (smg 1.13 drops sampling parameters while it knows two models)."""

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

    The manager calls :meth:`sync` at every publish with each head that has been READY and is not
    stopping, failing or scaled in; a new head is registered (and healthy) before it is published
    READY, a leaving one removed before its engine stops."""

    def sync(self, heads: Mapping[str, str]) -> None:
        """Register new heads, remove the ones gone. Blocking, idempotent; never raises: a
        failed registration is kept and reported by the router's ``check()``."""


@runtime_checkable
class RouterProcess(RouterMembership, Protocol):
    """A running router, as returned by ``RouterBackend.launch`` (it returns at once)."""

    @property
    def url(self) -> str:
        """``http://host:port`` callers use (published as ``router_url``)."""

    def wait_ready(self, timeout: float) -> None:
        """Block until the router serves, speaks a known worker API and keeps every request
        field; raise ``ConfigError`` (a field is dropped) or ``LifecycleError``."""

    def check(self) -> list[str]:
        """Restart a dead router, retry failed registrations; return what is wrong now."""

    def pids(self) -> list[int]:
        """The router's process ids (empty once stopped)."""

    def terminate(self, timeout: float) -> None:
        """Stop the router (SIGTERM, then SIGKILL after ``timeout``). Idempotent."""


@attrs.frozen
class RouterBackend:
    """A router that fronts a model's replica heads (``sglang-router``, ``smg``, …).

    ``launch(spec) -> RouterProcess`` returns at once. ``policies``: those it supports;
    ``default_policy`` when the model names none. ``worker_api``: one of
    :data:`ROUTER_WORKER_APIS`. ``keeps_unknown_fields``: it forwards fields it does not know.
    ``pd``: it routes prefill/decode workers. ``version``: ``None`` when not installed (listed,
    refused at start). ``default``: chosen for a model that names no router."""

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
        what = "it is not a class"
        if isinstance(value, type):
            what = f"it has no {' and no '.join(missing)} method"
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name}={value!r}: {what}; give the trainer "
            "class, built from a TrainerContext, with train(batch_id) and push(weight_version)"
        )


@attrs.frozen
class TrainerSpec:
    """A trainer ``relax run`` starts by name (``[run] trainer = "grpo"``).

    ``trainer_class(context)`` is built from a :class:`~relax_core.TrainerContext` in its own Ray
    actor and implements :class:`~relax_core.Trainer`; its module must import in the actor's
    worker and should not import torch at module level (plugins load in every command).
    ``options``: an attrs frozen class whose fields (each with a default) are ``[run]`` keys,
    read as :meth:`~relax_core.ConfigReader.record` reads and given as ``context.options``.
    ``check(run) -> list[ConfigProblem]``: problems across the table, found before anything
    starts. ``default``: the one used when several are installed and the job names none.

    :raises ValueError: a bad name, ``trainer_class`` is not a class with both methods, or
        ``options`` is not an attrs class whose every field has a default."""

    name: str = attrs.field(validator=_check_name)
    trainer_class: type[Any] = attrs.field(validator=_check_trainer_class)
    description: str = ""
    options: type[Any] | None = attrs.field(default=None, validator=_check_options_record)
    check: Callable[[Any], Sequence[Any]] | None = attrs.field(
        default=None, validator=_optional_callable
    )
    default: bool = attrs.field(default=False, validator=_BOOL)


# -- trackers ----------------------------------------------------------------------------------


@attrs.frozen
class TrackerSpec:
    """An experiment tracker named in ``[run] trackers`` or by ``--tracker``.

    ``open(context) -> Tracker`` (a :class:`~relax_core.TrackerContext` in, a
    :class:`~relax_core.Tracker` out) is called in the driver when the steps begin: import the
    tracking library inside it. ``options``: the keys an entry may hold besides ``tracker``
    (``None``: any).

    :raises ValueError: a bad name, or an option named ``tracker``."""

    name: str = attrs.field(validator=_check_name)
    open: Callable[[Any], Any] = attrs.field(validator=attrs.validators.is_callable())
    options: tuple[str, ...] | None = attrs.field(default=(), converter=_optional_tuple_of_str)
    description: str = ""

    @options.validator
    def _check_tracker_options(self, _a: object, value: tuple[str, ...] | None) -> None:
        if bad := [k for k in value or () if k == "tracker" or not NAME_PATTERN.match(k)]:
            raise ValueError(
                f"TrackerSpec {self.name!r}.options: option names are keys of the tracker's "
                f"entry (not {bad}; 'tracker' names the tracker itself)"
            )


# -- run probes --------------------------------------------------------------------------------


class RunProbe(Protocol):
    """One run's measurement, started by a :class:`RunProbeSpec` before the first step."""

    def coordinator(self, coordinator: Any) -> Any:
        """What the driver calls instead of the run's :class:`~relax_core.Coordinator` (its
        ``activate`` / ``deactivate`` switch a deferred role in and out)."""

    def rollout(self, handle: Any) -> Any:
        """What the driver calls instead of the generation model's
        :class:`~relax_core.ManagerHandle` (its ``onload`` / ``offload``: rollout's switches)."""

    async def report(self, trainer: Any, step_seconds: float) -> dict[str, Any]:
        """The summary's ``switching`` object (``docs/plugins.md``: the keys the text output
        reads), asked once after the last step (never of an interrupted run); ``trainer``: the
        run's :class:`~relax_core.Trainer`; ``step_seconds``: the committed steps' seconds."""


@attrs.frozen
class RunProbeSpec:
    """What ``relax run --measure`` measures: the probe named ``switching``, whose report is the
    summary's ``switching``.

    ``start(heads=, generation_role=, step_of=) -> RunProbe``, once per run: ``await
    heads(role)``: the base URLs of a role's engine heads; ``step_of(direction)``: the step a
    switch of the generation role (``"onload"`` / ``"offload"``) belongs to.

    :raises ValueError: a bad name, or ``start`` is not callable."""

    name: str = attrs.field(validator=_check_name)
    start: Callable[..., RunProbe] = attrs.field(validator=_callable)
    description: str = ""


# -- step stages -------------------------------------------------------------------------------


@runtime_checkable
class PluginLookup(Protocol):
    """Where a stage's or a source's builder looks records up: the job's plugin manager
    (``registered("reward_adapters")["exact-match"].record``)."""

    def registered(self, kind: str) -> Mapping[str, Any]: ...


def _option_names(table: str, reserved: set[str], why: str) -> _Validator:
    """A validator of option names: each a record name, none of ``reserved`` (keys of ``table``
    that are not options: ``why``)."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        bad = [k for k in value or () if not isinstance(k, str) or not NAME_PATTERN.match(k)]
        taken = sorted(reserved & set(value or ()))
        if bad or taken:
            raise ValueError(
                f"{type(instance).__name__}.{attribute.name}: option names are keys of {table} "
                f"(not {sorted(map(str, bad)) or taken}; {why})"
            )

    return check


_check_options = _option_names(
    "the stage's table",
    {"stage", "name", "role", "models", "retries"},
    "stage, name, role, models and retries are every stage's own",
)


@attrs.frozen
class StageSpec:
    """A kind of step stage that ``[[run.stages]]`` lists by name (``stage = "distill"``).

    ``build(config) -> Stage``: a :class:`~relax_core.StageConfig` in (read it with
    :class:`~relax_core.ConfigReader`; raise :class:`~relax_core.ConfigValidationError`), a
    :class:`~relax_core.Stage` out; pure, since every stage is built to check the job.
    ``options``: keys besides the common ones (``None``: any, ``build`` checks). ``needs_role``:
    ``role`` is required. ``retries``: the default of a stage's ``retries`` key (only for
    idempotent requests).

    :raises ValueError: a bad name, an option named like a common key, ``retries`` < 0."""

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
    if bad := [s for s in value if not s.startswith(".") or len(s) < 2]:
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name}: file suffixes start with a dot "
            f"('.jsonl'), got {bad}"
        )


@attrs.frozen
class DataSourceSpec:
    """A prompt source, named by ``dataset`` or chosen by one of its file ``suffixes``.

    ``open(request) -> PromptSource`` (a :class:`~relax_core.SourceRequest` in). ``check(request)
    -> list[ConfigProblem]``: every problem with its data, found before anything starts
    (``None``: ``open`` raises :class:`~relax_core.ConfigValidationError` itself).

    :raises ValueError: a bad name or suffix."""

    name: str = attrs.field(validator=_check_name)
    open: Callable[[Any], Any] = attrs.field(validator=attrs.validators.is_callable())
    suffixes: tuple[str, ...] = attrs.field(
        default=(), converter=_tuple_of_str, validator=_check_suffixes
    )
    check: Callable[[Any], Any] | None = attrs.field(default=None, validator=_optional_callable)
    description: str = ""


# -- rollout shapes and environments ---------------------------------------------------------


_check_shape_options = _option_names(
    "the [run.generation] table", {"shape"}, "'shape' names the shape itself"
)


@attrs.frozen
class RolloutShapeSpec:
    """How a step's prompts become groups of samples, named by ``[run.generation] shape``.

    ``build(config) -> RolloutShape`` (a :class:`~relax_core.RolloutShapeConfig` in; raises
    :class:`~relax_core.ConfigValidationError`); pure, built when the run is checked and again in
    the driver. ``options``: keys besides ``shape`` (``None``: any). ``needs(config)``: the
    :data:`ENGINE_FEATURES` it needs, each with the key path asking for it, checked against the
    backend's :attr:`EngineBackend.missing` before anything starts.

    :raises ValueError: a bad name or option name."""

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

    ``make(config)``: the environment of one trajectory; ``config`` and the environment's
    contract are those of the rollout shape that drives it (``docs/plugins.md``).
    ``check(config) -> list[ConfigProblem]``: the problems of ``[run.generation.env]`` (trajectory
    id ``"-"``), found before anything starts (``None``: ``make`` raises). ``options``: its keys
    (``None``: any). ``needs(options)``: the :data:`ENGINE_FEATURES` it needs, each with the
    option asking for it (``""``: the whole table).

    :raises ValueError: a bad name."""

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
    """A benchmark ``relax bench NAME`` runs.

    ``run(quick=..., **options) -> dict``: the JSON object ``--json`` prints. ``add_arguments``
    adds its own options (each reaches ``run`` by ``dest``); ``format_result(result) -> str``: the
    text output (else indented JSON). Import heavy dependencies inside ``run``.

    :raises ValueError: a bad name."""

    name: str = attrs.field(validator=_check_name)
    run: Callable[..., Mapping[str, Any]] = attrs.field(validator=attrs.validators.is_callable())
    description: str = ""
    add_arguments: Callable[[Any], None] | None = attrs.field(
        default=None, validator=_optional_callable
    )
    format_result: Callable[[Mapping[str, Any]], str] | None = attrs.field(
        default=None, validator=_optional_callable
    )


# -- commands ----------------------------------------------------------------------------------


@attrs.frozen
class CommandSpec:
    """A sub-command of ``relax`` a plugin adds (``relax report RUN_DIR``).

    ``help``: its line in ``relax --help``. ``add_arguments(parser)``; ``run(args) -> int``: the
    exit status (a :class:`~relax_core.RelaxError` prints ``relax NAME: error: …``, status 2).
    Import heavy libraries inside ``run``. A name taken by the core or another plugin is refused.

    :raises ValueError: a bad name, or ``add_arguments`` / ``run`` is not callable."""

    name: str = attrs.field(validator=_check_name)
    help: str = attrs.field(validator=attrs.validators.instance_of(str))
    add_arguments: Callable[[Any], None] = attrs.field(validator=attrs.validators.is_callable())
    run: Callable[[Any], int] = attrs.field(validator=attrs.validators.is_callable())

    @property
    def description(self) -> str:
        """What ``relax plugins`` shows of it: its ``help``."""
        return self.help
