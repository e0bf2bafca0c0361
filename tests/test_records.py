"""The records plugins register are validated where they are built, naming the field."""

from __future__ import annotations

import pickle

import pytest

from relax_core.records import NAME_PATTERN, ROUTE_MODES, OpenAPINotes, RoleSpec, RouteMode


def role(**changes: object) -> RoleSpec:
    fields: dict[str, object] = {
        "name": "critic",
        "allowed_weight_sources": {"STATIC"},
        "default_route_mode": "DIRECT",
    }
    return RoleSpec(**{**fields, **changes})  # type: ignore[arg-type]


def test_route_modes_have_one_spelling() -> None:
    assert ROUTE_MODES == ("DIRECT", "SGLANG_ROUTER") == tuple(RouteMode)
    assert role(default_route_mode="SGLANG_ROUTER").default_route_mode is RouteMode.SGLANG_ROUTER


def test_the_name_pattern_is_shared_by_every_record_and_the_snapshot_schema() -> None:
    from relax_core.discovery import schema

    assert schema.NAME_PATTERN is NAME_PATTERN
    assert NAME_PATTERN.match("relax-prm.v2_1") and not NAME_PATTERN.match("2fast")


def test_a_role_record_defaults_to_what_a_plain_role_needs() -> None:
    spec = role()
    assert (spec.deferrable, spec.generation_phase, spec.health_schema) == (False, False, 2)
    assert spec.title == "Critic" and spec.openapi == OpenAPINotes()
    assert spec.static_weights is True
    assert role(allowed_weight_sources={"STATIC", "ACTOR"}).static_weights is False


def test_a_role_record_survives_pickling() -> None:
    # A record is a plain value: it can be handed to a Ray actor or a worker process.
    spec = role(openapi=OpenAPINotes(generate_fields={"x": {"type": "string"}}))
    assert pickle.loads(pickle.dumps(spec)) == spec


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"default_route_mode": "PD"}, r"default_route_mode='PD': must be one of DIRECT"),
        ({"health_schema": 3}, r"RoleSpec.health_schema=3: must be 1 or 2"),
        ({"health_schema": True}, r"RoleSpec.health_schema=True: must be 1 or 2"),
        ({"deferrable": "yes"}, r"'deferrable' must be <class 'bool'>"),
        ({"deferrable": True, "generation_phase": True}, r"cannot be deferrable as well"),
        ({"default_weight_source": "ACTOR"}, r"default_weight_source 'ACTOR' is not among"),
        ({"title": " "}, r"title must not be empty"),
        ({"name": "bad name"}, r"RoleSpec.name='bad name'"),
        ({"openapi": {"batched_generate": True}}, r"'openapi' must be <class"),
    ],
)
def test_a_bad_role_record_is_refused_naming_the_field(
    changes: dict[str, object], message: str
) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        role(**changes)


def test_openapi_notes_copy_their_json_and_name_each_extra_input() -> None:
    branch = {"required": ["steps"], "properties": {"steps": {"type": "array"}}}
    notes = OpenAPINotes(generate_inputs=[branch])
    branch["required"].append("mutated")
    assert notes.input_names == ("steps",)
    assert notes.generate_inputs == ({"required": ["steps"], "properties": branch["properties"]},)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"generate_inputs": [{"properties": {}}]}, r"generate_inputs\[0\]: an input is"),
        (
            {"generate_inputs": [{"required": ["a"], "properties": {"b": {}}}]},
            r"generate_inputs\[0\]",
        ),
        ({"generate_fields": {"x": 1}}, r"generate_fields: give \{field name: JSON Schema"),
        ({"generate_fields": {"x": {"default": object()}}}, r"generate_fields: not a JSON value"),
        ({"generate_answer": ["object"]}, r"generate_answer: give a JSON Schema object"),
        ({"generate_inputs": {"required": ["x"]}}, r"generate_inputs: give a sequence"),
    ],
)
def test_bad_openapi_notes_are_refused_naming_the_field(
    changes: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        OpenAPINotes(**changes)  # type: ignore[arg-type]
