"""``relax status URL``: pretty-print a role's schema-2 snapshot from its gateway.

URL is a role gateway's role base (``http://host:port/genrm``) or its ``/engines`` URL."""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from typing import Any

from relax_core.discovery.status import fetch_snapshot, render_snapshot

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
    residency = _residency(args.url, args.token)
    if args.json:
        body = snap.to_json()
        if residency is not None:
            body = {**body, "residency": residency}  # not schema 2: relax serve's wake state
        print(json.dumps(body, indent=2))
    else:
        print(render_snapshot(snap))
        if residency is not None:
            print(render_residency(residency))
    return 0


def _residency(url: str, token: str | None) -> dict[str, Any] | None:
    """The role's residency from its gateway's ``/health`` (``relax serve``'s on-demand wake),
    or ``None`` where the gateway does not wake its role."""
    base = url.rstrip("/").removesuffix("/engines")
    req = urllib.request.Request(base + "/health?schema=2")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as err:  # 503: nothing READY, the body still says why
        body = json.loads(err.read() or b"{}")
    except (urllib.error.URLError, OSError, ValueError):
        return None
    found = body.get("residency") if isinstance(body, dict) else None
    return found if isinstance(found, dict) else None


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
