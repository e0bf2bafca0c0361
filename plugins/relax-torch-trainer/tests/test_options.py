"""The reference trainer's ``[run]`` keys: read through its options record by the core's
``parse_run_config``, checked at their key path, with the defaults ``docs/run.md`` lists."""

from __future__ import annotations

import pytest
from relax_torch_trainer import GRPOOptions

from relax_core import ConfigValidationError, PluginManager, loads_config, parse_run_config


def _run(plugin_manager: PluginManager, keys: str) -> GRPOOptions:
    text = f'[run]\nrewards = [{{ adapter = "x" }}]\ntrainer = "grpo"\n{keys}'
    options = parse_run_config(loads_config(text), plugin_manager).trainer_options
    assert isinstance(options, GRPOOptions)
    return options


def test_the_keys_default_as_documented(plugin_manager: PluginManager) -> None:
    options = _run(plugin_manager, "")
    assert (options.learning_rate, options.clip, options.distill_weight()) == (1e-5, 0.2, 1.0)
    assert (options.cap("sync"), options.cap("async")) == (0.0, 2.0)


def test_the_keys_a_job_file_gives_are_the_trainers(plugin_manager: PluginManager) -> None:
    options = _run(plugin_manager, "learning_rate = 1e-4\nclip = 0.3\nimportance_cap = 4\n")
    assert (options.learning_rate, options.clip, options.cap("sync")) == (1e-4, 0.3, 4.0)


@pytest.mark.parametrize(
    ("keys", "where", "says"),
    [
        ("learning_rate = 0\n", "run.learning_rate: [range]", "> 0"),
        ("importance_cap = 0.5\n", "run.importance_cap: [range]", "cap >= 1"),
        ("distill_coef = -1\n", "run.distill_coef: [range]", ">= 0"),
        ("distill_coef = 0.5\n", "run.distill_coef: [teacher-role]", "teacher_role"),
    ],
)
def test_a_bad_key_is_refused_at_its_key_path(
    plugin_manager: PluginManager, keys: str, where: str, says: str
) -> None:
    with pytest.raises(ConfigValidationError) as info:
        _run(plugin_manager, keys)
    (problem,) = [str(p) for p in info.value.problems]
    assert problem.startswith(where) and says in problem, problem
