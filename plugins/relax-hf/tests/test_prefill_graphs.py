"""Prefill steps of a few prompts after cached prefixes replayed from step graphs.

In process on CPU with the graph machinery emulated (``emulate_cuda_graph``: capture records the
static buffers, a replay runs the step on them and refuses once the memory it recorded has
moved). A judge phase's usual step admits a few prompts that share the judge's template beside
running rows: on a GPU its eager prefill costs the host ~1,500 launches (``test_cuda.py`` runs the
real graphs on the H200). Here: the graphs give the tokens and log-probs of the eager prefill,
padded rows and tokens touch nothing a sequence reads, and what does not fit runs eagerly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from relax_hf.batch import Batch, Sequence
from relax_hf.modeling import StaleGraph, StepGraphs
from relax_hf.protocol import LogprobParams, SamplingParams
from relax_hf.runner import ModelRunner
from relax_hf.testing import gathered_decode_attention

PREFIX = list(range(5, 45))  # the template every prompt shares


@pytest.fixture(scope="module")
def graphed(tiny_model: Path) -> ModelRunner:
    return ModelRunner(
        str(tiny_model), max_total_tokens=8192, max_running_requests=16, emulate_cuda_graph=True
    )


@pytest.fixture(scope="module")
def eager(tiny_model: Path) -> ModelRunner:
    return ModelRunner(str(tiny_model), max_total_tokens=8192, max_running_requests=16)


def _seq(rid: str, tail: list[int], *, seed: int, n: int = 6, top: int = 0) -> Sequence:
    return Sequence(
        rid=rid,
        prompt_ids=PREFIX + tail,
        sampling=SamplingParams(
            temperature=0.0 if seed % 2 else 0.8, max_new_tokens=n, ignore_eos=True
        ),
        logprob=LogprobParams(return_logprob=True, top_logprobs_num=top),
        seed=seed,
    )


def _judge_phase(runner: ModelRunner, arrivals: list[list[list[int]]]) -> list[Sequence]:
    """One prompt caches the template; then each step admits one group of ``arrivals`` beside
    the rows still running, until all end."""
    runner.prefix_cache.clear()
    batch = Batch(runner)
    batch.step([_seq("template", [50], seed=1, n=2)])
    while len(batch):
        batch.step([])
    seqs: list[Sequence] = []
    for g, group in enumerate(arrivals):
        base = 3 + len(seqs)
        new = [_seq(f"{g}.{i}", t, seed=base + i, top=2) for i, t in enumerate(group)]
        seqs += new
        batch.step(new)
    while len(batch):
        batch.step([])
    assert batch.pool.free_slots + batch.cache.tokens == batch.pool.capacity
    return seqs


def _outcome(seqs: list[Sequence]) -> list[tuple[object, ...]]:
    return [
        (s.cached_tokens, s.output_ids, s.output_token_logprobs, s.output_top_logprobs)
        for s in seqs
    ]


def _tails(sizes: list[int], base: int) -> list[list[int]]:
    """Prompt tails of ``sizes`` tokens (ids within the tiny vocabulary of 512)."""
    return [[60 + (base + 7 * i + k) % 400 for k in range(n)] for i, n in enumerate(sizes)]


def _same(got: list[Sequence], want: list[Sequence]) -> None:
    for g, w in zip(_outcome(got), _outcome(want), strict=True):
        assert g[0] == w[0]
        assert g[1] == w[1]
        assert [x[1] for x in g[2]] == [x[1] for x in w[2]]
        assert [x[0] for x in g[2]] == pytest.approx([x[0] for x in w[2]], abs=1e-4)
        assert [[t[1] for t in row] for row in g[3]] == [[t[1] for t in row] for row in w[3]]


def test_a_few_prompts_after_a_cached_prefix_replay_a_prefill_graph_with_the_eager_answer(
    graphed: ModelRunner, eager: ModelRunner
) -> None:
    graphs = graphed.graphs
    assert graphs is not None and graphs.prefill_captured > 0  # captured at start
    captures, replays = graphs.captures, graphs.prefill_replays
    # Arrivals of 3, 1 and 2 prompts of uneven lengths, each step beside running rows: the
    # rows and tokens are padded to the captured shape (4 x 16, 1 x 32, 2 x 32). Then a repeat
    # of a prompt (all but its last token cached: a decode row, one decode graph's replay) with
    # a new one, in the same step as the running rows' decode: three graphs replay in that
    # step, and none may write what another's outputs hold (the emulation overwrites them).
    arrivals = [_tails([3, 11, 7], 100), _tails([20], 200), _tails([9, 30], 300)]
    arrivals.append([arrivals[1][0], *_tails([12], 350)])
    got = _judge_phase(graphed, arrivals)
    assert graphs.prefill_replays == replays + 4  # one replay for each step's prefill
    assert graphs.captures == captures  # every shape was captured at start
    assert [s.cached_tokens for s in got] == [len(PREFIX)] * 6 + [len(PREFIX) + 19, len(PREFIX)]
    _same(got, _judge_phase(eager, arrivals))


def test_what_no_prefill_graph_fits_prefills_eagerly_or_is_captured_on_first_use(
    graphed: ModelRunner, eager: ModelRunner
) -> None:
    graphs = graphed.graphs
    assert graphs is not None
    replays, captures, held = graphs.prefill_replays, graphs.captures, graphs.prefill_captured
    # Nine prompts: more rows than a prefill graph holds (8), so an eager prefill.
    nine = [_tails([5] * 9, 400)]
    _same(_judge_phase(graphed, nine), _judge_phase(eager, nine))
    assert graphs.prefill_replays == replays and graphs.captures == captures
    # A context past the buckets captured in full at start (256), within the sparse ones
    # (512): 300 tokens replay the prefill graph of 512 tokens captured at start, and two
    # decoding rows the decode graph of 8, padded; nothing is captured.
    stand_ins = graphs.stand_ins
    mid = [_tails([300], 500), _tails([299], 650)]
    _same(_judge_phase(graphed, mid), _judge_phase(eager, mid))
    assert graphs.captures == captures
    assert graphs.stand_ins > stand_ins + 2 and graphs.prefill_replays == replays + 2
    # Past the sparse buckets (a context of 1024): captured on first use, once, and replayed
    # after that.
    long = [_tails([500], 700), _tails([499], 900)]
    _same(_judge_phase(graphed, long), _judge_phase(eager, long))
    assert graphs.prefill_captured == held + 1  # (decode graphs of that context came too)
    assert graphs.prefill_replays == replays + 4


def test_a_captured_graph_stands_in_for_a_shape_within_twice_its_work(
    graphed: ModelRunner,
) -> None:
    graphs = graphed.graphs
    assert graphs is not None
    ctx = graphs.ctx_buckets[-1]  # nothing of this context is captured at start
    captures, stand_ins = graphs.captures, graphs.stand_ins
    assert graphs.held(("prefill", 1, 512, ctx)) == ("prefill", 1, 512, ctx)  # captured
    assert graphs.captures == captures + 1
    # 384 tokens padded to 512: 1.33 x the work, replayed as it is.
    assert graphs.held(("prefill", 1, 384, ctx)) == ("prefill", 1, 512, ctx)
    # 128 tokens would be 4 x the work: captured (once).
    assert graphs.held(("prefill", 1, 128, ctx)) == ("prefill", 1, 128, ctx)
    assert graphs.held(("prefill", 1, 128, ctx)) == ("prefill", 1, 128, ctx)
    assert graphs.captures == captures + 2 and graphs.stand_ins == stand_ins + 1
    # A decode graph of a few rows stands in for fewer rows at the same context.
    assert graphs.held(("decode", 8, 1, ctx)) == ("decode", 8, 1, ctx)
    assert graphs.held(("decode", 1, 1, ctx)) == ("decode", 8, 1, ctx)
    assert graphs.captures == captures + 3 and graphs.stand_ins == stand_ins + 2


def test_the_start_up_captures_the_next_context_sparsely_within_the_largest_graph(
    graphed: ModelRunner,
) -> None:
    """The context bucket past the full ones (512) is captured at start for a few decode rows
    (no more rows x context than the largest decode graph of 256, whose gather sets the graphs'
    memory) and the sparse prefill tokens; nothing beyond it."""
    fresh = StepGraphs(graphed.native, graphed.pool, max_bs=16, emulate=True)
    fresh.warm_up()
    shapes = set(fresh.captured_shapes)
    assert {s[1] for s in shapes if s[0] == "decode" and s[3] == 256} == {1, 2, 4, 8, 16}
    assert {s[1] for s in shapes if s[0] == "decode" and s[3] == 512} == {1, 8}  # 8 x 512
    assert {s[2] for s in shapes if s[0] == "prefill" and s[3] == 512} == {64, 128, 256, 512}
    assert max(s[3] for s in shapes) == 512 and fresh.captures == len(shapes)


def test_with_the_paged_kernel_the_start_up_captures_every_sparse_row_count(
    graphed: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The paged decode kernel (``--attention-backend triton``) reads the pool in place, so a
    decode graph's memory does not grow with its context: the 512 bucket is captured for every
    sparse row count (16 rows here, the largest), and a batch that full past 256 positions
    (a judge phase's) replays a graph captured at start instead of capturing in its phase."""

    def paged(q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor,
              positions: torch.Tensor, scale: float) -> torch.Tensor:  # fmt: skip
        # The kernel's reference (the CPU tests run the kernel itself in Triton's interpreter).
        return gathered_decode_attention(q, cache, table, positions).to(q.dtype)

    monkeypatch.setattr(graphed.native, "paged_attention", paged)
    fresh = StepGraphs(graphed.native, graphed.pool, max_bs=16, emulate=True)
    fresh.warm_up()
    shapes = set(fresh.captured_shapes)
    assert {s[1] for s in shapes if s[0] == "decode" and s[3] == 512} == {1, 8, 16}
    captures = fresh.captures
    full = fresh.bucket(12, 300)  # 12 rows whose longest context is 300 positions
    assert full is not None and fresh.held(full) == ("decode", 16, 1, 512)
    assert fresh.captures == captures


