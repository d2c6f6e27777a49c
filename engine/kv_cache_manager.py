"""Maps sequences onto KV blocks: reservations, prefix cache, CoW, swap (docs/design.md: #kv-cache,
#admission-phase-2).

Position ``p`` of a sequence lives in block ``table[p // block_size]``. Only FULL blocks are
hashed; the hash chains over the parent block's hash, so a block is reused only when the
whole prefix up to and including it is identical (same tokens, same salt, same model)::

    tokens  [a b c d][e f g h][i j]
    hashes   h0=H(-, abcd)  h1=H(h0, efgh)   (partial tail: never cached)

This layer deals in block ids only; the (src, dst) copy and swap lists it emits go to the
model runner through :class:`engine.batch.SchedulerOutput`.
"""

from __future__ import annotations

import struct
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

from engine.block_pool import BlockPool, HostBlockPool, KVInvariantError
from engine.request import Request


def hash_block(parent_hash: int | None, token_ids: Sequence[int], extra_keys: tuple) -> int:
    """xxh3-64 of (parent hash, every token id, extra keys) packed unambiguously.

    ``extra_keys`` is ``(cache_salt, model_id)``: another tenant's salt never matches.
    """
    extra = repr(extra_keys).encode()
    packed = b"".join(
        (
            b"\x00" if parent_hash is None else b"\x01" + parent_hash.to_bytes(8, "little"),
            struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids),
            struct.pack("<I", len(extra)),
            extra,
        )
    )
    return xxhash.xxh3_64_intdigest(packed)


