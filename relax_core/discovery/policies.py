"""The built-in DIRECT replica-selection policies: ``round_robin``, ``rendezvous`` and
``bounded_rendezvous``. Selectors keep process-local state; the rendezvous score every process
computes alike is docs/discovery-and-routing.md's (slot winners are computed per candidate set
and cached)."""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
import threading
from array import array
from collections.abc import Callable, Mapping
from typing import Any

from relax_core.hookspecs import hookimpl
from relax_core.records import RoutingPolicy

SLOTS = 1 << 16
_LANE = 128  # bits per candidate lane: a 64-bit a*x+b never carries into the next lane
_RANK_BITS = 16
_RANK_MASK = (1 << _RANK_BITS) - 1
_MAX_CANDIDATES = _RANK_MASK  # rank 0xFFFF is the "not computed yet" marker of the slot table
_UNSET = 0xFFFF
_MAX_CACHED_SETS = 64


class RoundRobinSelector:
    """Process-local round robin: one cursor per (role, registry epoch, model).

    A new registry epoch starts a new cursor. Thread-safe (``itertools.count`` under the GIL)."""

    def __init__(self) -> None:
        self._cursors: dict[tuple[str, str, str], itertools.count[int]] = {}

    def select(
        self, *, role: str, epoch: str, model: str, candidates: tuple[Any, ...], **_: object
    ) -> Any:
        """The next candidate after the one this cursor gave last (key and load play no part)."""
        key = (role, epoch, model)
        cursor = self._cursors.get(key)
        if cursor is None:
            if len(self._cursors) >= 4096:
                # Old epochs accumulate over a long run; their cursors are never used again.
                self._cursors.clear()
            cursor = self._cursors.setdefault(key, itertools.count())
        return candidates[next(cursor) % len(candidates)]


ROUND_ROBIN = RoutingPolicy(
    name="round_robin",
    factory=RoundRobinSelector,
    description="Process-local round robin over READY, direct-eligible heads.",
)


@functools.lru_cache(maxsize=1 << 16)  # group keys repeat once per sample of a group
def _slot(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=2).digest(), "little")


class _Table:
    """Rendezvous scores for one (role, model, candidate set), with the slot -> winner cache."""

    __slots__ = (
        "a_packed",
        "b_packed",
        "ids",
        "mask",
        "n",
        "nbytes",
        "prefix",
        "ranks",
        "winners",
        "zeros",
    )

    def __init__(self, role: str, model: str, engine_ids: tuple[str, ...]) -> None:
        n = len(engine_ids)
        if n > _MAX_CANDIDATES:
            raise ValueError(f"rendezvous supports at most {_MAX_CANDIDATES} replicas, got {n}")
        self.n = n
        self.ids = engine_ids
        self.zeros = (0,) * n
        self.prefix = f"{role}\0{model}\0".encode()
        a_packed = b_packed = mask = ranks = 0
        lane_mask = ((1 << 64) - 1) ^ _RANK_MASK
        for rank, engine_id in enumerate(engine_ids):
            digest = hashlib.blake2b(self.prefix + engine_id.encode(), digest_size=16).digest()
            shift = _LANE * rank
            a_packed |= (int.from_bytes(digest[:8], "little") | 1) << shift
            b_packed |= int.from_bytes(digest[8:], "little") << shift
            mask |= lane_mask << shift
            ranks |= rank << shift
        self.a_packed, self.b_packed, self.mask, self.ranks = a_packed, b_packed, mask, ranks
        self.nbytes = n * _LANE // 8
        self.winners = array("H", [_UNSET]) * SLOTS

    def scores(self, slot: int) -> memoryview:
        """Every candidate's score for ``slot`` (64-bit words; odd words are zero)."""
        mixed = hashlib.blake2b(self.prefix + slot.to_bytes(2, "little"), digest_size=8)
        x = int.from_bytes(mixed.digest(), "little")
        packed = ((self.a_packed * x + self.b_packed) & self.mask) | self.ranks
        return memoryview(packed.to_bytes(self.nbytes, "little")).cast("Q")

    def winner(self, slot: int) -> int:
        """The rank of the highest-scoring candidate for ``slot`` (cached)."""
        rank = self.winners[slot]
        if rank == _UNSET:
            rank = max(self.scores(slot)[::2]) & _RANK_MASK
            self.winners[slot] = rank
        return rank

    def order(self, slot: int) -> list[int]:
        """Every candidate rank for ``slot``, highest score first."""
        return [word & _RANK_MASK for word in sorted(self.scores(slot)[::2], reverse=True)]


