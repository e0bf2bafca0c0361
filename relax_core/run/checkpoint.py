"""Checkpoints of ``relax run``, and what ``relax run --resume RUN_DIR`` continues from
(``docs/run.md``, "Checkpoints and resume"); a kill at any moment leaves the last one whole."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs

from relax_core.coordination.batch import DeferredCollector
from relax_core.errors import CheckpointError
from relax_core.run.data import Prompt, PromptSource
from relax_core.run.driver import Finished
from relax_core.run.generate import StepProducer

#: The latest checkpoint of a run, in its directory.
FILE = "checkpoint.json"
#: The folder of the checkpoints' state (one ``step-N`` each; only the latest is kept).
FOLDER = "checkpoints"
#: The version of :data:`FILE`'s layout.
FORMAT = 1
#: ``[run]`` keys a resumed run may change: how many steps, what it reports, how often it
#: checkpoints, its deadlines and retries. Every other key (and the generation model) must stay
#: as the checkpointed run had it, so the resumed steps generate and train as the run would.
MAY_CHANGE = (
    "steps",
    "trackers",
    "tracker_samples",
    "strict_trackers",
    "checkpoint_every",
    "operation_timeout",
    "request_timeout",
    "stream_concurrency",
    "generation_retries",
    "base",
)


def _steps(steps: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(s) for s in steps)


@attrs.frozen
class Checkpoint:
    """What a resume needs (each key: ``docs/run.md``, "Checkpoints and resume"): ``step``
    is the first step not finished, ``cursor`` the prompts taken from the source before it."""

    step: int
    steps: int
    cursor: int
    weight_version: str
    trainer_dir: str
    trainer: Mapping[str, Any] = attrs.field(factory=dict)
    trackers: Mapping[str, str | None] = attrs.field(factory=dict)
    job: str = ""
    job_file: str | None = None
    settings: Mapping[str, Any] = attrs.field(factory=dict)
    written: float = 0.0
    format: int = FORMAT
    failed_steps: tuple[int, ...] = attrs.field(default=(), converter=_steps)

    def to_json(self) -> dict[str, Any]:
        """The checkpoint as :data:`FILE` holds it."""
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, data: Any, where: str) -> Checkpoint:
        """The checkpoint ``data`` holds (read from ``where``).

        :raises CheckpointError: not a checkpoint of this layout."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise CheckpointError(
                where, f"is not a checkpoint of format {FORMAT} (found {found!r})"
            )
        try:
            return cls(**data)
        except TypeError as exc:
            raise CheckpointError(where, f"is not a whole checkpoint: {exc}") from None


def read_checkpoint(run_dir: str) -> Checkpoint:
    """The latest checkpoint of the run in ``run_dir``.

    :raises CheckpointError: no such directory, no checkpoint in it, one that cannot be read,
        or the state it names is missing (the message says what to do)."""
    if not os.path.isdir(run_dir):
        raise CheckpointError(
            run_dir,
            "no such directory; --resume takes the directory of the run to continue (its "
            "--run-dir; by default relax-runs/<job>)",
        )
    path = os.path.join(run_dir, FILE)
    if not os.path.exists(path):
        raise CheckpointError(
            run_dir,
            f"holds no checkpoint ({FILE}): the run ended before its first one (every [run] "
            "checkpoint_every steps and after the last step), had checkpoint_every = 0, or its "
            "trainer has no save/load; nothing can be resumed: start the run again with a new "
            "--run-dir",
        )
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            run_dir, f"{FILE} cannot be read ({type(exc).__name__}: {exc})"
        ) from None
    checkpoint = Checkpoint.from_json(data, path)
    state = os.path.join(run_dir, checkpoint.trainer_dir)
    if not os.path.isdir(state):
        raise CheckpointError(
            run_dir,
            f"{FILE} names the trainer's state {checkpoint.trainer_dir}, which is missing; the "
            "run directory was changed by hand: restore it, or start the run again",
        )
    return checkpoint


def job_settings(run: Any, *, generation_model: str, model_path: str) -> dict[str, Any]:
    """What a resume must keep of a job: every ``[run]`` key but :data:`MAY_CHANGE`, as JSON
    data by key path (``run.seed``), and the generation model and its directory."""
    settings = attrs.asdict(run, recurse=True)
    out = {f"run.{key}": value for key, value in settings.items() if key not in MAY_CHANGE}
    out |= {"generation_model": generation_model, "generation_model.model_path": model_path}
    normal: dict[str, Any] = json.loads(json.dumps(out, default=str, sort_keys=True))
    return normal


def settings_problems(
    checkpoint: Checkpoint, now: Mapping[str, Any], *, run_dir: str, job_file: str
) -> list[str]:
    """Each way the job now (``now``: :func:`job_settings`) differs from the checkpointed run
    in what a resume must keep, one message each."""
    saved = checkpoint.settings
    return [
        f"{key}: the run in {run_dir} had {_short(saved.get(key))}, {job_file} now has "
        f"{_short(now.get(key))}; a resumed run must generate and train as the run it "
        "continues: put it back, or start a new run (a new --run-dir)"
        for key in sorted(set(saved) | set(now))
        if saved.get(key) != now.get(key)
    ]


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 120 else text[:117] + "..."


