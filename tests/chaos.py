"""The chaos session: a long asynchronous CPU run under injected faults, accounted from its records.

``python -m tests.chaos`` (``nox -s chaos``; not part of the test session, it takes a long
while):

- three tiny hf models made locally (``relax-hf make-tiny-model``), the asynchronous split job of
  ``docs/examples/run-async-cpu.toml`` (rollout, genrm, teacher, one engine each) made small:
  2 prompts x 2 samples, 4 new tokens, a checkpoint after every step, failed steps gone past;
- the teacher's engine is started by the session itself (``relax-hf serve``, loopback), as a
  teacher served elsewhere would be, behind a TCP proxy it also runs
  (``tests/support/reset_proxy.py``); the job's teacher is served by ``external_urls`` = the
  proxy's URL, so its prefills cross the proxy;
- ``relax run JOB --json --run-dir D/run --dump-samples D/samples-0``; every ``--fault-every``
  steps one fault, the kinds taken in turn (the order shuffled by ``--seed``):
  ``kill9`` (SIGKILL of a random engine process the run started: rollout's or genrm's),
  ``sigstop`` (SIGSTOP of one of them for ``--stop-seconds``, then SIGCONT), ``reset`` (the
  proxy closes every open connection with a TCP RST and resets the next new one once its
  request arrived, whenever the teacher is next called: a reset meets a request however idle
  the teacher is then). The
  teacher's engine is no target of the signals: the run does not rebuild an engine it did not
  start, so a SIGKILL of it would end every later step (its owner's restart, not the run's);
- once (at ``--kill-driver-at`` committed steps) the ``relax run`` driver itself is SIGKILLed;
  what it left running (its Ray, its engines) is killed as an operator would, and the run goes
  on with ``relax run JOB --json --resume D/run --dump-samples D/samples-1``.

The report (text on stderr, JSON on stdout and in ``D/report.json``) is computed from the run's
own records: the ``--json`` rows of each driver (``D/driver-N.out``) and the samples of every
committed batch, failed step and dropped group (the ``--dump-samples`` files). A sample id is
``b{step}-p{prompt}-s{sample}`` (``relax_core.run.rollout.GroupRequest``), so the samples each
step must account for are known. It exits 1 unless: >= ``--steps`` steps (100 by default),
>= ``--min-faults`` injected faults (10) and one driver kill, no sample lost (a sample of a step
neither in a committed batch nor reported by a failed step or a drop), none trained twice (in
two committed batches, or a step committed twice; a killed driver's batches from the step the
resume's checkpoint names on are rolled back, not trained), and every step committed or
reported failed with its reason. Every process it started is killed on the way out, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

import attrs

from tests.support import run as support
from tests.support import serve
from tests.support.reset_proxy import ResettingProxy

PROMPTS, SAMPLES = 2, 2
#: the models of the job: rollout's, genrm's and the teacher's (``tiny/<name>``, its seed)
MODELS = support.MODELS


# --- accounting: pure, over the records (tests/test_chaos_accounting.py) -----------------------


@attrs.frozen
class DriverRecords:
    """What one ``relax run`` process left: its ``--json`` rows (progress events excluded) and
    the sample ids of its dumps: ``batches`` (committed, by batch id), ``failed`` and
    ``dropped`` (by step)."""

    rows: list[dict[str, Any]]
    batches: dict[int, list[str]] = attrs.field(factory=dict)
    failed: dict[int, list[str]] = attrs.field(factory=dict)
    dropped: dict[int, list[str]] = attrs.field(factory=dict)
    #: a resumed driver: the step its checkpoint named (the trainer's state reloaded is from
    #: before it, so an earlier driver's batches from this step on were trained on weights the
    #: resume threw away: rolled back, not trained)
    resumed_at: int | None = None


def expected_ids(step: int, prompts: int = PROMPTS, samples: int = SAMPLES) -> set[str]:
    """The sample ids step ``step`` generates first (``GroupRequest.sample_id``)."""
    return {f"b{step}-p{p}-s{s}" for p in range(prompts) for s in range(samples)}


def _is_step_row(r: dict[str, Any]) -> bool:
    return "step" in r and not r.get("summary") and "event" not in r


def account(
    steps: int, drivers: Sequence[DriverRecords], prompts: int = PROMPTS, samples: int = SAMPLES
) -> dict[str, Any]:
    """The figures of a chaos run from its drivers' records, and what breaks the contract
    (``problems``: empty when every step is committed or failed with its reason, no sample lost
    and none trained twice)."""
    problems: list[str] = []
    committed: dict[int, list[int]] = {}  # step -> the drivers that committed it
    failed: dict[int, dict[str, Any]] = {}  # step -> its last report
    retries: Counter[str] = Counter()
    recoveries: Counter[str] = Counter()
    trained: dict[str, list[tuple[int, int]]] = {}  # sample id -> (driver, batch) it is in
    reported: set[str] = set()
    # committed step -> its groups regenerated after a failed generation (``retries.generate``)
    regenerated: dict[int, int] = {}
    rolled_back: set[int] = set()

    def later_resume(d: int) -> int | None:
        """The earliest step a driver after ``d`` resumed at (``None``: none did)."""
        at = [r.resumed_at for r in drivers[d + 1 :] if r.resumed_at is not None]
        return min(at, default=None)

    for d, rec in enumerate(drivers):
        resume = later_resume(d)
        for r in filter(_is_step_row, rec.rows):
            step = int(r["step"])
            if resume is not None and step >= resume:
                rolled_back.add(step)  # a later driver ran it again from the checkpoint
                continue
            retries.update({k: int(v) for k, v in (r.get("retries") or {}).items()})
            if r.get("failed") or r.get("skipped"):
                failed[step] = r
                reported.update(r.get("sample_ids") or ())
                if not r.get("error"):
                    problems.append(f"step {step} failed (driver {d}) with no reason")
                continue
            committed.setdefault(step, []).append(d)
            recoveries.update({k: int(v) for k, v in (r.get("recoveries") or {}).items()})
            regenerated[step] = int((r.get("retries") or {}).get("generate", 0))
            ids = rec.batches.get(step)
            if ids is None:
                problems.append(f"step {step} committed (driver {d}) but its batch was not dumped")
                continue
            if "samples" in r and int(r["samples"]) != len(ids):
                problems.append(
                    f"step {step} (driver {d}): its row says {r['samples']} samples, its "
                    f"batch holds {len(ids)}"
                )
        for step, ids in rec.batches.items():
            if resume is not None and step >= resume:
                continue
            if d not in committed.get(step, []):
                problems.append(f"batch {step} dumped by driver {d} but no row committed it")
            for i in ids:
                trained.setdefault(i, []).append((d, step))
        for ids in (*rec.failed.values(), *rec.dropped.values()):
            reported.update(ids)
    twice = sorted(i for i, where in trained.items() if len(where) > 1)
    twice_steps = sorted(s for s, ds in committed.items() if len(ds) > 1)
    lost: list[str] = []
    unaccounted: list[int] = []
    for step in range(steps):
        if step in committed:
            continue
        if step not in failed:
            unaccounted.append(step)
            continue
        # a failed step reports itself: the samples it never generated are in no dump
        reported |= expected_ids(step, prompts, samples)
    excused = 0
    for step in range(steps):
        missing = expected_ids(step, prompts, samples) - set(trained) - reported
        # a group whose generation failed has no samples: a new group took its prompt (counted
        # in the step's retries.generate); only whole groups, as many as were regenerated
        whole = sorted(
            g
            for g in {i.rsplit("-", 1)[0] for i in missing}
            if all(f"{g}-s{j}" in missing for j in range(samples))
        )[: regenerated.get(step, 0)]
        excused += len(whole)
        lost += sorted(i for i in missing if i.rsplit("-", 1)[0] not in whole)
    if twice:
        problems.append(f"{len(twice)} samples trained twice: {twice[:8]}")
    if twice_steps:
        problems.append(f"steps committed twice: {twice_steps}")
    if lost:
        problems.append(f"{len(lost)} samples lost: {lost[:8]}")
    if unaccounted:
        problems.append(f"steps neither committed nor reported failed: {unaccounted}")
    final_failed = {s: r for s, r in failed.items() if s not in committed}
    return {
        "steps": steps,
        "steps_committed": len(committed),
        "steps_failed": [
            {"step": s, "kind": r.get("kind"), "reason": r.get("error")}
            for s, r in sorted(final_failed.items())
        ],
        "steps_failed_then_committed_after_resume": sorted(set(failed) & set(committed)),
        "steps_rolled_back_by_resume": sorted(rolled_back),
        "retries": dict(retries),
        "retries_total": sum(retries.values()),
        "recoveries": dict(recoveries),
        "recoveries_total": sum(recoveries.values()),
        "samples_committed": len(trained),
        "samples_reported": len(reported),
        "groups_regenerated": excused,
        "samples_lost": len(lost),
        "samples_trained_twice": len(twice),
        "steps_committed_twice": twice_steps,
        "problems": problems,
    }


def verdict(report: dict[str, Any], *, steps: int, min_faults: int) -> list[str]:
    """Why the session fails (empty: it passed)."""
    out = list(report["problems"])
    faults = report.get("faults", {})
    if report["steps"] < steps:
        out.append(f"{report['steps']} steps run, {steps} asked")
    injected = sum(v for k, v in faults.items() if k != "driver-kill")
    if injected < min_faults:
        out.append(f"{injected} faults injected, at least {min_faults} asked")
    if faults.get("driver-kill", 0) != 1:
        out.append(f"{faults.get('driver-kill', 0)} driver kills, 1 asked")
    return out


def read_dumps(directory: Path) -> tuple[dict[int, list[str]], ...]:
    """The sample ids of a ``--dump-samples`` directory: (batches, failed, dropped) by step."""
    out: tuple[dict[int, list[str]], ...] = ({}, {}, {})
    if not directory.is_dir():
        return out
    for path in directory.glob("*.jsonl"):
        kind, _, n = path.stem.rpartition("-")
        which = {"batch": 0, "failed": 1, "dropped": 2}.get(kind)
        if which is None:
            continue
        lines = path.read_text().splitlines()
        out[which][int(n)] = [json.loads(line)["id"] for line in lines if line.strip()]
    return out


# --- the processes ------------------------------------------------------------------------------


class Driver:
    """``relax run`` in a session of its own; its output read on threads and kept in files."""

    def __init__(self, job: Path, log: Path, *args: str) -> None:
        self.job = job
        self.log = log
        self.proc = support.start_run(job, *args)
        self.rows: list[dict[str, Any]] = []
        self._threads = [
            threading.Thread(target=self._read, args=(s, log.with_suffix(x), keep), daemon=True)
            for s, x, keep in ((self.proc.stdout, ".out", True), (self.proc.stderr, ".err", False))
        ]
        for t in self._threads:
            t.start()

    def _read(self, stream: TextIO, path: Path, keep: bool) -> None:
        with path.open("w") as f:
            for line in stream:
                f.write(line)
                f.flush()
                if keep and line.startswith("{"):
                    with contextlib.suppress(ValueError):
                        row = json.loads(line)
                        if "event" not in row:
                            self.rows.append(row)

    def steps_done(self) -> int:
        """Steps it committed or reported failed so far."""
        return sum(1 for r in list(self.rows) if _is_step_row(r))

    def finish(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        for t in self._threads:
            t.join(30)
        return code

    def kill_leftovers(self) -> None:
        """The driver's session (its Ray) and every process of the job's directory."""
        support.kill_run(self.proc, self.job.parent)


def engine_pids(job_dir: Path) -> dict[str, int]:
    """The job's managed hf engines now: model name -> pid."""
    out = {}
    for name in MODELS:
        path = str(job_dir / "tiny" / name)
        for p in serve.mentioning(path):
            cmd = serve.cmdline(p)
            if "relax_hf" in cmd and " serve " in cmd:
                out[name] = p
    return out


