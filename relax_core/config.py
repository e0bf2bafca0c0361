"""The job configuration file: one TOML document → frozen attrs models.

Parsing checks types, ranges, choices and references inside one role, and reports *every*
problem at once (:class:`~relax_core.errors.ConfigValidationError`), each with its key path and
a rule name; unknown keys get a "did you mean" hint. docs/configuration.md lists every key; the
cross-role rules belong to :func:`relax_core.placement.plan_inference_placement`."""

from __future__ import annotations

import difflib
import math
import re
import tomllib
import types
import typing
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs

from relax_core.errors import ConfigProblem, ConfigValidationError
from relax_core.records import NAME_PATTERN, ROUTE_MODES, EngineOptions

DEVICES = ("cuda", "cpu")
PG_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
_FLOAT_DTYPES = ("auto", "bfloat16", "bf16", "float16", "fp16", "half", "float32", "fp32")
DTYPES = (*_FLOAT_DTYPES, "fp8", "float8_e4m3fn", "fp8_e4m3", "fp8_e5m2", "int8", "int4")
#: ``placement.residency``: roles sharing GPUs stay resident together when the budget says they
#: fit (``planned``), or take turns (``exclusive``). Read by ``relax_core.coordination.residency``.
RESIDENCY_MODES = ("planned", "exclusive")

T = TypeVar("T")
R = TypeVar("R")


# -- the checks a value may need -----------------------------------------------------------------


def hint(key: str, known: Collection[str]) -> str:
    """``"; did you mean 'x'?"`` naming the one of ``known`` closest to ``key``, or ``""``."""
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


Check = Callable[[Any], "str | None"]


def _at_least(low: float) -> Check:
    return lambda v: None if v >= low else f"must be >= {low:g}, got {v!r}"


def _positive(v: Any) -> str | None:
    return None if v > 0 else f"must be > 0, got {v!r}"


def _fraction(open_high: bool) -> Check:
    def check(v: Any) -> str | None:
        if v <= 0 or v > 1 or (open_high and v >= 1):
            return f"must be in (0, 1{')' if open_high else ']'}, got {v!r}"
        return None

    return check


def _one_of(choices: Sequence[str]) -> Check:
    known = ", ".join(map(repr, choices))
    return lambda v: (
        None if v in choices else f"must be one of {known}, got {v!r}{hint(v, choices)}"
    )


def _finite(v: Any) -> str | None:
    return None if math.isfinite(v) else f"must be a finite number, got {v!r}"


def _non_empty(v: Any) -> str | None:
    return None if v.strip() else "must not be empty"


def _port(v: Any) -> str | None:
    return None if 0 <= v <= 65535 else f"must be a TCP port in 0..65535, got {v!r}"


def _checked(default: Any, check: Check) -> Any:
    """A field :meth:`ConfigReader.record` reads with ``check``."""
    return attrs.field(default=default, metadata={"check": check})


# -- the models --------------------------------------------------------------------------------


@attrs.frozen
class ClusterConfig:
    """``[cluster]``: ``num_nodes`` nodes of ``gpus_per_node`` GPUs each, and the memory
    budgets (each key: docs/configuration.md)."""

    num_nodes: int = _checked(1, _at_least(1))
    gpus_per_node: int = _checked(0, _at_least(0))
    gpu_memory_gib: float | None = _checked(None, _positive)
    host_memory_gib: float | None = _checked(None, _positive)
    cpus_per_bundle: float = _checked(1.0, _at_least(0))

    @property
    def total_gpus(self) -> int:
        """Every GPU of the cluster."""
        return self.num_nodes * self.gpus_per_node


@attrs.frozen
class TrainingConfig:
    """``[training]``: the training roles' GPU pools (0: absent) and how they share GPUs with
    inference (each key: docs/configuration.md)."""

    actor_gpus: int = _checked(0, _at_least(0))
    critic_gpus: int = _checked(0, _at_least(0))
    reference_gpus: int = _checked(0, _at_least(0))
    actor_forward_gpus: int = _checked(0, _at_least(0))
    colocate: bool | None = None
    offload: bool = False
    offload_resident_gib: float = _checked(1.0, _at_least(0))
    offload_host_gib: float = _checked(0.0, _at_least(0))
    ray_gpu_fraction: float | None = _checked(None, _fraction(False))

    def pools(self) -> tuple[tuple[str, int], ...]:
        """``(pool name, GPUs)`` of each present training role, actor first."""
        names = ("actor", "critic", "reference", "actor_forward")
        return tuple((name, n) for name in names if (n := getattr(self, f"{name}_gpus")) > 0)


