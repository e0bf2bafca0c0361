"""Job-file text for tests, built from Python values so that each test states only what its job
is about: :func:`job_text` writes the tables, :func:`colocated` the usual one-node colocated
layout, :func:`defer` a defer placement, :func:`hf` / :func:`sglang` / :func:`sim` a model table.

    job_text(
        **colocated(1),
        placement=defer("genrm"),
        models={"rollout.policy": hf("/m", weight_source="ACTOR"), "genrm.judge": hf("/m")},
    )
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

#: The hf engine's arguments that keep it on the CPU.
CPU = ["--device", "cpu"]


def toml_value(value: Any) -> str:
    """``value`` as a TOML value (a mapping as an inline table)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }"
    return "[" + ", ".join(toml_value(v) for v in value) + "]"


def _is_table_array(value: Any) -> bool:
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and bool(value)
        and all(isinstance(v, Mapping) for v in value)
    )


def _table(name: str, table: Mapping[str, Any]) -> list[str]:
    pairs = [
        f"{k} = {toml_value(v)}"
        for k, v in table.items()
        if not isinstance(v, Mapping) and not _is_table_array(v)
    ]
    nested = [(k, v) for k, v in table.items() if isinstance(v, Mapping) or _is_table_array(v)]
    out = [f"[{name}]", *pairs, ""] if pairs or not nested else []
    for key, value in nested:
        if isinstance(value, Mapping):
            out += _table(f"{name}.{key}", value)
        else:
            for item in value:
                out += [
                    f"[[{name}.{key}]]",
                    *(f"{k} = {toml_value(v)}" for k, v in item.items()),
                    "",
                ]
    return out


def job_text(**tables: Mapping[str, Any]) -> str:
    """A job file's text: each keyword a top-level table in the order given (a mapping inside
    one is a sub-table, a list of mappings an array of tables); ``models``, keyed
    ``"role.name"``, becomes the ``[roles.<role>.models.<name>]`` tables."""
    out: list[str] = []
    for name, table in tables.items():
        if name == "models":
            assert isinstance(table, Mapping)
            for key, model in table.items():
                role, model_name = key.split(".")
                out += _table(f"roles.{role}.models.{model_name}", model)
        else:
            out += _table(name, table)
    return "\n".join(out).rstrip("\n") + "\n"


def colocated(gpus: int, **cluster: Any) -> dict[str, dict[str, Any]]:
    """The ``cluster`` and ``training`` tables of one node of ``gpus`` GPUs (``cluster`` keys
    added), all of them the actor's, shared with the engines, which offload."""
    return {
        "cluster": {"num_nodes": 1, "gpus_per_node": gpus, **cluster},
        "training": {"actor_gpus": gpus, "colocate": True, "offload": True},
    }


def defer(*roles: str, **placement: Any) -> dict[str, Any]:
    """A ``[placement]`` table: mode defer, ``roles`` deferred, ``placement`` keys added."""
    return {"mode": "defer", "defer_roles": list(roles), **placement}


def hf(path: str, **keys: Any) -> dict[str, Any]:
    """A model table of the hf backend (``extra_args=CPU`` keeps its engine on the CPU)."""
    return {"backend": "hf", "model_path": path, **keys}


def sglang(path: str, **keys: Any) -> dict[str, Any]:
    """A model table of the sglang backend."""
    return {"backend": "sglang", "model_path": path, **keys}


def sim(path: str = "sim", **keys: Any) -> dict[str, Any]:
    """A model table of the test plugin's simulated engine (no model)."""
    return {"backend": "test-sim", "model_path": path, **keys}


def tiny(name: str, **keys: Any) -> dict[str, Any]:
    """The hf model table of the example's tiny model ``name`` (``tiny/<name>`` beside the job,
    as ``tests.support.run.make_models`` makes them) on the CPU."""
    return hf(f"tiny/{name}", extra_args=CPU, **keys)


def tiny_policy(**keys: Any) -> dict[str, Any]:
    """:func:`tiny` ``policy``, its weights the actor's (a CPU copy kept while it sleeps)."""
    return tiny("policy", weight_source="ACTOR", weights_cpu_backup=True, **keys)


def tiny_run(**keys: Any) -> dict[str, Any]:
    """A short ``[run]`` table for the tiny models: two steps of two prompts, two samples each
    of at most 8 tokens, trained by the test plugin's ``record-fields`` (``keys`` added)."""
    return {
        "steps": 2,
        "prompts_per_step": 2,
        "samples_per_prompt": 2,
        "max_new_tokens": 8,
        "trainer": "record-fields",
        **keys,
    }
