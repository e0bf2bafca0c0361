"""The prefix cache: SGLang's ``cached_tokens`` (also in OpenAI's ``usage``), reuse across
requests, invalidation, bounds."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import torch
from relax_hf.kvcache import KVPool
from relax_hf.prefixcache import PrefixCache
from relax_hf.testing import EngineServer
from relax_hf.tiny import make_tiny_model

GREEDY = {"temperature": 0.0, "ignore_eos": True}
PREFIX = [(7 * i + 3) % 400 + 10 for i in range(100)]  # 100 token ids, no repeats nearby


@pytest.fixture(scope="module")
def cached(start_server: Any) -> EngineServer:
    """Started with SGLang's ``--enable-cache-report`` (it changes only the OpenAI routes'
    ``usage``); ``uncached`` is started without it."""
    return start_server("hf-prefix-cache", extra_args=("--enable-cache-report",))  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def uncached(start_server: Any) -> EngineServer:
    return start_server("hf-no-prefix-cache", extra_args=("--disable-radix-cache",))  # type: ignore[no-any-return]


@pytest.fixture
def server(cached: EngineServer) -> EngineServer:
    """The cached engine with an empty prefix cache."""
    cached.http.ok("/flush_cache")
    return cached


def _gen(server: EngineServer, ids: list[int], new: int = 8, **kw: Any) -> dict[str, Any]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": new, **GREEDY}, **kw}
    return server.http.ok("/generate", body)  # type: ignore[no-any-return]


def _cache(server: EngineServer) -> dict[str, Any]:
    return server.http.ok("/server_info")["prefix_cache"]  # type: ignore[no-any-return]


def test_a_second_request_reports_the_shared_prefix_as_cached_tokens(server: EngineServer) -> None:
    first = _gen(server, [*PREFIX, 1, 2, 3])
    assert first["meta_info"]["cached_tokens"] == 0
    second = _gen(server, [*PREFIX, 4, 5])
    assert second["meta_info"]["cached_tokens"] == len(PREFIX)
    assert second["meta_info"]["prompt_tokens"] == len(PREFIX) + 2


def test_a_repeated_prompt_reuses_all_but_its_last_token(server: EngineServer) -> None:
    # SGLang's bound: the last input token is always computed (its logits pick the next).
    prompt = [*PREFIX, 9]
    _gen(server, prompt)
    assert _gen(server, prompt)["meta_info"]["cached_tokens"] == len(prompt) - 1


def test_cached_tokens_are_not_prefilled_again(server: EngineServer) -> None:
    _gen(server, [*PREFIX, 1])
    before = server.http.ok("/server_info")["prefill_tokens_total"]
    out = _gen(server, [*PREFIX, 2, 3, 4])
    after = server.http.ok("/server_info")["prefill_tokens_total"]
    assert after - before == out["meta_info"]["prompt_tokens"] - out["meta_info"]["cached_tokens"]
    assert after - before == 3


def test_a_cached_prefill_gives_the_tokens_and_logprobs_of_a_full_one(
    server: EngineServer, uncached: EngineServer
) -> None:
    kw = {"return_logprob": True, "logprob_start_len": 90, "top_logprobs_num": 3}
    _gen(server, [*PREFIX, 1])
    for tail in ([2, 3], [4], [5, 6, 7, 8]):
        hit = _gen(server, [*PREFIX, *tail], 16, **kw)
        full = _gen(uncached, [*PREFIX, *tail], 16, **kw)
        assert hit["meta_info"]["cached_tokens"] == 90  # the match stops at logprob_start_len
        assert full["meta_info"]["cached_tokens"] == 0
        assert hit["output_ids"] == full["output_ids"]
        for key in ("input_token_logprobs", "output_token_logprobs"):
            a, b = hit["meta_info"][key], full["meta_info"][key]
            assert [e[1] for e in a] == [e[1] for e in b]
            assert [e[0] for e in a[1:]] == pytest.approx([e[0] for e in b[1:]], abs=1e-4)
        assert len(hit["meta_info"]["input_top_logprobs"]) == len(PREFIX) + len(tail) - 90


def test_a_conversation_turn_reuses_the_previous_turns_prompt_and_answer(
    server: EngineServer,
) -> None:
    turn1 = [*PREFIX[:40], 11, 12]
    out1 = _gen(server, turn1, 12)
    turn2 = [*turn1, *out1["output_ids"], 13, 14, 15]
    out2 = _gen(server, turn2, 4)
    # Everything but the last generated token (its KV is computed when it is fed next).
    assert out2["meta_info"]["cached_tokens"] == len(turn1) + len(out1["output_ids"]) - 1


def test_concurrent_requests_sharing_a_prompt_prefill_it_once(server: EngineServer) -> None:
    # Eight clients sending one long prompt at once (a group of samples as separate requests):
    # the first is prefilled alone, the other seven reuse it (SGLang's in-batch prefix check).
    prompt = [*PREFIX, 21]
    before = server.http.ok("/server_info")["prefill_tokens_total"]
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda _: _gen(server, prompt, 4), range(8)))
    after = server.http.ok("/server_info")["prefill_tokens_total"]
    assert after - before < 2 * len(prompt)
    assert sorted(o["meta_info"]["cached_tokens"] for o in outs)[1:] == [len(prompt) - 1] * 7
    assert len({tuple(o["output_ids"]) for o in outs}) == 1


def test_prompts_sharing_a_cached_prefix_are_admitted_in_one_step(tiny_model: Path) -> None:
    # Judge prompts of one system prompt: the first is prefilled alone, then the cache holds
    # the shared prefix and the rest are taken together, not one a step (SGLang checks in-batch
    # prefixes only for prompts whose cached prefix is short).
    from relax_hf.engine import IN_BATCH_PREFIX_TOKENS, Engine
    from relax_hf.protocol import LogprobParams, SamplingParams
    from relax_hf.runner import ModelRunner

    engine = Engine(ModelRunner(str(tiny_model), max_total_tokens=4096), served_model_name="t")
    sampling = SamplingParams(temperature=0.0, max_new_tokens=4)
    for i in range(8):
        engine.submit([*PREFIX, 30 + i], sampling, LogprobParams())
    first = engine._admit()
    assert len(first) == 1
    engine._step(first)
    assert engine.runner.prefix_cache.cached(PREFIX) == len(PREFIX) > IN_BATCH_PREFIX_TOKENS
    rest = engine._admit()
    assert len(rest) == 7 and not engine._pending
    engine._step(rest)
    assert all(s.cached_tokens == len(PREFIX) for s in rest)


def _small_pool(context_len: int) -> KVPool:
    """A one-layer CPU pool of ``context_len + 1`` slots (slot 0 is the scratch slot)."""
    return KVPool(
        num_layers=1,
        kv_heads=1,
        head_dim=2,
        dtype=torch.float32,
        device=torch.device("cpu"),
        num_slots=context_len + 1,
        max_rows=2,
        context_len=context_len,
    )


def test_the_cached_prefix_length_is_read_without_changing_the_tree(tiny_model: Path) -> None:
    pool = _small_pool(16)
    cache = PrefixCache(pool)
    cache.insert(np.array([1, 2, 3, 4, 5, 6]), pool.alloc_slots(6))
    keys = ([1, 2, 3], [1, 2, 3, 4, 5, 6, 7], [1, 2, 9], [2], [])
    assert [cache.cached(k) for k in keys] == [3, 6, 2, 0, 0]
    assert cache.nodes == 1 and cache.root.children[1].last_access == 1  # no split, no touch
    assert PrefixCache(pool, enabled=False).cached([1, 2]) == 0


def test_the_hit_rate_is_reported_in_server_info_and_metrics(server: EngineServer) -> None:
    _gen(server, [*PREFIX, 1])
    _gen(server, [*PREFIX, 2])
    cache = _cache(server)
    assert cache["enabled"] is True and cache["tokens"] >= len(PREFIX)
    assert 0 < cache["hit_rate"] < 1
    assert cache["hit_rate"] == pytest.approx(
        cache["cached_tokens_total"] / cache["prompt_tokens_total"]
    )
    info = server.http.ok("/server_info")
    assert info["internal_states"][0]["cache_hit_rate"] == cache["hit_rate"]
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    values = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert values["sglang:cache_hit_rate"] == pytest.approx(cache["hit_rate"], abs=1e-6)
    assert values["sglang:cached_tokens_total"] == cache["cached_tokens_total"]
    assert values["relax_hf:prefix_cache_tokens"] == cache["tokens"]


def test_flush_cache_empties_the_prefix_cache(server: EngineServer) -> None:
    prompt = [*PREFIX, 1]
    _gen(server, prompt)
    assert _cache(server)["tokens"] > 0
    server.http.ok("/flush_cache")
    cache = _cache(server)
    assert (cache["tokens"], cache["nodes"]) == (0, 0)
    assert _gen(server, prompt)["meta_info"]["cached_tokens"] == 0


def test_the_cache_can_be_disabled(uncached: EngineServer) -> None:
    _gen(uncached, [*PREFIX, 1])
    assert _gen(uncached, [*PREFIX, 1])["meta_info"]["cached_tokens"] == 0
    info = uncached.http.ok("/server_info")
    assert info["prefix_cache"]["enabled"] is False and info["prefix_cache"]["tokens"] == 0
    assert info["disable_radix_cache"] is True


# -- reported to OpenAI clients (--enable-cache-report) ---------------------------------------

SYSTEM = {"role": "system", "content": "You answer briefly and kindly. " * 12}


def _client(server: EngineServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _chat_ids(server: EngineServer, messages: list[dict[str, str]]) -> list[int]:
    return server.http.ok("/v1/tokenize", {"messages": messages})["tokens"]  # type: ignore[no-any-return]


def _stream_usage(**options: bool) -> dict[str, Any]:
    # continuous_usage_stats is SGLang's (and vLLM's) key: the openai client passes it through.
    return {"stream": True, "stream_options": options}


def test_chat_usage_reports_the_shared_prefix_as_cached_tokens(server: EngineServer) -> None:
    client = _client(server)
    first = [SYSTEM, {"role": "user", "content": "What is the sea?"}]
    second = [SYSTEM, {"role": "user", "content": "Who are you?"}]
    a = client.chat.completions.create(model="tiny", messages=first, max_tokens=4, temperature=0)  # type: ignore[arg-type]
    # With the flag SGLang reports the details even when nothing was cached.
    assert a.usage is not None and a.usage.prompt_tokens_details is not None
    assert a.usage.prompt_tokens_details.cached_tokens == 0
    b = client.chat.completions.create(model="tiny", messages=second, max_tokens=4, temperature=0)  # type: ignore[arg-type]
    ids_a, ids_b = _chat_ids(server, first), _chat_ids(server, second)
    shared = next(i for i, (x, y) in enumerate(zip(ids_a, ids_b, strict=False)) if x != y)
    assert shared > 50  # the system message and then some
    assert b.usage is not None and b.usage.prompt_tokens == len(ids_b)
    assert b.usage.prompt_tokens_details is not None
    assert b.usage.prompt_tokens_details.cached_tokens == shared


def test_a_streams_usage_chunks_report_cached_tokens(server: EngineServer) -> None:
    client = _client(server)
    client.completions.create(model="tiny", prompt=[*PREFIX, 1, 2], max_tokens=2, temperature=0)
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=[*PREFIX, 3],
            max_tokens=4,
            temperature=0,
            extra_body={"ignore_eos": True},
            **_stream_usage(include_usage=True, continuous_usage_stats=True),
        )
    )
    *body, last = chunks
    assert body and all(c.choices and c.usage is not None for c in body)
    for c in body:
        assert c.usage is not None and c.usage.prompt_tokens_details is not None
        assert c.usage.prompt_tokens_details.cached_tokens == len(PREFIX)
    assert last.choices == [] and last.usage is not None and last.usage.completion_tokens == 4
    assert last.usage.prompt_tokens_details is not None
    assert last.usage.prompt_tokens_details.cached_tokens == len(PREFIX)
    chat = list(
        client.chat.completions.create(
            model="tiny",
            messages=[SYSTEM, {"role": "user", "content": "Hi"}],
            max_tokens=3,
            temperature=0,
            **_stream_usage(include_usage=True),
        )
    )
    again = list(
        client.chat.completions.create(
            model="tiny",
            messages=[SYSTEM, {"role": "user", "content": "Bye"}],
            max_tokens=3,
            temperature=0,
            **_stream_usage(include_usage=True),
        )
    )
    for stream, hit in ((chat, False), (again, True)):
        usage = stream[-1].usage
        assert usage is not None and usage.prompt_tokens_details is not None
        assert (usage.prompt_tokens_details.cached_tokens > 50) is hit


def test_n_samples_count_their_prompts_cached_tokens_once(server: EngineServer) -> None:
    # The n samples of a prompt share its prefill: usage reads the prompt once (its first
    # sample), as SGLang's; each choice's own usage has its own cached_tokens.
    client = _client(server)
    client.completions.create(model="tiny", prompt=[*PREFIX, 1], max_tokens=2, temperature=0)
    prompt = [*PREFIX, 5, 6]
    sampled = {
        "model": "tiny",
        "n": 3,
        "max_tokens": 4,
        "temperature": 1.0,
        "seed": 3,
        "extra_body": {"ignore_eos": True},
    }
    out = client.completions.create(prompt=prompt, **sampled)
    assert out.usage is not None and out.usage.prompt_tokens == len(prompt)
    assert out.usage.completion_tokens == 12
    assert out.usage.prompt_tokens_details is not None
    assert out.usage.prompt_tokens_details.cached_tokens == len(PREFIX)
    prompt = [*PREFIX, 7, 8]
    chunks = list(
        client.completions.create(
            prompt=prompt,
            **sampled,
            **_stream_usage(include_usage=True, continuous_usage_stats=True),
        )
    )
    per_choice = {}
    for c in chunks[:-1]:
        assert c.usage is not None and c.usage.prompt_tokens_details is not None
        per_choice[c.choices[0].index] = c.usage.prompt_tokens_details.cached_tokens
    # Sample 0 prefilled what the cache lacked; samples 1 and 2 read its prefill whole.
    assert per_choice == {0: len(PREFIX), 1: len(prompt), 2: len(prompt)}
    whole = chunks[-1].usage
    assert whole is not None and whole.prompt_tokens_details is not None
    assert (whole.prompt_tokens, whole.prompt_tokens_details.cached_tokens) == (
        len(prompt),
        len(PREFIX),
    )


def test_usage_has_no_prompt_tokens_details_without_enable_cache_report(
    uncached: EngineServer,
) -> None:
    client = _client(uncached)
    out = client.completions.create(model="tiny", prompt=[*PREFIX, 1], max_tokens=2)
    assert out.usage is not None and out.usage.prompt_tokens_details is None
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=[SYSTEM, {"role": "user", "content": "Hi"}],
            max_tokens=2,
            **_stream_usage(include_usage=True, continuous_usage_stats=True),
        )
    )
    assert all(c.usage is not None and c.usage.prompt_tokens_details is None for c in chunks)


# -- weight versions --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def other_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny architecture with other random weights (seed 1)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-seed-1"), seed=1)


@pytest.fixture
def versions(server: EngineServer, tiny_model: Path) -> Iterator[EngineServer]:
    """The cached engine on the tiny model's weights (loaded back afterwards too)."""
    server.http.ok(
        "/update_weights_from_disk", {"model_path": str(tiny_model), "weight_version": "a"}
    )
    yield server
    server.http.ok(
        "/update_weights_from_disk", {"model_path": str(tiny_model), "weight_version": "a"}
    )


