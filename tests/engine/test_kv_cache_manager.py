"""KVCacheManager: the sizing figures of docs/design.md#kv-paging, prefix caching, CoW,
reservations, swap."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.block_pool import KVInvariantError
from engine.config import ModelConfig
from engine.kv_cache_manager import (
    KVCacheManager,
    KVStats,
    hash_block,
    prefix_hashes,
)
from engine.request import Request
from engine.sampling_params import SamplingParams


def req(rid: str, tokens: list[int], salt: str = "") -> Request:
    return Request(rid, list(tokens), SamplingParams(), arrival_time=0.0, cache_salt=salt)


def prefill(kv: KVCacheManager, r: Request) -> list[int] | None:
    """Schedule the whole prompt, using prefix hits, in one step that then runs."""
    hits, num_cached = kv.get_computed_blocks(r)
    r.num_computed_tokens = num_cached
    new = kv.allocate_slots(r, r.num_tokens - num_cached, hits)
    if new is None:
        r.num_computed_tokens = 0
    else:
        r.num_computed_tokens = r.num_tokens
    assert kv.take_pending_copies() == []  # ends the step
    return new


def decode(kv: KVCacheManager, r: Request, token: int) -> list[int] | None:
    r.output_token_ids.append(token)
    new = kv.allocate_slots(r, 1)
    if new is not None:
        r.num_computed_tokens += 1
    return new


# -- hashing and helpers --


def test_hash_block_depends_on_parent_tokens_and_extra_keys() -> None:
    h = hash_block(None, [1, 2, 3, 4], ("", "m"))
    assert h == hash_block(None, (1, 2, 3, 4), ("", "m"))  # deterministic, sequence-agnostic
    assert 0 <= h < 2**64
    others = {
        hash_block(h, [1, 2, 3, 4], ("", "m")),
        hash_block(None, [1, 2, 3, 5], ("", "m")),
        hash_block(None, [1, 2, 3, 4], ("salt", "m")),
        hash_block(None, [1, 2, 3, 4], ("", "other-model")),
        hash_block(None, [1, 2, 3, 4, 0], ("", "m")),
        hash_block(0, [1, 2, 3, 4], ("", "m")),  # parent hash 0 is not "no parent"
    }
    assert h not in others and len(others) == 6


def test_blocks_for_is_ceiling() -> None:
    kv = KVCacheManager(8, 4)
    assert [kv.blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


# -- the sizing figures (docs/design.md#kv-paging) --


def test_d07_logical_vs_allocated_slots() -> None:
    cfg = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=16,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=4,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
        sliding_window=None,
        dtype=torch.float16,
    )
    assert cfg.kv_bytes_per_token() == 64
    kv = KVCacheManager(8, 4)
    prefill(kv, req("a", [1]))
    prefill(kv, req("b", [2, 3, 4, 5, 6]))
    s = kv.stats()
    assert (s.logical_slots, s.allocated_slots) == (6, 12)  # internal fragmentation is real
    assert (s.logical_slots * 64, s.allocated_slots * 64) == (384, 768)
    assert s.in_use_blocks == 3
    kv.check()


def test_d08_prefix_sharing_saves_one_block() -> None:
    shared = [7, 7, 8, 9]
    a_tokens, b_tokens = shared + [1, 2], shared + [3, 4, 5]

    plain = KVCacheManager(8, 4, enable_prefix_caching=False)
    prefill(plain, req("a", a_tokens))
    prefill(plain, req("b", b_tokens))
    assert plain.stats().in_use_blocks == 4

    kv = KVCacheManager(8, 4)
    a, b = req("a", a_tokens), req("b", b_tokens)
    prefill(kv, a)
    assert kv.get_computed_blocks(b) == ([kv.block_table("a")[0]], 4)
    prefill(kv, b)
    assert kv.stats().in_use_blocks == 3
    assert kv.block_table("a")[0] == kv.block_table("b")[0]
    assert kv.pool.refcount(kv.block_table("a")[0]) == 2
    # The hit ratio counts prompt tokens looked up (6 + 7) and found (4, b's shared block).
    stats = kv.stats()
    assert (stats.prefix_query_tokens, stats.prefix_hit_tokens) == (13, 4)
    assert stats.prefix_hit_ratio == 4 / 13
    kv.check()


def test_d08_sub_block_overlap_shares_nothing_and_three_way_sharing() -> None:
    kv = KVCacheManager(16, 4)
    prefill(kv, req("a", [7, 7, 8, 1, 2]))
    assert kv.get_computed_blocks(req("b", [7, 7, 8, 2, 2])) == ([], 0)
    for rid in ("x", "y", "z"):
        prefill(kv, req(rid, [5, 5, 5, 5, 5, 5, 5, 5, 1]))
    # 3 sequences x 3 blocks, 2 shared full blocks: saves (3 - 1) * 2 blocks.
    assert kv.stats().in_use_blocks == 2 + 9 - 4
    kv.check()


# -- prefix cache --


def test_full_hit_is_capped_so_the_last_token_is_recomputed() -> None:
    kv = KVCacheManager(8, 4)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    a = req("a", tokens)
    prefill(kv, a)
    first = kv.block_table("a")[0]
    hits, num_cached = kv.get_computed_blocks(req("b", tokens))
    assert (hits, num_cached) == ([first], 4)
    assert kv.pool.refcount(first) == 1  # lookup takes no reference


def test_salt_isolation() -> None:
    kv = KVCacheManager(8, 4)
    prefill(kv, req("a", [1, 2, 3, 4, 5], salt="tenant-a"))
    assert kv.get_computed_blocks(req("b", [1, 2, 3, 4, 5], salt="tenant-b")) == ([], 0)
    assert kv.get_computed_blocks(req("c", [1, 2, 3, 4, 5], salt="tenant-a")) == (
        kv.block_table("a")[:1],
        4,
    )


def test_model_id_isolation() -> None:
    kv1 = KVCacheManager(8, 4, model_id="m1")
    kv2 = KVCacheManager(8, 4, model_id="m2")
    a = req("a", [1, 2, 3, 4, 5])
    prefill(kv1, a)
    prefill(kv2, req("a", [1, 2, 3, 4, 5]))
    h_m1 = kv1.pool.block_hash(kv1.block_table("a")[0])
    h_m2 = kv2.pool.block_hash(kv2.block_table("a")[0])
    assert h_m1 is not None and h_m2 is not None and h_m1 != h_m2


def test_hit_after_free_revives_cached_blocks() -> None:
    kv = KVCacheManager(4, 4)
    prefill(kv, req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    table = kv.block_table("a")
    assert kv.free("a")
    assert (kv.stats().free_blocks, kv.stats().cached_blocks) == (2, 2)
    b = req("b", [1, 2, 3, 4, 5, 6, 7, 8, 0, 0])
    # 2 hits; the tail takes the first free block (a's partial tail went to the back).
    assert prefill(kv, b) == [3]
    assert kv.block_table("b") == [*table[:2], 3]
    assert kv.stats().cached_blocks == 0
    kv.check()


def test_decode_caches_blocks_as_they_fill() -> None:
    kv = KVCacheManager(8, 4)
    a = req("a", [1, 2, 3])
    prefill(kv, a)
    assert kv.pool.block_hash(kv.block_table("a")[0]) is None
    assert decode(kv, a, 4) == []
    assert kv.pool.block_hash(kv.block_table("a")[0]) is not None
    assert decode(kv, a, 5) == [1]
    assert kv.stats().logical_slots == 5
    assert kv.get_computed_blocks(req("b", [1, 2, 3, 4, 5, 6])) == ([0], 4)


def test_concurrent_identical_prefix_keeps_first_mapping() -> None:
    kv = KVCacheManager(8, 4)
    a, b = req("a", [1, 2, 3, 4, 5]), req("b", [1, 2, 3, 4, 6])
    # Both miss (b looks up before a is allocated), then both compute block [1, 2, 3, 4].
    assert kv.get_computed_blocks(b) == ([], 0)
    prefill(kv, a)
    kv.allocate_slots(b, 5)
    kv.take_pending_copies()
    a0, b0 = kv.block_table("a")[0], kv.block_table("b")[0]
    assert a0 != b0
    assert kv.pool.lookup(kv.pool.block_hash(a0) or 0) == a0
    assert kv.pool.block_hash(b0) is None
    kv.free("b")
    kv.free("a")
    s = kv.stats()
    assert (s.free_blocks, s.cached_blocks, s.in_use_blocks) == (7, 1, 0)
    kv.check()


def test_prefix_caching_disabled_never_hits_or_caches() -> None:
    kv = KVCacheManager(8, 4, enable_prefix_caching=False)
    prefill(kv, req("a", [1, 2, 3, 4, 5]))
    assert kv.get_computed_blocks(req("b", [1, 2, 3, 4, 5])) == ([], 0)
    kv.free("a")
    assert kv.stats().cached_blocks == 0


def test_lru_evicts_deepest_block_of_a_freed_sequence_first() -> None:
    kv = KVCacheManager(4, 2)
    prefill(kv, req("a", [1, 2, 3, 4, 5, 6, 7]))  # 3 full blocks cached + a partial tail
    b0, b1, b2, b3 = kv.block_table("a")
    kv.free("a")  # tail first: b3 free (uncached); LRU b2, b1, b0
    assert (kv.stats().free_blocks, kv.stats().cached_blocks) == (1, 3)
    c = req("c", [9, 9, 9])  # needs 2 blocks: the free one, then evicts b2 (deepest)
    assert prefill(kv, c) == [b3, b2]
    assert kv.get_computed_blocks(req("d", [1, 2, 3, 4, 5, 6, 0])) == ([b0, b1], 4)
    kv.check()


# -- allocation --


def test_chunked_prefill_grows_table() -> None:
    kv = KVCacheManager(8, 4)
    a = req("a", list(range(10)))
    assert kv.allocate_slots(a, 3) == [0]
    a.num_computed_tokens = 3
    assert kv.allocate_slots(a, 3) == [1]
    a.num_computed_tokens = 6
    assert kv.allocate_slots(a, 4) == [2]
    assert kv.block_table("a") == [0, 1, 2]
    assert kv.num_held_blocks("a") == 3
    assert kv.pool.block_hash(0) is not None and kv.pool.block_hash(1) is not None
    assert kv.pool.block_hash(2) is None
    kv.check()


def test_allocate_failure_changes_nothing() -> None:
    kv = KVCacheManager(4, 4)
    prefill(kv, req("a", [1, 2, 3, 4, 5]))
    kv.free("a")  # one cached block, three free
    kv.reserve("x", 4)
    before = kv.stats()
    b = req("b", [1, 2, 3, 4] + [0] * 13)  # hit of 1 block, needs 4 more: only 3 free
    hits, n = kv.get_computed_blocks(b)
    assert n == 4
    b.num_computed_tokens = n
    assert kv.allocate_slots(b, b.num_tokens - n, hits) is None
    assert kv.stats() == before
    assert kv.block_table("b") == [] and kv.pool.refcount(hits[0]) == 0
    assert kv.take_pending_copies() == []
    assert not kv.free("b")
    kv.check()


def test_allocate_counts_revived_hits_against_capacity() -> None:
    kv = KVCacheManager(2, 2)
    prefill(kv, req("a", [1, 2, 3]))
    kv.free("a")  # block 0 cached, block 1 free
    b = req("b", [1, 2, 3, 4, 5])
    hits, n = kv.get_computed_blocks(b)
    assert hits == [0]
    b.num_computed_tokens = n
    # 2 more blocks needed; only 1 free once the hit is revived (it cannot also be evicted).
    assert kv.allocate_slots(b, 3, hits) is None
    assert kv.stats().cached_blocks == 1


def test_computed_blocks_require_num_computed_tokens() -> None:
    kv = KVCacheManager(4, 4)
    prefill(kv, req("a", [1, 2, 3, 4, 5]))
    b = req("b", [1, 2, 3, 4, 5])
    hits, _ = kv.get_computed_blocks(b)
    with pytest.raises(ValueError, match="does not cover"):
        kv.allocate_slots(b, 5, hits)


# -- fork and copy-on-write --


def test_fork_then_child_append_copies_the_shared_tail_once() -> None:
    kv = KVCacheManager(8, 4)
    parent = req("p", [1, 2, 3, 4, 5, 6])
    prefill(kv, parent)
    kv.fork("p", "c")
    full, tail = kv.block_table("p")
    assert kv.block_table("c") == [full, tail]
    assert (kv.pool.refcount(full), kv.pool.refcount(tail)) == (2, 2)
    assert kv.stats().in_use_blocks == 2

    child = req("c", [1, 2, 3, 4, 5, 6])
    child.num_computed_tokens = 6
    new = decode(kv, child, 9)
    assert new is not None and len(new) == 1
    assert kv.take_pending_copies() == [(tail, new[0])]
    assert kv.take_pending_copies() == []
    assert kv.block_table("c") == [full, new[0]]
    assert kv.block_table("p") == [full, tail]  # the parent keeps the original
    assert (kv.pool.refcount(full), kv.pool.refcount(tail)) == (2, 1)

    assert decode(kv, parent, 8) == []  # now exclusive: writes in place, no copy
    assert kv.take_pending_copies() == []
    kv.check()


def test_fork_at_block_boundary_shares_full_blocks_without_copy() -> None:
    kv = KVCacheManager(8, 4)
    parent = req("p", [1, 2, 3, 4])
    prefill(kv, parent)
    kv.fork("p", "c")
    child = req("c", [1, 2, 3, 4])
    child.num_computed_tokens = 4
    assert decode(kv, child, 5) == [1]
    assert kv.take_pending_copies() == []
    assert kv.block_table("c") == [0, 1]
    kv.check()


def test_fork_errors() -> None:
    kv = KVCacheManager(8, 4)
    with pytest.raises(ValueError, match="parent x"):
        kv.fork("x", "y")
    prefill(kv, req("p", [1, 2]))
    kv.fork("p", "c")
    with pytest.raises(ValueError, match="child c"):
        kv.fork("p", "c")


# -- same-step preemption: work scheduled but never run --


def test_free_in_the_same_step_uncaches_blocks_never_computed() -> None:
    kv = KVCacheManager(8, 4)
    prefill(kv, req("a", [1, 2, 3, 4, 5]))  # step ran: block [1, 2, 3, 4] is cached
    b = req("b", [1, 2, 3, 4, 6, 7, 8, 9, 0])
    hits, b.num_computed_tokens = kv.get_computed_blocks(b)
    kv.allocate_slots(b, 5, hits)  # caches block [6, 7, 8, 9] for this step's forward
    assert kv.pool.num_in_use == 4
    assert kv.free("b")  # preempted before the forward ran
    assert kv.get_computed_blocks(req("c", b.all_token_ids)) == (hits, 4)  # committed hit stays
    kv.free("a")
    assert kv.stats().cached_blocks == 1
    kv.check()


def test_swap_out_in_the_same_step_reads_pending_cow_source() -> None:
    kv = KVCacheManager(8, 4, num_host_blocks=4)
    prefill(kv, req("p", [1, 2, 3, 4, 5, 6]))
    kv.fork("p", "c")
    full, tail = kv.block_table("p")
    child = req("c", [1, 2, 3, 4, 5, 6])
    child.num_computed_tokens = 6
    (dst,) = decode(kv, child, 9) or []
    out = kv.swap_out("c")  # preempted before the copy (and the forward) ran
    assert out is not None and [d for d, _ in out] == [full, tail]
    assert kv.take_pending_copies() == []
    assert kv.pool.refcount(dst) == 0 and kv.pool.refcount(tail) == 1
    kv.check()


def test_free_in_the_same_step_cancels_pending_cow() -> None:
    kv = KVCacheManager(8, 4)
    prefill(kv, req("p", [1, 2, 3, 4, 5, 6]))
    kv.fork("p", "c")
    child = req("c", [1, 2, 3, 4, 5, 6])
    child.num_computed_tokens = 6
    decode(kv, child, 9)
    assert kv.free("c")
    assert kv.take_pending_copies() == []
    assert kv.stats().in_use_blocks == 2
    kv.check()


# -- free --


def test_free_is_idempotent() -> None:
    kv = KVCacheManager(8, 4, num_host_blocks=4)
    a = req("a", [1, 2, 3, 4, 5])
    kv.reserve("a", 8)
    prefill(kv, a)
    assert kv.free("a")
    after = kv.stats()
    assert after.in_use_blocks == 0 and after.reserved_blocks == 0
    assert not kv.free("a")
    assert kv.stats() == after
    kv.check()


def test_free_of_queued_request_rolls_back_reservation_only() -> None:
    kv = KVCacheManager(8, 4)
    assert kv.reserve("q", 10)
    assert kv.stats().reserved_blocks == 3
    assert kv.free("q")
    assert kv.stats() == KVStats(8, 8, 0, 0, 0, 0, 0, 0, 0)
    assert not kv.free("never-seen")


def test_free_of_forked_parent_keeps_shared_blocks_for_child() -> None:
    kv = KVCacheManager(8, 4)
    prefill(kv, req("p", [1, 2, 3, 4, 5]))
    kv.fork("p", "c")
    assert kv.free("p")
    assert kv.stats().in_use_blocks == 2
    assert kv.free("c")
    assert kv.stats().in_use_blocks == 0
    kv.check()


# -- reservations --


def test_reservation_accounting() -> None:
    kv = KVCacheManager(10, 4)
    assert kv.reservable_tokens() == 40
    assert kv.reserve("a", 17)  # 5 blocks
    assert kv.reservable_tokens() == 20
    assert not kv.reserve("b", 21)  # 6 blocks: 5 + 6 > 10
    assert kv.stats().reserved_blocks == 5
    assert kv.reserve("b", 20)
    assert kv.reservable_tokens() == 0
    assert kv.reserve("a", 4)  # replacing a's reservation shrinks it
    assert kv.reservable_tokens() == 16
    assert kv.free("a")  # a reservation alone: free drops it
    assert kv.stats().reserved_blocks == 5
    assert kv.stats().free_blocks == 10  # bookkeeping only: nothing physical moved


def test_claim_is_max_of_reserved_and_held() -> None:
    kv = KVCacheManager(10, 4)
    a = req("a", list(range(12)))
    assert kv.reserve("a", 4)  # 1 block reserved, then 3 held: claim 3
    prefill(kv, a)
    assert kv.reservable_tokens() == 7 * 4
    assert kv.reserve("a", 32)  # 8 reserved, 3 held: claim 8
    assert kv.reservable_tokens() == 2 * 4
    assert not kv.reserve("b", 9)
    kv.free("a")
    assert kv.reservable_tokens() == 40


def test_full_blocks_held_by_several_requests_are_claimed_once() -> None:
    """Cheatsheet §4.2: n choices of one prompt claim the prompt once. Siblings hitting a
    running request's cached blocks and a fork share full blocks (claimed once); a shared
    partial tail is claimed per holder (each will copy it)."""
    kv = KVCacheManager(20, 4)
    prompt = list(range(10))  # 2 full blocks + a partial one
    a, b = req("a", prompt), req("b", prompt)
    assert kv.reserve("a", 12) and kv.reserve("b", 12)  # 3 blocks each
    prefill(kv, a)
    prefill(kv, b)  # hits a's two full blocks, its own tail
    assert kv.block_table("b")[:2] == kv.block_table("a")[:2]
    assert kv.stats().in_use_blocks == 4
    assert kv.claimed_blocks() == 3 + 3 - 2
    assert kv.reservable_tokens() == (20 - 4) * 4
    kv.fork("a", "a#1")  # shares a's full blocks and its partial tail
    # The two full blocks once; a's tail twice (a#1 will copy it); b's tail.
    assert kv.claimed_blocks() == 2 + 2 + 1
    assert kv.reserve("c", 4 * (20 - 5))
    assert not kv.reserve("d", 1)
    for rid in ("a", "a#1", "b", "c"):
        kv.free(rid)
    assert kv.claimed_blocks() == 0
    kv.check_idle()


def test_cached_free_blocks_count_as_reservable() -> None:
    kv = KVCacheManager(4, 4)
    prefill(kv, req("a", list(range(16))))
    kv.free("a")
    assert kv.stats().cached_blocks == 4
    assert kv.reserve("b", 16)


# -- swap --


def test_swap_round_trip() -> None:
    kv = KVCacheManager(6, 4, num_host_blocks=4)
    a = req("a", list(range(10)))
    kv.reserve("a", 12)
    prefill(kv, a)
    prefill(kv, req("other", [50, 51]))
    device = kv.block_table("a")
    assert kv.can_swap_out("a")
    out = kv.swap_out("a")
    assert out is not None and [d for d, _ in out] == device
    host = [h for _, h in out]
    assert len(set(host)) == 3 and all(0 <= h < 4 for h in host)
    assert kv.block_table("a") == [] and kv.num_held_blocks("a") == 0
    s = kv.stats()
    assert (s.host_free_blocks, s.reserved_blocks) == (1, 3)
    assert s.logical_slots == 2  # only device-resident sequences count
    assert not kv.can_swap_out("a") and kv.swap_out("a") is None

    with pytest.raises(ValueError, match="swapped out"):
        kv.allocate_slots(a, 1)

    assert kv.can_swap_in("a")
    back = kv.swap_in("a")
    assert back is not None and [h for h, _ in back] == host
    new_device = [d for _, d in back]
    assert kv.block_table("a") == new_device and len(set(new_device)) == 3
    assert all(kv.pool.refcount(d) == 1 for d in new_device)
    assert kv.stats().logical_slots == 12
    assert kv.stats().host_free_blocks == 1  # the swap-in copies still read the host blocks
    assert kv.swap_in("a") is None
    kv.check()
    kv.take_pending_copies()
    assert kv.stats().host_free_blocks == 4
    kv.check()
    assert decode(kv, a, 99) == []  # keeps decoding into the swapped-in table
    kv.free("a")
    kv.free("other")
    assert kv.stats().in_use_blocks == 0
    kv.check()


def test_swap_out_needs_host_room_and_swap_in_needs_device_room() -> None:
    kv = KVCacheManager(3, 4, num_host_blocks=2)
    prefill(kv, req("a", list(range(12))))
    assert not kv.can_swap_out("a")
    before = kv.stats()
    assert kv.swap_out("a") is None
    assert kv.stats() == before

    kv2 = KVCacheManager(3, 4, num_host_blocks=3)
    prefill(kv2, req("a", list(range(8))))
    assert kv2.swap_out("a") is not None
    prefill(kv2, req("b", list(range(100, 108))))
    assert not kv2.can_swap_in("a") and kv2.swap_in("a") is None
    kv2.free("b")
    assert kv2.swap_in("a") is not None


def test_free_while_swapped_returns_host_blocks() -> None:
    kv = KVCacheManager(4, 4, num_host_blocks=4)
    prefill(kv, req("a", list(range(6))))
    kv.swap_out("a")
    assert kv.stats().host_free_blocks == 2
    assert kv.free("a")
    s = kv.stats()
    assert (s.host_free_blocks, s.in_use_blocks) == (4, 0)
    kv.check()


def test_check_detects_table_refcount_mismatch() -> None:
    kv = KVCacheManager(4, 4)
    prefill(kv, req("a", [1, 2]))
    kv._seqs["a"].blocks.append(3)  # corrupt: a table entry with no reference
    with pytest.raises(KVInvariantError, match="block 3"):
        kv.check()


def test_stats_is_a_frozen_snapshot() -> None:
    kv = KVCacheManager(4, 4)
    s = kv.stats()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.free_blocks = 0  # type: ignore[misc]


def test_prefix_hashes_match_the_cache_keys() -> None:
    """The chain a router computes equals the hashes the manager caches full blocks under."""
    kv = KVCacheManager(num_blocks=16, block_size=4, model_id="m")
    r = req("a", list(range(11)), salt="tenant-1")
    kv.reserve(r, 11)
    assert prefill(kv, r) is not None
    stored = [kv.pool.block_hash(b) for b in kv.block_table("a")[:2]]
    assert stored == prefix_hashes(list(range(11)), 4, "tenant-1", "m")
    assert prefix_hashes(list(range(11)), 4, "tenant-2", "m")[0] not in stored


# -- pinned by mutation testing (make mutation) --


def test_forked_child_caches_its_blocks_under_the_parents_salt() -> None:
    """A forked child keeps the parent's salt: its new blocks hit only within that tenant."""
    kv = KVCacheManager(8, 4)
    parent = req("p", [1, 2, 3, 4, 5, 6], salt="tenant-a")
    prefill(kv, parent)
    kv.fork("p", "c")
    child = req("c", [1, 2, 3, 4, 5, 6], salt="tenant-a")
    child.num_computed_tokens = 6
    assert decode(kv, child, 7) is not None  # CoW of the shared tail
    assert decode(kv, child, 8) == []  # fills the tail: the child caches block 2
    kv.take_pending_copies()
    table = kv.block_table("c")
    probe = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert kv.get_computed_blocks(req("x", probe, salt="tenant-a")) == (table, 8)
    assert kv.get_computed_blocks(req("y", probe, salt="tenant-b")) == ([], 0)
    assert kv.get_computed_blocks(req("z", probe)) == ([], 0)
    assert kv.stats().logical_slots == 6 + 8  # the child's num_slots followed it
    kv.free("p")
    kv.free("c")
    kv.check_idle()


