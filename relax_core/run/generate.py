"""The producer of ``relax run`` (:class:`StepProducer`): each step's prompts become groups of
samples through the run's rollout shape; and the default shape, ``single-turn``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Unpack

import attrs

from relax_core._concurrent import gather_all
from relax_core.client.client import InferenceClient
from relax_core.coordination.batch import DeferredCollector
from relax_core.coordination.retries import Regeneration
from relax_core.coordination.sample import Sample
from relax_core.coordination.stages import MoreGroups
from relax_core.errors import ConfigError, UpstreamError
from relax_core.run.config import RunConfig
from relax_core.run.data import Prompt, PromptSource
from relax_core.run.rollout import (
    GroupRequest,
    RolloutShape,
    RolloutShapeConfig,
    TurnAnswer,
    continue_aborted,
    parse_answer,
    sampling_seed,
)


class PromptTokenizer:
    """The generation model's tokenizer (its ``tokenizer.json``).

    :raises ConfigError: no ``tokenizer.json``, or the ``tokenizers`` library is missing."""

    def __init__(self, model_path: str, *, where: str) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ConfigError(
                where, "relax run tokenizes prompts with the tokenizers library: pip install it"
            ) from None
        path = Path(model_path) / "tokenizer.json"
        if not path.exists():
            raise ConfigError(
                f"{where}.model_path",
                f"no tokenizer.json in {model_path}: relax run tokenizes the prompts with the "
                "generation model's own tokenizer",
            )
        self._tokenizer = Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text``, with the tokenizer's own special tokens (as the engine
        would tokenize it)."""
        return list(self._tokenizer.encode(text, add_special_tokens=True).ids)


@attrs.define
class SingleTurn:
    """The ``single-turn`` shape: one ``/generate`` request per group for its ``samples``
    completions (SGLang's ``n``); the tokenizer is loaded from ``model_path`` unless given."""

    model: str
    settings: RunConfig
    _tokenizer: PromptTokenizer | None = attrs.field(default=None, kw_only=True)
    model_path: str = attrs.field(default="", kw_only=True)
    model_where: str = attrs.field(default="", kw_only=True)

    @property
    def tokenizer(self) -> PromptTokenizer:
        """The prompt tokenizer (loaded once)."""
        if self._tokenizer is None:
            self._tokenizer = PromptTokenizer(self.model_path, where=self.model_where)
        return self._tokenizer

    async def group(self, request: GroupRequest, client: InferenceClient) -> list[Sample]:
        """The group's ``request.samples`` completions, from one request."""
        prompt = request.prompt
        ids = self.tokenizer.encode(prompt.prompt)
        run = self.settings
        n = request.samples
        body = {
            "input_ids": ids,
            "sampling_params": {
                "n": n,
                "max_new_tokens": run.max_new_tokens,
                # an empty response has nothing to score, train on or distill
                "min_new_tokens": 1,
                "temperature": request.temperature,
                "sampling_seed": request.seed,
            },
            "return_logprob": True,
            "model": self.model,
        }
        answer: Any = await client.generate(
            body, timeout=run.request_timeout, affinity_key=request.group_id
        )
        answers = answer if isinstance(answer, list) else [answer]
        if len(answers) != n:
            raise UpstreamError(
                502,
                f"prompt {prompt.origin or request.index} asked for {n} samples and got "
                f"{len(answers)}",
            )
        sample_ids = [request.sample_id(j) for j in range(n)]
        turns = [parse_answer(i, a) for i, a in zip(sample_ids, answers, strict=True)]
        if run.push_pause == "abort":  # a push cut them short: each goes on from its tokens
            key, timeout = request.group_id, run.request_timeout
            aborted = [
                continue_aborted(client, body, t, sample_id=i, affinity_key=key, timeout=timeout)
                for i, t in zip(sample_ids, turns, strict=True)
            ]
            turns = list(await asyncio.gather(*aborted))
        return [
            _sample(i, request.group_id, ids, prompt, t)
            for i, t in zip(sample_ids, turns, strict=True)
        ]


def build_single_turn(config: RolloutShapeConfig) -> SingleTurn:
    """The ``single-turn`` shape (it has no options)."""
    return SingleTurn(
        config.model, config.run, model_path=config.model_path, model_where=config.model_where
    )


