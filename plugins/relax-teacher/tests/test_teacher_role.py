"""The teacher role plugin: registration, prefill checks and the prefill answer contract."""

from __future__ import annotations

import pytest
from relax_teacher import TeacherAdapter, parse_prefill, prefill_payload

from relax_core import AdaptContext, InvalidRequestError, PluginManager, UpstreamError

CTX = AdaptContext(
    role="teacher", model="math", model_path=None, served_model_name=None, stream=False
)


def test_installed_plugin_registers_teacher_role(plugin_manager: PluginManager) -> None:
    role = plugin_manager.role("teacher")
    assert role.allowed_weight_sources == frozenset({"STATIC"})
    assert (role.default_route_mode, role.deferrable) == ("DIRECT", True)
    assert isinstance(role.gateway_adapter(), TeacherAdapter)
    assert plugin_manager.registered("roles")["teacher"].distribution == "relax-teacher"


def test_teacher_record_says_what_the_core_needs_to_know(plugin_manager: PluginManager) -> None:
    role = plugin_manager.role("teacher")
    assert role.static_weights is True and role.generation_phase is False
    assert (role.health_schema, role.title) == (2, "Teacher")
    # The prefill's extra field is documented in the teacher's OpenAPI document.
    assert set(role.openapi.generate_fields) == {"token_ids_logprob"}
    assert role.openapi.input_names == TeacherAdapter.generate_inputs == ()


def test_prefill_payload_scores_every_response_token() -> None:
    body = prefill_payload([5, 6, 7], [8, 9], top_k=4)
    assert body["input_ids"] == [5, 6, 7, 8, 9]
    assert body["logprob_start_len"] == 2
    assert body["sampling_params"]["max_new_tokens"] == 0
    assert body["return_logprob"] is True and body["top_logprobs_num"] == 4


def test_prefill_payload_passes_the_adapter_unchanged() -> None:
    adapter = TeacherAdapter()
    body = adapter.check_generate(prefill_payload([1, 2], [3], top_k=2, token_ids_logprob=[4, 5]))
    assert adapter.adapt_generate(body, CTX).payload is None


def test_top_k_without_return_logprob_is_a_bad_request() -> None:
    with pytest.raises(InvalidRequestError, match="return_logprob") as info:
        TeacherAdapter().adapt_generate({"input_ids": [1, 2], "top_logprobs_num": 3}, CTX)
    assert info.value.field == "return_logprob"


def test_logprob_start_beyond_the_input_is_a_bad_request() -> None:
    body = {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 2}
    with pytest.raises(InvalidRequestError, match="prompt_len - 1"):
        TeacherAdapter().adapt_generate(body, CTX)


def test_parse_prefill_drops_the_prompt_position_and_keeps_top_k() -> None:
    answer = {
        "meta_info": {
            "input_token_logprobs": [[None, 7, None], [-0.5, 8, None], [-1.5, 9, None]],
            "input_top_logprobs": [None, [[-0.1, 3, None], [-0.2, 4, None]], [[-0.3, 5, None]]],
        }
    }
    result = parse_prefill(answer, 2)
    assert result.logprobs == (-0.5, -1.5)
    assert result.top_ids == ((3, 4), (5,))
    assert result.top_logprobs == ((-0.1, -0.2), (-0.3,))


def test_parse_prefill_rejects_a_wrong_number_of_logprobs() -> None:
    answer = {"meta_info": {"input_token_logprobs": [[None, 7, None], [-0.5, 8, None]]}}
    with pytest.raises(UpstreamError, match="expected response length \\+ 1 = 3"):
        parse_prefill(answer, 2)