def test_padded_rows_and_tokens_write_only_the_scratch_slot(graphed: ModelRunner) -> None:
    """A replay for fewer rows and tokens than its shape (3 rows of 5 tokens, padded to 7 in
    the host's rows, in a 4 x 16 graph) writes K/V only where its rows' real tokens go and into
    the scratch slot 0: no slot another sequence holds changes, and each row's logits are those
    of the same tokens run alone."""
    graphs, pool = graphed.graphs, graphed.pool
    assert graphs is not None and pool.kv is not None
    graphed.prefix_cache.clear()
    rows = [pool.alloc_row() for _ in range(3)]
    tables = [pool.alloc_slots(len(PREFIX) + 5) for _ in rows]
    pool.write_rows([(r, 0, t) for r, t in zip(rows, tables, strict=True)])
    host = torch.tensor(
        [[*range(60 + 9 * i, 65 + 9 * i), 0, 0, 5, r, len(PREFIX)] for i, r in enumerate(rows)],
        dtype=torch.int64,
    )
    ctx = len(PREFIX) + 5
    before = pool.kv.clone()
    together = graphs.run_prefill(host, ctx)
    assert together is not None and graphs.prefill_bucket(3, 7, ctx) == ("prefill", 4, 16, 128)
    together = together.clone()
    changed = (pool.kv != before).flatten(2).any(-1).any(0)  # [slots]: any layer, K or V
    written = set(torch.nonzero(changed).flatten().tolist())
    assert written - {0} == {int(s) for t in tables for s in t[len(PREFIX) :]}
    for i in range(3):
        alone = graphs.run_prefill(host[i : i + 1], ctx)
        assert alone is not None
        assert torch.allclose(alone[0], together[i], atol=1e-4)
    for r, t in zip(rows, tables, strict=True):
        pool.free_row(r)
        pool.free_slots_of(t)


