"""``relax status URL``: pretty-print a role's schema-2 snapshot from its gateway.

URL is a role gateway's role base (``http://host:port/genrm``) or its ``/engines`` URL."""

from __future__ import annotations

import argparse
import json
import urllib.error
from typing import Any

from relax_core.discovery.status import fetch_health, fetch_snapshot, render_snapshot

NAME = "status"
HELP = "Show a role's models, states and replicas from its gateway (schema 2)."


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
    try:  # relax serve's on-demand wake state (none where the gateway wakes nothing)
        residency = fetch_health(args.url, token=args.token).get("residency")
    except (urllib.error.URLError, OSError, ValueError):
        residency = None
    if args.json:
        body = snap.to_json()
        if isinstance(residency, dict):
            body = {**body, "residency": residency}  # not schema 2: relax serve's wake state
        print(json.dumps(body, indent=2))
    else:
        print(render_snapshot(snap))
        if isinstance(residency, dict):
            print(render_residency(residency))
    return 0


def render_residency(residency: dict[str, Any]) -> str:
    """``residency: …`` lines of a role woken on demand."""
    lines = [
        f"  residency  {residency.get('state')} on {residency.get('slice')} (woken on demand; "
        f"resident there now: {', '.join(residency.get('resident_on_slice') or []) or 'none'}; "
        f"{residency.get('inflight', 0)} request(s) in flight)"
    ]
    if residency.get("blocked"):
        lines.append(f"  BLOCKED: {residency['blocked']}")
    lines.append(
        f"  a request waits up to {residency.get('wake_timeout_s')} s for a wake; asleep "
        f"again after {residency.get('idle_seconds')} s idle; resident at least "
        f"{residency.get('min_residency_s')} s"
    )
    return "\n".join(lines)
