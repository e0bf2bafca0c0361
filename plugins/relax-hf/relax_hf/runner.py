"""The model and its memory: loading, forward passes, weight residency, weight loading.

:class:`ModelRunner` is used from one compute thread only (the scheduler's executor); nothing
here is thread-safe on its own.

Weights live in one flat device buffer; every parameter is a view into it. Releasing weights
drops the buffer (and, on CUDA, returns the cached blocks to the driver), so the bytes really
leave the device. With ``weights_cpu_backup`` the bytes are first copied into one flat host
buffer (pinned on CUDA) and resumed with a single non-blocking host-to-device copy; without it
resuming reloads the checkpoint from disk.
"""

from __future__ import annotations

import ctypes
import gc
import inspect
import json
import mmap
import os
import time
import warnings
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = ["ModelRunner", "WeightsError"]

_ALIGN = 512
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class WeightsError(ValueError):
    """A weight operation cannot be done as asked (bad names, shapes, state); a 400."""


def _malloc_trim() -> None:
    # glibc keeps freed heap pages; trimming hands them back so RSS reflects what was freed.
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def process_rss_bytes() -> int:
    """Resident set size of this process, from /proc (0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


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
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_path = str(model_path)
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device.index or 0)
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.weights_cpu_backup = weights_cpu_backup
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
        self.max_len = int(getattr(self.config, "max_position_embeddings", 1 << 20))
        self.eos_ids = self._eos_ids()
        self.pad_id = self._pad_id()
        params = self.model.forward if hasattr(self.model, "forward") else None
        names = inspect.signature(params).parameters if params is not None else {}
        self._cache_kw = "cache" if "cache" in names else "past_key_values"
        self.params: dict[str, torch.nn.Parameter] = dict(self.model.named_parameters())
        # name -> (byte offset, byte count, shape, dtype); shapes are kept for released params.
        self._layout: dict[str, tuple[int, int, tuple[int, ...], torch.dtype]] = {}
        offset = 0
        for name, p in self.params.items():
            nbytes = p.numel() * p.element_size()
            self._layout[name] = (offset, nbytes, tuple(p.shape), p.dtype)
            offset += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        self.param_bytes = offset
        self._backup: torch.Tensor | None = None
        self._flat: torch.Tensor | None = None
        self._released: list[weakref.ref[Any]] = []
        self.weights_resident = True
        self.weights_dirty = False  # changed since loaded from ``checkpoint_path``
        self.checkpoint_path = self.model_path
        self._pack(self._to_flat_from_params())
        if weights_cpu_backup:
            # Allocated up front (pinned on CUDA) so a release costs one device-to-host copy.
            pin = self.device.type == "cuda"
            self._backup = torch.empty(self.param_bytes, dtype=torch.uint8, pin_memory=pin)
        _malloc_trim()

    # -- setup ---------------------------------------------------------------------------

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

    def _alloc_flat(self) -> torch.Tensor:
        """A flat byte buffer for every weight on the device.

        On CPU it is an anonymous memory mapping of its own, so dropping it unmaps the pages at
        once (no allocator caching): released weights really leave the process.
        """
        if self.device.type != "cpu":
            return torch.empty(self.param_bytes, dtype=torch.uint8, device=self.device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # frombuffer warns about buffers it cannot resize
            return torch.frombuffer(mmap.mmap(-1, max(self.param_bytes, 1)), dtype=torch.uint8)[
                : self.param_bytes
            ]

    def _to_flat_from_params(self) -> torch.Tensor:
        flat = self._alloc_flat()
        for _, p, view in self._views(flat):
            view.copy_(p.data)
        return flat

    def _pack(self, flat: torch.Tensor) -> None:
        """Point every parameter at its slice of ``flat`` (the old storages are dropped)."""
        for _, p, view in self._views(flat):
            p.data = view
        self._flat = flat

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- forward -------------------------------------------------------------------------

    def new_cache(self) -> Any:
        from transformers import DynamicCache

        try:
            return DynamicCache(config=self.config)
        except TypeError:
            return DynamicCache()

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Any,
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        """One forward pass with ``cache`` (updated in place); logits ``[B, T, V]``, model dtype."""
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=logits_to_keep,
            **{self._cache_kw: cache},
        )
        return out.logits  # type: ignore[no-any-return]

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
        if self.weights_cpu_backup:
            if self._backup is None:
                pin = self.device.type == "cuda"
                self._backup = torch.empty(self.param_bytes, dtype=torch.uint8, pin_memory=pin)
            self._backup.copy_(self._flat, non_blocking=True)
            self._sync()
        self._released = [weakref.ref(self._flat.untyped_storage())]
        self._flat = None
        for p in self.params.values():
            p.data = torch.empty(0, dtype=p.dtype, device=self.device)
        self.weights_resident = False
        self.free_cached_memory()
        return {"released_bytes": self.param_bytes, "seconds": time.perf_counter() - start}

    def resume_weights(self) -> dict[str, Any]:
        """Bring the weights back: from the host backup, or by reloading the checkpoint."""
        if self.weights_resident:
            return {"source": "resident", "seconds": 0.0}
        start = time.perf_counter()
        flat = self._alloc_flat()
        if self._backup is not None:
            flat.copy_(self._backup, non_blocking=True)
            self._sync()
            source = "cpu_backup"
        else:
            self._load_checkpoint_into(flat, self.checkpoint_path)
            source = f"checkpoint {self.checkpoint_path}"
        copy_seconds = time.perf_counter() - start
        self._pack(flat)
        self.weights_resident = True
        lost = self.weights_dirty and self._backup is None
        self.weights_dirty = self.weights_dirty and not lost
        return {"source": source, "seconds": copy_seconds, "updates_lost": lost}

    def free_cached_memory(self) -> None:
        """Return freed memory to the device driver / the OS."""
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            _malloc_trim()

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
            "cpu_backup_bytes": 0 if self._backup is None else self._backup.numel(),
            "cpu_backup_pinned": bool(self._backup is not None and self._backup.is_pinned()),
            "process_rss_bytes": process_rss_bytes(),
        }
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            report.update(
                cuda_memory_allocated=torch.cuda.memory_allocated(self.device),
                cuda_memory_reserved=torch.cuda.memory_reserved(self.device),
                cuda_device_free=free,
                cuda_device_total=total,
            )
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

    def _load_checkpoint_into(self, flat: torch.Tensor, path: str) -> None:
        views = {name: view for name, _, view in self._views(flat)}
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
        total = 0
        with torch.no_grad():
            for name, tensor in named:
                p = self.params[name]
                p.data.copy_(tensor, non_blocking=True)
                total += p.numel() * p.element_size()
        self._sync()
        self.weights_dirty = True
        return total

    def load_from_disk(self, path: str) -> int:
        """Load a checkpoint directory of the same architecture into the weights."""
        if not self.weights_resident:
            raise WeightsError("weights are released; resume_memory_occupation(['weights']) first")
        flat = self._alloc_flat()
        self._load_checkpoint_into(flat, path)
        self._pack(flat)
        self.free_cached_memory()
        self.checkpoint_path = path
        self.weights_dirty = False
        return self.param_bytes
