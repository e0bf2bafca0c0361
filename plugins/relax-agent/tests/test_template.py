"""The chat template applied once per turn boundary: the core's rendering equals transformers'
for the model's own template and tokenizer, and a trajectory built from the policy's ids and
the boundaries' ids is the tokenizer's own tokenization of the whole conversation — while a
template that is not prefix-stable is refused, never re-tokenized around."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from relax_agent import ChatTurns, NotPrefixStable

WHERE = "roles.rollout.models.policy"

FIRST = [
    {"role": "system", "content": "You can use a calculator."},
    {"role": "user", "content": "Question: what is 3 * 4? Answer:"},
]
TURNS = [
    '<tool_call>{"name": "calculator", "arguments": {"expression": "3 * 4"}}</tool_call>',
    "The answer is 12.",
]
OBSERVATION = [{"role": "tool", "content": "<tool_response>\n12\n</tool_response>"}]


@pytest.fixture(scope="module")
def hf_tokenizer(agent_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(agent_model), local_files_only=True)


def _ids(tok: Any, messages: list[dict[str, str]], gen: bool) -> list[int]:
    out = tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_rendering_and_the_prompt_are_transformers_own(
    agent_model: Path, hf_tokenizer: Any
) -> None:
    turns = ChatTurns(str(agent_model), where=WHERE)
    conversation = [*FIRST, {"role": "assistant", "content": TURNS[0]}, *OBSERVATION]
    for gen in (True, False):
        ours = turns.render(conversation, add_generation_prompt=gen)
        assert ours == hf_tokenizer.apply_chat_template(
            conversation, add_generation_prompt=gen, tokenize=False
        )
    assert turns.prompt(FIRST) == _ids(hf_tokenizer, FIRST, True)
    assert turns.eos_id == hf_tokenizer.eos_token_id


@pytest.mark.parametrize("eos", [True, False], ids=["turn-ended-by-eos", "turn-cut-by-length"])
def test_a_trajectory_is_the_tokenizers_own_tokenization_of_the_conversation(
    agent_model: Path, hf_tokenizer: Any, eos: bool
) -> None:
    turns = ChatTurns(str(agent_model), where=WHERE)
    ids = turns.prompt(FIRST)
    history: list[dict[str, str]] = list(FIRST)
    policy_spans = []
    for k, text in enumerate(TURNS):
        # What the engine would return for the turn: the text's ids, with the EOS if sampled.
        sampled = turns.encode(text) + ([turns.eos_id] if eos else [])  # type: ignore[list-item]
        policy_spans.append((len(ids), len(ids) + len(sampled)))
        ids += sampled
        if k == len(TURNS) - 1:
            break
        between = turns.boundary(history, text, eos, OBSERVATION)
        ids += between
        history += [{"role": "assistant", "content": text}, *OBSERVATION]
    whole = [*history, {"role": "assistant", "content": TURNS[-1]}]
    expected = _ids(hf_tokenizer, whole, False)
    if eos:
        # The template closes the last turn with EOS and a newline; the trajectory ends at EOS.
        assert ids == expected[: len(ids)] and len(expected) - len(ids) == 1
    else:
        # Cut by length: no EOS in the policy's ids, the template's closing is the boundary's.
        text = turns.decode(ids)
        assert hf_tokenizer.apply_chat_template(whole, tokenize=False).startswith(text)
    # The policy's ids are where the trajectory says, untouched.
    for (start, end), text in zip(policy_spans, TURNS, strict=True):
        assert turns.decode(ids[start:end]).startswith(text)


def test_a_template_that_rewrites_earlier_turns_is_refused(
    agent_model: Path, tmp_path: Path
) -> None:
    # Like templates that drop an earlier turn's reasoning: only the last assistant turn is
    # written in full, earlier ones shortened.
    model = tmp_path / "rewriting"
    model.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).write_text((agent_model / name).read_text())
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}(earlier answer)"
        "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    turns = ChatTurns(str(model), where=WHERE)
    with pytest.raises(NotPrefixStable, match="changes the policy's turn once another follows"):
        turns.boundary(FIRST, TURNS[0], True, OBSERVATION)


def test_a_model_without_a_chat_template_is_refused_naming_the_model(
    agent_model: Path, tmp_path: Path
) -> None:
    from relax_core import ConfigError

    model = tmp_path / "plain"
    model.mkdir()
    (model / "tokenizer.json").write_text((agent_model / "tokenizer.json").read_text())
    config = json.loads((agent_model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="has no chat template") as info:
        ChatTurns(str(model), where=WHERE)
    assert info.value.path == f"{WHERE}.model_path"
