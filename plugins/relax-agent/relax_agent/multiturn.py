"""The ``multi-turn`` rollout shape: each sample of a group is a trajectory of policy turns and
an environment's observations, kept token-exact.

One trajectory (``b{step}-p{prompt}-s{j}``, one member of its prompt's group):

1. the environment is made for it and reset from the prompt's dataset row; its first
   messages are rendered with the model's chat template once — the sample's ``prompt_ids``;
2. each policy turn is one ``/generate`` request for ``input_ids`` = the prompt and every
   response token so far, through the generation role's route with the **trajectory's id as
   the affinity key** (every turn reaches the same replica, whose prefix cache holds the
   trajectory); its output ids and log-probs are appended exactly as the engine returned
   them, loss mask 1;
3. the environment steps on the turn's text; unless it is done, its observation's messages are
   appended as the ids of the template's text between the turns
   (:meth:`~relax_agent.ChatTurns.boundary`: tokenized once, prefix-stable, checked),
   loss mask 0 and log-prob 0.0 (no policy sampled them);
4. until the environment says ``done``, after ``max_turns`` policy turns, or when the next
   turn would have no room under ``max_total_tokens`` (prompt and response together).

The sample: ``response_ids`` every turn's ids in order, ``loss_mask`` one 0/1 per response
token, ``rollout_logprobs`` one per response token, ``response`` the last policy turn's text
(what a reward adapter reads as the answer), ``metadata["trajectory"]`` the record of it:
its id, environment, the whole conversation (``messages``), the policy turns' token spans
(``turn_spans``: ``[start, end)`` in ``response_ids``), the per-turn rewards
(``turn_rewards``), the tool calls made, why it ended (``stop``) and each observation's
``info``; ``metadata["rollout_metrics"]`` its numbers, which the step's JSON object aggregates
under ``rollout`` (mean, max and total over the step's trajectories): ``turns`` (policy turns),
``tool_calls``, ``tool_errors``, ``tool_timeouts`` (as the environment's observations count
them) and ``environment_seconds`` (the time spent in the environment's ``reset`` and ``step``).

Options (``[run.generation]``): ``environment`` (a registered environment, required),
``max_turns`` (4), ``max_total_tokens`` (1024), ``tool_timeout`` (10 s, handed to the
environment), ``env`` (the environment's own table). Each turn samples at most ``[run]
max_new_tokens`` tokens.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Mapping
from typing import Any

from relax_agent.environment import (
    Environment,
    EnvironmentConfig,
    EnvironmentStepError,
    Observation,
    Reset,
    Turn,
)
from relax_agent.template import ChatTurns, NotPrefixStable
from relax_core import (
    ROLLOUT_METRICS,
    ConfigProblem,
    ConfigReader,
    ConfigValidationError,
    EnvironmentSpec,
    GroupRequest,
    InferenceClient,
    PluginError,
    RolloutShapeConfig,
    Sample,
    add_segments,
    boundaries,
    continue_aborted,
    gather_all,
    parse_answer,
    sampling_seed,
)

__all__ = ["MULTI_TURN_OPTIONS", "MultiTurn", "build_multi_turn", "multi_turn_needs"]

#: The keys of ``[run.generation]`` the multi-turn shape reads.
MULTI_TURN_OPTIONS = ("environment", "max_turns", "max_total_tokens", "tool_timeout", "env")


class MultiTurn:
    """The ``multi-turn`` shape (see the module docstring).

    :param environment: the environment's record.
    :param env_options: its ``[run.generation.env]`` table.
    :param model: the generation model's name; ``model_path``, ``model_where``: its directory
        and key path (the chat template and tokenizer are loaded from it on first use).
    :param continue_aborts: continue a turn a weight push's ``abort`` pause cut short
        (:func:`~relax_core.continue_aborted`).
    """

    def __init__(
        self,
        environment: EnvironmentSpec,
        env_options: Mapping[str, Any],
        *,
        model: str,
        model_path: str,
        model_where: str,
        max_turns: int,
        max_total_tokens: int,
        max_new_tokens: int,
        tool_timeout: float,
        request_timeout: float,
        env_path: str = "run.generation.env",
        continue_aborts: bool = False,
    ) -> None:
        self.environment = environment
        self.env_options = dict(env_options)
        self.env_path = env_path
        self.model = model
        self.model_path = model_path
        self.model_where = model_where
        self.max_turns = max_turns
        self.max_total_tokens = max_total_tokens
        self.max_new_tokens = max_new_tokens
        self.tool_timeout = tool_timeout
        self.request_timeout = request_timeout
        #: ``push_pause = "abort"``: a turn a push cut short goes on from its tokens
        self.continue_aborts = continue_aborts
        self._turns: ChatTurns | None = None

    @property
    def turns(self) -> ChatTurns:
        """The model's chat template and tokenizer (loaded once)."""
        if self._turns is None:
            self._turns = ChatTurns(self.model_path, where=self.model_where)
        return self._turns

    async def group(self, request: GroupRequest, client: InferenceClient) -> list[Sample]:
        """The group's trajectories, generated concurrently."""
        return await gather_all(self.trajectory(request, j, client) for j in range(request.samples))

    async def trajectory(self, request: GroupRequest, j: int, client: InferenceClient) -> Sample:
        """Sample ``j`` of the group: one trajectory.

        :raises EnvironmentStepError: the environment raised or answered what is not an
            observation (naming it and the trajectory).
        :raises UpstreamError: a turn's request failed.
        """
        tid = request.sample_id(j)
        name = self.environment.name
        config = EnvironmentConfig(self.env_options, tid, self.tool_timeout, self.env_path)
        began = time.perf_counter()
        try:
            env: Environment = self.environment.make(config)
            reset = env.reset(request.prompt)
            if not isinstance(reset, Reset):
                raise TypeError(f"reset returned a {type(reset).__name__}, not a Reset")
        except Exception as exc:
            raise EnvironmentStepError(
                name, tid, f"reset failed: {type(exc).__name__}: {exc}"
            ) from exc
        try:
            return await self._drive(request, j, client, env, reset, time.perf_counter() - began)
        finally:
            close = getattr(env, "close", None)
            if callable(close):
                close()

    async def _drive(
        self,
        request: GroupRequest,
        j: int,
        client: InferenceClient,
        env: Environment,
        reset: Reset,
        env_seconds: float,
    ) -> Sample:
        """The trajectory's turns, from its reset to its end; its sample (``env_seconds``:
        the environment's time so far, its reset)."""
        tid = request.sample_id(j)
        name = self.environment.name
        turns = self.turns
        messages: list[dict[str, Any]] = list(reset.messages)
        prompt_ids = turns.prompt(messages)
        response: list[int] = []
        logprobs: list[float] = []
        mask: list[int] = []
        spans: list[list[int]] = []
        rewards: list[float | None] = []
        infos: list[Mapping[str, Any]] = []
        tool_calls = tool_errors = tool_timeouts = 0
        guide = reset.guide
        version: str | None = None
        segments: list[tuple[int, str | None]] = []  # (first response token, version)
        text = ""
        stop = "max_turns"
        for k in range(self.max_turns):
            room = self.max_total_tokens - len(prompt_ids) - len(response)
            if room < 1:
                stop = "max_total_tokens"
                break
            sampling: dict[str, Any] = {
                "max_new_tokens": min(self.max_new_tokens, room),
                "min_new_tokens": 1,
                "temperature": request.temperature,
                "sampling_seed": sampling_seed(request.seed, request.batch_id, request.index, j, k),
            }
            if guide:
                sampling.update(guide)
            body = {
                "input_ids": [*prompt_ids, *response],
                "sampling_params": sampling,
                "return_logprob": True,
                "model": self.model,
            }
            raw = await client.generate(body, timeout=self.request_timeout, affinity_key=tid)
            answer = parse_answer(f"{tid} turn {k}", raw[0] if isinstance(raw, list) else raw)
            if self.continue_aborts:
                answer = await continue_aborted(
                    client,
                    body,
                    answer,
                    sample_id=f"{tid} turn {k}",
                    affinity_key=tid,
                    timeout=self.request_timeout,
                )
            version = answer.weight_version  # SGLang's: the version of the last token
            text = answer.text
            start = len(response)
            add_segments(segments, start, answer)
            response.extend(answer.output_ids)
            logprobs.extend(answer.logprobs)
            mask.extend([1] * len(answer.output_ids))
            spans.append([start, len(response)])
            turn = Turn(k, text, answer.output_ids, tid, tuple(messages))
            began = time.perf_counter()
            observation = await self._step(env, turn)
            env_seconds += time.perf_counter() - began
            rewards.append(observation.reward)
            infos.append(dict(observation.info))
            tool_calls += observation.tool_calls
            tool_errors += observation.tool_errors
            tool_timeouts += observation.tool_timeouts
            ended = bool(answer.output_ids) and answer.output_ids[-1] == turns.eos_id
            history = list(messages)
            messages.append({"role": "assistant", "content": text})
            if observation.done:
                stop = "done"
                break
            if k == self.max_turns - 1:
                break
            try:
                between = turns.boundary(history, text, ended, observation.messages)
            except NotPrefixStable as exc:
                raise EnvironmentStepError(
                    name,
                    tid,
                    f"the chat template of {self.model_where} is not prefix-stable after turn "
                    f"{k}: {exc}; a multi-turn rollout cannot keep its ids without "
                    "re-tokenizing (use a model whose template appends turns)",
                ) from exc
            if len(prompt_ids) + len(response) + len(between) >= self.max_total_tokens:
                stop = "max_total_tokens"
                break
            response.extend(between)
            logprobs.extend([0.0] * len(between))
            mask.extend([0] * len(between))
            messages.extend(observation.messages)
            guide = observation.guide
        prompt = request.prompt
        return Sample(
            tid,
            request.group_id,
            prompt_ids,
            response,
            prompt=prompt.prompt,
            response=text,
            label=prompt.label,
            rollout_logprobs=logprobs,
            metadata={
                **prompt.metadata,
                "trajectory": {
                    "id": tid,
                    "environment": name,
                    "turns": len(spans),
                    "tool_calls": tool_calls,
                    "tool_errors": tool_errors,
                    "tool_timeouts": tool_timeouts,
                    "turn_rewards": rewards,
                    "turn_spans": spans,
                    "stop": stop,
                    "messages": [dict(m) for m in messages],
                    "info": infos,
                },
                ROLLOUT_METRICS: {
                    "turns": len(spans),
                    "tool_calls": tool_calls,
                    "tool_errors": tool_errors,
                    "tool_timeouts": tool_timeouts,
                    "environment_seconds": env_seconds,
                },
            },
            weight_version=version,
            weight_versions=boundaries(segments),
            loss_mask=mask,
        )

    async def _step(self, env: Environment, turn: Turn) -> Observation:
        name = self.environment.name
        try:
            result = env.step(turn)
            if inspect.isawaitable(result):
                result = await result
        except Exception as exc:
            raise EnvironmentStepError(
                name,
                turn.trajectory_id,
                f"step on turn {turn.index} failed: {type(exc).__name__}: {exc}",
            ) from exc
        if not isinstance(result, Observation):
            raise EnvironmentStepError(
                name,
                turn.trajectory_id,
                f"step on turn {turn.index} returned a {type(result).__name__}, not an Observation",
            )
        return result


