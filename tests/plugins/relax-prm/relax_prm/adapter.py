"""The prm gateway adapter: a solution's ``steps`` rendered into the PRM's prompt format.

A body with ``steps`` (a non-empty list of non-empty strings) and an optional ``question`` is
forwarded as one ``text``: the question, then every step followed by :data:`STEP_TAG` (the
positions whose scores a process reward model reads). A body with raw ``text`` or ``input_ids``
passes through unchanged; the engine's answer is relayed as it is.
"""

from __future__ import annotations

from typing import Any

from relax_core import AdaptContext, Adapted, InvalidRequestError, RoleAdapter

__all__ = ["STEPS_INPUT", "STEP_TAG", "PRMAdapter", "render_steps"]

#: The tag after each step (Math-Shepherd's): the PRM scores the token at each tag.
STEP_TAG = "ки"

#: The ``steps`` input of ``/prm/generate`` as JSON Schema (the role's OpenAPI document).
STEPS_INPUT = {
    "required": ["steps"],
    "properties": {
        "steps": {
            "type": "array",
            "minItems": 1,
            "items": {"type": "string", "minLength": 1},
            "description": "The solution's steps, in order; each is scored.",
        },
        # null is taken as absent, as the gateway does for every optional field.
        "question": {"type": ["string", "null"], "description": "The problem the steps solve."},
        "stream": {"const": False, "description": "steps cannot be streamed"},
    },
}

_STEPS_ONLY = frozenset({"steps", "question"})


def render_steps(steps: list[str], question: str | None = None) -> str:
    """The PRM prompt: the question (if any), then one line per step ending in the step tag."""
    head = f"{question}\n" if question else ""
    return head + "".join(f"{step} {STEP_TAG}\n" for step in steps)


class PRMAdapter(RoleAdapter):
    """Renders ``steps`` into ``text``; raw ``text`` / ``input_ids`` pass through.

    ``steps`` with ``stream: true`` is refused (400): a scoring request is answered once.
    """

    generate_inputs = ("steps",)

    def adapt_generate(self, payload: dict[str, Any], ctx: AdaptContext) -> Adapted:
        steps = payload.get("steps")
        if steps is None:
            if payload.get("question") is not None:
                raise InvalidRequestError("'question' goes with 'steps'", field="question")
            return Adapted()
        if not isinstance(steps, list) or not steps:
            raise InvalidRequestError("'steps' must be a non-empty list of strings", field="steps")
        for i, step in enumerate(steps):
            if not isinstance(step, str) or not step.strip():
                raise InvalidRequestError(
                    f"'steps[{i}]' must be a non-empty string", field=f"steps[{i}]"
                )
            if STEP_TAG in step:
                raise InvalidRequestError(
                    f"'steps[{i}]' holds the step tag {STEP_TAG!r}; the adapter adds it after "
                    "each step",
                    field=f"steps[{i}]",
                )
        question = payload.get("question")
        if question is not None and not isinstance(question, str):
            raise InvalidRequestError("'question' must be a string", field="question")
        if ctx.stream:
            raise InvalidRequestError(
                "'steps' cannot be combined with 'stream': true (a scoring request is answered "
                "once); drop 'stream'",
                field="stream",
            )
        forwarded = {k: v for k, v in payload.items() if k not in _STEPS_ONLY}
        forwarded["text"] = render_steps(steps, question)
        return Adapted(payload=forwarded)
