"""Weight updates from other processes: tensors (two formats), gloo broadcast, disk."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from relax_hf.testing import EngineServer
from relax_torch_weights import serialize_named_tensors

from relax_core import ControlClient, LifecycleError
from relax_core.testing import free_port

TRAINER = Path(__file__).with_name("trainer_process.py")
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(start_server: Any) -> EngineServer:
    return start_server("hf-weights")  # type: ignore[no-any-return]


@pytest.fixture
def fresh(engine: EngineServer, tiny_model: Path) -> EngineServer:
    """The module's engine with the checkpoint's weights loaded back before each test."""
    engine.http.ok(
        "/update_weights_from_disk", {"model_path": str(tiny_model), "weight_version": "ckpt"}
    )
    return engine


def _shape(server: EngineServer) -> tuple[int, int]:
    info = server.http.ok("/server_info")
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(info["model_path"])
    return cfg.vocab_size, cfg.hidden_size


def _trainer(server: EngineServer, mode: str, *extra: str) -> dict[str, Any]:
    rows, cols = _shape(server)
    # Output goes to a file, not a pipe: torch's shared-memory manager (a daemon the
    # "sglang" mode starts) inherits the trainer's stdout and would hold a pipe open.
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(
            [sys.executable, str(TRAINER), server.url, mode, str(rows), str(cols), *extra],
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            code: int | None = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        out.seek(0)
        text = out.read()
    assert code == 0, text[-3000:]
    return json.loads(text.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _assert_zero_head(server: EngineServer, version: str) -> None:
    # lm_head = 0 makes every logit 0: greedy picks id 0, every log-prob is -log(vocab).
    out = server.http.generate("Hello", sampling_params=GREEDY, return_logprob=True)
    vocab = _shape(server)[0]
    assert out["output_ids"] == [0] * GREEDY["max_new_tokens"]
    for lp, _, _ in out["meta_info"]["output_token_logprobs"]:
        assert lp == pytest.approx(-math.log(vocab), abs=1e-4)
    assert out["meta_info"]["weight_version"] == version
    assert server.http.ok("/model_info")["weight_version"] == version


@pytest.mark.parametrize(("mode", "version"), [("safetensors", "st-1"), ("sglang", "sgl-1")])
def test_tensor_update_from_another_process_changes_outputs_and_version(
    fresh: EngineServer, mode: str, version: str
) -> None:
    before = fresh.http.generate("Hello", sampling_params=GREEDY)["output_ids"]
    assert before != [0] * GREEDY["max_new_tokens"]
    answer = _trainer(fresh, mode)
    assert answer["success"] is True and answer["weight_version"] == version
    _assert_zero_head(fresh, version)


def test_distributed_update_over_gloo_from_a_trainer_process(fresh: EngineServer) -> None:
    answer = _trainer(fresh, "distributed", str(free_port()))
    assert answer["success"] is True and answer["weight_version"] == "gloo-1"
    _assert_zero_head(fresh, "gloo-1")
    assert fresh.http.ok("/server_info")["weights_update_group"] is None  # destroyed


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(
    _cuda_devices() < 2, reason="needs 2 CUDA GPUs: the engine on one, the trainer on the other"
)
def test_distributed_update_over_nccl_from_a_trainer_on_another_gpu(start_server: Any) -> None:
    engine = start_server("hf-nccl", device="cuda:0", dtype="float32")
    answer = _trainer(engine, "distributed-nccl", str(free_port()))
    assert answer["success"] is True and answer["weight_version"] == "nccl-1"
    _assert_zero_head(engine, "nccl-1")


def test_retracted_requests_continue_with_the_new_weights(fresh: EngineServer) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from relax_core.testing import wait_for

    params = {"max_new_tokens": 1000, "temperature": 0.0, "ignore_eos": True}
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(fresh.http.generate, "Hello", sampling_params=params)
        wait_for(
            lambda: fresh.http.ok("/server_info")["num_running_reqs"] == 1,
            timeout=30,
            what="a running request",
        )
        out = fresh.http.ok("/pause_generation", {"mode": "retract"})
        assert "1 running request(s) retracted" in out["message"]
        info = fresh.http.ok("/server_info")
        assert (info["num_running_reqs"], info["num_waiting_reqs"]) == (0, 1)
        assert fresh.http.post("/flush_cache")[0] == 200  # nothing holds KV while retracted
        fresh.http.ok("/release_memory_occupation", {"tags": ["kv_cache"]})
        fresh.http.ok("/resume_memory_occupation", {"tags": ["kv_cache"]})
        _trainer(fresh, "safetensors")  # lm_head = 0: every token from now on is id 0
        fresh.http.ok("/continue_generation", {})
        result = fut.result(timeout=60)
    ids = result["output_ids"]
    assert len(ids) == 1000 and result["meta_info"]["finish_reason"]["type"] == "length"
    first_zero = next(i for i, t in enumerate(ids) if t == 0 and all(x == 0 for x in ids[i:]))
    assert 0 < first_zero < 1000  # tokens before the update came from the old weights
    assert result["meta_info"]["weight_version"] == "st-1"


def test_update_from_disk_restores_the_checkpoint(fresh: EngineServer, tiny_model: Path) -> None:
    before = fresh.http.generate("Hello", sampling_params=GREEDY)["output_ids"]
    _trainer(fresh, "safetensors")
    out = fresh.http.ok(
        "/update_weights_from_disk", {"model_path": str(tiny_model), "weight_version": "ckpt-2"}
    )
    assert out["weight_version"] == "ckpt-2"
    assert fresh.http.generate("Hello", sampling_params=GREEDY)["output_ids"] == before


def test_versions_count_up_when_the_caller_gives_none(
    fresh: EngineServer, tiny_model: Path
) -> None:
    fresh.http.ok(
        "/update_weights_from_disk", {"model_path": str(tiny_model), "weight_version": "7"}
    )
    out = fresh.http.ok("/update_weights_from_disk", {"model_path": str(tiny_model)})
    assert out["weight_version"] == "8"


def test_a_bad_update_is_refused_and_changes_nothing(fresh: EngineServer) -> None:
    import torch

    before = fresh.http.generate("Hello", sampling_params=GREEDY)["output_ids"]
    rows, cols = _shape(fresh)
    good = ("lm_head.weight", torch.zeros(rows, cols))
    for named, needle in [
        ([good, ("no.such.weight", torch.zeros(2))], "unknown parameter 'no.such.weight'"),
        ([good, ("model.norm.weight", torch.zeros(3))], "has shape"),
    ]:
        payload = serialize_named_tensors(named, load_format="safetensors")
        status, body = fresh.http.post(
            "/update_weights_from_tensor",
            {"serialized_named_tensors": [payload], "load_format": "safetensors"},
        )
        assert status == 400 and needle in body["message"]
    assert fresh.http.generate("Hello", sampling_params=GREEDY)["output_ids"] == before
    assert fresh.http.ok("/model_info")["weight_version"] == "ckpt"


def test_control_client_raises_lifecycle_error_with_the_servers_message(
    fresh: EngineServer,
) -> None:
    async def go() -> None:
        async with ControlClient(fresh.url, timeout=30) as c:
            with pytest.raises(
                LifecycleError, match=r"update_weights_from_disk refused by .*is not a directory"
            ):
                await c.update_weights_from_disk("/nonexistent/checkpoint")
            assert await c.weight_version() == "ckpt"

    asyncio.run(go())


def _pending(server: EngineServer) -> tuple[int, bool]:
    memory = server.http.ok("/server_info")["memory"]
    return memory["weights_pending"], memory["weights_pending_reloadable"]


def test_a_release_without_backup_after_an_update_refuses_generation_until_a_push(
    fresh: EngineServer, tiny_model: Path
) -> None:
    before = fresh.http.generate("Hello", sampling_params=GREEDY)["output_ids"]
    _trainer(fresh, "safetensors")
    fresh.http.ok("/release_memory_occupation", {"tags": ["weights"]})
    status, body = fresh.http.post("/update_weights_from_disk", {"model_path": "/x"})
    assert status == 400 and "resume" in body["message"]
    out = fresh.http.ok("/resume_memory_occupation", {"tags": ["weights"]})
    assert out["detail"]["weights"]["source"] == "discarded"  # nothing read back from disk
    assert out["detail"]["weights"]["updates_lost"] is True
    assert "lost" in out["message"] and out["weight_version"] == "ckpt"
    total, reloadable = _pending(fresh)
    assert total > 1 and reloadable is False
    # No silent fallback to the checkpoint: a 503 that says what was lost and what to do.
    status, body = fresh.http.post("/generate", {"text": "Hello", "sampling_params": GREEDY})
    assert status == 503 and "were lost" in body["message"] and "push every" in body["message"]
    status, body = fresh.http.post("/get_weights_by_name", {"name": "lm_head.weight"})
    assert status == 400 and "were lost" in body["message"]
    # The manager's onload check still runs (it checks the engine, not the weights).
    checked = fresh.http.ok(
        "/resume_memory_occupation", {"tags": ["weights"], "check_generation": True}
    )
    assert checked["generation_checked"] is True
    seconds = checked["detail"]["generation_check_seconds"]
    assert 0 < checked["detail"]["generation_check_step_seconds"] <= seconds
    _trainer(fresh, "safetensors")  # one parameter written: the others are still missing
    assert _pending(fresh) == (total - 1, False)
    status, body = fresh.http.post("/generate", {"text": "Hello", "sampling_params": GREEDY})
    assert status == 503 and f"{total - 1} of {total} parameters" in body["message"]
    fresh.http.ok(
        "/update_weights_from_disk", {"model_path": str(tiny_model), "weight_version": "ckpt"}
    )
    assert _pending(fresh) == (0, False)
    assert fresh.http.generate("Hello", sampling_params=GREEDY)["output_ids"] == before


def test_a_release_without_backup_of_the_checkpoints_weights_reads_back_only_what_no_push_wrote(
    fresh: EngineServer,
) -> None:
    before = fresh.http.generate("Hello", sampling_params=GREEDY)["output_ids"]
    fresh.http.ok("/release_memory_occupation", {"tags": ["weights"]})
    out = fresh.http.ok("/resume_memory_occupation", {"tags": ["weights"]})
    assert out["detail"]["weights"]["source"] == "discarded"
    assert out["detail"]["weights"]["updates_lost"] is False
    total, reloadable = _pending(fresh)
    assert total > 1 and reloadable is True
    head = fresh.http.ok("/get_weights_by_name", {"name": "lm_head.weight", "truncate_size": 2})
    assert _pending(fresh) == (0, True)  # a read of a parameter reads back every one
    fresh.http.ok("/release_memory_occupation", {"tags": ["weights"]})
    fresh.http.ok("/resume_memory_occupation", {"tags": ["weights"]})
    # The first request reads the checkpoint back (the resume read nothing).
    assert fresh.http.generate("Hello", sampling_params=GREEDY)["output_ids"] == before
    assert _pending(fresh) == (0, True)
    # A push after the release keeps its parameter; the rest come from the checkpoint.
    fresh.http.ok("/release_memory_occupation", {"tags": ["weights"]})
    fresh.http.ok("/resume_memory_occupation", {"tags": ["weights"]})
    _trainer(fresh, "safetensors")
    assert _pending(fresh) == (total - 1, True)
    _assert_zero_head(fresh, "st-1")
    assert _pending(fresh) == (0, True)
    assert head != fresh.http.ok(
        "/get_weights_by_name", {"name": "lm_head.weight", "truncate_size": 2}
    )  # the checkpoint's head (read back above), then the pushed zeros


def test_a_release_copies_weights_to_the_backup_only_when_they_changed(start_server: Any) -> None:
    import torch

    engine = start_server("hf-backup-copies", weights_cpu_backup=True)
    param_bytes = engine.http.ok("/server_info")["memory"]["param_bytes"]

    def cycle() -> tuple[int, list[int]]:
        out = engine.http.ok("/release_memory_occupation", {"tags": ["weights"]})
        engine.http.ok("/resume_memory_occupation", {"tags": ["weights"]})
        logged = engine.http.ok("/server_info")["memory_log"][-2:]
        assert [e["op"] for e in logged] == ["release", "resume"]
        assert logged[0]["detail"] == out["detail"]
        copied = out["detail"]["weights"]["backup_copied_bytes"]
        return copied, engine.http.generate("Hello", sampling_params=GREEDY)["output_ids"]

    before = engine.http.generate("Hello", sampling_params=GREEDY)["output_ids"]
    assert cycle() == (param_bytes, before)  # the first release fills the backup
    assert cycle() == (0, before)  # unchanged weights: nothing copied, the same outputs

    rows, cols = _shape(engine)
    payload = serialize_named_tensors(
        [("lm_head.weight", torch.zeros(rows, cols))], load_format="safetensors"
    )
    engine.http.ok(
        "/update_weights_from_tensor",
        {"serialized_named_tensors": [payload], "load_format": "safetensors"},
    )
    updated = engine.http.generate("Hello", sampling_params=GREEDY)["output_ids"]
    assert updated != before
    # An update makes the backup stale: the next release copies again, and the resume brings
    # back the updated weights, not the old backup.
    assert cycle() == (param_bytes, updated)


@pytest.mark.parametrize("mode", ["in_place", "retract", "abort"])
def test_a_push_during_generation_keeps_the_request_and_records_both_versions(
    fresh: EngineServer, mode: str
) -> None:
    """pause_generation(mode), a weight push, continue_generation — SGLang's semantics: in
    place and retracted requests finish, their tokens after the push from the new weights,
    and ``meta_info.weight_versions`` gives both spans (a sample carries both versions); an
    aborted one comes back with what it had generated, its abort reason and its one version."""
    from concurrent.futures import ThreadPoolExecutor

    from relax_core.testing import wait_for

    params = {"max_new_tokens": 1000, "temperature": 0.0, "ignore_eos": True}
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(fresh.http.generate, "Hello", sampling_params=params, return_logprob=True)
        wait_for(
            lambda: fresh.http.ok("/server_info")["num_running_reqs"] == 1,
            timeout=30,
            what="a running request",
        )
        fresh.http.ok("/pause_generation", {"mode": mode})
        _trainer(fresh, "safetensors")  # lm_head = 0: every token from now on is id 0
        fresh.http.ok("/continue_generation", {})
        result = fut.result(timeout=60)
    meta, ids = result["meta_info"], result["output_ids"]
    spans = meta["weight_versions"]
    if mode == "abort":
        assert meta["finish_reason"]["type"] == "abort"
        assert 0 < len(ids) < 1000
        assert spans == [{"version": "ckpt", "start": 0, "end": len(ids)}]
        return
    assert meta["finish_reason"]["type"] == "length" and len(ids) == 1000
    assert [s["version"] for s in spans] == ["ckpt", "st-1"], spans
    boundary = spans[1]["start"]
    assert spans == [
        {"version": "ckpt", "start": 0, "end": boundary},
        {"version": "st-1", "start": boundary, "end": 1000},
    ]
    assert 0 < boundary < 1000 and all(t == 0 for t in ids[boundary:])
    assert meta["weight_version"] == "st-1"
