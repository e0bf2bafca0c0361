"""/generate on a real hf engine: sampling, reproducibility, batching, stops, SSE, info routes."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

from relax_hf.testing import EngineServer

SEEDED = {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 1234}


def test_seeded_generation_is_reproducible(shared_server: EngineServer) -> None:
    a = shared_server.http.generate("Once upon a time", sampling_params=SEEDED)
    b = shared_server.http.generate("Once upon a time", sampling_params=SEEDED)
    assert a["output_ids"] == b["output_ids"]
    assert a["text"] == b["text"]
    other = shared_server.http.generate(
        "Once upon a time", sampling_params={**SEEDED, "sampling_seed": 99}
    )
    assert other["output_ids"] != a["output_ids"]


def test_seeded_output_does_not_depend_on_the_rest_of_the_batch(
    shared_server: EngineServer,
) -> None:
    alone = shared_server.http.generate("The sea is", sampling_params=SEEDED)["output_ids"]
    prompts = [
        "x",
        "Hello there, how are you today?",
        "1 2 3",
        "def add(a, b):",
        "Paris",
        "The sea is",
    ]

    def one(i: int) -> list[int]:
        params = SEEDED if i == len(prompts) - 1 else {"max_new_tokens": 5 + i, "temperature": 0.9}
        return shared_server.http.generate(prompts[i], sampling_params=params)["output_ids"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(one, range(len(prompts))))
    assert results[-1] == alone
    assert shared_server.http.ok("/server_info")["peak_running_reqs"] >= 2  # they were batched


def test_greedy_generation_matches_a_direct_forward_pass(
    shared_server: EngineServer, tiny_model
) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    ids = tok("Question: what is two plus two?", add_special_tokens=False)["input_ids"]
    out = shared_server.http.generate(
        input_ids=ids,
        text=None,
        sampling_params={"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True},
    )
    seq = list(ids)
    with torch.no_grad():
        for _ in range(6):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    assert out["output_ids"] == seq[len(ids) :]
    assert out["meta_info"]["prompt_tokens"] == len(ids)
    assert out["meta_info"]["completion_tokens"] == 6
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 6}


def test_max_new_tokens_zero_only_prefills(shared_server: EngineServer) -> None:
    out = shared_server.http.generate(sampling_params={"max_new_tokens": 0})
    assert out["output_ids"] == [] and out["text"] == ""
    assert out["meta_info"]["finish_reason"]["type"] == "length"


def test_stop_token_ids_finish_with_the_matched_id(shared_server: EngineServer) -> None:
    free = shared_server.http.generate(
        "Hello", sampling_params={"max_new_tokens": 6, "temperature": 0.0}
    )
    stop_id = free["output_ids"][2]
    first = free["output_ids"].index(stop_id)
    out = shared_server.http.generate(
        "Hello",
        sampling_params={"max_new_tokens": 6, "temperature": 0.0, "stop_token_ids": [stop_id]},
    )
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert out["output_ids"] == free["output_ids"][: first + 1]


def test_stop_strings_trim_the_text(shared_server: EngineServer) -> None:
    free = shared_server.http.generate(
        "Hello", sampling_params={"max_new_tokens": 10, "temperature": 0.0}
    )
    text = free["text"]
    stop = text[3:5]
    assert stop.strip(), f"need a visible stop string in {text!r}"
    out = shared_server.http.generate(
        "Hello", sampling_params={"max_new_tokens": 10, "temperature": 0.0, "stop": [stop]}
    )
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[: text.find(stop)]


def test_batch_of_texts_answers_a_list_in_order(shared_server: EngineServer) -> None:
    single = [shared_server.http.generate(t)["output_ids"] for t in ("a", "bb")]
    out = shared_server.http.ok(
        "/generate",
        {"text": ["a", "bb"], "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}},
    )
    assert [o["output_ids"] for o in out] == single


def test_stream_sends_cumulative_sse_events_and_done(shared_server: EngineServer) -> None:
    body = {
        "text": "Hello",
        "stream": True,
        "sampling_params": {"max_new_tokens": 5, "temperature": 0.0},
    }
    events = shared_server.http.stream("/generate", body)
    assert events[-1] == b"data: [DONE]\n\n"
    frames = []
    for ev in events[:-1]:
        assert ev.startswith(b"data: ") and ev.endswith(b"\n\n") and ev.count(b"\n\n") == 1
        frames.append(json.loads(ev[len(b"data: ") : -2]))
    assert len(frames) == 5
    for i, f in enumerate(frames):
        assert set(f) == {"text", "output_ids", "meta_info"}
        assert len(f["output_ids"]) == i + 1  # cumulative, as SGLang streams by default
        assert f["meta_info"]["completion_tokens"] == i + 1
        assert (f["meta_info"]["finish_reason"] is None) == (i < 4)
    whole = shared_server.http.generate(
        "Hello", sampling_params={"max_new_tokens": 5, "temperature": 0.0}
    )
    assert frames[-1]["output_ids"] == whole["output_ids"]
    assert frames[-1]["text"] == whole["text"]


def test_rid_is_echoed_as_meta_info_id(shared_server: EngineServer) -> None:
    out = shared_server.http.generate(rid="my-request-1")
    assert out["meta_info"]["id"] == "my-request-1"
    assert out["meta_info"]["weight_version"] == "default"


def test_info_routes_describe_the_model(shared_server: EngineServer, tiny_model) -> None:
    for path in ("/model_info", "/get_model_info"):
        status, info = shared_server.http.get(path)
        assert status == 200
        assert info["model_path"] == str(tiny_model) and info["is_generation"] is True
        assert info["weight_version"] == "default"
    for path in ("/server_info", "/get_server_info"):
        status, info = shared_server.http.get(path)
        assert status == 200 and info["served_model_name"] == "tiny"
        assert info["memory"]["resident_param_bytes"] == info["memory"]["param_bytes"] > 0
    status, models = shared_server.http.get("/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == ["tiny"]
    assert shared_server.http.get("/health")[0] == 200
    assert shared_server.http.get("/health_generate")[0] == 200


def test_a_request_arriving_during_a_long_generation_is_admitted_at_once(
    shared_server: EngineServer,
) -> None:
    """The compute thread decodes on without handing back to the scheduler loop while nothing
    waits for it: an arrival must still end that run at the next step."""
    long_params = {"max_new_tokens": 2000, "temperature": 0.0, "ignore_eos": True}
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(shared_server.http.generate, "Once", sampling_params=long_params)
        # Sent once the long one is decoding.
        deadline = time.monotonic() + 60
        while not shared_server.http.ok("/server_info")["internal_states"][0]["num_running_reqs"]:
            assert time.monotonic() < deadline and not long.done()
        short = shared_server.http.generate("Hi", sampling_params={"max_new_tokens": 4})
        assert len(short["output_ids"]) == 4
        assert not long.done()  # the short one was served while the long one ran
        assert len(long.result(timeout=120)["output_ids"]) == 2000


def test_the_scheduler_runs_count_the_hand_overs_of_a_run_of_decode_steps(
    shared_server: EngineServer,
) -> None:
    # One request alone: its decode steps run on, handing over to the scheduler loop only
    # when RUN_ON_SECONDS have passed (or it ends): at most one run per RUN_ON_SECONDS of the
    # compute thread's steps, and the prefill's, whatever this machine's speed.
    from relax_hf.engine import RUN_ON_SECONDS

    def counters() -> tuple[int, int, float]:
        info = shared_server.http.ok("/server_info")
        return info["scheduler_runs_total"], info["decode_steps_total"], info["step_seconds_total"]

    runs, steps, seconds = counters()
    params = {"max_new_tokens": 64, "temperature": 0.0, "ignore_eos": True}
    assert len(shared_server.http.generate("Once", sampling_params=params)["output_ids"]) == 64
    runs_after, steps_after, seconds_after = counters()
    assert steps_after - steps == 63  # the first token comes from the prefill
    assert 1 <= runs_after - runs <= (seconds_after - seconds) / RUN_ON_SECONDS + 2
