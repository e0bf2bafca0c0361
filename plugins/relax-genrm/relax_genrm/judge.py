"""The ``genrm-judge`` reward adapter: ask the genrm gateway for a verdict, turn it into a reward.

The judge is reached over HTTP through the genrm role gateway (``POST {url}/genrm/generate`` with
``messages``), so it works the same from a trainer process, a deferred scoring stage or a
notebook. The verdict parser reads the judge's last ``score: X`` (a number in [0, 1]) or, failing
that, its last ``yes``/``no`` / ``correct``/``incorrect`` word.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import aiohttp

from relax_core import UpstreamError

__all__ = ["JudgeClient", "judge_reward", "parse_verdict", "render_judge_messages"]

_SCORE = re.compile(r"score\s*[:=]\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
_WORD = re.compile(r"\b(yes|no|correct|incorrect|right|wrong)\b", re.IGNORECASE)
_POSITIVE = frozenset({"yes", "correct", "right"})

JUDGE_SYSTEM_PROMPT = (
    "You are a strict judge. Read the question, the reference answer and the response. "
    "Reply with a short reason and end with 'score: 1' if the response is correct, else 'score: 0'."
)


def render_judge_messages(
    question: str, response: str, reference: str | None = None
) -> list[dict[str, str]]:
    """The judge conversation for one sample (system prompt, then one user turn)."""
    parts = [f"Question:\n{question}", f"Response:\n{response}"]
    if reference is not None:
        parts.insert(1, f"Reference answer:\n{reference}")
    return [
        {"role": "system", "content": JUDGE_SYSTEM_PROMPT},
        {"role": "user", "content": "\n\n".join(parts)},
    ]


def parse_verdict(text: str, *, default: float = 0.0) -> float:
    """A reward in [0, 1] from a judge's text; ``default`` when it holds no verdict.

    The last ``score: X`` wins (clamped to [0, 1]); otherwise the last yes/no-like word.
    """
    scores = _SCORE.findall(text)
    if scores:
        return min(1.0, max(0.0, float(scores[-1])))
    words = _WORD.findall(text)
    if words:
        return 1.0 if words[-1].lower() in _POSITIVE else 0.0
    return default


class JudgeClient:
    """Sends judge conversations to a genrm gateway. Reuses one aiohttp session; close it.

    :param gateway_url: the genrm gateway's base URL (``http://host:port``).
    :param token: the gateway's bearer token, if it has one.
    """

    def __init__(
        self, gateway_url: str, *, token: str | None = None, timeout: float = 120.0
    ) -> None:
        self.url = gateway_url.rstrip("/") + "/genrm/generate"
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None

    async def judge(
        self,
        messages: list[dict[str, Any]],
        *,
        model: str | None = None,
        route_key: str | None = None,
        sampling_params: Mapping[str, Any] | None = None,
    ) -> str:
        """The judge's text for ``messages``.

        :raises UpstreamError: the gateway answered an error (its status and message are kept).
        """
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        body: dict[str, Any] = {
            "messages": messages,
            "sampling_params": dict(sampling_params or {"temperature": 0.0, "max_new_tokens": 64}),
        }
        if model is not None:
            body["model"] = model
        if route_key is not None:
            body["route_key"] = route_key
        async with self._session.post(self.url, json=body, headers=self._headers) as resp:
            payload = await resp.json(content_type=None)
            if resp.status != 200 or not isinstance(payload, dict) or "response" not in payload:
                message = payload.get("message") if isinstance(payload, dict) else payload
                raise UpstreamError(
                    resp.status if resp.status >= 500 else 502,
                    f"genrm gateway {self.url} answered {resp.status}: {message}",
                )
            return str(payload["response"])

    async def close(self) -> None:
        """Close the HTTP session (idempotent)."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> JudgeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def judge_reward(
    sample: Mapping[str, Any],
    *,
    client: JudgeClient,
    model: str | None = None,
    route_key: str | None = None,
) -> float:
    """The reward of one sample: ``sample`` has ``prompt``, ``response`` and optional ``label``.

    Async and side-effect free apart from the HTTP call, so a deferred scoring stage can run it
    over a staged batch (``supports_deferred=True``).
    """
    for key in ("prompt", "response"):
        if not isinstance(sample.get(key), str):
            raise ValueError(f"genrm-judge: sample[{key!r}] must be a string")
    label = sample.get("label")
    messages = render_judge_messages(
        sample["prompt"], sample["response"], label if isinstance(label, str) else None
    )
    text = await client.judge(messages, model=model, route_key=route_key)
    return parse_verdict(text)
