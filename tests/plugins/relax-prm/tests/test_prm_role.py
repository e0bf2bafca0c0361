"""The prm test plugin: found through its entry point, its record, and its adapter's rules.

Its end-to-end run (``relax plan`` in every layout, ``relax serve`` on hf engines, every gateway
route) is ``tests/commands/test_third_party_role.py``.
"""

from __future__ import annotations

import pytest
from relax_prm import PRM_ROLE, STEP_TAG, PRMAdapter, render_steps

from relax_core import AdaptContext, InvalidRequestError, PluginManager


def ctx(*, stream: bool = False) -> AdaptContext:
    return AdaptContext(
        role="prm", model=None, model_path=None, served_model_name=None, stream=stream
    )


def adapt(body: dict[str, object], *, stream: bool = False) -> dict[str, object] | None:
    adapter = PRMAdapter()
    return adapter.adapt_generate(adapter.check_generate(body), ctx(stream=stream)).payload


def test_installed_plugin_registers_the_prm_role_through_its_entry_point(
    plugin_manager: PluginManager,
) -> None:
    registered = plugin_manager.registered("roles")["prm"]
    assert (registered.plugin, registered.distribution) == ("prm", "relax-prm")
    role = registered.record
    assert role is PRM_ROLE
    assert role.allowed_weight_sources == frozenset({"STATIC"}) and role.static_weights
    assert (role.default_route_mode, role.deferrable, role.generation_phase) == (
        "DIRECT",
        True,
        False,
    )
    assert (role.health_schema, role.title) == (2, "PRM")
    assert isinstance(role.gateway_adapter(), PRMAdapter)
    assert role.openapi.input_names == PRMAdapter.generate_inputs == ("steps",)


def test_steps_are_forwarded_as_one_text_with_a_tag_after_each_step() -> None:
    body = {
        "question": "2+2?",
        "steps": ["2+2 is 4.", "So 4."],
        "sampling_params": {"max_new_tokens": 1},
        "model": "scorer",
    }
    payload = adapt(body)
    assert payload == {
        "text": f"2+2?\n2+2 is 4. {STEP_TAG}\nSo 4. {STEP_TAG}\n",
        "sampling_params": {"max_new_tokens": 1},
        "model": "scorer",
    }
    assert render_steps(["a"]) == f"a {STEP_TAG}\n"


def test_raw_text_and_input_ids_pass_through_unchanged() -> None:
    assert adapt({"text": "hello"}) is None
    assert adapt({"input_ids": [1, 2, 3]}, stream=True) is None


def test_steps_with_another_input_is_a_bad_request() -> None:
    with pytest.raises(InvalidRequestError, match="exactly one input") as info:
        adapt({"text": "x", "steps": ["a"]})
    assert info.value.field == "steps"


@pytest.mark.parametrize(
    ("steps", "field"),
    [
        ([], "steps"),
        ("one step", "steps"),
        (["fine", ""], "steps[1]"),
        (["fine", 3], "steps[1]"),
        ([f"tagged {STEP_TAG}"], "steps[0]"),
    ],
)
def test_a_bad_steps_list_names_the_offending_field(steps: object, field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        PRMAdapter().adapt_generate({"steps": steps}, ctx())
    assert info.value.field == field


def test_steps_cannot_be_streamed() -> None:
    with pytest.raises(InvalidRequestError, match="'stream'") as info:
        adapt({"steps": ["a"], "stream": True}, stream=True)
    assert info.value.field == "stream"


def test_a_question_needs_steps_and_must_be_a_string() -> None:
    with pytest.raises(InvalidRequestError) as info:
        adapt({"text": "x", "question": "q"})
    assert info.value.field == "question"
    with pytest.raises(InvalidRequestError) as info:
        adapt({"steps": ["a"], "question": 7})
    assert info.value.field == "question"
