"""The ``genrm-judge`` reward adapter: ask a genrm model for a verdict, turn it into a reward.

:func:`judge_reward` is the registered adapter (async, ``supports_deferred``): in a reward stage
it sends the judge conversation to the genrm role's engines through the scoring loop's shared
:class:`~relax_core.InferenceClient` (``context.client("genrm")``, OpenAI chat path, the
sample's route key picking the judge model) and returns a
:class:`~relax_core.coordination.RewardResult`; a judge answer without a verdict scores 0.0 and
is counted as a parse failure. A multi-turn trajectory is judged whole: the judge reads its
entire conversation (every policy turn and tool result), not only the last answer.
:class:`JudgeClient` and :func:`judge_sample` do the same through
a genrm *gateway* over HTTP (``POST {url}/genrm/generate`` with ``messages``), for code outside
a scoring stage. The verdict parser reads the judge's last ``score: X`` (a number in [0, 1]) or,
failing that, its last ``yes``/``no`` / ``correct``/``incorrect`` word.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

import aiohttp

from relax_core import (
    RewardContext,
    RewardResult,
    UpstreamError,
    UpstreamStatusError,
    UpstreamUnreachableError,
    quote_body,
)

__all__ = [
    "JUDGE_ROLE",
    "JudgeClient",
    "judge_reward",
    "judge_sample",
    "parse_verdict",
    "read_verdict",
    "render_judge_messages",
    "render_trajectory_judge_messages",
    "trajectory_messages",
]

#: The role the judge adapter calls.
JUDGE_ROLE = "genrm"
#: Sampling of a judge answer: greedy, short.
JUDGE_SAMPLING = {"temperature": 0.0, "max_new_tokens": 64}

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


TRAJECTORY_SYSTEM_PROMPT = (
    "You are a strict judge. Read the whole conversation between a user, an assistant and its "
    "tools, and the reference answer. Reply with a short reason and end with 'score: 1' if the "
    "assistant's final answer is correct, else 'score: 0'."
)


def trajectory_messages(sample: Any) -> list[dict[str, Any]] | None:
    """The whole conversation of a multi-turn trajectory (``metadata["trajectory"]
    ["messages"]``: the environment's first messages, every policy turn and every
    observation), or ``None`` for a single-turn sample."""
    metadata = getattr(sample, "metadata", None)
    trajectory = metadata.get("trajectory") if isinstance(metadata, Mapping) else None
    messages = trajectory.get("messages") if isinstance(trajectory, Mapping) else None
    if not isinstance(messages, list) or not messages:
        return None
    return [dict(m) for m in messages if isinstance(m, Mapping)]


def render_trajectory_judge_messages(
    conversation: list[dict[str, Any]], reference: str | None = None
) -> list[dict[str, str]]:
    """The judge conversation for a whole trajectory: the system prompt, then one user turn
    holding every message of ``conversation`` as ``[role]`` and its content, in order (the
    judge sees each turn and each tool result, not only the last answer), and the reference."""
    lines = [f"[{m.get('role', '?')}]\n{m.get('content', '')}" for m in conversation]
    parts = ["Conversation:\n" + "\n\n".join(lines)]
    if reference is not None:
        parts.append(f"Reference answer:\n{reference}")
    return [
        {"role": "system", "content": TRAJECTORY_SYSTEM_PROMPT},
        {"role": "user", "content": "\n\n".join(parts)},
    ]


def read_verdict(text: str) -> float | None:
    """A reward in [0, 1] from a judge's text, or ``None`` when it holds no verdict.

    The last ``score: X`` wins (clamped to [0, 1]); otherwise the last yes/no-like word.
    """
    scores = _SCORE.findall(text)
    if scores:
        return min(1.0, max(0.0, float(scores[-1])))
    words = _WORD.findall(text)
    if words:
        return 1.0 if words[-1].lower() in _POSITIVE else 0.0
    return None


def parse_verdict(text: str, *, default: float = 0.0) -> float:
    """:func:`read_verdict`, with ``default`` when the text holds no verdict."""
    verdict = read_verdict(text)
    return default if verdict is None else verdict


class JudgeClient:
    """Sends judge conversations to a genrm gateway. Reuses one aiohttp session; close it.

    :param gateway_url: the genrm gateway's base URL (``http://host:port``).
    :param token: the gateway's bearer token, if it has one.
    :param keepalive: seconds an idle connection is kept for reuse. Below the gateway's own
        keep-alive (30 s), so the gateway never closes a connection this client may pick: a
        judgement is a POST, which aiohttp never sends again after such a close.
    """

    def __init__(
        self,
        gateway_url: str,
        *,
        token: str | None = None,
        timeout: float = 120.0,
        keepalive: float = 4.0,
    ) -> None:
        self.url = gateway_url.rstrip("/") + "/genrm/generate"
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._keepalive = keepalive
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

        :raises UpstreamStatusError: the gateway answered an error: its own status (a 400 for a
            bad conversation or an unknown model stays a 400; 503 with ``retry_after`` while
            the judge model is not READY), its body, and the message of its
            ``{"error": {"message": …}}`` body; a 200 without a ``response`` is a 502.
        :raises UpstreamUnreachableError: the gateway could not be reached (nothing was sent).
        :raises UpstreamError: the exchange failed after the request was sent (502; not
            retried).
        """
        if self._session is None:
            # No connection cap of the client's own (aiohttp's default is 100): the caller
            # bounds what is in flight (a reward stage's ``concurrency``), and a hidden cap
            # below it would queue its judgements here, unseen.
            self._session = aiohttp.ClientSession(
                timeout=self._timeout,
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=self._keepalive),
            )
        body: dict[str, Any] = {
            "messages": messages,
            "sampling_params": dict(sampling_params or JUDGE_SAMPLING),
        }
        if model is not None:
            body["model"] = model
        if route_key is not None:
            body["route_key"] = route_key
        try:
            async with self._session.post(self.url, json=body, headers=self._headers) as resp:
                status, raw = resp.status, await resp.read()
                retry_after = _retry_after(resp.headers.get("Retry-After"))
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamUnreachableError(
                502, f"genrm gateway {self.url} could not be reached: {exc}; nothing was sent"
            ) from exc
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise UpstreamError(
                502,
                f"genrm gateway {self.url}: the exchange failed after the request was sent "
                f"({type(exc).__name__}: {exc}); it is not retried",
            ) from exc
        try:
            payload = json.loads(raw) if raw else None
        except ValueError:
            payload = None
        if status == 200 and isinstance(payload, dict) and "response" in payload:
            return str(payload["response"])
        raise UpstreamStatusError(
            status if status >= 400 else 502,
            f"genrm gateway {self.url} answered {status}: {_error_message(payload, raw)}",
            body=raw,
            url=self.url,
            retry_after=retry_after,
        )

    async def close(self) -> None:
        """Close the HTTP session (idempotent)."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> JudgeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _error_message(payload: Any, raw: bytes) -> str:
    """The message of a gateway's ``{"error": {"message": …}}`` body, else the body itself."""
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return str(error["message"])
    if isinstance(payload, dict) and "response" not in payload and payload:
        return quote_body(json.dumps(payload))
    if isinstance(payload, dict):
        return "the answer has no 'response' field"
    return quote_body(raw)


