"""The ``hf`` engine backend record and its ``launch``, and the ``relax demo`` command (the
``relax`` entry point)."""

from __future__ import annotations

import functools
import importlib.util
import sys
from collections.abc import Callable

from relax_core import (
    CONSTRAINED_DECODING,
    CommandSpec,
    ConfigError,
    ControlClient,
    EngineBackend,
    EngineLaunchSpec,
    SubprocessEngineProcess,
    free_port,
    hookimpl,
)
from relax_hf import demo
from relax_hf.options import HFEngineOptions, hf_options, options_argv
from relax_hf.protocol import parse_dist_addr

__all__ = [
    "DEMO",
    "HF_BACKEND",
    "OPTION_FLAGS",
    "launch",
    "missing",
    "relax_register_commands",
    "relax_register_engine_backends",
    "serve_argv",
]


#: The core's engine options (``EngineLaunchSpec.options``, from the job file's model keys)
#: the hf engine reads, and the flag each becomes; SGLang's names. Others (``dp``,
#: ``kv_cache_dtype``, …) are the sglang backend's.
OPTION_FLAGS = (
    ("mem_fraction_static", "--mem-fraction-static"),
    ("context_length", "--context-length"),
    ("max_running_requests", "--max-running-requests"),
)


def serve_argv(spec: EngineLaunchSpec, port: int) -> list[str]:
    """The ``python -m relax_hf serve …`` command line for ``spec`` (no PATH lookup).

    The model's ``mem_fraction_static``, ``context_length`` and ``max_running_requests``
    (``spec.options``) become their flags, then the hf options of its ``engine`` table
    (``spec.backend_options``, :mod:`relax_hf.options`) theirs; the model's ``extra_args``
    come last, so they win.
    """
    options = spec.options
    argv = [
        sys.executable,
        "-m",
        "relax_hf",
        "serve",
        "--model",
        spec.model_path,
        "--host",
        spec.host,
        "--port",
        str(port),
        "--dtype",
        options.dtype,
    ]
    # A --device in extra_args (an engine on CPU on a declared GPU bundle) is the one device
    # the command line names; otherwise the bundle's.
    if not any(a == "--device" or a.startswith("--device=") for a in options.extra_args):
        argv += ["--device", spec.device]
    if spec.seed is not None:
        argv += ["--seed", str(spec.seed)]
    if options.weights_cpu_backup:
        argv.append("--weights-cpu-backup")
    if spec.served_model_name:
        argv += ["--served-model-name", spec.served_model_name]
    if spec.weight_version:
        argv += ["--weight-version", spec.weight_version]
    if spec.nnodes > 1:
        argv += ["--nnodes", str(spec.nnodes), "--node-rank", str(spec.node_rank)]
        argv += ["--dist-init-addr", str(spec.dist_init_addr)]
    for key, flag in OPTION_FLAGS:
        value = getattr(options, key)
        if value is not None:
            argv += [flag, str(value)]
    return argv + options_argv(hf_options(spec)) + list(options.extra_args)


def _check(spec: EngineLaunchSpec) -> None:
    where = f"engines.{spec.engine_id}"
    for key in ("tp", "pp"):
        if getattr(spec, key) != 1:
            raise ConfigError(
                f"{where}.{key}",
                f"the hf engine does not shard a model; got {key}={getattr(spec, key)} "
                "(use the sglang backend for tensor/pipeline parallel engines)",
            )
    if spec.nnodes < 1:
        raise ConfigError(f"{where}.nnodes", f"must be >= 1, got {spec.nnodes}")
    if not 0 <= spec.node_rank < spec.nnodes:
        raise ConfigError(
            f"{where}.node_rank", f"must be in [0, nnodes={spec.nnodes}), got {spec.node_rank}"
        )
    if spec.nnodes > 1:
        try:
            parse_dist_addr(spec.dist_init_addr)
        except ValueError as exc:
            raise ConfigError(f"{where}.dist_init_addr", str(exc).split(": ", 1)[1]) from exc
    if spec.device not in ("cpu", "cuda") and not spec.device.startswith("cuda:"):
        raise ConfigError(f"{where}.device", f"{spec.device!r}: use cpu, cuda or cuda:N")
    hf_options(spec)


