"""Multi-node hf replicas on loopback: a head and a follower that mirrors every step.

Each replica here is two real ``relax-hf serve`` processes (node rank 0 and 1) joined in a gloo
group at a ``dist_init_addr`` on 127.0.0.1; faults are real (kill -9, a missing head).
"""

from __future__ import annotations

import os
import re
import signal
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from relax_hf.plugin import launch
from relax_hf.testing import EngineServer, ReplicaServers, start_replica

from relax_core import EngineLaunchSpec, EngineOptions, LifecycleError
from relax_core.testing import free_port, wait_for

TRAINER = Path(__file__).with_name("trainer_process.py")
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}

StartReplica = Callable[..., ReplicaServers]


@pytest.fixture(scope="module")
def start(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StartReplica]:
    """Start replicas for one module; every node of every one is stopped when it ends."""
    started: list[ReplicaServers] = []
    logs = tmp_path_factory.mktemp("replica-logs")

    def go(**kw: Any) -> ReplicaServers:
        name = f"hf-mn-{len(started)}"
        replica = start_replica(kw.pop("model", tiny_model), logs, name, seed=0, **kw)
        started.append(replica)
        return replica

    yield go
    for replica in started:
        replica.terminate(10)


@pytest.fixture(scope="module")
def replica(start: StartReplica) -> ReplicaServers:
    """One healthy two-node replica shared by the tests that leave it healthy."""
    return start()


def _nodes(replica: ReplicaServers) -> dict[str, Any]:
    return replica.http.ok("/server_info")["nodes"]  # type: ignore[no-any-return]


def _trainer(replica: ReplicaServers, mode: str, *extra: str) -> None:
    import json
    import subprocess
    import sys
    import tempfile

    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(replica.http.ok("/server_info")["model_path"])
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.run(
            [sys.executable, str(TRAINER), replica.head.url, mode, str(cfg.vocab_size),
             str(cfg.hidden_size), *extra],
            stdout=out, stderr=subprocess.STDOUT, timeout=120, check=False,
        )  # fmt: skip
        out.seek(0)
        text = out.read()
    assert proc.returncode == 0, text[-3000:]
    assert json.loads(text.strip().splitlines()[-1])["success"] is True


def test_a_two_node_replica_generates_what_a_single_node_engine_generates(
    replica: ReplicaServers, shared_server: EngineServer
) -> None:
    sampled = {"max_new_tokens": 12, "temperature": 0.8, "top_p": 0.9, "sampling_seed": 7}
    for body in (
        {"text": "Hello", "sampling_params": GREEDY},
        {"text": ["The quick", "Question: what", "def add"], "sampling_params": sampled},
        # n samples share one prefill; a grammar runs on both nodes (the follower compiles it).
        {"text": "x", "sampling_params": {**sampled, "n": 3, "regex": "[a-z]{2,6}"}},
    ):
        two_nodes = replica.http.ok("/generate", body)
        one_node = shared_server.http.ok("/generate", body)
        ids = [o["output_ids"] for o in (two_nodes if isinstance(two_nodes, list) else [two_nodes])]
        assert ids == [
            o["output_ids"] for o in (one_node if isinstance(one_node, list) else [one_node])
        ]
    nodes = _nodes(replica)
    assert nodes["healthy"] and nodes["nnodes"] == 2
    assert [f["pid"] for f in nodes["followers"]] == [replica.followers[0].pid]
    # The follower computed every token itself and agreed with the head on each one.
    assert nodes["tokens_synced"] >= 8 + 3 * 12 + 3 * 2 and nodes["diverged_tokens"] == 0


def test_the_follower_keeps_the_heads_prefix_cache(replica: ReplicaServers) -> None:
    # The follower runs only the tokens after the cached prefix too: had its tree not held the
    # prefix's K/V, its tokens would differ from the head's.
    http = replica.http
    http.ok("/flush_cache")
    prefix = [(7 * i + 3) % 400 + 10 for i in range(80)]
    outs = [
        http.ok("/generate", {"input_ids": [*prefix, t], "sampling_params": GREEDY})
        for t in (1, 2, 3)
    ]
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [0, 80, 80]
    nodes = _nodes(replica)
    assert nodes["healthy"] and nodes["diverged_tokens"] == 0


def test_every_weight_update_and_memory_operation_reaches_the_follower(
    replica: ReplicaServers, tiny_model: Path
) -> None:
    http = replica.http
    before = http.generate("Hello", sampling_params=GREEDY)["output_ids"]
    assert before != [0] * 8
    # lm_head = 0 on the head makes it pick id 0; a follower that missed the update would not.
    for mode, extra in (("safetensors", ()), ("distributed", (str(free_port()),))):
        http.ok("/update_weights_from_disk", {"model_path": str(tiny_model)})
        _trainer(replica, mode, *extra)
        assert http.generate("Hello", sampling_params=GREEDY)["output_ids"] == [0] * 8
        assert _nodes(replica)["diverged_tokens"] == 0, mode
    http.ok("/release_memory_occupation", {"tags": ["weights", "kv_cache"]})
    assert http.post("/generate", {"text": "Hello"})[0] == 503
    # Without a CPU backup the update is lost on both nodes: refused until written again.
    http.ok("/resume_memory_occupation", {"tags": ["weights", "kv_cache"]})
    status, body = http.post("/generate", {"text": "Hello"})
    assert status == 503 and "were lost" in body["message"]
    http.ok("/update_weights_from_disk", {"model_path": str(tiny_model)})
    assert http.generate("Hello", sampling_params=GREEDY)["output_ids"] == before
    # The checkpoint's own weights: both nodes read them back at the first use (here a read of
    # one parameter; a follower left with zeros would diverge below).
    http.ok("/release_memory_occupation", {"tags": ["weights", "kv_cache"]})
    http.ok("/resume_memory_occupation", {"tags": ["weights", "kv_cache"]})
    assert http.ok("/server_info")["memory"]["weights_pending"] > 0
    http.ok("/get_weights_by_name", {"name": "lm_head.weight", "truncate_size": 1})
    assert http.ok("/server_info")["memory"]["weights_pending"] == 0
    assert http.generate("Hello", sampling_params=GREEDY)["output_ids"] == before
    assert http.ok("/server_info")["memory"]["weights_pending"] == 0
    assert http.post("/flush_cache")[0] == 200
    nodes = _nodes(replica)
    assert nodes["healthy"] and nodes["diverged_tokens"] == 0
    assert replica.followers[0].poll() is None