@attrs.frozen
class PlacementConfig:
    """How inference is laid out: ``mode`` (a registered placement mode; ``None``: ``split``
    when training colocates, else ``decoupled``), the roles run in deferred phases, the Ray
    placement-group strategy and ``residency`` (:data:`RESIDENCY_MODES`)."""

    mode: str | None = None
    defer_roles: tuple[str, ...] = ()
    pg_strategy: str = _checked("PACK", _one_of(PG_STRATEGIES))
    residency: str = _checked("planned", _one_of(RESIDENCY_MODES))

    def resolved_mode(self, training: TrainingConfig) -> str:
        """The mode name in effect."""
        if self.mode is not None:
            return self.mode
        return "split" if training.colocate else "decoupled"


@attrs.frozen
class ServeSettings:
    """``[serve]``: how ``relax serve`` wakes the roles of a defer layout on demand (each key:
    docs/configuration.md)."""

    wake_timeout: float = attrs.field(default=60.0, validator=attrs.validators.gt(0))
    idle_seconds: float = attrs.field(default=300.0, validator=attrs.validators.ge(0))
    min_residency: float = attrs.field(default=5.0, validator=attrs.validators.ge(0))
    max_awake: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.ge(1))
    )
    operation_timeout: float = attrs.field(default=600.0, validator=attrs.validators.gt(0))


@attrs.frozen
class PlacementSettings:
    """Where a model's engines go and what they cost (what the planner and its budget read):
    ``num_gpus`` GPUs hold ``num_engines`` engines of ``gpus_per_engine`` (``tp x pp``) GPUs; a
    ``cpu`` model has 0 GPUs. Each key: docs/configuration.md."""

    num_gpus: int = 1
    gpus_per_engine: int = 1
    tp: int = 1
    pp: int = 1
    num_engines: int = 1
    bundle_start: int | None = None
    ray_gpu_fraction: float | None = None
    cuda_graph_gib: float = 1.0
    num_parameters: int | None = None


@attrs.frozen
class RouterSettings:
    """The router in front of an ``SGLANG_ROUTER`` model's heads: ``name`` (key ``router``;
    ``None``: the default router), ``policy`` (``router_policy``), ``allow_dropped_fields``
    (``router_allow_dropped_fields``) and ``args`` (``router_args``: extra router flags)."""

    name: str | None = None
    policy: str | None = None
    allow_dropped_fields: tuple[str, ...] = ()
    args: tuple[str, ...] = ()


@attrs.frozen
class HealthSettings:
    """How a model's live replicas are supervised: ``unhealthy_after`` consecutive failed
    health probes make a live replica FAILED (and rebuilt)."""

    unhealthy_after: int = 3


@attrs.frozen
class ModelConfig:
    """One model of a role: its identity and routing, and its placement, engine options, router
    and health checks as records of their own.

    ``path`` is the key path of its table (``roles.genrm.models.judge``). ``external_urls``:
    served by engines Relax does not start (no engine placed, ``backend`` unused).
    ``engine_table``: the model's ``engine`` table as written, checked against its backend's
    :attr:`~relax_core.records.EngineBackend.options` by :func:`relax_core.jobs.backend_options`."""

    role: str
    name: str
    path: str
    backend: str
    model_path: str
    device: str = "cuda"
    aliases: tuple[str, ...] = ()
    route_keys: tuple[str, ...] = ()
    route_mode: str | None = None
    weight_source: str | None = None
    served_model_name: str | None = None
    seed: int | None = None
    external_urls: tuple[str, ...] = ()
    placement: PlacementSettings = attrs.field(factory=PlacementSettings)
    engine: EngineOptions = attrs.field(factory=EngineOptions)
    router: RouterSettings = attrs.field(factory=RouterSettings)
    health: HealthSettings = attrs.field(factory=HealthSettings)
    engine_table: Mapping[str, Any] = attrs.field(factory=dict)

    @property
    def external(self) -> bool:
        """Served by engines Relax does not start (``external_urls``)."""
        return bool(self.external_urls)

    @property
    def engine_device(self) -> str:
        """The device the engine computes on: an SGLang-style ``--device X`` in ``extra_args``
        (e.g. an engine told ``--device cpu`` on a declared GPU bundle), else ``device``."""
        args = self.engine.extra_args
        for i, arg in enumerate(args):
            if arg == "--device" and i + 1 < len(args):
                return args[i + 1]
            if arg.startswith("--device="):
                return arg.split("=", 1)[1]
        return self.device


