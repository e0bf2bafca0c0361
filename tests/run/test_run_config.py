"""The ``[run]`` table and what ``relax run`` checks before anything starts: every problem
with its key path, the defer preflight filled from the table, a clear exit 2 with nothing
started."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from relax_core.config import load_config, loads_config
from relax_core.errors import ConfigValidationError
from relax_core.jobs import check_job, resolve_model_paths
from relax_core.plugins import PluginManager
from relax_core.run.config import DEFAULT_TRAINER, RewardWeight, RunConfig, parse_run_config
from relax_core.run.job import run_problems
from tests.support import run as support

ROOT = Path(__file__).resolve().parents[2]


def _run(text: str) -> RunConfig:
    return parse_run_config(loads_config(text))


def _problems(text: str) -> list[str]:
    with pytest.raises(ConfigValidationError) as info:
        _run(text)
    return [str(p) for p in info.value.problems]


def test_the_run_table_is_read_with_its_defaults() -> None:
    run = _run('[run]\nrewards = [{ adapter = "exact-match" }, { adapter = "digits", weight = 2 }]')
    assert run.rewards == (RewardWeight("exact-match", 1.0), RewardWeight("digits", 2.0))
    assert (run.steps, run.prompts_per_step, run.samples_per_prompt) == (3, 4, 4)
    assert run.dataset == "arithmetic" and run.trainer == DEFAULT_TRAINER
    assert run.teacher_role is None and run.teacher_top_k == 0


def test_every_problem_of_the_table_is_reported_at_once_with_its_key_path() -> None:
    problems = _problems(
        "[run]\n"
        "steps = 0\n"
        "prompt_per_step = 4\n"
        'teacher_mode = "full"\n'
        'teacher_role = "teacher"\n'
        'rewards = [{ adapter = "a", weight = 1 }, { adapter = "a" }, { weight = 1 }]\n'
        'trainer = "not an import path"\n'
        'push_format = "ipc"\n'
    )
    joined = "\n".join(problems)
    assert "run.steps: [range] must be >= 1, got 0" in joined
    assert "run.prompt_per_step: [unknown-key]" in joined and "prompts_per_step" in joined
    assert "run.teacher_mode: [choice]" in joined
    assert "run.rewards[1].adapter: [duplicate]" in joined
    assert "run.rewards[2].adapter: [required]" in joined
    assert "run.trainer: [range] must be 'package.module:ClassName'" in joined
    assert "run.push_format: [push-format]" in joined and "trainer_device = 'cuda'" in joined


def test_teacher_keys_need_a_teacher_role_and_top_k_needs_top_k_mode() -> None:
    joined = "\n".join(
        _problems('[run]\nrewards = [{ adapter = "x" }]\ntop_k = 4\ndistill_coef = 0.5\n')
    )
    assert "run.top_k: [teacher-mode]" in joined
    assert "run.distill_coef: [teacher-role]" in joined
    assert "[required]" not in joined


def test_the_rewards_are_required(tmp_path: Path) -> None:
    assert _problems("[run]\nsteps = 2\n") == [
        "run.rewards: [required] give at least one reward adapter: rewards = [{ adapter = "
        '"exact-match" }]'
    ]


def test_a_jsonl_dataset_and_model_paths_are_relative_to_the_job_file(tmp_path: Path) -> None:
    (tmp_path / "tiny" / "policy").mkdir(parents=True)
    job = tmp_path / "job.toml"
    job.write_text(
        '[roles.rollout.models.policy]\nbackend = "hf"\ndevice = "cpu"\n'
        'model_path = "tiny/policy"\n\n[run]\ndataset = "data/train.jsonl"\n'
        'rewards = [{ adapter = "digits" }]\n'
    )
    config = resolve_model_paths(load_config(job))
    assert config.role("rollout").models[0].model_path == str(tmp_path.resolve() / "tiny/policy")
    assert parse_run_config(config).dataset == str(tmp_path.resolve() / "data" / "train.jsonl")
    # Every relative path is read so, whether or not it names a directory (the preflight
    # refuses a missing one): a model directory is local, never a hub id.
    job.write_text(job.read_text().replace("tiny/policy", "Qwen/Qwen3-0.6B"))
    config = resolve_model_paths(load_config(job))
    assert config.role("rollout").models[0].model_path == str(
        tmp_path.resolve() / "Qwen/Qwen3-0.6B"
    )


def test_serve_and_plan_accept_a_job_file_with_a_run_table(tmp_path: Path) -> None:
    config = load_config(support.EXAMPLE)
    assert config.run["reward_role"] == "genrm"
    assert check_job(config, PluginManager.create()) == []


def _example(tmp_path: Path, **run: object) -> tuple[object, RunConfig]:
    for name in ("policy", "judge", "math"):
        d = tmp_path / "tiny" / name
        d.mkdir(parents=True, exist_ok=True)
        for f in ("config.json", "tokenizer.json"):
            (d / f).write_text("{}")
    config = resolve_model_paths(load_config(support.job_file(tmp_path, **run)))
    return config, parse_run_config(config)  # type: ignore[arg-type]


def test_the_example_passes_every_check(tmp_path: Path) -> None:
    config, run = _example(tmp_path)
    assert run_problems(config, run, PluginManager.create()) == []  # type: ignore[arg-type]


def test_the_defer_preflight_is_filled_from_the_run_table(tmp_path: Path) -> None:
    from relax_core import RewardSpec
    from relax_core.plugins import module_plugin

    def rewards(register: object) -> None:
        register(RewardSpec(name="online-only", fn=lambda r, label: 0.0))  # type: ignore[operator]

    pm = PluginManager.create(
        plugins=[("online", module_plugin("online", relax_register_reward_adapters=rewards))]
    )
    config, run = _example(
        tmp_path,
        rewards=[{"adapter": "genrm-judge"}, {"adapter": "online-only"}, {"adapter": "nope"}],
        partial_rollout=True,
        eval_dataset="eval.jsonl",
    )
    joined = "\n".join(run_problems(config, run, pm))  # type: ignore[arg-type]
    assert "run.rewards[1]: [defer-adapter] reward adapter 'online-only'" in joined
    assert "run.rewards[2]: [plugin] no reward adapter 'nope' is registered" in joined
    assert "run.partial_rollout: [defer-unstageable]" in joined
    assert "run.eval_dataset: [defer-unstageable]" in joined
    assert "run.rewards[0]" not in joined


def test_the_roles_the_table_names_must_suit_the_job(tmp_path: Path) -> None:
    _example(tmp_path)  # the model directories
    text = support.job_file(tmp_path, reward_role="judge", teacher_role="rollout").read_text()
    (tmp_path / "job.toml").write_text(
        text.replace('weight_source = "ACTOR"', 'weight_source = "DCS"')
    )
    config = resolve_model_paths(load_config(tmp_path / "job.toml"))
    joined = "\n".join(run_problems(config, parse_run_config(config), PluginManager.create()))
    assert "run.reward_role: [reference] role 'judge' is not configured" in joined
    assert "run.teacher_role: [generation-role] 'rollout' generates the batch" in joined
    # DCS weights take disk updates only: the trainer could not push its tensors.
    assert "roles.rollout.models.policy.weight_source: [weights] DCS weights take no tensor" in (
        joined
    )


def test_relax_run_rejects_a_bad_job_with_exit_2_and_starts_nothing(tmp_path: Path) -> None:
    job = support.job_file(tmp_path, steps=0)
    out = subprocess.run(
        [sys.executable, "-m", "relax_core", "run", str(job)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert "relax run: rejected:" in out.stderr and "nothing was started" in out.stderr
    assert "run.steps: [range] must be >= 1, got 0" in out.stderr
    # The models are not there either: named with their key path and what to do.
    out = subprocess.run(
        [sys.executable, "-m", "relax_core", "run", str(support.job_file(tmp_path))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "roles.rollout.models.policy.model_path: [model-dir] no model directory" in out.stderr
    assert "Ray" not in out.stdout


def test_the_h200_example_holds_60_percent_of_the_gpu_per_engine_and_passes_every_check(
    tmp_path: Path,
) -> None:
    import json

    from relax_hf.plugin import serve_argv
    from relax_hf.tiny import TINY_SIZES
    from transformers import LlamaConfig

    from relax_core.jobs import engine_launch_specs

    shape = LlamaConfig(vocab_size=512, **TINY_SIZES["small"]).to_dict()
    for name in ("policy", "judge", "math"):
        d = tmp_path / "small" / name
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps({**shape, "dtype": "bfloat16"}))
        (d / "tokenizer.json").write_text("{}")
    job = tmp_path / "run-h200.toml"
    job.write_text((ROOT / "docs" / "examples" / "run-h200.toml").read_text())
    pm = PluginManager.create()
    config = resolve_model_paths(load_config(job))
    run = parse_run_config(config)
    assert run_problems(config, run, pm) == []
    assert (run.trainer_device, run.push_format) == ("cuda", "ipc")
    fractions = {m.path: m.engine.mem_fraction_static for m in config.models()}
    assert set(fractions.values()) == {0.6}  # any two together would need 120% of the GPU
    for path, engines in engine_launch_specs(config, pm).items():
        argv = serve_argv(engines[f"{path.rsplit('.', 1)[1]}/replica-0"][0], 1)
        i = argv.index("--mem-fraction-static")
        assert argv[i + 1] == "0.6" and "--disable-cuda-graph" in argv
        assert argv[argv.index("--device") + 1] == "cuda"
