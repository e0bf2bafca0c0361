"""A role gateway in its own process, for ``relax bench gateway``.

``python -m relax_bench._gateway_proc --upstream URL [--workers N] [--stream-coalesce S]``
serves the ``bench`` role's gateway on a free loopback port with a fixed schema-2 snapshot whose one
DIRECT head is ``URL`` (with N > 1: N worker processes sharing the port; ``S``: the handler's
``stream_coalesce``, default the gateway's default); it prints ``{"port": P, "pids": [...]}``
once it accepts connections and stops when its stdin closes.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from relax_core import (
    DEFAULT_STREAM_COALESCE_S,
    GatewayOptions,
    GatewayServer,
    PluginManager,
    RoleSnapshot,
    RoleSpec,
    gateway_app,
    module_plugin,
)

#: The benchmark's role: any name does, the gateway's data path is the same for every role.
ROLE = "bench"


def bench_snapshot(upstream: str) -> RoleSnapshot:
    """A snapshot of the benchmark role with one READY DIRECT head at ``upstream``."""
    return RoleSnapshot.from_json(
        {
            "schema_version": 2,
            "role": ROLE,
            "registry_epoch": "bench",
            "topology_revision": 1,
            "routing": {
                "default_model": "policy",
                "route_key_map": {},
                "aliases": {},
                "policy": "round_robin",
                "policy_revision": 0,
            },
            "models": {
                "policy": {
                    "state": "READY",
                    "route_mode": "DIRECT",
                    "router_url": None,
                    "weight_source": "ACTOR",
                    "weight_version": "1",
                    "served_model_name": "null-model",
                    "engines": [
                        {
                            "engine_id": "policy/replica-0",
                            "base_url": upstream,
                            "state": "READY",
                            "direct_eligible": True,
                            "generation": 1,
                        }
                    ],
                }
            },
        }
    )


def bench_app(upstream: str, stream_coalesce: float = DEFAULT_STREAM_COALESCE_S) -> Any:
    """The benchmark role's gateway app in front of ``upstream`` (one per worker process).

    Built as a served gateway is (:func:`~relax_core.gateway.serving.gateway_app`), over a
    plugin manager of the core's built-ins and :func:`bench_role_plugin` only: the bench
    measures the core's gateway, whatever role plugins are installed.
    """
    snap = bench_snapshot(upstream)
    pm = PluginManager.create(entry_points=False, plugins=[("relax-bench", bench_role_plugin())])
    return gateway_app(
        ROLE,
        lambda: snap,
        plugin_manager=pm,
        options=GatewayOptions(snapshot_ttl=5.0, stream_coalesce=stream_coalesce),
    )


def bench_role_plugin() -> ModuleType:
    """A plugin registering the benchmark role with the pass-through adapter."""
    spec = RoleSpec(
        name=ROLE,
        allowed_weight_sources={"ACTOR"},
        default_route_mode="DIRECT",
        default_weight_source="ACTOR",
    )

    def relax_register_roles(register: Callable[[RoleSpec], None]) -> None:
        register(spec)

    return module_plugin("relax-bench", relax_register_roles=relax_register_roles)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--workers", type=int, default=1, help="gateway worker processes")
    parser.add_argument(
        "--stream-coalesce",
        type=float,
        default=DEFAULT_STREAM_COALESCE_S,
        help="seconds a fast stream's bytes may be held to be relayed together (0: never)",
    )
    args = parser.parse_args()
    # By module name, so that worker processes can unpickle it (this file runs as __main__).
    from relax_bench._gateway_proc import bench_app as factory

    server = GatewayServer(
        app_factory=functools.partial(factory, args.upstream, args.stream_coalesce),
        workers=args.workers,
    ).start()
    try:
        print(json.dumps({"port": server.port, "pids": server.pids}), flush=True)
        sys.stdin.buffer.read()  # serve until the parent closes our stdin
    finally:
        server.stop()


if __name__ == "__main__":
    main()
