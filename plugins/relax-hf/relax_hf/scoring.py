"""SGLang's scoring API, ``POST /v1/score``: how likely each label token is after query + item.

For every item the engine prefills ``query + item`` (``item + query`` with ``item_first``;
text is joined as text and tokenized as ``/generate`` tokenizes it, token ids are joined as
ids) and reads the next-token log-probabilities of the item's ``label_token_ids`` at the last
position. ``scores`` has one row per item: the probabilities of the labels
(``exp(logprob)``), or with ``apply_softmax`` their softmax (over the labels only, at
``temperature``). With ``return_token_logprobs`` the raw log-probs come back too. The items
share the query's prefill through the prefix cache.

Refused with 400, as this engine serves causal LMs only: ``return_pooled_hidden_states``
(needs a model with a task head), embedding overrides, and the setwise readout
(``score_extraction_token``).
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from relax_hf.engine import Engine
from relax_hf.protocol import BadRequest, LogprobParams, SamplingParams
from relax_hf.wire import encode_prompt, engine_of, read_json

__all__ = ["score"]

_REFUSED = {
    "return_pooled_hidden_states": "is not supported for CausalLM models: it needs a model "
    "with a task-specific head (SequenceClassification or RewardModel)",
    "score_extraction_token": "setwise scoring is not supported by the hf engine; score each "
    "set as its own item",
    "embed_override_token_id": "embedding overrides are not supported by the hf engine",
    "query_embed_overrides": "embedding overrides are not supported by the hf engine",
    "item_embed_overrides": "embedding overrides are not supported by the hf engine",
}


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def _prompts(engine: Engine, body: dict[str, Any]) -> list[list[int]]:
    query, items = body.get("query"), body.get("items")
    item_first = body.get("item_first", False)
    if not isinstance(item_first, bool):
        raise BadRequest("item_first", "must be true or false")
    if isinstance(items, str):
        items = [items]
    if not isinstance(items, list):
        raise BadRequest("items", "must be a string, a list of strings or a list of id lists")
    if all(isinstance(i, str) for i in items):
        if query is None:
            query = ""
        if not isinstance(query, str):
            raise BadRequest("query", "must be text when the items are text")
        texts = [f"{i}{query}" if item_first else f"{query}{i}" for i in items]
        return [encode_prompt(engine, t, f"items[{n}]") for n, t in enumerate(texts)]
    if all(_is_ids(i) for i in items):
        if query is None:
            query = []
        if not _is_ids(query):
            raise BadRequest("query", "must be a list of token ids when the items are ids")
        out = [i + query if item_first else query + i for i in items]
        vocab = engine.runner.vocab_size
        for n, ids in enumerate(out):
            if not ids:
                raise BadRequest(f"items[{n}]", "query and item are both empty")
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise BadRequest(
                    f"items[{n}]", f"token id {bad} is out of vocabulary (vocab size: {vocab})"
                )
        return out
    raise BadRequest("items", "must be all strings or all lists of token ids")


def _labels(engine: Engine, raw: Any, count: int) -> list[list[int]]:
    if raw is None:
        raise BadRequest(
            "label_token_ids", "label_token_ids is required for generation (CausalLM) models."
        )
    if not isinstance(raw, list) or not raw:
        raise BadRequest("label_token_ids", "label_token_ids must be a nonempty list")
    per_item = raw if isinstance(raw[0], list) else [raw] * count
    if len(per_item) != count:
        raise BadRequest("label_token_ids", "label_token_ids must have one list per item")
    vocab = engine.runner.vocab_size
    for labels in per_item:
        if not _is_ids(labels) or not labels or any(t < 0 for t in labels):
            raise BadRequest(
                "label_token_ids", "each item needs a nonempty list of nonnegative token ids"
            )
        if len(set(labels)) != len(labels):
            raise BadRequest("label_token_ids", "label_token_ids must not contain duplicate tokens")
        bad = next((t for t in labels if t >= vocab), None)
        if bad is not None:
            raise BadRequest(
                "label_token_ids",
                f"Token ID {bad} is out of vocabulary (vocab size: {vocab})",
            )
    return per_item


def _scores(logprobs: list[float], softmax: bool, temperature: float) -> list[float]:
    # SGLang's conversion: probabilities, or a softmax over the labels centred on the largest.
    if softmax:
        top = max(logprobs)
        weights = [math.exp((lp - top) / temperature) for lp in logprobs]
        total = sum(weights)
        return [w / total for w in weights]
    return [math.exp(lp) if lp != -math.inf else 0.0 for lp in logprobs]


async def score(request: Request) -> Response:
    """``POST /v1/score``."""
    engine = engine_of(request)
    body = await read_json(request)
    if not isinstance(body, dict):
        raise BadRequest("body", "must be a JSON object")
    for key, why in _REFUSED.items():
        if body.get(key) not in (None, False):
            raise BadRequest(key, why)
    softmax = body.get("apply_softmax", False)
    want_logprobs = body.get("return_token_logprobs", False)
    for key, value in (("apply_softmax", softmax), ("return_token_logprobs", want_logprobs)):
        if not isinstance(value, bool):
            raise BadRequest(key, "must be true or false")
    temperature = body.get("temperature", 1.0)
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, int | float)
        or not math.isfinite(temperature)
        or temperature <= 0
    ):
        raise BadRequest("temperature", "temperature must be finite and greater than zero")
    if temperature != 1.0 and not softmax:
        raise BadRequest("temperature", "temperature requires apply_softmax=True")
    if body.get("items") is None:
        raise BadRequest("items", "items must be provided")
    model = engine.served_model_name
    if not body["items"]:
        empty: dict[str, Any] = {"scores": [], "model": model, "object": "scoring"}
        return JSONResponse({**empty, "token_logprobs": [] if want_logprobs else None})
    prompts = _prompts(engine, body)
    labels = _labels(engine, body.get("label_token_ids"), len(prompts))
    # One greedy token: its log-probs are the raw next-token distribution (temperature 1).
    sampling = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    outs = await asyncio.gather(
        *(
            engine.generate_one(
                ids, sampling, LogprobParams(return_logprob=True, token_ids_logprob=tuple(lab))
            )
            for ids, lab in zip(prompts, labels, strict=True)
        )
    )
    rows, raw = [], []
    for out, lab in zip(outs, labels, strict=True):
        by_id = {tid: lp for lp, tid, _ in out["meta_info"]["output_token_ids_logprobs"][0]}
        lps = [by_id[t] for t in lab]
        raw.append(lps)
        rows.append(_scores(lps, softmax, float(temperature)))
    prompt_tokens = sum(o["meta_info"]["prompt_tokens"] for o in outs)
    return JSONResponse(
        {
            "scores": rows,
            "pooled_hidden_states": None,
            "token_logprobs": raw if want_logprobs else None,
            "model": model,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": 0,
                "total_tokens": prompt_tokens,
            },
            "object": "scoring",
        }
    )
