"""docs/plugins.md's "A trainer plugin" as written: its distribution's files are the ones shown,
its hook registers ``grpo-sgd``, ``[run] trainer`` finds it by that name, and the trainer it
names builds on a micro checkpoint with the optimizer it promises."""

from __future__ import annotations

import importlib.util
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from relax_core import PluginManager, Trainer, loads_config, parse_run_config
from relax_core.run.trainer import TrainerContext, load_trainer_class
from tests.support import docs
from tests.support.serve import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "plugins.md"


TEXT = docs.section("plugins.md", "A trainer plugin")


@pytest.fixture(scope="module")
def plugin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModuleType]:
    """The section's package, written out and imported as its entry point names it."""
    root = tmp_path_factory.mktemp("relax-grpo-sgd")
    for path, text in docs.files(TEXT).items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    (module_name,) = project["entry-points"]["relax"].values()
    spec = importlib.util.spec_from_file_location(module_name, root / module_name / "__init__.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[module_name]


def test_the_section_shows_a_distribution_with_its_entry_point() -> None:
    files = docs.files(TEXT)
    assert set(files) == {"pyproject.toml", "relax_grpo_sgd/__init__.py"}
    project = tomllib.loads(files["pyproject.toml"])["project"]
    assert project["entry-points"]["relax"] == {"grpo-sgd": "relax_grpo_sgd"}
    (run,) = [tomllib.loads(b)["run"] for b in docs.blocks(TEXT, "toml") if "[run]" in b]
    assert run == {"trainer": "grpo-sgd", "learning_rate": 0.01}


def test_its_trainer_is_found_by_the_name_run_trainer_gives(plugin: ModuleType) -> None:
    pm = PluginManager.create(plugins=[("grpo-sgd", plugin)])
    cls = load_trainer_class("grpo-sgd", pm)
    assert cls is plugin.SGDTrainer and issubclass(cls, Trainer)
    assert pm.registered("trainers").keys() >= {"grpo", "grpo-sgd"}


def test_the_learning_rate_the_job_gives_is_the_trainers(plugin: ModuleType) -> None:
    pm = PluginManager.create(plugins=[("grpo-sgd", plugin)])
    (block,) = [b for b in docs.blocks(TEXT, "toml") if "[run]" in b]
    text = block + 'rewards = [{ adapter = "exact-match" }]\n'
    run = parse_run_config(loads_config(text), pm)
    assert (run.trainer, run.trainer_options.learning_rate) == ("grpo-sgd", 0.01)


def test_its_trainer_builds_with_plain_sgd(plugin: ModuleType, tmp_path: Path) -> None:
    import torch

    model = make_tiny_model(tmp_path / "policy")
    context = TrainerContext(
        job="doc", model_path=str(model), coordinator=None, sink=None, rollout=None
    )
    trainer = plugin.SGDTrainer(context)
    assert type(trainer.optimizer) is torch.optim.SGD
    assert trainer.optimizer.defaults["lr"] == trainer.options.learning_rate == 1e-5
