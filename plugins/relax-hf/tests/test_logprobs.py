"""Log-probs in SGLang's shapes, checked against a direct forward pass of the same checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from relax_hf.testing import EngineServer

TOP_K = 5


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> Any:
    """log_softmax of a direct transformers forward pass, per position (float64)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()

    def run(ids: list[int]) -> Any:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)

    run.tokenizer = tok  # type: ignore[attr-defined]
    return run


def _teacher_body(prompt: list[int], response: list[int], **extra: Any) -> dict[str, Any]:
    return {
        "input_ids": prompt + response,
        "sampling_params": {"temperature": 0, "max_new_tokens": 0, "skip_special_tokens": False},
        "return_logprob": True,
        "logprob_start_len": max(len(prompt) - 1, 0),
        "top_logprobs_num": TOP_K,
        **extra,
    }


def test_teacher_prefill_logprobs_equal_a_direct_forward_pass(
    shared_server: EngineServer, reference: Any
) -> None:
    tok = reference.tokenizer
    prompt = tok("Question: what is the capital of France?", add_special_tokens=False)["input_ids"]
    response = tok(" Answer: the capital of France is Paris.", add_special_tokens=False)[
        "input_ids"
    ]
    out = shared_server.http.ok("/generate", _teacher_body(prompt, response))
    meta = out["meta_info"]
    ref = reference(prompt + response)

    tokens = meta["input_token_logprobs"]
    assert len(tokens) == len(response) + 1  # the check a teacher client makes
    assert tokens[0][0] is None and tokens[0][1] == prompt[-1]  # no logprob without context
    for k, (lp, tid, text) in enumerate(tokens[1:]):
        pos = len(prompt) + k  # token at pos is predicted by the logits at pos - 1
        assert tid == response[k] and text is None
        assert lp == pytest.approx(float(ref[pos - 1, tid]), abs=1e-4)

    tops = meta["input_top_logprobs"]
    assert len(tops) == len(tokens) and tops[0] is None
    for k, top in enumerate(tops[1:]):
        pos = len(prompt) + k
        vals, ids = ref[pos - 1].topk(TOP_K)
        assert [t[1] for t in top] == ids.tolist()
        assert [t[0] for t in top] == pytest.approx(vals.tolist(), abs=1e-4)
    assert meta["output_token_logprobs"] == [] and out["output_ids"] == []


def test_token_ids_logprob_scores_the_given_ids_at_every_position(
    shared_server: EngineServer, reference: Any
) -> None:
    ids = reference.tokenizer("Hello world, how are you?", add_special_tokens=False)["input_ids"]
    wanted = [5, 17, 300]
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": 2},
        "return_logprob": True,
        "logprob_start_len": 0,
        "token_ids_logprob": wanted,
    }
    meta = shared_server.http.ok("/generate", body)["meta_info"]
    ref = reference(ids)
    per_pos = meta["input_token_ids_logprobs"]
    assert len(per_pos) == len(ids) and per_pos[0] is None
    for j, entries in enumerate(per_pos[1:], start=1):
        assert [e[1] for e in entries] == wanted
        assert [e[0] for e in entries] == pytest.approx(
            [float(ref[j - 1, t]) for t in wanted], abs=1e-4
        )
    assert len(meta["output_token_ids_logprobs"]) == 2
    assert "input_top_logprobs" not in meta  # only asked for when top_logprobs_num > 0


def test_output_logprobs_are_the_greedy_tokens_logprobs(
    shared_server: EngineServer, reference: Any
) -> None:
    ids = reference.tokenizer("Once upon a time", add_special_tokens=False)["input_ids"]
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True},
        "return_logprob": True,
        "top_logprobs_num": 3,
        "return_text_in_logprobs": True,
    }
    out = shared_server.http.ok("/generate", body)
    meta = out["meta_info"]
    assert len(meta["input_token_logprobs"]) == 1  # default start: the last prompt token only
    ref = reference(ids + out["output_ids"])
    for k, (lp, tid, text) in enumerate(meta["output_token_logprobs"]):
        assert tid == out["output_ids"][k] and isinstance(text, str)
        assert lp == pytest.approx(float(ref[len(ids) + k - 1, tid]), abs=1e-4)
        assert meta["output_top_logprobs"][k][0][1] == tid  # greedy picks the top token


