"""``relax plugins [--json]``: every registered record with the distribution that registered it."""

from __future__ import annotations

import argparse
import json

from relax_core.plugins import KINDS, PluginManager

NAME = "plugins"
HELP = "List every registered record: roles, backends, reward adapters, trainers, policies, …"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    pm = PluginManager.create()
    rows = [
        {
            "kind": kind,
            "name": name,
            "plugin": reg.plugin,
            "distribution": reg.distribution,
            "description": getattr(reg.record, "description", ""),
        }
        for kind in KINDS
        for name, reg in sorted(pm.registered(kind).items())
    ]
    if args.json:
        print(json.dumps({"plugins": pm.plugin_names(), "records": rows}, indent=2))
        return 0
    widths = {h: max(len(h), *(len(r[h]) for r in rows)) for h in ("kind", "name", "distribution")}
    print("  ".join(h.upper().ljust(w) for h, w in widths.items()) + "  DESCRIPTION")
    for r in rows:
        print("  ".join(r[h].ljust(w) for h, w in widths.items()) + "  " + r["description"])
    return 0
