"""A role gateway in its own process, for ``relax bench gateway``.

``python -m relax_core.bench._gateway_proc --upstream URL`` serves the rollout gateway on a free
loopback port with a fixed schema-2 snapshot whose one DIRECT head is ``URL``; it prints
``{"port": P}`` once it accepts connections and stops when its stdin closes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading

from relax_core.gateway import InferenceGatewayHandler
from relax_core.gateway_app import create_gateway_app, uvicorn_config
from relax_core.schema import RoleSnapshot
from relax_core.testing import free_port


def bench_snapshot(upstream: str) -> RoleSnapshot:
    """A rollout snapshot with one READY DIRECT head at ``upstream``."""
    return RoleSnapshot.from_json(
        {
            "schema_version": 2,
            "role": "rollout",
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--upstream", required=True)
    args = parser.parse_args()
    import uvicorn

    snap = bench_snapshot(args.upstream)
    handler = InferenceGatewayHandler("rollout", snapshot_provider=lambda: snap, snapshot_ttl=5.0)
    port = free_port()
    server = uvicorn.Server(uvicorn_config(create_gateway_app(handler), "127.0.0.1", port))

    def stop_on_eof() -> None:
        sys.stdin.buffer.read()
        server.should_exit = True

    async def serve() -> None:
        task = asyncio.ensure_future(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        print(json.dumps({"port": port}), flush=True)
        await task

    threading.Thread(target=stop_on_eof, daemon=True).start()
    try:
        import uvloop

        uvloop.run(serve())
    except ImportError:
        asyncio.run(serve())


if __name__ == "__main__":
    main()