@attrs.frozen
class GatewayConfig:
    """The role gateway's listen address (``port`` ``None``: pick a free one) and where it runs:
    in a thread of ``relax serve``, or (``in_ray_actor``) in a CPU-only Ray actor of its own."""

    host: str = "127.0.0.1"
    port: int | None = _checked(None, _port)
    in_ray_actor: bool = False


@attrs.frozen
class RoleConfig:
    """An inference role and its models (in file order)."""

    name: str
    models: tuple[ModelConfig, ...]
    default_model: str | None = None
    policy: str | None = None
    num_gpus: int | None = None
    gateway: GatewayConfig = GatewayConfig()

    @property
    def model_names(self) -> tuple[str, ...]:
        """Model names in file order."""
        return tuple(m.name for m in self.models)

    def model(self, name: str) -> ModelConfig:
        """The model called ``name``; :class:`KeyError` naming the known ones otherwise."""
        found = {m.name: m for m in self.models}
        if name not in found:
            raise KeyError(f"role {self.name!r} has no model {name!r}; models: {tuple(found)}")
        return found[name]


@attrs.frozen
class JobConfig:
    """A whole job file. ``source`` is where it was read from (for messages); ``run`` is the
    ``[run]`` table as written (read by :func:`relax_core.run.config.parse_run_config`)."""

    cluster: ClusterConfig = ClusterConfig()
    training: TrainingConfig = TrainingConfig()
    placement: PlacementConfig = PlacementConfig()
    roles: tuple[RoleConfig, ...] = ()
    source: str | None = None
    run: Mapping[str, Any] = attrs.field(factory=dict)
    serve: ServeSettings = ServeSettings()

    def role(self, name: str) -> RoleConfig:
        """The role called ``name``; :class:`KeyError` naming the configured ones otherwise."""
        found = {r.name: r for r in self.roles}
        if name not in found:
            raise KeyError(f"role {name!r} is not configured; roles: {tuple(found)}")
        return found[name]

    @property
    def role_names(self) -> tuple[str, ...]:
        """Configured role names in file order."""
        return tuple(r.name for r in self.roles)

    def models(self) -> tuple[ModelConfig, ...]:
        """Every model of every role, roles in file order."""
        return tuple(m for r in self.roles for m in r.models)


# -- reading -----------------------------------------------------------------------------------