@attrs.define
class Generator:
    """Generates one step's groups through the rollout role's ``client`` with the run's
    rollout ``shape``, ``concurrency`` groups at a time."""

    client: InferenceClient
    settings: RunConfig
    shape: RolloutShape
    concurrency: int = 64
    _gate: asyncio.Semaphore = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._gate = asyncio.Semaphore(self.concurrency)

    async def groups(
        self,
        batch_id: int,
        prompts: Sequence[Prompt],
        *,
        first_index: int = 0,
        samples_per_prompt: int | None = None,
        temperature: float | None = None,
        regeneration: Regeneration | None = None,
        again: Callable[[], int] | None = None,
        each: Callable[[list[Sample]], None] | None = None,
    ) -> list[list[Sample]]:
        """Every prompt's group, in the order of ``prompts``, ``each(group)`` called as each
        completes. Group ``i`` is ``b{batch_id}-p{first_index + i}``; with ``regeneration``
        (and ``again``, the step's next group index) a failed group is regenerated as a new
        group of the same prompt.

        :raises UpstreamError: a request failed or its answer is not a sampled group;
            groups completed before it were passed to ``each``."""
        run = self.settings
        samples = samples_per_prompt or run.samples_per_prompt
        temperature = run.temperature if temperature is None else temperature
        out: list[list[Sample]] = [[] for _ in prompts]

        async def one(position: int, prompt: Prompt) -> None:
            async def generate(index: int) -> list[Sample]:
                seed = sampling_seed(run.seed, batch_id, index)
                request = GroupRequest(
                    batch_id, index, f"b{batch_id}-p{index}", prompt, samples, temperature, seed
                )
                async with self._gate:
                    return await self.shape.group(request, self.client)

            index = first_index + position
            if regeneration is None or again is None:
                out[position] = await generate(index)
            else:
                out[position] = await regeneration.group(generate, index, again)
            if each is not None:
                each(out[position])

        await gather_all(one(i, p) for i, p in enumerate(prompts))
        return out


class StepProducer:
    """What each step generates with: :meth:`first` a step's first groups, :meth:`generate`
    more while its batch is in flight, every group of a step with an index of its own."""

    def __init__(self, generator: Generator, source: PromptSource) -> None:
        self.generator = generator
        self.source = source
        self._next: dict[int, int] = {}
        #: how a group whose generation failed is regenerated (``None``: it fails the step)
        self.regeneration: Regeneration | None = None

    def regenerate_failed(self, regeneration: Regeneration | None) -> None:
        """From now on a group whose generation fails retryably is regenerated as a new group
        of the same prompt (``None``: it fails the step)."""
        self.regeneration = regeneration

    def _indexes(self, batch_id: int, count: int) -> int:
        """The first of ``count`` new group indexes of batch ``batch_id``."""
        first = self._next.get(batch_id, 0)
        self._next = {batch_id: first + count}  # earlier batches are done with
        return first

    async def _groups(
        self, batch_id: int, prompts: Sequence[Prompt], **options: Any
    ) -> list[list[Sample]]:
        return await self.generator.groups(
            batch_id,
            prompts,
            first_index=self._indexes(batch_id, len(prompts)),
            regeneration=self.regeneration,
            again=lambda: self._indexes(batch_id, 1),
            **options,
        )

    async def first(
        self,
        batch_id: int,
        collector: DeferredCollector,
        *,
        on_group: Callable[[int], None] | None = None,
    ) -> None:
        """The step's prompts from the source, each group into ``collector`` as it completes,
        then ``on_group(groups_done)``."""
        done = 0

        def add(group: list[Sample]) -> None:
            nonlocal done
            collector.add(group)
            done += 1
            if on_group is not None:
                on_group(done)

        prompts = self.source.take(self.generator.settings.prompts_per_step)
        await self._groups(batch_id, prompts, each=add)

    async def generate(self, batch_id: int, **request: Unpack[MoreGroups]) -> list[list[Sample]]:
        """``groups`` more groups from the source, or one per prompt of ``prompts``."""
        prompts = request.get("prompts")
        chosen = (
            list(prompts) if prompts is not None else self.source.take(request.get("groups") or 0)
        )
        return await self._groups(
            batch_id,
            chosen,
            samples_per_prompt=request.get("samples_per_prompt"),
            temperature=request.get("temperature"),
        )


def _sample(
    sample_id: str, group_id: str, ids: list[int], prompt: Prompt, turn: TurnAnswer
) -> Sample:
    return Sample(
        sample_id,
        group_id,
        ids,
        turn.output_ids,
        prompt=prompt.prompt,
        response=turn.text,
        label=prompt.label,
        rollout_logprobs=turn.logprobs,
        metadata=dict(prompt.metadata),
        weight_version=turn.weight_version,
        weight_versions=turn.weight_versions,
    )