# --- the session -------------------------------------------------------------------------------


#: the model the session serves itself, behind the resetting proxy (the teacher's)
EXTERNAL = "math"


def _job(directory: Path, steps: int, external_url: str) -> Path:
    job = support.job_file(
        directory,
        example=support.ASYNC_EXAMPLE,
        steps=steps,
        prompts_per_step=PROMPTS,
        samples_per_prompt=SAMPLES,
        max_new_tokens=4,
        checkpoint_every=1,
        max_failed_steps=steps,
        operation_timeout=60.0,
        request_timeout=30.0,
    )
    return support.served_externally(job, EXTERNAL, external_url)


@attrs.define
class Injector:
    job_dir: Path
    rng: random.Random
    stop_seconds: float
    faults: Counter[str] = attrs.field(factory=Counter)
    log: list[dict[str, Any]] = attrs.field(factory=list)
    stopped: set[int] = attrs.field(factory=set)
    #: the proxy in front of the externally served engine (``None``: no ``reset`` fault)
    proxy: ResettingProxy | None = None
    _kinds: Iterator[str] | None = None

    def kinds(self) -> list[str]:
        return ["kill9", "sigstop"] + (["reset"] if self.proxy is not None else [])

    def next_kind(self) -> str:
        if self._kinds is None:
            order = self.kinds()
            self.rng.shuffle(order)
            self._kinds = itertools.cycle(order)
        return next(self._kinds)

    def inject(self, at_step: int) -> None:
        kind = self.next_kind()
        entry: dict[str, Any] = {"kind": kind, "after_steps": at_step, "time": time.time()}
        if kind == "reset":
            self._reset(entry)
            return
        engines = engine_pids(self.job_dir)
        if not engines:
            entry["skipped"] = "no engine running (one is being rebuilt)"
            self.log.append(entry)
            return
        model = self.rng.choice(sorted(engines))
        pid = entry["pid"] = engines[model]
        entry["model"] = model
        try:
            if kind == "kill9":
                os.kill(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGSTOP)
                self.stopped.add(pid)
                time.sleep(self.stop_seconds)
                os.kill(pid, signal.SIGCONT)
                self.stopped.discard(pid)
        except ProcessLookupError:
            entry["skipped"] = "the engine exited first"
            self.log.append(entry)
            return
        self.faults[kind] += 1
        self.log.append(entry)
        print(f"chaos: after {at_step} steps: {kind} {entry.get('model', '')}", file=sys.stderr)

    def _reset(self, entry: dict[str, Any]) -> None:
        assert self.proxy is not None
        entry["model"] = EXTERNAL
        entry["open_connections_reset"] = self.proxy.reset(new=1)
        self.faults["reset"] += 1
        self.log.append(entry)
        print(
            f"chaos: after {entry['after_steps']} steps: reset of the connections to {EXTERNAL} "
            f"({entry['open_connections_reset']} open, and the next new one)",
            file=sys.stderr,
        )

    def release(self) -> None:
        for pid in list(self.stopped):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self.stopped.clear()