class _Tables:
    """Score tables by candidate tuple identity (fast) and by (role, model, ids) (shared)."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[tuple[Any, ...], str, str, _Table]] = {}
        self._by_key: dict[tuple[str, str, tuple[str, ...]], _Table] = {}
        self._lock = threading.Lock()

    def get(self, role: str, model: str, candidates: tuple[Any, ...]) -> _Table:
        entry = self._by_id.get(id(candidates))
        if entry is not None and entry[0] is candidates and entry[1] == role and entry[2] == model:
            return entry[3]
        ids = tuple(c.engine_id for c in candidates)
        if list(ids) != sorted(ids):
            raise ValueError("rendezvous candidates must be sorted by engine_id")
        key = (role, model, ids)
        with self._lock:
            table = self._by_key.get(key)
            if table is None:
                if len(self._by_key) >= _MAX_CACHED_SETS:
                    self._by_key.clear()
                table = self._by_key[key] = _Table(role, model, ids)
            if len(self._by_id) >= _MAX_CACHED_SETS:
                self._by_id.clear()
            self._by_id[id(candidates)] = (candidates, role, model, table)
        return table


def rendezvous_order(role: str, model: str, engine_ids: tuple[str, ...], key: str) -> list[str]:
    """Every engine id, best first, as rendezvous ranks them for ``key`` (for tests and tools).

    ``engine_ids`` may come in any order; the ranking does not depend on it."""
    ids = tuple(sorted(engine_ids))
    return [ids[rank] for rank in _Table(role, model, ids).order(_slot(key))]


class RendezvousSelector:
    """Affinity: the candidate with the highest score for (role, model, key, engine_id).

    The same key goes to the same head while the candidate set is unchanged; removing a head
    moves only the keys it held. ``affinity_key=None`` hashes as the empty key. Candidates must
    come sorted by ``engine_id`` (the resolver does so); thread-safe."""

    def __init__(self) -> None:
        self._tables = _Tables()

    def select(self, *, role: str, model: str, candidates: tuple[Any, ...], **request: Any) -> Any:
        """The candidate :meth:`_rank` picks for the ``affinity_key``'s slot."""
        table = self._tables.get(role, model, candidates)
        slot = _slot(request.get("affinity_key") or "")
        return candidates[self._rank(table, slot, request.get("inflight"))]

    def _rank(self, table: _Table, slot: int, inflight: Mapping[str, int] | None) -> int:
        """The rank of the slot's highest-scoring candidate; plain rendezvous ignores the load."""
        return table.winner(slot)


RENDEZVOUS = RoutingPolicy(
    name="rendezvous",
    factory=RendezvousSelector,
    uses_affinity=True,
    description="Affinity: highest hash(role, model, key, engine_id) wins.",
)


class BoundedRendezvousSelector(RendezvousSelector):
    """Rendezvous with bounded load: hot keys cannot pile onto one head.

    With ``n`` candidates carrying ``total`` in-flight requests (``inflight`` by engine id), the
    bound is ``ceil(c * (total + 1) / n)``; the request goes to the highest-scoring candidate
    whose in-flight count is below it (one always is). Without ``inflight``: plain rendezvous.

    :param c: the load factor, ``>= 1`` (default 1.25). Smaller keeps loads tighter and moves
        more keys off their preferred head.
    :raises ValueError: ``c`` below 1 or not finite."""

    def __init__(self, c: float = 1.25) -> None:
        if not isinstance(c, (int, float)) or not math.isfinite(c) or c < 1:
            raise ValueError(f"bounded_rendezvous: c must be a finite number >= 1, got {c!r}")
        super().__init__()
        self.c = float(c)

    def bound(self, total: int, n: int) -> int:
        """The most in-flight requests a head may hold after taking one more."""
        return math.ceil(self.c * (total + 1) / n)

    def _rank(self, table: _Table, slot: int, inflight: Mapping[str, int] | None) -> int:
        """The rank of the best-scoring candidate that stays within the load bound."""
        best = table.winner(slot)
        if not inflight:
            return best
        load = inflight.get(table.ids[best], 0)
        if load == 0:
            return best  # the bound is always >= 1
        loads = list(map(inflight.get, table.ids, table.zeros))
        limit = self.bound(sum(loads), table.n)
        if load < limit:
            return best
        # Walk the ranking best-first without sorting it: usually the second or third wins.
        scores = table.scores(slot)[::2].tolist()
        for _ in range(table.n):
            rank = max(scores) & _RANK_MASK
            if loads[rank] < limit:
                return rank
            scores[rank] = -1
        # Unreachable for c >= 1 (n * limit > total); keep affinity rather than fail.
        return best


BOUNDED_RENDEZVOUS = RoutingPolicy(
    name="bounded_rendezvous",
    factory=BoundedRendezvousSelector,
    uses_affinity=True,
    description=(
        "Affinity with bounded load: a head above ceil(1.25 x mean in-flight) is skipped for "
        "the next-best score."
    ),
)


@hookimpl
def relax_register_routing_policies(register: Callable[[RoutingPolicy], None]) -> None:
    """Register ``round_robin``, ``rendezvous`` and ``bounded_rendezvous``."""
    for policy in (ROUND_ROBIN, RENDEZVOUS, BOUNDED_RENDEZVOUS):
        register(policy)
