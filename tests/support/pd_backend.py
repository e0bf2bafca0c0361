"""A prefill/decode test backend: real worker processes that say which kind they are.

On CPU no engine can really disaggregate prefill from decode (SGLang's KV transfer needs GPUs),
so this backend stands in for SGLang's prefill and decode servers: ``launch`` starts one worker
process per engine, of the kind the sglang backend would start for that replica
(:func:`relax_sglang.server_args.disaggregation_mode`), a prefill worker with a free bootstrap
port. A worker answers what the manager and the routers ask (``/health``,
``/health_generate``, ``/server_info`` with ``disaggregation_mode`` and
``disaggregation_bootstrap_port``, ``/model_info``) and counts each generation it receives with
the bootstrap fields the router added (``seen`` in its ``/server_info``, which the admission
server forwards). Everything around it — Ray, the manager,
the admission servers, the router in PD mode, the publisher — is real.

Run as ``python -m tests.support.pd_backend PORT MODE BOOTSTRAP`` (what ``launch`` does).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from relax_core.engine.process import SubprocessEngineProcess
from relax_core.net import free_port
from relax_core.records import EngineLaunchSpec


def launch(spec: EngineLaunchSpec) -> SubprocessEngineProcess:
    """One worker for ``spec`` (its port is given by the manager's worker)."""
    from relax_sglang.server_args import disaggregation_mode

    mode = disaggregation_mode(spec) or "null"
    bootstrap = free_port() if mode == "prefill" else 0
    return SubprocessEngineProcess.start(
        [sys.executable, "-m", "tests.support.pd_backend", str(spec.port), mode, str(bootstrap)],
        base_url=f"http://127.0.0.1:{spec.port}",
        engine_id=spec.engine_id,
        log_path=spec.log_path,
        cwd=".",
    )


def main() -> None:
    from aiohttp import web

    port, mode, bootstrap = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    seen: list[dict[str, Any]] = []
    info = {
        "model_path": "policy",
        "served_model_name": "policy",
        "is_generation": True,
        "weight_version": "0",
        "disaggregation_mode": mode,
        "disaggregation_bootstrap_port": bootstrap or None,
    }

    async def get(request: web.Request) -> web.StreamResponse:
        if request.path in ("/health", "/health_generate"):
            return web.Response()
        if request.path in ("/server_info", "/get_server_info"):
            return web.json_response({**info, "seen": seen})
        if request.path in ("/model_info", "/get_model_info"):
            return web.json_response(info)
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": "policy"}]})
        return web.json_response({"error": request.path}, status=404)

    async def post(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read() or b"{}")
        seen.append(
            {k: body.get(k) for k in ("rid", "bootstrap_host", "bootstrap_port", "bootstrap_room")}
        )
        return web.json_response(
            {
                "text": mode,
                "output_ids": [1],
                "meta_info": {
                    "id": body.get("rid"),
                    "finish_reason": {"type": "length", "length": 1},
                },
            }
        )

    app = web.Application()
    app.router.add_get("/{tail:.*}", get)
    app.router.add_post("/{tail:.*}", post)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


if __name__ == "__main__":
    main()