def _drive(
    driver: Driver,
    injector: Injector,
    *,
    every: int,
    kill_at: int | None,
    deadline: float,
    offset: int,
) -> bool:
    """Inject a fault every ``every`` steps while ``driver`` runs; SIGKILL it once it has done
    ``kill_at`` steps (``True``: it was killed)."""  # fmt: skip
    last = 0
    while driver.proc.poll() is None:
        if time.monotonic() > deadline:
            raise TimeoutError("the chaos session ran past --timeout")
        done = driver.steps_done()
        if kill_at is not None and done >= kill_at:
            os.kill(driver.proc.pid, signal.SIGKILL)  # the driver alone, as the OOM killer would
            driver.proc.wait(60)
            injector.faults["driver-kill"] += 1
            injector.log.append({"kind": "driver-kill", "after_steps": done, "time": time.time()})
            print(f"chaos: after {done} steps: SIGKILL of the driver", file=sys.stderr)
            return True
        if done // every > last // every and done > 0:
            injector.inject(offset + done)
        last = done
        time.sleep(0.5)
    return False


def text_report(report: dict[str, Any]) -> str:
    lines = [
        f"steps: {report['steps_committed']} committed of {report['steps']}, "
        f"{len(report['steps_failed'])} failed",
        *(f"  step {f['step']} failed: {f['kind']}: {f['reason']}" for f in report["steps_failed"]),
        f"retries: {report['retries_total']} {report['retries']}",
        f"recoveries: {report['recoveries_total']} {report['recoveries']}",
        f"faults: {report['faults']}",
        f"proxy: {report.get('proxy')}",
        f"samples: {report['samples_committed']} committed, {report['samples_reported']} "
        f"reported failed or dropped, {report['samples_lost']} lost, "
        f"{report['samples_trained_twice']} trained twice",
        f"rolled back by the resume (committed after its checkpoint, run again): "
        f"steps {report['steps_rolled_back_by_resume']}",
        f"wall: {report['wall_s']:.0f} s",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--fault-every", type=int, default=3, help="steps between faults")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-faults", type=int, default=10)
    parser.add_argument("--stop-seconds", type=float, default=3.0)
    parser.add_argument("--kill-driver-at", type=int, help="steps done (default: half)")
    parser.add_argument("--dir", type=Path, help="where it works (default: a temporary one)")
    parser.add_argument("--timeout", type=float, default=4 * 3600, help="seconds in all")
    args = parser.parse_args(argv)
    base = args.dir or Path(tempfile.mkdtemp(prefix="relax-chaos-"))
    base.mkdir(parents=True, exist_ok=True)
    job_dir = base / "job"
    print(f"chaos: working in {base}", file=sys.stderr)
    started = time.monotonic()
    deadline = started + args.timeout
    drivers: list[Driver] = []
    injector: Injector | None = None
    external: Any = None
    proxy: ResettingProxy | None = None

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        job_dir.mkdir(exist_ok=True)
        support.make_models(job_dir)
        # The teacher's engine, started here as its owner would, from a path outside the job's
        # directory (what a driver leaves running is found by that directory); the proxy in front.
        (base / "external").mkdir(exist_ok=True)
        served = base / "external" / EXTERNAL
        if not served.exists():
            served.symlink_to(job_dir / "tiny" / EXTERNAL, target_is_directory=True)
        external = support.start_hf_engine(served)
        upstream = str(external.base_url).rsplit(":", 1)
        proxy = ResettingProxy(upstream[0].removeprefix("http://"), int(upstream[1]))
        job = _job(job_dir, args.steps, proxy.start())
        injector = Injector(job_dir, random.Random(args.seed), args.stop_seconds, proxy=proxy)
        kill_at = args.kill_driver_at if args.kill_driver_at is not None else args.steps // 2
        run_dir = base / "run"
        first = Driver(
            job, base / "driver-0", "--json", "--run-dir", str(run_dir),
            "--dump-samples", str(base / "samples-0"),
        )  # fmt: skip
        drivers.append(first)
        killed = _drive(
            first, injector, every=args.fault_every, kill_at=kill_at, deadline=deadline, offset=0
        )
        injector.release()
        codes = []
        resumed_at: int | None = None
        if killed:
            first.finish(60)
            first.kill_leftovers()  # its Ray and engines, as an operator would
            resumed_at = int(json.loads((run_dir / "checkpoint.json").read_text())["step"])
            second = Driver(
                job, base / "driver-1", "--json", "--resume", str(run_dir),
                "--dump-samples", str(base / "samples-1"),
            )  # fmt: skip
            drivers.append(second)
            _drive(
                second, injector, every=args.fault_every, kill_at=None, deadline=deadline,
                offset=first.steps_done(),
            )  # fmt: skip
            injector.release()
            codes.append(second.finish(max(1.0, deadline - time.monotonic())))
        else:
            codes.append(first.finish(max(1.0, deadline - time.monotonic())))
        records = [
            DriverRecords(
                d.rows, *read_dumps(base / f"samples-{i}"), resumed_at=resumed_at if i else None
            )
            for i, d in enumerate(drivers)
        ]
        report = account(args.steps, records)
        report["faults"] = dict(injector.faults)
        report["proxy"] = {
            "open_reset": proxy.open_reset,
            "new_reset": proxy.new_reset,
            "accepted": proxy.accepted,
        }
        report["fault_log"] = injector.log
        report["exit_status"] = codes[-1]
        report["wall_s"] = time.monotonic() - started
        report["argv"] = sys.argv[1:] if argv is None else list(argv)
        bad = verdict(report, steps=args.steps, min_faults=args.min_faults)
        if codes[-1] != 0:
            bad.append(f"the last relax run exited with {codes[-1]} (see {drivers[-1].log}.err)")
        report["verdict"] = bad
        (base / "report.json").write_text(json.dumps(report, indent=2))
        print(json.dumps({k: v for k, v in report.items() if k != "fault_log"}))
        print(text_report(report), file=sys.stderr)
        for line in bad:
            print(f"chaos: FAILED: {line}", file=sys.stderr)
        print("chaos: passed" if not bad else "chaos: failed", file=sys.stderr)
        return 0 if not bad else 1
    except KeyboardInterrupt:
        print("chaos: interrupted; cleaning up", file=sys.stderr)
        return 130
    finally:
        if injector is not None:
            injector.release()
        for d in drivers:
            d.kill_leftovers()
        if proxy is not None:
            proxy.close()
        if external is not None:
            external.kill()


if __name__ == "__main__":
    sys.exit(main())
