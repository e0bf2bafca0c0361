"""``relax serve`` and ``relax status`` as a user runs them: real subprocesses, real Ray, real
hf engines on CPU, real gateways; Ctrl-C sent to the process group as a terminal does.

The serve test checks, besides the answers, that nothing outlives ``relax serve``: no process
in its session (Ray's GCS, raylet, workers, the gateway actor) and no engine process (engines
run in sessions of their own; they are found by the test's model directory on their command
line).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from relax_core.discovery.status import fetch_health
from relax_core.testing import wait_for
from tests.support import serve as support
from tests.support.jobs import hf, job_text, sim

pytestmark = [pytest.mark.ray, pytest.mark.slow]


Lines = support.Lines
in_session, mentioning, listener_pid = support.in_session, support.mentioning, support.listener_pid
_alive, _cmdline = support.alive, support.cmdline


# -- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A micro hf model made the way a user makes one (``python -m relax_hf make-tiny-model``)."""
    return support.make_tiny_model(tmp_path_factory.mktemp("serve") / "model")


serve = support.serve


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.status == 200
        return dict(json.loads(resp.read()))


def _relax(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "relax_core", *args], capture_output=True, text=True, timeout=60
    )


# -- tests -----------------------------------------------------------------------------------


def _job(model: str) -> str:
    """Three models of ``model`` on the CPU, the judge's gateway in a Ray actor."""
    return job_text(
        models={
            "rollout.policy": hf(model, device="cpu"),
            "teacher.math": hf(model, device="cpu"),
            "genrm.judge": hf(model, device="cpu", route_keys=["math"]),
        },
        roles={"genrm": {"gateway": {"in_ray_actor": True}}},
    )


