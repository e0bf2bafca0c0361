"""Text prompts become the token ids SGLang would give the model (the tokenizer's specials)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import openai
import pytest
from relax_hf.testing import EngineServer

BOS = "<|endoftext|>"


def make_bos_model(source: Path, target: Path) -> Path:
    """The tiny model with a tokenizer that prepends a BOS token, as Llama 3's does."""
    from tokenizers import Tokenizer, processors

    shutil.copytree(source, target)
    path = target / "tokenizer.json"
    tok = Tokenizer.from_file(str(path))
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
            ),
        ]
    )
    tok.save(str(path))
    config = json.loads((target / "tokenizer_config.json").read_text())
    config["bos_token"] = BOS
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


@pytest.fixture(scope="module")
def bos_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_bos_model(tiny_model, tmp_path_factory.mktemp("bos") / "model")


@pytest.fixture(scope="module")
def bos_server(start_server: Any, bos_model: Path) -> EngineServer:
    return start_server("hf-bos", model=bos_model, served_model_name="bos")  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def tokenizer(bos_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bos_model)


GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def test_a_text_prompt_gets_the_tokenizers_bos_as_sglang_gives_it(
    bos_server: EngineServer, tokenizer: Any
) -> None:
    ids = tokenizer("Hello world")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    body = {"sampling_params": GREEDY, "return_logprob": True, "logprob_start_len": 0}
    by_text = bos_server.http.ok("/generate", {"text": "Hello world", **body})
    by_ids = bos_server.http.ok("/generate", {"input_ids": ids, **body})
    assert by_text["meta_info"]["prompt_tokens"] == len(ids)
    assert [e[1] for e in by_text["meta_info"]["input_token_logprobs"]] == ids
    assert by_text["output_ids"] == by_ids["output_ids"]


def test_a_batch_of_texts_gets_one_bos_per_prompt(bos_server: EngineServer, tokenizer: Any) -> None:
    out = bos_server.http.ok(
        "/generate", {"text": ["Hello", "The sea is"], "sampling_params": GREEDY}
    )
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [
        len(tokenizer(t)["input_ids"]) for t in ("Hello", "The sea is")
    ]


def test_openai_prompts_count_the_bos_and_chat_adds_no_second_one(
    bos_server: EngineServer, tokenizer: Any
) -> None:
    client = openai.OpenAI(base_url=bos_server.url + "/v1", api_key="none", max_retries=0)
    done = client.completions.create(model="bos", prompt="Hello world", max_tokens=2)
    assert done.usage is not None
    assert done.usage.prompt_tokens == len(tokenizer("Hello world")["input_ids"])
    echoed = client.completions.create(
        model="bos", prompt="Hello world", max_tokens=2, echo=True, temperature=0
    )
    assert echoed.choices[0].text.startswith("Hello world")  # the prompt as sent, no BOS text
    messages = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model="bos", messages=messages, max_tokens=2)  # type: ignore[arg-type]
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert chat.usage is not None and chat.usage.prompt_tokens == len(expected)
