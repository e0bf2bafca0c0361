"""The model and its memory: loading, forward passes, weight residency, weight loading.

:class:`ModelRunner` is used from one compute thread only (the scheduler's executor); nothing
here is thread-safe on its own.

Weights live in one flat device buffer; every parameter is a view into it. Releasing weights
drops the buffer (and, on CUDA, returns the cached blocks to the driver), so the bytes really
leave the device. With ``weights_cpu_backup`` the bytes are first copied into one flat host
buffer (pinned on CUDA) and resumed with a single non-blocking host-to-device copy. Without it the
bytes are discarded (SGLang's release without a CPU backup): a resume maps the memory back zeroed
and the weights are *pending* until a push writes every parameter; meanwhile the parameters no
push wrote are reloaded from the checkpoint when something needs them, if they were the
checkpoint's when discarded, and refused otherwise (the updates since were lost).

The runner also owns what the forward pass needs besides the weights: the
:class:`~relax_hf.modeling.NativeModel` that runs them, the preallocated KV cache pool
(:class:`~relax_hf.kvcache.KVPool`, sized by ``mem_fraction_static`` or ``max_total_tokens``;
the ``kv_cache`` memory tag), the CUDA graphs of the decode steps (``cuda_graph``), and the
grammar compiler for constrained decoding.
"""

from __future__ import annotations

import ctypes
import gc
import json
import mmap
import os
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention import sdpa_kernel

from relax_hf import paged_attention
from relax_hf.grammar import GrammarBackend
from relax_hf.kvcache import KVPool
from relax_hf.modeling import EAGER_ATTENTION, PREFILL_GRAPH_MAX_TOKENS, NativeModel, StepGraphs
from relax_hf.options import ATTENTION_BACKENDS
from relax_hf.prefixcache import PrefixCache
from relax_hf.vmm import DriverWarmer, Exchange, Segment, device_uuid

__all__ = ["GRAPH_PHASES", "ModelRunner", "WeightsError", "pool_slots"]

