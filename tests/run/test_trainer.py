"""The core's side of the trainer: ``[run] trainer`` names a registered trainer or a class path,
an unknown one is refused before anything starts (listing the registered ones), a
``TrainerSpec`` is checked where it is built, and :func:`start_trainer` runs the class in a Ray
actor. The reference torch trainer is tested where it lives (``plugins/relax-torch-trainer``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import attrs
import pytest

from relax_core import (
    ConfigError,
    ConfigProblem,
    ConfigReader,
    LifecycleError,
    PluginManager,
    Trainer,
    TrainerSpec,
)
from relax_core.config import load_config, loads_config
from relax_core.errors import ConfigValidationError
from relax_core.jobs import resolve_model_paths
from relax_core.run.config import parse_run_config
from relax_core.run.job import run_problems
from relax_core.run.trainer import TrainerContext, load_trainer_class, start_trainer
from tests.support import run as support
from tests.support import trainers
from tests.support.plugin_managers import registering
from tests.support.trainers import BrokenTrainer, EchoTrainer, NoPush


def _with_trainers(*specs: TrainerSpec) -> PluginManager:
    return registering("mine", "relax_register_trainers", *specs)


def test_a_registered_name_gives_the_registered_class() -> None:
    pm = _with_trainers(TrainerSpec(name="echo", trainer_class=EchoTrainer))
    assert load_trainer_class("echo", pm) is EchoTrainer
    assert pm.registered("trainers")["echo"].plugin == "mine"


def test_a_class_path_names_a_trainer_nobody_registered() -> None:
    pm = _with_trainers()
    assert load_trainer_class("tests.support.trainers:EchoTrainer", pm) is EchoTrainer
    assert issubclass(EchoTrainer, Trainer)


def test_an_unknown_name_is_refused_listing_the_registered_trainers() -> None:
    pm = _with_trainers(
        TrainerSpec(name="echo", trainer_class=EchoTrainer),
        TrainerSpec(name="echo-too", trainer_class=EchoTrainer),
    )
    with pytest.raises(ConfigError, match=r"no trainer named 'ppo' is registered") as info:
        load_trainer_class("ppo", pm)
    assert info.value.path == "run.trainer"
    assert "(registered: echo, echo-too)" in str(info.value)
    assert "'package.module:ClassName'" in str(info.value)


def _unnamed_trainer_problem(pm: PluginManager) -> str:
    with pytest.raises(ConfigValidationError) as info:
        parse_run_config(loads_config("[run]\nrewards = []\n"), pm)
    (problem,) = [str(p) for p in info.value.problems]
    return problem


def test_a_job_naming_no_trainer_gets_the_one_installed() -> None:
    pm = _with_trainers(TrainerSpec(name="echo", trainer_class=EchoTrainer))
    assert parse_run_config(loads_config("[run]\nrewards = []\n"), pm).trainer == "echo"


def test_a_job_naming_no_trainer_gets_the_default_of_several() -> None:
    pm = _with_trainers(
        TrainerSpec(name="echo", trainer_class=EchoTrainer),
        TrainerSpec(name="echo-too", trainer_class=EchoTrainer, default=True),
    )
    assert parse_run_config(loads_config("[run]\nrewards = []\n"), pm).trainer == "echo-too"


def test_a_job_naming_no_trainer_is_refused_when_none_or_several_could_be_meant() -> None:
    problem = _unnamed_trainer_problem(_with_trainers())
    assert problem.startswith("run.trainer: [required] name the trainer: none is registered")
    problem = _unnamed_trainer_problem(
        _with_trainers(
            TrainerSpec(name="echo", trainer_class=EchoTrainer),
            TrainerSpec(name="echo-too", trainer_class=EchoTrainer),
        )
    )
    assert "2 are registered (echo, echo-too) and none says it is the default" in problem


@attrs.frozen
class _Options:
    rate: float = attrs.field(default=0.1, metadata={"check": ConfigReader.positive})


def test_a_trainers_options_are_its_keys_of_the_run_table_checked_at_their_key_path() -> None:
    pm = _with_trainers(TrainerSpec(name="echo", trainer_class=EchoTrainer, options=_Options))
    run = parse_run_config(loads_config("[run]\nrewards = []\nrate = 0.5\n"), pm)
    assert run.trainer_options == _Options(rate=0.5)
    assert parse_run_config(loads_config("[run]\nrewards = []\n"), pm).trainer_options == (
        _Options()
    )
    with pytest.raises(ConfigValidationError) as info:
        parse_run_config(loads_config("[run]\nrewards = []\nrate = -1\nrat = 2\n"), pm)
    problems = [str(p) for p in info.value.problems]
    assert any(p.startswith("run.rate: [range]") for p in problems), problems
    assert any(
        p.startswith("run.rat: [unknown-key] unknown key; did you mean 'rate'?") for p in problems
    )


def test_a_trainer_without_options_reads_no_key_of_the_table() -> None:
    pm = _with_trainers(TrainerSpec(name="echo", trainer_class=EchoTrainer))
    with pytest.raises(ConfigValidationError) as info:
        parse_run_config(loads_config("[run]\nrewards = []\nlearning_rate = 0.1\n"), pm)
    (problem,) = [str(p) for p in info.value.problems]
    assert problem.startswith("run.learning_rate: [unknown-key]")


def test_a_trainers_check_sees_the_whole_table() -> None:
    def check(run: Any) -> list[ConfigProblem]:
        return [ConfigProblem("run.rate", "mine", f"not with {run.mode} mode")]

    pm = _with_trainers(
        TrainerSpec(name="echo", trainer_class=EchoTrainer, options=_Options, check=check)
    )
    with pytest.raises(ConfigValidationError) as info:
        parse_run_config(loads_config("[run]\nrewards = []\n"), pm)
    assert [str(p) for p in info.value.problems] == ["run.rate: [mine] not with sync mode"]


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("tests.support.no_such_module:EchoTrainer", "cannot import 'tests.support.no_such"),
        ("tests.support.trainers:Missing", "'tests.support.trainers' has no class 'Missing'"),
        ("tests.support.trainers:NoPush", "trainers:NoPush has no push method"),
    ],
)
def test_a_class_path_that_is_not_a_trainer_is_refused_saying_why(path: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        load_trainer_class(path, _with_trainers())
    assert info.value.path == "run.trainer"


@pytest.mark.parametrize(
    ("trainer_class", "message"),
    [(NoPush, "it has no push method"), (lambda context: EchoTrainer(context), "not a class")],
)
def test_a_trainer_spec_is_checked_where_it_is_built(trainer_class: Any, message: str) -> None:
    with pytest.raises(ValueError, match=rf"TrainerSpec\.trainer_class=.*{message}"):
        TrainerSpec(name="bad", trainer_class=trainer_class)
    with pytest.raises(ValueError, match=r"TrainerSpec\.name='a:b'"):
        TrainerSpec(name="a:b", trainer_class=EchoTrainer)


@pytest.mark.parametrize("value", ["grpo", "my-trainer.v2", "pkg.mod:Trainer"])
def test_run_trainer_takes_a_name_or_a_class_path(value: str) -> None:
    run = parse_run_config(
        loads_config(f'[run]\nrewards = [{{ adapter = "x" }}]\ntrainer = "{value}"')
    )
    assert run.trainer == value


@pytest.mark.parametrize("value", ["two words", "pkg.mod:", ":Class", "9lives"])
def test_run_trainer_that_is_neither_is_a_problem_of_the_table(value: str) -> None:
    with pytest.raises(ConfigValidationError) as info:
        parse_run_config(
            loads_config(f'[run]\nrewards = [{{ adapter = "x" }}]\ntrainer = "{value}"')
        )
    (problem,) = [str(p) for p in info.value.problems]
    assert problem.startswith("run.trainer: [range] must be 'package.module:ClassName' or a")


def test_relax_run_refuses_an_unregistered_trainer_before_anything_starts(tmp_path: Path) -> None:
    for name in ("policy", "judge", "math"):
        d = tmp_path / "tiny" / name
        d.mkdir(parents=True)
        for f in ("config.json", "tokenizer.json"):
            (d / f).write_text("{}")
    config = resolve_model_paths(load_config(support.job_file(tmp_path, trainer="ppo")))
    problems = run_problems(config, parse_run_config(config), PluginManager.create())
    (problem,) = [p for p in problems if p.startswith("run.trainer")]
    assert "[trainer] no trainer named 'ppo' is registered (registered: " in problem
    assert "grpo" in problem  # the installed reference trainer is listed


def _context(**fields: Any) -> TrainerContext:
    return TrainerContext(
        job="j", model_path="nowhere", coordinator=None, sink=None, rollout=None, **fields
    )


@pytest.fixture
def ray_trainers(ray_local: Any) -> Any:
    from ray import cloudpickle

    # Ray's workers may not find the repository's tests package: send the classes by value.
    cloudpickle.register_pickle_by_value(sys.modules[trainers.__name__])
    return ray_local


@pytest.mark.ray
def test_start_trainer_runs_the_named_trainer_in_an_actor(ray_trainers: Any) -> None:
    pm = _with_trainers(TrainerSpec(name="echo", trainer_class=EchoTrainer))
    actor = start_trainer(_context(), trainer="echo", pm=pm, timeout=120)
    try:
        assert ray_trainers.get(actor.train.remote(4)) == {"batch_id": 4, "job": "j"}
        assert ray_trainers.get(actor.push.remote("5")) == {"weight_version": "5"}
    finally:
        ray_trainers.kill(actor)


@pytest.mark.ray
def test_a_trainer_that_cannot_be_built_is_a_lifecycle_error_quoting_it(
    ray_trainers: Any,
) -> None:
    pm = _with_trainers(TrainerSpec(name="broken", trainer_class=BrokenTrainer))
    with pytest.raises(LifecycleError, match=r"the trainer broken did not start: .*nowhere"):
        start_trainer(_context(), trainer="broken", pm=pm, timeout=120)


def test_start_trainer_refuses_an_unknown_push_format_before_starting_an_actor() -> None:
    pm = _with_trainers(TrainerSpec(name="echo", trainer_class=EchoTrainer))
    with pytest.raises(ConfigError, match="must be one of") as info:
        start_trainer(_context(push_format="gguf"), trainer="echo", pm=pm)
    assert info.value.path == "run.push_format"


def test_start_trainer_refuses_a_bucket_size_below_one_byte_before_starting_an_actor() -> None:
    pm = _with_trainers(TrainerSpec(name="echo", trainer_class=EchoTrainer))
    with pytest.raises(ConfigError, match="must be an integer >= 1, got 0") as info:
        start_trainer(_context(push_bucket_bytes=0), trainer="echo", pm=pm)
    assert info.value.path == "run.push_bucket_bytes"
