"""``relax serve CONFIG``: bring a job's inference side up on Ray and serve its role gateways
until Ctrl-C or SIGTERM (``docs/serve.md``; a job with problems: exit status 2)."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import attrs

from relax_core.commands._reject import reject
from relax_core.config import load_config
from relax_core.errors import ConfigValidationError, LifecycleError
from relax_core.jobs import (
    ShutdownSignals,
    check_job,
    describe_job,
    job_preflight,
    ray_session,
    resolve_model_paths,
    serve_job,
)
from relax_core.plugins import PluginManager

NAME = "serve"
HELP = "Bring a job's inference roles up on Ray and serve their gateways until Ctrl-C."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="the job's TOML file")
    parser.add_argument("--address", help="an existing Ray cluster (default: a new local Ray)")
    parser.add_argument("--token", help="bearer token every gateway requires (default: none)")
    parser.add_argument(
        "--refresh", type=float, default=2.0, help="seconds between status checks (default 2)"
    )
    parser.add_argument(
        "--health-interval",
        type=float,
        default=10.0,
        help="seconds between health checks of every replica; 0 turns them off (default 10)",
    )
    parser.add_argument("--log-dir", help="where engine logs go (default: a new temp directory)")
    wake = parser.add_argument_group(
        "on-demand wake", "override the job file's [serve] table (docs/serve.md)"
    )
    wake.add_argument(
        "--wake-timeout", type=float, help="longest a request waits for its role to wake (s)"
    )
    wake.add_argument(
        "--idle-seconds", type=float, help="an idle role goes back to sleep after this (0: never)"
    )
    wake.add_argument(
        "--min-residency", type=float, help="a woken role is not evicted before this (s)"
    )
    wake.add_argument("--max-awake", type=int, help="at most this many roles of a slice awake")


def run(args: argparse.Namespace) -> int:
    out = sys.stdout
    pm = PluginManager.create()
    try:
        loaded = load_config(args.config, role_names=pm.registered("roles"))
    except ConfigValidationError as exc:
        return reject("serve", *map(str, exc.problems))
    overrides = {
        key: getattr(args, key)
        for key in ("wake_timeout", "idle_seconds", "min_residency", "max_awake")
        if getattr(args, key, None) is not None
    }
    bad = []
    for key, value in overrides.items():
        try:
            loaded = attrs.evolve(loaded, serve=attrs.evolve(loaded.serve, **{key: value}))
        except ValueError as exc:
            bad.append(f"--{key.replace('_', '-')} {value}: {exc}")
    if bad:
        return reject("serve", *bad)
    # Relative model paths are relative to the job file, as relax run reads them.
    config = resolve_model_paths(loaded)
    found = job_preflight(loaded, pm, address=args.address, gateways=True)
    if problems := check_job(config, pm) + [str(p) for p in found.problems]:
        return reject("serve", *problems)
    for warning in found.warnings:
        print(f"relax serve: warning: {warning}", file=sys.stderr, flush=True)
    signals = ShutdownSignals(out)
    signals.install()

    def stopping() -> None:
        if not signals.holding:
            signals.hold()
            print("relax serve: shutting down …", file=out, flush=True)

    log_dir = args.log_dir or tempfile.mkdtemp(prefix="relax-serve-logs-")
    ready = False
    try:
        with ray_session(args.address, config, out) as where:
            print(f"relax serve: starting on {where}; engine logs in {log_dir}", flush=True)
            print("\n".join(describe_job(config, pm)), flush=True)
            with serve_job(
                config,
                plugin_manager=pm,
                token=args.token,
                out=out,
                log_dir=log_dir,
                health_interval=args.health_interval,
                before_teardown=stopping,
                # On a cluster that outlives this process, a group teardown must keep (an
                # engine not confirmed gone) stays reserved after it.
                detach_groups=args.address is not None,
            ) as job:
                for role, gw in job.gateways.items():
                    print(
                        f"  {role:8} gateway  {gw.url}/{role}/   ({gw.mode}, pid {gw.pid}; "
                        f"relax status {gw.url}/{role})",
                        flush=True,
                    )
                print("relax serve: ready; Ctrl-C stops everything", flush=True)
                ready = True
                last = ""  # the status table now and whenever it changes, until interrupted
                while True:
                    table = job.status()
                    if table != last:
                        print(f"\nstatus at {time.strftime('%H:%M:%S')}\n{table}", flush=True)
                        last = table
                    time.sleep(args.refresh)
    except KeyboardInterrupt:
        pass
    except LifecycleError as exc:
        print(f"relax serve: {exc}", file=sys.stderr, flush=True)
        return 1
    print("relax serve: stopped; nothing left running", flush=True)
    # Ctrl-C is how a served job ends (0); before it was ready, the start was interrupted.
    return 0 if ready else 130