def test_aborted_and_retracted_requests_keep_the_follower_in_step(
    replica: ReplicaServers,
) -> None:
    http = replica.http
    long = {"max_new_tokens": 300, "temperature": 0.7, "sampling_seed": 1, "ignore_eos": True}
    rid = uuid.uuid4().hex
    with ThreadPoolExecutor(2) as pool:
        kept = pool.submit(http.generate, "Hello", sampling_params=long)
        dropped = pool.submit(http.generate, "Question", sampling_params=long, rid=rid)
        wait_for(
            lambda: http.ok("/server_info")["num_running_reqs"] == 2,
            timeout=60,
            what="two running requests",
        )
        assert http.ok("/abort_request", {"rid": rid})["found"] is True
        message = http.ok("/pause_generation", {"mode": "retract"})["message"]
        assert re.search(r"[12] running request\(s\) retracted", message), message
        http.ok("/continue_generation", {})
        assert kept.result(timeout=120)["meta_info"]["finish_reason"]["type"] == "length"
        assert dropped.result(timeout=60)["meta_info"]["finish_reason"]["type"] == "abort"
    nodes = _nodes(replica)
    assert nodes["healthy"] and nodes["diverged_tokens"] == 0
    assert http.get("/health_generate")[0] == 200


def test_killing_the_follower_makes_the_head_unhealthy_and_ends_its_requests(
    start: StartReplica,
) -> None:
    replica = start()
    http = replica.http
    follower = replica.followers[0]
    params = {"max_new_tokens": 2000, "temperature": 0.0, "ignore_eos": True}
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(http.generate, "Hello", sampling_params=params)
        wait_for(
            lambda: http.ok("/server_info")["num_running_reqs"] == 1,
            timeout=60,
            what="a running request",
        )
        os.kill(follower.pid, signal.SIGKILL)
        wait_for(
            lambda: http.get("/health_generate", timeout=30)[0] != 200,
            timeout=30,
            what="the head to notice its lost follower",
        )
        # The request in flight ends (aborted), it does not hang.
        assert running.result(timeout=30)["meta_info"]["finish_reason"]["type"] == "abort"
    status, body = http.get("/health")
    assert status == 503 and "follower node 1" in body["message"]
    assert http.get("/health_generate")[0] == 503
    assert http.post("/generate", {"text": "Hello"})[0] == 503
    nodes = _nodes(replica)
    assert nodes["healthy"] is False and "follower node 1" in nodes["lost"]
    assert replica.head.process.poll() is None  # unhealthy, not gone: the manager decides


def test_a_follower_exits_on_its_own_when_its_head_is_killed(start: StartReplica) -> None:
    replica = start()
    follower = replica.followers[0]
    os.kill(replica.head.process.pid, signal.SIGKILL)
    wait_for(lambda: follower.poll() is not None, timeout=30, what="the follower to exit")
    assert follower.poll() == 1
    assert "lost the head" in follower.log_tail()


def test_stopping_the_head_stops_its_follower_cleanly(start: StartReplica) -> None:
    replica = start()
    follower = replica.followers[0]
    replica.head.process.terminate(10)
    wait_for(lambda: follower.poll() is not None, timeout=30, what="the follower to exit")
    assert follower.poll() == 0


def test_a_follower_that_loaded_another_model_is_refused(
    start: StartReplica, tmp_path: Path
) -> None:
    from relax_hf.tiny import make_tiny_model

    other = make_tiny_model(tmp_path / "micro", seed=0, size="micro")
    replica = start(follower_model=other, wait=False)
    with pytest.raises(LifecycleError, match="loaded a different model than the head"):
        replica.head.process.wait_ready(120)
    follower = replica.followers[0]
    wait_for(lambda: follower.poll() is not None, timeout=30, what="the refused follower to exit")
    assert follower.poll() == 1


def test_a_follower_without_a_head_gives_up_after_the_dist_timeout(
    tiny_model: Path, tmp_path: Path
) -> None:
    process = launch(
        EngineLaunchSpec(
            engine_id="lonely/replica-0/node-1",
            model_path=str(tiny_model),
            nnodes=2,
            node_rank=1,
            dist_init_addr=f"127.0.0.1:{free_port()}",
            options=EngineOptions(extra_args=("--dist-timeout", "2")),
            log_path=str(tmp_path / "follower.log"),
        )
    )
    try:
        assert process.base_url is None and process.ready_url is not None
        with pytest.raises(LifecycleError) as info:
            process.wait_ready(60)
        assert "exited with code 1" in str(info.value) and "no head answered" in str(info.value)
    finally:
        process.terminate(5)
