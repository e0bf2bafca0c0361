"""The KV cache pool: preallocated token slots and the request-to-token table (SGLang's design).

One buffer holds, for every layer, the key and value of ``num_slots`` token positions
(``[layers, num_slots, 2, kv_heads, head_dim]``: a slot's key and value side by side, so one
copy writes a step's keys and values and one gather reads a context's); slot 0 is a scratch
slot that padding rows of a CUDA-graph batch write into. A running sequence owns a *row* of
``req_to_token`` (``[max_rows + 1, context_len]``, row 0 is the padding row's): entry ``t`` is
the slot of its position ``t``. Slots are reference-counted, so the ``n`` samples of one
request share the prompt's slots (its KV is computed once) and own only the slots of their own
tokens.

The pool is sized once at start-up (``--mem-fraction-static`` / ``--max-total-tokens``) and
held until ``kv_cache`` is released: :meth:`KVPool.release` drops the buffer (the memory goes
back to the driver or the OS), :meth:`KVPool.allocate` takes it again. With an
:class:`~relax_hf.vmm.Exchange` (``--memory-handoff``) the buffer is a
:class:`~relax_hf.vmm.Segment`: released, its memory is parked for the next engine on the GPU;
allocated, it takes parked memory first. Compute thread only.
"""

from __future__ import annotations

import mmap
import warnings
from typing import Any

import numpy as np
import torch

from relax_hf.vmm import DriverError, Exchange, Segment

__all__ = ["KVPool", "PoolFull", "PoolUnavailable"]


class PoolFull(RuntimeError):
    """Not enough free slots or rows for what was asked (the scheduler waits)."""