class ConfigReader:
    """Reads typed values out of a job file's tables with the job file's rules, collecting every
    problem (with its key path) instead of stopping at the first.

    The core reads its tables with it, and a plugin its own (a stage's table, an engine backend's
    options): an integer is accepted for a number, a bool never is; a ``check`` (one below, or any
    ``value -> problem text or None``) checks ranges and choices; unknown keys get a "did you
    mean" hint. Call :meth:`raise_problems` when done::

        r = ConfigReader()
        t = r.table(raw, "run.stages[2]", ("stage", "k", "mode"))
        k = r.value(t, "run.stages[2]", "k", int, 4, check=ConfigReader.at_least(1))
        how = ConfigReader.one_of(("mean", "max"))
        mode = r.value(t, "run.stages[2]", "mode", str, "mean", check=how)
        r.raise_problems(source)
    """

    #: The checks: factories (``at_least``, ``fraction``, ``one_of``) and plain ones.
    at_least = staticmethod(_at_least)
    positive = staticmethod(_positive)
    fraction = staticmethod(_fraction)
    one_of = staticmethod(_one_of)
    finite = staticmethod(_finite)
    non_empty = staticmethod(_non_empty)

    def __init__(self) -> None:
        self.problems: list[ConfigProblem] = []

    def problem(self, path: str, rule: str, message: str) -> None:
        """Record one problem: its key path, a rule name (``type``, ``range``, …), what is
        wrong and what to do."""
        self.problems.append(ConfigProblem(path, rule, message))

    def table(
        self,
        value: object,
        path: str,
        known: Collection[str],
        *,
        what: str = "key",
        tip: str = "",
        unlisted: Collection[str] = (),
    ) -> dict[str, Any]:
        """``value`` as a table whose keys are all in ``known`` (each other key is an
        ``unknown-<what>`` problem, ``tip`` appended); ``{}`` and a problem if it is not a
        table. ``unlisted`` keys are accepted (the caller says what became of them) but not
        offered as known in the message."""
        if not isinstance(value, dict):
            self.problem(path, "type", f"must be a table, got {type(value).__name__}")
            return {}
        offered = sorted(k for k in known if k not in unlisted)
        for key in value:
            if key not in known:
                self.problem(
                    f"{path}.{key}" if path else key,
                    f"unknown-{what}",
                    f"unknown {what}{hint(key, offered)} (known: {', '.join(offered)}){tip}",
                )
        return value

    def value(
        self,
        table: Mapping[str, Any],
        path: str,
        key: str,
        kind: type[T] | tuple[type, ...],
        default: Any = None,
        *,
        required: bool = False,
        check: Check | None = None,
    ) -> Any:
        """``table[key]`` if it is of ``kind`` and passes ``check``; else ``default`` and a
        problem at ``path.key`` (``required``: its absence is one too)."""
        full = f"{path}.{key}" if path else key
        if key not in table:
            if required:
                self.problem(full, "required", "is required")
            return default
        raw = table[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        accepted = (*kinds, int) if float in kinds else kinds
        ok = isinstance(raw, accepted) and not (isinstance(raw, bool) and bool not in kinds)
        if not ok:
            names = " or ".join(_KIND_NAMES.get(k, k.__name__) for k in kinds)
            self.problem(full, "type", f"must be {names}, got {raw!r}")
            return default
        if isinstance(raw, int) and float in kinds and not isinstance(raw, bool):
            raw = float(raw)
        msg = check(raw) if check is not None else None
        if msg:
            self.problem(full, "choice" if msg.startswith("must be one of") else "range", msg)
            return default
        return raw

    def str_list(self, table: Mapping[str, Any], path: str, key: str) -> tuple[str, ...]:
        """``table[key]`` as distinct non-empty strings (absent: empty)."""
        full = f"{path}.{key}"
        raw = table.get(key, [])
        if not isinstance(raw, list):
            self.problem(full, "type", f"must be a list of strings, got {raw!r}")
            return ()
        out: list[str] = []
        for i, item in enumerate(raw):
            if not isinstance(item, str) or not item:
                self.problem(f"{full}[{i}]", "type", f"must be a non-empty string, got {item!r}")
            elif item in out:
                self.problem(f"{full}[{i}]", "duplicate", f"{item!r} is listed twice")
            else:
                out.append(item)
        return tuple(out)

    def record(self, value: object, path: str, cls: type[R]) -> R | None:
        """An instance of the attrs class ``cls`` read from the table ``value``, or ``None`` and a
        problem for each bad key (at ``path.key``).

        The fields are the table's keys (others are ``unknown-key`` problems), each read as
        its annotation says: ``bool``, ``int``, ``float``, ``str``, any of them ``| None``,
        ``tuple[str, ...]`` or a ``typing.Literal`` of strings; an absent key takes the
        default. A field's ``metadata={"check": ...}`` (e.g. ``ConfigReader.at_least(0)``) checks
        its value too; a ``ValueError`` of the record's own validators is a problem at ``path``.
        Every field needs a default.

        :raises TypeError: ``cls`` is not an attrs class, or a field has a type or no default a job
            file cannot give (the record's author's mistake, not the file's)."""
        if not (isinstance(cls, type) and attrs.has(cls)):
            raise TypeError(f"ConfigReader.record: {cls!r} is not an attrs class")
        hints = typing.get_type_hints(cls)
        fields = [f for f in attrs.fields(cls) if f.init]
        readers = {f.alias or f.name: _field_reader(cls, f, hints[f.name]) for f in fields}
        before = len(self.problems)
        table = self.table(value, path, tuple(readers))
        kwargs = {key: read(self, table, path) for key, read in readers.items() if key in table}
        if len(self.problems) != before:
            return None
        try:
            return typing.cast(R, cls(**kwargs))
        except (TypeError, ValueError) as exc:
            self.problem(path, "value", str(exc))
            return None

    def raise_problems(self, source: str | None = None) -> None:
        """Raise every problem recorded so far at once; return when there is none.

        :raises ConfigValidationError: listing each problem (``source``: the job file; where
            it is a readable file, each problem whose key it writes ends with ``(FILE:LINE)``)."""
        if self.problems:
            problems: Sequence[ConfigProblem] = self.problems
            if source is not None:
                try:
                    text = Path(source).read_text(encoding="utf-8")
                except OSError:
                    pass  # a config given as text names a source that is not a file
                else:
                    problems = located(problems, text, source)
            raise ConfigValidationError(problems, source)


_KIND_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}

#: What :meth:`ConfigReader.record` reads one field with: ``(reader, table, path) -> value``.
_FieldReader = Callable[[ConfigReader, Mapping[str, Any], str], Any]