def test_fork_copies_table_and_hash_chain_not_aliases() -> None:
    """The child's table and hash chain are copies: the parent's growth leaves them alone."""
    kv = KVCacheManager(8, 4)
    parent = req("p", [1, 2, 3, 4, 5])
    prefill(kv, parent)
    kv.fork("p", "c")
    for token in (6, 7, 8, 9):
        decode(kv, parent, token)  # CoW of the tail, then a third block
    kv.take_pending_copies()
    assert len(kv.block_table("p")) == 3 and len(kv.block_table("c")) == 2
    assert kv.block_table("c")[0] == kv.block_table("p")[0]
    assert kv.stats().logical_slots == 9 + 5
    kv.free("p")
    kv.free("c")
    kv.check_idle()


def test_freeing_an_unknown_request_keeps_the_reservations() -> None:
    """Freeing a request that holds nothing changes nothing; freeing a reserved one drops its
    reservation, once."""
    kv = KVCacheManager(4, 4)
    assert kv.reserve("a", 8)
    assert not kv.free("b")
    assert kv.stats().reserved_blocks == 2
    assert kv.free("a") and not kv.free("a")
    kv.check_idle()


def test_lease_keeps_the_blocks_until_free() -> None:
    """A lease drops the reservation but keeps the blocks in use until free() ends it."""
    kv = KVCacheManager(4, 4)
    r = req("a", [1, 2, 3, 4, 5])
    assert kv.reserve("a", 8)
    prefill(kv, r)
    table = kv.block_table("a")
    assert kv.lease("a") == table and kv.leased_ids == frozenset({"a"})
    s = kv.stats()
    assert (s.reserved_blocks, s.in_use_blocks) == (0, 2)
    with pytest.raises(KVInvariantError, match="pool not back to baseline"):
        kv.check_idle()
    assert kv.free("a") and kv.leased_ids == frozenset()
    kv.check_idle()
    with pytest.raises(ValueError, match="lease: request a holds no device blocks"):
        kv.lease("a")


