"""The scheduler: admission, one tick, preemption, reclaim (docs/design.md: #admission-phase-2,
#scheduler-tick, #preemption, #cleanup).

Count tokens, don't track phases: every request holding KV lets ``num_computed_tokens`` catch
up with ``num_tokens`` (prompt + output). A chunk whose end reaches ``num_tokens`` samples.
Prefill, chunked prefill, prefix hits, decode and recompute after preemption are all this rule.

Where requests live::

    waiting   QUEUED / DEGRADED / PREEMPTED     (a KV reservation at most; no device blocks)
    swapped   SWAPPED                           (KV in host blocks, reservation kept)
    running   RUNNABLE .. BACKPRESSURED         (device blocks; one batch slot each)

A request that ends is marked terminal at once and reclaimed (KV freed, slot released, one
TerminalRecord written) at the start of the next ``schedule()`` by :meth:`Scheduler.reclaim`.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import replace

from engine import metrics
from engine.admission import Admission, AdmissionResult, NoRoom
from engine.batch import ScheduledChunk, SchedulerOutput
from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager, token_slice
from engine.request import (
    FinishReason,
    RecordLog,
    Request,
    RequestStatus,
    TerminalRecord,
    fork_id,
)

S = RequestStatus
# A running request computes tokens this step unless it ended, its client is behind, or its
# KV is still arriving.
_STEPPING = frozenset(s for s in S if not s.is_terminal) - {S.BACKPRESSURED, S.WAITING_FOR_KV}


class Scheduler:
    """Decides, once per step, which tokens of which requests the model runner computes."""

    def __init__(
        self,
        config: EngineConfig,
        kv: KVCacheManager,
        max_model_len: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.clock = clock
        self.admission = Admission(config, kv, max_model_len)
        self.records: RecordLog[TerminalRecord] = RecordLog()
        self._requests: dict[str, Request] = {}  # every request not yet reclaimed
        self._waiting: list[Request] = []
        self._swapped: list[Request] = []
        self._running: list[Request] = []
        self._ended: list[str] = []  # marked terminal, reclaimed at the next tick
        self._backpressured: set[str] = set()  # the client is behind: generate nothing more
        self._in_flight: set[str] = set()  # ids scheduled by the last schedule(), until update
        self._riders: dict[str, list[Request]] = {}  # parent id -> children forked mid-step
        # Speculation (docs/design.md#speculative-decoding): the engine's draft source, given a
        # decoding request and the most drafts it may take; this step's drafts by request id.
        self.drafter: Callable[[Request, int], list[int]] | None = None
        self._drafts: dict[str, list[int]] = {}

    # -- admission, phase 2 (docs/design.md#admission-phase-2) --

    def add_request(self, req: Request) -> AdmissionResult:
        """Admit ``req`` with a KV reservation, queue it, degrade it, or reject it."""
        rid = req.request_id
        if rid in self._requests:
            raise ValueError(f"request {rid} is already in the scheduler")
        self._requests[rid] = req
        limit = self.admission.hard_limit(req)
        if limit is not None:
            return self._reject(req, limit)
        reserved = self.admission.reserve(req)
        if reserved is None and self.config.admission_policy == "reject":
            return self._reject(req, self.admission.no_fit(req))
        req.times.queued = self.clock()
        self._waiting.append(req)
        if reserved is None:
            return AdmissionResult(S.QUEUED, f"waiting: {self.admission.no_fit(req)}")
        if req.status is S.DEGRADED:
            target = self.admission.target_tokens(req)
            return AdmissionResult(S.DEGRADED, f"degraded: reserved {reserved} of {target} tokens")
        return AdmissionResult(S.QUEUED)

    def add_imported(self, req: Request, num_kv_tokens: int) -> AdmissionResult:
        """Disaggregated decode side: admit ``req`` whose first ``num_kv_tokens`` positions
        were computed elsewhere. Blocks for them are taken now (uncached until verified) and
        the request waits in WAITING_FOR_KV, holding a batch slot, until :meth:`kv_ready`.
        Past a hard limit it is REJECTED. Without a slot, its full reservation or the blocks
        right now it raises NoRoom with nothing changed: the cluster's admission promised
        this worker the room (router/admission.py), so the caller offers it again once a
        request here ends, instead of failing a request whose client may already have its
        first token."""
        rid = req.request_id
        if rid in self._requests:
            raise ValueError(f"request {rid} is already in the scheduler")
        if not 0 < num_kv_tokens <= req.num_tokens:
            raise ValueError(f"request {rid}: num_kv_tokens={num_kv_tokens} of {req.num_tokens}")
        limit = self.admission.hard_limit(req)
        if limit is not None:
            self._requests[rid] = req
            return self._reject(req, limit)
        if len(self._running) >= self.config.max_num_seqs:
            raise NoRoom(f"request {rid}: all {self.config.max_num_seqs} batch slots are taken")
        if self.admission.reserve(req, allow_degrade=False) is None:
            raise NoRoom(f"request {rid}: {self.admission.no_fit(req)}")
        if self.kv.allocate_slots(req, num_kv_tokens, cache=False) is None:
            self.kv.free(rid)  # the reservation just made
            self.admission.forget(rid)
            raise NoRoom(f"request {rid}: {self.kv.blocks_for(num_kv_tokens)} KV blocks not free")
        self._requests[rid] = req
        req.num_computed_tokens = num_kv_tokens
        req.times.queued = req.times.first_scheduled = self.clock()
        req.transition(S.WAITING_FOR_KV)
        self._running.append(req)
        return AdmissionResult(S.WAITING_FOR_KV)

    def kv_ready(self, request_id: str) -> None:
        """The imported KV is written and verified, and the token sampled after it appended:
        cache its full blocks and decode."""
        req = self._requests.get(request_id)
        if req is None or req.is_finished:
            return  # ended (cancel, deadline) while the KV was in flight
        if req.status is not S.WAITING_FOR_KV or req.num_computed_tokens >= req.num_tokens:
            raise ValueError(f"kv_ready: request {request_id} is {req.status.name} with no token")
        self.kv.cache_computed(req)
        req.transition(S.DECODING)

    def _reject(self, req: Request, reason: str) -> AdmissionResult:
        self.finish_request(req.request_id, FinishReason.REJECTED, error=reason)
        self.reclaim(req.request_id)
        return AdmissionResult(S.REJECTED, reason)

    # -- one tick (docs/design.md#scheduler-tick) --

    def schedule(self) -> SchedulerOutput:
        """Reclaim, schedule running requests, resume swapped ones, admit waiting ones."""
        now = self.clock()
        expired = [
            r.request_id
            for r in self._requests.values()
            if r.deadline is not None and now >= r.deadline and not r.is_finished
        ]
        for rid in expired:
            self.finish_request(rid, FinishReason.DEADLINE)
        for rid in list(self._ended):
            self.reclaim(rid)

        out = SchedulerOutput()
        scheduled: dict[str, int] = {}  # request id -> new tokens; insertion order = row order
        preempted = self._schedule_running(out, scheduled)
        if not preempted:
            self._resume_swapped(out, scheduled)
            if not self._swapped:  # swapped requests hold host KV: they go before new ones
                self._admit_waiting(scheduled, now)

        for rid, n in scheduled.items():
            req = self._requests[rid]
            if req.status is S.RUNNABLE:
                req.transition(S.PREFILLING)
            start = req.num_computed_tokens
            drafts = self._drafts.get(rid, [])
            out.chunks.append(
                ScheduledChunk(
                    request_id=rid,
                    token_ids=token_slice(req, start, start + n - len(drafts)) + drafts,
                    start_pos=start,
                    block_table=self.kv.block_table(rid),
                    sample=start + n - len(drafts) == req.num_tokens,
                    all_logits=req.needs_prompt_logits,
                    num_drafts=len(drafts),
                )
            )
        self._drafts = {}
        out.copy_blocks = self.kv.take_pending_copies()
        self._in_flight = set(scheduled)
        return out

    def _chunk_size(self, req: Request, num_seqs: int, num_tokens: int) -> int:
        """Tokens ``req`` may compute this step, given ``num_seqs`` sequences and ``num_tokens``
        tokens already in it: 0 when it (or its whole prompt) does not fit."""
        if num_seqs >= self.config.max_num_seqs:
            return 0
        remaining = req.num_tokens - req.num_computed_tokens
        budget = self.config.max_num_batched_tokens - num_tokens
        if remaining > budget and not self.config.enable_chunked_prefill:
            return 0
        return min(remaining, budget)

    def _schedule_running(self, out: SchedulerOutput, scheduled: dict[str, int]) -> bool:
        """Give every running request its next chunk; returns whether anything was preempted."""
        # Plan in running order, which is admission order: a partial prefill chunk always takes
        # the rest of the budget, so nothing joins behind it and decodes never wait for one.
        plan: dict[str, int] = {}
        planned: list[Request] = []
        num_tokens = 0
        for req in self._running:
            if req.status in _STEPPING:
                n = self._chunk_size(req, len(plan), num_tokens)
                if n:
                    plan[req.request_id] = n
                    planned.append(req)
                    num_tokens += n
        # Drafts only from the budget the real tokens left: a guess never delays a token.
        for req in planned if self.drafter is not None else ():
            drafted = self._draft(req, plan[req.request_id], num_tokens)
            plan[req.request_id] += drafted
            num_tokens += drafted
        # Allocate the most important first. A victim is then never a request that already
        # got blocks this step: those blocks may be hashed for the prefix cache already, and
        # dropping the chunk would leave cached blocks whose KV is never computed.
        preempted: set[str] = set()
        for req in sorted(planned, key=self._victim_key):
            if req.request_id in preempted:
                continue  # preempted as a victim earlier in this loop
            n = plan[req.request_id]
            if req.request_id in self._drafts:
                if self.kv.allocate_slots(req, n) is not None:
                    scheduled[req.request_id] = n
                    continue
                # Drafts only take free blocks: never preempt anyone for a guess.
                n -= len(self._drafts.pop(req.request_id))
            while self.kv.allocate_slots(req, n) is None:
                victim = self._pick_victim(req, scheduled)
                if victim is None:
                    # Alone and still short: the whole pool cannot hold this sequence.
                    error = f"the KV pool cannot hold {req.num_computed_tokens + n} tokens"
                    self.finish_request(req.request_id, FinishReason.ERROR, error=error)
                    break
                self._preempt(victim, out)
                preempted.add(victim.request_id)
                if victim is req:
                    break
            else:
                scheduled[req.request_id] = n
        return bool(preempted)

    def _draft(self, req: Request, n: int, num_tokens: int) -> int:
        """Propose drafts for a decoding request's step of ``n`` (its one new token), the step
        holding ``num_tokens`` so far; returns how many it got. Bounded by the budget left and
        so that the verification never writes KV at a position a plain decode would not reach
        (the last token below ``max_tokens`` and the context limit is never computed)."""
        if (
            self.drafter is None
            or self.config.speculative is None
            or n != 1
            or req.status is not S.DECODING
            or len(self._running) > self.config.speculative.max_batch
        ):
            return 0
        most = min(
            req.sampling_params.max_tokens - len(req.output_token_ids) - 1,
            self.max_model_len - req.num_tokens - 1,
            self.config.max_num_batched_tokens - num_tokens,
        )
        drafts = self.drafter(req, most) if most > 0 else []
        if drafts:
            self._drafts[req.request_id] = drafts
        return len(drafts)

    def _victim_key(self, r: Request) -> tuple[bool, int, float]:
        """Larger is preempted first: backpressured, then lowest priority, then latest arrival."""
        by_priority = self.config.scheduling_policy == "priority"
        return (r.status is S.BACKPRESSURED, r.priority if by_priority else 0, r.arrival_time)

    def _pick_victim(self, req: Request, scheduled: dict[str, int]) -> Request | None:
        """The request to preempt so ``req`` can grow (docs/design.md#preemption); None if ``req``
        is alone.

        Another request is preferred; ``req`` itself is returned only when every other one is
        more important, or already has its blocks for this step.
        """
        # A request waiting for KV is never a victim: a transfer is writing into its blocks.
        others = [
            r
            for r in self._running
            if r is not req and not r.is_finished and r.status is not S.WAITING_FOR_KV
        ]
        if not others:
            return None
        # Reversed: on a tie, max() keeps the first seen, i.e. the one admitted last.
        candidates = [r for r in reversed(others) if r.request_id not in scheduled]
        victim = max(candidates, key=self._victim_key, default=None)
        if victim is None or self._victim_key(victim) < self._victim_key(req):
            return req
        return victim

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        """Really free the victim's device blocks: swap them out, else drop and recompute."""
        rid = victim.request_id
        self._running.remove(victim)
        victim.num_preemptions += 1
        out.preempted_ids.append(rid)
        pairs = self.kv.swap_out(rid) if self.config.preemption_mode == "swap" else None
        if pairs is not None:
            out.swap_out.extend(pairs)
            victim.transition(S.SWAPPED)
            # Kept in arrival order, so they come back oldest first (victims go newest first).
            bisect.insort(self._swapped, victim, key=lambda r: r.arrival_time)
            return
        self.kv.free(rid)  # also drops the reservation; it is taken again on resume
        self.admission.forget(rid)
        victim.num_computed_tokens = 0
        victim.transition(S.PREEMPTED)
        self._waiting.insert(0, victim)

    def _resume_swapped(self, out: SchedulerOutput, scheduled: dict[str, int]) -> None:
        """Swap requests back in, oldest first, when their KV and next chunk both fit."""
        pool = self.kv.pool
        while self._swapped and len(self._running) < self.config.max_num_seqs:
            req = self._swapped[0]
            n = self._chunk_size(req, len(scheduled), sum(scheduled.values()))
            # Room for every block up to the chunk's end, else it would be swapped straight out.
            room = pool.num_free + pool.num_cached >= self.kv.blocks_for(
                req.num_computed_tokens + n
            )
            pairs = self.kv.swap_in(req.request_id) if n and room else None
            if pairs is None:
                return
            self._swapped.pop(0)
            out.swap_in.extend(pairs)
            req.transition(S.RUNNABLE)
            self._running.append(req)
            if self.kv.allocate_slots(req, n) is not None:
                scheduled[req.request_id] = n

    def _admit_waiting(self, scheduled: dict[str, int], now: float) -> None:
        """Turn reservations into device blocks in policy order; within a priority level
        preempted requests go first, then arrival order (the list is kept in add order)."""
        if self.config.batching == "static" and self._running:
            return  # static batching refills only once the whole batch is done
        by_priority = self.config.scheduling_policy == "priority"
        self._waiting.sort(
            key=lambda r: (r.priority if by_priority else 0, r.status is not S.PREEMPTED)
        )
        reservations_blocked = False
        for req in list(self._waiting):
            if len(self._running) >= self.config.max_num_seqs:
                return
            rid = req.request_id
            if not self.admission.holds(rid):
                # Once one reservation fails, later ones may not overtake it.
                if reservations_blocked or self.admission.reserve(req) is None:
                    reservations_blocked = True
                    continue
            computed, num_cached = self.kv.get_computed_blocks(req)
            req.num_computed_tokens = num_cached
            n = self._chunk_size(req, len(scheduled), sum(scheduled.values()))
            if n == 0 or self.kv.allocate_slots(req, n, computed) is None:
                req.num_computed_tokens = 0
                return  # FCFS: nobody behind overtakes the head on blocks or budget
            self._waiting.remove(req)
            req.transition(S.RUNNABLE)
            self._running.append(req)
            scheduled[rid] = n
            if req.times.first_scheduled is None:
                req.times.first_scheduled = now

    # -- after the forward (tick steps 5 and 7) --

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance computed tokens, append sampled ones, apply token-level stops.

        Args: ``out`` from the last schedule(); ``sampled`` maps each sampling request id to
        its new token. Returns the requests that got a token (the engine detokenises them).
        """
        self._in_flight = set()
        got: list[Request] = []
        for chunk in out.chunks:
            parent = self._requests.get(chunk.request_id)
            # Children forked during this step ride on their parent's chunk.
            riders = self._riders.pop(chunk.request_id, ()) if self._riders else ()
            for req in (parent, *riders):
                if req is None or req.is_finished:
                    continue  # ended while the step ran; its token is dropped
                # Drafts' KV counts only once they are accepted (accept_draft).
                req.num_computed_tokens = chunk.start_pos + len(chunk.token_ids) - chunk.num_drafts
                if chunk.sample:
                    self._append(req, sampled[req.request_id])
                    got.append(req)
        return got

    def accept_draft(self, request_id: str, token: int) -> bool:
        """Speculation: the request's last token equals the draft verified after it, so that
        draft's KV (computed by the step) is its KV; count it and append ``token``, the token
        sampled from the draft's row. False, changing nothing, when the request may not take
        one more token now (it ended, or its client is behind)."""
        req = self._requests.get(request_id)
        if req is None or req.status is not S.DECODING:
            return False
        if req.num_computed_tokens != req.num_tokens - 1:
            raise ValueError(f"accept_draft: request {request_id} has no token awaiting its KV")
        req.num_computed_tokens += 1
        self._append(req, token)
        return True

    def end_verification(self, request_id: str) -> None:
        """The request's drafts are settled: free the KV written for the rejected ones."""
        req = self._requests.get(request_id)
        if req is not None and not req.is_finished:
            self.kv.rollback(req)

    def _append(self, req: Request, token: int) -> None:
        """Commit one sampled token and apply the token-level stops (tick step 7)."""
        req.output_token_ids.append(token)
        req.num_generated += 1
        if req.status is S.PREFILLING:
            req.transition(S.DECODING)
        reason = self._stop_reason(req, token)
        if reason is None and req.prefill_only:
            reason = FinishReason.HANDED_OFF
        if reason is not None:
            self.finish_request(req.request_id, reason)
        elif req.request_id in self._backpressured and req.status is S.DECODING:
            req.transition(S.BACKPRESSURED)

    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        sp = req.sampling_params
        num_out = len(req.output_token_ids)
        if num_out >= sp.min_tokens:
            if token in req.eos_token_ids and not sp.ignore_eos:
                return FinishReason.EOS
            if token in sp.stop_token_ids:
                return FinishReason.STOP_TOKEN
        if num_out >= sp.max_tokens:
            return FinishReason.MAX_TOKENS
        if req.num_tokens >= self.max_model_len:
            return FinishReason.CONTEXT_LIMIT
        return None

    # -- ending (docs/design.md#cleanup) --

    def finish_request(
        self, request_id: str, reason: FinishReason, error: str | None = None
    ) -> None:
        """Mark a live request terminal; its KV is reclaimed next tick. Repeats are no-ops."""
        req = self._requests.get(request_id)
        if req is None or req.is_finished:
            return
        req.transition(reason.status)
        req.finish_reason = reason
        req.error = error
        req.times.finished = self.clock()
        self._ended.append(request_id)

    def abort(self, request_id: str) -> None:
        """Client cancel or disconnect."""
        self.finish_request(request_id, FinishReason.CANCELLED)

    def reclaim(self, request_id: str) -> TerminalRecord | None:
        """THE one reclaim routine: free KV, release the slot, write exactly one record.

        Idempotent: returns None, changing nothing, for a request already reclaimed (or
        unknown). Raises ValueError for a request that has not ended.
        """
        req = self._requests.get(request_id)
        if req is None:
            return None
        if req.finish_reason is None or req.times.finished is None:
            raise ValueError(f"reclaim of live request {request_id} ({req.status.name})")
        if req.finish_reason is FinishReason.HANDED_OFF:
            self.kv.lease(request_id)  # the blocks go on to a decode worker; freed on release
        else:
            self.kv.free(request_id)
        for queue in (self._running, self._waiting, self._swapped):
            if req in queue:
                queue.remove(req)
        del self._requests[request_id]
        self._ended.remove(request_id)
        self.admission.forget(request_id)
        self._backpressured.discard(request_id)
        req.record = TerminalRecord(
            request_id=request_id,
            status=req.status,
            finish_reason=req.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_generated=req.num_generated,
            num_committed=len(req.output_token_ids),
            num_emitted=req.num_emitted,
            arrival=req.arrival_time,
            first_token=req.times.first_token,
            finished=req.times.finished,
            error=req.error,
            queue_time_s=metrics.queue_time(req.times),
            speculation=replace(req.speculation) if req.speculation.num_steps else None,
        )
        self.records.append(req.record)
        return req.record

    # -- n > 1, backpressure, queries --

    def fork(self, parent_id: str, n_children: int) -> list[Request]:
        """Children ``<parent>#1`` .. ``#n_children`` share the parent's KV blocks (CoW).

        The parent is sample 0, so the engine calls this with ``n - 1`` once the parent's
        first token is sampled: either after update_from_output (children copy that token),
        or between schedule() and update_from_output, when the children ride on the parent's
        chunk and ``sampled`` must hold a token for each of them too.
        """
        parent = self._requests[parent_id]
        if parent not in self._running:
            raise ValueError(f"fork: parent {parent_id} is not running")
        children = []
        for i in range(1, n_children + 1):
            child = Request(
                request_id=fork_id(parent_id, i),
                prompt_token_ids=list(parent.prompt_token_ids),
                sampling_params=parent.sampling_params,
                arrival_time=parent.arrival_time,
                priority=parent.priority,
                deadline=parent.deadline,
                cache_salt=parent.cache_salt,
                eos_token_ids=parent.eos_token_ids,
                parent_id=parent_id,
                index=i,
            )
            child.output_token_ids = list(parent.output_token_ids)
            child.num_generated = parent.num_generated
            child.num_computed_tokens = parent.num_computed_tokens
            child.times.queued = parent.times.queued
            child.times.first_scheduled = parent.times.first_scheduled
            path = [S.RUNNABLE, S.PREFILLING]
            if child.num_generated:
                path.append(S.DECODING)  # the parent's first token is already in
            for status in path:
                child.transition(status)
            self.kv.fork(parent_id, child.request_id)
            self._requests[child.request_id] = child
            children.append(child)
        # Right behind the parent, so they stay ahead of any partial prefill admitted later.
        at = self._running.index(parent) + 1
        self._running[at:at] = children
        if parent_id in self._in_flight:
            self._riders[parent_id] = children
        return children

    def set_backpressured(self, request_id: str, on: bool) -> None:
        """Pause (``on``) or resume generation for a request whose client reads slowly.

        A paused request keeps its KV (descheduling frees no memory) and is the first
        preemption victim. A request paused before it decodes pauses at its next token.
        """
        req = self._requests.get(request_id)
        if req is None or req.is_finished:
            return
        if on:
            self._backpressured.add(request_id)
            if req.status is S.DECODING:
                req.transition(S.BACKPRESSURED)
        else:
            self._backpressured.discard(request_id)
            if req.status is S.BACKPRESSURED:
                req.transition(S.DECODING)

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    @property
    def num_waiting(self) -> int:
        """Requests without device KV: queued, degraded, preempted and swapped."""
        return len(self._waiting) + len(self._swapped)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def has_unfinished(self) -> bool:
        """True while any request is live or still awaits reclaim (so keep ticking)."""
        return bool(self._requests)