def test_a_cached_prefix_is_never_served_across_a_weight_update(
    versions: EngineServer, other_model: Path
) -> None:
    server = versions
    prompt = [*PREFIX, 1]
    old = _gen(server, prompt, 16)
    assert _gen(server, prompt, 16)["meta_info"]["cached_tokens"] == len(prompt) - 1
    # Even when the caller asks not to flush: KV of other weights is never valid.
    server.http.ok(
        "/update_weights_from_disk",
        {"model_path": str(other_model), "weight_version": "b", "flush_cache": False},
    )
    after = _gen(server, prompt, 16)
    assert after["meta_info"]["cached_tokens"] == 0
    assert after["meta_info"]["weight_version"] == "b"
    assert after["output_ids"] != old["output_ids"]
    server.http.ok("/flush_cache")
    fresh = _gen(server, prompt, 16)  # computed from scratch with the new weights
    assert fresh["meta_info"]["cached_tokens"] == 0 and fresh["output_ids"] == after["output_ids"]
    assert _gen(server, prompt, 16)["meta_info"]["cached_tokens"] == len(prompt) - 1


def test_a_tensor_update_invalidates_the_cache(versions: EngineServer) -> None:
    from relax_torch_weights import serialize_named_tensors

    server = versions
    prompt = [*PREFIX, 2]
    _gen(server, prompt)
    assert _cache(server)["tokens"] > 0
    weight = torch.full((128, 256), 0.01)  # layer 0's k_proj (2 kv heads of 64): every KV moves
    payload = serialize_named_tensors(
        [("model.layers.0.self_attn.k_proj.weight", weight)], load_format="safetensors"
    )
    body = {
        "serialized_named_tensors": [payload],
        "load_format": "safetensors",
        "flush_cache": False,
    }
    server.http.ok("/update_weights_from_tensor", body)
    assert _cache(server)["tokens"] == 0
    assert _gen(server, prompt)["meta_info"]["cached_tokens"] == 0