def test_serve_answers_in_both_gateway_modes_rebuilds_a_killed_engine_and_stops_clean(
    model_dir: Path,
) -> None:
    config = model_dir.parent / "job.toml"
    # A relative model_path is relative to the job file, as relax run reads it.
    config.write_text(_job(model_dir.name))
    logs = model_dir.parent / "logs"
    args = ("--log-dir", str(logs), "--refresh", "0.5", "--health-interval", "1")
    with serve(config, *args) as (proc, out, stderr):
        out.wait_for(r"relax serve: ready", timeout=240)
        gateways = {
            m.group(1): (m.group(2), int(m.group(3)), m.group(4), int(m.group(5)))
            for m in (
                re.search(
                    r"^\s+(\w+)\s+gateway\s+(http://[\d.]+:(\d+))/\w+/\s+\(([\w-]+), pid (\d+)",
                    line,
                )
                for line in out.lines
            )
            if m
        }
        assert set(gateways) == {"teacher", "genrm", "rollout"}, str(out)
        teacher_url, teacher_port, teacher_mode, teacher_pid = gateways["teacher"]
        genrm_url, genrm_port, genrm_mode, genrm_pid = gateways["genrm"]
        # "ready" comes once the genrm adapter's tokenizers are loaded: no request (or wake)
        # runs beside that load and its imports.
        assert fetch_health(f"{genrm_url}/genrm")["adapter"] == "ok"

        # The status table lists each engine with its process id.
        out.wait_for(r"judge/replica-0\s+READY", timeout=30)
        engines = {
            m.group(1): int(m.group(2))
            for m in re.finditer(r"(\w+)/replica-0\s+READY\s+gen 1 .*pid (\d+)", str(out))
        }
        engine_pids = set(engines.values())
        assert len(engine_pids) == 3 and all(_alive(p) for p in engine_pids), str(out)
        assert set(mentioning(str(model_dir))) >= engine_pids

        # A teacher prefill through the gateway in this process, a genrm judgement through
        # the gateway in its Ray actor.
        prefill = _post(
            f"{teacher_url}/teacher/generate",
            {
                "input_ids": [5, 6, 7, 8],
                "return_logprob": True,
                "logprob_start_len": 1,
                "sampling_params": {"max_new_tokens": 0},
            },
        )
        assert len(prefill["meta_info"]["input_token_logprobs"]) == 3
        judged = _post(
            f"{genrm_url}/genrm/generate",
            {
                "messages": [{"role": "user", "content": "2+2=4. Correct?"}],
                "route_key": "math",
                "sampling_params": {"max_new_tokens": 3},
            },
        )
        assert isinstance(judged["response"], str)

        # Rollout on its default route mode: through its router (a process of its own), whose
        # URL the status shows.
        rollout_url = gateways["rollout"][0]
        generated = _post(
            f"{rollout_url}/rollout/generate",
            {"text": "hi", "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}},
        )
        assert generated["meta_info"]["completion_tokens"] == 3
        # Nothing was pushed: the engines' initial weights do not meet a minimum version.
        req = urllib.request.Request(
            f"{rollout_url}/rollout/generate",
            data=json.dumps({"text": "hi", "min_weight_version": "12"}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=30)
        assert refused.value.code == 503
        assert "Nothing sent" in refused.value.read().decode()
        status = _relax("status", f"{rollout_url}/rollout")
        assert status.returncode == 0, status.stdout + status.stderr
        router = re.search(
            r"policy\s+READY\s+SGLANG_ROUTER\s+ACTOR .*1/1 READY  router (http://[\d.]+:(\d+))$",
            status.stdout,
            re.M,
        )
        assert router, status.stdout
        router_pid = listener_pid(int(router.group(2)))
        assert router_pid is not None and router_pid not in (proc.pid, *engine_pids)

        # Where each gateway really runs: a thread of relax serve, and a Ray worker process.
        assert teacher_mode == "thread" and teacher_pid == proc.pid
        assert listener_pid(teacher_port) == proc.pid
        assert genrm_mode == "ray-actor" and listener_pid(genrm_port) == genrm_pid
        assert genrm_pid != proc.pid and "GatewayActor" in _cmdline(genrm_pid)

        status = _relax("status", f"{genrm_url}/genrm")
        assert status.returncode == 0, status.stdout + status.stderr
        assert re.search(r"role genrm .*default model judge", status.stdout)
        assert re.search(r"judge\s+READY\s+DIRECT\s+STATIC .*1/1 READY", status.stdout)
        assert re.search(r"judge/replica-0\s+READY\s+gen 1\s+http://", status.stdout)
        assert "route keys: math→judge" in status.stdout

        # An engine killed: the health monitor fails its replica and rebuilds it (a new
        # process, generation 2), and the gateway serves again.
        os.kill(engines["math"], signal.SIGKILL)
        out.wait_for(r"health math/replica-0 \(teacher\): .* → rebuilt, now READY", timeout=120)
        rebuilt = out.wait_for(r"math/replica-0\s+READY\s+gen 2 .*pid (\d+)", timeout=120)
        engine_pids.add(int(rebuilt.group(1)))
        assert int(rebuilt.group(1)) != engines["math"] and _alive(int(rebuilt.group(1)))
        assert _post(f"{teacher_url}/teacher/generate", {"text": "hi"})["text"] is not None

        # Ctrl-C in a terminal signals the whole foreground process group.
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) == 0, out.rest(10) + stderr.read_text()
        text = out.rest(10)
        assert "gateways stopped (3)" in text and "engines stopped (4 processes)" in text
        assert "routers stopped (1)" in text
        assert "local Ray stopped" in text and text.endswith("nothing left running")
        # The local Ray runs with token authentication, set up explicitly: Ray has nothing to
        # warn a newcomer about.
        assert "Token authentication" not in text + stderr.read_text()

        wait_for(lambda: not in_session(proc.pid), timeout=30, what="serve's processes gone")
        wait_for(lambda: not mentioning(str(model_dir)), timeout=30, what="engines gone")
        assert not any(_alive(p) for p in engine_pids) and not _alive(router_pid)
        assert listener_pid(genrm_port) is None and listener_pid(teacher_port) is None
        status = _relax("status", f"{genrm_url}/genrm")
        assert status.returncode == 1
        assert "is `relax serve` running?" in status.stdout


def _alive_actors() -> dict[str, str]:
    """Actor id → class name of every live actor of the connected Ray (the GCS view; the
    public state API needs the dashboard, which the test Ray runs without)."""
    import ray._private.state as ray_state

    return {
        a["ActorID"]: a.get("ActorClassName", "")
        for a in ray_state.actors().values()
        if a.get("State") != "DEAD"
    }


def test_serve_on_an_existing_cluster_leaves_no_actor_there_and_the_cluster_running(
    model_dir: Path, ray_local: Any
) -> None:
    config = model_dir.parent / "cluster-job.toml"
    config.write_text(
        job_text(
            models={"teacher.math": hf(str(model_dir), device="cpu")},
            roles={"teacher": {"gateway": {"in_ray_actor": True}}},
        )
    )
    address = ray_local.get_runtime_context().gcs_address
    before = _alive_actors()
    with serve(config, "--address", address, "--log-dir", str(model_dir.parent / "logs2")) as (
        proc,
        out,
        stderr,
    ):
        out.wait_for(r"relax serve: ready", timeout=240)
        assert f"starting on the Ray cluster at {address}" in str(out)
        started = {k: v for k, v in _alive_actors().items() if k not in before}
        assert sorted(started.values()) == ["EngineWorker", "GatewayActor"], started
        url = out.wait_for(r"teacher\s+gateway\s+(http://[\d.:]+)/teacher/", timeout=5).group(1)
        assert _post(f"{url}/teacher/generate", {"text": "hi"})["text"] is not None
        engine = int(out.wait_for(r"math/replica-0\s+READY .*pid (\d+)", timeout=30).group(1))

        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) == 0, out.rest(10) + stderr.read_text()
        text = out.rest(10)
        assert text.endswith("nothing left running") and "local Ray stopped" not in text

        wait_for(
            lambda: not set(started) & set(_alive_actors()),
            timeout=30,
            what="serve's actors dead in the cluster",
        )
        assert not _alive(engine)
        # The cluster itself is untouched and still runs work.
        assert ray_local.get(ray_local.put(7)) == 7