def launch(spec: EngineLaunchSpec) -> SubprocessEngineProcess:
    """Start one ``hf`` engine server (one node of a replica) for ``spec``; return at once.

    Call ``wait_ready`` on the result. ``port`` 0 picks a free port. A head (node rank 0)
    binds ``spec.host`` and ``base_url`` uses 127.0.0.1 when the host is a wildcard address.
    With ``nnodes`` > 1 every node loads the same model and the followers (node rank > 0) mirror
    the head (no sharding): a follower has no public HTTP; ``port`` is its private readiness
    port on 127.0.0.1, which answers 200 once it has joined the head at ``dist_init_addr``.

    :raises ConfigError: tp or pp other than 1, a node rank outside ``[0, nnodes)``, a missing
        or malformed ``dist_init_addr`` with ``nnodes`` > 1, an unknown device, or
        ``backend_options`` that are not :class:`~relax_hf.options.HFEngineOptions`.
    """
    _check(spec)
    env = {"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **dict(spec.options.env)}
    if spec.node_rank > 0:
        port = spec.port or free_port("127.0.0.1")
        return SubprocessEngineProcess.start(
            serve_argv(spec, port),
            base_url=None,
            ready_url=f"http://127.0.0.1:{port}/health",
            engine_id=spec.engine_id,
            env=env,
            log_path=spec.log_path,
        )
    host = spec.host
    url_host = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
    port = spec.port or free_port(url_host)
    return SubprocessEngineProcess.start(
        serve_argv(spec, port),
        base_url=f"http://{url_host}:{port}",
        engine_id=spec.engine_id,
        env=env,
        log_path=spec.log_path,
    )


def missing(feature: str) -> str | None:
    """What this install lacks for an engine feature a job needs (``None``: it has it): the
    hf engine's constrained decoding is xgrammar's, an optional extra."""
    if feature == CONSTRAINED_DECODING:
        if importlib.util.find_spec("xgrammar") is None:
            return "constrained decoding needs xgrammar: pip install 'relax-hf[grammar]'"
        return None
    return f"the hf engine has no feature {feature!r} (it has: {CONSTRAINED_DECODING})"


def keeps_graphs(options: HFEngineOptions | None, extra_args: tuple[str, ...]) -> bool:
    """Whether a model's decode CUDA graphs stay on its GPU while it sleeps: with the memory
    handoff the weights and the pool come back at their addresses, so a release keeps the
    graphs (and their memory) for the resume to replay."""
    given = options or HFEngineOptions()
    handoff = given.memory_handoff or "--memory-handoff" in extra_args
    return handoff and not (given.disable_cuda_graph or "--disable-cuda-graph" in extra_args)


HF_BACKEND = EngineBackend(
    name="hf",
    launch=launch,
    # The engine's release of kv_cache flushes its prefix cache itself and refuses while a
    # request runs, and its resume checks a generation when asked: an offload and an onload
    # are one engine call each (ControlClient.release_flushes, resume_checks).
    control_client=functools.partial(ControlClient, release_flushes=True, resume_checks=True),
    devices={"cpu", "cuda"},
    multi_node=True,
    description=(
        "Hugging Face transformers engine speaking SGLang's HTTP protocol (CPU or CUDA; a "
        "multi-node replica's followers mirror the head over gloo, no sharding)."
    ),
    model_hint=(
        "for a try-out, `relax-hf make-tiny-model DIR` writes a tiny random model with a local "
        "tokenizer (`relax demo` makes the demo job's three)"
    ),
    options=HFEngineOptions,
    missing=missing,
    keeps_graphs=keeps_graphs,
)

DEMO = CommandSpec(name=demo.NAME, help=demo.HELP, add_arguments=demo.add_arguments, run=demo.run)


@hookimpl
def relax_register_engine_backends(register: Callable[[EngineBackend], None]) -> None:
    """Register the ``hf`` engine backend."""
    register(HF_BACKEND)


@hookimpl
def relax_register_commands(register: Callable[[CommandSpec], None]) -> None:
    """Register ``relax demo``."""
    register(DEMO)
