"""``relax status URL``: pretty-print a role's schema-2 snapshot from its gateway.

URL is a role gateway's role base (``http://host:port/genrm``) or its ``/engines`` URL.
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from relax_core.schema import RoleSnapshot

NAME = "status"
HELP = "Show a role's models, states and replicas from its gateway (schema 2)."

__all__ = ["fetch_snapshot", "render_snapshot"]


def fetch_snapshot(url: str, *, token: str | None = None, timeout: float = 10.0) -> RoleSnapshot:
    """The snapshot served at ``url`` (a role base URL or its ``/engines`` URL)."""
    base = url.rstrip("/")
    if not base.endswith("/engines"):
        base += "/engines"
    req = urllib.request.Request(base + "?schema=2")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return RoleSnapshot.from_json(resp.read())


def render_snapshot(snap: RoleSnapshot, *, pids: Mapping[str, Sequence[int]] | None = None) -> str:
    """A table: one line per model, one indented line per replica head.

    ``pids``: engine id → its engine process ids, shown per replica when given (``relax
    serve`` knows them; a snapshot does not carry them).
    """
    lines = [
        f"role {snap.role}  (epoch {snap.registry_epoch}, revision {snap.topology_revision}, "
        f"default model {snap.routing.default_model}, policy {snap.routing.policy})"
    ]
    for model_id, m in snap.models.items():
        ready = sum(1 for e in m.engines if e.state.value == "READY")
        version = f" version {m.weight_version}" if m.weight_version else ""
        lines.append(
            f"  {model_id:12} {m.state.value:10} {m.route_mode.value:13} {m.weight_source}"
            f"{version}  served as {m.served_model_name}  {ready}/{len(m.engines)} READY"
        )
        for e in m.engines:
            pid = ""
            if pids is not None and pids.get(e.engine_id):
                pid = "  pid " + ",".join(str(p) for p in pids[e.engine_id])
            lines.append(
                f"      {e.engine_id:22} {e.state.value:10} gen {e.generation:<3} "
                f"{e.base_url or '-'}{'' if e.direct_eligible else '  (not routable)'}{pid}"
            )
    keys = snap.routing.route_key_map
    if keys:
        lines.append("  route keys: " + ", ".join(f"{k}→{v}" for k, v in keys.items()))
    if snap.routing.aliases:
        lines.append("  aliases: " + ", ".join(f"{k}→{v}" for k, v in snap.routing.aliases.items()))
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", help="a role gateway URL, e.g. http://127.0.0.1:8100/genrm")
    parser.add_argument("--token", help="the gateway's bearer token")
    parser.add_argument("--json", action="store_true", help="print the raw schema-2 JSON")


def run(args: argparse.Namespace) -> int:
    try:
        snap = fetch_snapshot(args.url, token=args.token)
    except urllib.error.HTTPError as err:
        body: Any = err.read().decode("utf-8", "replace")
        print(f"relax status: {args.url} answered {err.code}: {body}")
        return 1
    except (urllib.error.URLError, OSError) as err:
        print(f"relax status: cannot reach {args.url}: {err}; is `relax serve` running?")
        return 1
    print(json.dumps(snap.to_json(), indent=2) if args.json else render_snapshot(snap))
    return 0
