"""The rollout role plugin: registration and raw-generation request checks."""

from __future__ import annotations

import pytest
from relax_rollout import RolloutAdapter

from relax_core import AdaptContext, InvalidRequestError, PluginManager


def test_installed_plugin_registers_rollout_role(plugin_manager: PluginManager) -> None:
    role = plugin_manager.role("rollout")
    assert role.default_route_mode == "SGLANG_ROUTER"
    assert role.default_weight_source == "ACTOR"
    assert role.deferrable is False
    assert isinstance(role.gateway_adapter(), RolloutAdapter)
    assert plugin_manager.registered("roles")["rollout"].distribution == "relax-rollout"


def test_rollout_record_says_what_the_core_needs_to_know(plugin_manager: PluginManager) -> None:
    role = plugin_manager.role("rollout")
    # It generates the batch: under mode = "defer" it runs in the generation phase.
    assert role.generation_phase is True and role.static_weights is False
    assert (role.health_schema, role.title) == (2, "Rollout")
    # Its OpenAPI document describes the batches its adapter accepts.
    assert role.openapi.batched_generate is True
    assert role.openapi.input_names == RolloutAdapter.generate_inputs == ()


def test_single_and_batched_generate_bodies_pass_through() -> None:
    adapter = RolloutAdapter()
    ctx = AdaptContext(
        role="rollout", model="policy", model_path=None, served_model_name=None, stream=False
    )
    for body in (
        {"text": "hi", "sampling_params": {"max_new_tokens": 4}},
        {"input_ids": [[1, 2], [3]], "sampling_params": {"temperature": 0.0}},
        {"text": ["a", "b"], "return_logprob": True},
    ):
        assert adapter.adapt_generate(adapter.check_generate(body), ctx).payload is None


def test_batched_item_error_names_its_index() -> None:
    with pytest.raises(InvalidRequestError, match=r"input_ids\[1\]") as info:
        RolloutAdapter().check_generate({"input_ids": [[1], [-4]]})
    assert info.value.field == "input_ids[1]"


def test_batched_generate_cannot_stream() -> None:
    with pytest.raises(InvalidRequestError, match="cannot be streamed"):
        RolloutAdapter().check_generate({"text": ["a", "b"], "stream": True})


def test_bad_sampling_params_name_the_field() -> None:
    with pytest.raises(InvalidRequestError, match=r"sampling_params\.max_new_tokens"):
        RolloutAdapter().check_generate({"text": "a", "sampling_params": {"max_new_tokens": "x"}})