def test_a_request_running_across_a_weight_update_does_not_cache_its_kv(
    versions: EngineServer, other_model: Path
) -> None:
    server = versions
    prompt = [*PREFIX, 3]
    body = json.dumps(
        {
            "input_ids": prompt,
            "stream": True,
            "sampling_params": {"max_new_tokens": 1200, **GREEDY},
        }
    ).encode()
    req = urllib.request.Request(server.url + "/generate", data=body, method="POST")
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.readline().startswith(b"data: ")  # it runs (prompt inserted after prefill)
        server.http.ok(
            "/update_weights_from_disk", {"model_path": str(other_model), "weight_version": "c"}
        )
        events = [line for line in resp.read().split(b"\n\n") if line.startswith(b"data: {")]
    last = json.loads(events[-1][len(b"data: ") :])
    assert last["meta_info"]["weight_version"] == "c"  # it finished under the new weights
    assert last["meta_info"]["completion_tokens"] == 1200
    assert _cache(server)["tokens"] == 0  # neither its prompt nor its output were kept
    out = _gen(server, [*prompt, *last["output_ids"][:50]])
    assert out["meta_info"]["cached_tokens"] == 0


# -- memory -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small(start_server: Any) -> EngineServer:
    """An engine whose pool holds 512 tokens."""
    return start_server("hf-prefix-small", extra_args=("--max-total-tokens", "512"))  # type: ignore[no-any-return]


