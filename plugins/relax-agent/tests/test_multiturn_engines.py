"""The ``multi-turn`` shape on real hf engines (two replicas of a tiny model on loopback, the
real client and its DIRECT routing): the policy's ids in each trajectory are the ones the
engines answered, the environment's tokens carry loss mask 0, every turn of a trajectory
reaches one replica (counted by the engines themselves), a hanging tool is cut at its timeout
while the trajectory goes on, and an environment that raises fails with its name and the
trajectory's id.

The tiny random model never writes a tool call by itself: the first turn is guided (the
calculator's ``guided_first_turn``, the engine's regex-constrained decoding), so the policy
still samples every token of it.
"""

from __future__ import annotations

import asyncio
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from relax_agent import (
    CALCULATOR,
    EnvironmentStepError,
    MultiTurn,
    Observation,
    Reset,
    Tool,
    ToolBox,
    Turn,
    parse_tool_calls,
    tool_message,
)

from relax_core import (
    EnvironmentSpec,
    GroupRequest,
    InferenceClient,
    PluginManager,
    Prompt,
    SourceRequest,
)

MODEL = "policy"


def _arithmetic(n: int) -> list[Prompt]:
    """The first ``n`` questions of the core's ``arithmetic`` source (seed 0)."""
    spec = PluginManager.create().registered("data_sources")["arithmetic"].record
    prompts: list[Prompt] = spec.open(SourceRequest("arithmetic")).take(n)
    return prompts


def _snapshot(urls: list[str]) -> dict[str, Any]:
    return {
        "schema_version": 2,
        "role": "rollout",
        "registry_epoch": "test",
        "topology_revision": 1,
        "routing": {
            "default_model": MODEL,
            "route_key_map": {},
            "aliases": {},
            "policy": "round_robin",
            "policy_revision": 0,
        },
        "models": {
            MODEL: {
                "state": "READY",
                "route_mode": "DIRECT",
                "router_url": None,
                "weight_source": "STATIC",
                "weight_version": None,
                "served_model_name": MODEL,
                "engines": [
                    {
                        "engine_id": f"{MODEL}/replica-{i}",
                        "base_url": url,
                        "state": "READY",
                        "direct_eligible": True,
                        "generation": 1,
                    }
                    for i, url in enumerate(urls)
                ],
            }
        },
    }


