"""The chat template of a multi-turn trajectory, applied once per turn boundary.

A trajectory's token ids are built, never re-tokenized: the prompt is the template's rendering
of the environment's first messages (with the generation prompt), tokenized once; each policy
turn is appended as the ids the engine sampled; at each turn boundary only the *new* text is
tokenized — what the template puts after the policy's words (the end of its turn) and the
observation's messages, up to the next generation prompt. That text is found by rendering the
conversation before and after the boundary and taking the difference, which is only sound when
the template is **prefix-stable** at that boundary: the rendering of the conversation so far is
a prefix of the rendering with the policy's turn, which holds the policy's text verbatim, and
that one a prefix of the rendering with the observation appended. :meth:`ChatTurns.boundary`
checks all three at every boundary and raises :class:`NotPrefixStable` otherwise (a template
that rewrites earlier turns — one that strips an earlier turn's reasoning, say — cannot be
used token-exactly; the error says which check failed).

The template is the model's own (``chat_template.jinja`` beside the tokenizer, else
``tokenizer_config.json``'s ``chat_template``), rendered with jinja2 the way transformers
renders it (a sandboxed environment, ``trim_blocks`` and ``lstrip_blocks``, the tokenizer's
special tokens as variables); text becomes ids with the model's ``tokenizer.json`` (the
``tokenizers`` library), with no special tokens added.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from relax_core import ConfigError, RelaxError

__all__ = ["ChatTurns", "NotPrefixStable"]


class NotPrefixStable(RelaxError, ValueError):
    """A chat template rewrites earlier turns (an earlier rendering is not a prefix of a later one),
    so a multi-turn trajectory's ids cannot be extended without re-tokenizing."""


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


class ChatTurns:
    """The generation model's chat template and tokenizer, for trajectories.

    :param model_path: the model's directory.
    :param where: the model's key path (errors name it).
    :raises ConfigError: no ``tokenizer.json``, no chat template, or jinja2 / tokenizers is
        not installed.
    """

    def __init__(self, model_path: str, *, where: str) -> None:
        try:
            import jinja2.sandbox
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise ConfigError(
                where,
                f"multi-turn rollouts render the chat template with jinja2 and tokenize with "
                f"the tokenizers library: {exc}; pip install them",
            ) from None
        root = Path(model_path)
        if not (root / "tokenizer.json").exists():
            raise ConfigError(
                f"{where}.model_path",
                f"no tokenizer.json in {model_path}: multi-turn rollouts tokenize with the "
                "generation model's own tokenizer",
            )
        self._tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
        config: dict[str, Any] = {}
        if (root / "tokenizer_config.json").exists():
            config = json.loads((root / "tokenizer_config.json").read_text())
        source = None
        if (root / "chat_template.jinja").exists():
            source = (root / "chat_template.jinja").read_text()
        else:
            raw = config.get("chat_template")
            if isinstance(raw, list):  # named templates: the default one
                raw = next((t.get("template") for t in raw if t.get("name") == "default"), None)
            source = raw if isinstance(raw, str) else None
        if not source:
            raise ConfigError(
                f"{where}.model_path",
                f"the tokenizer in {model_path} has no chat template (chat_template.jinja or "
                "tokenizer_config.json's chat_template): a multi-turn rollout renders each turn "
                "with it",
            )

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda v, indent=None: json.dumps(
            v, ensure_ascii=False, indent=indent
        )
        env.globals["raise_exception"] = raise_exception
        self._template = env.from_string(source)
        self._specials = {
            k: _token_text(config.get(k))
            for k in ("bos_token", "eos_token", "pad_token", "unk_token")
        }
        eos = self._specials.get("eos_token")
        eos_id = self._tokenizer.token_to_id(eos) if eos else None
        self.eos_text: str | None = eos
        #: The id of the tokenizer's end-of-turn (EOS) token, if it has one.
        self.eos_id: int | None = eos_id

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool) -> str:
        """The template's text of ``messages``."""
        return str(
            self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                **{k: v for k, v in self._specials.items() if v is not None},
            )
        )

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``, no special tokens added (the template wrote its own)."""
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens kept."""
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=False))

    def prompt(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The prompt of a trajectory: ``messages`` rendered with the generation prompt,
        tokenized once."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    def boundary(
        self,
        history: Sequence[Mapping[str, Any]],
        policy_text: str,
        ended_with_eos: bool,
        observation: Sequence[Mapping[str, Any]],
    ) -> list[int]:
        """The ids that follow a policy turn: the end of its turn as the template writes it
        (less the EOS token when the policy sampled it: those ids are the policy's), then
        ``observation`` up to the next generation prompt.

        ``history``: the conversation before the policy's turn (its rendering with the
        generation prompt is what the policy continued); ``policy_text``: the turn's text.

        :raises NotPrefixStable: the template is not prefix-stable at this boundary.
        """
        turn = {"role": "assistant", "content": policy_text}
        head = self.render(history, add_generation_prompt=True)
        closed = self.render([*history, turn], add_generation_prompt=False)
        after = self.render([*history, turn, *observation], add_generation_prompt=True)
        if not closed.startswith(head):
            raise NotPrefixStable(
                "the conversation rendered with the policy's turn does not start with its "
                "rendering before the turn (the template changes earlier turns)"
            )
        if not closed[len(head) :].startswith(policy_text):
            raise NotPrefixStable(
                "the template does not write the policy's turn verbatim after the generation "
                f"prompt (it wrote {closed[len(head) : len(head) + 80]!r}, the policy "
                f"{policy_text[:80]!r})"
            )
        if not after.startswith(closed):
            raise NotPrefixStable(
                "the conversation rendered with the observation does not start with its "
                "rendering without it (the template changes the policy's turn once another "
                "follows)"
            )
        end = closed[len(head) + len(policy_text) :]
        if ended_with_eos and self.eos_text:
            if not end.startswith(self.eos_text):
                raise NotPrefixStable(
                    f"the policy ended its turn with {self.eos_text!r} but the template ends "
                    f"an assistant turn with {end[:40]!r}"
                )
            end = end[len(self.eos_text) :]
        return self.encode(end + after[len(closed) :])