def _field_reader(cls: type, field: attrs.Attribute[Any], hint: Any) -> _FieldReader:
    """How a job file gives ``cls``'s ``field`` (annotated ``hint``); :class:`TypeError` when it
    cannot."""
    where = f"{cls.__qualname__}.{field.name}"
    if field.default is attrs.NOTHING:
        raise TypeError(f"{where}: give it a default (a job file may leave its key out)")
    key = field.alias or field.name
    given: Check | None = field.metadata.get("check")
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (types.UnionType, typing.Union) and type(None) in args:
        rest = tuple(a for a in args if a is not type(None))
        hint = rest[0] if len(rest) == 1 else hint
        args = typing.get_args(hint)
    if hint in (bool, int, float, str):  # value() makes an int given for a float one
        return lambda r, t, p: r.value(t, p, key, hint, None, check=given)
    if typing.get_origin(hint) is typing.Literal and args and all(isinstance(a, str) for a in args):
        choices = _one_of(args)

        def check(v: Any) -> str | None:
            return choices(v) or (given(v) if given is not None else None)

        return lambda r, t, p: r.value(t, p, key, str, None, check=check)
    if typing.get_origin(hint) is tuple and args == (str, ...):
        return lambda r, t, p: r.str_list(t, p, key)
    raise TypeError(
        f"{where}: a job file cannot give a {hint!r}; use bool, int, float, str (or None), "
        "tuple[str, ...] or a Literal of strings"
    )


_TOP = ("cluster", "training", "placement", "roles", "run", "serve")
_ROLE = ("models", "default_model", "policy", "num_gpus", "gateway")
#: The model table's keys: its own, then those of each of its records (every one flat in the
#: table, under the record's field name; the ``router*`` keys map to :class:`RouterSettings`
#: fields without the prefix), then the backend's ``engine`` table.
_NOT_OWN = ("role", "name", "path", "placement", "engine", "router", "health", "engine_table")
_MODEL_OWN = tuple(f.name for f in attrs.fields(ModelConfig) if f.name not in _NOT_OWN)
_ROUTER_KEYS = ("router", "router_policy", "router_allow_dropped_fields", "router_args")
_MODEL = (
    *_MODEL_OWN,
    *(f.name for f in attrs.fields(PlacementSettings)),
    *(f.name for f in attrs.fields(EngineOptions)),
    *_ROUTER_KEYS,
    *(f.name for f in attrs.fields(HealthSettings)),
    "engine",
)
#: How the model table's keys of :class:`~relax_core.records.EngineOptions` are read (the
#: records layer knows no reader): ``key: (type, default, check)``.
_ENGINE_KEYS: dict[str, tuple[type, Any, Check | None]] = {
    "dtype": (str, "auto", _one_of(DTYPES)),
    "kv_cache_dtype": (str, "auto", _one_of(DTYPES)),
    "mem_fraction_static": (float, None, _fraction(True)),
    "context_length": (int, None, _at_least(1)),
    "max_running_requests": (int, None, _at_least(1)),
    "dp": (int, 1, _at_least(1)),
    "dp_attention": (bool, False, None),
    "deterministic_inference": (bool, None, None),
    "weights_cpu_backup": (bool, None, None),
    "offload_weights": (bool, True, None),
}