def test_memory_stays_bounded_under_a_stream_of_distinct_prefixes(small: EngineServer) -> None:
    rng = np.random.default_rng(0)
    for i in range(40):
        prompt = [10 + i] + [int(t) for t in rng.integers(10, 400, size=59)]  # distinct first
        out = _gen(small, prompt, 8)
        assert out["meta_info"]["cached_tokens"] == 0, i
        cache = _cache(small)
        assert cache["tokens"] <= 512 and cache["nodes"] <= cache["tokens"]
    info = small.http.ok("/server_info")
    kv, cache = info["memory"]["kv_cache"], info["prefix_cache"]
    assert cache["evicted_tokens_total"] > 0  # the oldest prefixes made room for new ones
    assert kv["free_slots"] + cache["tokens"] == 512  # no slot leaked
    assert cache["evictable_tokens"] == cache["tokens"]  # nothing running: nothing locked
    # A request that needs almost the whole pool still runs: eviction frees what it needs.
    big = _gen(small, [int(t) for t in rng.integers(10, 400, size=400)], 100)
    assert big["meta_info"]["completion_tokens"] == 100


def test_the_least_recently_used_prefix_is_evicted_first(tiny_model: Path) -> None:
    pool = _small_pool(32)
    cache = PrefixCache(pool)

    def add(key: list[int]) -> None:
        slots = pool.alloc_slots(len(key))
        cache.insert(np.array(key), slots)
        pool.free_slots_of(slots)  # the sequence is done: only the tree holds them

    add([1, 2, 3, 4, 5, 6, 7, 8])
    add([1, 2, 3, 4, 9, 9, 9, 9])  # shares 4 tokens: a split, three nodes
    add([5, 5, 5, 5, 5, 5, 5, 5])
    assert (cache.tokens, cache.nodes) == (20, 4)
    hit, _, node = cache.match(np.array([1, 2, 3, 4, 5, 6, 7, 8, 0]), limit=8)
    assert hit == 8
    cache.lock(node)
    assert cache.evictable_tokens == 20 - 8
    cache.evict(4)  # the oldest unlocked leaf: [9, 9, 9, 9] (the [5…] branch was used later)
    assert cache.match(np.array([1, 2, 3, 4, 9, 9]), limit=6)[0] == 4
    assert cache.match(np.array([5, 5, 5]), limit=3)[0] == 3
    freed = cache.evict(100)  # everything unlocked goes; the locked path stays
    assert freed == 8 and cache.tokens == 8 and cache.evictable_tokens == 0
    cache.unlock(node)
    cache.clear()
    assert pool.free_slots == 32 and cache.tokens == 0


