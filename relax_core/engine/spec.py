"""What an engine may do: :class:`InferenceEngineSpec` (role, weight source, allowed operations,
strict drain), checked by the manager, the engine worker and the admission server."""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from relax_core.engine.tags import ALL_TAGS, ResidentTag
from relax_core.errors import CapabilityError
from relax_core.records import UPDATE_PATHS, RoleSpec, WeightSource

GENERATION_OPERATIONS = frozenset({"generate", "chat", "completions", "abort"})
LIFECYCLE_OPERATIONS = frozenset({"onload", "offload"})
#: Every operation name an :class:`InferenceEngineSpec` may allow.
OPERATIONS = GENERATION_OPERATIONS | LIFECYCLE_OPERATIONS | UPDATE_PATHS

#: Engine HTTP paths of each update path (what the admission server refuses at the public port).
UPDATE_ENDPOINTS: dict[str, tuple[str, ...]] = {
    "tensor": ("/update_weights_from_tensor",),
    "distributed": (
        "/update_weights_from_distributed",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
    ),
    "disk": ("/update_weights_from_disk",),
    "lora": ("/load_lora_adapter", "/unload_lora_adapter"),
    "seed_sync": ("/update_weight_version", "/set_random_seed"),
}


def _ops(value: Iterable[str] | None) -> frozenset[str] | None:
    return None if value is None else frozenset(str(v) for v in value)


@attrs.frozen
class InferenceEngineSpec:
    """The capabilities of one model's engines.

    :param role: the role name (``rollout``, ``genrm``, ``teacher``, …).
    :param weight_source: the weight-source record (``plugin_manager.weight_source("STATIC")``).
    :param allowed_operations: default: generation, lifecycle and every update path of the
        weight source (none outside it).
    :param strict_drain: offload waits for in-flight requests (up to the drain deadline).
    :param checkpoint_dir: the versioned checkpoint directory (required by DCS sources).
    :param weights_cpu_backup: the engine keeps a CPU copy of its weights (STATIC: always, but
        where ``offload_weights`` is ``False``).
    :param offload_weights: an offload releases the weights too (``False``: they stay on the GPU
        while the model sleeps; only its KV cache and CUDA graphs are released).
    :raises ValueError: a field is invalid; the message names the field."""

    role: str
    weight_source: WeightSource = attrs.field(validator=attrs.validators.instance_of(WeightSource))
    allowed_operations: frozenset[str] = attrs.field(default=None, converter=_ops)
    strict_drain: bool = True
    checkpoint_dir: str | None = None
    weights_cpu_backup: bool = False
    offload_weights: bool = True

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.role, str) or not self.role:
            raise ValueError(f"InferenceEngineSpec.role={self.role!r}: give the role's name")
        if self.allowed_operations is None:
            default = GENERATION_OPERATIONS | LIFECYCLE_OPERATIONS | self.weight_source.update_paths
            object.__setattr__(self, "allowed_operations", frozenset(default))
        if unknown := self.allowed_operations - OPERATIONS:
            raise ValueError(
                f"InferenceEngineSpec.allowed_operations: unknown operations {sorted(unknown)}; "
                f"known: {sorted(OPERATIONS)}"
            )
        refused = (self.allowed_operations & UPDATE_PATHS) - self.weight_source.update_paths
        if refused:
            raise ValueError(
                f"InferenceEngineSpec.allowed_operations: {sorted(refused)} are not update paths "
                f"of weight source {self.weight_source.name!r} (it allows "
                f"{sorted(self.weight_source.update_paths) or 'none'}); remove them or pick "
                "another weight source"
            )
        if self.needs_checkpoint_dir and not self.checkpoint_dir:
            raise ValueError(
                f"InferenceEngineSpec.checkpoint_dir: weight source {self.weight_source.name!r} "
                "pulls versioned checkpoints from disk; set checkpoint_dir to the directory "
                "holding version-N/ sub-directories"
            )
        backup = self.weight_source.cpu_backup(self.offload_weights, self.weights_cpu_backup)
        object.__setattr__(self, "weights_cpu_backup", backup)

    @classmethod
    def for_role(
        cls, role: RoleSpec, weight_source: WeightSource, **kwargs: object
    ) -> InferenceEngineSpec:
        """A spec for ``role`` with ``weight_source``.
        :raises ValueError: the role does not allow the weight source."""
        if weight_source.name not in role.allowed_weight_sources:
            raise ValueError(
                f"InferenceEngineSpec.weight_source: role {role.name!r} does not allow weight "
                f"source {weight_source.name!r}; allowed: {sorted(role.allowed_weight_sources)}"
            )
        return cls(role=role.name, weight_source=weight_source, **kwargs)  # type: ignore[arg-type]

    @property
    def is_static(self) -> bool:
        """True when the weight source allows no update path at all."""
        return not self.weight_source.update_paths

    @property
    def offload_tags(self) -> frozenset[str]:
        """What an offload releases unless told: every tag, but the weights where they stay."""
        return ALL_TAGS if self.offload_weights else ALL_TAGS - {ResidentTag.WEIGHTS}

    @property
    def discards_weights(self) -> bool:
        """Whether an offload throws the weights away (released, with no CPU copy)."""
        return self.offload_weights and not self.weights_cpu_backup

    @property
    def needs_checkpoint_dir(self) -> bool:
        """True for a versioned, disk-only source (DCS and its kind)."""
        return self.weight_source.update_paths == frozenset({"disk"}) and bool(
            self.weight_source.publishes_version
        )

    @property
    def update_paths(self) -> frozenset[str]:
        """The update paths this engine allows."""
        return self.allowed_operations & UPDATE_PATHS

    @property
    def publishes_version(self) -> bool:
        """Whether the model's snapshot carries a ``weight_version``."""
        return bool(self.weight_source.publishes_version)

    def check(self, operation: str, *, engine_id: str) -> None:
        """Raise :class:`CapabilityError` unless ``operation`` is allowed."""
        if operation not in OPERATIONS:
            raise CapabilityError(
                f"engine {engine_id!r}: unknown operation {operation!r}; "
                f"known: {sorted(OPERATIONS)}"
            )
        if operation in self.allowed_operations:
            return
        raise CapabilityError(self.refusal(operation, engine_id=engine_id))

    def refusal(self, operation: str, *, engine_id: str) -> str:
        """The message a refused ``operation`` gets (the manager's and the admission door's)."""
        source = self.weight_source.name
        if operation in UPDATE_PATHS and self.is_static:
            what = "LoRA adapters" if operation == "lora" else f"{operation!r} weight updates"
            return (
                f"engine {engine_id!r} (role {self.role!r}) serves {source} weights: {what} are "
                f"refused. {source} engines never change weights, load LoRA or sync seeds; use a "
                "model with an ACTOR or DCS weight source for that"
            )
        if operation in UPDATE_PATHS:
            return (
                f"engine {engine_id!r} (role {self.role!r}, weight source {source}) does not "
                f"allow {operation!r} updates; allowed update paths: "
                f"{sorted(self.update_paths) or 'none'}"
            )
        return (
            f"engine {engine_id!r} (role {self.role!r}) does not allow operation {operation!r}; "
            f"allowed: {sorted(self.allowed_operations)}"
        )
