"""Stateful property test of the KV cache manager against a shadow model of block contents.

The shadow plays the model runner: it writes each computed token into the block its position
maps to, applies CoW copies and swaps, and records for every device block the salt and the
whole token prefix up to the last slot written. Every prefix hit must then point at a block
holding exactly the hitting request's prefix, and every write must land in a block that the
writer holds alone and whose earlier slots hold the writer's own prefix.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams

BLOCK_SIZE = 2
NUM_BLOCKS = 16
NUM_HOST_BLOCKS = 10
VOCAB = (0, 1)  # tiny, so prefixes collide often
SALTS = ("s0", "s1")

Content = tuple[str, tuple[int, ...]]  # (salt, token prefix up to the last written slot)


class KVMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, num_host_blocks=NUM_HOST_BLOCKS)
        self.reqs: dict[str, Request] = {}
        self.phase: dict[str, str] = {}  # "new" (no blocks yet) | "active" | "swapped"
        self.reserved: dict[str, int] = {}  # blocks
        self.host_held: dict[str, list[int]] = {}
        self.content: dict[int, Content] = {}
        self.host_content: dict[int, Content] = {}
        self.next_id = 0

    # -- helpers --

    def _ids(self, phase: str) -> list[str]:
        return sorted(r for r, p in self.phase.items() if p == phase)

    def _pick(self, phase: str, pick: int) -> str:
        ids = self._ids(phase)
        return ids[pick % len(ids)]

    def _new_request(self, tokens: list[int], salt: str) -> Request:
        rid = f"r{self.next_id}"
        self.next_id += 1
        r = Request(rid, tokens, SamplingParams(), arrival_time=0.0, cache_salt=salt)
        self.reqs[rid] = r
        self.phase[rid] = "new"
        return r

    def _snapshot(self) -> tuple[object, ...]:
        tables = {rid: self.kv.block_table(rid) for rid in self.reqs}
        refcounts = [self.kv.pool.refcount(b) for b in range(NUM_BLOCKS)]
        return (self.kv.stats(), tables, refcounts)

    def _write(self, r: Request, start: int, num_new: int) -> None:
        """Apply this step's copies, then write positions start .. start + num_new - 1."""
        for src, dst in self.kv.take_pending_copies():
            assert self.kv.pool.refcount(dst) == 1
            self.content[dst] = self.content[src]
        table = self.kv.block_table(r.request_id)
        assert len(table) == self.kv.blocks_for(start + num_new)
        tokens = r.all_token_ids
        for pos in range(start, start + num_new):
            block = table[pos // BLOCK_SIZE]
            assert self.kv.pool.refcount(block) == 1, "write into a shared block (missing CoW)"
            if pos % BLOCK_SIZE:
                assert self.content.get(block) == (r.cache_salt, tuple(tokens[:pos]))
            self.content[block] = (r.cache_salt, tuple(tokens[: pos + 1]))
        r.num_computed_tokens = start + num_new

    def _schedule(self, r: Request, chunk: int) -> None:
        rid = r.request_id
        if self.phase[rid] == "new":
            hits, num_cached = self.kv.get_computed_blocks(r)
            tokens = r.all_token_ids
            assert num_cached == len(hits) * BLOCK_SIZE <= r.num_tokens - 1
            for i, block in enumerate(hits):
                expected = (r.cache_salt, tuple(tokens[: (i + 1) * BLOCK_SIZE]))
                assert self.content.get(block) == expected, "prefix hit on foreign content"
            r.num_computed_tokens = num_cached
        else:
            hits = []
        start = r.num_computed_tokens
        num_new = min(chunk, r.num_tokens - start)
        revived = sum(1 for b in hits if self.kv.pool.refcount(b) == 0)
        need = self.kv.blocks_for(start + num_new) - max(len(hits), self.kv.num_held_blocks(rid))
        available = self.kv.pool.num_available - revived
        before = self._snapshot()
        new = self.kv.allocate_slots(r, num_new, hits)
        if new is None:
            assert self._snapshot() == before
            if self.phase[rid] == "new":
                r.num_computed_tokens = 0
            if self.phase[rid] == "new" or start % BLOCK_SIZE == 0:
                assert need > available  # no CoW possible here: the count is exact
            return
        if self.phase[rid] == "new" or start % BLOCK_SIZE == 0:
            assert len(new) == need <= available
        self.phase[rid] = "active"
        self._write(r, start, num_new)

    # -- rules --

    @rule(
        tokens=st.lists(st.sampled_from(VOCAB), min_size=1, max_size=9),
        salt=st.sampled_from(SALTS),
        reserve=st.booleans(),
    )
    def add_request(self, tokens: list[int], salt: str, reserve: bool) -> None:
        r = self._new_request(tokens, salt)
        if reserve:
            self._reserve(r.request_id, r.num_tokens + 4)

    @precondition(lambda self: self.reqs)
    @rule(pick=st.integers(0, 99), num_tokens=st.integers(1, 30))
    def reserve(self, pick: int, num_tokens: int) -> None:
        self._reserve(sorted(self.reqs)[pick % len(self.reqs)], num_tokens)

    def _reserve(self, rid: str, num_tokens: int) -> None:
        need = self.kv.blocks_for(num_tokens)
        others = sum(
            max(self.reserved.get(o, 0), self.kv.num_held_blocks(o)) for o in self.reqs if o != rid
        ) - self._shared_full_blocks(exclude=rid)
        fits = others + max(need, self.kv.num_held_blocks(rid)) <= NUM_BLOCKS
        assert self.kv.reserve(rid, num_tokens) == fits
        if fits:
            self.reserved[rid] = need

    def _shared_full_blocks(self, exclude: str) -> int:
        """Claims a full block held by k requests other than ``exclude`` saves: k - 1."""
        holders: Counter[int] = Counter()
        for o, r in self.reqs.items():
            if o != exclude and self.kv.num_held_blocks(o):
                full = r.num_computed_tokens // BLOCK_SIZE
                holders.update(self.kv.block_table(o)[:full])
        return sum(k - 1 for k in holders.values())

    @precondition(lambda self: self._ids("new"))
    @rule(pick=st.integers(0, 99), chunk=st.integers(1, 8))
    def schedule_new(self, pick: int, chunk: int) -> None:
        self._schedule(self.reqs[self._pick("new", pick)], chunk)

    @precondition(
        lambda self: any(
            self.reqs[r].num_computed_tokens < self.reqs[r].num_tokens for r in self._ids("active")
        )
    )
    @rule(pick=st.integers(0, 99), chunk=st.integers(1, 8))
    def continue_prefill(self, pick: int, chunk: int) -> None:
        ids = [
            r
            for r in self._ids("active")
            if self.reqs[r].num_computed_tokens < self.reqs[r].num_tokens
        ]
        self._schedule(self.reqs[ids[pick % len(ids)]], chunk)

    @precondition(
        lambda self: any(
            self.reqs[r].num_computed_tokens == self.reqs[r].num_tokens for r in self._ids("active")
        )
    )
    @rule(pick=st.integers(0, 99), token=st.sampled_from(VOCAB))
    def decode(self, pick: int, token: int) -> None:
        ids = [
            r
            for r in self._ids("active")
            if self.reqs[r].num_computed_tokens == self.reqs[r].num_tokens
        ]
        r = self.reqs[ids[pick % len(ids)]]
        r.output_token_ids.append(token)
        self._schedule(r, 1)
        if r.num_computed_tokens < r.num_tokens:  # out of blocks: the token is not kept
            r.output_token_ids.pop()

    @rule(
        tokens=st.lists(st.sampled_from(VOCAB), min_size=12, max_size=20),
        salt=st.sampled_from(SALTS),
    )
    def evict_by_pressure(self, tokens: list[int], salt: str) -> None:
        """A long prompt scheduled at once: it needs cached blocks evicted to fit."""
        self._schedule(self._new_request(tokens, salt), len(tokens))

    @precondition(lambda self: self._ids("active"))
    @rule(pick=st.integers(0, 99))
    def fork(self, pick: int) -> None:
        parent = self.reqs[self._pick("active", pick)]
        child = self._new_request(list(parent.prompt_token_ids), parent.cache_salt)
        child.output_token_ids = list(parent.output_token_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        self.kv.fork(parent.request_id, child.request_id)
        self.phase[child.request_id] = "active"
        assert self.kv.block_table(child.request_id) == self.kv.block_table(parent.request_id)

    @precondition(lambda self: self.reqs)
    @rule(pick=st.integers(0, 99))
    def free_twice(self, pick: int) -> None:
        """Finish / preempt-by-recompute, then a racing second reclaim that must be a no-op."""
        rid = sorted(self.reqs)[pick % len(self.reqs)]
        holds = self.phase[rid] != "new" or rid in self.reserved
        assert self.kv.free(rid) == holds
        after = self._snapshot()
        assert not self.kv.free(rid)
        assert self._snapshot() == after
        self._forget(rid)

    @precondition(lambda self: self._ids("new"))
    @rule(pick=st.integers(0, 99))
    def cancel_before_allocation(self, pick: int) -> None:
        rid = self._pick("new", pick)
        before = self.kv.stats()
        assert self.kv.free(rid) == (rid in self.reserved)
        after = self.kv.stats()
        assert (after.in_use_blocks, after.free_blocks) == (
            before.in_use_blocks,
            before.free_blocks,
        )
        self._forget(rid)

    @precondition(lambda self: self._ids("active"))
    @rule(pick=st.integers(0, 99))
    def swap_out(self, pick: int) -> None:
        rid = self._pick("active", pick)
        table = self.kv.block_table(rid)
        expect = len(table) <= self.kv.host_pool.num_free
        assert self.kv.can_swap_out(rid) == expect
        pairs = self.kv.swap_out(rid)
        if pairs is None:
            assert not expect
            return
        assert [d for d, _ in pairs] == table
        host = [h for _, h in pairs]
        held = {h for hs in self.host_held.values() for h in hs}
        assert len(set(host)) == len(host) and not held & set(host)
        assert all(0 <= h < NUM_HOST_BLOCKS for h in host)
        for d, h in pairs:
            self.host_content[h] = self.content[d]
        self.host_held[rid] = host
        self.phase[rid] = "swapped"

    @precondition(lambda self: self._ids("swapped"))
    @rule(pick=st.integers(0, 99))
    def swap_in(self, pick: int) -> None:
        rid = self._pick("swapped", pick)
        host = self.host_held[rid]
        expect = len(host) <= self.kv.pool.num_available
        assert self.kv.can_swap_in(rid) == expect
        pairs = self.kv.swap_in(rid)
        if pairs is None:
            assert not expect
            return
        assert [h for h, _ in pairs] == host
        assert [d for _, d in pairs] == self.kv.block_table(rid)
        for h, d in pairs:
            assert self.kv.pool.refcount(d) == 1
            self.content[d] = self.host_content[h]
        del self.host_held[rid]
        self.phase[rid] = "active"

    @rule()
    def end_step(self) -> None:
        assert self.kv.take_pending_copies() == []  # _write drains them after each allocation

    def _forget(self, rid: str) -> None:
        del self.reqs[rid], self.phase[rid]
        self.reserved.pop(rid, None)
        self.host_held.pop(rid, None)

    # -- invariants --

    @invariant()
    def consistent(self) -> None:
        self.kv.check()
        refs = [0] * NUM_BLOCKS
        for rid, phase in self.phase.items():
            table = self.kv.block_table(rid)
            assert (phase == "active") == bool(table)
            for b in table:
                refs[b] += 1
        assert refs == [self.kv.pool.refcount(b) for b in range(NUM_BLOCKS)]
        s = self.kv.stats()
        assert s.free_blocks + s.cached_blocks + s.in_use_blocks == NUM_BLOCKS
        assert s.in_use_blocks == sum(1 for n in refs if n > 0)
        assert s.reserved_blocks == sum(self.reserved.values())
        # The host pool's free and in-transfer blocks and the model's held ones partition it.
        self.kv.host_pool.check(held=[h for hs in self.host_held.values() for h in hs])

    def teardown(self) -> None:
        for rid in list(self.reqs):
            self.kv.free(rid)
            self._forget(rid)
        self.kv.take_pending_copies()
        self.kv.check()
        s = self.kv.stats()
        assert s.in_use_blocks == 0 and s.reserved_blocks == 0 and s.logical_slots == 0
        assert s.free_blocks + s.cached_blocks == NUM_BLOCKS
        assert s.host_free_blocks == NUM_HOST_BLOCKS


KVMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestKVProperties = KVMachine.TestCase
