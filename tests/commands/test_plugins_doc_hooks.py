"""docs/plugins.md's example for each hook, loaded as written: each section's module is imported
from the doc's own text, registered in a fresh plugin manager, and its record does what the
section says (an engine backend starts a real engine; a routing policy picks the least loaded
head; a placement mode plans a job; a data source feeds prompts and refuses a missing file; a
run probe times every switch of a simulated run).
The stage, the reward adapter and the trainer walkthroughs have their own tests
(test_stage_doc.py, test_plugins_doc.py, tests/run/test_trainer_doc.py)."""

from __future__ import annotations

import importlib.util
import sys
import urllib.request
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from relax_core import EngineLaunchSpec, PluginManager, loads_config, plan_inference_placement
from relax_core.run.data import find_source, open_source, source_problems
from relax_core.testing import free_port
from tests.support import docs
from tests.support.serve import make_tiny_model


def _module(title: str, tmp_path: Path) -> ModuleType:
    """The section's one module, written out and imported under its package name."""
    ((path, text),) = [
        (p, t)
        for p, t in docs.files(docs.section("plugins.md", title)).items()
        if p.endswith(".py")
    ]
    name = path.split("/")[0]
    file = tmp_path / path
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(text)
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _plugins(title: str, tmp_path: Path) -> PluginManager:
    module = _module(title, tmp_path)
    return PluginManager.create(plugins=[(module.__name__, module)])


def test_the_table_names_a_section_for_every_hook() -> None:
    from relax_core import hookspecs

    hooks = {name for name in vars(hookspecs) if name.startswith("relax_register_")}
    text = (docs.ROOT / "docs" / "plugins.md").read_text()
    assert {h for h in hooks if f"| `{h}` |" not in text} == set()


def test_the_engine_backend_example_starts_a_real_engine(tmp_path: Path) -> None:
    pm = _plugins("An engine backend", tmp_path)
    backend = pm.engine_backend("hf-eager")
    assert backend.devices == {"cpu", "cuda"}
    model = make_tiny_model(tmp_path / "tiny")
    port = free_port()
    spec = EngineLaunchSpec(
        engine_id="m/replica-0", model_path=str(model), port=port, device="cpu",
        served_model_name="m", log_path=str(tmp_path / "engine.log"),
    )  # fmt: skip
    engine = backend.launch(spec)
    try:
        engine.wait_ready(180)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as answer:
            assert answer.status == 200
        assert backend.control_client(engine.base_url) is not None
    finally:
        engine.terminate(10)
    assert engine.poll() is not None


def test_the_weight_source_example_is_what_a_model_may_name(tmp_path: Path) -> None:
    source = _plugins("A weight source", tmp_path).weight_source("S3CKPT")
    assert source.update_paths == {"disk"} and source.publishes_version


def test_the_routing_policy_example_picks_the_head_with_the_fewest_requests(
    tmp_path: Path,
) -> None:
    policy = _plugins("A routing policy", tmp_path).routing_policy("fewest-inflight")

    class Head:
        def __init__(self, engine_id: str) -> None:
            self.engine_id = engine_id
            self.base_url = f"http://{engine_id}"

    heads = (Head("a"), Head("b"), Head("c"))
    chosen = policy.factory().select(
        role="genrm", epoch="e", model="m", candidates=heads, affinity_key=None,
        inflight={"a": 3, "b": 1, "c": 2},
    )  # fmt: skip
    assert chosen is heads[1]


def test_the_placement_mode_example_plans_a_job_in_one_pool(tmp_path: Path) -> None:
    pm = _plugins("A placement mode", tmp_path)
    config = loads_config(
        '[cluster]\ngpus_per_node = 4\n[placement]\nmode = "one-pool"\n'
        '[roles.genrm.models.judge]\nbackend = "hf"\nmodel_path = "/m"\nnum_gpus = 2\n'
        '[roles.teacher.models.math]\nbackend = "hf"\nmodel_path = "/m"\nnum_gpus = 2\n'
    )
    plan = plan_inference_placement(config, pm)
    where: dict[str, Any] = {p.path: (p.pool, p.bundle_start) for p in plan.placements}
    assert where == {
        "roles.genrm.models.judge": ("inference", 0),
        "roles.teacher.models.math": ("inference", 2),
    }


