"""``relax run CONFIG``: check the job, bring it up on Ray, run its steps, shut everything down
(``docs/run.md`` has the run directory, ``--resume`` and the exit statuses)."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import attrs

from relax_core.commands._reject import reject
from relax_core.config import load_config
from relax_core.errors import CheckpointError, ConfigValidationError, RelaxError, TrackerError
from relax_core.plugins import PluginManager

NAME = "run"
HELP = "Run RL steps: generate, score deferred, commit, train, push weights (Ctrl-C stops)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config",
        nargs="?",
        help="the job's TOML file, with a [run] table (with --resume: the checkpointed run's, "
        "by default)",
    )
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
    parser.add_argument(
        "--log-dir",
        help="where engine logs go (default: RUN_DIR/engine-logs with a run directory, else a "
        "temp directory removed when the run ends well)",
    )
    parser.add_argument(
        "--tracker",
        action="append",
        default=[],
        metavar="NAME",
        help="also report to this tracker (repeatable; added to [run] trackers): jsonl, "
        "tensorboard, a plugin's (relax plugins lists them)",
    )
    parser.add_argument(
        "--strict-trackers",
        action="store_true",
        help="a tracker's failure ends the run (default: reported once, the run goes on)",
    )
    parser.add_argument(
        "--run-dir",
        metavar="DIR",
        help="where the run keeps its records: the trackers' files, the trace, the report "
        "(default with a tracker or --report: relax-runs/<job>); must be new or empty",
    )
    parser.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the run whose directory is RUN_DIR from its last checkpoint (its first "
        "untrained step; its job file unless CONFIG names it; the same directory)",
    )
    parser.add_argument(
        "--report",
        action="store_true",
        help="write RUN_DIR/report.html at the end (relax report; turns the jsonl tracker on, "
        "with its report option)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve the driver's Prometheus metrics (phase histograms, step counters) on PORT "
        "while the run runs",
    )
    parser.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        metavar="HOST",
        help="the address --metrics-port binds (default: 127.0.0.1)",
    )


def _with_trackers(settings: Any, args: argparse.Namespace) -> Any:
    """``settings`` with ``--tracker``, ``--report`` and ``--strict-trackers`` applied."""
    from relax_core.tracking.tracker import TrackerEntry

    entries = list(settings.trackers)
    names = [e.name for e in entries]
    wanted = [*args.tracker, *(["jsonl"] if args.report else [])]
    for i, name in enumerate(wanted):
        if name not in names:
            where = f"--tracker[{i}]" if i < len(args.tracker) else "--report"
            entries.append(TrackerEntry(name, {}, where))
            names.append(name)
    if args.report:
        # The jsonl tracker writes RUN_DIR/report.html as it closes (its report option).
        entries = [
            attrs.evolve(e, options={**e.options, "report": True}) if e.name == "jsonl" else e
            for e in entries
        ]
    strict = settings.strict_trackers or args.strict_trackers
    return attrs.evolve(settings, trackers=tuple(entries), strict_trackers=strict)


def _trainer_checkpoints(settings: Any, pm: PluginManager) -> bool:
    """Whether the run's trainer has ``save`` and ``load``."""
    from relax_core.run.trainer import load_trainer_class, trainer_checkpoints

    try:
        return trainer_checkpoints(load_trainer_class(settings.trainer, pm))
    except RelaxError:
        return False  # run_problems said why


def _resume_problems(
    resume: Any, settings: Any, config: Any, pm: PluginManager, args: argparse.Namespace
) -> list[str]:
    """Why the run in ``args.resume`` cannot go on with this job, one message each."""
    from relax_core.run.checkpoint import job_settings, settings_problems
    from relax_core.run.job import generation_role

    out: list[str] = []
    if resume.step >= settings.steps:
        out.append(
            f"--resume: the run in {args.resume} trained all {resume.step} of its steps; give "
            f"--steps N (N > {resume.step}) to run more of them"
        )
    if settings.checkpoint_every <= 0:
        out.append(
            "run.checkpoint_every: a resumed run keeps checkpoints in its directory; set it "
            "to 1 or more"
        )
    if not _trainer_checkpoints(settings, pm):
        out.append(
            f"run.trainer: the trainer {settings.trainer} has no load, so its state cannot be "
            "resumed (docs/plugins.md#a-trainer-plugin)"
        )
    gen = generation_role(config, pm)
    if gen is not None and config.role(gen).models:
        model = config.role(gen).models[0]
        now = job_settings(settings, generation_model=model.name, model_path=model.model_path)
        out += [
            f"--resume: {p}"
            for p in settings_problems(resume, now, run_dir=args.resume, job_file=str(args.config))
        ]
    return out


