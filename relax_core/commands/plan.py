"""``relax plan CONFIG [--json]``: the placement preflight of a job file, without starting anything:
the bundle map, the memory budget per GPU and the residency plan (exit 0), or every problem on
stderr (exit 2); a ``[run]`` table is checked as ``relax run`` checks it."""

from __future__ import annotations

import argparse
import json
import re

from relax_core.commands._reject import reject
from relax_core.config import JobConfig, load_config
from relax_core.coordination.residency import defer_slices, plan_residency
from relax_core.errors import ConfigValidationError
from relax_core.jobs.preflight import resolve_model_paths
from relax_core.placement import preflight, render_plan, role_titles
from relax_core.plugins import PluginManager, get_plugin_manager

NAME = "plan"
HELP = "Check a job file's GPU placement and memory budget and print the plan (starts nothing)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="the job's TOML file")
    parser.add_argument(
        "--json", action="store_true", help="print the plan (or the violations) as JSON"
    )


def _reject(lines: list[str], rows: list[dict[str, str]], as_json: bool) -> int:
    status = reject("plan", *lines, nothing_started=False)
    if as_json:
        print(json.dumps({"ok": False, "violations": rows}, indent=2))
    return status


_PROBLEM = re.compile(r"^(?P<path>[^:\s]+): \[(?P<rule>[^\]]+)\] (?P<message>.*)$", re.S)


def _row(line: str) -> dict[str, str]:
    found = _PROBLEM.match(line)
    if found is None:
        return {"path": "", "rule": "", "message": line}
    return found.groupdict()


def _run_problems(config: JobConfig, pm: PluginManager) -> list[str]:
    """What ``relax run`` would refuse in the job's ``[run]`` table (none without one)."""
    if not config.run:
        return []
    from relax_core.run.config import parse_run_config
    from relax_core.run.job import run_problems

    try:
        settings = parse_run_config(config, pm)
    except ConfigValidationError as exc:
        return [str(p) for p in exc.problems]
    return run_problems(config, settings, pm)


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
    lines = [str(v) for v in result.violations]
    lines += [line for line in _run_problems(config, pm) if line not in lines]
    if result.plan is None or lines:
        return _reject(lines, [_row(line) for line in lines], args.json)
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