def prefix_hashes(
    token_ids: Sequence[int], block_size: int, cache_salt: str, model_id: str
) -> list[int]:
    """The hash chain of every FULL block of ``token_ids``: what an engine keys those blocks by
    in its prefix cache, and so what a router matches KV events against."""
    hashes: list[int] = []
    parent: int | None = None
    for i in range(len(token_ids) // block_size):
        parent = hash_block(
            parent, token_ids[i * block_size : (i + 1) * block_size], (cache_salt, model_id)
        )
        hashes.append(parent)
    return hashes


def token_slice(request: Request, start: int, end: int) -> list[int]:
    """``request.all_token_ids[start:end]`` without concatenating prompt and output first
    (that copy of every token, per sequence per step, dominated the decode bookkeeping)."""
    prompt = request.prompt_token_ids
    num_prompt = len(prompt)
    if start >= num_prompt:
        return request.output_token_ids[start - num_prompt : end - num_prompt]
    if end <= num_prompt:
        return prompt[start:end]
    return prompt[start:] + request.output_token_ids[: end - num_prompt]


@dataclass(frozen=True)
class KVStats:
    """A snapshot for tests, metrics and the debug endpoint."""

    total_blocks: int
    free_blocks: int
    cached_blocks: int
    in_use_blocks: int
    reserved_blocks: int
    host_total_blocks: int
    host_free_blocks: int
    logical_slots: int  # tokens actually stored (sum of device-resident sequence lengths)
    allocated_slots: int  # sum over sequences of blocks held * block_size (shows fragmentation)
    # Prefix cache, over every request admitted so far: tokens looked up and tokens found.
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0

    @property
    def prefix_hit_ratio(self) -> float:
        return (
            self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0
        )


@dataclass
class _Seq:
    """KV state of one request that holds (or held, if swapped) physical blocks."""

    extra_keys: tuple[str, str]
    blocks: list[int] = field(default_factory=list)  # device table; empty while swapped
    host_blocks: list[int] = field(default_factory=list)  # non-empty only while swapped
    block_hashes: list[int] = field(default_factory=list)  # chain over the full blocks
    num_slots: int = 0  # positions covered once the scheduled tokens are computed


class KVCacheManager:
    """Block tables of all requests over one :class:`BlockPool` and one host swap pool."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        num_host_blocks: int = 0,
        enable_prefix_caching: bool = True,
        model_id: str = "",
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size={block_size}: must be >= 1")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.host_pool = HostBlockPool(num_host_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.model_id = model_id
        self._seqs: dict[str, _Seq] = {}
        self._reserved: dict[str, int] = {}  # request id -> reserved blocks (bookkeeping only)
        self._prefix_query_tokens = 0
        self._prefix_hit_tokens = 0
        self._pending_copies: list[tuple[int, int]] = []
        # Blocks each request newly cached this step: their KV is only computed by the
        # step's forward, so a same-step preemption must take them back out of the cache.
        self._step_cached: dict[str, list[int]] = {}
        self._leased: set[str] = set()  # ended requests whose blocks a decode worker still needs

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- phase-2 admission: accounting only (docs/design.md#admission, #admission-phase-2) --

    def _claims(self, exclude: str | None = None) -> int:
        """Sum over requests of max(reserved, held) blocks, leaving out ``exclude``, with a full
        block that several of them hold counted once: n choices of one prompt (a fork, or
        siblings hitting its cached blocks) claim the prompt once and the output n times
        (cheatsheet §4.2). A shared partial block counts per holder: each will copy it."""
        ids = self._reserved.keys() | self._seqs.keys()
        claims = held = 0
        for r in ids:
            mine = self.num_held_blocks(r)
            held += mine
            if r != exclude:
                claims += max(self._reserved.get(r, 0), mine)
        if held == self.pool.num_in_use:  # no block held twice: nothing shared (the fast path)
            return claims
        holders: Counter[int] = Counter()
        for r, seq in self._seqs.items():
            if r != exclude:
                holders.update(seq.blocks[: seq.num_slots // self.block_size])
        return claims - sum(n - 1 for n in holders.values())

    def reserve(self, request_id: str, num_tokens: int) -> bool:
        """Reserve blocks for ``num_tokens`` total tokens; replaces an earlier reservation.

        Succeeds iff every request's max(reserved, held) still sums to <= num_blocks
        (evictable cached blocks count as capacity). No physical block moves.
        """
        need = self.blocks_for(num_tokens)
        claim = max(need, self.num_held_blocks(request_id))
        if self._claims(exclude=request_id) + claim > self.pool.num_blocks:
            return False
        self._reserved[request_id] = need
        return True

    def claimed_blocks(self) -> int:
        """Blocks promised to requests: each one's max(reserved, held), leases included."""
        return self._claims()

    def reservable_tokens(self) -> int:
        """Largest ``num_tokens`` a reserve() for a new request id would accept now."""
        return max(0, self.pool.num_blocks - self._claims()) * self.block_size

    # -- prefix cache --

    def _extra_keys(self, request: Request) -> tuple[str, str]:
        return (request.cache_salt, self.model_id)

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest run of cached FULL blocks matching the request's tokens under its salt.

        Capped so the last token is always recomputed (its logits sample the next token,
        docs/design.md#lifecycle); none for a request that needs every prompt position's
        logits (prompt logprobs). Takes no references. Returns (block_ids, num_cached_tokens).
        """
        if not self.enable_prefix_caching or request.needs_prompt_logits:
            return [], 0
        tokens = request.all_token_ids
        extra = self._extra_keys(request)
        hits: list[int] = []
        parent: int | None = None
        for i in range((len(tokens) - 1) // self.block_size):
            chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            block_hash = hash_block(parent, chunk, extra)
            block_id = self.pool.lookup(block_hash, key=(parent, chunk, extra))
            if block_id is None:
                break
            hits.append(block_id)
            parent = block_hash
        return hits, len(hits) * self.block_size

    # -- physical allocation at scheduling --

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[int] | None = None,
        *,
        cache: bool = True,
    ) -> list[int] | None:
        """Grow the request's table to cover num_computed_tokens + num_new_tokens positions.

        ``computed_blocks`` (first call only) are prefix hits, incref'd into the table. A
        shared block that the new tokens write into is copied first (CoW; the pair goes to
        take_pending_copies). Blocks that become full are hashed and cached, unless ``cache``
        is False (KV arriving from another worker: :meth:`cache_computed` once it is checked).
        Returns the newly taken block ids, or None, having changed nothing, if blocks run short.
        """
        rid = request.request_id
        seq = self._seqs.get(rid)
        bs = self.block_size
        start = request.num_computed_tokens
        end = start + num_new_tokens
        if (
            seq is not None
            and not computed_blocks
            and num_new_tokens
            and start // bs == len(seq.blocks) - 1 == (end - 1) // bs
            and self.pool.refcount(seq.blocks[-1]) == 1
        ):
            # The common decode step: the tokens land in the last held block (a swapped-out
            # request holds none), which nobody shares: nothing is taken or copied.
            seq.num_slots = max(seq.num_slots, end)
            self._full(request, seq, min(end, request.num_tokens) // bs, cache)
            return []
        computed = computed_blocks or []
        if seq is not None and seq.host_blocks:
            raise ValueError(f"request {rid}: allocate_slots while swapped out")
        held = seq.blocks if seq is not None else []
        if computed and held:
            raise ValueError(f"request {rid}: computed_blocks on a request that holds blocks")
        if len(computed) * bs > start:
            raise ValueError(f"request {rid}: num_computed_tokens does not cover computed_blocks")
        table = held or list(computed)
        num_needed = -(-end // bs)
        # Blocks the new tokens write into that others also hold must be replaced first.
        written = range(start // bs, min(len(table), num_needed)) if num_new_tokens else ()
        cow = [i for i in written if self.pool.refcount(table[i]) > 1]
        num_grow = max(0, num_needed - len(table))
        new_blocks: list[int] = []
        # The common decode step (last block still has room, nobody shares it) takes nothing.
        if seq is None or computed or cow or num_grow:
            revived = sum(1 for b in computed if self.pool.refcount(b) == 0)
            if len(cow) + num_grow > self.pool.num_available - revived:
                return None
            if seq is None:
                seq = self._seqs[rid] = _Seq(extra_keys=self._extra_keys(request))
                if cache:  # a lookup; imported KV (not cached until checked) is none
                    self._prefix_query_tokens += request.num_tokens
                    self._prefix_hit_tokens += len(computed) * bs
            self.pool.incref(computed)
            seq.blocks = table
            new_blocks = self._take_blocks(table, cow, num_grow, start)
        seq.num_slots = max(seq.num_slots, end)
        self._full(request, seq, min(end, request.num_tokens) // bs, cache)
        return new_blocks

    def _full(self, request: Request, seq: _Seq, num_full: int, cache: bool) -> None:
        """The request's first ``num_full`` blocks are full: hash and cache the new ones."""
        if cache and self.enable_prefix_caching and num_full > len(seq.block_hashes):
            self._cache_full_blocks(request, seq, num_full)

    def cache_computed(self, request: Request) -> None:
        """Register the full blocks of the request's computed tokens in the prefix cache (for
        KV written from outside the forward, after it was verified)."""
        seq = self._seqs.get(request.request_id)
        num_full = request.num_computed_tokens // self.block_size
        if seq is not None and self.enable_prefix_caching and num_full > len(seq.block_hashes):
            self._cache_full_blocks(request, seq, num_full)

    def _take_blocks(
        self, table: list[int], cow: list[int], num_grow: int, start: int
    ) -> list[int]:
        """Replace the shared blocks at table indices ``cow`` and append ``num_grow`` blocks."""
        new_blocks = self.pool.allocate(len(cow) + num_grow)
        if new_blocks is None:
            raise KVInvariantError("allocate failed after the availability check")
        for i, dst in zip(cow, new_blocks, strict=False):
            src = table[i]
            if i * self.block_size < start:  # the block holds computed tokens: copy them
                self._pending_copies.append((src, dst))
            self.pool.decref([src])
            table[i] = dst
        table.extend(new_blocks[len(cow) :])
        return new_blocks

    def _cache_full_blocks(self, request: Request, seq: _Seq, num_full: int) -> None:
        """Hash and register the request's first ``num_full`` blocks (all of them full)."""
        bs = self.block_size
        for i in range(len(seq.block_hashes), num_full):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            chunk = tuple(token_slice(request, i * bs, (i + 1) * bs))
            block_hash = hash_block(parent, chunk, seq.extra_keys)
            seq.block_hashes.append(block_hash)
            block = seq.blocks[i]
            fresh = self.pool.block_hash(block) is None  # not a prefix hit
            if self.pool.cache(block, block_hash, key=(parent, chunk, seq.extra_keys)) and fresh:
                self._step_cached.setdefault(request.request_id, []).append(block)

    def block_table(self, request_id: str) -> list[int]:
        seq = self._seqs.get(request_id)
        return list(seq.blocks) if seq is not None else []

    def num_held_blocks(self, request_id: str) -> int:
        seq = self._seqs.get(request_id)
        return len(seq.blocks) if seq is not None else 0

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Drain the CoW (src, dst) pairs into this step's SchedulerOutput.copy_blocks.

        Called once per step, after scheduling: it ends the step. The host blocks this
        step's swap-ins read are freed (they were held back so no swap-out could overwrite
        them) and the blocks cached this step become final.
        """
        copies, self._pending_copies = self._pending_copies, []
        self.host_pool.finish_transfers()
        self._step_cached.clear()
        return copies

    def _cancel_step(self, request_id: str, seq: _Seq) -> dict[int, int]:
        """Undo this step's provisional work of a request dropped before its forward ran.

        Blocks it cached this step will never be computed, so they leave the cache; CoW
        copies into its blocks are cancelled. Returns {cancelled CoW dst: its src}.
        """
        for block in self._step_cached.pop(request_id, []):
            self.pool.uncache(block)
        held = set(seq.blocks)
        cancelled = {dst: src for src, dst in self._pending_copies if dst in held}
        self._pending_copies = [(s, d) for s, d in self._pending_copies if d not in cancelled]
        return cancelled

    # -- n > 1 --

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every parent block; the partial tail is copied on first write."""
        parent = self._seqs.get(parent_id)
        if parent is None or parent.host_blocks:
            raise ValueError(f"fork: parent {parent_id} holds no device blocks")
        if child_id in self._seqs:
            raise ValueError(f"fork: child {child_id} already holds blocks")
        self.pool.incref(parent.blocks)
        self._seqs[child_id] = _Seq(
            extra_keys=parent.extra_keys,
            blocks=list(parent.blocks),
            block_hashes=list(parent.block_hashes),
            num_slots=parent.num_slots,
        )

    # -- freeing and preemption (docs/design.md#cleanup, #preemption) --

    def lease(self, request_id: str) -> list[int]:
        """Keep an ended request's device blocks for a transfer (prefill side of
        disaggregation); drops its reservation. The blocks stay in use until :meth:`free`, which
        the lease's release calls exactly once. Returns the block table."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.host_blocks:
            raise ValueError(f"lease: request {request_id} holds no device blocks")
        self._reserved.pop(request_id, None)
        self._leased.add(request_id)
        return list(seq.blocks)

    @property
    def leased_ids(self) -> frozenset[str]:
        return frozenset(self._leased)

    def free(self, request_id: str) -> bool:
        """THE freeing path: drop all device and host blocks and the reservation.

        Blocks are released tail first so the LRU evicts the deepest prefix blocks first.
        Idempotent: returns False, changing nothing, when the request holds nothing.
        """
        self._leased.discard(request_id)
        seq = self._seqs.pop(request_id, None)
        reserved = self._reserved.pop(request_id, None)
        if seq is not None:
            self._cancel_step(request_id, seq)
            self.pool.decref(seq.blocks[::-1])
            self.host_pool.free(seq.host_blocks)
        return seq is not None or reserved is not None

    def rollback(self, request: Request) -> None:
        """Take back what a verification wrote for rejected drafts (docs/design.md
        #speculative-decoding): the request now covers its computed tokens, and the blocks past
        the one its next token goes into return to the pool. They were never cached (only
        blocks full of known tokens are) and nobody else holds them (they were fresh)."""
        seq = self._seqs.get(request.request_id)
        if seq is None:
            return
        seq.num_slots = request.num_computed_tokens
        keep = self.blocks_for(request.num_tokens)
        if len(seq.blocks) > keep:
            self.pool.decref(seq.blocks[keep:])
            del seq.blocks[keep:]

    def can_swap_out(self, request_id: str) -> bool:
        seq = self._seqs.get(request_id)
        return seq is not None and bool(seq.blocks) and len(seq.blocks) <= self.host_pool.num_free

    def swap_out(self, request_id: str) -> list[tuple[int, int]] | None:
        """Move the request's KV to host blocks; returns (device, host) pairs or None.

        A block whose CoW copy is still pending is read from the copy's source instead.
        """
        if not self.can_swap_out(request_id):
            return None
        seq = self._seqs[request_id]
        host = self.host_pool.allocate(len(seq.blocks))
        if host is None:
            raise KVInvariantError("host allocate failed after can_swap_out")
        moved = self._cancel_step(request_id, seq)
        pairs = [(moved.get(d, d), h) for d, h in zip(seq.blocks, host, strict=True)]
        self.pool.decref(seq.blocks[::-1])
        seq.blocks, seq.host_blocks = [], host
        return pairs

    def can_swap_in(self, request_id: str) -> bool:
        seq = self._seqs.get(request_id)
        return (
            seq is not None
            and bool(seq.host_blocks)
            and len(seq.host_blocks) <= self.pool.num_available
        )

    def swap_in(self, request_id: str) -> list[tuple[int, int]] | None:
        """Bring a swapped request back into fresh device blocks; (host, device) pairs."""
        if not self.can_swap_in(request_id):
            return None
        seq = self._seqs[request_id]
        device = self.pool.allocate(len(seq.host_blocks))
        if device is None:
            raise KVInvariantError("device allocate failed after can_swap_in")
        pairs = list(zip(seq.host_blocks, device, strict=True))
        self.host_pool.free_after_transfer(seq.host_blocks)
        seq.blocks, seq.host_blocks = device, []
        return pairs

    # -- observability --

    def stats(self) -> KVStats:
        on_device = [s for s in self._seqs.values() if s.blocks]
        return KVStats(
            total_blocks=self.pool.num_blocks,
            free_blocks=self.pool.num_free,
            cached_blocks=self.pool.num_cached,
            in_use_blocks=self.pool.num_in_use,
            reserved_blocks=sum(self._reserved.values()),
            host_total_blocks=self.host_pool.num_blocks,
            host_free_blocks=self.host_pool.num_free,
            logical_slots=sum(s.num_slots for s in on_device),
            allocated_slots=sum(len(s.blocks) for s in on_device) * self.block_size,
            prefix_query_tokens=self._prefix_query_tokens,
            prefix_hit_tokens=self._prefix_hit_tokens,
        )

    def check(self) -> None:
        """Pool conservation, tables consistent with refcounts block by block, host pool ok."""
        self.pool.check()
        held = [0] * self.pool.num_blocks
        for rid, seq in self._seqs.items():
            if seq.blocks and seq.host_blocks:
                raise KVInvariantError(f"request {rid} is both on device and swapped")
            if len(set(seq.blocks)) != len(seq.blocks):
                raise KVInvariantError(f"request {rid} holds a block twice")
            for block_id in seq.blocks:
                held[block_id] += 1
        for block_id, count in enumerate(held):
            if count != self.pool.refcount(block_id):
                raise KVInvariantError(
                    f"block {block_id}: {count} table references, "
                    f"refcount {self.pool.refcount(block_id)}"
                )
        self.host_pool.check([b for s in self._seqs.values() for b in s.host_blocks])

    def check_idle(self) -> None:
        """The leak check once no request is live (P1): ``check()`` plus every pool back to its
        baseline — nothing in use, nothing reserved, the whole host pool free."""
        self.check()
        s = self.stats()
        if s.in_use_blocks or s.reserved_blocks or s.host_free_blocks != s.host_total_blocks:
            raise KVInvariantError(f"pool not back to baseline: {s}")
        if s.free_blocks + s.cached_blocks != s.total_blocks:
            raise KVInvariantError(f"blocks unaccounted for: {s}")
