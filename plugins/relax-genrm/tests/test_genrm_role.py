"""The genrm role plugin: registration, the messages protocol and the judge reward adapter."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from relax_genrm import GenRMAdapter, parse_verdict
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from relax_core import AdaptContext, InvalidRequestError, PluginManager
from relax_core.testing import serve_app

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer(directory: Path, *, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    """A tiny byte-level BPE tokenizer trained locally (no hub) and saved to ``directory``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["the judge says yes", "score: 1 correct"] * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>")
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("genrm-tok"))


def ctx(model_path: Path | None, *, stream: bool = False) -> AdaptContext:
    return AdaptContext(
        role="genrm",
        model="judge",
        model_path=str(model_path) if model_path else None,
        served_model_name="judge-v1",
        stream=stream,
    )


def test_installed_plugin_registers_genrm_role_and_deferred_judge(
    plugin_manager: PluginManager,
) -> None:
    role = plugin_manager.role("genrm")
    assert role.allowed_weight_sources == frozenset({"STATIC"})
    assert role.default_route_mode == "DIRECT"
    assert role.deferrable is True
    assert isinstance(role.gateway_adapter(), GenRMAdapter)
    judge = plugin_manager.reward_adapter("genrm-judge")
    assert judge.supports_deferred is True and judge.mode == "async"
    assert plugin_manager.registered("roles")["genrm"].distribution == "relax-genrm"


def test_genrm_record_says_what_the_core_needs_to_know(plugin_manager: PluginManager) -> None:
    role = plugin_manager.role("genrm")
    # Its old consumers read the legacy health body: /genrm/health answers schema 1.
    assert role.health_schema == 1
    assert role.static_weights is True and role.generation_phase is False
    assert role.title == "GenRM"
    # The messages input is documented exactly as the adapter accepts it.
    assert role.openapi.input_names == GenRMAdapter.generate_inputs == ("messages",)
    assert role.openapi.generate_answer is not None


def test_messages_are_rendered_with_the_models_chat_template(tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    adapter = GenRMAdapter()
    messages = [{"role": "user", "content": "is it correct?"}]
    body = {
        "messages": messages,
        "model": "judge",
        "route_key": "k",
        "sampling_params": {"max_new_tokens": 4},
    }
    adapted = adapter.adapt_generate(adapter.check_generate(body), ctx(tokenizer_dir))
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    expected = tok.encode(
        "<|im_start|>user\nis it correct?<|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False,
    )
    assert adapted.payload == {"input_ids": expected, "sampling_params": {"max_new_tokens": 4}}
    assert adapted.response is not None
    assert adapted.response({"text": "score: 1", "meta_info": {}}) == {"response": "score: 1"}


def test_tokenizer_is_loaded_once_per_model_path(tokenizer_dir: Path) -> None:
    adapter = GenRMAdapter()
    for _ in range(3):
        adapter.adapt_generate({"messages": [{"role": "user", "content": "x"}]}, ctx(tokenizer_dir))
    assert len(adapter.tokenizers) == 1


def test_raw_input_passes_through_unchanged(tokenizer_dir: Path) -> None:
    adapter = GenRMAdapter()
    adapted = adapter.adapt_generate(
        adapter.check_generate({"input_ids": [1, 2, 3]}), ctx(tokenizer_dir)
    )
    assert adapted.payload is None and adapted.response is None


def test_messages_with_stream_is_a_bad_request(tokenizer_dir: Path) -> None:
    adapter = GenRMAdapter()
    body = adapter.check_generate({"messages": [{"role": "user", "content": "x"}], "stream": True})
    with pytest.raises(InvalidRequestError, match="stream") as info:
        adapter.adapt_generate(body, ctx(tokenizer_dir, stream=True))
    assert info.value.field == "stream"


def test_messages_and_input_ids_together_are_a_bad_request() -> None:
    with pytest.raises(InvalidRequestError, match="exactly one input"):
        GenRMAdapter().check_generate({"messages": [{"role": "user"}], "input_ids": [1]})


def test_malformed_message_names_its_index() -> None:
    adapter = GenRMAdapter()
    body = adapter.check_generate(
        {"messages": [{"role": "user", "content": "a"}, {"content": "b"}]}
    )
    with pytest.raises(InvalidRequestError, match=r"messages\[1\]\.role"):
        adapter.adapt_generate(body, ctx(None))


def test_messages_without_model_path_say_what_to_send_instead() -> None:
    with pytest.raises(InvalidRequestError, match="input_ids"):
        GenRMAdapter().adapt_generate({"messages": [{"role": "user", "content": "x"}]}, ctx(None))


def test_tokenizer_without_chat_template_is_refused(tmp_path: Path) -> None:
    path = make_tokenizer(tmp_path, chat_template=None)
    with pytest.raises(InvalidRequestError, match="no chat template"):
        GenRMAdapter().adapt_generate({"messages": [{"role": "user", "content": "x"}]}, ctx(path))


def test_missing_tokenizer_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="cannot load the tokenizer"):
        GenRMAdapter().adapt_generate(
            {"messages": [{"role": "user", "content": "x"}]}, ctx(tmp_path / "missing")
        )