def test_a_prefill_graph_refuses_to_replay_once_its_memory_moved(tiny_model: Path) -> None:
    runner = ModelRunner(
        str(tiny_model), max_total_tokens=1024, max_running_requests=4, emulate_cuda_graph=True
    )
    graphs = runner.graphs
    assert graphs is not None and graphs.prefill_captured > 0
    host = torch.tensor([[*range(60, 70), 10, 0, 50]], dtype=torch.int64)
    assert graphs.run_prefill(host, 60) is not None
    runner.pool.kv = runner.pool.kv.clone()  # the pool at another address, graphs not dropped
    with pytest.raises(StaleGraph, match="memory moved"):
        graphs.run_prefill(host, 60)
    assert graphs.drop_if_moved() and graphs.prefill_captured == 0


def test_the_backend_flag_turns_prefill_graphs_off(tiny_model: Path) -> None:
    off = ModelRunner(
        str(tiny_model),
        max_total_tokens=1024,
        max_running_requests=4,
        emulate_cuda_graph=True,
        cuda_graph_prefill=False,
    )
    assert off.graphs is not None and off.graphs.captured > 0  # decode graphs
    assert off.graphs.prefill_captured == 0
    assert off.prefill_captured(torch.zeros((1, 19), dtype=torch.int64), 64) is None
