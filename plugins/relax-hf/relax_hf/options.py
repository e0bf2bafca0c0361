"""The hf engine's own options: a model's ``engine`` table, read into :class:`HFEngineOptions`.

The options every engine backend may read (dtype, memory fraction, context length, …) are the
core's :class:`~relax_core.EngineOptions`; these are the ``relax-hf serve`` flags only this
engine has. The core reads a model's ``engine`` table into the record (unknown keys, wrong
types and out-of-range values refused at their key path before anything starts), and each
launch carries it as ``EngineLaunchSpec.backend_options``::

    [roles.rollout.models.policy.engine]
    memory_handoff = true
    disable_cuda_graph = true

Each option is the flag of its name (``memory_handoff`` → ``--memory-handoff``), given only
when it differs from the default, so a model without the table starts the engine exactly as
before. A model's ``extra_args`` still reach the command line after them (and win).
"""

from __future__ import annotations

from typing import Literal

import attrs

from relax_core import ConfigError, ConfigReader, EngineLaunchSpec

__all__ = ["ATTENTION_BACKENDS", "HFEngineOptions", "hf_options", "options_argv"]

#: ``--attention-backend``'s values (:attr:`HFEngineOptions.attention_backend`): the Triton
#: kernel of :mod:`relax_hf.paged_attention`, or the gather path
#: (:func:`relax_hf.modeling.gathered_attention`).
ATTENTION_BACKENDS = ("triton", "torch_native")


@attrs.frozen
class HFEngineOptions:
    """The ``relax-hf serve`` options a job file gives in a model's ``engine`` table.

    ``memory_handoff`` (CUDA): a release parks the weights' and the KV cache pool's GPU memory
    for the next engine on the GPU to take over (docs/hf-engine.md). ``disable_cuda_graph``:
    decode steps run eagerly. ``cuda_graph_max_bs``: the largest decode batch captured as a
    CUDA graph (default: ``max_running_requests``). ``cuda_graph_backend_prefill``: ``full``
    (prefill steps of a few prompts after cached prefixes replay CUDA graphs where decode steps
    do) or ``disabled``; ``cuda_graph_max_bs_prefill``: rows x padded tokens such a graph holds
    at most (default 2048). ``enable_torch_compile`` (CUDA): fuse the
    element-wise parts of the forward pass. ``max_total_tokens``: the KV cache pool in tokens
    (overrides ``mem_fraction_static``). ``attn_implementation``: ``sdpa`` or ``eager``.
    ``threads``: torch CPU threads (0: torch's default). ``dist_timeout``: seconds a
    multi-node replica waits for its nodes and for one collective.
    ``constrained_json_disable_any_whitespace`` / ``constrained_json_max_whitespace_cnt``:
    JSON-schema output without free whitespace / with at most that many whitespace
    characters in a row. ``disable_radix_cache``: no prefix cache (every prompt is
    prefilled in full). ``enable_custom_logit_processor``: requests may carry a
    ``custom_logit_processor`` (serialized code the engine runs; SGLang's flag).
    ``enable_cache_report``: the OpenAI routes' ``usage`` carries
    ``prompt_tokens_details.cached_tokens`` (SGLang's flag). ``disable_overlap_schedule``: a
    decode step starts only once the last one's tokens are appended (SGLang's flag).
    ``num_continuous_decode_steps``: while sequences run, new requests are admitted at most
    once every that many steps (SGLang's flag; 1: at every step). ``attention_backend``: the
    decode step's attention, ``triton`` (each row's positions read in place from the pool;
    CUDA) or ``torch_native`` (gather + SDPA); default: triton where it can run (SGLang's flag).
    """

    memory_handoff: bool = False
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = attrs.field(
        default=None, metadata={"check": ConfigReader.at_least(1)}
    )
    cuda_graph_backend_prefill: Literal["full", "disabled"] = "full"
    cuda_graph_max_bs_prefill: int | None = attrs.field(
        default=None, metadata={"check": ConfigReader.at_least(16)}
    )
    enable_torch_compile: bool = False
    max_total_tokens: int | None = attrs.field(
        default=None, metadata={"check": ConfigReader.at_least(1)}
    )
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    threads: int = attrs.field(default=0, metadata={"check": ConfigReader.at_least(0)})
    dist_timeout: float = attrs.field(default=300.0, metadata={"check": ConfigReader.positive})
    constrained_json_disable_any_whitespace: bool = False
    constrained_json_max_whitespace_cnt: int | None = attrs.field(
        default=None, metadata={"check": ConfigReader.at_least(0)}
    )
    disable_radix_cache: bool = False
    enable_custom_logit_processor: bool = False
    enable_cache_report: bool = False
    disable_overlap_schedule: bool = False
    num_continuous_decode_steps: int = attrs.field(
        default=1, metadata={"check": ConfigReader.at_least(1)}
    )
    attention_backend: Literal["triton", "torch_native"] | None = None


def hf_options(spec: EngineLaunchSpec) -> HFEngineOptions:
    """The hf options of ``spec``: its ``backend_options``, or the defaults for a spec built
    without them.

    :raises ConfigError: ``backend_options`` is another backend's record.
    """
    options = spec.backend_options
    if options is None:
        return HFEngineOptions()
    if not isinstance(options, HFEngineOptions):
        raise ConfigError(
            f"engines.{spec.engine_id}.backend_options",
            f"the hf engine reads HFEngineOptions, got {type(options).__name__}",
        )
    return options


def options_argv(options: HFEngineOptions) -> list[str]:
    """The ``relax-hf serve`` flags of every option that differs from its default (each
    boolean option is off by default; its flag turns it on)."""
    argv: list[str] = []
    for field in attrs.fields(HFEngineOptions):
        value = getattr(options, field.name)
        if value == field.default:
            continue
        flag = "--" + field.name.replace("_", "-")
        argv += [flag] if isinstance(value, bool) else [flag, str(value)]
    return argv
