"""The job preflight: what ``relax serve`` and ``relax run`` check on this machine before Ray
starts (model directories, gateway ports, the Ray address), reported all at once. Nothing here
starts anything. See ``docs/jobs.md``."""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path
from urllib.parse import urlsplit

import attrs

from relax_core.config import JobConfig, ModelConfig
from relax_core.errors import ConfigProblem, PluginError
from relax_core.plugins import PluginManager
from relax_core.records import EngineBackend

#: Any one of these files in a model directory is a tokenizer an engine can load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
#: Seconds a ``--address`` has to accept a connection.
ADDRESS_TIMEOUT = 3.0
#: Seconds a connected ``--address`` has to answer the HTTP/2 handshake as gRPC servers do.
ANSWER_TIMEOUT = 10.0
#: The HTTP/2 client preface and an empty SETTINGS frame (RFC 9113, 3.4 and 6.5).
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes((0, 0, 0, 4, 0, 0, 0, 0, 0))
_H2_FRAME_HEADER = 9
_H2_SETTINGS = 4


@attrs.frozen
class Preflight:
    """What the preflight found: ``problems`` refuse the job (exit 2, nothing started);
    ``warnings`` are printed and the job goes on."""

    problems: tuple[ConfigProblem, ...] = ()
    warnings: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """No problem: the job may start."""
        return not self.problems


def resolve_model_paths(config: JobConfig) -> JobConfig:
    """``config`` with every relative ``model_path`` made absolute, relative to the directory
    of the job file (``config.source``), as both ``relax serve`` and ``relax run`` read it.
    A config with no source (built in code) is returned as it is."""
    if config.source is None:
        return config
    base = Path(config.source).resolve().parent
    roles = []
    for role in config.roles:
        models = tuple(
            attrs.evolve(m, model_path=str(base / m.model_path))
            if m.model_path and not m.external and not os.path.isabs(m.model_path)
            else m
            for m in role.models
        )
        roles.append(attrs.evolve(role, models=models))
    return attrs.evolve(config, roles=tuple(roles))


def _backend(model: ModelConfig, pm: PluginManager) -> EngineBackend | None:
    """The model's engine backend; ``None`` when unknown (the job's own checks report that)."""
    try:
        return pm.engine_backend(model.backend)
    except PluginError:
        return None


def model_dir_problems(
    config: JobConfig, pm: PluginManager, *, remote: bool = False
) -> tuple[list[ConfigProblem], list[str]]:
    """The problems (and, with ``remote``, warnings) of every managed model's directory,
    relative paths taken relative to the job file. ``remote``: a missing absolute path is a
    warning (it may exist on the cluster's nodes)."""
    base = Path(config.source).resolve().parent if config.source is not None else Path.cwd()
    problems: list[ConfigProblem] = []
    warnings: list[str] = []
    for role in config.roles:
        for m in role.models:
            backend = _backend(m, pm)
            if (
                m.external
                or not m.model_path
                or (backend is not None and not backend.loads_model_dir)
            ):
                continue
            key = f"{m.path}.model_path"
            path = base / m.model_path  # an absolute model_path stays as it is
            if not path.exists():
                if remote and os.path.isabs(m.model_path):
                    warnings.append(
                        f"{key}: {path} is not on this machine; the engines' nodes must have it "
                        "(their start fails otherwise)"
                    )
                else:
                    problems.append(ConfigProblem(key, "model-dir", _missing(m, path, pm)))
                continue
            if not path.is_dir():
                problems.append(
                    ConfigProblem(key, "model-dir", f"{path} is a file, not a model directory")
                )
                continue
            missing = []
            if not (path / "config.json").is_file():
                missing.append("config.json")
            skips_tokenizer = "--skip-tokenizer-init" in m.engine.extra_args
            if not skips_tokenizer and not any((path / n).is_file() for n in TOKENIZER_FILES):
                missing.append(f"tokenizer ({' / '.join(TOKENIZER_FILES)})")
            if missing:
                problems.append(
                    ConfigProblem(
                        key,
                        "model-dir",
                        f"{path} has no {' and no '.join(missing)}: the engine loads its model "
                        "and tokenizer from this directory",
                    )
                )
    return problems, warnings


def _missing(model: ModelConfig, path: Path, pm: PluginManager) -> str:
    message = f"no model directory {path}"
    if not os.path.isabs(model.model_path):
        message += f" ({model.model_path!r} is relative to the job file's directory)"
    backend = _backend(model, pm)
    hint = backend.model_hint if backend is not None else ""
    return f"{message}; {hint}" if hint else message