def test_serve_rejects_a_job_the_planner_rejects_with_every_problem_before_starting_anything(
    tmp_path: Path,
) -> None:
    config = tmp_path / "job.toml"
    config.write_text(
        job_text(
            cluster={"gpus_per_node": 2},
            models={
                "rollout.policy": hf("/models/policy", num_gpus=2),
                "teacher.math": hf("/models/teacher", num_gpus=2, weight_source="ACTOR"),
            },
        )
    )
    # Nothing listens at this address: touching Ray at all would fail differently.
    done = _relax("serve", str(config), "--address", "127.0.0.1:9")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "rejected: 3 problem(s); nothing was started" in done.stderr
    assert "--address: [ray-address] no Ray cluster answers at 127.0.0.1:9" in done.stderr
    for path, rule in [
        ("cluster", "gpu-budget"),
        ("roles.teacher.models.math.weight_source", "weight-source"),
    ]:
        assert f"  {path}: [{rule}]" in done.stderr, done.stderr
    assert "starting on" not in done.stdout


def test_serve_rejects_config_errors_with_their_key_paths(tmp_path: Path) -> None:
    config = tmp_path / "job.toml"
    config.write_text('[roles.genrm.models.judge]\nbackend = "hf"\ntp = "2"\n')
    done = _relax("serve", str(config), "--address", "127.0.0.1:9")
    assert done.returncode == 2
    assert "roles.genrm.models.judge.model_path: [required]" in done.stderr
    assert "roles.genrm.models.judge.tp: [type]" in done.stderr