def build_multi_turn(config: RolloutShapeConfig) -> MultiTurn:
    """The ``multi-turn`` shape from its ``[run.generation]`` table.

    :raises ConfigValidationError: no ``environment``, an unknown one, a bad number, or what
        the environment's own check found in ``env`` (each with its key path).
    """
    r = ConfigReader()
    t, p, v = config.options, config.path, r.value
    name = v(t, p, "environment", str, None, required=True, check=ConfigReader.non_empty)
    max_turns = v(t, p, "max_turns", int, 4, check=ConfigReader.at_least(1))
    max_total = v(t, p, "max_total_tokens", int, 1024, check=ConfigReader.at_least(2))
    tool_timeout = v(t, p, "tool_timeout", float, 10.0, check=ConfigReader.positive)
    env_options = t.get("env", {})
    env_path = f"{p}.env"
    if not isinstance(env_options, Mapping):
        r.problem(env_path, "type", f"must be a table ([run.generation.env]), got {env_options!r}")
        env_options = {}
    spec: EnvironmentSpec | None = None
    if name is not None:
        try:
            spec = config.pm.registered("environments")[name].record
        except KeyError:
            known = sorted(config.pm.registered("environments"))
            r.problem(
                f"{p}.environment",
                "environment",
                f"no environment named {name!r} is registered; known: {known}. Is the plugin "
                "that provides it installed and enabled?",
            )
    if spec is not None:
        if spec.options is not None:
            r.table(dict(env_options), env_path, spec.options)
        if spec.check is not None:
            try:
                found = list(
                    spec.check(EnvironmentConfig(env_options, "-", tool_timeout, env_path))
                )
            except PluginError as exc:
                found = [ConfigProblem(env_path, "environment", str(exc))]
            r.problems.extend(found)
    if r.problems:
        raise ConfigValidationError(r.problems, config.run.base)
    assert spec is not None and name is not None
    return MultiTurn(
        spec,
        env_options,
        model=config.model,
        model_path=config.model_path,
        model_where=config.model_where,
        max_turns=max_turns,
        max_total_tokens=max_total,
        max_new_tokens=config.run.max_new_tokens,
        tool_timeout=tool_timeout,
        request_timeout=config.run.request_timeout,
        env_path=env_path,
        continue_aborts=config.run.push_pause == "abort",
    )


def multi_turn_needs(config: RolloutShapeConfig) -> dict[str, str]:
    """The engine features the table's environment needs with its ``env`` options
    (``EnvironmentSpec.needs``), each at its key path (``run.generation.env.OPTION``)."""
    name = config.options.get("environment")
    env_options = config.options.get("env", {})
    found = config.pm.registered("environments").get(name) if isinstance(name, str) else None
    if found is None or found.record.needs is None or not isinstance(env_options, Mapping):
        return {}
    env_path = config.key("env")
    return {
        feature: f"{env_path}.{key}" if key else env_path
        for feature, key in found.record.needs(dict(env_options)).items()
    }
