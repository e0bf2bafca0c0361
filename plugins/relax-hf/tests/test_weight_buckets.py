"""Weight buckets on the engine side: SGLang's ``flattened_bucket`` cut into its tensors (the
metadata checked against the buffer before a byte is loaded), ``/get_weights_by_name``, and
``relax-hf push-bench`` on CPU (a bucketed push of safetensors files into a real engine)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch
from relax_hf.cli import main
from relax_hf.runner import WeightsError
from relax_hf.testing import EngineServer
from relax_hf.weights import decode_named_tensors, unflatten
from relax_torch_weights import flatten_bucket, serialize_bucket

from relax_core import WeightBucket, plan_weight_buckets


def _named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(3, 5, generator=g).to(torch.bfloat16)),  # 30 bytes: b starts unaligned
        ("b", torch.randn(4, generator=g)),
        ("c", torch.randint(0, 9, (2, 2), generator=g)),
    ]


def _entries(bucket: WeightBucket) -> list[tuple[str, tuple[int, ...], torch.dtype, int, int]]:
    ends = [o + s for o, s in zip(bucket.offsets, bucket.sizes(), strict=True)]
    return [
        (n, s, getattr(torch, d), o, e)
        for n, s, d, o, e in zip(
            bucket.names, bucket.shapes, bucket.dtypes, bucket.offsets, ends, strict=True
        )
    ]


def test_a_flattened_bucket_gives_back_every_tensor_bit_for_bit_even_unaligned() -> None:
    named = _named()
    (bucket,) = plan_weight_buckets(named, 1 << 20)
    assert bucket.offsets == (0, 30, 46) and bucket.nbytes == 78
    out = dict(unflatten(flatten_bucket(bucket, dict(named)), _entries(bucket), "m"))
    assert all(out[n].dtype == t.dtype and torch.equal(out[n], t) for n, t in named)


def test_sglang_metadata_as_attributes_or_keys_is_read_from_the_pickled_payload() -> None:
    import base64
    import io
    from multiprocessing.reduction import ForkingPickler

    named = _named()
    (bucket,) = plan_weight_buckets(named, 1 << 20)
    flat = flatten_bucket(bucket, dict(named))
    payload = serialize_bucket(bucket, flat)  # SimpleNamespace entries, SGLang's field names
    assert dict(decode_named_tensors(payload, "flattened_bucket", "p")).keys() == {"a", "b", "c"}
    keys = [
        {"name": n, "shape": list(s), "dtype": str(d), "start_idx": o, "end_idx": e}
        for n, s, d, o, e in _entries(bucket)
    ]
    buf = io.BytesIO()
    ForkingPickler(buf).dump({"flattened_tensor": flat, "metadata": keys})
    got = dict(
        decode_named_tensors(base64.b64encode(buf.getvalue()).decode(), "flattened_bucket", "p")
    )
    assert all(torch.equal(got[n], t) for n, t in named)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"end": 80}, r"spans bytes \[46, 80\) of a 78-byte bucket"),
        ({"end": 62}, r"'c' is int64 \[2, 2\] \(32 bytes\) but spans 16 bytes"),
        ({"start": 40, "end": 72}, "'c' overlaps another tensor"),
    ],
)
def test_a_bucket_whose_metadata_does_not_fit_its_buffer_is_refused(
    change: dict[str, int], message: str
) -> None:
    named = _named()
    (bucket,) = plan_weight_buckets(named, 1 << 20)
    entries = _entries(bucket)
    name, shape, dtype, start, end = entries[2]
    entries[2] = (name, shape, dtype, change.get("start", start), change.get("end", end))
    with pytest.raises(WeightsError, match=message):
        unflatten(flatten_bucket(bucket, dict(named)), entries, "m")


def test_a_bucket_buffer_must_be_flat_bytes() -> None:
    with pytest.raises(WeightsError, match=r"1-D uint8 tensor, got float32 \[2, 2\]"):
        unflatten(torch.zeros(2, 2), [("a", (4,), torch.float32, 0, 16)], "m")


@pytest.fixture(scope="module")
def engine(start_server: Any) -> EngineServer:
    return start_server("hf-buckets")  # type: ignore[no-any-return]


def test_get_weights_by_name_answers_the_parameter_cut_to_truncate_size(
    engine: EngineServer, tiny_model: Path
) -> None:
    from safetensors.torch import load_file

    weight = load_file(str(tiny_model / "model.safetensors"))["lm_head.weight"]
    rows = engine.http.ok("/get_weights_by_name", {"name": "lm_head.weight", "truncate_size": 3})
    assert torch.equal(torch.tensor(rows), weight[:3].float())


def test_get_weights_by_name_of_an_unknown_parameter_is_a_400_naming_it(
    engine: EngineServer,
) -> None:
    status, body = engine.http.post("/get_weights_by_name", {"name": "nope.weight"})
    assert status == 400 and "unknown parameter 'nope.weight'" in json.dumps(body)


def test_push_bench_on_cpu_pushes_in_buckets_and_the_engine_holds_the_pushed_weights(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from relax_hf.tiny import make_tiny_model

    # The micro model: no parameter's request body is over aiohttp's 1 MiB warning (an error
    # in the tests).
    micro = make_tiny_model(tmp_path / "micro", seed=0, size="micro")
    code = main(
        [
            "push-bench",
            str(micro),
            "--device",
            "cpu",
            "--json",
            "--bucket-mib",
            "0.1",
            "0.5",
            "--repeats",
            "1",
            "--log-dir",
            str(tmp_path),
        ]
    )
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["ok"] is True
    small, larger = result["pushes"]
    assert small["buckets"] > larger["buckets"] > 1
    assert small["bytes"] == larger["bytes"] == result["bytes"]
    for push in (small, larger):
        assert push["weights_equal"] is True
        # Each push's time is the median of its runs, and its ratios are the copy baselines of
        # the same bytes over it (what the report prints as "of H2D" / "of D2D").
        assert push["seconds"] == statistics.median(push["seconds_all"])
        assert push["vs_h2d"] == pytest.approx(result["h2d_pinned_seconds"] / push["seconds"])
        assert push["vs_d2d"] == pytest.approx(result["d2d_seconds"] / push["seconds"])
