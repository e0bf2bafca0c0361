"""One step of ``relax run`` on a real two-node ``ray.cluster_utils.Cluster``.

Run by ``tests/run/test_run_cluster.py`` in its own process: a Cluster cannot share a process
with the suite's local Ray. A head node without GPUs and two nodes of one declared GPU each;
the job's pool has one bundle per node: rollout on bundle 0, genrm and teacher deferred on
bundle 1 (the other node). The run goes through the same code as ``relax run`` (a RunJob, the
step loop, the teardown) with micro hf models on CPU. Prints one JSON line with what it saw;
everything it made is gone before it exits (checked, and reported in the JSON).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

from tests.support.serve import alive

#: The deferred roles' models, both on bundle 1 (the other node).
DEFERRED = "\n".join(
    f"""\
[roles.{role}.models.{model}]
backend = "hf"
model_path = "{{root}}/{model}"
bundle_start = 1
extra_args = ["--device", "cpu"]
env = {{{{ OMP_NUM_THREADS = "1" }}}}
"""
    for role, model in (("genrm", "judge"), ("teacher", "math"))
)

JOB = (
    """\
[cluster]
num_nodes = 2
gpus_per_node = 1

[training]
actor_gpus = 2
colocate = true
offload = true

[placement]
mode = "defer"
defer_roles = ["genrm", "teacher"]

[roles.rollout.models.policy]
backend = "hf"
model_path = "{root}/policy"
weight_source = "ACTOR"
weights_cpu_backup = true
bundle_start = 0
extra_args = ["--device", "cpu"]
env = {{ OMP_NUM_THREADS = "1" }}

"""
    + DEFERRED
    + """
[run]
steps = 1
prompts_per_step = 2
samples_per_prompt = 2
max_new_tokens = 8
rewards = [{{ adapter = "genrm-judge" }}, {{ adapter = "exact-match", weight = 0.5 }}]
reward_role = "genrm"
teacher_role = "teacher"
operation_timeout = 60.0
"""
)


def main() -> int:
    import ray
    from ray.cluster_utils import Cluster
    from relax_hf.tiny import make_tiny_model

    from relax_core.config import loads_config
    from relax_core.plugins import PluginManager
    from relax_core.run.config import parse_run_config
    from relax_core.run.job import RunJob, run_problems
    from relax_core.run.loop import run_loop
    from relax_core.run.progress import Printer

    root = tempfile.mkdtemp(prefix="relax-run-cluster-")
    for seed, name in enumerate(("policy", "judge", "math")):
        make_tiny_model(os.path.join(root, name), seed=seed, size="micro")
    pm = PluginManager.create()
    config = loads_config(JOB.format(root=root), source=os.path.join(root, "job.toml"))
    settings = parse_run_config(config)
    out: dict[str, Any] = {"problems": run_problems(config, settings, pm)}

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    for _ in range(2):
        cluster.add_node(num_cpus=1, num_gpus=1)
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    cluster.wait_for_nodes()
    said: list[str] = []
    job = RunJob(config, settings, pm, name="cluster-check", log_dir=os.path.join(root, "logs"))
    try:
        out["head"] = ray.get_runtime_context().get_node_id()
        job.start(said.append)
        printer = Printer(json_lines=True, out=io.StringIO(), err=io.StringIO())
        summary = asyncio.run(run_loop(job, printer, steps=1))
        out["steps_committed"] = len(summary.committed)
        out["failure"] = None if summary.failure is None else summary.failure.row()
        out["samples"] = [r["samples"] for r in summary.committed]
        out["fields"] = [r["fields"] for r in summary.committed]
        out["weight_versions"] = summary.weight_versions
        # Where each model's engines ran: the node of every worker actor, and the node the
        # validated binding put its bundle on.
        out["worker_nodes"] = {}
        for role, models in job.actors.items():
            for name, actor in models.items():
                engine = f"{name}/replica-0"
                workers = ray.get(actor.workers.remote(engine))
                out["worker_nodes"][f"{role}.{name}"] = [w.node_id for w in workers]
        out["bundle_nodes"] = {
            f"{m.role}.{m.model}": [w.node_id for replica in m.replicas for w in replica]
            for bound in job.bound
            for m in bound.models
        }
        out["slices"] = job.slices
    except BaseException as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        pids = set(job.engine_pids) | set(job.router_pids)
        out["teardown_problems"] = job.teardown(said.append)
        deadline = time.monotonic() + 20
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        out["processes"] = len(pids)
        out["processes_left"] = sorted(p for p in pids if alive(p))
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    out["said"] = said
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
