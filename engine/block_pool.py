"""Device KV block ids and their reference counts (docs/design.md#kv-paging) — the one owner of
refcounts.

Every block is in exactly one of three places::

    free    refcount 0, no prefix hash        -> handed out first by allocate()
    cached  refcount 0, holds a prefix hash   -> LRU; evicted (hash dropped) only on demand
    in use  refcount > 0                      -> in one or more block tables

The pool knows nothing about tokens or requests; :mod:`engine.kv_cache_manager` maps
sequences onto it. The physical K/V tensors live in the model runner.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable

from engine.kv_events import KVEvent, KVEventKind


class KVInvariantError(AssertionError):
    """A KV bookkeeping invariant broke (double free, leak, inconsistent hash map)."""


class BlockPool:
    """Reference-counted device blocks with an LRU of evictable prefix-cached blocks."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks}: must be >= 1")
        self.num_blocks = num_blocks
        self._refcount = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        # Oldest first: popitem(last=False) evicts the least recently released block.
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[int, int] = {}
        self._block_hash: dict[int, int] = {}
        # Full content key per cached block, so a 64-bit hash collision is a miss, not a hit.
        self._block_key: dict[int, Hashable] = {}
        # Hashes that entered / left the prefix cache since take_events(); None = not recorded
        # (only a worker that reports to a router turns this on).
        self._events: list[KVEvent] | None = None

    def record_events(self) -> None:
        """Start recording STORED / REMOVED events for :meth:`take_events`."""
        if self._events is None:
            self._events = []

    def cached_hashes(self) -> list[int]:
        """Every hash in the prefix cache now (a router rebuilding its index starts here)."""
        return list(self._hash_to_block)

    def take_events(self) -> list[KVEvent]:
        """The events since the last call, oldest first (runs of one kind merged)."""
        if self._events is None:
            return []
        events, self._events = self._events, []
        return events

    def _event(self, kind: KVEventKind, block_hash: int) -> None:
        if self._events is None:
            return
        if self._events and self._events[-1].kind is kind:
            last = self._events[-1]
            self._events[-1] = KVEvent(kind, (*last.block_hashes, block_hash))
        else:
            self._events.append(KVEvent(kind, (block_hash,)))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    @property
    def num_in_use(self) -> int:
        return self.num_blocks - len(self._free) - len(self._lru)

    @property
    def num_available(self) -> int:
        """Blocks allocate() can hand out now: free ones plus evictable cached ones."""
        return len(self._free) + len(self._lru)

    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` blocks at refcount 1: free ones first, then evict LRU cached ones.

        Returns None, having changed nothing, when fewer than ``n`` are available.
        """
        if n < 0:
            raise ValueError(f"n={n}: must be >= 0")
        if n > self.num_available:
            return None
        taken: list[int] = []
        while len(taken) < n and self._free:
            taken.append(self._free.popleft())
        while len(taken) < n:
            block_id, _ = self._lru.popitem(last=False)
            self._uncache(block_id)
            taken.append(block_id)
        for block_id in taken:
            self._refcount[block_id] = 1
        return taken

    def incref(self, block_ids: list[int]) -> None:
        """Add a holder to each block; a cached block at refcount 0 leaves the LRU list."""
        for block_id in block_ids:
            if self._refcount[block_id] == 0:
                if block_id not in self._lru:
                    raise KVInvariantError(f"incref of free, uncached block {block_id}")
                del self._lru[block_id]
            self._refcount[block_id] += 1

    def decref(self, block_ids: list[int]) -> None:
        """Drop a holder from each block; at 0 it becomes cached (if hashed) or free."""
        for block_id in block_ids:
            if self._refcount[block_id] <= 0:
                raise KVInvariantError(f"double free of block {block_id}")
            self._refcount[block_id] -= 1
            if self._refcount[block_id] == 0:
                if block_id in self._block_hash:
                    self._lru[block_id] = None
                else:
                    self._free.append(block_id)

    def refcount(self, block_id: int) -> int:
        return self._refcount[block_id]

    def block_hash(self, block_id: int) -> int | None:
        return self._block_hash.get(block_id)

    def cache(self, block_id: int, block_hash: int, key: Hashable = None) -> bool:
        """Register a FULL, held block under ``block_hash`` (``key``: its full content key).

        Returns False, leaving the block uncached, when another block already holds the
        hash (two requests computed the same prefix); the existing mapping wins.
        """
        if self._refcount[block_id] <= 0:
            raise KVInvariantError(f"cache() of unheld block {block_id}")
        current = self._block_hash.get(block_id)
        if current is not None:
            if current != block_hash:
                raise KVInvariantError(f"block {block_id} re-cached under another hash")
            return True
        if block_hash in self._hash_to_block:
            return False
        self._hash_to_block[block_hash] = block_id
        self._block_hash[block_id] = block_hash
        self._block_key[block_id] = key
        self._event(KVEventKind.STORED, block_hash)
        return True

    def lookup(self, block_hash: int, key: Hashable = None) -> int | None:
        """The block cached under ``block_hash``; with ``key``, only if its content key matches."""
        block_id = self._hash_to_block.get(block_hash)
        if block_id is None or (key is not None and self._block_key[block_id] != key):
            return None
        return block_id

    def uncache(self, block_id: int) -> None:
        """Drop a held block's hash: its content will not be computed after all."""
        if self._refcount[block_id] <= 0 or block_id not in self._block_hash:
            raise KVInvariantError(f"uncache() of unheld or unhashed block {block_id}")
        self._uncache(block_id)

    def _uncache(self, block_id: int) -> None:
        block_hash = self._block_hash.pop(block_id)
        del self._hash_to_block[block_hash]
        del self._block_key[block_id]
        self._event(KVEventKind.REMOVED, block_hash)

    def check(self) -> None:
        """Conservation and consistency; raises KVInvariantError on the first violation."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise KVInvariantError("a block is on the free list twice")
        if free & self._lru.keys():
            raise KVInvariantError("a block is both free and cached")
        in_use = sum(1 for rc in self._refcount if rc > 0)
        if len(free) + len(self._lru) + in_use != self.num_blocks:
            raise KVInvariantError(
                f"free {len(free)} + cached {len(self._lru)} + in_use {in_use} "
                f"!= total {self.num_blocks}"
            )
        for block_id, rc in enumerate(self._refcount):
            if rc < 0:
                raise KVInvariantError(f"block {block_id} has refcount {rc}")
        for block_id in free:
            if self._refcount[block_id] != 0 or block_id in self._block_hash:
                raise KVInvariantError(f"free block {block_id} is held or hashed")
        for block_id in self._lru:
            if self._refcount[block_id] != 0 or block_id not in self._block_hash:
                raise KVInvariantError(f"cached block {block_id} is held or unhashed")
        if len(self._hash_to_block) != len(self._block_hash) or any(
            self._block_hash.get(b) != h for h, b in self._hash_to_block.items()
        ):
            raise KVInvariantError("hash map and block-hash map disagree")
        if self._block_key.keys() != self._block_hash.keys():
            raise KVInvariantError("content keys out of step with cached hashes")


class HostBlockPool:
    """Host-memory block ids for swapped-out KV: no refcounts, no caching
    (docs/design.md#preemption).

    Blocks released by a swap-in stay *in transfer* until :meth:`finish_transfers` (end of
    the scheduling step): the step's host->device copies still read them, and a swap-out
    in the same step would otherwise overwrite them first (swap_out runs before swap_in).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_host_blocks={num_blocks}: must be >= 0")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._in_transfer: list[int] = []

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        return [self._free.popleft() for _ in range(n)]

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)

    def free_after_transfer(self, block_ids: list[int]) -> None:
        self._in_transfer.extend(block_ids)

    def finish_transfers(self) -> None:
        self._free.extend(self._in_transfer)
        self._in_transfer.clear()

    def check(self, held: list[int]) -> None:
        """``held``: every host block in a swapped request's table."""
        everything = [*self._free, *self._in_transfer, *held]
        if sorted(everything) != list(range(self.num_blocks)):
            raise KVInvariantError(
                f"host pool: free {len(self._free)} + in transfer {len(self._in_transfer)} "
                f"+ held {len(held)} do not partition {self.num_blocks} blocks"
            )