#: A prompt longer than any prefill budget: every prompt starts with the same (BOS-like)
#: token, so the prefix cache matches one token and the prefill after the match runs the rest.
LONG_PROMPT = 20_000


def _peak_rss(pid: int) -> int:
    """The process's peak resident set size so far (``VmHWM``), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM in /proc/{pid}/status")


@pytest.fixture(scope="module")
def long_context(start_server: Any, tmp_path_factory: pytest.TempPathFactory) -> EngineServer:
    """The micro model (2 layers, 2 query heads on 1 KV head) with room for a 20k-token prompt."""
    model = make_tiny_model(tmp_path_factory.mktemp("micro-model"), seed=0, size="micro")
    room = str(LONG_PROMPT + 64)
    return start_server(  # type: ignore[no-any-return]
        "hf-long-context",
        model=model,
        extra_args=("--context-length", room, "--max-total-tokens", room),
    )


@pytest.mark.slow
@pytest.mark.timeout(600)  # two prefills of 50k tokens on a shared CPU
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/<pid>/status")
def test_input_logprobs_after_a_one_token_match_stay_bounded_in_memory(
    long_context: EngineServer,
) -> None:
    # The prefill after a cached prefix attends the context in chunks of queries: it never
    # holds a prompt x context mask or score matrix (at 20k tokens that grew it by 3.8 GiB).
    server = long_context
    rng = np.random.default_rng(1)
    first = 7
    prompt = [first] + [int(t) for t in rng.integers(10, 400, size=LONG_PROMPT - 1)]
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 0, **GREEDY},
        "return_logprob": True,
        "logprob_start_len": 1,  # a match of at most one token, as after a shared BOS
    }
    server.http.ok("/flush_cache")
    _gen(server, [first, 11, 12, 13], 2)  # the cache now holds the first token
    before = _peak_rss(server.process.pid)
    matched = server.http.ok("/generate", body, timeout=300)["meta_info"]
    grown = _peak_rss(server.process.pid) - before
    assert matched["cached_tokens"] == 1
    assert grown < 2**30, f"peak RSS grew by {grown / 2**30:.2f} GiB"

    server.http.ok("/flush_cache")
    full = server.http.ok("/generate", body, timeout=300)["meta_info"]
    assert full["cached_tokens"] == 0
    got, want = matched["input_token_logprobs"], full["input_token_logprobs"]
    assert len(got) == len(want) == LONG_PROMPT - 1
    assert [t for _, t, _ in got] == [t for _, t, _ in want]
    assert got[0][0] is None and want[0][0] is None
    np.testing.assert_allclose(
        [lp for lp, _, _ in got[1:]], [lp for lp, _, _ in want[1:]], rtol=1e-4, atol=1e-4
    )