def _model(r: ConfigReader, role: str, name: str, raw: object) -> ModelConfig | None:
    p = f"roles.{role}.models.{name}"
    before = len(r.problems)
    t = r.table(raw, p, _MODEL)
    v = r.value
    external_urls = _urls(r, t, p, "external_urls")
    is_external = "external_urls" in t
    if is_external:
        if not t.get("external_urls"):
            r.problem(f"{p}.external_urls", "required", "give at least one engine head's URL")
        for key in ("num_gpus", "gpus_per_engine", "num_engines", "bundle_start", "tp", "pp"):
            if key in t:
                r.problem(
                    f"{p}.{key}",
                    "external",
                    "a model served by external_urls starts no engine and uses no GPU; drop "
                    "this key",
                )
        if t.get("device", "cpu") != "cpu":
            r.problem(f"{p}.device", "external", "external engines use no GPU of this job")
        t = {**t, "device": "cpu", "num_engines": max(1, len(external_urls))}
    device = v(t, p, "device", str, "cuda", check=_one_of(DEVICES))
    pp = v(t, p, "pp", int, 1, check=_at_least(1))
    given_tp = v(t, p, "tp", int, None, check=_at_least(1))
    if device == "cpu":
        for key in ("num_gpus", "gpus_per_engine", "bundle_start"):
            if t.get(key) not in (None, 0):
                r.problem(
                    f"{p}.{key}", "device", "a device = 'cpu' model uses no GPU; drop this key"
                )
        num_engines = v(t, p, "num_engines", int, 1, check=_at_least(1))
        gpe, num_gpus, tp = 0, 0, given_tp or 1
    else:
        gpe_default = given_tp * pp if given_tp else None
        gpe = v(t, p, "gpus_per_engine", int, gpe_default, check=_at_least(1))
        tp = given_tp if given_tp else (gpe // pp if gpe and gpe % pp == 0 else 1)
        gpe = gpe or tp * pp
        given_engines = v(t, p, "num_engines", int, None, check=_at_least(1))
        num_gpus = v(t, p, "num_gpus", int, (given_engines or 1) * gpe, check=_at_least(1))
        if given_engines is not None and "num_gpus" in t and given_engines * gpe != num_gpus:
            r.problem(
                f"{p}.num_engines",
                "consistency",
                f"{given_engines} engines x gpus_per_engine {gpe} = {given_engines * gpe} GPUs, "
                f"but num_gpus = {num_gpus}; give only one of num_engines and num_gpus",
            )
        num_engines = num_gpus // gpe if gpe else 0
    env = t.get("env", {})
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(x, str) for k, x in env.items()
    ):
        r.problem(f"{p}.env", "type", "must be a table of string values")
        env = {}
    pd_prefill = v(t, p, "pd_prefill_engines", int, None, check=_at_least(1))
    if pd_prefill is not None and num_engines and pd_prefill >= num_engines:
        r.problem(
            f"{p}.pd_prefill_engines",
            "range",
            f"{pd_prefill} prefill engines leave no decode engine of the model's {num_engines}; "
            "give fewer prefill engines or more engines",
        )
    if pd_prefill is not None and is_external:
        r.problem(
            f"{p}.pd_prefill_engines",
            "external",
            "external engines are not started here: prefill/decode workers must be managed",
        )
    engine_table = _engine_table(r, t, p, is_external)
    own: dict[str, Any] = {
        "backend": v(t, p, "backend", str, "", required=not is_external),
        "model_path": v(t, p, "model_path", str, "", required=not is_external),
        "aliases": r.str_list(t, p, "aliases"),
        "route_keys": r.str_list(t, p, "route_keys"),
        "route_mode": v(t, p, "route_mode", str, None, check=_one_of(ROUTE_MODES)),
        "weight_source": v(t, p, "weight_source", str, None),
        "served_model_name": v(t, p, "served_model_name", str, None),
        "seed": v(t, p, "seed", int, None),
    }
    size = dict(num_gpus=num_gpus, gpus_per_engine=gpe, tp=tp, pp=pp, num_engines=num_engines)
    placement = PlacementSettings(
        **size,
        bundle_start=v(t, p, "bundle_start", int, None, check=_at_least(0)),
        ray_gpu_fraction=v(t, p, "ray_gpu_fraction", float, None, check=_fraction(False)),
        cuda_graph_gib=v(t, p, "cuda_graph_gib", float, 1.0, check=_at_least(0)),
        num_parameters=v(t, p, "num_parameters", int, None, check=_at_least(1)),
    )
    engine = EngineOptions(
        **{k: v(t, p, k, *how[:2], check=how[2]) for k, how in _ENGINE_KEYS.items()},
        extra_args=r.str_list(t, p, "extra_args"),
        env=dict(env),
        pd_prefill_engines=pd_prefill,
    )
    router = RouterSettings(
        name=v(t, p, "router", str, None),
        policy=v(t, p, "router_policy", str, None),
        allow_dropped_fields=r.str_list(t, p, "router_allow_dropped_fields"),
        args=r.str_list(t, p, "router_args"),
    )
    own["health"] = HealthSettings(v(t, p, "unhealthy_after", int, 3, check=_at_least(1)))
    own |= {"device": device, "external_urls": external_urls, "engine_table": engine_table}
    model = ModelConfig(role, name, p, placement=placement, engine=engine, router=router, **own)
    return model if len(r.problems) == before else None


def _engine_table(
    r: ConfigReader, t: Mapping[str, Any], p: str, is_external: bool
) -> dict[str, Any]:
    """The model's ``engine`` table as written (its backend's record reads it, later)."""
    table = t.get("engine", {})
    if not isinstance(table, dict):
        r.problem(
            f"{p}.engine",
            "type",
            f"must be a table of the {t.get('backend', 'engine')!r} backend's options, got "
            f"{type(table).__name__}",
        )
        return {}
    if table and is_external:
        r.problem(
            f"{p}.engine",
            "external",
            "external engines are not started here, so no backend reads their options; drop "
            "this table",
        )
    return dict(table)


