"""The prefix cache: a radix tree of token ids over the KV cache pool's slots (SGLang's RadixCache).

Every edge of the tree holds a run of token ids and the pool slots whose K and V were computed
for them, in the context of the path above it. A new sequence walks the tree with its input and
reuses the longest matching path: those positions are not prefilled again (``cached_tokens``).
A sequence's input is inserted right after its prefill (so a request arriving while it decodes
already hits it) and its generated tokens when it finishes (so a multi-turn conversation's next
turn hits its whole history), as SGLang does.

Memory: the tree holds one reference on each slot it stores (:meth:`KVPool.share`); a sequence
that reuses a path holds its own references and *locks* the path's nodes, so they are not
evicted under it. The pool is the bound: when a sequence needs slots and too few are free, the
least recently used unlocked leaves are evicted (their slots go back to the pool) until enough
are; unlocked nodes are all evictable, so admission counts them as free.

Validity: the KV of a path is only valid for the weights that computed it. :meth:`clear` drops
the whole tree and moves :attr:`PrefixCache.epoch`; the runner calls it whenever the weights
change or leave the device and whenever the pool is dropped, and sequences record the epoch
they were prefilled in, so a sequence that ran across a weight update never inserts its KV
(computed partly with the old weights). The tree is used from the compute thread only, and
every decision in it is deterministic (a logical clock orders the LRU), so the nodes of a
multi-node replica keep identical trees.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

import numpy as np

from relax_hf.kvcache import KVPool, PoolFull

__all__ = ["CacheNode", "PrefixCache"]


class CacheNode:
    """One edge of the tree: token ids, their slots, and the bookkeeping of eviction."""

    __slots__ = (
        "children",
        "epoch",
        "key",
        "last_access",
        "lock_ref",
        "parent",
        "serial",
        "slots",
    )

    def __init__(
        self, key: np.ndarray, slots: np.ndarray, parent: CacheNode | None, epoch: int, serial: int
    ) -> None:
        self.serial = serial  # creation order: breaks LRU ties the same way on every node
        self.key = key
        self.slots = slots
        self.parent = parent
        self.children: dict[int, CacheNode] = {}
        self.lock_ref = 0
        self.last_access = 0
        self.epoch = epoch


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """The length of the common prefix of two id arrays."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