_ALIGN = 512
GIB = 1 << 30
#: SGLang's CUDA-graph phases (its ``GRAPH_MEMORY_USAGE_KEYS``): the keys of ``/server_info``'s
#: ``startup_time.cuda_graph`` and ``memory_usage.graph``.
GRAPH_PHASES = (
    "prefill",
    "decode",
    "target_verify",
    "draft_prefill",
    "draft_decode",
    "draft_extend",
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class WeightsError(ValueError):
    """A weight operation cannot be done as asked (bad names, shapes, state); a 400."""


def _prefixed(detail: dict[str, Any]) -> dict[str, Any]:
    """A segment's map / unmap detail as fields of a tag's (``segment_…``)."""
    return {f"segment_{k}": v for k, v in detail.items()}


def _malloc_trim() -> None:
    # glibc keeps freed heap pages; trimming hands them back so RSS reflects what was freed.
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def available_memory(device: torch.device) -> int:
    """Bytes free for this engine on ``device``: the GPU's free memory, or the host's
    available memory (``MemAvailable``; 0 where unavailable), as SGLang measures it."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def process_rss_bytes() -> int:
    """Resident set size of this process, from /proc (0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _fusion_order(named: dict[str, Any]) -> list[str]:
    """Parameter names with q/k/v and gate/up weights (and biases) next to each other."""
    groups = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
    order: list[str] = []
    placed: set[str] = set()
    for name in named:
        if name in placed:
            continue
        for group in groups:
            head, sep, tail = name.rpartition(f".{group[0]}.")
            if sep:
                members = [f"{head}.{g}.{tail}" for g in group]
                if all(m in named for m in members):
                    order += members
                    placed.update(members)
                break
        if name not in placed:
            order.append(name)
            placed.add(name)
    return order


def _kv_bytes_per_token(native: NativeModel, dtype: torch.dtype) -> int:
    elem = torch.empty(0, dtype=dtype).element_size()
    return native.num_layers * 2 * native.num_kv_heads * native.head_dim * elem


#: KV cache slots on CPU when neither --max-total-tokens nor --mem-fraction-static is given.
CPU_DEFAULT_TOKENS = 32768
#: --mem-fraction-static on CUDA when none is given: SGLang's usual choice on large GPUs (and what
#: the core's placement budget assumes for a model that gives none).
CUDA_DEFAULT_MEM_FRACTION = 0.88


def pool_slots(
    *,
    device: torch.device,
    bytes_per_token: int,
    param_bytes: int,
    mem_fraction_static: float | None,
    max_total_tokens: int | None,
) -> int:
    """How many token slots the KV cache pool gets (plus the scratch slot).

    ``max_total_tokens`` wins; otherwise ``mem_fraction_static`` of the device's memory (CUDA:
    the GPU's total; CPU: physical RAM) is for the weights and the pool together, as in SGLang.
    :raises ValueError: naming the flag, when that leaves no room for a pool.
    """
    if max_total_tokens is not None:
        if max_total_tokens < 1:
            raise ValueError(f"--max-total-tokens: must be >= 1, got {max_total_tokens}")
        return max_total_tokens + 1
    fraction = mem_fraction_static
    if fraction is None:
        if device.type != "cuda":
            return CPU_DEFAULT_TOKENS + 1
        fraction = CUDA_DEFAULT_MEM_FRACTION
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"--mem-fraction-static: must be in (0, 1), got {fraction}")
    if device.type == "cuda":
        total = torch.cuda.mem_get_info(device)[1]
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    budget = int(total * fraction) - param_bytes
    slots = budget // bytes_per_token
    if slots < 2:
        raise ValueError(
            f"--mem-fraction-static: {fraction} of {total / 2**30:.1f} GiB leaves no room for a "
            f"KV cache pool after {param_bytes / 2**30:.2f} GiB of weights; raise it"
        )
    return int(min(slots, (1 << 31) - 1))


class ModelRunner:
    """A transformers causal LM on one device, with releasable weights."""

    def __init__(
        self,
        model_path: str,
        *,
        device: str = "cpu",
        dtype: str = "auto",
        weights_cpu_backup: bool = False,
        attn_implementation: str = "sdpa",
        mem_fraction_static: float | None = None,
        max_total_tokens: int | None = None,
        max_running_requests: int = 64,
        context_length: int | None = None,
        cuda_graph: bool = True,
        cuda_graph_max_bs: int | None = None,
        cuda_graph_prefill: bool = True,
        cuda_graph_max_bs_prefill: int | None = None,
        json_any_whitespace: bool = True,
        json_max_whitespace_cnt: int | None = None,
        torch_compile: bool = False,
        memory_handoff: bool = False,
        radix_cache: bool = True,
        emulate_cuda_graph: bool = False,
        attention_backend: str | None = None,
    ) -> None:
        """Load the model and its tokenizer, pack the weights, take the KV cache pool.

        ``radix_cache`` (SGLang's default; ``--disable-radix-cache`` turns it off) keeps the
        KV of prompts and outputs in a :class:`~relax_hf.prefixcache.PrefixCache` over the
        pool, for later sequences that share their prefix.

        The decode graphs (``cuda_graph``, CUDA) survive a release and a resume where the
        weights and the pool come back at the same addresses: with ``memory_handoff``, and on
        CPU (whose mappings are kept). Elsewhere they are captured again after a resume;
        :attr:`graphs_note` says so. ``emulate_cuda_graph`` (CPU) runs decode steps through the
        graph machinery with eager stand-ins (:class:`~relax_hf.modeling.StepGraphs`). With
        them (``cuda_graph_prefill``), a prefill of a few prompts after cached prefixes replays
        a graph too, of at most ``cuda_graph_max_bs_prefill`` rows x padded tokens.

        With ``memory_handoff`` (CUDA only) the weight buffer and the pool are
        :class:`~relax_hf.vmm.Segment` s: a release parks their physical memory for the next
        engine on the GPU to take over (:mod:`relax_hf.vmm`), and a resume takes parked memory
        first.

        :raises ValueError: an unknown dtype, an unsupported architecture, a KV cache pool
            that ``mem_fraction_static`` / ``max_total_tokens`` leave no room for, or
            ``memory_handoff`` off CUDA.
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer

        began = time.perf_counter()
        self.model_path = str(model_path)
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device.index or 0)
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.weights_cpu_backup = weights_cpu_backup
        self.exchange: Exchange | None = None
        # Pays the driver's deferred cost of the first allocation after a release, off the
        # compute thread, so that a resume does not (relax_hf.vmm.DriverWarmer).
        self.warmer: DriverWarmer | None = None
        if self.device.type == "cuda":
            self.warmer = DriverWarmer(self.device.index or 0)
        if memory_handoff:
            if self.device.type != "cuda":
                raise ValueError(
                    f"--memory-handoff: hands CUDA memory between engines; device is {self.device}"
                )
            index = self.device.index or 0
            self.exchange = Exchange(device_uuid(index), device=index)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        torch_dtype: Any = "auto" if dtype == "auto" else DTYPES.get(dtype)
        if torch_dtype is None:
            raise ValueError(f"dtype={dtype!r}: use auto, {', '.join(DTYPES)}")
        model = AutoModelForCausalLM.from_pretrained(
            self.model_path, dtype=torch_dtype, attn_implementation=attn_implementation
        )
        self.model = model.to(self.device).eval()
        self.config = self.model.config
        self.dtype = next(self.model.parameters()).dtype
        self.vocab_size = int(self.config.vocab_size)
        model_len = int(getattr(self.config, "max_position_embeddings", 4096))
        self.max_len = int(context_length or model_len)
        self.eos_ids = self._eos_ids()
        self.pad_id = self._pad_id()
        self.native = NativeModel(self.model)
        # Fusable projections (q, k, v; gate, up) are laid out back to back in the flat buffer.
        named = dict(self.model.named_parameters())
        self.params: dict[str, torch.nn.Parameter] = {n: named[n] for n in _fusion_order(named)}
        # name -> (byte offset, byte count, shape, dtype); shapes are kept for released params.
        self._layout: dict[str, tuple[int, int, tuple[int, ...], torch.dtype]] = {}
        offset = 0
        for name, p in self.params.items():
            nbytes = p.numel() * p.element_size()
            self._layout[name] = (offset, nbytes, tuple(p.shape), p.dtype)
            offset += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        self.param_bytes = offset
        self._wseg: Segment | None = None
        if self.exchange is not None:
            self._wseg = Segment(
                self.exchange.device, self.param_bytes, exchange=self.exchange, name="weights"
            )
        self._backup: torch.Tensor | None = None
        self._flat: torch.Tensor | None = None
        self._cpu_map: mmap.mmap | None = None  # CPU: the mapping the weights live in
        self._released: list[weakref.ref[Any]] = []
        self.weights_resident = True
        self.weights_dirty = False  # changed since loaded from ``checkpoint_path``
        # The host backup holds the weights as they are on the device now (set by a copy into
        # it, cleared by an update): a release of unchanged weights copies nothing.
        self._backup_current = False
        #: parameters discarded by a release without a backup and not written since
        self.weights_pending: set[str] = set()
        #: the pending parameters are the checkpoint's (else pushed updates, lost)
        self.pending_reloadable = True
        self.checkpoint_path = self.model_path
        self._pack(self._to_flat_from_params())
        self.max_running_requests = max_running_requests
        loaded = time.perf_counter()
        num_slots = pool_slots(
            device=self.device,
            bytes_per_token=_kv_bytes_per_token(self.native, self.dtype),
            param_bytes=self.param_bytes,
            mem_fraction_static=mem_fraction_static,
            max_total_tokens=max_total_tokens,
        )
        self.mem_fraction_static = mem_fraction_static
        self.pool = KVPool(
            num_layers=self.native.num_layers,
            kv_heads=self.native.num_kv_heads,
            head_dim=self.native.head_dim,
            dtype=self.dtype,
            device=self.device,
            num_slots=num_slots,
            max_rows=max_running_requests,
            context_len=self.max_len,
            exchange=self.exchange,
        )
        # Cleared whenever the KV it indexes stops being valid: the weights change or leave the
        # device, or the pool is dropped (see each of those operations).
        self.prefix_cache = PrefixCache(self.pool, enabled=radix_cache)
        pooled = time.perf_counter()
        self.graphs: StepGraphs | None = None
        emulate = emulate_cuda_graph and self.device.type == "cpu"
        if cuda_graph and (self.device.type == "cuda" or emulate):
            self.graphs = StepGraphs(
                self.native,
                self.pool,
                max_bs=min(cuda_graph_max_bs or max_running_requests, max_running_requests),
                emulate=emulate,
                prefill_max_tokens=(
                    (cuda_graph_max_bs_prefill or PREFILL_GRAPH_MAX_TOKENS)
                    if cuda_graph_prefill
                    else 0
                ),
            )
        #: Whether the weights and the pool come back at the addresses they left (memory
        #: hand-over's segments; CPU mappings): the decode graphs are then kept across a
        #: release and replayed after a resume.
        self.stable_addresses = self._wseg is not None or self.device.type == "cpu"
        #: Why the decode graphs are captured again after every resume (``None``: they are
        #: not, or there are none).
        self.graphs_note: str | None = None
        if self.graphs is not None and not self.stable_addresses:
            self.graphs_note = (
                "CUDA graphs are dropped by a release and captured again by the next resume "
                "(the weights and the KV cache pool come back at other addresses); start with "
                "--memory-handoff to keep them"
            )
        #: The decode step's attention: ``triton`` (each row's positions read in place from
        #: the pool) or ``torch_native`` (the rows' context buckets gathered, then SDPA).
        self.attention_backend = self._attention(attention_backend)
        if torch_compile and self.device.type == "cuda":
            self.native.compile()
        elif torch_compile:  # said at start, not silently slower than asked
            print(
                f"relax-hf: --enable-torch-compile is for CUDA; on {self.device.type} the decode "
                "step runs eager",
                file=sys.stderr,
                flush=True,
            )
        graph_bytes = 0
        if self.graphs is not None:
            cuda = self.device.type == "cuda"
            if cuda:  # as every capture does first: what the cache hands back is not the graphs'
                torch.cuda.empty_cache()
            reserved = torch.cuda.memory_reserved(self.device) if cuda else 0
            self.graphs.warm_up()
            if cuda:  # the warm-ups' cached blocks are not the graphs'
                torch.cuda.empty_cache()
            graph_bytes = torch.cuda.memory_reserved(self.device) - reserved if cuda else 0
        #: Bytes the graphs captured at start hold (their memory pool and buffers);
        #: resident while the ``cuda_graph`` tag is released when the graphs are kept.
        self.graph_bytes = graph_bytes
        #: SGLang's ``memory_usage.graph``: GiB its graphs of each phase took at start-up.
        self.graph_memory_gib = {**dict.fromkeys(GRAPH_PHASES, 0.0), "decode": graph_bytes / GIB}
        self.grammar = GrammarBackend(
            self.tokenizer,
            self.vocab_size,
            self.eos_ids,
            any_whitespace=json_any_whitespace,
            max_whitespace_cnt=json_max_whitespace_cnt,
        )
        if weights_cpu_backup:
            # Allocated up front (pinned on CUDA) so a release costs one device-to-host copy.
            pin = self.device.type == "cuda"
            self._backup = torch.empty(self.param_bytes, dtype=torch.uint8, pin_memory=pin)
        _malloc_trim()
        #: SGLang's ``memory_usage.startup_available``: GiB free on the device once started.
        self.startup_available_gib = available_memory(self.device) / GIB
        #: SGLang's ``startup_time`` phases (seconds) of this runner; ``cuda_graph`` has every
        #: phase SGLang reports (this engine captures decode steps only).
        self.startup_time: dict[str, Any] = {
            "load_weight": loaded - began,
            "kv_cache_allocation": pooled - loaded,
            "scheduler_e2e": time.perf_counter() - began,
            "cuda_graph": {
                **dict.fromkeys(GRAPH_PHASES, 0.0),
                "decode": self.graphs.capture_seconds if self.graphs else 0.0,
            },
        }

    @classmethod
    def from_config(cls, config: Any) -> ModelRunner:
        """The runner a :class:`~relax_hf.server.ServerConfig` describes (blocking: loads)."""
        return cls(
            config.model_path,
            device=config.device,
            dtype=config.dtype,
            weights_cpu_backup=config.weights_cpu_backup,
            attn_implementation=config.attn_implementation,
            mem_fraction_static=config.mem_fraction_static,
            max_total_tokens=config.max_total_tokens,
            max_running_requests=config.max_running_requests,
            context_length=config.context_length,
            cuda_graph=not config.disable_cuda_graph,
            cuda_graph_max_bs=config.cuda_graph_max_bs,
            cuda_graph_prefill=config.cuda_graph_backend_prefill == "full",
            cuda_graph_max_bs_prefill=config.cuda_graph_max_bs_prefill,
            json_any_whitespace=not config.constrained_json_disable_any_whitespace,
            json_max_whitespace_cnt=config.constrained_json_max_whitespace_cnt,
            torch_compile=config.enable_torch_compile,
            memory_handoff=config.memory_handoff,
            radix_cache=not config.disable_radix_cache,
            emulate_cuda_graph=config.emulate_cuda_graph,
            attention_backend=config.attention_backend,
        )

    # -- setup ---------------------------------------------------------------------------

    def _attention(self, asked: str | None) -> str:
        """The decode attention ``asked`` for (``None``: ``triton`` on CUDA where Triton is
        installed, else ``torch_native``, said at start on CUDA); installs the kernel.
        :raises ValueError: ``triton`` where it cannot run, or an unknown name."""
        cuda = self.device.type == "cuda"
        why = paged_attention.available() if cuda else f"it runs on CUDA, not {self.device.type}"
        if asked is not None and asked not in ATTENTION_BACKENDS:
            raise ValueError(f"--attention-backend: {asked!r}; use one of {ATTENTION_BACKENDS}")
        if asked == "triton" and why is not None:
            raise ValueError(f"--attention-backend triton: {why}; use torch_native")
        if asked is None and why is not None:
            if cuda:  # said at start, not silently slower than it could be
                print(
                    f"relax-hf: decode attention torch_native (gather + SDPA): {why}",
                    file=sys.stderr,
                    flush=True,
                )
            return "torch_native"
        if asked == "torch_native":
            return asked
        self.native.paged_attention = paged_attention.decode_attention
        return "triton"

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for src in (self.config, getattr(self.model, "generation_config", None)):
            eos = getattr(src, "eos_token_id", None)
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, list | tuple):
                ids.update(int(e) for e in eos)
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return frozenset(ids)

    def _pad_id(self) -> int:
        for cand in (self.tokenizer.pad_token_id, getattr(self.config, "pad_token_id", None)):
            if isinstance(cand, int):
                return cand
        return min(self.eos_ids) if self.eos_ids else 0

    # -- flat weight buffer --------------------------------------------------------------

    def _views(self, flat: torch.Tensor) -> Iterator[tuple[str, torch.nn.Parameter, torch.Tensor]]:
        for name, p in self.params.items():
            off, nbytes, shape, dtype = self._layout[name]
            yield name, p, flat[off : off + nbytes].view(dtype).view(shape)

    def _alloc_flat(self, *, fresh: bool = False) -> tuple[torch.Tensor, dict[str, Any]]:
        """A flat byte buffer for every weight on the device, and what mapping it took.

        On CPU it is a private anonymous memory mapping of its own (no allocator caching): a release
        hands its pages back to the OS at once and keeps the addresses, which the next buffer
        takes again (``fresh``: a new mapping, for a load beside the weights held now). With
        memory hand-over it is the weight segment, mapped (the same addresses every time).
        """
        if self._wseg is not None:
            mapped = _prefixed(self._wseg.map())
            return self._wseg.tensor(), mapped
        if self.device.type != "cpu":
            return torch.empty(self.param_bytes, dtype=torch.uint8, device=self.device), {}
        if fresh or self._cpu_map is None:
            # Private: pages handed back (MADV_DONTNEED) are freed and read as zeros after; a
            # shared mapping would keep them, and their bytes, in the kernel's shared memory.
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
            self._cpu_map = mmap.mmap(-1, max(self.param_bytes, 1), flags=flags)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # frombuffer warns about buffers it cannot resize
            raw = torch.frombuffer(self._cpu_map, dtype=torch.uint8)
        return raw[: self.param_bytes], {}

    def _to_flat_from_params(self) -> torch.Tensor:
        flat, _ = self._alloc_flat()
        for _, p, view in self._views(flat):
            view.copy_(p.data)
        return flat

    def _pack(self, flat: torch.Tensor) -> None:
        """Point every parameter at its slice of ``flat`` (the old storages are dropped)."""
        for _, p, view in self._views(flat):
            p.data = view
        self._flat = flat
        if hasattr(self, "native"):
            self.native.bind()
        if getattr(self, "graphs", None) is not None and self.pool.resident:
            self.graphs.drop_if_moved()  # type: ignore[union-attr]

    def synchronize(self) -> None:
        """Wait for the device's queued work (a no-op on CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- forward -------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(
        self,
        ids: torch.Tensor,
        lens: torch.Tensor,
        rows: torch.Tensor,
        starts: torch.Tensor | None = None,
        ctx: int = 0,
    ) -> torch.Tensor:
        """Prefill right-padded ``ids [B, T]`` into the pool rows; hidden states ``[B, T, H]``.

        With ``starts`` the rows' tokens follow cached prefixes of those lengths (``ctx``: the
        longest ``start + len``; see :meth:`NativeModel.prefill_after`).
        """
        with sdpa_kernel(EAGER_ATTENTION):
            if starts is None:
                return self.native.prefill(self.pool, ids, lens, rows)
            return self.native.prefill_after(self.pool, ids, lens, rows, starts, ctx)

    @torch.inference_mode()
    def prefill_captured(
        self, host: torch.Tensor, ctx: int, before: Callable[[], None] | None = None
    ) -> torch.Tensor | None:
        """Float32 logits of each row's last token from a prefill graph (``host``: CPU int64
        rows of tokens after their cached prefixes, then each one's count, pool row and prefix;
        ``before`` runs first where a graph replays:
        :meth:`~relax_hf.modeling.StepGraphs.run_prefill`); ``None`` where no graph fits (or
        there are none): prefill eagerly. Valid until the next prefill graph's replay."""
        return None if self.graphs is None else self.graphs.run_prefill(host, ctx, before)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of hidden states."""
        return self.native.logits(hidden)

    @torch.inference_mode()
    def decode(
        self, host_packed: torch.Tensor, host_temps: torch.Tensor, ctx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step (CPU inputs, see :meth:`NativeModel.decode_step`): logits, tokens.

        Replays a CUDA graph when one fits (capturing it on first use), else runs eagerly.
        """
        if self.graphs is not None:
            out = self.graphs.run(host_packed, host_temps, ctx)
            if out is not None:
                return out
        packed = host_packed.to(self.device, non_blocking=True)
        temps = host_temps.to(self.device, non_blocking=True)
        with sdpa_kernel(EAGER_ATTENTION):
            return self.native.decode_step(self.pool, packed, temps, ctx)

    def weights_digest(self) -> str:
        """SHA-256 of the weight bytes as loaded now (``""`` while released)."""
        import hashlib

        digest = hashlib.sha256()
        flat = self._flat
        if flat is not None:
            step = 64 << 20
            for start in range(0, flat.numel(), step):
                chunk = flat[start : start + step].cpu().contiguous()
                digest.update(chunk.numpy().data)
        return digest.hexdigest() if flat is not None else ""

    # -- residency -----------------------------------------------------------------------

    def release_weights(self) -> dict[str, Any]:
        """Drop the weights from the device (backing them up first if configured). Idempotent."""
        if not self.weights_resident:
            return {"released_bytes": 0}
        start = time.perf_counter()
        assert self._flat is not None
        self.prefix_cache.clear()  # the weights may come back other than they were
        copied = 0
        if self.weights_cpu_backup and not self._backup_current:
            if self._backup is None:
                pin = self.device.type == "cuda"
                self._backup = torch.empty(self.param_bytes, dtype=torch.uint8, pin_memory=pin)
            self._backup.copy_(self._flat, non_blocking=True)
            self.synchronize()
            self._backup_current = True
            copied = self.param_bytes
        copy_done = time.perf_counter()
        self._released = [weakref.ref(self._flat.untyped_storage())]
        self._flat = None
        self.native.unbind()  # its views would keep the buffer alive
        if self.graphs is not None and not self.stable_addresses:
            self.graphs.drop()  # they point into the buffer
        for p in self.params.values():
            p.data = torch.empty(0, dtype=p.dtype, device=self.device)
        self.weights_resident = False
        unmapped: dict[str, Any] = {}
        if self._wseg is not None:
            self.synchronize()  # nothing may still read the buffer when its memory is unmapped
            unmapped = _prefixed(self._wseg.unmap(park=True))
        freed = self.free_cached_memory(self._released)
        if self._cpu_map is not None:
            self._cpu_map.madvise(mmap.MADV_DONTNEED)  # the pages go back; the addresses stay
        return {
            "released_bytes": self.param_bytes,
            **unmapped,
            "backup_copied_bytes": copied,
            "copy_seconds": copy_done - start,
            **freed,
            "seconds": time.perf_counter() - start,
        }

    def resume_weights(self, *, wait: bool = True) -> dict[str, Any]:
        """Bring the weights back: from the host backup, or by reloading the checkpoint.

        Without ``wait`` a copy from the host backup is only started (the device runs it in
        stream order before anything queued after it); the caller synchronises.
        """
        if self.weights_resident:
            return {"source": "resident", "seconds": 0.0}
        start = time.perf_counter()
        flat, mapped = self._alloc_flat()
        self.synchronize()
        allocated = time.perf_counter()
        if self._backup_current:
            assert self._backup is not None
            flat.copy_(self._backup, non_blocking=True)
            if wait:
                self.synchronize()
            source = "cpu_backup"
        else:
            # Nothing read back: a push follows (or the checkpoint, when something needs it).
            # Zeroed, so that what runs on them meanwhile (the resume's generation check) is
            # defined; the CPU mapping's pages handed back read as zeros already.
            if self._cpu_map is None:
                flat.zero_()
            self.pending_reloadable = not self.weights_dirty
            self.weights_pending = set(self.params)
            source = "discarded"
        copy_seconds = time.perf_counter() - start
        self._pack(flat)
        self.weights_resident = True
        return {
            "source": source,
            "seconds": copy_seconds,
            "alloc_seconds": allocated - start,
            **mapped,
            "updates_lost": bool(self.weights_pending) and not self.pending_reloadable,
            "pending_parameters": len(self.weights_pending),
        }

    def pending_error(self) -> str | None:
        """Why the weights cannot be used now (``None``: they can, perhaps after
        :meth:`reload_pending`)."""
        if not self.weights_pending or self.pending_reloadable:
            return None
        names = sorted(self.weights_pending)
        return (
            f"the weights were discarded by a release without a CPU backup and the updates since "
            f"the checkpoint were lost; {len(names)} of {len(self.params)} parameters are not "
            f"written again yet ({', '.join(names[:3])}{', …' if len(names) > 3 else ''}): push "
            "every parameter (update_weights_from_*) or load a checkpoint, or start the engine "
            "with weights_cpu_backup"
        )

    def reload_pending(self) -> dict[str, Any]:
        """Read the pending parameters back from the checkpoint (the others were pushed since).

        :raises WeightsError: they are not the checkpoint's (see :meth:`pending_error`)."""
        if not self.weights_pending:
            return {"reloaded": 0}
        error = self.pending_error()
        if error is not None:
            raise WeightsError(error)
        assert self._flat is not None
        start = time.perf_counter()
        n = len(self.weights_pending)
        self._load_checkpoint_into(self._flat, self.checkpoint_path, only=self.weights_pending)
        self.synchronize()
        self.weights_pending = set()
        return {"reloaded": n, "seconds": time.perf_counter() - start}

    @property
    def kv_resident(self) -> bool:
        """Whether the KV cache pool is held."""
        return self.pool.resident

    def release_kv_cache(self) -> dict[str, Any]:
        """Drop the KV cache pool (refused while a sequence holds a row). Idempotent."""
        if not self.pool.resident:
            return {"released_bytes": 0}
        if self.graphs is not None and not self.stable_addresses:
            self.graphs.drop()  # they read the pool's addresses
        self.prefix_cache.clear()  # its slots go with the pool
        assert self.pool.kv is not None
        start = time.perf_counter()
        buffer = [weakref.ref(self.pool.kv.untyped_storage())]
        if self.pool.segment is not None:
            self.synchronize()  # nothing may still read the pool when its memory is unmapped
        unmapped = _prefixed(self.pool.release())
        freed = self.free_cached_memory(buffer)
        return {
            "released_bytes": self.pool.nbytes,
            **unmapped,
            **freed,
            "seconds": time.perf_counter() - start,
        }

    def resume_kv_cache(self) -> dict[str, Any]:
        """Take the KV cache pool again (every slot free). Idempotent."""
        if self.pool.resident:
            return {"source": "resident", "seconds": 0.0}
        start = time.perf_counter()
        mapped = _prefixed(self.pool.allocate())
        self.synchronize()
        return {"bytes": self.pool.nbytes, **mapped, "seconds": time.perf_counter() - start}

    def release_cuda_graphs(self) -> dict[str, Any]:
        """Drop every captured decode graph and its memory pool; where the addresses are
        stable, keep them instead (resident, :attr:`graph_bytes`) for the next resume to
        replay. Idempotent."""
        n = self.graphs.captured if self.graphs is not None else 0
        if self.graphs is not None and self.stable_addresses:
            return {"graphs": n, "kept": True, "resident_bytes": self.graph_bytes}
        if self.graphs is not None:
            self.graphs.drop()
            self.free_cached_memory()
        return {"graphs": n}

    def capture_cuda_graphs(self) -> dict[str, Any]:
        """Capture again the decode graphs captured before (needs weights and pool)."""
        if self.graphs is None or not (self.weights_resident and self.pool.resident):
            return {"graphs": 0, "seconds": 0.0}
        start = time.perf_counter()
        n = self.graphs.recapture()
        self.synchronize()
        return {"graphs": n, "seconds": time.perf_counter() - start}

    def release(self, tags: tuple[str, ...] | list[str]) -> dict[str, Any]:
        """Release the memory of ``tags`` (weights, kv_cache, cuda_graph). Idempotent."""
        detail: dict[str, Any] = {}
        if "cuda_graph" in tags:
            detail["cuda_graph"] = self.release_cuda_graphs()
        if "weights" in tags and self.weights_resident:
            detail["weights"] = self.release_weights()
        if "kv_cache" in tags:
            detail["kv_cache"] = self.release_kv_cache()
        return detail

    def resume(self, tags: tuple[str, ...] | list[str], *, graphs: bool) -> dict[str, Any]:
        """Resume ``tags``, weights first; then, when ``graphs`` (the ``cuda_graph`` tag is
        resident) and weights and pool are both back, capture the decode graphs again."""
        detail: dict[str, Any] = {}
        weights = "weights" in tags and not self.weights_resident
        pool = "kv_cache" in tags and not self.pool.resident
        # A pool that is a segment is only mapped (no device work): the weights' copy from the
        # host backup runs meanwhile, and the pool's resume ends by synchronising the device,
        # after the copy too. The weights' ``seconds`` then run until that synchronisation; the
        # pool's (``overlapped``) are inside them.
        overlap = weights and pool and self.pool.segment is not None and self._backup_current
        began = time.perf_counter()
        if weights:
            detail["weights"] = self.resume_weights(wait=not overlap)
        if pool:
            detail["kv_cache"] = self.resume_kv_cache()
        if overlap:
            detail["weights"]["seconds"] = time.perf_counter() - began
            detail["weights"]["copy_overlaps"] = "kv_cache"
            detail["kv_cache"]["overlapped"] = True
        if self.graphs is not None and self.weights_resident and self.pool.resident:
            kept = self.graphs.captured
            if self.graphs.drop_if_moved():
                detail["cuda_graph_moved"] = {"dropped": kept}
            elif kept and graphs:
                detail["cuda_graph"] = {"graphs": kept, "kept": True, "seconds": 0.0}
        if graphs and self.graphs is not None and self.graphs.captured == 0:
            detail["cuda_graph"] = self.capture_cuda_graphs()
        return detail

    def flush_cache(self) -> None:
        """``flush_cache``: drop the prefix cache and hand the allocator's caches back (no
        storage was dropped, so no garbage collection)."""
        self.prefix_cache.clear()
        self.free_cached_memory([])

    #: Objects :meth:`freeze_heap` froze, kept here because ``gc.get_freeze_count()`` walks
    #: every one of them (15-40 ms for an engine's 1-2 M, holding the GIL): ``/server_info``
    #: runs on the compute thread and reads this instead. Process-wide, as the collector's
    #: frozen generation is.
    frozen_objects = 0

    @staticmethod
    def freeze_heap() -> int:
        """Take every object alive now (the start-up's: torch, transformers, the tokenizer, the
        model, the graphs) out of the garbage collector's full collections, as SGLang and vLLM
        do once started; the objects frozen. A full collection then scans only what serving
        made since: on an H200's host one of an engine's 1-2 M start-up objects took 0.2-0.3 s,
        and the genrm engine of ``run-h200.toml`` ran three in each judge phase of 2.5 s
        (requests, their token lists and log-prob rows living long enough to be counted)."""
        gc.collect()
        gc.freeze()
        ModelRunner.frozen_objects = gc.get_freeze_count()
        return ModelRunner.frozen_objects

    def free_cached_memory(self, released: list[weakref.ref[Any]] | None = None) -> dict[str, Any]:
        """Return freed memory to the device driver / the OS; what it took.

        With ``released`` (weak references to the storages just dropped), a garbage collection
        runs only if one of them is still alive (held by a reference cycle): a full collection
        costs ~0.1 s in a process that imported torch and transformers, which a release that
        freed its buffers at once need not pay. Without it, it always runs. Where the start-up
        heap is frozen (:meth:`freeze_heap`), a collection looks at it too only if it must:
        without ``released``, or when a released storage outlived the collection of the rest.
        """
        start = time.perf_counter()

        def held() -> bool:  # a released storage still alive (or none named)
            return released is None or any(r() is not None for r in released)

        collected = held()
        if collected:
            frozen = gc.get_freeze_count() > 0  # a walk, but only before a full collection
            if released is not None or not frozen:
                gc.collect()  # what is not frozen: enough unless a released storage outlives it
            if frozen and held():
                gc.unfreeze()  # a cycle the start-up made may hold it
                gc.collect()
                gc.freeze()
                ModelRunner.frozen_objects = gc.get_freeze_count()
        collected_at = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            if self.warmer is not None:
                self.warmer.released()
        else:
            _malloc_trim()
        return {
            "gc_seconds": collected_at - start if collected else 0.0,
            "free_seconds": time.perf_counter() - collected_at,
        }

    def memory_report(self) -> dict[str, Any]:
        """Honest accounting of what is held: parameter storages on the device, RSS, CUDA."""
        seen: dict[int, int] = {}
        for p in self.params.values():
            if p.device == self.device and p.numel() > 0:
                s = p.data.untyped_storage()
                seen[s.data_ptr()] = s.nbytes()
        report: dict[str, Any] = {
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "param_bytes": self.param_bytes,
            "resident_param_bytes": sum(seen.values()),
            "released_storages_alive": sum(1 for r in self._released if r() is not None),
            "weights_pending": len(self.weights_pending),
            "weights_pending_reloadable": self.pending_reloadable,
            "cpu_backup_bytes": 0 if self._backup is None else self._backup.numel(),
            "cpu_backup_pinned": bool(self._backup is not None and self._backup.is_pinned()),
            "process_rss_bytes": process_rss_bytes(),
            "kv_cache": {
                "resident": self.pool.resident,
                "bytes": self.pool.nbytes if self.pool.resident else 0,
                "pool_bytes": self.pool.nbytes,
                "num_slots": self.pool.num_slots,
                "bytes_per_token": self.pool.bytes_per_token,
                "free_slots": self.pool.free_slots if self.pool.resident else 0,
                "prefix_cache_slots": self.prefix_cache.tokens,
                "rows_in_use": self.pool.rows_in_use,
                "mem_fraction_static": self.mem_fraction_static,
            },
            "cuda_graphs": {
                "enabled": self.graphs is not None,
                "emulated": self.graphs is not None and self.graphs.emulate,
                "captured": self.graphs.captured if self.graphs is not None else 0,
                "capture_seconds": self.graphs.capture_seconds if self.graphs is not None else 0,
                "captures": self.graphs.captures if self.graphs is not None else 0,
                "replays": self.graphs.replays if self.graphs is not None else 0,
                # Prefill steps of a few prompts after cached prefixes, replayed.
                "prefill_captured": self.graphs.prefill_captured if self.graphs else 0,
                "prefill_replays": self.graphs.prefill_replays if self.graphs else 0,
                # Replays of a captured graph, padded, for a shape not captured (no capture).
                "stand_ins": self.graphs.stand_ins if self.graphs else 0,
                "kept_across_release": self.graphs is not None and self.stable_addresses,
                # --enable-torch-compile: the decode step's element-wise pieces are fused.
                "torch_compile": self.native.compiled,
                "bytes": self.graph_bytes,
                "note": self.graphs_note,
            },
        }
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            reserved = torch.cuda.memory_reserved(self.device)
            mapped = sum(
                seg.size for seg in (self._wseg, self.pool.segment) if seg and seg.resident
            )
            report.update(
                cuda_memory_allocated=torch.cuda.memory_allocated(self.device),
                cuda_memory_reserved=reserved,
                # What this engine holds: torch's allocator and the segments it maps itself.
                cuda_memory_held=reserved + mapped,
                cuda_device_free=free,
                cuda_device_total=total,
            )
            if self.warmer is not None:
                report["driver_warmup"] = {
                    "log": [list(e) for e in self.warmer.log],
                    "error": self.warmer.error,
                }
            if self.exchange is not None:
                report["memory_handoff"] = {
                    "mapped_bytes": mapped,
                    "parked_bytes": self.exchange.parked_bytes,
                    "handed_out_bytes": self.exchange.handed_out_bytes,
                    "handed_in_bytes": self.exchange.handed_in_bytes,
                }
        return report

    # -- loading weights -----------------------------------------------------------------

    def _checkpoint_files(self, path: str) -> list[Path]:
        root = Path(path)
        if not root.is_dir():
            raise WeightsError(f"model_path: {path!r} is not a directory")
        index = root / "model.safetensors.index.json"
        if index.exists():
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
            return [root / name for name in files]
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise WeightsError(f"model_path: no *.safetensors checkpoint in {path!r}")
        return files

    def _iter_checkpoint(self, path: str) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        for file in self._checkpoint_files(path):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    yield key, f.get_tensor(key)

    def _load_checkpoint_into(
        self, flat: torch.Tensor, path: str, only: set[str] | None = None
    ) -> None:
        views = {n: view for n, _, view in self._views(flat) if only is None or n in only}
        missing = set(views)
        for key, tensor in self._iter_checkpoint(path):
            view = views.get(key)
            if view is None:
                continue
            view.copy_(tensor, non_blocking=False)
            missing.discard(key)
        if missing:
            raise WeightsError(
                f"model_path: checkpoint {path!r} lacks parameters {sorted(missing)[:5]}"
            )

    def parameter(self, name: str) -> torch.Tensor:
        """The weight ``name`` as loaded now (a view; read it on the compute thread).

        :raises WeightsError: no such parameter, the weights are released, or it was
            discarded and no push wrote it since (:meth:`reload_pending` first).
        """
        if not self.weights_resident:
            raise WeightsError("weights are released; resume_memory_occupation(['weights']) first")
        p = self.params.get(name)
        if p is None:
            known = ", ".join(list(self.params)[:4])
            raise WeightsError(f"name: unknown parameter {name!r} (known: {known}, …)")
        if name in self.weights_pending:
            raise WeightsError(f"name: {name!r} was discarded by a release and not written since")
        return p.data

    def check_named(self, named: Iterable[tuple[str, tuple[int, ...]]], field: str) -> None:
        """Check names and shapes before any byte is written (updates are all-or-nothing)."""
        for i, (name, shape) in enumerate(named):
            p = self.params.get(name)
            if p is None:
                known = ", ".join(list(self.params)[:4])
                raise WeightsError(f"{field}[{i}]: unknown parameter {name!r} (known: {known}, …)")
            expected = self._layout[name][2]
            if tuple(shape) != expected:
                raise WeightsError(
                    f"{field}[{i}]: parameter {name!r} has shape {list(expected)}, "
                    f"got {list(shape)}"
                )

    def load_named_tensors(self, named: list[tuple[str, torch.Tensor]], field: str) -> int:
        """Copy tensors into the named parameters (dtype converted); returns the byte count."""
        if not self.weights_resident:
            raise WeightsError("weights are released; resume_memory_occupation(['weights']) first")
        self.check_named(((n, tuple(t.shape)) for n, t in named), field)
        self.prefix_cache.clear()  # KV computed with the old weights is never served again
        total = 0
        with torch.no_grad():
            for name, tensor in named:
                p = self.params[name]
                p.data.copy_(tensor, non_blocking=True)
                total += p.numel() * p.element_size()
        self.synchronize()
        self.weights_dirty = True
        self._backup_current = False
        self.weights_pending.difference_update(name for name, _ in named)
        return total

    def load_from_disk(self, path: str) -> int:
        """Load a checkpoint directory of the same architecture into the weights."""
        if not self.weights_resident:
            raise WeightsError("weights are released; resume_memory_occupation(['weights']) first")
        self.prefix_cache.clear()  # KV computed with the old weights is never served again
        if self._wseg is not None and self._flat is not None:
            # Loaded aside first (a failed load leaves the weights as they were), then copied
            # into the segment: the same addresses, so views and graphs stay valid.
            staging = torch.empty(self.param_bytes, dtype=torch.uint8, device=self.device)
            self._load_checkpoint_into(staging, path)
            self._flat.copy_(staging)
            self.synchronize()
            del staging
            had_graphs = False
        else:
            flat, _ = self._alloc_flat(fresh=True)
            self._load_checkpoint_into(flat, path)
            had_graphs = self.graphs is not None and self.graphs.captured > 0
            self._pack(flat)  # new addresses: the graphs are dropped
        self.free_cached_memory()
        if had_graphs:
            self.capture_cuda_graphs()
        self.checkpoint_path = path
        self.weights_dirty = False
        self._backup_current = False
        self.weights_pending = set()
        return self.param_bytes