class Cursor:
    """The run's prompt source, counting the prompts it hands out, so a checkpoint knows the
    source's position before the first step it has not trained (:meth:`at`)."""

    def __init__(self, source: PromptSource, taken: int = 0) -> None:
        self.source = source
        self.taken = taken
        self._starts: dict[int, int] = {}

    @classmethod
    def resumed(cls, source: PromptSource, position: int) -> Cursor:
        """``source`` after ``position`` prompts were taken (and dropped) from it."""
        left = position
        while left > 0:
            got = source.take(min(left, 4096))
            if not got:
                break
            left -= len(got)
        return cls(source, position)

    def take(self, n: int) -> list[Prompt]:
        """The next ``n`` prompts of the source."""
        out = self.source.take(n)
        self.taken += len(out)
        return out

    def mark(self, step: int) -> None:
        """Step ``step`` takes its first prompts now."""
        self._starts.setdefault(step, self.taken)
        for old in [s for s in self._starts if s < step - 64]:
            del self._starts[old]

    def at(self, step: int) -> int:
        """The source's position before step ``step`` took its prompts (now, if it has not
        begun)."""
        return self._starts.get(step, self.taken)


class CursorProducer(StepProducer):
    """A :class:`~relax_core.run.generate.StepProducer` that marks where each step begins
    taking prompts from its :class:`Cursor`."""

    def __init__(self, generator: Any, cursor: Cursor) -> None:
        super().__init__(generator, cursor)
        self.cursor = cursor

    async def first(self, batch_id: int, collector: DeferredCollector, **kw: Any) -> None:
        """:meth:`StepProducer.first`, once the cursor marked the step's start."""
        self.cursor.mark(batch_id)
        await super().first(batch_id, collector, **kw)


@attrs.define(eq=False)
class Checkpointer:
    """Writes the run's checkpoints in ``run_dir``: one every ``every`` steps and after the
    last of ``steps``, once the trainer is idle; ``run_ids``: each tracker's run id."""

    run_dir: str
    every: int = attrs.field(kw_only=True)
    steps: int = attrs.field(kw_only=True)
    trainer: Any = attrs.field(kw_only=True)
    cursor: Cursor = attrs.field(kw_only=True)
    job: str = attrs.field(kw_only=True)
    job_file: str | None = attrs.field(kw_only=True)
    settings: dict[str, Any] = attrs.field(kw_only=True, converter=dict)
    run_ids: Callable[[], Mapping[str, str | None]] = attrs.field(default=dict, kw_only=True)
    say: Callable[[str], None] | None = attrs.field(default=None, kw_only=True)
    #: the checkpoints written, latest last
    written: list[Checkpoint] = attrs.field(init=False, factory=list)

    async def finished(self, finished: Finished) -> None:
        """Step ``finished.step`` and every one before it are over: a checkpoint if one is
        due, the resume going on at the step after it."""
        done = finished.step + 1
        if done == self.steps or (self.every > 0 and done % self.every == 0):
            await self.write(
                done, failed_steps=finished.failed_steps, weight_version=finished.weight_version
            )

    async def write(
        self, step: int, *, failed_steps: Sequence[int] = (), weight_version: str | None = None
    ) -> Checkpoint:
        """A checkpoint whose first unfinished step is ``step``, the trainer's weights version
        ``weight_version`` (``None``: ``step``); blocks until it is on disk.

        :raises CheckpointError: a file could not be written, or the trainer's ``save``
            failed (the previous checkpoint stays the latest)."""
        began = time.perf_counter()
        folder = os.path.join(self.run_dir, FOLDER)
        name = f"step-{step}"
        final = os.path.join(folder, name)
        temp = f"{final}.tmp"
        try:
            shutil.rmtree(temp, ignore_errors=True)
            os.makedirs(os.path.join(temp, "trainer"))
            saved = await self.trainer.save(os.path.abspath(os.path.join(temp, "trainer")))
            if os.path.exists(final):  # a run resumed from an earlier checkpoint writes it again
                shutil.rmtree(final)
            os.rename(temp, final)
            checkpoint = Checkpoint(
                step=step,
                steps=self.steps,
                cursor=self.cursor.at(step),
                weight_version=str(step) if weight_version is None else weight_version,
                failed_steps=tuple(failed_steps),
                trainer_dir=os.path.join(FOLDER, name, "trainer"),
                trainer=dict(saved or {}),
                trackers=dict(self.run_ids()),
                job=self.job,
                job_file=self.job_file,
                settings=self.settings,
                written=time.time(),
            )
            _write_json(os.path.join(self.run_dir, FILE), checkpoint.to_json())
            for entry in os.listdir(folder):
                if entry != name:
                    shutil.rmtree(os.path.join(folder, entry), ignore_errors=True)
        except Exception as exc:
            raise CheckpointError(
                self.run_dir,
                f"the checkpoint of step {step} could not be written ({type(exc).__name__}: "
                f"{exc}); the previous one is kept: fix what failed (the disk, the directory's "
                "permissions, the trainer's save) and resume from it",
            ) from exc
        self.written.append(checkpoint)
        if self.say is not None:
            failed = f" ({len(failed_steps)} failed and gone past)" if failed_steps else ""
            self.say(
                f"relax run: checkpoint: steps 0-{step - 1} done{failed}, in {self.run_dir} "
                f"({time.perf_counter() - began:.2f}s)"
            )
        return checkpoint


def _write_json(path: str, data: Any) -> None:
    """``data`` into ``path`` in one rename (a kill leaves the old file or the new one)."""
    temp = f"{path}.tmp"
    with open(temp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, path)
