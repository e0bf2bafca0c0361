"""The ``[run]`` table and what ``relax run`` checks before anything starts: every problem
with its key path, the defer preflight filled from the table, a clear exit 2 with nothing
started."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from relax_core.config import load_config, loads_config
from relax_core.errors import ConfigValidationError
from relax_core.jobs import check_job, resolve_model_paths
from relax_core.plugins import PluginManager
from relax_core.run.config import RunConfig, parse_run_config
from relax_core.run.data import find_source
from relax_core.run.job import run_problems
from relax_core.run.stages import stage_problems
from tests.support import run as support

ROOT = Path(__file__).resolve().parents[2]


def _run(text: str) -> RunConfig:
    return parse_run_config(loads_config(text))


def _problems(text: str) -> list[str]:
    with pytest.raises(ConfigValidationError) as info:
        _run(text)
    return [str(p) for p in info.value.problems]


def test_the_run_table_is_read_with_its_defaults() -> None:
    rewards = [{"adapter": "exact-match"}, {"adapter": "digits", "weight": 2}]
    run = _run('[run]\nrewards = [{ adapter = "exact-match" }, { adapter = "digits", weight = 2 }]')
    # The shorthand makes the default step: one reward stage (no teacher stage).
    assert [(t.kind, t.name, t.role, dict(t.options)) for t in run.stages] == [
        ("reward", "rewards", None, {"rewards": rewards})
    ]
    assert (run.steps, run.prompts_per_step, run.samples_per_prompt) == (3, 4, 4)
    assert run.dataset == "arithmetic" and run.trainer == "grpo"  # the installed default


def test_the_teacher_shorthand_adds_the_distillation_stage_after_the_reward_stage() -> None:
    run = _run(
        '[run]\nrewards = [{ adapter = "digits" }]\nreward_role = "genrm"\n'
        'teacher_role = "teacher"\nteacher_mode = "top-k"\ntop_k = 4\n'
    )
    assert [(t.kind, t.name, t.role, dict(t.options)) for t in run.stages] == [
        ("reward", "genrm", "genrm", {"rewards": [{"adapter": "digits"}]}),
        ("distill", "teacher", "teacher", {"mode": "top-k", "top_k": 4}),
    ]
    # Their problems are reported where the shorthand put them.
    assert run.stages[1].key("role") == "run.teacher_role"


def test_run_stages_lists_the_stages_in_order_with_their_own_keys() -> None:
    run = _run(
        '[[run.stages]]\nstage = "reward"\nrole = "genrm"\nmodels = ["judge-a"]\n'
        'rewards = [{ adapter = "genrm-judge", key = "a" }]\n'
        '[[run.stages]]\nstage = "reward"\nname = "judge-b"\nrole = "genrm"\n'
        'models = ["judge-b"]\nrewards = [{ adapter = "genrm-judge", key = "b" }]\n'
        '[[run.stages]]\nstage = "eval"\nevery = 5\ndataset = "held-out.jsonl"\n'
    )
    assert [(t.kind, t.name, t.role, t.models, t.path) for t in run.stages] == [
        ("reward", "genrm", "genrm", ("judge-a",), "run.stages[0]"),
        ("reward", "judge-b", "genrm", ("judge-b",), "run.stages[1]"),
        ("eval", "eval", None, (), "run.stages[2]"),
    ]
    assert run.stage("eval").options == {"every": 5, "dataset": "held-out.jsonl"}


def test_run_stages_refuses_the_shorthand_beside_it_and_two_stages_of_one_name() -> None:
    joined = "\n".join(
        _problems(
            '[run]\nrewards = [{ adapter = "digits" }]\n'
            '[[run.stages]]\nstage = "reward"\nrewards = []\n'
            '[[run.stages]]\nstage = "reward"\n'
            '[[run.stages]]\nname = "x"\n'
        )
    )
    assert "run.rewards: [stages] rewards describe the default stages" in joined
    assert "run.stages[1].name: [duplicate] two stages are called 'reward'" in joined
    assert "run.stages[2].stage: [required]" in joined


def test_keys_that_became_stages_say_where_they_went() -> None:
    joined = "\n".join(
        _problems(
            '[run]\nrewards = [{ adapter = "digits" }]\neval_dataset = "e.jsonl"\n'
            'filter_hooks = ["mine"]\ndynamic_batch = true\n'
        )
    )
    assert "run.eval_dataset: [moved] no longer a [run] key: evaluation is a stage" in joined
    assert "run.filter_hooks: [moved]" in joined and "run.dynamic_batch: [moved]" in joined


def test_an_unknown_key_is_not_offered_keys_the_table_no_longer_has() -> None:
    (problem,) = _problems('[run]\nrewards = [{ adapter = "digits" }]\nstepz = 3\n')
    assert "run.stepz: [unknown-key] unknown key; did you mean 'steps'?" in problem, problem
    for moved in ("eval_dataset", "filter_hooks", "dynamic_batch"):
        assert moved not in problem


def test_every_problem_of_the_table_is_reported_at_once_with_its_key_path() -> None:
    problems = _problems(
        "[run]\n"
        "steps = 0\n"
        "prompt_per_step = 4\n"
        'teacher_mode = "full"\n'
        'teacher_role = "teacher"\n'
        'rewards = [{ adapter = "exact-match" }]\n'
        'trainer = "not an import path"\n'
        'push_format = "ipc"\n'
    )
    joined = "\n".join(problems)
    assert "run.steps: [range] must be >= 1, got 0" in joined
    assert "run.prompt_per_step: [unknown-key]" in joined and "prompts_per_step" in joined
    assert "run.teacher_mode: [choice]" in joined
    assert "run.trainer: [range] must be 'package.module:ClassName'" in joined
    assert "run.push_format: [push-format]" in joined and "trainer_device = 'cuda'" in joined


def test_a_push_is_bucketed_at_512_mib_unless_the_table_sets_another_size() -> None:
    assert _run("[run]\nrewards = []").push_bucket_bytes == 512 << 20
    run = _run('[run]\nrewards = []\npush_format = "distributed"\npush_bucket_bytes = 4096')
    assert (run.push_format, run.push_bucket_bytes) == ("distributed", 4096)


def test_a_distributed_push_needs_the_fence() -> None:
    joined = "\n".join(
        _problems('[run]\nrewards = []\nmode = "async"\npush_format = "distributed"')
    )
    assert "run.push_format: [push-format]" in joined and "push_pause = 'fence'" in joined


@pytest.mark.parametrize(
    ("value", "problem"),
    [("0", "[range] must be >= 1, got 0"), ('"512MiB"', "[type]")],
)
def test_a_bad_push_bucket_size_is_a_problem_at_its_key_path(value: str, problem: str) -> None:
    joined = "\n".join(_problems(f"[run]\nrewards = []\npush_bucket_bytes = {value}"))
    assert f"run.push_bucket_bytes: {problem}" in joined


def test_every_problem_of_a_stage_is_reported_at_once_with_its_key_path() -> None:
    run = _run(
        '[[run.stages]]\nstage = "reward"\nrewards = [{ adapter = "exact-match", weight = 1 },'
        ' { adapter = "exact-match" }, { weight = 1 }, { adapter = "nope" }]\nconcurency = 2\n'
        '[[run.stages]]\nstage = "distil"\nrole = "teacher"\n'
        '[[run.stages]]\nstage = "distill"\ntop_k = 0\n'
    )
    joined = "\n".join(map(str, stage_problems(run, PluginManager.create())))
    assert "run.stages[0].rewards[1].adapter: [duplicate]" in joined
    assert "run.stages[0].rewards[2].adapter: [required]" in joined
    assert "run.stages[0].rewards[3]: [plugin] no reward adapter 'nope' is registered" in joined
    assert "run.stages[0].concurency: [unknown-key] unknown key; did you mean 'concurrency'?" in (
        joined
    )
    assert "run.stages[1].stage: [plugin] no stage kind 'distil' is registered; did you mean" in (
        joined
    )
    assert "run.stages[2].role: [required] stage kind 'distill' calls a role's engines" in joined


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
        '"exact-match" }] (or list the step\'s stages as [[run.stages]])'
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
    run = parse_run_config(config)
    found = find_source(run.dataset, PluginManager.create(), base=run.base)
    assert isinstance(found, tuple), found
    spec, request = found
    assert spec.name == "jsonl"
    assert request.file == str(tmp_path.resolve() / "data" / "train.jsonl")
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
    )
    joined = "\n".join(run_problems(config, run, pm))  # type: ignore[arg-type]
    assert "run.rewards[1]: [defer-adapter] reward adapter 'online-only'" in joined
    assert "run.rewards[2]: [plugin] no reward adapter 'nope' is registered" in joined
    assert "run.partial_rollout: [defer-unstageable]" in joined
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


def test_measure_without_a_plugin_providing_it_is_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    job = support.job_file(tmp_path)  # its models are not there: a problem of its own

    def run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "relax_core", "run", str(job), "--measure"],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, **env},
        )

    out = run({"RELAX_DISABLE_PLUGINS": "bench"})  # relax-bench registers the run probe
    assert out.returncode == 2 and "nothing was started" in out.stderr
    assert (
        "--measure: no plugin provides the switch report (a run probe named 'switching'); "
        "pip install relax-bench, or run without --measure"
    ) in out.stderr
    # With relax-bench loaded the same job is refused for its own problems only.
    out = run({})
    assert out.returncode == 2 and "[model-dir] no model directory" in out.stderr
    assert "--measure" not in out.stderr


def _h200_example(directory: Path, name: str) -> Path:
    """The example ``docs/examples/NAME.toml`` in ``directory``, beside its three models'
    config and tokenizer files (bf16, the "small" size; no weights: nothing is loaded)."""
    import json

    from relax_hf.tiny import TINY_SIZES
    from transformers import LlamaConfig

    shape = LlamaConfig(vocab_size=512, **TINY_SIZES["small"]).to_dict()
    for model in ("policy", "judge", "math"):
        d = directory / "small" / model
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps({**shape, "dtype": "bfloat16"}))
        (d / "tokenizer.json").write_text("{}")
    job = directory / f"{name}.toml"
    job.write_text((ROOT / "docs" / "examples" / f"{name}.toml").read_text())
    return job


def test_the_h200_example_holds_60_percent_of_the_gpu_per_engine_and_passes_every_check(
    tmp_path: Path,
) -> None:
    from relax_hf.plugin import serve_argv

    from relax_core.jobs import engine_launch_specs

    job = _h200_example(tmp_path, "run-h200")
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
        assert argv[i + 1] == "0.6" and "--memory-handoff" in argv
        assert "--disable-cuda-graph" not in argv  # graphs kept across switches
        assert argv[argv.index("--device") + 1] == "cuda"
    # The judge takes the step's samples as one batch: all of them in flight at once.
    judge = next(m for m in config.models() if m.path.startswith("roles.genrm."))
    reward = next(t for t in run.stages if t.kind == "reward")
    assert reward.options["concurrency"] == judge.engine.max_running_requests == 256


def test_the_h200_async_example_runs_graphs_budgeted_in_the_preflight(tmp_path: Path) -> None:
    from relax_hf.plugin import serve_argv

    from relax_core.jobs import engine_launch_specs

    job = _h200_example(tmp_path, "run-h200-async")
    pm = PluginManager.create()
    config = resolve_model_paths(load_config(job))
    assert run_problems(config, parse_run_config(config), pm) == []
    assert {m.placement.cuda_graph_gib for m in config.models()} == {1}
    for path, engines in engine_launch_specs(config, pm).items():
        argv = serve_argv(engines[f"{path.rsplit('.', 1)[1]}/replica-0"][0], 1)
        assert "--disable-cuda-graph" not in argv
        assert argv[argv.index("--device") + 1] == "cuda:0"
    out = subprocess.run(
        [sys.executable, "-m", "relax_core", "plan", str(job)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("+ CUDA graphs 1.0 +") == 3
