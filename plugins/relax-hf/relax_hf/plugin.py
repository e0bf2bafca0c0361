"""The ``hf`` engine backend record and its ``launch`` (the ``relax`` entry point)."""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable

from relax_core.control import ControlClient
from relax_core.engine_process import SubprocessEngineProcess
from relax_core.errors import ConfigError
from relax_core.hookspecs import hookimpl
from relax_core.records import EngineBackend, EngineLaunchSpec

__all__ = ["HF_BACKEND", "launch", "relax_register_engine_backends", "serve_argv"]


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def serve_argv(spec: EngineLaunchSpec, port: int) -> list[str]:
    """The ``python -m relax_hf serve …`` command line for ``spec`` (no PATH lookup)."""
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
        "--device",
        spec.device,
        "--dtype",
        spec.dtype,
    ]
    if spec.seed is not None:
        argv += ["--seed", str(spec.seed)]
    if spec.weights_cpu_backup:
        argv.append("--weights-cpu-backup")
    if spec.served_model_name:
        argv += ["--served-model-name", spec.served_model_name]
    if spec.weight_version:
        argv += ["--weight-version", spec.weight_version]
    return argv + list(spec.extra_args)


def launch(spec: EngineLaunchSpec) -> SubprocessEngineProcess:
    """Start one ``hf`` engine server for ``spec`` and return at once (call ``wait_ready``).

    ``port`` 0 picks a free port. The server binds ``spec.host``; ``base_url`` uses
    127.0.0.1 when the host is a wildcard address.

    :raises ConfigError: tp, pp or nnodes other than 1 (the hf engine is one process).
    """
    for key in ("tp", "pp", "nnodes"):
        if getattr(spec, key) != 1:
            raise ConfigError(
                f"engines.{spec.engine_id}.{key}",
                f"the hf engine runs one process on one device; got {key}={getattr(spec, key)} "
                "(use the sglang backend for tensor/pipeline parallel or multi-node engines)",
            )
    if spec.device not in ("cpu", "cuda") and not spec.device.startswith("cuda:"):
        raise ConfigError(
            f"engines.{spec.engine_id}.device", f"{spec.device!r}: use cpu, cuda or cuda:N"
        )
    host = spec.host
    url_host = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
    port = spec.port or _free_port(url_host)
    env = {"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **dict(spec.env)}
    return SubprocessEngineProcess.start(
        serve_argv(spec, port),
        base_url=f"http://{url_host}:{port}",
        engine_id=spec.engine_id,
        env=env,
        log_path=spec.log_path,
    )


HF_BACKEND = EngineBackend(
    name="hf",
    launch=launch,
    control_client=ControlClient,
    devices={"cpu", "cuda"},
    multi_node=False,
    description=(
        "Hugging Face transformers engine speaking SGLang's HTTP protocol (CPU or CUDA, one "
        "process)."
    ),
)


@hookimpl
def relax_register_engine_backends(register: Callable[[EngineBackend], None]) -> None:
    """Register the ``hf`` engine backend."""
    register(HF_BACKEND)