def _urls(r: ConfigReader, t: Mapping[str, Any], p: str, key: str) -> tuple[str, ...]:
    """A list of distinct ``http(s)://host:port`` URLs (trailing ``/`` dropped)."""
    from urllib.parse import urlsplit

    out = []
    for i, url in enumerate(r.str_list(t, p, key)):
        where = f"{p}.{key}[{i}]"
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            port = None
        if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
            r.problem(where, "url", f"{url!r} is not an http://host:port URL of an engine head")
        elif parts.path.strip("/") or parts.query:
            r.problem(where, "url", f"{url!r}: give the head's base URL, no path")
        else:
            out.append(url.rstrip("/"))
    return tuple(out)


def _role(r: ConfigReader, name: str, raw: object) -> RoleConfig | None:
    p = f"roles.{name}"
    before = len(r.problems)
    t = r.table(raw, p, _ROLE)
    models_raw = t.get("models")
    if models_raw is None:
        r.problem(f"{p}.models", "required", f"add at least one [{p}.models.NAME] table")
    elif not isinstance(models_raw, dict) or not models_raw:
        r.problem(f"{p}.models", "type", f"must hold at least one [{p}.models.NAME] table")
    found = models_raw.items() if isinstance(models_raw, dict) else ()
    models = [m for n, raw in found if (m := _model(r, name, n, raw)) is not None]
    gateway = r.record(t.get("gateway", {}), f"{p}.gateway", GatewayConfig) or GatewayConfig()
    role = RoleConfig(
        name=name,
        models=tuple(models),
        default_model=r.value(t, p, "default_model", str, None),
        policy=r.value(t, p, "policy", str, None),
        num_gpus=r.value(t, p, "num_gpus", int, None, check=_at_least(0)),
        gateway=gateway,
    )
    _check_role_names(r, role)
    return role if len(r.problems) == before else None


def _check_role_names(r: ConfigReader, role: RoleConfig) -> None:
    """Model names, aliases and route keys of one role must resolve to exactly one model."""
    names: dict[str, str] = {m.name: m.name for m in role.models}
    alias = "alias {name!r} already names model {model!r} of role {role!r}; an alias must "
    taken: dict[str, tuple[dict[str, str], str]] = {
        "aliases": (names, alias + "resolve to one model"),
        "route_keys": ({}, "route key {name!r} is already mapped to model {model!r}"),
    }
    for field, (owner, message) in taken.items():
        for m in role.models:
            for i, name in enumerate(getattr(m, field)):
                if name in owner:
                    text = message.format(name=name, model=owner[name], role=role.name)
                    r.problem(f"{m.path}.{field}[{i}]", "duplicate", text)
                else:
                    owner[name] = m.name
    if role.default_model is not None and role.default_model not in names:
        r.problem(
            f"roles.{role.name}.default_model",
            "reference",
            f"{role.default_model!r} is not a model or alias of role {role.name!r}"
            f"{hint(role.default_model, names)} (models: {', '.join(role.model_names)})",
        )


def _role_name_ok(r: ConfigReader, name: object) -> bool:
    if isinstance(name, str) and NAME_PATTERN.match(name):
        return True
    r.problem(
        f"roles.{name}",
        "role-name",
        f"{name!r} is not a role name: a role name starts with a letter and holds only "
        "letters, digits, '_', '.' and '-'",
    )
    return False


def parse_config(
    data: Mapping[str, Any], *, source: str | None = None, role_names: Collection[str] | None = None
) -> JobConfig:
    """Build a :class:`JobConfig` from a parsed TOML document (or any nested dict).

    :param source: where ``data`` came from, for messages.
    :param role_names: the role names accepted under ``[roles]`` (``pm.registered("roles")``): any
        other is an ``unknown-role`` problem. ``None``: any well-formed name (the planner then
        rejects a role no plugin registers).
    :raises ConfigValidationError: with every problem found."""
    r = ConfigReader()
    top = r.table(dict(data), "", _TOP)
    cluster = r.record(top.get("cluster", {}), "cluster", ClusterConfig) or ClusterConfig()
    training = r.record(top.get("training", {}), "training", TrainingConfig) or TrainingConfig()
    placement = r.record(top.get("placement", {}), "placement", PlacementConfig)
    placement = placement or PlacementConfig()
    raw_roles = top.get("roles", {})
    if role_names is None:
        roles_raw = r.table(raw_roles, "roles", raw_roles if isinstance(raw_roles, dict) else ())
        known_roles: Collection[str] = [n for n in roles_raw if _role_name_ok(r, n)]
    else:
        known_roles = tuple(role_names)
        roles_raw = r.table(
            raw_roles,
            "roles",
            known_roles,
            what="role",
            tip="; a third-party role needs its plugin installed",
        )
    # A name not in known_roles is reported above, as an unknown or malformed role name.
    configured = {name: raw for name, raw in roles_raw.items() if name in known_roles}
    roles = [role for name, raw in configured.items() if (role := _role(r, name, raw)) is not None]
    for i, name in enumerate(placement.defer_roles):
        if name not in configured:
            r.problem(
                f"placement.defer_roles[{i}]",
                "reference",
                f"role {name!r} is not configured under [roles]{hint(name, configured)} "
                f"(configured: {', '.join(sorted(configured)) or 'none'})",
            )
    run = top.get("run", {})
    if not isinstance(run, dict):
        r.problem("run", "type", f"must be a table, got {type(run).__name__}")
    serve = r.record(top.get("serve", {}), "serve", ServeSettings) or ServeSettings()
    r.raise_problems(source)
    return JobConfig(cluster, training, placement, tuple(roles), source, run=run, serve=serve)