def test_lease_of_a_swapped_request_is_refused() -> None:
    """A swapped-out request holds no device blocks to lease."""
    kv = KVCacheManager(4, 4, num_host_blocks=4)
    prefill(kv, req("a", [1, 2, 3, 4, 5]))
    assert kv.swap_out("a") is not None
    with pytest.raises(ValueError, match="lease: request a holds no device blocks"):
        kv.lease("a")
    assert kv.leased_ids == frozenset()
    kv.free("a")
    kv.check_idle()


def test_imported_kv_is_cached_only_once_verified() -> None:
    """Blocks allocated with cache=False enter the prefix cache at cache_computed()."""
    kv = KVCacheManager(8, 4)
    r = req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert kv.allocate_slots(r, 9, cache=False) == [0, 1, 2]
    kv.take_pending_copies()
    probe = req("p", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert kv.get_computed_blocks(probe) == ([], 0)
    kv.cache_computed(r)  # nothing computed yet: nothing to cache
    assert kv.get_computed_blocks(probe) == ([], 0)
    r.num_computed_tokens = 7
    kv.cache_computed(r)
    assert kv.get_computed_blocks(probe) == ([0], 4)
    r.num_computed_tokens = 9
    kv.cache_computed(r)
    kv.cache_computed(r)  # repeats are no-ops
    assert kv.get_computed_blocks(probe) == ([0, 1], 8)
    kv.cache_computed(req("unknown", [1]))
    # An import is no lookup: a decode worker's hit ratio counts only its own prefills.
    assert (kv.stats().prefix_query_tokens, kv.stats().prefix_hit_tokens) == (0, 0)
    kv.free("a")
    kv.check_idle()


def test_cache_computed_respects_disabled_prefix_caching() -> None:
    """With prefix caching off, verified imported KV is never cached."""
    kv = KVCacheManager(8, 4, enable_prefix_caching=False)
    r = req("a", [1, 2, 3, 4, 5])
    kv.allocate_slots(r, 5, cache=False)
    r.num_computed_tokens = 5
    kv.cache_computed(r)
    assert kv.pool.cached_hashes() == []
    kv.free("a")
    assert kv.stats().cached_blocks == 0
    kv.check_idle()


@pytest.mark.parametrize("leak", ["reserved", "in_use", "host"])
def test_check_idle_names_what_is_not_back(leak: str) -> None:
    """check_idle() fails on a leftover reservation, block in use, or held host block."""
    kv = KVCacheManager(4, 4, num_host_blocks=2)
    kv.check_idle()
    if leak == "reserved":
        kv.reserve("a", 4)
    else:
        prefill(kv, req("a", [1, 2, 3]))
        if leak == "host":
            assert kv.swap_out("a") is not None
    with pytest.raises(KVInvariantError, match="pool not back to baseline"):
        kv.check_idle()
    kv.free("a")
    kv.check_idle()


def test_swap_out_in_the_same_step_uncaches_blocks_never_computed() -> None:
    """A request swapped out before its forward takes this step's newly cached blocks back."""
    kv = KVCacheManager(8, 4, num_host_blocks=4)
    prefill(kv, req("a", [1, 2, 3, 4, 5]))  # step ran: block [1, 2, 3, 4] is cached
    b = req("b", [1, 2, 3, 4, 6, 7, 8, 9, 0])
    hits, b.num_computed_tokens = kv.get_computed_blocks(b)
    kv.allocate_slots(b, 5, hits)  # caches block [6, 7, 8, 9] for this step's forward
    pairs = kv.swap_out("b")  # preempted before the forward ran
    assert pairs is not None and len(pairs) == 3
    assert kv.get_computed_blocks(req("c", b.all_token_ids)) == (hits, 4)  # committed hit stays
    assert len(kv.pool.cached_hashes()) == 1
    kv.free("a")
    kv.free("b")
    kv.check_idle()


def test_swap_out_releases_the_deepest_block_first() -> None:
    """Swapped-out blocks go to the LRU tail first, so the deepest prefix block is evicted first."""
    kv = KVCacheManager(4, 2, num_host_blocks=4)
    prefill(kv, req("a", [1, 2, 3, 4, 5, 6, 7]))  # 3 full blocks cached + a partial tail
    b0, b1, b2, b3 = kv.block_table("a")
    pairs = kv.swap_out("a")
    assert pairs is not None and [d for d, _ in pairs] == [b0, b1, b2, b3]
    assert (kv.stats().free_blocks, kv.stats().cached_blocks) == (1, 3)
    assert prefill(kv, req("c", [9, 9, 9])) == [b3, b2]  # the free one, then b2 (deepest)
    assert kv.get_computed_blocks(req("d", [1, 2, 3, 4, 5, 6, 0])) == ([b0, b1], 4)
    kv.free("a")
    kv.free("c")
    kv.check_idle()


def test_block_hashes_are_stable_golden_values() -> None:
    """hash_block's encoding is fixed: routers and engines in other processes must agree."""
    assert hash_block(None, [1, 2, 3, 4], ("", "m")) == 3608752165236924298
    assert hash_block(7, [1, 2, 3, 4], ("salt", "m")) == 8345030227118645802
    chain = [7214037947964759520, 11216070355372478009]
    assert prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, "", "") == chain
    kv = KVCacheManager(4, 4)  # the default model id is ""
    prefill(kv, req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert sorted(kv.pool.cached_hashes()) == sorted(chain)
    kv.free("a")
    kv.check_idle()


def test_a_hash_collision_is_a_miss() -> None:
    """A cached block whose content key differs (a 64-bit collision) is never a prefix hit."""
    kv = KVCacheManager(4, 4)
    probe = req("p", [1, 2, 3, 4, 5])
    h = hash_block(None, (1, 2, 3, 4), ("", ""))
    (b,) = kv.pool.allocate(1) or []
    kv.pool.cache(b, h, key=(None, (9, 9, 9, 9), ("", "")))  # other tokens, same hash
    assert kv.get_computed_blocks(probe) == ([], 0)
    kv.pool.decref([b])
    kv.check_idle()


def test_one_token_blocks_and_prefix_hit_accounting() -> None:
    """block_size 1 is valid; prefix query and hit tokens add up over requests."""
    kv = KVCacheManager(16, 1)
    prefill(kv, req("a", [1, 2, 3]))
    prefill(kv, req("b", [1, 2, 3, 4]))  # hits 3 of 4 tokens
    prefill(kv, req("c", [1, 2, 9]))  # hits 2 of 3 tokens
    s = kv.stats()
    assert (s.prefix_query_tokens, s.prefix_hit_tokens) == (10, 5)
    assert s.prefix_hit_ratio == 0.5
    for rid in "abc":
        kv.free(rid)
    kv.check_idle()
    with pytest.raises(ValueError, match="block_size=0: must be >= 1"):
        KVCacheManager(4, 0)


def test_lease_of_a_request_without_reservation() -> None:
    """A forked child (it never reserved) can be leased and freed like any other."""
    kv = KVCacheManager(4, 4)
    prefill(kv, req("p", [1, 2, 3, 4, 5]))
    kv.fork("p", "c")
    assert kv.lease("c") == kv.block_table("p")
    kv.free("p")
    kv.free("c")
    kv.check_idle()


def test_computed_blocks_must_be_covered_by_computed_tokens() -> None:
    """Prefix hits need num_computed_tokens to cover them all: one token short raises."""
    kv = KVCacheManager(4, 4)
    prefill(kv, req("a", [1, 2, 3, 4, 5]))
    b = req("b", [1, 2, 3, 4, 5])
    hits, _ = kv.get_computed_blocks(b)
    b.num_computed_tokens = 3
    with pytest.raises(ValueError, match="request b: num_computed_tokens does not cover"):
        kv.allocate_slots(b, 2, hits)
