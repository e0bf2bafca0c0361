"""The torch trainer as the core sees it: registered as ``grpo`` (the default of ``[run]
trainer``) through its real entry point, a :class:`relax_core.Trainer`, and loaded without
torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from relax_torch_trainer import GRPO_TRAINER, GRPOOptions, PolicyTrainer

from relax_core import PluginManager, Trainer, loads_config, parse_run_config


def test_the_installed_plugin_registers_grpo_through_its_entry_point(
    plugin_manager: PluginManager,
) -> None:
    assert plugin_manager.trainer("grpo") is GRPO_TRAINER
    assert GRPO_TRAINER.trainer_class is PolicyTrainer
    registered = plugin_manager.registered("trainers")["grpo"]
    assert (registered.plugin, registered.distribution) == ("torch-trainer", "relax-torch-trainer")


def test_grpo_is_the_trainer_a_job_file_naming_none_gets(plugin_manager: PluginManager) -> None:
    assert GRPO_TRAINER.default
    run = parse_run_config(loads_config("[run]\nrewards = []\n"), plugin_manager)
    assert run.trainer == GRPO_TRAINER.name and run.trainer_options == GRPOOptions()


def test_the_policy_trainer_implements_the_trainer_protocol() -> None:
    assert issubclass(PolicyTrainer, Trainer)


def test_loading_the_plugin_imports_no_torch() -> None:
    # Every relax command loads every plugin: torch is imported only in the trainer's actor.
    script = (
        "import json, sys\n"
        "from relax_core import PluginManager\n"
        "record = PluginManager.create().trainer('grpo')\n"
        "print(json.dumps([record.name, 'torch' in sys.modules]))\n"
    )
    env = {**os.environ, "RELAX_LOAD_PLUGINS": "torch-trainer"}
    env.pop("RELAX_DISABLE_PLUGINS", None)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["grpo", False]
