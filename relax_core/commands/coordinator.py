"""``relax coordinator status|reset``: an operator's view of a job's LifecycleCoordinator over
Ray (never an HTTP route). ``reset`` sets one BLOCKED lease back to SLEEPING, only with
``--confirm-clean`` (docs/coordination.md#blocked).

Exit status: 0 done, 1 refused by the coordinator, 2 bad usage or no coordinator found."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

import attrs

from relax_core.errors import CoordinationError

NAME = "coordinator"
HELP = "Show a job's shared-GPU leases, or reset a BLOCKED one after confirming its GPUs clean."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    for action, text in (
        ("status", "every role's lease, the current batch and the run's failure"),
        ("reset", "set a BLOCKED lease back to SLEEPING (needs --confirm-clean)"),
    ):
        p = sub.add_parser(action, help=text, description=text)
        p.add_argument("--address", required=True, help="the job's Ray cluster (HOST:PORT)")
        p.add_argument("--job", required=True, help="the job's name (its coordinator actor)")
        if action == "status":
            p.add_argument("--json", action="store_true", help="print one JSON object")
        else:
            p.add_argument("--role", required=True, help="the BLOCKED role to reset")
            p.add_argument(
                "--confirm-clean",
                action="store_true",
                help="I checked on every node that this role's engines hold no GPU memory",
            )


def _status_dict(status: Any) -> dict[str, Any]:
    out: dict[str, Any] = attrs.asdict(status)
    out["deferred_roles"] = list(status.deferred_roles)
    out["residency"] = status.residency.to_dict()
    return out


def _render(status: Any) -> str:
    lines = [f"generation role: {status.generation_role}"]
    for role, state in status.leases.items():
        why = f"  ({status.blocked[role]})" if role in status.blocked else ""
        lines.append(f"  {role:10} {state:9} slice {status.slices[role]}{why}")
    lines += [f"  residency: {line}" for line in status.residency.describe()]
    batch = "none" if status.current is None else f"{status.current} {status.batch_state}"
    lines.append(f"current batch: {batch}; committed batches remembered: {status.committed}")
    if status.failure is not None:
        lines.append(f"run failed at batch {status.failure.batch_id}: {status.failure.cause}")
    for late in status.late_replies:
        lines.append(f"late reply: {late.handle} {late.method} -> {late.outcome} (changed nothing)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import logging

    import ray

    from relax_core.coordination import connect_coordinator

    if args.action == "reset" and not args.confirm_clean:
        print(
            f"relax coordinator reset: refused: confirm first that the {args.role} engines hold "
            "no GPU memory on every node (stop them, or check that their offload completed), then "
            "run again with --confirm-clean",
            file=sys.stderr,
        )
        return 2
    ray.init(address=args.address, log_to_driver=False, logging_level=logging.WARNING)
    try:
        try:
            coordinator = connect_coordinator(args.job)
        except CoordinationError as exc:
            print(f"relax coordinator: {exc}", file=sys.stderr)
            return 2
        if args.action == "status":
            status = asyncio.run(coordinator.describe())
            print(json.dumps(_status_dict(status)) if args.json else _render(status))
            return 0
        try:
            state = asyncio.run(coordinator.reset_blocked(args.role, confirm_clean=True))
        except CoordinationError as exc:
            print(f"relax coordinator reset: refused: {exc}", file=sys.stderr)
            return 1
        print(f"relax coordinator reset: role {args.role!r} lease is now {state}")
        return 0
    finally:
        ray.shutdown()
