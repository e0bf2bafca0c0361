"""``[run.generation]``: single-turn is the default shape; the multi-turn shape's keys (the
relax-agent plugin's), its environment and the environment's own keys are checked before
anything starts, each problem with its key path."""

from __future__ import annotations

import pytest
from relax_agent import MultiTurn

from relax_core.config import loads_config
from relax_core.plugins import PluginManager
from relax_core.run.config import parse_run_config
from relax_core.run.generate import SingleTurn
from relax_core.run.rollout import build_rollout_shape, rollout_problems

BASE = '[run]\nrewards = [{ adapter = "environment" }]\n'
MODEL = {"model": "policy", "model_path": "/nonexistent", "model_where": "roles.rollout.models.p"}


@pytest.fixture(scope="module")
def pm() -> PluginManager:
    return PluginManager.create()


def _problems(text: str, pm: PluginManager) -> list[str]:
    run = parse_run_config(loads_config(BASE + text))
    return [str(p) for p in rollout_problems(run.generation, run, pm, **MODEL)]


def test_single_turn_is_the_default_shape(pm: PluginManager) -> None:
    run = parse_run_config(loads_config(BASE))
    assert run.generation.shape == "single-turn"
    assert isinstance(build_rollout_shape(run.generation, run, pm, **MODEL), SingleTurn)


def test_a_multi_turn_table_builds_the_shape_with_its_environment(pm: PluginManager) -> None:
    run = parse_run_config(
        loads_config(
            BASE + '[run.generation]\nshape = "multi-turn"\nenvironment = "calculator"\n'
            "max_turns = 3\nmax_total_tokens = 300\ntool_timeout = 2.5\n"
            "[run.generation.env]\nguided_first_turn = true\n"
        )
    )
    shape = build_rollout_shape(run.generation, run, pm, **MODEL)
    assert isinstance(shape, MultiTurn)
    assert (shape.environment.name, shape.max_turns, shape.max_total_tokens) == (
        "calculator", 3, 300,
    )  # fmt: skip
    assert shape.tool_timeout == 2.5 and shape.env_options == {"guided_first_turn": True}


def test_every_problem_is_named_by_its_key_path(pm: PluginManager) -> None:
    assert _problems('[run.generation]\nshape = "multi-turns"\n', pm) == [
        "run.generation.shape: [shape] no rollout shape named 'multi-turns' is registered; known: "
        "['multi-turn', 'single-turn']. Is the plugin that provides it installed and enabled?"
    ]
    (missing,) = _problems('[run.generation]\nshape = "multi-turn"\n', pm)
    assert missing.startswith("run.generation.environment:")
    (typo,) = _problems('[run.generation]\nshape = "multi-turn"\nenviroment = "calculator"\n', pm)
    assert typo.startswith("run.generation.enviroment:") and "environment" in typo
    (unknown,) = _problems('[run.generation]\nshape = "multi-turn"\nenvironment = "chess"\n', pm)
    assert "no environment named 'chess' is registered; known: ['calculator'" in unknown
    problems = _problems(
        '[run.generation]\nshape = "multi-turn"\nenvironment = "calculator"\nmax_turns = 0\n'
        '[run.generation.env]\nguided_first_turn = "yes"\ntool_rewards = 1\n',
        pm,
    )
    assert [p.split(":")[0] for p in problems] == [
        "run.generation.max_turns",
        "run.generation.env.tool_rewards",
        "run.generation.env.guided_first_turn",
    ]