class PrefixCache:
    """A radix tree of token ids whose nodes own references on KV cache pool slots."""

    def __init__(self, pool: KVPool, *, enabled: bool = True) -> None:
        self.pool = pool
        self.enabled = enabled
        self.epoch = 0
        self._clock = 0
        self._empty = np.empty(0, dtype=np.int64)
        self._serial = 0
        self.root = CacheNode(self._empty, self._empty, None, 0, 0)
        self.root.lock_ref = 1  # never evicted, never counted
        self.tokens = 0  # slots the tree holds
        self.evictable_tokens = 0  # of which in unlocked nodes
        self.nodes = 0
        self.evicted_tokens_total = 0
        self.inserted_tokens_total = 0
        self.invalidations_total = 0

    # -- lookup ------------------------------------------------------------------------------

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _node(self, key: np.ndarray, slots: np.ndarray, parent: CacheNode) -> CacheNode:
        self._serial += 1
        self.nodes += 1
        return CacheNode(key, slots, parent, self.epoch, self._serial)

    def match(self, key: np.ndarray, limit: int) -> tuple[int, np.ndarray, CacheNode]:
        """The longest cached prefix of ``key``, at most ``limit`` tokens.

        Returns its length, its slots and the node it ends at (the root when nothing matched;
        a node is split so that the match ends on a node boundary). Lock the node before any
        eviction can run.
        """
        node = self.root
        if not self.enabled or limit <= 0:
            return 0, self._empty, node
        now = self._tick()
        parts: list[np.ndarray] = []
        i = 0
        while i < limit:
            child = node.children.get(int(key[i]))
            if child is None:
                break
            k = _common(child.key, key[i:limit])
            if k == 0:
                break
            if k < len(child.key):
                child = self._split(child, k)
            child.last_access = now
            parts.append(child.slots)
            node = child
            i += k
        slots = np.concatenate(parts) if parts else self._empty
        return i, slots, node

    def cached(self, key: Sequence[int]) -> int:
        """How many leading tokens of ``key`` the tree holds. Read-only (no split, no LRU
        touch), so the scheduler may ask it between steps: an answer racing a change of the
        tree is only an admission hint."""
        if not self.enabled:
            return 0
        ids = np.asarray(key, dtype=np.int64)
        node, i = self.root, 0
        while i < len(ids):
            child = node.children.get(int(ids[i]))
            if child is None:
                break
            k = _common(child.key, ids[i:])
            i += k
            if k < len(child.key):
                break
            node = child
        return i

    def _split(self, node: CacheNode, at: int) -> CacheNode:
        """Cut ``node`` after ``at`` tokens; the new upper part is returned."""
        assert node.parent is not None
        upper = self._node(node.key[:at], node.slots[:at], node.parent)
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        upper.children[int(node.key[at])] = node
        node.parent.children[int(upper.key[0])] = upper
        node.key = node.key[at:]
        node.slots = node.slots[at:]
        node.parent = upper
        return upper

    # -- locks -------------------------------------------------------------------------------

    def lock(self, node: CacheNode) -> None:
        """Protect the path from the root to ``node`` from eviction (one more user)."""
        if node.epoch != self.epoch:
            return
        n: CacheNode | None = node
        while n is not None and n is not self.root:
            if n.lock_ref == 0:
                self.evictable_tokens -= len(n.key)
            n.lock_ref += 1
            n = n.parent

    def unlock(self, node: CacheNode) -> None:
        """Undo one :meth:`lock` (a node of a cleared tree is ignored)."""
        if node.epoch != self.epoch:
            return
        n: CacheNode | None = node
        while n is not None and n is not self.root:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self.evictable_tokens += len(n.key)
            n = n.parent

    # -- insertion ---------------------------------------------------------------------------

    def insert(self, key: np.ndarray, slots: np.ndarray) -> CacheNode:
        """Add ``key`` with its ``slots`` (position by position); return the node it ends at.

        The part already in the tree keeps the tree's slots (the caller's copies are freed
        when the caller lets them go); the tree takes a reference on the slots of the rest.
        """
        node = self.root
        if not self.enabled or not len(key):
            return node
        now = self._tick()
        i = 0
        while i < len(key):
            child = node.children.get(int(key[i]))
            if child is None:
                tail = slots[i:].copy()
                new = self._node(key[i:].copy(), tail, node)
                new.last_access = now
                node.children[int(key[i])] = new
                self.pool.share(tail)
                self.tokens += len(tail)
                self.evictable_tokens += len(tail)
                self.inserted_tokens_total += len(tail)
                return new
            k = _common(child.key, key[i:])
            if k < len(child.key):
                child = self._split(child, k)
            child.last_access = now
            node = child
            i += k
        return node

    # -- eviction ----------------------------------------------------------------------------

    @property
    def available(self) -> int:
        """Slots a new sequence can have: the free ones and those eviction would free."""
        return self.pool.free_slots + self.evictable_tokens

    def _drop(self, node: CacheNode) -> None:
        assert node.parent is not None
        del node.parent.children[int(node.key[0])]
        self.pool.free_slots_of(node.slots)
        self.tokens -= len(node.key)
        self.nodes -= 1

    def evict(self, wanted: int) -> int:
        """Evict least recently used unlocked leaves until ``wanted`` slots are freed (or
        nothing evictable is left); returns the slots freed."""
        if wanted <= 0 or not self.evictable_tokens:
            return 0
        heap: list[tuple[int, int, CacheNode]] = []
        stack = [self.root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if not n.children and n.lock_ref == 0:
                heap.append((n.last_access, n.serial, n))
        heapq.heapify(heap)
        freed = 0
        while heap and freed < wanted:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            self._drop(leaf)
            self.evictable_tokens -= len(leaf.key)
            freed += len(leaf.key)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.serial, parent))
        self.evicted_tokens_total += freed
        return freed

    def make_room(self, slots: int) -> None:
        """Evict until ``slots`` slots are free. :raises PoolFull: eviction cannot free them."""
        short = slots - self.pool.free_slots
        if short > 0:
            self.evict(short)
        if slots > self.pool.free_slots:
            raise PoolFull(
                f"{slots} KV slots wanted, {self.pool.free_slots} free and "
                f"{self.evictable_tokens} evictable in the prefix cache"
            )

    def clear(self) -> None:
        """Drop every node and its slot references; nodes still locked by running sequences
        become stale (their unlock is ignored and they never insert again). Idempotent."""
        stack, held = list(self.root.children.values()), []
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            held.append(n.slots)
        if held:  # nodes hold disjoint slots: one pass (a node at a time took ~5 ms for 256)
            self.pool.free_slots_of(np.concatenate(held))
        self.root.children = {}
        self.tokens = self.evictable_tokens = self.nodes = 0
        self.epoch += 1
        self.root.epoch = self.epoch
        self.invalidations_total += 1

    def report(self) -> dict[str, Any]:
        """What the tree holds now and what it did (``/server_info`` ``prefix_cache``)."""
        return {
            "enabled": self.enabled,
            "tokens": self.tokens,
            "evictable_tokens": self.evictable_tokens,
            "nodes": self.nodes,
            "epoch": self.epoch,
            "inserted_tokens_total": self.inserted_tokens_total,
            "evicted_tokens_total": self.evicted_tokens_total,
            "invalidations_total": self.invalidations_total,
        }
