"""Tiny, random-initialised causal LMs made locally: no hub, no network, deterministic.

:func:`make_tiny_model` writes a standard transformers checkpoint directory (a Llama
architecture with a few small layers, ``model.safetensors``, ``config.json``,
``generation_config.json``) and a byte-level BPE tokenizer trained on a built-in corpus, with a
ChatML chat template. The same ``seed`` gives byte-identical weights and tokenizer.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "TINY_SIZES", "make_tiny_model"]

#: Special tokens of the tiny tokenizer; ``<|im_end|>`` ends a turn and is the EOS.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")

#: ChatML, as Qwen models use it.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

#: Model shapes by name. ``tiny`` is what tests and the demo use (about 4M parameters);
#: ``small`` (about 0.5B) is for GPUs.
TINY_SIZES: Mapping[str, Mapping[str, int]] = {
    "tiny": {
        "hidden_size": 256,
        "intermediate_size": 1024,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "micro": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
    },
    # The shape of a 0.6B-class policy (Qwen3-0.6B's layers, this tokenizer's vocabulary):
    # about 0.5B parameters, what relax run's GPU example measures phase switches with.
    "small": {
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
    },
}

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with one step.
Reinforcement learning trains a policy to maximise reward. The rollout engine samples responses,
the reward model judges them, and the teacher scores every token of the student's answer.
Question: what is two plus two? Answer: two plus two is four. Question: what is the capital of
France? Answer: the capital of France is Paris. Question: name a prime number. Answer: seven.
def add(a, b):
    return a + b

for i in range(10):
    print(i, i * i)

import json
data = {"name": "relax", "roles": ["rollout", "genrm", "teacher"], "version": 2}
print(json.dumps(data, indent=2))
The engine answers health checks, generates text, reports log-probabilities, releases its memory
when another role needs the GPU and resumes it afterwards. Weights are updated from the trainer
after every step, and the weight version moves with them.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 1000 3.14159 2.71828 42.
Once upon a time there was a little model that learned to count, to spell and to say hello.
Hello! How are you today? I am fine, thank you. What would you like to talk about?
User: please write a short poem about the sea.
Assistant: The sea is wide, the sea is deep, it sings the sailors off to sleep.
Mathematics: if x + 3 = 7 then x = 4; the square of 12 is 144; the sum of 1 to 10 is 55.
Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor incididunt.
Über, café, naïve, façade, coöperate, résumé: words with accents are bytes too. 你好, 世界。
"""


def _train_tokenizer(vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeating the corpus makes pair counts large enough for a stable merge order.
    tok.train_from_iterator([_CORPUS] * 8, trainer=trainer)
    return tok


def make_tiny_model(
    directory: str | os.PathLike[str],
    *,
    seed: int = 0,
    size: str = "tiny",
    vocab_size: int = 512,
    dtype: str = "float32",
) -> Path:
    """Write a tiny random-initialised Llama checkpoint and its tokenizer into ``directory``.

    :param seed: seeds the weight initialisation; the same seed gives identical files.
    :param size: a key of :data:`TINY_SIZES`.
    :param vocab_size: the tokenizer's target vocabulary (the model's is the tokenizer's size).
    :param dtype: ``float32`` (default), ``bfloat16`` or ``float16``.
    :returns: the directory.
    :raises ValueError: an unknown ``size`` or ``dtype``.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if size not in TINY_SIZES:
        raise ValueError(f"size={size!r}: known sizes are {sorted(TINY_SIZES)}")
    torch_dtype = {
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
    }.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"dtype={dtype!r}: use float32, bfloat16 or float16")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)

    raw = _train_tokenizer(vocab_size)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        unk_token=None,
        additional_special_tokens=["<|endoftext|>", "<|im_start|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)

    shape = TINY_SIZES[size]
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|pad|>"),
        **shape,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        # A larger init than transformers' default so a random model's next-token
        # distributions are far from uniform: seeded sampling and top-k are then meaningful.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.08 if "embed" in name or "lm_head" in name else 0.05)
    model = model.to(torch_dtype)
    model.generation_config.do_sample = False
    model.save_pretrained(out, safe_serialization=True)
    with open(out / "relax_tiny.json", "w") as f:
        json.dump(
            {"seed": seed, "size": size, "vocab_size": len(tokenizer), "dtype": dtype}, f, indent=2
        )
    return out
