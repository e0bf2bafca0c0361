"""Decode attention that reads each row's keys and values straight from the KV cache pool
(``--attention-backend triton``, CUDA's default where Triton is installed).

The ``torch_native`` path gathers every row's whole context bucket out of the pool into a
dense tensor, then torch's attention reads it again (docs/paged-decode-attention.md). Here one
Triton kernel per split of the context (flash-decoding) loads a row's slots from its
request-to-token row, up to the row's own length, attends the query heads that share a KV
head together, and leaves a partial softmax; a second kernel combines a row's splits. Blocks
past a row's length return at once, so the grid is fixed by the step's bucket and a captured
decode graph keeps its shape; a context in one split is written out directly, no combine.
Float32 accumulation; the probabilities are rounded to the values' dtype for their product with
the values, as flash attention does.

Triton is imported by :func:`decode_attention`'s first call, not by this module: the CPU
engine (and ``TRITON_INTERPRET=1`` tests, which run the kernels on CPU tensors) chooses it.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch

__all__ = ["available", "decode_attention", "splits_for"]

#: Context positions one iteration of a split's loop reads.
BLOCK_N = 64


def available() -> str | None:
    """Why the Triton kernels cannot run here (``None``: they can)."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (it comes with torch's CUDA builds)"
    return None


