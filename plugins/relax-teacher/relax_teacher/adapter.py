"""The teacher gateway adapter: raw prefill, checked before it reaches an engine.

A prefill asks for input log-probs (``return_logprob``) from ``logprob_start_len`` on, and
optionally the top ``top_logprobs_num`` per position. A request that could never succeed is a
400 here rather than an engine error after a GPU forward pass.
"""

from __future__ import annotations

from typing import Any

from relax_core import AdaptContext, Adapted, InvalidRequestError, RoleAdapter

__all__ = ["TeacherAdapter"]


class TeacherAdapter(RoleAdapter):
    """Checks prefill fields; forwards the raw payload unchanged."""

    def adapt_generate(self, payload: dict[str, Any], ctx: AdaptContext) -> Adapted:
        wants_topk = payload.get("top_logprobs_num") not in (None, 0)
        ids = payload.get("token_ids_logprob")
        if (wants_topk or ids is not None) and payload.get("return_logprob") is not True:
            raise InvalidRequestError(
                "'top_logprobs_num' and 'token_ids_logprob' need 'return_logprob': true",
                field="return_logprob",
            )
        start = payload.get("logprob_start_len")
        prompt = payload.get("input_ids")
        if isinstance(start, int) and isinstance(prompt, list) and start >= len(prompt):
            raise InvalidRequestError(
                f"'logprob_start_len' ({start}) must be smaller than the number of input_ids "
                f"({len(prompt)}); use max(prompt_len - 1, 0)",
                field="logprob_start_len",
            )
        if ids is not None and not (
            isinstance(ids, list)
            and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**31 for i in ids)
        ):
            raise InvalidRequestError(
                "'token_ids_logprob' must be a list of token ids", field="token_ids_logprob"
            )
        return Adapted()
