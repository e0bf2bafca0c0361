"""Starting one SGLang server process for the InferenceManager's engine worker.

:func:`launch` runs ``python -m sglang.launch_server`` (see :mod:`relax_sglang.server_args`) in
its own process group with the current interpreter and returns a
:class:`~relax_core.engine.process.SubprocessEngineProcess` at once. A head is ready when
``GET /health_generate`` answers 200 — after SGLang really generated a token, not merely when
its HTTP server came up. A follower of a multi-node replica (node rank > 0) serves no HTTP: it
counts as started once it has stayed alive through a short grace period; the head's
``health_generate`` covers the whole replica from then on.

Everything after the start goes through the core's SGLang-protocol control client
(:class:`~relax_core.engine.control.ControlClient`), as for every backend.
"""

from __future__ import annotations

from relax_core import EngineLaunchSpec, SubprocessEngineProcess, free_port
from relax_sglang.server_args import disaggregation_mode, launch_server_argv

__all__ = ["launch"]


def launch(spec: EngineLaunchSpec) -> SubprocessEngineProcess:
    """Start one SGLang server (one node of a replica) for ``spec``; return at once.

    Call ``wait_ready`` on the result. ``port`` 0 picks a free port; a prefill worker's head
    also gets a free KV bootstrap port (SGLang reports it in ``/server_info``, where the router
    plugin reads it). The base URL uses 127.0.0.1 when the host is a wildcard address.

    :raises ConfigError: the spec breaks a rule of :func:`relax_sglang.server_args.check_launch`.
    :raises LifecycleError: the interpreter cannot be started.
    """
    env = {"PYTHONUNBUFFERED": "1", **dict(spec.options.env)}
    url_host = "127.0.0.1" if spec.host in ("0.0.0.0", "", "::") else spec.host
    port = spec.port or free_port(url_host)
    bootstrap = None
    if disaggregation_mode(spec) == "prefill" and spec.node_rank == 0:
        bootstrap = free_port(url_host)
    argv = launch_server_argv(spec, port=port, bootstrap_port=bootstrap)
    if spec.node_rank > 0:
        return SubprocessEngineProcess.start(
            argv, base_url=None, engine_id=spec.engine_id, env=env, log_path=spec.log_path
        )
    return SubprocessEngineProcess.start(
        argv,
        base_url=f"http://{url_host}:{port}",
        engine_id=spec.engine_id,
        env=env,
        log_path=spec.log_path,
        health_path="/health_generate",
    )
