"""``n`` samples of one prompt: one prefill shared by the samples, SGLang's answer shapes."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from relax_hf.testing import EngineServer

SAMPLED = {"max_new_tokens": 10, "temperature": 1.0, "ignore_eos": True}


def _prefills(server: EngineServer) -> tuple[int, int]:
    info = server.http.ok("/server_info")
    return info["prefill_sequences_total"], info["prefill_tokens_total"]


def test_n_samples_answer_a_list_and_prefill_the_prompt_once(
    shared_server: EngineServer,
) -> None:
    server = shared_server  # tests run one at a time: the counters move for this request only
    body = {"input_ids": [5, 6, 7, 8, 9, 10, 11], "sampling_params": {**SAMPLED, "n": 4}}
    server.http.ok("/flush_cache")  # no earlier test's prompt in the prefix cache
    before = _prefills(server)
    out = server.http.ok("/generate", body)
    after = _prefills(server)
    assert isinstance(out, list) and len(out) == 4
    assert after[0] - before[0] == 1  # one prefill forward row for the four samples
    assert after[1] - before[1] == 7  # the prompt's tokens, once
    assert len({tuple(o["output_ids"]) for o in out}) == 4  # the samples differ
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [7] * 4
    assert [o["meta_info"]["cached_tokens"] for o in out] == [0, 7, 7, 7]
    assert all(o["meta_info"]["completion_tokens"] == 10 for o in out)


def test_seeded_samples_reproduce_and_match_a_single_request(shared_server: EngineServer) -> None:
    body = {"text": "Hello", "sampling_params": {**SAMPLED, "n": 3, "sampling_seed": 11}}
    a = [o["output_ids"] for o in shared_server.http.ok("/generate", body)]
    b = [o["output_ids"] for o in shared_server.http.ok("/generate", body)]
    assert a == b
    alone = shared_server.http.generate("Hello", sampling_params={**SAMPLED, "sampling_seed": 11})[
        "output_ids"
    ]
    assert a[0] == alone  # sample 0 keeps the request's seed


def test_seeded_samples_do_not_depend_on_other_requests_in_the_batch(
    shared_server: EngineServer,
) -> None:
    body = {"text": "The sea", "sampling_params": {**SAMPLED, "n": 2, "sampling_seed": 4}}
    alone = [o["output_ids"] for o in shared_server.http.ok("/generate", body)]

    def noise(i: int) -> Any:
        return shared_server.http.generate(
            f"noise {i}", sampling_params={"max_new_tokens": 6 + i, "temperature": 0.7}
        )

    with ThreadPoolExecutor(5) as pool:
        futures = [pool.submit(noise, i) for i in range(4)]
        together = [o["output_ids"] for o in shared_server.http.ok("/generate", body)]
        for f in futures:
            f.result()
    assert together == alone


def test_a_batch_with_n_is_ordered_prompt_by_prompt(shared_server: EngineServer) -> None:
    greedy = {"max_new_tokens": 4, "temperature": 0.0}
    out = shared_server.http.ok(
        "/generate", {"text": ["a", "bb"], "sampling_params": {**greedy, "n": 2}}
    )
    singles = [shared_server.http.generate(t, sampling_params=greedy)["output_ids"] for t in "ab"]
    singles[1] = shared_server.http.generate("bb", sampling_params=greedy)["output_ids"]
    assert [o["output_ids"] for o in out] == [singles[0], singles[0], singles[1], singles[1]]


def test_streaming_n_samples_tags_each_event_with_its_index(shared_server: EngineServer) -> None:
    body = {"text": "Hi", "stream": True, "sampling_params": {**SAMPLED, "n": 3}}
    events = shared_server.http.stream("/generate", body)
    assert events[-1] == b"data: [DONE]\n\n"
    frames = [json.loads(e[len(b"data: ") : -2]) for e in events[:-1]]
    last: dict[int, dict[str, Any]] = {}
    for f in frames:
        last[f["index"]] = f
    assert sorted(last) == [0, 1, 2]
    assert all(len(f["output_ids"]) == 10 for f in last.values())
    assert all(f["meta_info"]["finish_reason"] is not None for f in last.values())


def test_aborting_the_request_rid_aborts_every_sample(
    shared_server: EngineServer,
) -> None:
    long = {"max_new_tokens": 2000, "temperature": 1.0, "ignore_eos": True, "n": 2}
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(
            shared_server.http.ok, "/generate", {"text": "x", "rid": "grp", "sampling_params": long}
        )
        deadline = time.monotonic() + 30
        while shared_server.http.ok("/server_info")["num_running_reqs"] < 2:  # both run
            assert time.monotonic() < deadline, "the two samples never ran"
            time.sleep(0.01)
        assert shared_server.http.ok("/abort_request", {"rid": "grp"})["found"] is True
        out = fut.result(timeout=60)
    assert [o["meta_info"]["id"] for o in out] == ["grp-0", "grp-1"]
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in out)
