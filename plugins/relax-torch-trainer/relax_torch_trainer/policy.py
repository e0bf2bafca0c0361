"""The reference trainer's policy: a Llama-family causal LM in plain torch, ours.

:class:`Policy` is the architecture the ``hf`` engine serves (``model_type`` llama or mistral:
RMSNorm, rotary embeddings, grouped-query attention, SiLU MLP), laid out so that its
``state_dict`` names are the checkpoint's (``model.layers.0.self_attn.q_proj.weight``, …):
what it loads from a model directory (``config.json`` + safetensors) is what it pushes back
to the engines, name for name and shape for shape, in the checkpoint's dtype
(:meth:`Policy.named_weights`).

It stands in for a Megatron or FSDP model: it needs torch and safetensors, imported by this
module, which only the trainer's Ray actor imports (the plugin's ``__init__`` does not, so
loading the plugin in a ``relax`` command imports no torch).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from relax_core import ConfigError

__all__ = ["SUPPORTED_MODEL_TYPES", "Policy", "PolicyShape", "load_policy"]

#: The ``model_type`` values this module implements (the hf engine serves more).
SUPPORTED_MODEL_TYPES = ("llama", "mistral")

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class PolicyShape:
    """The shape of a checkpoint, read from its ``config.json``.

    :raises ConfigError: (``path`` = the config file) an architecture this module does not
        implement: another ``model_type``, rotary scaling, a sliding window, biases.
    """

    def __init__(self, config: dict[str, Any], where: str) -> None:
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                where,
                f"model_type {model_type!r}: the reference trainer implements "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}; plug in a trainer of your own for others "
                "(docs/run.md#the-trainer)",
            )
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(where, f"rope_type {rope_type!r}: only default rotary embeddings")
        window = config.get("sliding_window") if config.get("use_sliding_window", True) else None
        if window and int(window) < int(config.get("max_position_embeddings", 0)):
            raise ConfigError(where, "a sliding window is not implemented by this trainer")
        if config.get("attention_bias") or config.get("mlp_bias"):
            raise ConfigError(where, "attention or MLP biases are not implemented by this trainer")
        self.vocab_size = int(config["vocab_size"])
        self.hidden = int(config["hidden_size"])
        self.intermediate = int(config["intermediate_size"])
        self.layers = int(config["num_hidden_layers"])
        self.heads = int(config["num_attention_heads"])
        self.kv_heads = int(config.get("num_key_value_heads") or self.heads)
        self.head_dim = int(config.get("head_dim") or self.hidden // self.heads)
        self.eps = float(config.get("rms_norm_eps", 1e-6))
        self.theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
        self.tied = bool(config.get("tie_word_embeddings", False))
        self.dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")


class _Attention(nn.Module):  # type: ignore[misc]
    def __init__(self, s: PolicyShape) -> None:
        super().__init__()
        self.s = s
        self.q_proj = nn.Linear(s.hidden, s.heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.heads * s.head_dim, s.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        s = self.s
        q = self.q_proj(x).view(b, t, s.heads, s.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if s.kv_heads != s.heads:
            k = k.repeat_interleave(s.heads // s.kv_heads, dim=1)
            v = v.repeat_interleave(s.heads // s.kv_heads, dim=1)
        # Right padding: a real token never attends to the padding after it.
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        projected: torch.Tensor = self.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        return projected


class _MLP(nn.Module):  # type: ignore[misc]
    def __init__(self, s: PolicyShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.up_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.down_proj = nn.Linear(s.intermediate, s.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        down: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return down


class _RMSNorm(nn.Module):  # type: ignore[misc]
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # float32 inside, as the checkpoint's own implementation computes it
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class _Layer(nn.Module):  # type: ignore[misc]
    def __init__(self, s: PolicyShape) -> None:
        super().__init__()
        self.input_layernorm = _RMSNorm(s.hidden, s.eps)
        self.self_attn = _Attention(s)
        self.post_attention_layernorm = _RMSNorm(s.hidden, s.eps)
        self.mlp = _MLP(s)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class _Body(nn.Module):  # type: ignore[misc]
    def __init__(self, s: PolicyShape) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden)
        self.layers = nn.ModuleList(_Layer(s) for _ in range(s.layers))
        self.norm = _RMSNorm(s.hidden, s.eps)


def _inv_freq(shape: PolicyShape, device: Any) -> torch.Tensor:
    steps = torch.arange(0, shape.head_dim, 2, dtype=torch.float32, device=device)
    return 1.0 / (shape.theta ** (steps / shape.head_dim))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Policy(nn.Module):  # type: ignore[misc]  # torch may be untyped where mypy runs
    """A causal LM whose ``state_dict`` is the checkpoint's (see the module docstring)."""

    def __init__(self, shape: PolicyShape) -> None:
        super().__init__()
        self.shape = shape
        self.model = _Body(shape)
        self.lm_head = nn.Linear(shape.hidden, shape.vocab_size, bias=False)
        if shape.tied:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", _inv_freq(shape, "cpu"), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, vocab]`` of a right-padded batch ``input_ids [B, T]``."""
        t = input_ids.shape[1]
        positions = torch.arange(t, device=input_ids.device, dtype=torch.float32)
        inv: torch.Tensor = self.inv_freq  # type: ignore[assignment]  # a registered buffer
        freqs = positions[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        x = self.model.embed_tokens(input_ids)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        logits: torch.Tensor = self.lm_head(self.model.norm(x))
        return logits

    def named_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(checkpoint name, tensor)`` of every weight, detached, in ``dtype`` (default: the
        checkpoint's); a tied ``lm_head`` is not listed (the checkpoint has none)."""
        want = dtype or _DTYPES.get(self.shape.dtype, torch.float32)
        for name, tensor in self.state_dict().items():
            if self.shape.tied and name == "lm_head.weight":
                continue
            yield name, tensor.detach().to(want)


def _weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / s for s in shards]
    single = directory / "model.safetensors"
    if single.exists():
        return [single]
    raise ConfigError(
        str(directory),
        "no model.safetensors (or model.safetensors.index.json) in the model directory; the "
        "reference trainer loads safetensors checkpoints",
    )


def load_policy(model_path: str, *, device: str = "cpu") -> Policy:
    """The policy of the checkpoint at ``model_path``, in float32 on ``device``.

    :raises ConfigError: no ``config.json`` or safetensors there, an unsupported architecture,
        or a checkpoint whose weights do not match its config (names or shapes).
    """
    from safetensors.torch import load_file

    directory = Path(model_path)
    config_file = directory / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(str(config_file), f"cannot read the model's config: {exc}") from None
    shape = PolicyShape(config, str(config_file))
    with torch.device("meta"):
        policy = Policy(shape)
    state: dict[str, torch.Tensor] = {}
    for f in _weight_files(directory):
        state.update(load_file(str(f)))
    wanted = {n: tuple(p.shape) for n, p in policy.state_dict().items()}
    if shape.tied:
        wanted.pop("lm_head.weight", None)
    got = {n: tuple(t.shape) for n, t in state.items()}
    if got != wanted:
        missing = sorted(set(wanted) - set(got))[:3]
        extra = sorted(set(got) - set(wanted))[:3]
        wrong = sorted(n for n in set(got) & set(wanted) if got[n] != wanted[n])[:3]
        raise ConfigError(
            str(directory),
            f"the checkpoint does not match its config.json (missing {missing}, unexpected "
            f"{extra}, other shapes {wrong})",
        )
    policy.to_empty(device=device)  # in place (it returns the module itself)
    policy.load_state_dict({n: t.float() for n, t in state.items()}, strict=not shape.tied)
    if shape.tied:
        policy.lm_head.weight = policy.model.embed_tokens.weight
    policy.inv_freq = _inv_freq(shape, device)
    return policy
