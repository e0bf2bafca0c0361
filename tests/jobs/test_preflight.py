"""The job preflight, as a user meets it: ``relax run`` and ``relax serve`` refuse a job whose
model directory, dataset, gateway port or Ray address is wrong before Ray starts, naming every
problem by key path or ``file:line`` (exit status 2); both read relative model paths the same
way (relative to the job file).

The CLI tests run ``python -m relax_core`` as a user does; each has a deadline of 30 s (the
issue's bound for a refusal), and none may print the line that says Ray is starting.
"""

from __future__ import annotations

import http.server
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from relax_core import PluginManager, load_config
from relax_core.jobs import (
    job_preflight,
    model_dir_problems,
    port_problems,
    ray_address_problem,
    resolve_model_paths,
)
from tests.support import run as support
from tests.support.jobs import hf, job_text

#: A refusal must come well before anything would start (the issue's bound).
REFUSAL_DEADLINE = 30


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return support.make_models(tmp_path_factory.mktemp("preflight-models"))


@pytest.fixture
def root(models: Path, tmp_path: Path) -> Path:
    """A job directory with the example's models beside it (``tiny/<name>``)."""
    (tmp_path / "tiny").mkdir()
    for name in support.MODELS:
        (tmp_path / "tiny" / name).symlink_to(models / "tiny" / name, target_is_directory=True)
    return tmp_path


def relax(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "relax_core", *args],
        capture_output=True,
        text=True,
        timeout=REFUSAL_DEADLINE,
    )


def refused(result: subprocess.CompletedProcess[str], command: str) -> str:
    """The refusal's text, after checking it is one: exit 2, nothing started."""
    text = result.stdout + result.stderr
    assert result.returncode == 2, text
    assert f"relax {command}: rejected:" in result.stderr and "nothing was started" in text
    assert "starting a new local Ray" not in text and "Traceback" not in text, text
    return result.stderr


# -- relax run --------------------------------------------------------------------------------


def test_run_refuses_a_missing_teacher_model_directory_by_key_path_with_how_to_make_it(
    root: Path,
) -> None:
    (root / "tiny" / "math").unlink()
    err = refused(relax("run", str(support.job_file(root))), "run")
    assert "roles.teacher.models.math.model_path: [model-dir]" in err
    assert f"no model directory {root / 'tiny' / 'math'}" in err
    assert "'tiny/math' is relative to the job file's directory" in err
    assert "relax-hf make-tiny-model DIR" in err  # the hf backend's hint


def test_run_names_every_malformed_dataset_line_and_a_missing_genrm_model_at_once(
    root: Path,
) -> None:
    data = root / "prompts.jsonl"
    data.write_text(
        '{"prompt": "What is 2 + 2?", "label": "4"}\n'
        '{"prompt": "broken", \n'
        '{"prompt": "What is 3 + 3?", "label": "6"}\n'
        '{"prompt": "x", "label": 6}\n'
    )
    (root / "tiny" / "judge").unlink()
    err = refused(relax("run", str(support.job_file(root, dataset="prompts.jsonl"))), "run")
    assert f"{data}:2: [dataset-line] not valid JSON" in err
    assert f"{data}:4: [dataset-line] label must be a string or null" in err
    assert "roles.genrm.models.judge.model_path: [model-dir]" in err
    assert "3 problem(s)" in err


def test_run_refuses_an_unreachable_ray_address_without_waiting_for_ray(root: Path) -> None:
    err = refused(relax("run", str(support.job_file(root)), "--address", "127.0.0.1:1"), "run")
    assert "--address: [ray-address] no Ray cluster answers at 127.0.0.1:1" in err


def test_run_refuses_a_run_directory_that_holds_a_run(root: Path) -> None:
    used = root / "records"
    used.mkdir()
    (used / "run.jsonl").write_text('{"type": "config"}\n')
    err = refused(relax("run", str(support.job_file(root)), "--run-dir", str(used)), "run")
    assert f"--run-dir: {used} already holds a run's records (run.jsonl)" in err