def loads_config(
    text: str, *, source: str | None = None, role_names: Collection[str] | None = None
) -> JobConfig:
    """Parse TOML text into a :class:`JobConfig` (see :func:`parse_config`).

    :raises ConfigValidationError: bad TOML syntax (rule ``toml``) or bad values."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigValidationError([_toml_problem(exc, text, source)], source) from exc
    return parse_config(data, source=source, role_names=role_names)


_TOML_AT = re.compile(r"\s*\(at line (\d+), column (\d+)\)$|\s*\(at end of document\)$")


def _toml_problem(exc: tomllib.TOMLDecodeError, text: str, source: str | None) -> ConfigProblem:
    """A TOML syntax error as ``FILE:LINE:COLUMN: [toml] what`` with the offending line."""
    message = str(exc)
    found = _TOML_AT.search(message)
    lines = text.splitlines()
    if found is not None and found.group(1):
        line, column = int(found.group(1)), int(found.group(2))
    else:  # at the end of the document
        line = max(len(lines), 1)
        column = len(lines[-1]) + 1 if lines else 1
    what = message[: found.start()] if found is not None else message
    shown = lines[line - 1].strip() if 0 < line <= len(lines) else ""
    quoted = f": {shown!r}" if shown else ""
    return ConfigProblem(
        f"{source or '<config>'}:{line}:{column}",
        "toml",
        f"not valid TOML: {what} (line {line}{quoted})",
    )


def load_config(path: str | Path, *, role_names: Collection[str] | None = None) -> JobConfig:
    """Read and parse a job file.

    :raises ConfigValidationError: the file is unreadable, not TOML, or has bad values; each
        problem whose key the file holds ends with where, ``(FILE:LINE)``."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigValidationError(
            [ConfigProblem(str(p), "file", f"cannot read the job file: {exc.strerror or exc}")],
            str(p),
        ) from exc
    return loads_config(text, source=str(p), role_names=role_names)


_HEADER = re.compile(r"^\s*(\[\[?)\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_KEY_LINE = re.compile(r"^\s*([A-Za-z0-9_\-\.\"']+)\s*=")
_INDEX = re.compile(r"\[\d+\]$")


def key_lines(text: str) -> dict[str, int]:
    """Each key path a TOML text writes (tables, array-of-table items as ``name[i]``, keys of
    both) and the 1-based line it is written on; keys inside inline tables are not listed."""
    found: dict[str, int] = {}
    counts: dict[str, int] = {}
    table = ""
    for number, line in enumerate(text.splitlines(), start=1):
        header = _HEADER.match(line)
        if header is not None:
            name = header.group(2).replace(" ", "").replace('"', "").replace("'", "")
            if header.group(1) == "[[":
                index = counts.get(name, 0)
                counts[name] = index + 1
                table = f"{name}[{index}]"
            else:
                table = name
            found.setdefault(table, number)
            continue
        key = _KEY_LINE.match(line)
        if key is not None:
            name = key.group(1).replace('"', "").replace("'", "")
            found.setdefault(f"{table}.{name}" if table else name, number)
    return found


def located(problems: Sequence[ConfigProblem], text: str, source: str) -> list[ConfigProblem]:
    """``problems`` with ``(SOURCE:LINE)`` appended to each whose key path (or, for an item of
    an inline array, its array's key) ``text`` writes; the others as they are."""
    lines = key_lines(text)
    out = []
    for problem in problems:
        line = lines.get(problem.path) or lines.get(_INDEX.sub("", problem.path))
        if line is None or problem.rule in ("toml", "file"):
            out.append(problem)
        else:
            out.append(attrs.evolve(problem, message=f"{problem.message} ({source}:{line})"))
    return out