def run(args: argparse.Namespace) -> int:
    began = time.monotonic()  # the summary's wall time counts from here
    from relax_core.jobs import ShutdownSignals, job_preflight, ray_session, resolve_model_paths
    from relax_core.run.checkpoint import read_checkpoint
    from relax_core.run.config import parse_run_config
    from relax_core.run.job import RunJob, run_problems
    from relax_core.run.loop import RunSummary, run_loop
    from relax_core.run.metrics import serve_metrics
    from relax_core.run.progress import Printer
    from relax_core.tracking.hub import Trackers

    pm = PluginManager.create()
    resume = None
    if args.resume is not None:
        if args.run_dir is not None and os.path.abspath(args.run_dir) != os.path.abspath(
            args.resume
        ):
            return reject(
                "run",
                f"--run-dir: a resumed run keeps its directory ({args.resume}); drop --run-dir",
            )
        try:
            resume = read_checkpoint(args.resume)
        except CheckpointError as exc:
            return reject("run", f"--resume: {exc}")
        if args.config is None:
            args.config = resume.job_file
            if args.config is None or not os.path.exists(args.config):
                return reject(
                    "run",
                    f"--resume: the checkpointed run's job file {resume.job_file} is gone; give "
                    f"the job file: relax run JOB.toml --resume {args.resume}",
                )
        args.job = args.job or resume.job or None
    if args.config is None:
        return reject("run", "CONFIG: give the job's TOML file (or --resume RUN_DIR)")
    try:
        loaded = load_config(args.config, role_names=pm.registered("roles"))
        config = resolve_model_paths(loaded)
        settings = parse_run_config(config, pm)
    except ConfigValidationError as exc:
        return reject("run", *map(str, exc.problems))
    if args.steps is not None:
        if args.steps < 1:
            return reject("run", f"--steps: must be >= 1, got {args.steps}")
        settings = attrs.evolve(settings, steps=args.steps)
    settings = _with_trackers(settings, args)
    found = job_preflight(loaded, pm, address=args.address)
    problems = run_problems(config, settings, pm) + [str(p) for p in found.problems]
    name = args.job or f"run-{os.getpid()}"
    run_dir = args.resume if args.resume is not None else args.run_dir
    if run_dir is None and settings.trackers:
        run_dir = os.path.join("relax-runs", name)
    checkpoint_dir = run_dir if settings.checkpoint_every > 0 else None
    if resume is not None:
        problems += _resume_problems(resume, settings, config, pm, args)
    elif run_dir is not None and os.path.isdir(run_dir) and os.listdir(run_dir):
        # Appending a second run to one run.jsonl mixed both in its report.
        held = sorted(os.listdir(run_dir))
        listed = ", ".join(held[:4]) + (", …" if len(held) > 4 else "")
        problems.append(
            f"--run-dir: {run_dir} already holds a run's records ({listed}); give a new "
            "--run-dir (or --job name), remove that directory, or continue that run with "
            f"--resume {run_dir}"
        )
    probe = pm.registered("run_probes").get("switching") if args.measure else None
    if args.measure and probe is None:
        problems.append(
            "--measure: no plugin provides the switch report (a run probe named 'switching'); "
            "pip install relax-bench, or run without --measure"
        )
    if problems:
        return reject("run", *problems)
    for warning in found.warnings:
        print(f"relax run: warning: {warning}", file=sys.stderr, flush=True)
    printer = Printer(json_lines=args.json, began=began)
    signals = ShutdownSignals(printer.progress_out, command="relax run")
    signals.install()
    trace = args.trace
    if run_dir is not None:
        os.makedirs(run_dir, exist_ok=True)
        # A resumed run keeps the trace of the run it continues.
        trace_name = "trace.json" if resume is None else f"trace-from-{resume.step}.json"
        trace = trace or os.path.join(run_dir, trace_name)
    if checkpoint_dir is not None and not _trainer_checkpoints(settings, pm):
        printer.say(
            f"relax run: no checkpoints: the trainer {settings.trainer} has no save/load "
            "(docs/plugins.md#a-trainer-plugin)"
        )
        checkpoint_dir = None
    # Engine logs live with the run's records; a run without a run directory logs to a temp
    # directory that is removed when the run ends well and kept (and named) when it does not.
    temp_logs = args.log_dir is None and run_dir is None
    if args.log_dir is not None:
        log_dir = args.log_dir
    elif run_dir is not None:
        log_dir = os.path.join(run_dir, "engine-logs")
        os.makedirs(log_dir, exist_ok=True)
    else:
        log_dir = tempfile.mkdtemp(prefix="relax-run-logs-")
    metrics = None
    if args.metrics_port is not None:
        try:
            metrics = serve_metrics(args.metrics_port, args.metrics_host)
        except OSError as exc:
            address = f"{args.metrics_host}:{args.metrics_port}"
            return reject("run", f"--metrics-port: cannot serve on {address}: {exc}")
    status = 0
    summary = None
    error_text: str | None = None
    trackers = None
    left: list[str] = []
    job = None
    try:
        with ray_session(args.address, config, printer.progress_out) as where:
            printer.say(f"relax run: job {name} on {where}; engine logs in {log_dir}")
            if run_dir is not None:
                printer.say(f"relax run: the run's records in {run_dir}")
            if metrics is not None:
                printer.say(
                    f"relax run: Prometheus metrics on http://{args.metrics_host}:"
                    f"{metrics.server_port}/metrics"
                )
            job = RunJob(config, settings, pm, name=name, log_dir=log_dir)
            try:
                models = sum(len(role.models) for role in config.roles)
                with printer.waiting("starting engines", total=models, unit="models") as bar:
                    job.start(printer.say, on_interrupt=signals.hold, on_started=bar.update)
                if run_dir is not None and settings.trackers:
                    trackers = Trackers.open(
                        settings.trackers, pm, run_dir=run_dir, job=name, say=printer.say,
                        strict=settings.strict_trackers,
                        resume_step=None if resume is None else resume.step,
                        resume_ids=None if resume is None else resume.trackers,
                    )  # fmt: skip
                first = "" if resume is None else f" from step {resume.step}"
                printer.say(
                    f"relax run: {settings.steps} step(s){first} of {settings.prompts_per_step} "
                    f"prompts x {settings.samples_per_prompt} samples; Ctrl-C stops"
                )
                summary = asyncio.run(
                    run_loop(
                        job, printer, steps=settings.steps, trace=trace, dump_dir=args.dump_samples,
                        measure=None if probe is None else probe.record, trackers=trackers,
                        checkpoint_dir=checkpoint_dir, resume=resume,
                    )
                )  # fmt: skip
                if summary.interrupted:  # the loop stopped its step in flight cleanly
                    status = 130
            except KeyboardInterrupt:
                status = 130
            except Exception as exc:  # a bug (of Relax or a plugin) too: said, never a traceback
                signals.hold()
                status, error_text = 1, f"{type(exc).__name__}: {exc}"
                said = f"{exc}" if isinstance(exc, RelaxError) else (
                    f"unexpected error: {error_text} (a bug in Relax or a plugin: please report "
                    "it with the job file; everything is shut down now)"
                )  # fmt: skip
                print(f"relax run: {said}", file=sys.stderr, flush=True)
            finally:
                signals.hold()
                if status == 130:
                    printer.say("relax run: interrupted; shutting down …")
                try:
                    if trackers is not None:
                        trackers.close(None if summary is None else summary.row())
                except TrackerError as error:
                    print(f"relax run: {error}", file=sys.stderr, flush=True)
                    status = status or 1
                left = job.teardown(printer.say)
    except KeyboardInterrupt:  # during Ray's own start or stop
        status = 130
    finally:
        if metrics is not None:
            metrics.shutdown()
            metrics.server_close()
    if summary is None:  # the --json stream ends with a summary whatever happened
        error_text = error_text or "the run did not start"
        startup = time.monotonic() - began
        summary = RunSummary(name, settings.steps, startup_seconds=startup, error=error_text)
    row = summary.row()
    # What was started, for whoever checks that it is gone (the shutdown did).
    row["engine_pids"] = sorted(job.engine_pids) if job is not None else []
    row["router_pids"] = sorted(job.router_pids) if job is not None else []
    printer.summary(row)
    if summary.failure is not None or summary.error is not None:
        status = status or 1
    if left:
        lines = "\n  ".join(left)
        print(f"relax run: shutdown left problems:\n  {lines}", file=sys.stderr, flush=True)
        return 1
    if temp_logs and status == 0:
        shutil.rmtree(log_dir, ignore_errors=True)
    elif temp_logs:
        printer.say(f"relax run: engine logs kept in {log_dir}")
    printer.say("relax run: stopped; nothing left running")
    return status
