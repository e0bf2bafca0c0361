"""The forward pass of Llama-family models over the KV cache pool, and CUDA-graph decode steps.

:class:`NativeModel` runs the transformers model's own weights (the parameters of the loaded
``*ForCausalLM``; they live in the runner's flat buffer) with its own code: RMSNorm, rotary
embeddings taken from the model's ``rotary_emb`` (so Llama 3 / linear / YaRN scaling come with
it), grouped-query attention, SiLU MLP, optional q/k/v biases (Qwen2) and per-head q/k norms
(Qwen3). Projections whose weights are adjacent in the flat buffer run as one matrix product
(q, k and v; gate and up).

- **Prefill** runs a right-padded batch ``[B, T]`` with torch's fused attention
  (``scaled_dot_product_attention``, causal: real tokens never see the padding after them) and
  writes each real token's K and V into its slot (``req_to_token`` of the row).
- **Decode** runs one token per row: K/V of the new token are written into its slot, the row's
  context is gathered from the pool by ``req_to_token`` and attended with two batched matrix
  products (the batch is ``kv_heads × rows``, so no copy is needed for the transposes).

:class:`DecodeGraphs` captures decode steps as CUDA graphs per (batch size, context bucket) on
first use and replays them; the batch is padded to the captured size with the scratch row 0.
Graphs bake in the addresses of the weights and of the pool, so they are dropped whenever
either is reallocated (release/resume, a disk update) and captured again.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F

from relax_hf.kvcache import KVPool

__all__ = ["SUPPORTED_MODEL_TYPES", "DecodeGraphs", "NativeModel", "UnsupportedModel"]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class UnsupportedModel(ValueError):
    """The model's architecture is not one the native forward implements."""


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _fused(tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
    """One view over tensors that lie back to back in one storage (else ``None``)."""
    if any(t is None for t in tensors):
        return None
    ts = [t for t in tensors if t is not None]
    first = ts[0]
    trailing = first.shape[1:]
    offset = first.storage_offset()
    for t in ts:
        if t.shape[1:] != trailing or not t.is_contiguous() or t.storage_offset() != offset:
            return None
        if t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in ts)
    shape = (rows, *trailing)
    return first.as_strided(shape, first.stride(), first.storage_offset())


class _Layer:
    """One decoder layer's weights as views (re-bound after every weight reallocation)."""

    def __init__(self, layer: Any) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.ln1 = layer.input_layernorm.weight
        self.ln2 = layer.post_attention_layernorm.weight
        q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
        self.wq, self.wk, self.wv = q.weight, k.weight, v.weight
        self.bq, self.bk, self.bv = q.bias, k.bias, v.bias
        self.wqkv = _fused([self.wq, self.wk, self.wv])
        self.bqkv = _fused([self.bq, self.bk, self.bv]) if self.bq is not None else None
        self.wo, self.bo = attn.o_proj.weight, attn.o_proj.bias
        qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.qn = qn.weight if qn is not None else None
        self.kn = kn.weight if kn is not None else None
        self.wg, self.wu, self.wd = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
        self.bg, self.bu, self.bd = mlp.gate_proj.bias, mlp.up_proj.bias, mlp.down_proj.bias
        self.wgu = _fused([self.wg, self.wu]) if self.bg is None else None

    def qkv(self, h: torch.Tensor, nq: int, nkv: int) -> tuple[torch.Tensor, ...]:
        if self.wqkv is not None and (self.bq is None or self.bqkv is not None):
            out = F.linear(h, self.wqkv, self.bqkv)
            return tuple(out.split([nq, nkv, nkv], dim=-1))
        return (
            F.linear(h, self.wq, self.bq),
            F.linear(h, self.wk, self.bk),
            F.linear(h, self.wv, self.bv),
        )

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        if self.wgu is not None:
            gate, up = F.linear(h, self.wgu).chunk(2, dim=-1)
        else:
            gate, up = F.linear(h, self.wg, self.bg), F.linear(h, self.wu, self.bu)
        return F.linear(F.silu(gate) * up, self.wd, self.bd)


