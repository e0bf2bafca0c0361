"""A model's ``engine`` table is its backend's own options record: read and checked before
anything starts, at its key path, and carried to every launch as ``backend_options`` beside
the core's typed :class:`~relax_core.EngineOptions`."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from relax_bench.manager import launch_sim

from relax_core import (
    ConfigError,
    ConfigReader,
    ControlClient,
    EngineBackend,
    EngineLaunchSpec,
    EngineOptions,
    PluginManager,
    engine_launch_specs,
    loads_config,
)
from relax_core.jobs import check_job
from relax_core.plugins import module_plugin
from tests.support.roles import builtin_roles


@attrs.frozen
class FastOptions:
    """What the ``fast`` test backend alone understands."""

    memory_handoff: bool = False
    threads: int = attrs.field(default=0, metadata={"check": ConfigReader.at_least(0)})


def _backends(register: Any) -> None:
    common: dict[str, Any] = {"launch": launch_sim, "control_client": ControlClient}
    common["devices"] = {"cpu"}
    register(EngineBackend(name="fast", options=FastOptions, **common))
    register(EngineBackend(name="plain", **common))


@pytest.fixture
def pm() -> PluginManager:
    return builtin_roles(
        ("test-backends", module_plugin("tb", relax_register_engine_backends=_backends))
    )


def job(backend: str, engine: str = "", extra: str = "") -> str:
    return (
        "[roles.genrm.models.judge]\n"
        f'backend = "{backend}"\nmodel_path = "/m"\ndevice = "cpu"\nnum_engines = 2\n{extra}'
        + (f"[roles.genrm.models.judge.engine]\n{engine}" if engine else "")
    )


def launches(text: str, pm: PluginManager) -> list[EngineLaunchSpec]:
    specs = engine_launch_specs(loads_config(text), pm)["roles.genrm.models.judge"]
    return [workers[0] for workers in specs.values()]


def test_an_engine_table_is_read_into_the_backends_record_and_reaches_every_launch(
    pm: PluginManager,
) -> None:
    text = job("fast", "memory_handoff = true\nthreads = 2\n", 'dtype = "bf16"\nseed = 3\n')
    assert check_job(loads_config(text), pm) == []
    specs = launches(text, pm)
    assert len(specs) == 2
    for spec in specs:
        assert spec.backend_options == FastOptions(memory_handoff=True, threads=2)
        assert isinstance(spec.options, EngineOptions) and spec.options.dtype == "bf16"


def test_a_model_without_an_engine_table_launches_with_the_records_defaults(
    pm: PluginManager,
) -> None:
    assert [s.backend_options for s in launches(job("fast"), pm)] == [FastOptions()] * 2
    assert [s.backend_options for s in launches(job("plain"), pm)] == [None, None]


def test_a_launch_carries_the_decided_backup_and_determinism_not_the_files_none(
    pm: PluginManager,
) -> None:
    # genrm is STATIC (its engines keep a CPU backup) and deterministic by its role's default.
    options = launches(job("plain"), pm)[0].options
    assert (options.weights_cpu_backup, options.deterministic_inference) == (True, True)
    options = launches(job("plain", extra="deterministic_inference = false\n"), pm)[0].options
    assert options.deterministic_inference is False


def test_an_unknown_engine_key_is_refused_at_its_key_path_with_a_hint(pm: PluginManager) -> None:
    problems = check_job(loads_config(job("fast", "memory_handof = true\n")), pm)
    assert len(problems) == 1, problems
    assert problems[0].startswith(
        "roles.genrm.models.judge.engine.memory_handof: [unknown-key] unknown key; "
        "did you mean 'memory_handoff'? (known: memory_handoff, threads)"
    )


def test_a_bad_engine_value_is_refused_at_its_key_path(pm: PluginManager) -> None:
    problems = check_job(loads_config(job("fast", 'threads = -1\nmemory_handoff = "yes"\n')), pm)
    assert problems == [
        "roles.genrm.models.judge.engine.memory_handoff: [type] must be true or false, got 'yes'",
        "roles.genrm.models.judge.engine.threads: [range] must be >= 0, got -1",
    ]


def test_a_backend_without_an_options_record_refuses_any_engine_table(pm: PluginManager) -> None:
    problems = check_job(loads_config(job("plain", "memory_handoff = true\n")), pm)
    assert len(problems) == 1, problems
    assert problems[0].startswith("roles.genrm.models.judge.engine: [engine-options] engine ")
    assert "backend 'plain' declares no options of its own" in problems[0]
    assert "extra_args" in problems[0]


def test_what_the_checks_refuse_no_launch_is_built_from(pm: PluginManager) -> None:
    with pytest.raises(ConfigError, match=r"roles.genrm.models.judge.engine.threads: \[range\]"):
        launches(job("fast", "threads = -1\n"), pm)


def test_an_options_record_is_checked_when_the_backend_is_built() -> None:
    common: dict[str, Any] = {"name": "b", "launch": launch_sim, "control_client": ControlClient}

    @attrs.frozen
    class NoDefault:
        needed: int

    with pytest.raises(ValueError, match=r"EngineBackend.options=.*attrs frozen class"):
        EngineBackend(options=dict, **common)
    with pytest.raises(ValueError, match=r"give every field a default; needed has none"):
        EngineBackend(options=NoDefault, **common)
