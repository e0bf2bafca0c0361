"""Planning a weight push's buckets: pure Python over shapes, dtypes and element sizes (no
torch is imported to plan), SGLang's layout (back to back, in order, no padding)."""

from __future__ import annotations

import math
import pickle

import attrs
import pytest

from relax_core import WeightBucket, plan_weight_buckets


@attrs.frozen
class Tensor:
    """What planning reads of a tensor."""

    shape: tuple[int, ...]
    dtype: str
    itemsize: int

    def element_size(self) -> int:
        return self.itemsize


def _named(*sizes: int) -> list[tuple[str, Tensor]]:
    return [(f"w{i}", Tensor((n,), "torch.bfloat16", 2)) for i, n in enumerate(sizes)]


def test_tensors_fill_buckets_in_order_up_to_the_size_back_to_back() -> None:
    buckets = plan_weight_buckets(_named(100, 100, 100, 50), 400)
    assert [b.names for b in buckets] == [("w0", "w1"), ("w2", "w3")]
    assert [b.offsets for b in buckets] == [(0, 200), (0, 200)]
    assert [b.nbytes for b in buckets] == [400, 300] and buckets[1].sizes() == (200, 100)
    assert buckets[0].dtypes == ("bfloat16", "bfloat16") and buckets[0].shapes == ((100,), (100,))


def test_a_tensor_larger_than_a_bucket_travels_alone_and_unsplit() -> None:
    buckets = plan_weight_buckets(_named(10, 1000, 10), 100)
    assert [(b.names, b.nbytes) for b in buckets] == [(("w0",), 20), (("w1",), 2000), (("w2",), 20)]


def test_one_bucket_holds_everything_below_its_size_and_it_pickles() -> None:
    named = [("a", Tensor((3, 4), "torch.float32", 4)), ("b", Tensor((), "torch.int64", 8))]
    (bucket,) = plan_weight_buckets(named, 1 << 30)
    assert bucket.nbytes == math.prod((3, 4)) * 4 + 8 and bucket.offsets == (0, 48)
    assert pickle.loads(pickle.dumps(bucket)) == bucket


@pytest.mark.parametrize("size", [0, -1, 1.5, True])
def test_a_bucket_size_that_is_not_a_positive_integer_is_refused(size: object) -> None:
    with pytest.raises(ValueError, match="bucket_bytes must be a positive integer"):
        plan_weight_buckets(_named(1), size)  # type: ignore[arg-type]


def test_no_tensors_or_a_name_given_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="no tensors to push"):
        plan_weight_buckets([], 10)
    with pytest.raises(ValueError, match="'w0' is given twice"):
        plan_weight_buckets(_named(1) * 2, 10)


def test_a_bucket_whose_offsets_are_not_back_to_back_is_refused() -> None:
    with pytest.raises(ValueError, match="not back to back"):
        WeightBucket(("a", "b"), ("float32", "float32"), ((1,), (1,)), (0, 8), 4)