def test_the_data_source_example_reads_a_text_file_and_refuses_a_missing_one(
    tmp_path: Path,
) -> None:
    pm = _plugins("A data source", tmp_path)
    (tmp_path / "questions.txt").write_text("What is 2 + 2?\n\nName a prime.\n")
    found = find_source("questions.txt", pm, base=str(tmp_path))
    assert isinstance(found, tuple) and found[0].name == "text-lines"
    source = open_source("questions.txt", pm, base=str(tmp_path))
    prompts = source.take(3)
    assert [p.prompt for p in prompts] == ["What is 2 + 2?", "Name a prime.", "What is 2 + 2?"]
    assert prompts[1].origin.endswith("questions.txt:3")
    (problem,) = source_problems("gone.txt", pm, base=str(tmp_path))
    assert (problem.path, problem.rule) == ("run.dataset", "dataset")


def test_the_benchmark_example_runs_with_its_own_option(tmp_path: Path) -> None:
    import argparse

    spec = _plugins("A benchmark", tmp_path).benchmark("sort")
    parser = argparse.ArgumentParser()
    assert spec.add_arguments is not None
    spec.add_arguments(parser)
    options = vars(parser.parse_args(["--size", "200"]))
    result = spec.run(quick=True, **options)
    assert result["items"] == 20 and result["sort_vs_copy"] >= 0


def test_the_run_probe_example_times_every_switch_of_a_run_and_its_report_prints(
    tmp_path: Path,
) -> None:
    import asyncio
    import io

    from relax_bench._steps_sim import SimJudge, SimRollout, Times

    from relax_core.run.loop import drive
    from relax_core.run.progress import Printer
    from tests.support.sim_job import sim_ports, sim_run

    module = _module("A run probe", tmp_path)
    pm = PluginManager.create(entry_points=False, plugins=[(module.__name__, module)])
    times = Times(generate_s=0.02, score_s=0.02, train_s=0.02, push_s=0.0, groups=2)
    rollout = SimRollout(times)
    ports = sim_ports(
        "timed", sim_run(times), times=times, rollout=rollout, stages=[SimJudge(times)], defer=True
    )
    out, err = io.StringIO(), io.StringIO()
    printer = Printer(json_lines=False, out=out, err=err, tty=False)
    measure = pm.run_probe("switching")
    summary = asyncio.run(drive(ports, printer, steps=2, initial_version="0", measure=measure))
    assert summary.failure is None and summary.switching is not None
    switches = summary.switching["switches"]
    # The judge's turns through the coordinator, the policy's own through its handle.
    assert {(s["role"], s["direction"]) for s in switches} == {
        ("judge", "onload"), ("judge", "offload"), ("policy", "onload"), ("policy", "offload"),
    }  # fmt: skip
    assert {s["step"] for s in switches} == {0, 1} and all(s["seconds"] >= 0 for s in switches)
    printer.summary(summary.row())  # the text output reads the report's keys
    assert "switching:" in out.getvalue() and "judge.offload" in out.getvalue()


def test_the_command_example_is_a_sub_command_of_relax(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from relax_core import cli, plugins

    pm = _plugins("A command", tmp_path)
    monkeypatch.setattr(plugins, "get_plugin_manager", lambda: pm)
    (tmp_path / "three.txt").write_text("a\nb\nc\n")
    assert cli.main(["count-lines", str(tmp_path / "three.txt")]) == 0
    assert capsys.readouterr().out == "3\n"
    assert "count-lines" in cli.build_parser().format_help()


def test_a_plugins_command_named_like_one_of_the_cores_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from relax_core import CommandSpec, cli, plugins

    def register(register: Any) -> None:
        register(CommandSpec(name="plan", help="mine", add_arguments=print, run=lambda a: 0))

    plugin = plugins.module_plugin("shadow", relax_register_commands=register)
    pm = PluginManager.create(entry_points=False, plugins=[("shadow", plugin)])
    monkeypatch.setattr(plugins, "get_plugin_manager", lambda: pm)
    assert cli.main(["plan", "job.toml"]) == 2
    err = capsys.readouterr().err
    assert "the command 'plan' of plugin 'shadow' has the name of one of relax-core's" in err
    assert "RELAX_DISABLE_PLUGINS=shadow" in err