def test_check_job_names_what_serve_cannot_run_by_key_path() -> None:
    from relax_core.config import loads_config
    from relax_core.jobs import check_job
    from relax_core.plugins import PluginManager, module_plugin
    from relax_core.records import EngineBackend

    def backends(register: Any) -> None:
        # A backend record only: nothing is launched by this test.
        register(EngineBackend(name="gpuonly", launch=print, control_client=print))

    pm = PluginManager.create(
        plugins=[("gpuonly", module_plugin("gpuonly", relax_register_engine_backends=backends))]
    )
    config = loads_config(
        job_text(
            models={
                "genrm.judge": {
                    "backend": "gpuonly",
                    "device": "cpu",
                    "model_path": "/models/judge",
                },
                "teacher.math": {
                    "backend": "nosuch",
                    "device": "cpu",
                    "model_path": "/models/math",
                    "route_mode": "SGLANG_ROUTER",
                },
            }
        )
    )
    problems = check_job(config, pm)
    assert problems[0].startswith(
        "roles.genrm.models.judge.device: [device] engine backend 'gpuonly' runs on cuda"
    )
    assert problems[1].startswith(
        "roles.teacher.models.math.backend: [plugin] no engine backend 'nosuch' is registered"
    )
    assert problems[2].startswith(
        "roles.teacher.models.math.route_mode: [router] a STATIC model's engines are static and "
        "never registered with a router"
    )
    assert len(problems) == 3


def test_a_router_model_is_refused_with_advice_when_no_router_plugin_is_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from relax_core.config import loads_config
    from relax_core.jobs import check_job
    from relax_core.plugins import PluginManager

    monkeypatch.setenv("RELAX_DISABLE_PLUGINS", "sglang")  # the plugin registering the routers
    config = loads_config(
        '[roles.rollout.models.policy]\nbackend = "hf"\ndevice = "cpu"\nmodel_path = "/m"\n'
    )
    assert check_job(config, PluginManager.create()) == [
        "roles.rollout.models.policy.route_mode: [router] route_mode SGLANG_ROUTER (the rollout "
        "role's default) needs a router plugin, and none is installed; pip install relax-sglang "
        '(sglang-router and smg), or set route_mode = "DIRECT" to route this model like the '
        "static roles"
    ]
    direct = loads_config(
        '[roles.rollout.models.policy]\nbackend = "hf"\ndevice = "cpu"\nmodel_path = "/m"\n'
        'route_mode = "DIRECT"\n'
    )
    assert check_job(direct, PluginManager.create()) == []


def test_placements_bind_gpu_models_to_their_bundles_and_teardown_removes_the_groups(
    ray_local: Any,
) -> None:
    import io

    from relax_core.config import loads_config
    from relax_core.jobs import ServedJob
    from relax_core.jobs import place_served_job as _placements
    from relax_core.jobs import teardown_served_job as _teardown
    from relax_core.plugins import PluginManager

    config = loads_config(
        job_text(
            cluster={"gpus_per_node": 8},
            models={
                "genrm.judge": hf("/models/judge", num_gpus=2),
                "teacher.math": hf("/models/math", num_gpus=2, tp=2),
                "teacher.small": hf("/models/small", device="cpu", num_engines=2),
            },
        )
    )
    job = ServedJob()
    try:
        placements = _placements(config, PluginManager.create(), job)
        judge, math, small = (
            placements["genrm"]["judge"],
            placements["teacher"]["math"],
            placements["teacher"]["small"],
        )
        groups = {b.pool: b for b in job.bound}
        assert len(groups) == 2 and all(b.owned for b in groups.values())
        # Two one-GPU replicas; one two-GPU replica; both borrowed from the job's pools.
        assert len(judge.workers) == 2 and all(
            len(r) == 1 and len(r[0]) == 1 for r in judge.workers
        )
        assert len(math.workers) == 1 and len(math.workers[0][0]) == 2
        assert not judge.owned and not math.owned
        assert {id(judge.placement_group), id(math.placement_group)} == {
            id(b.placement_group) for b in groups.values()
        }
        assert small.placement_group is None and len(small.workers) == 2
    finally:
        out = io.StringIO()
        assert _teardown(job, out) == []
    assert "placement groups removed (2)" in out.getvalue()
    for bound in job.bound:
        state = ray_local.util.placement_group_table(bound.placement_group)["state"]
        assert state == "REMOVED"


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return int(f.read().rsplit(b")", 1)[1].split()[1])


