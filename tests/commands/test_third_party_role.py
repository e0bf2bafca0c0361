"""A fourth role added by a plugin distribution, with no core change: ``prm``.

``tests/plugins/relax-prm`` (installed with ``pip install -e``, found through its ``relax``
entry point) registers a process reward model: STATIC weights, DIRECT, deferrable, with its own
gateway adapter. Everything below is what a user runs: ``relax plugins``, ``relax plan`` in the
decoupled, split and defer layouts, and ``relax serve`` on ``hf`` engines (real Ray, a real
engine process, the real gateway), asked on every route of the prm gateway. Its OpenAPI
document is checked with the others' in ``tests/gateway/test_openapi.py``.
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

from relax_core.testing import wait_for
from tests.support import serve as support
from tests.support.jobs import colocated, defer, hf, job_text

ROOT = Path(__file__).resolve().parents[2]
PRM_DOCUMENT = ROOT / "tests" / "plugins" / "relax-prm" / "openapi" / "prm.json"


def _relax(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "relax_core", *args], capture_output=True, text=True, timeout=120
    )


def _http(url: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    """GET (or POST ``body`` as JSON); ``(status, decoded JSON)`` without raising on errors."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# -- relax plugins and relax plan ----------------------------------------------------------


def test_relax_plugins_lists_the_prm_role_with_its_distribution() -> None:
    done = _relax("plugins", "--json")
    assert done.returncode == 0, done.stderr
    rows = {(r["kind"], r["name"]): r for r in json.loads(done.stdout)["records"]}
    assert rows[("roles", "prm")]["distribution"] == "relax-prm"
    assert rows[("roles", "prm")]["plugin"] == "prm"


def _models(policy: int, scorer: int, **engines: int) -> dict[str, dict[str, object]]:
    """rollout.policy on ``policy`` GPUs and prm.scorer on ``scorer``, engines as ``engines``."""
    return {
        "rollout.policy": hf("/models/prm", num_gpus=policy, **engines),
        "prm.scorer": hf("/models/prm", num_gpus=scorer, **engines),
    }


LAYOUTS = {
    "decoupled": job_text(
        cluster={"num_nodes": 2, "gpus_per_node": 8},
        training={"actor_gpus": 8},
        placement={"mode": "decoupled"},
        models=_models(4, 4, gpus_per_engine=2, tp=2),
    ),
    "split": job_text(**colocated(8), placement={"mode": "split"}, models=_models(4, 4)),
    "defer": job_text(
        **colocated(8),
        placement=defer("prm"),
        models={
            "rollout.policy": hf("/models/prm", num_gpus=8, gpus_per_engine=2, tp=2),
            "prm.scorer": hf("/models/prm", num_gpus=8, gpus_per_engine=4, tp=4),
        },
    ),
}