class PoolUnavailable(RuntimeError):
    """The device has not the free memory the pool needs (another process holds it)."""


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device`` without waiting for the device's queued work: through pinned
    memory, whose block the host allocator keeps until the copy is done (on CPU: as is)."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class KVPool:
    """Token slots for every layer's K and V, with reference counts and request rows."""

    def __init__(
        self,
        *,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        num_slots: int,
        max_rows: int,
        context_len: int,
        exchange: Exchange | None = None,
    ) -> None:
        if num_slots < 2:
            raise ValueError(f"the KV cache pool needs at least 2 slots, got {num_slots}")
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.num_slots = num_slots
        self.max_rows = max_rows
        self.context_len = context_len
        elem = torch.empty(0, dtype=dtype).element_size()
        self.bytes_per_token = num_layers * 2 * kv_heads * head_dim * elem
        self.nbytes = self.bytes_per_token * num_slots
        # In a segment the request-to-token table follows the slots (its memory is handed over
        # with theirs); otherwise torch allocates it.
        self._table_offset = -(-self.nbytes // 512) * 512
        table_bytes = (max_rows + 1) * context_len * 8
        self._table_bytes = table_bytes
        self._map: mmap.mmap | None = None  # CPU: the mapping the pool and table live in
        self.segment: Segment | None = None
        if exchange is not None:
            self.segment = Segment(
                exchange.device,
                self._table_offset + table_bytes,
                exchange=exchange,
                name="kv_cache",
            )
        self.kv: torch.Tensor | None = None
        self.req_to_token: torch.Tensor | None = None
        self._stack = np.empty(0, dtype=np.int64)
        self._top = 0
        self._refs = np.zeros(0, dtype=np.int32)
        self._rows: list[int] = []
        self.allocate()

    # -- residency -------------------------------------------------------------------------

    @property
    def resident(self) -> bool:
        """Whether the buffer is held."""
        return self.kv is not None

    def _unavailable(self, free: int, total: int) -> PoolUnavailable:
        return PoolUnavailable(
            f"the KV cache pool needs {self.nbytes / 2**30:.1f} GiB on {self.device}, "
            f"{free / 2**30:.1f} GiB of its {total / 2**30:.1f} GiB are free (another "
            "process holds the rest); release that memory first, or start the engine "
            "with a smaller --mem-fraction-static / --max-total-tokens"
        )

    def allocate(self) -> dict[str, Any]:
        """Take the buffer (every slot free); what mapping a segment took. Idempotent."""
        if self.kv is not None:
            return {}
        detail: dict[str, Any] = {}
        if self.segment is not None:
            try:
                detail = self.segment.map()
            except DriverError as exc:
                if "OUT_OF_MEMORY" not in str(exc):
                    raise
                raise self._unavailable(*torch.cuda.mem_get_info(self.device)) from exc
            raw = self.segment.tensor()
        elif self.device.type == "cpu":
            # An anonymous mapping of its own, kept for the engine's life: pages are committed
            # when written and handed back to the OS on release (no allocator keeps them), and
            # the addresses stay (so do the decode graphs that read them), as a segment's.
            if self._map is None:
                self._map = mmap.mmap(-1, self._table_offset + self._table_bytes)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # frombuffer warns about non-resizable buffers
                raw = torch.frombuffer(self._map, dtype=torch.uint8)
        else:
            free, total = torch.cuda.mem_get_info(self.device)
            if self.nbytes > free:
                raise self._unavailable(free, total)
            raw = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        self.kv = (
            raw[: self.nbytes]
            .view(self.dtype)
            .view(self.num_layers, self.num_slots, 2, self.kv_heads, self.head_dim)
        )
        if self.segment is not None or self._map is not None:
            table = raw[self._table_offset : self._table_offset + self._table_bytes]
            table = table.view(torch.int64)
            self.req_to_token = table.view(self.max_rows + 1, self.context_len).zero_()
        else:
            self.req_to_token = torch.zeros(
                (self.max_rows + 1, self.context_len), dtype=torch.int64, device=self.device
            )
        if len(self._stack) != self.num_slots - 1 or self._top != len(self._stack):
            # The first allocation. A release leaves every slot on the free stack with a count
            # of 0 and every row free: nothing to rebuild after one.
            self._stack = np.arange(self.num_slots - 1, 0, -1, dtype=np.int64)
            self._top = len(self._stack)
            self._refs = np.zeros(self.num_slots, dtype=np.int32)
            self._rows = list(range(self.max_rows, 0, -1))
        return detail

    def release(self) -> dict[str, Any]:
        """Drop the buffer; refused (``RuntimeError``) while a row is in use; what unmapping a
        segment took (the caller has synchronised the device). Idempotent."""
        if self.kv is None:
            return {}
        if self.rows_in_use:
            raise RuntimeError(f"{self.rows_in_use} sequence(s) still hold KV cache rows")
        self.kv = None
        self.req_to_token = None
        if self.segment is not None:
            return self.segment.unmap(park=True)
        if self._map is not None:
            self._map.madvise(mmap.MADV_DONTNEED)  # the pages go back; the addresses stay
        return {}

    # -- accounting ------------------------------------------------------------------------

    @property
    def free_slots(self) -> int:
        """Slots nobody holds."""
        return self._top

    @property
    def rows_in_use(self) -> int:
        """Rows held by running sequences."""
        return self.max_rows - len(self._rows) if self.kv is not None else 0

    @property
    def capacity(self) -> int:
        """Slots a sequence can hold at most (all but the scratch slot)."""
        return self.num_slots - 1

    # -- slots and rows --------------------------------------------------------------------

    def alloc_slots(self, n: int) -> np.ndarray:
        """``n`` free slots, each with one reference. :raises PoolFull: fewer are free."""
        if n > self._top:
            raise PoolFull(f"{n} KV slots wanted, {self._top} free")
        out = self._stack[self._top - n : self._top].copy()
        self._top -= n
        self._refs[out] = 1
        return out

    def share(self, slots: np.ndarray, times: int = 1) -> None:
        """Add ``times`` references to each of ``slots`` (another sequence reads them too)."""
        self._refs[slots] += times

    def free_slots_of(self, slots: np.ndarray) -> None:
        """Drop one reference from each of ``slots`` (unique); free those left with none."""
        if not len(slots) or self.kv is None:
            return
        self._refs[slots] -= 1
        gone = slots[self._refs[slots] <= 0]
        self._refs[gone] = 0
        self._stack[self._top : self._top + len(gone)] = gone
        self._top += len(gone)

    def alloc_row(self) -> int:
        """A free ``req_to_token`` row. :raises PoolFull: every row is in use."""
        if not self._rows:
            raise PoolFull("every KV cache row is in use")
        return self._rows.pop()

    def free_row(self, row: int) -> None:
        """Give ``row`` back."""
        if self.kv is not None:
            self._rows.append(row)

    def write_rows(self, rows: list[tuple[int, int, np.ndarray]]) -> None:
        """Map positions ``start…`` of each ``row`` to its ``slots``, in one copy to the device
        that does not wait for the device's queued work (a step's decode runs meanwhile)."""
        assert self.req_to_token is not None
        rows = [r for r in rows if len(r[2])]
        if not rows:
            return
        lens = [len(slots) for _, _, slots in rows]
        where = np.empty((3, sum(lens)), dtype=np.int64)
        where[0] = np.repeat([r for r, _, _ in rows], lens)
        where[1] = np.concatenate([np.arange(st, st + len(slots)) for _, st, slots in rows])
        where[2] = np.concatenate([slots for _, _, slots in rows])
        at = to_device(torch.from_numpy(where), self.device)
        self.req_to_token[at[0], at[1]] = at[2]

    def layer(self, i: int) -> torch.Tensor:
        """Layer ``i``'s keys and values, ``[num_slots, 2, kv_heads, head_dim]``."""
        assert self.kv is not None
        return self.kv[i]