def port_problems(config: JobConfig, *, local: bool = True) -> list[ConfigProblem]:
    """Every fixed gateway port that is taken on its host, or given to two gateways
    (``local``: a gateway in a Ray actor listens on this machine too)."""
    problems: list[ConfigProblem] = []
    seen: dict[tuple[str, int], str] = {}
    for role in config.roles:
        gw = role.gateway
        if not gw.port:
            continue
        key = f"roles.{role.name}.gateway.port"
        taken_by = seen.setdefault((gw.host, gw.port), key)
        where = f"{gw.host}:{gw.port}"
        if taken_by != key:
            message = (
                f"{where} is also {taken_by}; give each gateway a port of its own (or leave "
                "port out: a free one is picked)"
            )
        elif (gw.in_ray_actor and not local) or (why := _bind_error(gw.host, gw.port)) is None:
            continue
        else:
            message = (
                f"cannot listen on {where} ({why}); stop what holds it, pick another port, or "
                "leave port out (a free one is picked)"
            )
        problems.append(ConfigProblem(key, "port", message))
    return problems


def _bind_error(host: str, port: int) -> str | None:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        return f"host {host!r} does not resolve: {exc.strerror or exc}"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        # As the gateway's server does: a port left in TIME_WAIT is free to listen on.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def ray_address_problem(
    address: str | None, *, timeout: float = ADDRESS_TIMEOUT
) -> ConfigProblem | None:
    """Why the Ray cluster at ``address`` (``host:port`` or ``ray://host:port``) does not
    accept a connection within ``timeout`` and answer as a gRPC server within
    :data:`ANSWER_TIMEOUT`; ``None`` when it does, or for ``None``, ``auto`` or ``local``."""
    if address is None or address in ("auto", "local"):
        return None
    parts = urlsplit(address if "://" in address else f"ray://{address}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        host, port = None, None
    if not host or port is None:
        return _address_problem(
            f"{address!r} is not a Ray address; give HOST:PORT of the head's GCS (e.g. "
            "10.0.0.1:6379), ray://HOST:PORT, or auto"
        )
    try:
        with socket.create_connection((host, port), timeout=timeout) as conn:
            conn.settimeout(ANSWER_TIMEOUT)
            answer = _h2_answer(conn)
    except OSError as exc:
        why = (
            f"no answer within {timeout:g} s"
            if isinstance(exc, TimeoutError)
            else (exc.strerror or str(exc)).lower()
        )
        return _address_problem(
            f"no Ray cluster answers at {host}:{port} ({why}); start it "
            "(`ray start --head`) or fix the address; leave --address out for a new local Ray"
        )
    if len(answer) >= _H2_FRAME_HEADER and answer[3] == _H2_SETTINGS:
        return None
    said = f"its first bytes: {answer[:40]!r}" if answer else "it closed or said nothing"
    return _address_problem(
        f"{host}:{port} accepts connections but is not a Ray cluster ({said}; a Ray head's "
        "GCS answers gRPC, by default on port 6379, the Ray Client server on 10001); give "
        "the address `ray start --head` printed, or leave --address out for a new local Ray"
    )


def _address_problem(message: str) -> ConfigProblem:
    return ConfigProblem("--address", "ray-address", message)


def _h2_answer(conn: socket.socket) -> bytes:
    """Send the HTTP/2 client preface and return the first bytes the server answers (up to one
    frame header; fewer when it closes; empty when it says nothing within the socket's
    timeout)."""
    conn.sendall(_H2_PREFACE)
    answer = b""
    with contextlib.suppress(OSError):  # a timeout or a reset: what arrived is the answer
        while len(answer) < _H2_FRAME_HEADER:
            chunk = conn.recv(_H2_FRAME_HEADER - len(answer))
            if not chunk:
                break
            answer += chunk
    return answer


def job_preflight(
    config: JobConfig, pm: PluginManager, *, address: str | None = None, gateways: bool = False
) -> Preflight:
    """Every problem of ``config`` (as loaded) that this machine can see before Ray starts;
    ``address`` (``--address``) is checked and makes missing absolute model paths warnings;
    ``gateways``: the gateway ports are checked."""
    remote = address not in (None, "local")
    problems, warnings = model_dir_problems(config, pm, remote=remote)
    if gateways:
        problems += port_problems(config, local=not remote)
    found = ray_address_problem(address)
    if found is not None:
        problems.append(found)
    return Preflight(tuple(problems), tuple(warnings))
