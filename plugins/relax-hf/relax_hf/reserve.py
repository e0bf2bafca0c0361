"""A warm device allocation an engine keeps across a release, for its resume's first
allocations.

After a large free (the other engine's release that a wake evicts, this engine's own), the CUDA
driver charges the next allocation of any size tens of milliseconds, and hundreds when it must
scrub what was freed first: the tail of a wake under ``relax serve``. A resume with
``--memory-handoff`` asks the driver for nothing big (its weights and pool come back on parked
chunks at their own addresses) but its first forward passes still allocate their activations
through torch's caching allocator, which a release emptied. So the engine keeps a small
allocation it already has across the release: taken right after the release emptied the cache
(the driver is fast then, before its deferred cost sets in), held while the engine is released
(no later ``empty_cache`` frees it), and handed to torch's cache at the start of the resume,
where the resume's activations find it without a driver call.

On CPU (``--emulate-cuda-graph``, tests) the same bookkeeping runs over host memory: there is no
caching allocator to hand the block to, so a hand-back frees it.
"""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["RESERVE_BYTES", "SMALL_BYTES", "KeptReserve"]

#: The large block kept: the activations of a resume's check generation and first decode steps
#: at the engine's running requests fit in it on the H200's examples.
RESERVE_BYTES = 256 << 20
#: One allocation of torch's small pool (under 1 MiB; its blocks come from 2 MiB segments).
SMALL_BYTES = 512 << 10


class KeptReserve:
    """A large and a small block held while the engine is released (see the module).

    Compute thread only.
    """

    def __init__(
        self, device: torch.device, nbytes: int = RESERVE_BYTES, small: int = SMALL_BYTES
    ) -> None:
        self.device = device
        self.nbytes = int(nbytes)
        self.small = int(small)
        self._held: list[torch.Tensor] = []
        #: How many times a release kept it and a resume handed it back.
        self.kept = 0
        self.handed_back = 0
        self.keep_seconds = 0.0
        self.error: str | None = None

    @property
    def held_bytes(self) -> int:
        return sum(t.numel() for t in self._held)

    def keep(self) -> None:
        """Take the blocks (the caller just emptied torch's cache). Idempotent; a refusal (no
        memory left) is recorded and nothing else changes."""
        if self._held:
            return
        start = time.perf_counter()
        try:
            self._held = [
                torch.empty(self.nbytes, dtype=torch.uint8, device=self.device),
                torch.empty(self.small, dtype=torch.uint8, device=self.device),
            ]
        except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            self._held = []
            self.error = f"{type(exc).__name__}: {exc}"
            return
        self.keep_seconds = time.perf_counter() - start
        self.kept += 1

    def hand_back(self) -> int:
        """Drop the blocks into torch's caching allocator (CUDA): the resume's allocations
        take them without a driver call. The bytes handed back."""
        n = self.held_bytes
        if self._held:
            self._held = []
            self.handed_back += 1
        return n

    def report(self) -> dict[str, Any]:
        return {
            "bytes": self.nbytes + self.small,
            "held_bytes": self.held_bytes,
            "kept": self.kept,
            "handed_back": self.handed_back,
            "keep_seconds": round(self.keep_seconds, 6),
            "error": self.error,
        }
