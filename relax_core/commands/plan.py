"""``relax plan CONFIG [--json]``: the placement preflight of a job file, without starting anything.

Prints the bundle map of every pool, the memory budget per GPU and, for roles that share GPUs
across phases, the residency plan (which of them may be resident together), and exits 0; a
rejected config prints every violation on stderr (``key.path: [rule] message``) and exits 2.
"""

from __future__ import annotations

import argparse
import json

from relax_core.commands._reject import reject
from relax_core.config import load_config
from relax_core.coordination.residency import plan_residency
from relax_core.coordination.slices import defer_slices
from relax_core.errors import ConfigValidationError
from relax_core.jobs.preflight import resolve_model_paths
from relax_core.placement import preflight, render_plan, role_titles
from relax_core.plugins import get_plugin_manager

NAME = "plan"
HELP = "Check a job file's GPU placement and memory budget and print the plan (starts nothing)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="the job's TOML file")
    parser.add_argument(
        "--json", action="store_true", help="print the plan (or the violations) as JSON"
    )


def _reject(lines: list[str], rows: list[dict[str, str]], as_json: bool) -> int:
    status = reject("plan", lines, nothing_started=False)
    if as_json:
        print(json.dumps({"ok": False, "violations": rows}, indent=2))
    return status


def run(args: argparse.Namespace) -> int:
    pm = get_plugin_manager()
    try:
        config = load_config(args.config, role_names=pm.registered("roles"))
    except ConfigValidationError as exc:
        rows = [{"path": p.path, "rule": p.rule, "message": p.message} for p in exc.problems]
        return _reject([str(p) for p in exc.problems], rows, args.json)
    # A relative model_path names a directory next to the job file, as relax serve and relax
    # run read it (the memory budget reads its config.json).
    config = resolve_model_paths(config)
    result = preflight(config, pm)
    if result.plan is None:
        rows = [{"path": v.path, "rule": v.rule, "message": v.message} for v in result.violations]
        return _reject([str(v) for v in result.violations], rows, args.json)
    slices = defer_slices(result.plan)
    residency = plan_residency(
        result.plan, slices, mode=config.placement.residency, roles=tuple(slices)
    )
    if args.json:
        print(json.dumps({"ok": True, **result.plan.to_dict(), "residency": residency.to_dict()}))
    else:
        print(render_plan(result.plan, titles=role_titles(pm)))
        if residency.slices:
            print("Residency (placement.residency = " + repr(residency.mode) + "):")
            for line in residency.describe():
                print(f"  {line}")
    return 0
