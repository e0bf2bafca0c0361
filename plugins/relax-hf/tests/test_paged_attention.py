"""The decode attention kernel (``--attention-backend triton``) against the gather + SDPA path.

The kernels are Triton's; on this CPU machine they run in Triton's interpreter
(``TRITON_INTERPRET=1``), which executes the same kernel code on CPU tensors with numpy. The
interpreter's matrix product is wrong for bfloat16 (numpy has no such type), so here the
kernels run in float32 and float16; bfloat16, the compiled kernels and a captured graph are
checked on a GPU in test_cuda.py.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from relax_hf import paged_attention
from relax_hf.batch import Batch, Sequence
from relax_hf.protocol import LogprobParams, SamplingParams
from relax_hf.runner import ModelRunner
from relax_hf.testing import gathered_decode_attention

if torch.cuda.is_available():
    pytest.skip("with CUDA the kernels run compiled: test_cuda.py", allow_module_level=True)
# Before triton's first import: its language's own functions are built for the interpreter then.
INTERPRETED = "triton" not in sys.modules
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="the kernels' tests need triton (relax-hf's test extra)")


@pytest.fixture
def interpreter(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The kernels built for Triton's interpreter (and rebuilt after, as the GPU needs)."""
    from triton.runtime import interpreter as interp

    if not INTERPRETED:
        pytest.skip("triton was imported before this module set TRITON_INTERPRET")
    original = interp._patch_lang_tensor

    def patch(tensor: object, scope: object) -> None:
        # Triton 3.6's interpreter converts a loaded scalar (a one-element array) with int(),
        # which numpy 2 refuses for arrays of one dimension; a loop bounded by a row's length
        # needs it.
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda t: int(t.handle.data.reshape(-1)[0]))  # type: ignore[attr-defined]

    monkeypatch.setattr(interp, "_patch_lang_tensor", patch)
    paged_attention._kernels.cache_clear()
    yield
    paged_attention._kernels.cache_clear()


@pytest.mark.parametrize(
    ("rows", "heads", "kv_heads", "d", "ctx", "splits", "dtype"),
    [
        (3, 4, 2, 64, 128, None, torch.float32),  # the tiny model's heads
        (2, 6, 2, 32, 200, 3, torch.float32),  # a bucket no split divides; 3 query heads a kv
        (4, 2, 2, 16, 64, 1, torch.float32),  # one split; no grouping
        (5, 16, 8, 128, 256, 4, torch.float16),  # the small judge's heads
    ],
)
def test_the_kernel_attends_what_the_gather_path_attends(
    interpreter: None,
    rows: int,
    heads: int,
    kv_heads: int,
    d: int,
    ctx: int,
    splits: int | None,
    dtype: torch.dtype,
) -> None:
    """Ragged rows (one at its first position, one at the bucket's last) over slots scattered
    through the pool; ``q`` a strided view of the step's q, k and v heads, as the model
    hands it over."""
    generator = torch.Generator().manual_seed(rows * ctx)
    slots = 4 * rows * ctx
    cache = torch.randn(slots, 2, kv_heads, d, generator=generator).to(dtype)
    q = torch.randn(rows, heads + 2 * kv_heads, d, generator=generator).to(dtype)[:, :heads]
    table = torch.randperm(slots, generator=generator)[: rows * ctx].view(rows, ctx)
    positions = torch.randint(0, ctx, (rows,), generator=generator)
    positions[0], positions[-1] = 0, ctx - 1
    out = paged_attention.decode_attention(q, cache, table, positions, d**-0.5, splits)
    assert out.shape == (rows, heads, d) and out.dtype == dtype
    want = gathered_decode_attention(q, cache, table, positions)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), want, rtol=tolerance, atol=tolerance)


def test_splits_give_every_processor_work_and_no_split_is_shorter_than_a_block() -> None:
    assert paged_attention.splits_for(1, 8, 256, 132) == 256 // paged_attention.BLOCK_N
    assert paged_attention.splits_for(256, 8, 512, 132) == 1
    assert paged_attention.splits_for(16, 8, 512, 132) == 5
    assert paged_attention.splits_for(1, 1, 10, 132) == 1


PROMPTS = ["The quick brown fox", "Question: what is two plus two?", "Hello"]


def test_an_engine_decoding_through_the_kernel_draws_the_gather_paths_tokens(
    interpreter: None, tiny_model: Path
) -> None:
    """The same prompts, greedy and sampled with seeds, through a CPU runner's decode steps with
    the kernel installed (as ``--attention-backend triton`` installs it on CUDA) and without:
    the same tokens, log-probs within float32's rounding."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]

    calls = 0

    def counted(*args: object) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return paged_attention.decode_attention(*args)  # type: ignore[arg-type]

    def generate(kernel: bool) -> list[tuple[list[int], list[float]]]:
        runner = ModelRunner(str(tiny_model), max_total_tokens=1024, dtype="float32")
        assert runner.attention_backend == "torch_native"  # CPU's, unless installed by hand
        if kernel:
            runner.native.paged_attention = counted
        batch = Batch(runner)
        seqs = [
            Sequence(
                rid=str(i),
                prompt_ids=p,
                sampling=SamplingParams(
                    temperature=0.0 if i == 0 else 0.9,
                    sampling_seed=i,
                    max_new_tokens=12,
                    ignore_eos=True,
                ),
                logprob=LogprobParams(return_logprob=True),
            )
            for i, p in enumerate(ids)
        ]
        batch.step(seqs)
        while len(batch):
            batch.step([])
        return [(s.output_ids, [lp for lp, *_ in s.output_token_logprobs]) for s in seqs]

    plain, paged = generate(False), generate(True)
    assert calls == 11 * 4  # every decode step (the first token is the prefill's), each layer
    for (want_ids, want_lps), (got_ids, got_lps) in zip(plain, paged, strict=True):
        assert got_ids == want_ids and len(got_ids) == 12
        torch.testing.assert_close(torch.tensor(got_lps), torch.tensor(want_lps), atol=1e-4, rtol=0)


def test_the_backend_is_chosen_at_start_and_triton_is_refused_where_it_cannot_run(
    tiny_model: Path,
) -> None:
    runner = ModelRunner(str(tiny_model), max_total_tokens=256)
    assert runner.attention_backend == "torch_native"
    assert runner.native.paged_attention is None
    with pytest.raises(ValueError, match="--attention-backend triton: it runs on CUDA, not cpu"):
        ModelRunner(str(tiny_model), max_total_tokens=256, attention_backend="triton")
