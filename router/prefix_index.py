"""Exact per-worker prefix index, kept from the workers' KV events.

A block hash chains its parent, the tenant salt and the model id
(``engine.kv_cache_manager.prefix_hashes``), so the index needs no tokens and no tree: "worker W
holds hash h" is the whole state. A prompt's cached prefix on W is the run of its hash chain that
W holds, from the first block on; tenants are isolated because another salt gives other hashes.

Two maps are kept in step: ``hash -> bitmask of workers`` answers ``match_all`` by narrowing
the candidate mask block by block (one AND per block, whatever the number of workers), and
``worker -> hashes`` makes ``drop_worker`` (death, restart, CLEARED) proportional to what that
worker held. Both hold only ints: CPython's garbage collector skips such dicts, while a set per
hash (~300k of them for 10k cached prefixes) made each full collection pause the router ~90 ms.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from engine.kv_events import KVEvent, KVEventKind


class PrefixIndex:
    """Which block hashes each worker's prefix cache holds."""

    def __init__(self) -> None:
        self._bits: dict[str, int] = {}  # worker -> its bit, given on first sight and kept
        self._names: list[str] = []  # bit position -> worker
        self._holders: dict[int, int] = {}  # hash -> mask of the workers holding it (never 0)
        self._held: dict[str, dict[int, None]] = {}  # worker -> hashes (a dict as a GC-free set)

    @property
    def num_entries(self) -> int:
        """(worker, hash) pairs held: the index's size, back to its baseline after a drop."""
        return sum(len(hashes) for hashes in self._held.values())

    def held_by(self, worker: str) -> int:
        """Blocks ``worker`` holds, as the index knows it."""
        return len(self._held.get(worker, ()))

    @property
    def num_hashes(self) -> int:
        """Distinct hashes held by at least one worker."""
        return len(self._holders)

    def apply(self, worker: str, events: Iterable[KVEvent]) -> None:
        """Apply one worker's events in order. Repeated STOREs and REMOVEs of hashes the worker
        does not hold are no-ops: an engine may report a block again after a re-cache."""
        for event in events:
            if event.kind == KVEventKind.STORED:
                self._store(worker, event.block_hashes)
            elif event.kind == KVEventKind.REMOVED:
                self._remove(worker, event.block_hashes)
            else:
                self.drop_worker(worker)

    def drop_worker(self, worker: str) -> None:
        """Forget everything ``worker`` held (it died, restarted, or reset its cache)."""
        held = self._held.pop(worker, None)
        if held is None:
            return
        keep = ~self._bits[worker]
        holders = self._holders
        for block_hash in held:
            mask = holders[block_hash] & keep
            if mask:
                holders[block_hash] = mask
            else:
                del holders[block_hash]

    def match(self, worker: str, hashes: Sequence[int]) -> int:
        """How many leading hashes of the chain ``worker`` holds (stops at the first miss)."""
        held = self._held.get(worker)
        if held is None:
            return 0
        count = 0
        for block_hash in hashes:
            if block_hash not in held:
                break
            count += 1
        return count

    def match_all(self, hashes: Sequence[int]) -> dict[str, int]:
        """``match`` for every worker at once; workers holding not even the first block are
        left out (their match is 0)."""
        if not hashes:
            return {}
        holders = self._holders
        candidates = holders.get(hashes[0], 0)
        result: dict[str, int] = {}
        depth = 1  # every candidate holds hashes[:depth]
        for block_hash in hashes[1:]:
            if not candidates:
                return result
            survivors = candidates & holders.get(block_hash, 0)
            if survivors != candidates:
                self._assign(candidates & ~survivors, depth, result)
                candidates = survivors
            depth += 1
        self._assign(candidates, depth, result)
        return result

    def _assign(self, mask: int, depth: int, result: dict[str, int]) -> None:
        while mask:
            low = mask & -mask
            result[self._names[low.bit_length() - 1]] = depth
            mask ^= low

    def _bit(self, worker: str) -> int:
        bit = self._bits.get(worker)
        if bit is None:
            bit = self._bits[worker] = 1 << len(self._names)
            self._names.append(worker)
        return bit

    def _store(self, worker: str, hashes: Iterable[int]) -> None:
        bit = self._bit(worker)
        held = self._held.setdefault(worker, {})
        holders = self._holders
        for block_hash in hashes:
            if block_hash not in held:
                held[block_hash] = None
                holders[block_hash] = holders.get(block_hash, 0) | bit
        if not held:  # an empty STORED event
            del self._held[worker]

    def _remove(self, worker: str, hashes: Iterable[int]) -> None:
        held = self._held.get(worker)
        if held is None:
            return
        keep = ~self._bits[worker]
        holders = self._holders
        for block_hash in hashes:
            if block_hash in held:
                del held[block_hash]
                mask = holders[block_hash] & keep
                if mask:
                    holders[block_hash] = mask
                else:
                    del holders[block_hash]
        if not held:
            del self._held[worker]
