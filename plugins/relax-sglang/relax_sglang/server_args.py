"""The ``python -m sglang.launch_server`` command line of one engine process.

:func:`launch_server_argv` turns an :class:`~relax_core.records.EngineLaunchSpec` (what the
InferenceManager asks for one node of one logical replica) into SGLang's own flags:
parallelism (``--tp-size``, ``--pp-size``, ``--dp-size``, ``--enable-dp-attention``), a
multi-node replica's ``--nnodes`` / ``--node-rank`` / ``--dist-init-addr``, memory
(``--mem-fraction-static``, ``--enable-memory-saver``, ``--enable-weights-cpu-backup``), the seed,
deterministic inference, the served name and weight version, prefill/decode disaggregation
(``--disaggregation-mode``, ``--disaggregation-bootstrap-port``), then the model's own
``extra_args``.

Rules it enforces (:func:`check_launch`), each a :class:`~relax_core.errors.ConfigError` naming
the key:

- a static engine (STATIC weights: nothing can re-feed it) always keeps a CPU weight backup,
  and refuses dummy load formats and LoRA flags;
- ``extra_args`` may not set what a config key or the manager owns (the port, the parallelism,
  the memory fraction, …): the message names the key to use instead;
- every option value must be one SGLang accepts.

Nothing leaks between models: a command line is built from one model's spec alone, so the
policy's SGLang settings never reach a judge's or a teacher's engine.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence

from relax_core import ConfigError, EngineLaunchSpec

__all__ = [
    "OWNED_FLAGS",
    "check_launch",
    "disaggregation_mode",
    "launch_server_argv",
]

#: Flags the command line sets from the spec: ``extra_args`` may not repeat them. Each maps to
#: what to set instead.
OWNED_FLAGS: Mapping[str, str] = {
    "--model-path": "model_path",
    "--model": "model_path",
    "--host": "the manager (engine_host)",
    "--port": "the manager (a free port per engine)",
    "--tp-size": "tp",
    "--tp": "tp",
    "--pp-size": "pp",
    "--pp": "pp",
    "--dp-size": "dp",
    "--dp": "dp",
    "--enable-dp-attention": "dp_attention",
    "--nnodes": "the placement (nodes per replica)",
    "--node-rank": "the placement (nodes per replica)",
    "--dist-init-addr": "the manager (the head worker's address)",
    "--mem-fraction-static": "mem_fraction_static",
    "--context-length": "context_length",
    "--max-running-requests": "max_running_requests",
    "--kv-cache-dtype": "kv_cache_dtype",
    "--dtype": "dtype",
    "--random-seed": "seed",
    "--served-model-name": "served_model_name",
    "--weight-version": "the manager (the published weight version)",
    "--enable-memory-saver": "nothing: the sglang backend always enables it",
    "--enable-weights-cpu-backup": "weights_cpu_backup",
    "--enable-deterministic-inference": "deterministic_inference",
    "--disaggregation-mode": "pd_prefill_engines",
    "--disaggregation-bootstrap-port": "nothing: a free port is picked per prefill engine",
}

_LORA_PREFIXES = ("--enable-lora", "--lora-", "--max-lora", "--max-loaded-loras", "--uno-lora")

# config dtype -> SGLang --dtype; the quantized ones are a weight-budget hint only: SGLang reads a
# quantized checkpoint's method from its own config (or from --quantization in extra_args).
_DTYPES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "float32": "float32",
    "fp32": "float32",
}
_QUANTIZED = frozenset({"fp8", "float8_e4m3fn", "fp8_e4m3", "fp8_e5m2", "int8", "int4"})
_KV_DTYPES = {
    "fp8": "fp8_e4m3",
    "fp8_e4m3": "fp8_e4m3",
    "float8_e4m3fn": "fp8_e4m3",
    "fp8_e5m2": "fp8_e5m2",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
}


def _flag(arg: str) -> str:
    return arg.split("=", 1)[0]


def _where(spec: EngineLaunchSpec) -> str:
    return f"engines.{spec.engine_id}"


def disaggregation_mode(spec: EngineLaunchSpec) -> str | None:
    """``prefill``, ``decode`` or ``None`` (no disaggregation) for this engine.

    With ``pd_prefill_engines = P`` the replicas of index below ``P`` are prefill workers and
    every other one (including replicas added by a scale-out) a decode worker.
    """
    prefill = spec.options.pd_prefill_engines
    if prefill is None:
        return None
    return "prefill" if spec.replica_index < prefill else "decode"


def _load_formats(args: Sequence[str]) -> list[str]:
    out = []
    for i, arg in enumerate(args):
        if arg == "--load-format" and i + 1 < len(args):
            out.append(args[i + 1])
        elif arg.startswith("--load-format="):
            out.append(arg.split("=", 1)[1])
    return out


def check_launch(spec: EngineLaunchSpec) -> None:
    """Check ``spec`` against the sglang backend's rules (see the module docstring).

    :raises ConfigError: naming the key path (``engines.<id>.<key>``) and what to do.
    """
    where = _where(spec)
    for key in ("tp", "pp", "nnodes"):
        if getattr(spec, key) < 1:
            raise ConfigError(f"{where}.{key}", f"must be >= 1, got {getattr(spec, key)}")
    if not 0 <= spec.node_rank < spec.nnodes:
        raise ConfigError(
            f"{where}.node_rank", f"must be in [0, nnodes={spec.nnodes}), got {spec.node_rank}"
        )
    if spec.nnodes > 1 and not spec.dist_init_addr:
        raise ConfigError(
            f"{where}.dist_init_addr",
            f"a replica of {spec.nnodes} nodes needs the head's address (host:port)",
        )
    opts = spec.options
    if opts.dtype != "auto" and opts.dtype not in _DTYPES and opts.dtype not in _QUANTIZED:
        raise ConfigError(f"{where}.dtype", f"{opts.dtype!r} is not a dtype SGLang serves")
    kv = opts.kv_cache_dtype
    if kv != "auto" and kv not in _KV_DTYPES:
        raise ConfigError(
            f"{where}.kv_cache_dtype",
            f"{kv!r}: SGLang's KV cache holds auto (the model's dtype), "
            f"{', '.join(sorted(_KV_DTYPES))}",
        )
    for arg in opts.extra_args:
        owner = OWNED_FLAGS.get(_flag(arg))
        if owner is not None:
            raise ConfigError(
                f"{where}.extra_args",
                f"{_flag(arg)} is set by the sglang backend from {owner}; remove it from "
                "extra_args",
            )
    if spec.static:
        dummy = [f for f in _load_formats(opts.extra_args) if f.startswith("dummy")]
        if dummy:
            raise ConfigError(
                f"{where}.extra_args",
                f"--load-format {dummy[0]}: a static engine (role {spec.role!r}) serves its "
                "checkpoint and nobody ever pushes weights to it, so random dummy weights are "
                "refused; remove the flag",
            )
        lora = [a for a in opts.extra_args if _flag(a).startswith(_LORA_PREFIXES)]
        if lora:
            raise ConfigError(
                f"{where}.extra_args",
                f"{_flag(lora[0])}: a static engine (role {spec.role!r}) never loads LoRA "
                "adapters; remove the LoRA flags or give the model an ACTOR weight source",
            )


def launch_server_argv(
    spec: EngineLaunchSpec, *, port: int, bootstrap_port: int | None = None
) -> list[str]:
    """The full ``python -m sglang.launch_server …`` command line (current interpreter).

    ``port`` is the engine's HTTP port; ``bootstrap_port`` the KV-transfer bootstrap port of a
    prefill worker (required for one).

    :raises ConfigError: see :func:`check_launch`; a prefill worker without ``bootstrap_port``.
    """
    check_launch(spec)
    opts = spec.options
    argv = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        spec.model_path,
        "--host",
        spec.host,
        "--port",
        str(port),
        "--tp-size",
        str(spec.tp),
        "--pp-size",
        str(spec.pp),
    ]
    if opts.dp != 1:
        argv += ["--dp-size", str(opts.dp)]
    if opts.dp_attention:
        argv.append("--enable-dp-attention")
    if spec.nnodes > 1:
        argv += ["--nnodes", str(spec.nnodes), "--node-rank", str(spec.node_rank)]
        argv += ["--dist-init-addr", str(spec.dist_init_addr)]
    if opts.dtype in _DTYPES:
        argv += ["--dtype", _DTYPES[opts.dtype]]
    if opts.kv_cache_dtype != "auto":
        argv += ["--kv-cache-dtype", _KV_DTYPES[opts.kv_cache_dtype]]
    for flag, value in (
        ("--mem-fraction-static", opts.mem_fraction_static),
        ("--context-length", opts.context_length),
        ("--max-running-requests", opts.max_running_requests),
    ):
        if value is not None:
            argv += [flag, str(value)]
    # The manager releases and resumes memory occupation (offload/onload): SGLang needs the
    # memory saver for that, on every engine.
    argv.append("--enable-memory-saver")
    if opts.weights_cpu_backup or spec.static:
        argv.append("--enable-weights-cpu-backup")
    if spec.seed is not None:
        argv += ["--random-seed", str(spec.seed)]
    if opts.deterministic_inference:
        argv.append("--enable-deterministic-inference")
    if spec.served_model_name:
        argv += ["--served-model-name", spec.served_model_name]
    if spec.weight_version:
        argv += ["--weight-version", spec.weight_version]
    mode = disaggregation_mode(spec)
    if mode is not None:
        argv += ["--disaggregation-mode", mode]
        if mode == "prefill" and spec.node_rank == 0:
            if bootstrap_port is None:
                raise ConfigError(
                    f"{_where(spec)}.pd_prefill_engines",
                    "a prefill engine needs a bootstrap port (the launcher picks one)",
                )
            argv += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
    return argv + list(opts.extra_args)
