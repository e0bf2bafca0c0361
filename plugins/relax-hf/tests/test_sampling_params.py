"""Every SGLang sampling parameter, against the pinned SGLang's list and its documented effect."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

from relax_hf.protocol import SGLANG_INTERNAL_SAMPLING_FIELDS, SGLANG_VERSION
from relax_hf.protocol import sampling_param_names as our_names
from relax_hf.testing import EngineServer

PROMPT = "Once upon a time"
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def _sglang_sampling_fields() -> tuple[list[str], list[str]]:
    """(API fields, internal fields) of the installed SGLang's ``SamplingParams``.

    Read from the source with ``ast``: importing ``sglang`` runs its package ``__init__``, which
    pulls the GPU runtime (triton, CUDA kernels) that this CPU-only test session does not
    install. The class marks where the internal fields start with a comment.
    """
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations, (
        "sglang is not installed: the test session installs it with --no-deps (see noxfile.py)"
    )
    path = Path(next(iter(spec.submodule_search_locations))) / "srt/sampling/sampling_params.py"
    source = path.read_text()
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SamplingParams")
    lines = source.splitlines()
    internal_from = next(
        i + 1
        for i in range(cls.lineno, cls.end_lineno or len(lines))
        if re.match(r"\s*# --- Internal fields", lines[i])
    )
    api, internal = [], []
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            (internal if node.lineno > internal_from else api).append(node.target.id)
    return api, internal


def test_the_pinned_sglang_version_is_installed() -> None:
    assert importlib.metadata.version("sglang") == SGLANG_VERSION


def test_our_sampling_parameters_are_sglangs() -> None:
    api, internal = _sglang_sampling_fields()
    assert list(our_names()) == api, (
        "SGLang's SamplingParams changed: missing here "
        f"{sorted(set(api) - set(our_names()))}, gone there {sorted(set(our_names()) - set(api))}"
    )
    assert list(SGLANG_INTERNAL_SAMPLING_FIELDS) == internal


def gen(server: EngineServer, text: str = PROMPT, **sp: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"text": text, "sampling_params": sp}
    return server.http.ok("/generate", body)  # type: ignore[no-any-return]


def gen_lp(server: EngineServer, ids: list[int], **sp: Any) -> dict[str, Any]:
    body = {
        "text": PROMPT,
        "sampling_params": sp,
        "return_logprob": True,
        "token_ids_logprob": ids,
    }
    return server.http.ok("/generate", body)  # type: ignore[no-any-return]


def _first_token(server: EngineServer) -> int:
    return int(gen(server, max_new_tokens=1, **GREEDY)["output_ids"][0])


def test_each_penalty_lowers_the_repeated_tokens_probability(shared_server: EngineServer) -> None:
    t0 = _first_token(shared_server)
    free = gen_lp(shared_server, [t0], max_new_tokens=3, **GREEDY)["meta_info"]
    for penalty in (
        {"frequency_penalty": 1.5},
        {"presence_penalty": 1.5},
        {"repetition_penalty": 1.8},
    ):
        pen = gen_lp(shared_server, [t0], max_new_tokens=3, **GREEDY, **penalty)["meta_info"]
        before = [e[0][0] for e in free["output_token_ids_logprobs"]]
        after = [e[0][0] for e in pen["output_token_ids_logprobs"]]
        assert after[0] == before[0], penalty  # nothing generated yet: no penalty
        assert after[1] < before[1] - 0.1, (penalty, before, after)


def test_frequency_penalty_grows_with_each_repetition(shared_server: EngineServer) -> None:
    # A +100 logit bias makes every output the same token: the frequency penalty (count x
    # penalty) then grows by the same step each time, the presence penalty (0/1) does not.
    t = 100
    base = {"max_new_tokens": 4, "logit_bias": {str(t): 100.0}, **GREEDY}
    raw = gen_lp(shared_server, [t], **base)["meta_info"]["output_token_ids_logprobs"]
    freq = gen_lp(shared_server, [t], frequency_penalty=0.5, **base)["meta_info"]
    pres = gen_lp(shared_server, [t], presence_penalty=0.5, **base)["meta_info"]
    raw_v = [e[0][0] for e in raw]
    freq_v = [e[0][0] for e in freq["output_token_ids_logprobs"]]
    pres_v = [e[0][0] for e in pres["output_token_ids_logprobs"]]
    assert freq["output_token_logprobs"][0][1] == t
    # Near-certain tokens: the log-prob barely moves, but the logit offsets are exact, so
    # compare the differences' signs: later repetitions are penalised more under frequency.
    assert freq_v[1] <= raw_v[1] and freq_v[3] <= freq_v[2] <= freq_v[1]
    assert pres_v[1] <= raw_v[1]


def test_logit_bias_of_minus_100_bans_a_token(shared_server: EngineServer) -> None:
    t0 = _first_token(shared_server)
    sampled = {"max_new_tokens": 48, "temperature": 1.0, "sampling_seed": 3, "ignore_eos": True}
    banned = gen(shared_server, logit_bias={str(t0): -100.0}, **sampled)
    assert t0 not in banned["output_ids"]
    greedy = gen(shared_server, max_new_tokens=4, logit_bias={str(t0): -100.0}, **GREEDY)
    assert greedy["output_ids"][0] != t0


def test_logit_bias_of_plus_100_forces_a_token(shared_server: EngineServer) -> None:
    out = gen(shared_server, max_new_tokens=5, logit_bias={"77": 100.0}, temperature=1.0)
    assert out["output_ids"] == [77] * 5


def test_stop_regex_stops_where_the_pattern_first_matches(
    shared_server: EngineServer, tiny_model: Path
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    free = gen(shared_server, max_new_tokens=24, **GREEDY)
    ids = free["output_ids"]
    # A two-character piece of the greedy text that first appears after a few characters.
    text = free["text"]
    piece = next(
        text[i : i + 2]
        for i in range(3, len(text) - 2)
        if text[i : i + 2].isalnum() and text.find(text[i : i + 2]) == i
    )
    pattern = re.escape(piece[0]) + "[" + re.escape(piece[1]) + "]"
    out = gen(shared_server, max_new_tokens=24, stop_regex=pattern, **GREEDY)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    n = len(out["output_ids"])
    assert out["output_ids"] == ids[:n] and n < len(ids)
    assert re.search(pattern, tok.decode(ids[:n]))
    assert not re.search(pattern, tok.decode(ids[: n - 1]))  # it stopped at the first match
    assert re.search(pattern, out["text"])  # SGLang keeps a regex match in the text


def test_stop_strings_can_be_kept_with_no_stop_trim(shared_server: EngineServer) -> None:
    free = gen(shared_server, max_new_tokens=16, **GREEDY)["text"]
    stop = free[4:6]
    trimmed = gen(shared_server, max_new_tokens=16, stop=stop, **GREEDY)
    kept = gen(shared_server, max_new_tokens=16, stop=stop, no_stop_trim=True, **GREEDY)
    assert trimmed["text"] == free[: free.find(stop)]
    assert kept["text"] == free[: free.find(stop) + len(stop)]


def test_min_new_tokens_holds_back_stop_tokens(shared_server: EngineServer) -> None:
    t0 = _first_token(shared_server)
    free = gen(shared_server, max_new_tokens=8, temperature=0.0, stop_token_ids=[t0])
    assert free["output_ids"] == [t0]
    held = gen(
        shared_server, max_new_tokens=8, temperature=0.0, stop_token_ids=[t0], min_new_tokens=3
    )
    assert len(held["output_ids"]) >= 3 and t0 not in held["output_ids"][:3]


def test_ignore_eos_also_ignores_stop_token_ids_as_in_sglang(shared_server: EngineServer) -> None:
    t0 = _first_token(shared_server)
    out = gen(
        shared_server, max_new_tokens=4, temperature=0.0, stop_token_ids=[t0], ignore_eos=True
    )
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 4}


def test_sampling_seed_reproduces_and_top_k_one_is_greedy(shared_server: EngineServer) -> None:
    sampled = {"max_new_tokens": 16, "temperature": 1.3, "ignore_eos": True}
    a = gen(shared_server, sampling_seed=-42, **sampled)["output_ids"]
    assert gen(shared_server, sampling_seed=-42, **sampled)["output_ids"] == a
    assert gen(shared_server, sampling_seed=43, **sampled)["output_ids"] != a
    greedy = gen(shared_server, max_new_tokens=16, **GREEDY)["output_ids"]
    assert gen(shared_server, top_k=1, **sampled)["output_ids"] == greedy
    assert gen(shared_server, min_p=1.0, sampling_seed=1, **sampled)["output_ids"] == greedy
    assert gen(shared_server, top_p=1e-6, sampling_seed=1, **sampled)["output_ids"] == greedy


def test_top_k_keeps_every_token_among_the_k_most_likely(shared_server: EngineServer) -> None:
    body = {
        "text": PROMPT,
        "sampling_params": {
            "max_new_tokens": 12,
            "temperature": 2.0,
            "top_k": 3,
            "sampling_seed": 5,
            "ignore_eos": True,
        },
        "return_logprob": True,
        "top_logprobs_num": 3,
    }
    meta = shared_server.http.ok("/generate", body)["meta_info"]
    for (_, tok, _), top in zip(
        meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True
    ):
        assert tok in [t for _, t, _ in top]


def test_special_tokens_are_kept_in_the_text_when_asked(shared_server: EngineServer) -> None:
    forced = {"max_new_tokens": 6, "logit_bias": {"1": 100.0}, **GREEDY}
    out = gen(shared_server, skip_special_tokens=False, **forced)
    assert out["output_ids"] == [1] * 6
    assert out["text"] == "<|im_start|>" * 6
    assert gen(shared_server, **forced)["text"] == ""


def test_stream_interval_sends_every_kth_token(shared_server: EngineServer) -> None:
    body = {
        "text": PROMPT,
        "stream": True,
        "sampling_params": {"max_new_tokens": 10, "stream_interval": 4, **GREEDY},
    }
    events = shared_server.http.stream("/generate", body)
    frames = [json.loads(e[len(b"data: ") : -2]) for e in events[:-1]]
    assert [len(f["output_ids"]) for f in frames] == [4, 8, 10]


def test_custom_params_are_accepted(shared_server: EngineServer) -> None:
    out = gen(shared_server, max_new_tokens=2, custom_params={"k": [1, 2], "s": "x"}, **GREEDY)
    assert len(out["output_ids"]) == 2
