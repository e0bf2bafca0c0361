"""Small network helpers shared by servers, benchmarks and tests."""

from __future__ import annotations

import socket
from collections.abc import Collection


def free_port(host: str = "127.0.0.1", *, avoid: Collection[int] = ()) -> int:
    """A TCP port that was free on ``host`` a moment ago (another process may take it), and is
    none of ``avoid`` (ports already handed to a process that has not bound them yet)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in avoid:
            return port


def keep_local_ray_on_loopback() -> None:
    """Make a Ray started by this process (and its workers) use 127.0.0.1 as its node address
    (not the machine's outward one), with token authentication on (a new local Ray's default,
    asked for to spare Ray's warning; an explicit ``RAY_AUTH_MODE`` is kept). Call before
    ``ray.init`` of a new local Ray; never for a real cluster."""
    import os
    import sys

    if "RAY_AUTH_MODE" not in os.environ:
        os.environ["RAY_AUTH_MODE"] = "token"
        raylet = sys.modules.get("ray._raylet")
        if raylet is not None:
            # Ray already read its config from the old environment: refresh it, as Ray's own
            # default (token auth for a new local cluster) does.
            raylet.Config.initialize("")
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # read by Ray at import
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:  # Ray already imported: its constant was read from the old env
        setattr(constants, "ENABLE_RAY_CLUSTER", False)  # noqa: B010