@pytest.fixture(scope="module")
def engines(agent_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    from relax_hf.testing import start_engine

    logs = tmp_path_factory.mktemp("agent-engines")
    started = []
    try:
        for i in range(2):
            started.append(
                start_engine(agent_model, logs, f"agent-{i}", served_model_name=MODEL, seed=0)
            )
        yield [s.url for s in started]
    finally:
        for server in started:
            server.process.terminate(10)


def _requests(url: str) -> int:
    """The engine's own count of requests it served (its ``/metrics``)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    match = re.search(r"^sglang:num_requests_total\{[^}]*\} (\d+)", text, re.M)
    assert match is not None, text[:500]
    return int(match.group(1))


class Recording:
    """The real client, each ``/generate`` answer kept as the engine sent it (to compare the
    trajectory's ids with), by affinity key."""

    def __init__(self, client: InferenceClient) -> None:
        self.client = client
        self.answers: dict[str, list[dict[str, Any]]] = {}

    async def generate(self, body: dict[str, Any], **kw: Any) -> Any:
        answer = await self.client.generate(body, **kw)
        self.answers.setdefault(kw["affinity_key"], []).append(answer)
        return answer


def _shape(environment: EnvironmentSpec, model: Path, **options: Any) -> MultiTurn:
    settings: dict[str, Any] = {
        "max_turns": 3, "max_total_tokens": 512, "max_new_tokens": 96, "tool_timeout": 5.0,
    }  # fmt: skip
    settings.update(options.pop("settings", {}))
    return MultiTurn(
        environment,
        options,
        model=MODEL,
        model_path=str(model),
        model_where="roles.rollout.models.policy",
        request_timeout=120.0,
        **settings,
    )


def _groups(
    urls: list[str], shape: MultiTurn, prompts: list[Prompt], samples: int = 1
) -> tuple[list[Any], Recording, list[dict[str, int]]]:
    """One group per prompt, one after the other; each engine's request count after each."""

    async def provide() -> dict[str, Any]:
        return _snapshot(urls)

    async def main() -> tuple[list[Any], Recording, list[dict[str, int]]]:
        out, counts = [], [{u: _requests(u) for u in urls}]
        async with InferenceClient(snapshot_provider=provide, role="rollout") as client:
            recording = Recording(client)
            for i, prompt in enumerate(prompts):
                request = GroupRequest(0, i, f"b0-p{i}", prompt, samples, 1.0, 1000 + i)
                out += await shape.group(request, recording)  # type: ignore[arg-type]
                counts.append({u: _requests(u) for u in urls})
        return out, recording, counts

    return asyncio.run(main())


@pytest.fixture(scope="module")
def calculator_run(engines: list[str], agent_model: Path) -> tuple[list[Any], Recording, Any]:
    shape = _shape(CALCULATOR, agent_model, guided_first_turn=True)
    return _groups(engines, shape, _arithmetic(6))


@pytest.mark.slow
def test_policy_ids_are_the_engines_and_environment_tokens_carry_mask_0(
    calculator_run: tuple[list[Any], Recording, Any],
) -> None:
    samples, recording, _ = calculator_run
    for s in samples:
        t = s.metadata["trajectory"]
        answers = recording.answers[s.id]
        assert t["turns"] == len(answers) >= 2 and t["tool_calls"] >= 1
        spans = t["turn_spans"]
        policy = set()
        for (start, end), answer in zip(spans, answers, strict=True):
            # Exactly the ids and log-probs the engine answered for the turn, mask 1.
            assert list(s.response_ids[start:end]) == answer["output_ids"]
            lps = [e[0] for e in answer["meta_info"]["output_token_logprobs"]]
            assert list(s.rollout_logprobs[start:end]) == pytest.approx(lps)
            assert set(s.loss_mask[start:end]) == {1}
            policy.update(range(start, end))
        # Every other response token is the environment's: mask 0, between the turns.
        others = [i for i in range(len(s.response_ids)) if i not in policy]
        assert others and all(s.loss_mask[i] == 0 for i in others)
        assert sum(s.loss_mask) == sum(len(a["output_ids"]) for a in answers)
        # The tool's result is what those tokens say, and the policy saw it.
        tool = next(m for m in t["messages"] if m["role"] == "tool")
        assert "<tool_response>" in tool["content"]
        assert s.response == t["messages"][-1]["content"]


@pytest.mark.slow
def test_every_turn_of_a_trajectory_reached_one_replica(
    engines: list[str], calculator_run: tuple[list[Any], Recording, Any]
) -> None:
    samples, recording, counts = calculator_run
    used = set()
    for s, before, after in zip(samples, counts[:-1], counts[1:], strict=True):
        served = {u: after[u] - before[u] for u in engines}
        turns = s.metadata["trajectory"]["turns"]
        # One engine served every turn of it, the other none.
        assert sorted(served.values()) == [0, turns], (s.id, served)
        used.add(max(served, key=lambda u: served[u]))
        # The replica's prefix cache held the trajectory for its later turns.
        later = recording.answers[s.id][1:]
        assert all(a["meta_info"].get("cached_tokens", 0) > 0 for a in later)
    assert used == set(engines)  # trajectories are spread over the replicas, each one sticks


class _Waiting:
    """An environment whose one tool never answers: the first turn is guided to call it."""

    CALL = r'<tool_call>\{"name": "wait", "arguments": \{\}\}</tool_call>'

    def __init__(self, config: Any) -> None:
        async def wait() -> str:
            await asyncio.Event().wait()  # never set: only the timeout ends it
            return "never"

        self.tools = ToolBox([Tool("wait", wait)], timeout=config.tool_timeout)

    def reset(self, prompt: Prompt) -> Reset:
        return Reset([{"role": "user", "content": prompt.prompt}], guide={"regex": self.CALL})

    async def step(self, turn: Turn) -> Observation:
        calls = parse_tool_calls(turn.text)
        if not calls:
            return Observation(reward=0.5, done=True)
        results = [await self.tools.run(c) for c in calls]
        return Observation(
            [tool_message(r.text) for r in results],
            tool_calls=len(calls),
            tool_errors=sum(r.error for r in results),
            tool_timeouts=sum(r.timed_out for r in results),
        )


@pytest.mark.slow
def test_a_hanging_tool_is_cut_at_its_timeout_and_the_trajectory_goes_on(
    engines: list[str], agent_model: Path
) -> None:
    spec = EnvironmentSpec(name="waiting", make=_Waiting)
    shape = _shape(spec, agent_model, settings={"tool_timeout": 0.5, "max_turns": 2})
    (sample,), recording, _ = _groups(engines, shape, [Prompt("Wait for it.")])
    t = sample.metadata["trajectory"]
    assert t["turns"] == 2 and t["tool_calls"] == 1
    # Counted as an error and a timeout; the environment's seconds hold the wait.
    metrics = sample.metadata["rollout_metrics"]
    assert (metrics["turns"], metrics["tool_errors"], metrics["tool_timeouts"]) == (2, 1, 1)
    assert metrics["environment_seconds"] > 0.4
    assert (
        t["messages"][2]["content"]
        == "<tool_response>\nerror: wait timed out after 0.5s\n</tool_response>"
    )
    assert len(recording.answers[sample.id]) == 2  # the second turn was generated after it


class _Raising:
    def __init__(self, config: Any) -> None:
        pass

    def reset(self, prompt: Prompt) -> Reset:
        return Reset([{"role": "user", "content": prompt.prompt}])

    def step(self, turn: Turn) -> Observation:
        raise RuntimeError("the board is on fire")


@pytest.mark.slow
def test_an_environment_that_raises_fails_with_its_name_and_the_trajectory_id(
    engines: list[str], agent_model: Path
) -> None:
    spec = EnvironmentSpec(name="raising", make=_Raising)
    with pytest.raises(EnvironmentStepError) as info:
        _groups(engines, _shape(spec, agent_model), [Prompt("hello")], samples=2)
    error = info.value
    assert error.environment == "raising" and error.trajectory in {"b0-p0-s0", "b0-p0-s1"}
    assert "step on turn 0 failed: RuntimeError: the board is on fire" in str(error)