class NativeModel:
    """Prefill and decode of a Llama-family ``*ForCausalLM`` over a :class:`KVPool`."""

    def __init__(self, model: Any) -> None:
        config = model.config
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModel(
                f"model_type {model_type!r} is not supported by the hf engine's forward pass "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedModel(f"hidden_act {act!r} is not supported (only silu)")
        window = getattr(config, "sliding_window", None)
        use_window = getattr(config, "use_sliding_window", window is not None)
        if window is not None and use_window and window < config.max_position_embeddings:
            raise UnsupportedModel(
                f"sliding_window {window} shorter than the context is not supported"
            )
        rope = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None)
        rope_type = (rope or {}).get("rope_type", (rope or {}).get("type", "default"))
        if rope_type == "dynamic":
            raise UnsupportedModel("dynamic rotary scaling is not supported")
        self.model = model
        self.config = config
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        )
        self.groups = self.num_heads // self.num_kv_heads
        self.eps = float(config.rms_norm_eps)
        self.scale = self.head_dim**-0.5
        rotary = model.model.rotary_emb
        self.inv_freq = rotary.inv_freq
        self.rope_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self.layers: list[_Layer] = []
        self.bind()

    @property
    def num_layers(self) -> int:
        """Decoder layers."""
        return len(self.model.model.layers)

    def bind(self) -> None:
        """Take the current weight views (after the runner repacked or resumed the weights)."""
        self.inv_freq = self.model.model.rotary_emb.inv_freq
        self.layers = [_Layer(layer) for layer in self.model.model.layers]
        self.embed = self.model.model.embed_tokens.weight
        self.norm = self.model.model.norm.weight
        self.lm_head = self.model.lm_head.weight

    def unbind(self) -> None:
        """Drop every weight view (the weights are being released)."""
        self.layers = []
        self.embed = self.norm = self.lm_head = None  # type: ignore[assignment]

    # -- pieces ------------------------------------------------------------------------------

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        freqs = positions.float()[..., None] * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scaling).to(dtype)
        sin = (emb.sin() * self.rope_scaling).to(dtype)
        return cos, sin

    def _heads(
        self, layer: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[..., H, d]``, k and v ``[..., Hkv, d]`` with norms and rotary applied."""
        d = self.head_dim
        q, k, v = layer.qkv(h, self.num_heads * d, self.num_kv_heads * d)
        q = q.unflatten(-1, (self.num_heads, d))
        k = k.unflatten(-1, (self.num_kv_heads, d))
        v = v.unflatten(-1, (self.num_kv_heads, d))
        if layer.qn is not None:
            q = _rms(q, layer.qn, self.eps)
        if layer.kn is not None:
            k = _rms(k, layer.kn, self.eps)
        c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
        q = q * c + _rotate_half(q) * s
        k = k * c + _rotate_half(k) * s
        return q, k, v

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and the LM head: float32 logits."""
        return F.linear(_rms(hidden, self.norm, self.eps), self.lm_head).float()

    # -- prefill -----------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(
        self, pool: KVPool, ids: torch.Tensor, lens: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        """Run right-padded ``ids [B, T]`` (``lens`` real tokens each); return hidden states.

        Writes K/V of every real token into the slots ``req_to_token[rows, :lens]``.
        """
        assert pool.req_to_token is not None
        b, t = ids.shape
        pos = torch.arange(t, device=ids.device)
        real = pos[None, :] < lens[:, None]
        slots = torch.where(real, pool.req_to_token[rows, :t], 0).reshape(-1)
        x = F.embedding(ids, self.embed)
        cos, sin = self._rope(pos, x.dtype)
        rep = self.groups
        for i, layer in enumerate(self.layers):
            h = _rms(x, layer.ln1, self.eps)
            q, k, v = self._heads(layer, h, cos, sin)
            kc, vc = pool.layer(i)
            kc.index_copy_(1, slots, k.reshape(b * t, self.num_kv_heads, -1).transpose(0, 1))
            vc.index_copy_(1, slots, v.reshape(b * t, self.num_kv_heads, -1).transpose(0, 1))
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            if rep > 1:
                k = k.repeat_interleave(rep, dim=1)
                v = v.repeat_interleave(rep, dim=1)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
            x = x + F.linear(o.transpose(1, 2).reshape(b, t, -1), layer.wo, layer.bo)
            x = x + layer.mlp(_rms(x, layer.ln2, self.eps))
        return x

    # -- decode ------------------------------------------------------------------------------

    def decode_step(self, pool: KVPool, packed: torch.Tensor, ctx: int) -> torch.Tensor:
        """One token per row: ``packed`` is ``[3, B]`` (tokens, positions, rows); float32 logits.

        ``ctx`` is at least the longest row's context (``position + 1``); shorter rows are
        masked. Graph-capturable: no host synchronisation, static shapes.
        """
        assert pool.req_to_token is not None
        tokens, positions, rows = packed[0], packed[1], packed[2]
        b = tokens.shape[0]
        hkv, d, g = self.num_kv_heads, self.head_dim, self.groups
        table = pool.req_to_token.index_select(0, rows)[:, :ctx]
        write = table.gather(1, positions[:, None]).squeeze(1)
        flat = table.reshape(-1)
        keep = torch.arange(ctx, device=tokens.device)[None, :] <= positions[:, None]
        bias = torch.zeros((b, ctx), dtype=torch.float32, device=tokens.device)
        bias = bias.masked_fill(~keep, float("-inf"))[None, :, None, :]  # [1, B, 1, ctx]
        x = F.embedding(tokens, self.embed)
        cos, sin = self._rope(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            h = _rms(x, layer.ln1, self.eps)
            q, k, v = self._heads(layer, h, cos, sin)  # q [B, H, d], k/v [B, Hkv, d]
            kc, vc = pool.layer(i)
            kc.index_copy_(1, write, k.transpose(0, 1))
            vc.index_copy_(1, write, v.transpose(0, 1))
            keys = kc.index_select(1, flat).view(hkv * b, ctx, d)
            values = vc.index_select(1, flat).view(hkv * b, ctx, d)
            qh = q.view(b, hkv, g, d).transpose(0, 1).reshape(hkv * b, g, d)
            scores = torch.bmm(qh, keys.transpose(1, 2)).float() * self.scale
            scores = scores.view(hkv, b, g, ctx) + bias
            probs = torch.softmax(scores, dim=-1).to(values.dtype).view(hkv * b, g, ctx)
            o = torch.bmm(probs, values).view(hkv, b, g * d).transpose(0, 1).reshape(b, -1)
            x = x + F.linear(o, layer.wo, layer.bo)
            x = x + layer.mlp(_rms(x, layer.ln2, self.eps))
        return self.logits(x)


def _buckets(context_len: int, smallest: int = 128) -> list[int]:
    out, b = [], smallest
    while b < context_len:
        out.append(b)
        b *= 2
    out.append(context_len)
    return out


class DecodeGraphs:
    """CUDA graphs of :meth:`NativeModel.decode_step` per (batch size, context bucket)."""

    def __init__(self, model: NativeModel, pool: KVPool, *, max_bs: int) -> None:
        self.model = model
        self.pool = pool
        sizes = [1, 2, 4, 8] + list(range(16, max_bs + 1, 8))
        self.batch_sizes = sorted({s for s in sizes if s <= max_bs} | {max_bs})
        self.ctx_buckets = _buckets(pool.context_len)
        self._graphs: dict[tuple[int, int], tuple[Any, torch.Tensor, torch.Tensor]] = {}
        self._mempool: Any = None
        self._staging: dict[int, torch.Tensor] = {}
        self.captured_shapes: list[tuple[int, int]] = []  # what to capture again on resume
        self.capture_seconds = 0.0
        self.replays = 0

    @property
    def captured(self) -> int:
        """Graphs held now."""
        return len(self._graphs)

    def bucket(self, b: int, ctx: int) -> tuple[int, int] | None:
        """The captured shape for ``b`` rows of context ``ctx`` (``None``: too large)."""
        bs = next((s for s in self.batch_sizes if s >= b), None)
        cb = next((c for c in self.ctx_buckets if c >= ctx), None)
        return None if bs is None or cb is None else (bs, cb)

    def drop(self) -> None:
        """Forget every graph and its memory (weights or pool moved, or ``cuda_graph`` freed)."""
        self._graphs.clear()
        self._mempool = None

    def capture(self, shape: tuple[int, int]) -> None:
        """Capture the graph of ``shape`` (idempotent)."""
        if shape in self._graphs:
            return
        start = time.perf_counter()
        bs, ctx = shape
        device = self.pool.device
        packed = torch.zeros((3, bs), dtype=torch.int64, device=device)  # scratch row 0
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.inference_mode(), torch.cuda.stream(stream):
            for _ in range(2):  # warm up (cuBLAS handles, allocator) outside the capture
                self.model.decode_step(self.pool, packed, ctx)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._mempool):
            out = self.model.decode_step(self.pool, packed, ctx)
        self._graphs[shape] = (graph, packed, out)
        if shape not in self.captured_shapes:
            self.captured_shapes.append(shape)
        self.capture_seconds += time.perf_counter() - start

    def warm_up(self, *, max_ctx: int = 256) -> int:
        """Capture every batch size for the context buckets up to ``max_ctx`` (start-up), so
        that short requests never wait for a capture; longer contexts are captured on first
        use."""
        for ctx in [c for c in self.ctx_buckets if c <= max_ctx] or self.ctx_buckets[:1]:
            for bs in sorted(self.batch_sizes, reverse=True):
                self.capture((bs, ctx))
        return len(self._graphs)

    def recapture(self) -> int:
        """Capture again every shape captured before the last :meth:`drop`."""
        for shape in sorted(self.captured_shapes, reverse=True):
            self.capture(shape)
        return len(self._graphs)

    def run(self, host_packed: torch.Tensor, ctx: int) -> torch.Tensor | None:
        """Replay the graph for ``host_packed [3, b]`` (CPU); ``None`` when no shape fits."""
        b = host_packed.shape[1]
        shape = self.bucket(b, ctx)
        if shape is None:
            return None
        if shape not in self._graphs:
            self.capture(shape)
        graph, packed, out = self._graphs[shape]
        bs = shape[0]
        staging = self._staging.get(bs)
        if staging is None:
            staging = torch.zeros((3, bs), dtype=torch.int64).pin_memory()
            self._staging[bs] = staging
        staging.zero_()
        staging[:, :b] = host_packed
        packed.copy_(staging, non_blocking=True)
        graph.replay()
        self.replays += 1
        return out[:b].clone()