def test_logprobs_in_a_batch_match_a_request_alone(
    shared_server: EngineServer, reference: Any
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    tok = reference.tokenizer
    prompts = [
        tok(t, add_special_tokens=False)["input_ids"]
        for t in ("a", "Hello there, long prompt here", "x y z")
    ]

    def one(p: list[int]) -> list[Any]:
        body = _teacher_body(p[:1], p[1:] or p)
        return shared_server.http.ok("/generate", body)["meta_info"]["input_token_logprobs"]

    alone = [one(p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(one, prompts))
    for a, b in zip(alone, together, strict=True):
        assert [t[1] for t in a] == [t[1] for t in b]
        assert [t[0] for t in a[1:]] == pytest.approx([t[0] for t in b[1:]], abs=1e-4)


def test_input_logprobs_of_a_long_prompt_never_hold_every_positions_logits(
    tiny_model: Path, reference: Any
) -> None:
    # A 50k-token prompt with full-vocabulary logits at every position is 10 GiB on a real
    # vocabulary: they are made a chunk of positions at a time, with the same values.
    from relax_hf.batch import INPUT_LOGPROB_CHUNK, Batch, Sequence
    from relax_hf.protocol import LogprobParams, SamplingParams
    from relax_hf.runner import ModelRunner

    runner = ModelRunner(str(tiny_model), max_total_tokens=4096)
    rows: list[int] = []
    logits = runner.logits

    def counted(hidden: Any) -> Any:
        rows.append(hidden.shape[0] if hidden.dim() == 2 else 1)
        return logits(hidden)

    runner.logits = counted  # type: ignore[method-assign]
    prompt = [(13 * i) % 500 + 5 for i in range(3 * INPUT_LOGPROB_CHUNK + 7)]
    seq = Sequence(
        rid="long",
        prompt_ids=prompt,
        sampling=SamplingParams(temperature=0.0, max_new_tokens=0),
        logprob=LogprobParams(return_logprob=True, logprob_start_len=0, top_logprobs_num=2),
    )
    Batch(runner).step([seq])
    assert max(rows) <= INPUT_LOGPROB_CHUNK
    assert seq.input_token_logprobs is not None and seq.input_top_logprobs is not None
    assert len(seq.input_token_logprobs) == len(prompt)
    ref = reference(prompt)
    for t in (1, INPUT_LOGPROB_CHUNK, INPUT_LOGPROB_CHUNK + 1, len(prompt) - 1):
        assert seq.input_token_logprobs[t][0] == pytest.approx(
            float(ref[t - 1, prompt[t]]), abs=1e-3
        )


def test_sampled_tokens_logprobs_come_from_the_forward_passes_draw(
    tiny_model: Path, reference: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rollout's requests (sampled, return_logprob): each decode step keeps the token the forward
    # pass drew and reads its log-prob, with no second draw; the tokens are those of the same
    # request without log-probs, the log-probs those of the temperature-scaled distribution.
    import relax_hf.batch as batch_module
    import torch
    from relax_hf.batch import Batch, Sequence
    from relax_hf.protocol import LogprobParams, SamplingParams
    from relax_hf.runner import ModelRunner

    runner = ModelRunner(str(tiny_model), max_total_tokens=1024)
    draws = []
    real_draw = batch_module.draw

    def counted(z: Any, rows: Any) -> Any:
        draws.append(len(rows))
        return real_draw(z, rows)

    monkeypatch.setattr(batch_module, "draw", counted)
    prompt, temperature = [5, 17, 33, 8], 0.7

    def generate(return_logprob: bool) -> list[Sequence]:
        batch = Batch(runner)
        seqs = [
            Sequence(
                rid=f"r{i}",
                prompt_ids=prompt,
                sampling=SamplingParams(temperature=temperature, max_new_tokens=6, ignore_eos=True),
                logprob=LogprobParams(return_logprob=return_logprob),
                seed=100 + i,
            )
            for i in range(3)
        ]
        batch.step(seqs)
        draws.clear()
        while len(batch):
            batch.step([])
        return seqs

    plain = generate(False)
    scored = generate(True)
    assert draws == []  # every decode step took the forward pass's tokens
    for a, b in zip(plain, scored, strict=True):
        assert a.output_ids == b.output_ids and len(b.output_token_logprobs) == 6
        logits = torch.log_softmax(reference(prompt + b.output_ids).float(), -1)  # as logits
        scaled = torch.log_softmax(logits / temperature, -1)
        for k, (lp, tid, _) in enumerate(b.output_token_logprobs):
            assert tid == b.output_ids[k]
            assert lp == pytest.approx(float(scaled[len(prompt) + k - 1, tid]), abs=1e-4)
