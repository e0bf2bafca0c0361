"""``relax run CONFIG``: the whole inference side of RL steps, closed into a loop with a trainer.

Before anything starts, the job file and its ``[run]`` table are checked (every problem is
printed; exit status 2, nothing started). Then the job comes up on Ray (managers in actors,
engines phase by phase, the trainer, the coordinator and the batch sink: see
``relax_core.run.job``), runs its steps (``relax_core.run.loop``), and everything is shut down.

Exit status: 0 when every step committed and nothing is left running; 1 when a step failed,
an engine did not start or the shutdown left something (named on stderr); 2 when the job was
rejected before anything started; 130 on Ctrl-C (after a clean shutdown).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time

from relax_core.commands._reject import reject
from relax_core.config import load_config
from relax_core.errors import ConfigValidationError, RelaxError
from relax_core.plugins import PluginManager

NAME = "run"
HELP = "Run RL steps: generate, score deferred, commit, train, push weights (Ctrl-C stops)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="the job's TOML file, with a [run] table")
    parser.add_argument("--steps", type=int, help="steps to run (default: [run] steps, or 3)")
    parser.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per committed step and a summary on stdout (progress on stderr)",
    )
    parser.add_argument("--trace", metavar="FILE", help="write the Perfetto trace of the run")
    parser.add_argument(
        "--measure",
        action="store_true",
        help="time every phase switch against a pinned copy of the bytes it moves",
    )
    parser.add_argument(
        "--dump-samples",
        metavar="DIR",
        help="write each committed batch's samples to DIR/batch-N.jsonl (a failed step's to "
        "DIR/failed-N.jsonl)",
    )
    parser.add_argument("--address", help="an existing Ray cluster (default: a new local Ray)")
    parser.add_argument(
        "--job", help="the job's name: actor names, relax coordinator --job (default: run-<pid>)"
    )
    parser.add_argument("--log-dir", help="where engine logs go (default: a new temp directory)")


def run(args: argparse.Namespace) -> int:
    began = time.monotonic()  # the summary's wall time counts from here
    import attrs

    from relax_core.jobs import ShutdownSignals, job_preflight, ray_session, resolve_model_paths
    from relax_core.run.config import parse_run_config
    from relax_core.run.job import RunJob, run_problems
    from relax_core.run.loop import run_loop
    from relax_core.run.progress import Printer

    pm = PluginManager.create()
    try:
        loaded = load_config(args.config, role_names=pm.registered("roles"))
        config = resolve_model_paths(loaded)
        settings = parse_run_config(config)
    except ConfigValidationError as exc:
        return reject("run", [str(p) for p in exc.problems])
    if args.steps is not None:
        if args.steps < 1:
            return reject("run", [f"--steps: must be >= 1, got {args.steps}"])
        settings = attrs.evolve(settings, steps=args.steps)
    found = job_preflight(loaded, pm, address=args.address)
    problems = run_problems(config, settings, pm) + [str(p) for p in found.problems]
    if problems:
        return reject("run", problems)
    for warning in found.warnings:
        print(f"relax run: warning: {warning}", file=sys.stderr, flush=True)
    printer = Printer(json_lines=args.json, began=began)
    signals = ShutdownSignals(printer.progress_out, command="relax run")
    signals.install()
    name = args.job or f"run-{os.getpid()}"
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="relax-run-logs-")
    status = 0
    summary = None
    left: list[str] = []
    try:
        with ray_session(args.address, config, printer.progress_out) as where:
            printer.say(f"relax run: job {name} on {where}; engine logs in {log_dir}")
            job = RunJob(config, settings, pm, name=name, log_dir=log_dir)
            try:
                job.start(printer.say, on_interrupt=signals.hold)
                printer.say(
                    f"relax run: {settings.steps} step(s) of {settings.prompts_per_step} "
                    f"prompts x {settings.samples_per_prompt} samples; Ctrl-C stops"
                )
                summary = asyncio.run(
                    run_loop(
                        job,
                        printer,
                        steps=settings.steps,
                        trace=args.trace,
                        dump_dir=args.dump_samples,
                        measure=args.measure,
                    )
                )
                if summary.interrupted:  # the loop stopped its step in flight cleanly
                    signals.hold()
                    printer.say("relax run: interrupted; shutting down …")
                    status = 130
            except KeyboardInterrupt:
                signals.hold()
                printer.say("relax run: interrupted; shutting down …")
                status = 130
            except RelaxError as exc:
                signals.hold()
                print(f"relax run: {exc}", file=sys.stderr, flush=True)
                status = 1
            finally:
                signals.hold()
                left = job.teardown(printer.say)
    except KeyboardInterrupt:  # during Ray's own start or stop
        status = 130
    if summary is not None:
        row = summary.row()
        # What was started, for whoever checks that it is gone (the shutdown did).
        row["engine_pids"] = sorted(job.engine_pids)
        row["router_pids"] = sorted(job.router_pids)
        printer.summary(row)
        if summary.failure is not None:
            status = status or 1
    if left:
        print(
            "relax run: shutdown left problems:\n  " + "\n  ".join(left),
            file=sys.stderr,
            flush=True,
        )
        return 1
    printer.say("relax run: stopped; nothing left running")
    return status
