"""The native forward pass against transformers' own, for each supported architecture.

In-process (no server): the runner and the batch on small random models of each family.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from relax_hf.batch import Batch, Sequence
from relax_hf.modeling import UnsupportedModel
from relax_hf.protocol import LogprobParams, SamplingParams
from relax_hf.runner import ModelRunner
from relax_hf.sampling import row_keys

PROMPTS = ["The quick brown fox", "Question: what is two plus two?", "Hello"]


def _save(tmp: Path, tiny_model: Path, family: str, **extra: Any) -> Path:
    import transformers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    config_cls = getattr(transformers, f"{family}Config")
    model_cls = getattr(transformers, f"{family}ForCausalLM")
    config = config_cls(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        **extra,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = model_cls(config)
        with torch.no_grad():  # larger weights than the default: peaked next-token choices
            for name, p in model.named_parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.08)
                elif name.endswith("bias"):
                    p.normal_(0.0, 0.1)
    out = tmp / family
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.mark.parametrize(
    ("family", "extra"),
    [
        ("Llama", {"tie_word_embeddings": False}),
        ("Qwen2", {"tie_word_embeddings": True}),  # q/k/v biases, tied embeddings
        ("Qwen3", {"tie_word_embeddings": False}),  # per-head q/k norms
        ("Mistral", {"sliding_window": None}),
    ],
)
def test_greedy_outputs_equal_transformers_forward(
    tmp_path: Path, tiny_model: Path, family: str, extra: dict[str, Any]
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _save(tmp_path, tiny_model, family, **extra)
    tok = AutoTokenizer.from_pretrained(path)
    reference = AutoModelForCausalLM.from_pretrained(path).eval()
    batch = Batch(ModelRunner(str(path), max_total_tokens=1024))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    seqs = [
        Sequence(
            rid=str(i),
            prompt_ids=tok(p, add_special_tokens=False)["input_ids"],
            sampling=greedy,
            logprob=LogprobParams(),
        )
        for i, p in enumerate(PROMPTS)
    ]
    batch.step(seqs)  # one prefill for the three prompts of different lengths
    while len(batch):
        batch.step([])
    for s in seqs:
        ids = list(s.prompt_ids)
        with torch.no_grad():
            for _ in range(8):
                ids.append(int(reference(torch.tensor([ids])).logits[0, -1].argmax()))
        assert s.output_ids == ids[len(s.prompt_ids) :], (family, s.rid)
    # Every slot given back, or held by the prefix cache (their prompts' and outputs' KV).
    assert batch.pool.free_slots + batch.cache.tokens == batch.pool.capacity


def test_an_unsupported_architecture_is_refused_naming_it(tmp_path: Path, tiny_model: Path) -> None:
    path = _save(tmp_path, tiny_model, "Mistral", sliding_window=16)
    with pytest.raises(UnsupportedModel, match="sliding_window 16"):
        ModelRunner(str(path), max_total_tokens=64)


def test_a_release_frees_its_buffers_without_a_garbage_collection(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A full collection costs ~0.1 s in this process; a release whose buffers are freed as
    # their references go (no cycle holds them) must not pay it — a phase switch is timed.
    import gc

    runner = ModelRunner(str(tiny_model), max_total_tokens=256, weights_cpu_backup=True)
    collections: list[int] = []
    monkeypatch.setattr(gc, "collect", lambda *a: collections.append(1) or 0)
    runner.release(["weights", "kv_cache", "cuda_graph"])
    assert collections == []
    report = runner.memory_report()
    assert report["released_storages_alive"] == 0 and report["resident_param_bytes"] == 0
    assert report["kv_cache"]["resident"] is False
    runner.resume(["weights", "kv_cache", "cuda_graph"], graphs=True)
    assert runner.memory_report()["resident_param_bytes"] == report["param_bytes"]


def test_a_prefill_after_cached_prefixes_attends_in_chunks_as_in_one_pass(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rows after prefixes of different lengths, their queries cut into chunks of 3 (a budget of
    # 3 x heads x context mask elements) or run at once: the same hidden states.
    import relax_hf.modeling as modeling

    runner = ModelRunner(str(tiny_model), max_total_tokens=256)
    pool, native = runner.pool, runner.native
    prompts = [list(range(20, 60)), list(range(100, 125))]
    starts, rows = [7, 1], []
    for ids in prompts:
        row = pool.alloc_row()
        pool.write_rows([(row, 0, pool.alloc_slots(len(ids)))])
        rows.append(row)
    # The cached prefixes: their K/V in the pool, as a prefill of them alone leaves it.
    width = max(starts)
    prefix = torch.tensor([p[:width] for p in prompts])
    native.prefill(pool, prefix, torch.tensor(starts), torch.tensor(rows))
    tail = max(len(p) - s for p, s in zip(prompts, starts, strict=True))
    ids = torch.full((2, tail), runner.pad_id)
    for r, (p, s) in enumerate(zip(prompts, starts, strict=True)):
        ids[r, : len(p) - s] = torch.tensor(p[s:])
    lens = torch.tensor([len(p) - s for p, s in zip(prompts, starts, strict=True)])
    args = (pool, ids, lens, torch.tensor(rows), torch.tensor(starts), max(map(len, prompts)))
    whole = native.prefill_after(*args)
    ctx = args[-1]
    monkeypatch.setattr(modeling, "ATTENTION_CHUNK_ELEMENTS", 3 * 2 * native.num_heads * ctx)
    chunked = native.prefill_after(*args)
    for r, n in enumerate(lens.tolist()):
        torch.testing.assert_close(chunked[r, :n], whole[r, :n], rtol=1e-5, atol=1e-5)
    # And both are the full prefill's states of those positions.
    full = native.prefill(
        pool, torch.tensor(prompts[0])[None], torch.tensor([40]), torch.tensor(rows[:1])
    )
    torch.testing.assert_close(chunked[0, : lens[0]], full[0, starts[0] :], rtol=1e-4, atol=1e-4)


def test_the_eager_passes_leave_cudnn_attention_to_the_decode_graphs(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # cuDNN's attention plans every new shape (~0.1 s on an H200) and eager passes change shape
    # every call: prefills and graph-less decode steps run with it off, and turn it back on.
    # (On CPU no cuDNN runs: what is checked is the backend flag each pass sees.)
    runner = ModelRunner(str(tiny_model), max_total_tokens=64)
    native = runner.native
    seen: dict[str, bool] = {}
    for name in ("prefill", "prefill_after", "decode_step"):
        real = getattr(native, name)

        def spy(*args: Any, _name: str = name, _real: Any = real) -> Any:
            seen[_name] = torch.backends.cuda.cudnn_sdp_enabled()
            return _real(*args)

        monkeypatch.setattr(native, name, spy)
    row = runner.pool.alloc_row()
    runner.pool.write_rows([(row, 0, runner.pool.alloc_slots(8))])
    ids, rows = torch.tensor([[5, 6, 7, 8]]), torch.tensor([row])
    runner.prefill(ids, torch.tensor([4]), rows)
    runner.prefill(ids, torch.tensor([4]), rows, torch.tensor([4]), 8)
    packed = torch.tensor([[9], [7], [row], [0]])
    runner.decode(packed, torch.zeros(1), 8)
    assert seen == {"prefill": False, "prefill_after": False, "decode_step": False}
    assert torch.backends.cuda.cudnn_sdp_enabled()  # as it was outside them


@pytest.mark.parametrize("family", ["Llama", "Qwen3"])
def test_the_compiled_decode_pieces_draw_the_same_tokens_and_compile_once(
    tmp_path: Path, tiny_model: Path, family: str
) -> None:
    """``--enable-torch-compile`` fuses the decode step's element-wise pieces. On CPU, traced
    by torch.compile with the ``aot_eager`` backend (the graphs inductor would compile, run
    without a compiler; inductor's kernels are checked on a GPU in test_cuda.py): the same
    logits and tokens as eager, greedy and sampled rows, and a new batch size or context after
    the first two compiles nothing (the decode graphs capture new shapes while serving)."""
    from torch._dynamo.utils import counters

    runner = ModelRunner(str(_save(tmp_path, tiny_model, family)), max_total_tokens=1024)

    def step(b: int, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
        packed = torch.stack(
            [
                torch.arange(b) + 5,  # tokens
                torch.arange(b) + ctx - b,  # positions
                torch.arange(b) + 1,  # rows
                row_keys(torch.arange(b) * 7 + 3, torch.full((b,), 4)),  # seeds, steps
            ]
        )
        temps = torch.tensor([0.0] + [0.8] * (b - 1))
        with torch.inference_mode():
            return runner.native.decode_step(runner.pool, packed, temps, ctx)  # type: ignore[no-any-return]

    shapes = [(1, 16), (3, 16), (5, 32), (8, 64)]
    eager = [step(b, ctx) for b, ctx in shapes]
    torch._dynamo.reset()
    runner.native.compile(backend="aot_eager")
    assert runner.native.compiled
    compiled = [step(b, ctx) for b, ctx in shapes[:2]]
    frames = counters["stats"]["unique_graphs"]
    compiled += [step(b, ctx) for b, ctx in shapes[2:]]
    assert counters["stats"]["unique_graphs"] == frames  # no recompile at 5 x 32 or 8 x 64
    for (logits, tokens), (want_logits, want_tokens) in zip(compiled, eager, strict=True):
        torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
        assert torch.equal(tokens, want_tokens)
    torch._dynamo.reset()
