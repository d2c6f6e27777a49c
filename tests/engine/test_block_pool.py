"""BlockPool: refcounts, free/cached/in-use conservation, LRU eviction, the hash map."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from engine.block_pool import BlockPool, HostBlockPool, KVInvariantError
from engine.kv_events import KVEvent, KVEventKind


def counts(pool: BlockPool) -> tuple[int, int, int]:
    return pool.num_free, pool.num_cached, pool.num_in_use


def test_fresh_pool_is_all_free() -> None:
    pool = BlockPool(4)
    assert counts(pool) == (4, 0, 0)
    assert [pool.refcount(b) for b in range(4)] == [0, 0, 0, 0]
    pool.check()


def test_rejects_empty_pool() -> None:
    with pytest.raises(ValueError, match="num_blocks=0"):
        BlockPool(0)


def test_allocate_takes_lowest_free_ids_at_refcount_one() -> None:
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert [pool.refcount(b) for b in range(4)] == [1, 1, 1, 0]
    assert counts(pool) == (1, 0, 3)
    assert pool.allocate(0) == []
    pool.check()


def test_allocate_too_many_returns_none_and_changes_nothing() -> None:
    pool = BlockPool(4)
    pool.allocate(2)
    assert pool.allocate(3) is None
    assert counts(pool) == (2, 0, 2)
    assert pool.allocate(2) == [2, 3]
    pool.check()


def test_decref_to_zero_frees_unhashed_block() -> None:
    pool = BlockPool(2)
    pool.allocate(2)
    pool.decref([1])
    assert counts(pool) == (1, 0, 1)
    assert pool.refcount(1) == 0
    pool.check()


def test_double_free_raises() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1) or []
    pool.decref([b])
    with pytest.raises(KVInvariantError, match="double free of block 0"):
        pool.decref([b])
    assert pool.refcount(b) == 0
    pool.check()


def test_incref_of_free_uncached_block_raises() -> None:
    pool = BlockPool(2)
    with pytest.raises(KVInvariantError, match="incref of free"):
        pool.incref([0])


def test_shared_block_returns_only_after_last_holder() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1) or []
    pool.incref([b])
    assert pool.refcount(b) == 2
    pool.decref([b])
    assert counts(pool) == (1, 0, 1)
    pool.decref([b])
    assert counts(pool) == (2, 0, 0)
    pool.check()


def test_cached_block_survives_release_and_is_revived_by_incref() -> None:
    pool = BlockPool(3)
    (b,) = pool.allocate(1) or []
    assert pool.cache(b, 111, key=("k",))
    pool.decref([b])
    assert counts(pool) == (2, 1, 0)
    assert pool.lookup(111) == b
    pool.incref([b])  # a prefix hit takes it out of the LRU list
    assert counts(pool) == (2, 0, 1)
    assert pool.refcount(b) == 1
    assert pool.block_hash(b) == 111
    pool.check()


def test_lookup_checks_content_key() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1) or []
    pool.cache(b, 7, key=("tokens", 1, 2))
    assert pool.lookup(7, key=("tokens", 1, 2)) == b
    assert pool.lookup(7, key=("tokens", 1, 3)) is None  # a hash collision is a miss
    assert pool.lookup(8) is None


def test_duplicate_hash_keeps_existing_mapping() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(2) or []
    assert pool.cache(a, 5)
    assert not pool.cache(b, 5)
    assert pool.lookup(5) == a
    assert pool.block_hash(b) is None
    pool.decref([a, b])
    assert counts(pool) == (2, 1, 0)  # the duplicate is freed normally, the original cached
    pool.check()


def test_recache_same_hash_is_noop_other_hash_raises() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1) or []
    pool.cache(b, 5)
    assert pool.cache(b, 5)
    with pytest.raises(KVInvariantError, match="another hash"):
        pool.cache(b, 6)


def test_cache_of_unheld_block_raises() -> None:
    pool = BlockPool(2)
    with pytest.raises(KVInvariantError, match="unheld"):
        pool.cache(0, 5)


def test_allocate_prefers_free_then_evicts_lru_oldest_first() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4) or []
    for b in blocks[:3]:
        pool.cache(b, 100 + b)
    pool.decref([2, 0, 1, 3])  # LRU order 2, 0, 1; block 3 is plainly free
    assert counts(pool) == (1, 3, 0)
    assert pool.allocate(1) == [3]  # free first: no eviction
    assert pool.lookup(102) == 2
    assert pool.allocate(2) == [2, 0]  # then least recently released
    assert pool.lookup(102) is None and pool.lookup(100) is None
    assert pool.lookup(101) == 1
    assert pool.block_hash(2) is None
    assert counts(pool) == (0, 1, 3)
    pool.check()


def test_revived_block_goes_to_lru_tail_on_release() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2) or []
    pool.cache(a, 1)
    pool.cache(b, 2)
    pool.decref([a, b])  # LRU: a, b
    pool.incref([a])
    pool.decref([a])  # LRU: b, a
    assert pool.allocate(1) == [b]
    pool.check()


def test_uncache_drops_hash_of_held_block() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1) or []
    pool.cache(b, 9)
    pool.uncache(b)
    assert pool.lookup(9) is None and pool.block_hash(b) is None
    pool.decref([b])
    assert counts(pool) == (2, 0, 0)
    with pytest.raises(KVInvariantError, match="uncache"):
        pool.uncache(b)
    pool.check()


def test_check_detects_corruption() -> None:
    pool = BlockPool(2)
    pool.allocate(1)
    pool._refcount[1] = 1  # corrupt: in use yet still on the free list
    with pytest.raises(KVInvariantError):
        pool.check()


def test_host_pool_holds_swap_in_sources_until_step_end() -> None:
    host = HostBlockPool(3)
    assert host.allocate(4) is None
    taken = host.allocate(2)
    assert taken == [0, 1]
    host.check(held=[0, 1])
    host.free_after_transfer([0, 1])
    assert host.num_free == 1
    assert host.allocate(2) is None  # the swap-in copies still read blocks 0 and 1
    host.check(held=[])  # 0 and 1 are in transfer: neither free nor held
    host.finish_transfers()
    assert host.num_free == 3
    host.check(held=[])
    with pytest.raises(KVInvariantError, match="host pool"):
        host.check(held=[0])


# -- pinned by mutation testing (make mutation): every check() rule fires on its own --


def corrupt_twice_free(pool: BlockPool) -> None:
    pool._free.append(0)


def corrupt_free_and_cached(pool: BlockPool) -> None:
    pool._lru[0] = None


def corrupt_lost_block(pool: BlockPool) -> None:
    pool.allocate(1)
    pool._refcount[0] = 0  # released without going back to the free list


def corrupt_negative_refcount(pool: BlockPool) -> None:
    pool._refcount[0] = -1


def corrupt_hashed_free_block(pool: BlockPool) -> None:
    pool._block_hash[0] = 5


def corrupt_held_free_block(pool: BlockPool) -> None:
    pool.allocate(2)
    pool._free.append(0)  # block 0 is held and on the free list
    pool._refcount[1] = 0  # block 1 is lost, so the counts still add up


def corrupt_unhashed_cached_block(pool: BlockPool) -> None:
    pool.allocate(1)
    pool._refcount[0] = 0
    pool._lru[0] = None


def corrupt_held_cached_block(pool: BlockPool) -> None:
    pool.allocate(2)
    pool.cache(0, 9)
    pool._lru[0] = None  # block 0 is held and on the LRU list
    pool._refcount[1] = 0  # block 1 is lost, so the counts still add up


def corrupt_hash_maps(pool: BlockPool) -> None:
    pool.allocate(1)
    pool.cache(0, 9)
    pool._hash_to_block[9] = 1


def corrupt_extra_hash_entry(pool: BlockPool) -> None:
    pool.allocate(1)
    pool.cache(0, 9)
    pool._hash_to_block[10] = 0


def corrupt_content_keys(pool: BlockPool) -> None:
    pool.allocate(1)
    pool.cache(0, 9, key=("k",))
    del pool._block_key[0]


CORRUPTIONS: list[tuple[Callable[[BlockPool], None], str]] = [
    (corrupt_twice_free, "a block is on the free list twice"),
    (corrupt_free_and_cached, "a block is both free and cached"),
    (corrupt_lost_block, r"free 1 \+ cached 0 \+ in_use 0 != total 2"),
    (corrupt_negative_refcount, "block 0 has refcount -1"),
    (corrupt_hashed_free_block, "free block 0 is held or hashed"),
    (corrupt_held_free_block, "free block 0 is held or hashed"),
    (corrupt_unhashed_cached_block, "cached block 0 is held or unhashed"),
    (corrupt_held_cached_block, "cached block 0 is held or unhashed"),
    (corrupt_hash_maps, "hash map and block-hash map disagree"),
    (corrupt_extra_hash_entry, "hash map and block-hash map disagree"),
    (corrupt_content_keys, "content keys out of step with cached hashes"),
]


@pytest.mark.parametrize(
    ("corrupt", "message"),
    CORRUPTIONS,
    ids=[corrupt.__name__.removeprefix("corrupt_") for corrupt, _ in CORRUPTIONS],
)
def test_check_names_each_broken_invariant(
    corrupt: Callable[[BlockPool], None], message: str
) -> None:
    """Each kind of bookkeeping corruption makes check() raise with its own message."""
    pool = BlockPool(2)
    pool.check()
    corrupt(pool)
    with pytest.raises(KVInvariantError, match=f"^{message}$"):
        pool.check()


def test_uncache_refuses_unheld_and_unhashed_blocks() -> None:
    """uncache() needs a held, hashed block: a cached (refcount 0) or unhashed one raises."""
    pool = BlockPool(2)
    a, b = pool.allocate(2) or []
    with pytest.raises(KVInvariantError, match=f"uncache\\(\\) of unheld or unhashed block {b}"):
        pool.uncache(b)  # held, never hashed
    pool.cache(a, 9)
    pool.decref([a])  # cached at refcount 0
    with pytest.raises(KVInvariantError, match=f"unheld or unhashed block {a}"):
        pool.uncache(a)
    assert pool.lookup(9) == a and counts(pool) == (0, 1, 1)
    pool.check()


def test_events_are_recorded_only_once_turned_on_and_merge_runs() -> None:
    """STORED/REMOVED events are kept only after record_events(); runs of one kind merge."""
    pool = BlockPool(4)
    a, b, c = pool.allocate(3) or []
    pool.cache(a, 10)
    assert pool.take_events() == []  # not recording yet
    pool.record_events()
    pool.cache(b, 11)
    pool.cache(c, 12)
    pool.uncache(c)
    pool.uncache(b)
    pool.cache(c, 13)
    assert pool.take_events() == [
        KVEvent(KVEventKind.STORED, (11, 12)),
        KVEvent(KVEventKind.REMOVED, (12, 11)),
        KVEvent(KVEventKind.STORED, (13,)),
    ]
    assert pool.take_events() == []
    pool.record_events()  # a second call keeps what is recorded
    pool.decref([a, b, c])
    pool.allocate(4)  # evicts the cached blocks, oldest first
    pool.record_events()
    assert pool.take_events() == [KVEvent(KVEventKind.REMOVED, (10, 13))]
    assert pool.cached_hashes() == []


def test_cached_hashes_lists_every_cached_hash() -> None:
    """cached_hashes() is every hash in the prefix cache, held or evictable."""
    pool = BlockPool(3)
    a, b, _ = pool.allocate(3) or []
    pool.cache(a, 7)
    pool.cache(b, 8)
    pool.decref([a])
    assert sorted(pool.cached_hashes()) == [7, 8]


def test_size_limits_of_the_pools() -> None:
    """A one-block pool and an empty host pool are valid; negative sizes and counts raise."""
    pool = BlockPool(1)
    assert pool.allocate(1) == [0] and pool.allocate(1) is None
    with pytest.raises(ValueError, match="n=-1: must be >= 0"):
        pool.allocate(-1)
    assert HostBlockPool(0).allocate(1) is None
    with pytest.raises(ValueError, match="num_host_blocks=-1: must be >= 0"):
        HostBlockPool(-1)