def _retry_after(value: str | None) -> float | None:
    try:
        seconds = float(value) if value else None
    except ValueError:
        return None
    return seconds if seconds is not None and math.isfinite(seconds) and seconds >= 0 else None


async def judge_sample(
    sample: Mapping[str, Any],
    *,
    client: JudgeClient,
    model: str | None = None,
    route_key: str | None = None,
) -> float:
    """The reward of one sample through a genrm gateway: ``sample`` has ``prompt``,
    ``response`` and optional ``label``. No verdict in the answer scores 0.0.

    :raises ValueError: ``prompt`` or ``response`` is not a string.
    :raises UpstreamError: the gateway answered an error.
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


async def judge_reward(response: str, label: str | None, *, context: RewardContext) -> RewardResult:
    """The ``genrm-judge`` adapter: the judge model's verdict on ``response``.

    Sends the judge conversation (question = the sample's prompt, reference = ``label``; for
    a multi-turn trajectory the whole conversation, :func:`render_trajectory_judge_messages`) to
    the reward stage's role (``genrm`` unless the stage names another) through
    ``context.client(role)`` on ``/v1/chat/completions``: to the stage's model when it names
    one (``models = ["judge-a"]``: one judge per stage), else routed by the sample's route key;
    its group as the affinity key. Side-effect free apart from that one request, so a deferred
    stage can run it (``supports_deferred=True``).

    :raises UpstreamError: the judge request failed (this function sends it once; the reward
        stage calls it again, up to the adapter's ``retries``, when the failure was a transport
        one or a 5xx: a judgement is idempotent).
    :raises ValueError: the answer has no message text.
    """
    conversation = trajectory_messages(context.sample)
    if conversation is not None:
        messages = render_trajectory_judge_messages(conversation, label)
    else:
        messages = render_judge_messages(context.prompt, response, label)
    client = context.client(context.role or JUDGE_ROLE)
    body: dict[str, Any] = {
        "messages": messages,
        "temperature": JUDGE_SAMPLING["temperature"],
        "max_tokens": JUDGE_SAMPLING["max_new_tokens"],
    }
    answer = await client.post(
        "/v1/chat/completions",
        body,
        model=context.model,
        route_key=None if context.model is not None else context.route_key,
        affinity_key=context.sample.group_id,
    )
    try:
        text = answer["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"the judge answer has no choices[0].message.content: {exc!r}") from None
    if not isinstance(text, str):
        raise ValueError(f"the judge answer's message content is {type(text).__name__}")
    verdict = read_verdict(text)
    if verdict is None:
        return RewardResult(0.0, parse_failed=True, detail=text[-200:])
    return RewardResult(verdict, detail=text[-200:])
