"""A role's snapshot as people read it: fetched from a gateway and rendered as a table."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from relax_core.discovery.schema import RoleSnapshot


def _get(url: str, route: str, token: str | None) -> urllib.request.Request:
    auth = {"Authorization": f"Bearer {token}"} if token else {}
    return urllib.request.Request(url.rstrip("/").removesuffix("/engines") + route, headers=auth)


def fetch_snapshot(url: str, *, token: str | None = None, timeout: float = 10.0) -> RoleSnapshot:
    """The snapshot served at ``url`` (a role base URL or its ``/engines`` URL)."""
    with urllib.request.urlopen(_get(url, "/engines?schema=2", token), timeout=timeout) as resp:
        return RoleSnapshot.from_json(resp.read())


def fetch_health(url: str, *, token: str | None = None, timeout: float = 10.0) -> dict[str, Any]:
    """A role gateway's ``/health?schema=2`` body (``url``: the role base URL), a 503's too."""
    req = _get(url, "/health?schema=2", token)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as err:  # 503: nothing READY, or loading; the body says why
        body = json.loads(err.read() or b"{}")
    return body if isinstance(body, dict) else {}


def render_snapshot(snap: RoleSnapshot, *, pids: Mapping[str, Sequence[int]] | None = None) -> str:
    """A table: one line per model, one indented line per replica head.

    ``pids``: engine id → its engine process ids, shown per replica when given (``relax
    serve`` knows them; a snapshot does not carry them)."""
    lines = [
        f"role {snap.role}  (epoch {snap.registry_epoch}, revision {snap.topology_revision}, "
        f"default model {snap.routing.default_model}, policy {snap.routing.policy})"
    ]
    for model_id, m in snap.models.items():
        ready = sum(1 for e in m.engines if e.state.value == "READY")
        version = f" version {m.weight_version}" if m.weight_version else ""
        router = f"  router {m.router_url}" if m.router_url else ""
        lines.append(
            f"  {model_id:12} {m.state.value:10} {m.route_mode.value:13} {m.weight_source}"
            f"{version}  served as {m.served_model_name}  {ready}/{len(m.engines)} READY{router}"
        )
        for e in m.engines:
            found = (pids or {}).get(e.engine_id)
            pid = "  pid " + ",".join(map(str, found)) if found else ""
            lines.append(
                f"      {e.engine_id:22} {e.state.value:10} gen {e.generation:<3} "
                f"{e.base_url or '-'}{'' if e.direct_eligible else '  (not routable)'}{pid}"
            )
    routing = snap.routing
    for what, table in (("route keys", routing.route_key_map), ("aliases", routing.aliases)):
        if table:
            lines.append(f"  {what}: " + ", ".join(f"{k}→{v}" for k, v in table.items()))
    return "\n".join(lines)