@pytest.fixture
def http_server() -> Iterator[int]:
    """A plain HTTP/1 server on a free loopback port (what a mistyped port often reaches)."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            return None

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.mark.parametrize("command", ["run", "serve"])
def test_an_address_that_answers_http_but_is_not_ray_is_refused_before_ray_starts(
    root: Path, http_server: int, command: str
) -> None:
    # Before the handshake probe Ray looped on "Failed to connect to GCS" for minutes here.
    err = refused(
        relax(command, str(support.job_file(root)), "--address", f"127.0.0.1:{http_server}"),
        command,
    )
    assert f"127.0.0.1:{http_server} accepts connections but is not a Ray cluster" in err
    assert "(its first bytes: b'" in err, err  # what the server said, for the user to see


def test_a_toml_syntax_error_names_the_file_and_line(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text("[cluster]\nnum_nodes = 1\ngpus_per_node = \n[roles.rollout]\n")
    err = refused(relax("run", str(job)), "run")
    assert f"{job}:3:" in err and "[toml] not valid TOML" in err
    assert "line 3: 'gpus_per_node ='" in err


# -- relax serve --------------------------------------------------------------------------------


def _serve_job(
    port: int = 0, policy: str = "tiny/policy", math: str = "tiny/math", **roles: Any
) -> str:
    """A served job of two CPU models, the teacher's gateway on ``port`` (``roles``: more
    role tables)."""
    return job_text(
        models={
            "rollout.policy": hf(policy, device="cpu", route_mode="DIRECT"),
            "teacher.math": hf(math, device="cpu"),
        },
        roles={"teacher": {"gateway": {"port": port}}, **roles},
    )


def test_serve_refuses_a_gateway_port_in_use_naming_its_key(root: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        job = root / "serve.toml"
        job.write_text(_serve_job(port))
        err = refused(relax("serve", str(job)), "serve")
    assert f"roles.teacher.gateway.port: [port] cannot listen on 127.0.0.1:{port}" in err


def test_serve_reads_a_relative_model_path_as_run_does_and_refuses_a_missing_one(
    root: Path,
) -> None:
    (root / "tiny" / "math").unlink()
    job = root / "serve.toml"
    job.write_text(_serve_job())
    err = refused(relax("serve", str(job)), "serve")
    assert "roles.teacher.models.math.model_path: [model-dir] no model directory " in err
    assert str(root / "tiny" / "math") in err
    # The policy's relative path was found next to the job file: no problem for it.
    assert "roles.rollout" not in err


# -- the checks, one by one --------------------------------------------------------------------


def test_both_commands_resolve_relative_model_paths_against_the_job_file(root: Path) -> None:
    job = root / "sub" / "job.toml"
    job.parent.mkdir()
    job.write_text(_serve_job(policy="../tiny/policy", math="../tiny/math"))
    config = resolve_model_paths(load_config(job))
    paths = {m.name: m.model_path for role in config.roles for m in role.models}
    assert paths == {
        "policy": str(root / "sub" / ".." / "tiny" / "policy"),
        "math": str(root / "sub" / ".." / "tiny" / "math"),
    }
    assert model_dir_problems(load_config(job), PluginManager.create()) == ([], [])


def test_a_model_directory_without_config_or_tokenizer_is_refused(root: Path) -> None:
    (root / "tiny" / "math").unlink()
    (root / "tiny" / "math").mkdir()
    job = root / "serve.toml"
    job.write_text(_serve_job())
    problems, _ = model_dir_problems(load_config(job), PluginManager.create())
    assert [p.path for p in problems] == ["roles.teacher.models.math.model_path"]
    assert "has no config.json and no tokenizer" in problems[0].message


def test_on_a_cluster_a_missing_absolute_path_is_a_warning_a_relative_one_a_problem(
    root: Path,
) -> None:
    job = root / "serve.toml"
    job.write_text(_serve_job(policy="/nonexistent/policy", math="tiny/none"))
    problems, warnings = model_dir_problems(load_config(job), PluginManager.create(), remote=True)
    assert [p.path for p in problems] == ["roles.teacher.models.math.model_path"]
    assert len(warnings) == 1 and "/nonexistent/policy is not on this machine" in warnings[0]
    # On this machine's own new Ray, both are problems.
    found = job_preflight(load_config(job), PluginManager.create())
    assert len(found.problems) == 2 and not found.ok


def test_two_gateways_on_one_port_are_refused(root: Path) -> None:
    job = root / "serve.toml"
    port = 45123
    job.write_text(_serve_job(port, rollout={"gateway": {"port": port}}))
    problems = port_problems(load_config(job))
    assert any(
        p.path == "roles.teacher.gateway.port" and "is also roles.rollout.gateway.port" in p.message
        for p in problems
    ), problems


@pytest.mark.parametrize(
    ("address", "found"),
    [
        (None, None),
        ("auto", None),
        ("127.0.0.1:1", "no Ray cluster answers at 127.0.0.1:1"),
        ("ray://127.0.0.1:1", "no Ray cluster answers at 127.0.0.1:1"),
        ("not an address", "is not a Ray address"),
    ],
)
def test_the_ray_address_is_checked_before_ray_is_asked(
    address: str | None, found: str | None
) -> None:
    problem = ray_address_problem(address, timeout=2.0)
    if found is None:
        assert problem is None
    else:
        assert problem is not None and problem.path == "--address" and found in problem.message


def test_the_gcs_of_a_real_ray_cluster_passes(ray_local: Any) -> None:
    assert ray_address_problem(ray_local.get_runtime_context().gcs_address) is None


def test_a_listening_server_that_says_nothing_is_not_a_ray_cluster(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Shortened only so the test does not wait the user-facing 10 s for a silent server.
    monkeypatch.setattr("relax_core.jobs.preflight.ANSWER_TIMEOUT", 0.5)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        problem = ray_address_problem(f"127.0.0.1:{server.getsockname()[1]}")
        assert problem is not None
        assert "is not a Ray cluster (it closed or said nothing" in problem.message
