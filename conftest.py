"""Root pytest configuration shared by the core's and every plugin's tests."""

from __future__ import annotations

import os

import pytest

# Every Ray a test starts on this machine (local, or simulated nodes of ray.cluster_utils.Cluster)
# keeps its services, engines and admission servers on loopback; set before anything imports Ray.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # "No tests ran" is a failure of the suite, never a silent pass: a collection filter or a
    # missing install that hides every test must turn CI red.
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        print("\nerror: no tests ran (pytest exit code 5); failing the run", flush=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


#: The modules that run longest (whole jobs, module-wide engines), longest first: the default
#: session's two workers take modules in collection order, so these go first and the short ones
#: fill the end, instead of one worker finishing a long module alone at the end. Only the order
#: changes; a module missing here runs where it was collected.
LONGEST_FIRST = (
    "tests/run/test_run_async_cli.py",
    "tests/manager/test_manager_faults.py",
    "tests/integration/test_rollout_router.py",
    "tests/manager/test_manager_multinode.py",
    "tests/agent/test_agent_run.py",
    "tests/run/test_resume_cli.py",
    "tests/commands/test_serve.py",
    "tests/run/test_run_durable_cli.py",
    "tests/run/test_tracking_run.py",
    "tests/run/test_stages_run.py",
    "tests/commands/test_environment_doc.py",
    "tests/commands/test_stage_doc.py",
    "plugins/relax-hf/tests/test_weights.py",
    "tests/coordination/test_deferred_real.py",
    "plugins/relax-hf/tests/test_multinode.py",
    "tests/coordination/test_serve_defer.py",
    "tests/run/test_run_cli.py",
    "plugins/relax-hf/tests/test_prefix_cache.py",
    "tests/integration/test_bucketed_push.py",
    "tests/manager/test_manager_weights.py",
    "tests/manager/test_manager_scaling.py",
    "tests/placement/test_binding.py",
    "tests/run/test_run_rollout_rebuild_cli.py",
    "tests/commands/test_plugins_doc.py",
    "plugins/relax-agent/tests/test_multiturn_engines.py",
    "plugins/relax-hf/tests/test_kv_cache.py",
    "tests/commands/test_demo.py",
    "contrib/relax-dynamic-sampling/tests/test_relax_run.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    root = config.rootpath

    def key(item: pytest.Item) -> int:
        return rank.get(item.path.relative_to(root).as_posix(), len(rank))

    items.sort(key=key)  # stable: the order within a module and among the rest is kept
