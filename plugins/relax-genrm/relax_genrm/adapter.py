"""The genrm gateway adapter: the legacy messages protocol on ``/genrm/generate``.

A body with ``messages`` is rendered with the selected model's tokenizer and chat template,
forwarded to the engine as ``input_ids`` and answered as ``{"response": text}``. A body with raw
``text`` or ``input_ids`` passes through unchanged (the engine's own answer is relayed).

Tokenizers are loaded when the gateway starts (:meth:`GenRMAdapter.preload`, in the background;
the gateway's health says so until they are), and rendering runs in the gateway's thread pool
(``blocking = True``), never on its event loop.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from relax_core import AdaptContext, Adapted, InvalidRequestError, RoleAdapter, check_messages

__all__ = ["MESSAGES_INPUT", "GenRMAdapter", "TokenizerCache"]

log = logging.getLogger("relax.genrm")

#: Fields of a messages request that are not forwarded to the engine as-is.
_MESSAGE_ONLY = frozenset({"messages", "model", "route_key", "chat_template_kwargs"})

#: The messages input of ``/genrm/generate`` as JSON Schema (the role's OpenAPI document): a
#: chat conversation, never streamed (the judge answers one ``{"response": text}``).
MESSAGES_INPUT = {
    "required": ["messages"],
    "properties": {
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["role"],
                "properties": {
                    "role": {
                        "type": "string",
                        "minLength": 1,
                        "description": "system, user, assistant",
                    },
                    "content": {"type": ["string", "array", "null"]},
                },
            },
        },
        "stream": {"const": False, "description": "messages cannot be streamed"},
    },
}


class TokenizerCache:
    """Tokenizers by model path, loaded once with local files only. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokenizers: dict[str, Any] = {}

    def get(self, model_path: str) -> Any:
        """The tokenizer saved in ``model_path``.

        :raises InvalidRequestError: the directory holds no loadable tokenizer.
        """
        with self._lock:
            tok = self._tokenizers.get(model_path)
            if tok is None:
                from transformers import AutoTokenizer

                try:
                    tok = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
                except (OSError, ValueError) as exc:
                    raise InvalidRequestError(
                        f"cannot load the tokenizer of {model_path!r} to render 'messages' "
                        f"({type(exc).__name__}: {exc}); send raw 'input_ids' instead, or fix the "
                        "model's model_path"
                    ) from exc
                self._tokenizers[model_path] = tok
            return tok

    def __len__(self) -> int:
        with self._lock:
            return len(self._tokenizers)


class GenRMAdapter(RoleAdapter):
    """Renders ``messages`` into ``input_ids`` and answers ``{"response": text}``.

    ``messages`` with ``stream: true`` is refused (400): the judge protocol answers one text.
    """

    generate_inputs = ("messages",)
    blocking = True

    def __init__(self, tokenizers: TokenizerCache | None = None) -> None:
        self.tokenizers = tokenizers or TokenizerCache()

    def preload(self, model_paths: Mapping[str, str]) -> None:
        """Load every model's tokenizer and compile its chat template once.

        :raises InvalidRequestError: a model's tokenizer cannot be loaded (naming every such
            model; the others are loaded). Raw ``input_ids``/``text`` requests still work.
        """
        problems = []
        for model, path in model_paths.items():
            try:
                tok = self.tokenizers.get(path)
            except InvalidRequestError as exc:
                problems.append(f"{model}: {exc.message}")
                continue
            if getattr(tok, "chat_template", None) is not None:
                # The first render compiles the template: do it now, not on a caller's time.
                try:
                    tok.apply_chat_template(
                        [{"role": "user", "content": "warm-up"}],
                        tokenize=False,
                        add_generation_prompt=True,
                    )
                except Exception as exc:  # a template that needs kwargs: compiled on use
                    log.info("genrm model %s: chat template warm-up skipped: %s", model, exc)
        if problems:
            raise InvalidRequestError("cannot render 'messages' for " + "; ".join(problems))

    def render(
        self, messages: list[dict[str, Any]], ctx: AdaptContext, **template_kwargs: Any
    ) -> list[int]:
        """Token ids of ``messages`` under the model's chat template, with the generation prompt."""
        if not ctx.model_path:
            raise InvalidRequestError(
                f"genrm model {ctx.model!r} has no model_path known to the gateway, so 'messages' "
                "cannot be rendered; send raw 'input_ids' or 'text', or configure model_path"
            )
        tok = self.tokenizers.get(ctx.model_path)
        if getattr(tok, "chat_template", None) is None:
            raise InvalidRequestError(
                f"the tokenizer of genrm model {ctx.model!r} ({ctx.model_path}) has no chat "
                "template, so 'messages' cannot be rendered; send raw 'input_ids' or 'text'"
            )
        try:
            prompt = tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **template_kwargs
            )
        except Exception as exc:  # jinja raises its own errors for bad message shapes
            raise InvalidRequestError(
                f"the chat template of genrm model {ctx.model!r} rejected 'messages': "
                f"{type(exc).__name__}: {exc}",
                field="messages",
            ) from exc
        ids = tok.encode(prompt, add_special_tokens=False)
        if not ids:
            raise InvalidRequestError("'messages' rendered to no tokens", field="messages")
        return [int(i) for i in ids]

    def needs_model(self, payload: dict[str, Any]) -> bool:
        return payload.get("messages") is not None

    def adapt_generate(self, payload: dict[str, Any], ctx: AdaptContext) -> Adapted:
        messages = payload.get("messages")
        if messages is None:
            return Adapted()
        if ctx.stream:
            raise InvalidRequestError(
                "'messages' cannot be combined with 'stream': true (the judge answers one "
                "{\"response\": text}); drop 'stream' or send raw 'input_ids'",
                field="stream",
            )
        check_messages(messages)
        template_kwargs = payload.get("chat_template_kwargs") or {}
        if not isinstance(template_kwargs, dict):
            raise InvalidRequestError(
                "'chat_template_kwargs' must be an object", field="chat_template_kwargs"
            )
        forwarded = {k: v for k, v in payload.items() if k not in _MESSAGE_ONLY}
        forwarded["input_ids"] = self.render(messages, ctx, **template_kwargs)
        return Adapted(payload=forwarded, response=_judge_response)


def _judge_response(answer: Any) -> dict[str, Any]:
    if isinstance(answer, list):  # a batched engine answer: one text per input
        answer = answer[0] if answer else {}
    text = answer.get("text") if isinstance(answer, dict) else None
    if not isinstance(text, str):
        raise ValueError("the engine answer has no 'text' string")
    return {"response": text}
