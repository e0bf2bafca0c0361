"""``relax status URL``: pretty-print a role's schema-2 snapshot from its gateway.

URL is a role gateway's role base (``http://host:port/genrm``) or its ``/engines`` URL.
"""

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
    print(json.dumps(snap.to_json(), indent=2) if args.json else render_snapshot(snap))
    return 0