def splits_for(rows: int, kv_heads: int, ctx: int, processors: int) -> int:
    """How many splits a context of ``ctx`` positions is attended in: enough programs to give
    each of the device's ``processors`` a few (``rows x kv_heads`` of them per split), no
    split shorter than :data:`BLOCK_N`."""
    most = max(1, -(-ctx // BLOCK_N))
    want = -(-4 * processors // max(1, rows * kv_heads))
    return max(1, min(most, want))


@functools.cache
def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    # One compiled variant a model: no specialisation on the split count (1 or not) nor on
    # the positions' alignment (a view into the step's packed inputs, 16-byte aligned only for
    # an even number of rows), so a graph captured mid-phase compiles nothing.
    once = triton.jit(
        do_not_specialize=["split_len", "splits"], do_not_specialize_on_alignment=["positions_ptr"]
    )

    @once
    def split_kernel(
        q_ptr,
        kv_ptr,
        table_ptr,
        positions_ptr,
        part_ptr,
        stats_ptr,
        out_ptr,
        stride_qb,
        stride_qh,
        stride_ob,
        stride_oh,
        stride_slot,
        stride_side,
        stride_head,
        stride_tb,
        split_len,
        splits,
        scale,
        G: tl.constexpr,
        BLOCK_G: tl.constexpr,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK: tl.constexpr,
        PRECISION: tl.constexpr,
        DIRECT: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        length = tl.load(positions_ptr + b) + 1
        start = s * split_len
        end = tl.minimum(start + split_len, length)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        in_g = offs_g < G
        in_d = offs_d < D
        q = tl.load(
            q_ptr + b * stride_qb + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :],
            mask=in_g[:, None] & in_d[None, :],
            other=0.0,
        )
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for n0 in range(start, end, BLOCK):
            offs_n = n0 + tl.arange(0, BLOCK)
            valid = offs_n < end
            slots = tl.load(table_ptr + b * stride_tb + offs_n, mask=valid, other=0)
            at = kv_ptr + slots[:, None] * stride_slot + h * stride_head + offs_d[None, :]
            both = valid[:, None] & in_d[None, :]
            k = tl.load(at, mask=both, other=0.0)
            v = tl.load(at + stride_side, mask=both, other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            scores = tl.where(valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            total = total * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        if DIRECT:  # one split: the output itself, no combine
            out = acc / total[:, None]
            tl.store(
                out_ptr + b * stride_ob + (h * G + offs_g)[:, None] * stride_oh + offs_d[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=in_g[:, None] & in_d[None, :],
            )
        else:
            row = (b * tl.num_programs(1) + h) * splits + s
            tl.store(
                part_ptr + (row * BLOCK_G + offs_g)[:, None] * BLOCK_D + offs_d[None, :],
                acc,
                mask=in_g[:, None],
            )
            tl.store(stats_ptr + (row * BLOCK_G + offs_g) * 2, m, mask=in_g)
            tl.store(stats_ptr + (row * BLOCK_G + offs_g) * 2 + 1, total, mask=in_g)

    # fmt: off
    @once
    def combine_kernel(
        part_ptr, stats_ptr, positions_ptr, out_ptr, stride_ob, stride_oh, split_len, splits,
        kv_heads, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
    # fmt: on
        b = tl.program_id(0)
        head = tl.program_id(1)
        h = head // G
        g = head % G
        used = (tl.load(positions_ptr + b) + split_len) // split_len  # splits holding positions
        offs_d = tl.arange(0, BLOCK_D)
        in_d = offs_d < D
        m = float("-inf")
        total = 0.0
        acc = tl.zeros([BLOCK_D], tl.float32)
        for s in range(0, used):
            row = ((b * kv_heads + h) * splits + s) * BLOCK_G + g
            m_s = tl.load(stats_ptr + row * 2)
            t_s = tl.load(stats_ptr + row * 2 + 1)
            a_s = tl.load(part_ptr + row * BLOCK_D + offs_d, mask=in_d, other=0.0)
            m_new = tl.maximum(m, m_s)
            keep = tl.exp(m - m_new)
            take = tl.exp(m_s - m_new)
            total = total * keep + t_s * take
            acc = acc * keep + a_s * take
            m = m_new
        out = acc / total
        tl.store(
            out_ptr + b * stride_ob + head * stride_oh + offs_d,
            out.to(out_ptr.dtype.element_ty),
            mask=in_d,
        )

    return split_kernel, combine_kernel


@functools.cache
def _processors(device: torch.device) -> int:
    """The device's streaming multiprocessors (a few on CPU, where the interpreter runs)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 4


def decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    table: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    splits: int | None = None,
) -> torch.Tensor:
    """Attention of one decode step: ``q [rows, heads, d]`` (any strides but the last) over
    row ``b``'s positions ``0 … positions[b]``, whose keys and values lie in ``cache [slots,
    2, kv_heads, d]`` (one layer of the pool) at slots ``table[b, :positions[b] + 1]``
    (``table``: ``[rows, bucket]``, the rows' request-to-token rows). Returns ``[rows, heads,
    d]`` in ``q``'s dtype. ``splits``: the context's splits (default :func:`splits_for`).
    No host synchronisation: graph-capturable."""
    import triton

    rows, heads, d = q.shape
    kv_heads = cache.shape[2]
    groups = heads // kv_heads
    if q.stride(2) != 1 or cache.stride(3) != 1 or table.stride(1) != 1:
        raise ValueError("decode_attention: the last dimension of q, cache and table is dense")
    ctx = table.shape[1]
    if splits is None:
        splits = splits_for(rows, kv_heads, ctx, _processors(q.device))
    split_len = -(-ctx // splits)
    split_len = -(-split_len // BLOCK_N) * BLOCK_N
    splits = -(-ctx // split_len)
    block_g = max(16, triton.next_power_of_2(groups))
    block_d = triton.next_power_of_2(d)
    direct = splits == 1
    out = torch.empty((rows, heads, d), dtype=q.dtype, device=q.device)
    parts = 0 if direct else splits  # one split writes ``out`` itself
    part = torch.empty(
        (rows, kv_heads, parts, block_g, block_d), dtype=torch.float32, device=q.device
    )
    stats = torch.empty((rows, kv_heads, parts, block_g, 2), dtype=torch.float32, device=q.device)
    split_kernel, combine_kernel = _kernels()
    split_kernel[(rows, kv_heads, splits)](
        q, cache, table, positions, part, stats, out,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        cache.stride(0), cache.stride(1), cache.stride(2),
        table.stride(0), split_len, splits, scale,
        G=groups, BLOCK_G=block_g, D=d, BLOCK_D=block_d, BLOCK=BLOCK_N,
        # float32 values multiply as float32 (not TensorFloat-32's 10-bit mantissas)
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DIRECT=direct,
    )  # fmt: skip
    if not direct:
        combine_kernel[(rows, heads)](
            part, stats, positions, out, out.stride(0), out.stride(1), split_len, splits,
            kv_heads, G=groups, BLOCK_G=block_g, D=d, BLOCK_D=block_d,
        )  # fmt: skip
    return out