#: (pool, bundle_start, num_gpus, phase) of rollout.policy and prm.scorer, and the phases.
EXPECTED = {
    "decoupled": (("rollout", 0, 4, "resident"), ("prm", 0, 4, "resident"), ("resident",)),
    "split": (("actor", 0, 4, "resident"), ("actor", 4, 4, "resident"), ("resident",)),
    "defer": (("actor", 0, 8, "generation"), ("actor", 0, 8, "prm"), ("generation", "prm")),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_relax_plan_places_the_prm_role_in_every_layout(layout: str, tmp_path: Path) -> None:
    config = tmp_path / "job.toml"
    config.write_text(LAYOUTS[layout])
    done = _relax("plan", str(config), "--json")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    rows = {
        (p["role"], p["model"]): (p["pool"], p["bundle_start"], p["num_gpus"], p["phase"])
        for p in plan["placements"]
    }
    policy, scorer, phases = EXPECTED[layout]
    assert rows == {("rollout", "policy"): policy, ("prm", "scorer"): scorer}
    assert (plan["mode"], tuple(plan["phases"])) == (layout, phases)


def test_relax_plan_draws_the_prm_role_by_its_records_title(tmp_path: Path) -> None:
    config = tmp_path / "job.toml"
    config.write_text(LAYOUTS["split"])
    done = _relax("plan", str(config))
    assert done.returncode == 0, done.stderr
    lines = [line.rstrip() for line in done.stdout.splitlines()]
    assert "Rollout: R R R R . . . ." in lines
    assert "PRM:     . . . . P P P P" in lines


def test_relax_plan_refuses_to_defer_a_role_whose_record_is_not_deferrable(
    tmp_path: Path,
) -> None:
    config = tmp_path / "job.toml"
    config.write_text(
        LAYOUTS["defer"].replace('defer_roles = ["prm"]', 'defer_roles = ["rollout"]')
    )
    done = _relax("plan", str(config))
    assert done.returncode == 2
    assert "placement.defer_roles[0]: [defer-role] role 'rollout' cannot be deferred" in done.stderr
    assert "prm" in done.stderr  # the installed deferrable roles are listed


# -- relax serve ---------------------------------------------------------------------------


@pytest.mark.ray
@pytest.mark.slow
def test_relax_serve_starts_the_prm_role_on_hf_engines_and_its_gateway_answers_every_route(
    tmp_path: Path,
) -> None:
    model_dir = support.make_tiny_model(tmp_path / "model")
    config = tmp_path / "job.toml"
    config.write_text(job_text(models={"prm.scorer": hf(str(model_dir), device="cpu")}))
    args = ("--log-dir", str(tmp_path / "logs"), "--refresh", "0.5", "--health-interval", "0")
    with support.serve(config, *args) as (proc, out, stderr):
        out.wait_for(r"relax serve: ready", timeout=240)
        assert re.search(
            r"prm\.scorer: hf on cpu, 1 engine, weights STATIC, route DIRECT", str(out)
        )
        url = out.wait_for(r"^\s+prm\s+gateway\s+(http://[\d.]+:\d+)/prm/", timeout=5).group(1)
        base = f"{url}/prm"

        # Raw generation, and the prm adapter's own input: a solution's steps.
        status, raw = _http(
            f"{base}/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
        )
        assert status == 200 and isinstance(raw["text"], str)
        status, scored = _http(
            f"{base}/generate",
            {
                "question": "2+2?",
                "steps": ["2+2 is 4.", "So the answer is 4."],
                "sampling_params": {"max_new_tokens": 1},
            },
        )
        assert status == 200 and isinstance(scored["text"], str)
        # The adapter rendered the steps into one prompt longer than the raw one.
        assert scored["meta_info"]["prompt_tokens"] > raw["meta_info"]["prompt_tokens"]
        status, refused = _http(f"{base}/generate", {"steps": ["a", ""]})
        assert status == 400 and refused["error"]["param"] == "steps[1]"

        status, chat = _http(
            f"{base}/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Is 2+2=4?"}], "max_tokens": 2},
        )
        assert status == 200 and chat["object"] == "chat.completion"

        status, engines = _http(f"{base}/engines")
        assert status == 200 and engines["role"] == "prm" and engines["schema_version"] == 2
        scorer = engines["models"]["scorer"]
        assert (scorer["state"], scorer["route_mode"], scorer["weight_source"]) == (
            "READY",
            "DIRECT",
            "STATIC",
        )
        assert [e["state"] for e in scorer["engines"]] == ["READY"]

        # The record says health schema 2 (the unified body) by default.
        status, health = _http(f"{base}/health")
        assert status == 200 and health["role"] == "prm" and health["ready"] is True

        status, document = _http(f"{base}/openapi.json")
        assert status == 200 and document == json.loads(PRM_DOCUMENT.read_text())

        status_cmd = _relax("status", base)
        assert status_cmd.returncode == 0, status_cmd.stdout + status_cmd.stderr
        assert re.search(r"scorer\s+READY\s+DIRECT\s+STATIC", status_cmd.stdout)

        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) == 0, out.rest(10) + stderr.read_text()
        assert out.rest(10).endswith("nothing left running")
        wait_for(lambda: not support.in_session(proc.pid), timeout=30, what="serve's processes")
        wait_for(lambda: not support.mentioning(str(model_dir)), timeout=30, what="engines gone")
