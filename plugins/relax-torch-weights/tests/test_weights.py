"""The torch side of a weight push: payloads of named tensors, and a bucket's flat buffer and
its SGLang ``flattened_bucket`` payload, in the layout the core's plan describes."""

from __future__ import annotations

import base64
import io
import pickle

import pytest
import torch
from relax_torch_weights import flatten_bucket, serialize_bucket, serialize_named_tensors
from safetensors.torch import load

from relax_core import plan_weight_buckets


def _named() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(3, 5, generator=g).to(torch.bfloat16),  # 30 bytes: b starts unaligned
        "b": torch.randn(4, generator=g),
    }


def test_serialize_named_tensors_round_trips_safetensors() -> None:
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    payload = serialize_named_tensors([("w", t)], load_format="safetensors")
    assert torch.equal(load(base64.b64decode(payload))["w"], t)


def test_an_unknown_load_format_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="load_format='gguf'"):
        serialize_named_tensors([("w", torch.zeros(1))], load_format="gguf")


def test_a_flat_bucket_holds_each_tensors_bytes_at_its_planned_offset() -> None:
    named = _named()
    (bucket,) = plan_weight_buckets(named.items(), 1 << 20)
    flat = flatten_bucket(bucket, named)
    assert flat.dtype == torch.uint8 and tuple(flat.shape) == (bucket.nbytes,)
    for name, start, size in zip(bucket.names, bucket.offsets, bucket.sizes(), strict=True):
        expected = named[name].contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(flat[start : start + size], expected)


def test_a_tensor_that_is_not_the_buckets_is_refused_by_name() -> None:
    named = _named()
    (bucket,) = plan_weight_buckets(named.items(), 1 << 20)
    with pytest.raises(ValueError, match="'b' is float64"):
        flatten_bucket(bucket, {**named, "b": named["b"].double()})
    with pytest.raises(KeyError):
        flatten_bucket(bucket, {"a": named["a"]})


def test_the_bucket_payload_carries_sglangs_metadata_fields() -> None:
    named = _named()
    (bucket,) = plan_weight_buckets(named.items(), 1 << 20)
    payload = pickle.load(
        io.BytesIO(base64.b64decode(serialize_bucket(bucket, flatten_bucket(bucket, named))))
    )
    entries = [
        (m.name, tuple(m.shape), m.dtype, m.start_idx, m.end_idx) for m in payload["metadata"]
    ]
    assert entries == [("a", (3, 5), torch.bfloat16, 0, 30), ("b", (4,), torch.float32, 30, 46)]
    with pytest.raises(ValueError, match=r"uint8 \[46\]"):
        serialize_bucket(bucket, torch.zeros(46))