def _groups_named(ray: Any, name: str) -> dict[str, str]:
    """Placement group id -> state, of every group called ``name`` the cluster knows."""
    return {
        gid: str(g["state"])
        for gid, g in ray.util.placement_group_table().items()
        if g.get("name") == name
    }


def test_serve_keeps_a_fenced_placement_group_at_shutdown_names_it_and_exits_1(
    tmp_path: Path, ray_local: Any
) -> None:
    import ray.util
    from ray.util.placement_group import PlacementGroup

    engine = 0
    config = tmp_path / "fence-job.toml"
    # The test plugin's simulated engine (no model) on one of the session Ray's fake GPUs, so
    # the model gets a placement group of its own.
    config.write_text(
        job_text(
            cluster={"gpus_per_node": 8},
            models={"genrm.judge": sim(num_gpus=1, num_parameters=1000)},
        )
    )
    address = ray_local.get_runtime_context().gcs_address
    args = ("--address", address, "--health-interval", "1", "--refresh", "0.5")
    before = set(_groups_named(ray_local, "relax-genrm"))  # other tests' groups of that name

    def state() -> str:
        (ours,) = set(_groups_named(ray_local, "relax-genrm")) - before
        return _groups_named(ray_local, "relax-genrm")[ours]

    try:
        with serve(config, *args) as (proc, out, stderr):
            out.wait_for(r"relax serve: ready", timeout=180)
            assert state() == "CREATED"
            engine = int(out.wait_for(r"judge/replica-0\s+READY .*pid (\d+)", timeout=30)[1])
            # The worker actor dies without cleaning up its engine: the manager cannot know
            # whether the engine still holds its GPU, so it fences the worker.
            os.kill(_ppid(engine), signal.SIGKILL)
            out.wait_for(r"health genrm\.judge: .*died without confirmed cleanup", timeout=60)

            os.killpg(proc.pid, signal.SIGINT)
            assert proc.wait(timeout=120) == 1, out.rest(10) + stderr.read_text()
            text, err = out.rest(10), stderr.read_text()
            assert "placement groups removed (0), 1 kept" in text, text
            assert "nothing left running" not in text
            assert "placement group 'relax-genrm' (pool 'genrm'" in err and "KEPT" in err, err
            assert "judge/replica-0 (node 127.0.0.1" in err and "fenced" in err, err
            assert "remove_placement_group" in err
        # The group outlives relax serve: nothing may be scheduled onto its GPU until an
        # operator confirms the engine is gone.
        assert state() == "CREATED"
    finally:
        # The operator's part, once the engine is confirmed gone (it died with its actor).
        wait_for(lambda: not _alive(engine), timeout=20, what="the fenced engine gone")
        ours = set(_groups_named(ray_local, "relax-genrm")) - before
        for gid in ours:
            pg_id = ray_local.PlacementGroupID(bytes.fromhex(gid))
            ray.util.remove_placement_group(PlacementGroup(pg_id))
        wait_for(
            lambda: all(_groups_named(ray_local, "relax-genrm")[g] == "REMOVED" for g in ours),
            timeout=20,
            what="the kept group removed",
        )


def test_ctrl_c_before_the_job_is_ready_exits_130_with_nothing_left(
    ray_local: Any, tmp_path: Path
) -> None:
    # Ctrl-C is how a served job ends (exit 0 once ready); one that lands while the job is
    # still starting interrupts the start, and the exit status says so.
    config = tmp_path / "job.toml"
    config.write_text(
        '[cluster]\ngpus_per_node = 8\n\n[roles.genrm.models.judge]\nbackend = "test-sim"\n'
        'model_path = "sim"\nnum_gpus = 1\nnum_parameters = 1000\n'
    )
    address = ray_local.get_runtime_context().gcs_address
    with support.serve(config, "--address", address) as (proc, out, stderr):
        out.wait_for(r"relax serve: starting on the Ray cluster", timeout=120)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) == 130, out.rest(10) + stderr.read_text()
        text = out.rest(10)
        assert "relax serve: ready" not in text and text.endswith("nothing left running")