@pytest.mark.parametrize(
    ("text", "reward"),
    [
        ("The response is right. score: 1", 1.0),
        ("score: 1 ... on reflection score: 0", 0.0),
        ("score: 0.5", 0.5),
        ("score: 7", 1.0),
        ("Yes, correct.", 1.0),
        ("that is incorrect", 0.0),
        ("no verdict here", 0.0),
    ],
)
def test_verdict_parser(text: str, reward: float) -> None:
    assert parse_verdict(text) == reward


@pytest.fixture
def judge_engine() -> Iterator[tuple[str, list[dict[str, object]]]]:
    """A real HTTP server answering /v1/chat/completions like a genrm engine (a test upstream:
    the judge's verdicts are scripted per question, which a tiny real model cannot be)."""
    seen: list[dict[str, object]] = []

    async def chat(request: Request) -> JSONResponse:
        body = await request.json()
        seen.append({"body": body, "key": request.headers.get("x-smg-routing-key")})
        question = body["messages"][1]["content"]
        text = "the response matches. score: 1" if "2+2" in question else "I cannot tell"
        return JSONResponse({"choices": [{"message": {"role": "assistant", "content": text}}]})

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
    with serve_app(app) as url:
        yield url, seen


def test_judge_adapter_scores_a_reward_stage_and_counts_parse_failures(
    plugin_manager: PluginManager, judge_engine: tuple[str, list[dict[str, object]]]
) -> None:
    from relax_core import (
        RegistryPublisher,
        RewardStage,
        RoleClients,
        RoutingSpec,
        Sample,
        StageContext,
    )

    url, seen = judge_engine
    publisher = RegistryPublisher("genrm", RoutingSpec(default_model="judge"))
    publisher.set_model(
        "judge", state="READY", route_mode="DIRECT", weight_source="STATIC",
        served_model_name="judge-v1",
    )  # fmt: skip
    publisher.set_engine("judge", "judge/replica-0", base_url=url, state="READY")
    samples = [
        Sample("a", "g0", [1], [2], prompt="2+2?", response="4", label="4"),
        Sample("b", "g1", [1], [2], prompt="a riddle", response="?", label=None),
    ]
    stage = RewardStage([plugin_manager.reward_adapter("genrm-judge")], role="genrm")
    clients = RoleClients({"genrm": publisher.snapshot})

    report = asyncio.run(stage.run(samples, StageContext(0, clients)))
    assert [s.reward for s in samples] == [1.0, 0.0]
    assert report.counts == {"genrm-judge.scored": 2, "genrm-judge.parse_failures": 1}
    asked = [str(s["body"]["messages"][1]["content"]) for s in seen]  # type: ignore[index]
    assert any("2+2?" in q and "Reference answer:\n4" in q for q in asked)
    assert {s["body"]["model"] for s in seen} == {"judge-v1"}  # type: ignore[index]
    assert {s["key"] for s in seen} == {"g0", "g1"}  # the group is the affinity key


def test_a_multi_turn_trajectory_is_judged_whole(
    plugin_manager: PluginManager, judge_engine: tuple[str, list[dict[str, object]]]
) -> None:
    from relax_core import (
        RegistryPublisher,
        RewardStage,
        RoleClients,
        RoutingSpec,
        Sample,
        StageContext,
    )

    url, seen = judge_engine
    publisher = RegistryPublisher("genrm", RoutingSpec(default_model="judge"))
    publisher.set_model(
        "judge", state="READY", route_mode="DIRECT", weight_source="STATIC",
        served_model_name="judge-v1",
    )  # fmt: skip
    publisher.set_engine("judge", "judge/replica-0", base_url=url, state="READY")
    conversation = [
        {"role": "system", "content": "You can use a calculator."},
        {"role": "user", "content": "what is 2+2?"},
        {"role": "assistant", "content": '<tool_call>{"name": "calculator"}</tool_call>'},
        {"role": "tool", "content": "<tool_response>\n4\n</tool_response>"},
        {"role": "assistant", "content": "4"},
    ]
    # Its prompt and last answer alone would not show the judge the question ("2+2").
    sample = Sample(
        "t", "g0", [1], [2, 3, 4], prompt="(see the conversation)", response="4", label="4",
        metadata={"trajectory": {"messages": conversation}}, loss_mask=(1, 0, 1),
    )  # fmt: skip
    stage = RewardStage([plugin_manager.reward_adapter("genrm-judge")], role="genrm")
    before = len(seen)
    asyncio.run(stage.run([sample], StageContext(0, RoleClients({"genrm": publisher.snapshot}))))
    assert sample.reward == 1.0
    (asked,) = [s["body"]["messages"] for s in seen[before:]]  # type: ignore[index]
    text = asked[1]["content"]
    # Every message of the conversation, in order, with its role; then the reference.
    at = [text.index(f"[{m['role']}]\n{m['content']}") for m in conversation]
    assert at == sorted(at)
    assert text.endswith("Reference answer:\n4")
