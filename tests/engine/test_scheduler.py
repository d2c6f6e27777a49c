"""Step-driven scheduler tests (docs/design.md: #scheduler-tick, #admission, #cleanup, #preemption).

No model: a fake runner returns the sampled token per request. The default runner samples
``100 + position`` (the position the new token will take), so every output is known exactly.
Every test ends with the leak check: pools back to baseline, one record per request.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.admission import NoRoom
from engine.batch import SchedulerOutput
from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import FinishReason, Request, RequestStatus, TerminalRecord
from engine.sampling_params import SamplingParams
from engine.scheduler import AdmissionResult, Scheduler

S = RequestStatus
Runner = Callable[[Request], int]


def position_runner(req: Request) -> int:
    return 100 + req.num_tokens


def batched_tokens(out: SchedulerOutput) -> int:
    """Tokens the step's forward runs (its chunks' together)."""
    return sum(len(c.token_ids) for c in out.chunks)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Harness:
    """Plays the engine: schedule, check the output, 'run' it, feed tokens back."""

    def __init__(
        self,
        num_blocks: int = 16,
        *,
        block_size: int = 4,
        num_host_blocks: int = 0,
        prefix_caching: bool = True,
        max_model_len: int = 64,
        **config: Any,
    ) -> None:
        self.clock = Clock()
        self.config = EngineConfig(block_size=block_size, **config)
        self.kv = KVCacheManager(
            num_blocks,
            block_size,
            num_host_blocks=num_host_blocks,
            enable_prefix_caching=prefix_caching,
        )
        self.sched = Scheduler(self.config, self.kv, max_model_len, clock=self.clock)
        self.reqs: dict[str, Request] = {}
        self.outputs: list[SchedulerOutput] = []

    def add(
        self, rid: str, prompt: list[int] | int, max_tokens: int = 4, **kw: Any
    ) -> AdmissionResult:
        tokens = list(range(1, prompt + 1)) if isinstance(prompt, int) else prompt
        sp_keys = {"min_tokens", "ignore_eos", "stop_token_ids", "n", "prompt_logprobs"}
        sp = SamplingParams(max_tokens=max_tokens, **{k: kw.pop(k) for k in sp_keys & kw.keys()})
        kw.setdefault("arrival_time", self.clock.t)
        req = Request(rid, tokens, sp, **kw)
        self.reqs[rid] = req
        return self.sched.add_request(req)

    def step(self, runner: Runner = position_runner) -> SchedulerOutput:
        """One tick. An n > 1 request forks n - 1 children when its first token is sampled,
        between schedule() and update_from_output(), as the engine does."""
        out = self.sched.schedule()
        self.check(out)
        self.outputs.append(out)
        ids = out.sampled_ids
        for rid in list(ids):
            parent = self.reqs[rid]
            if parent.sampling_params.n > 1 and not parent.output_token_ids and "#" not in rid:
                for child in self.sched.fork(rid, parent.sampling_params.n - 1):
                    self.reqs[child.request_id] = child
                    ids.append(child.request_id)
        sampled = {rid: runner(self.reqs[rid]) for rid in ids}
        for req in self.sched.update_from_output(out, sampled):
            req.times.emits.append(self.clock.t)
        return out

    def check(self, out: SchedulerOutput) -> None:
        """Limits hold and every chunk is exactly the next uncomputed tokens of its request."""
        assert len(out.chunks) <= self.config.max_num_seqs
        assert batched_tokens(out) <= self.config.max_num_batched_tokens
        assert len({c.request_id for c in out.chunks}) == len(out.chunks)
        for c in out.chunks:
            req = self.reqs[c.request_id]
            assert c.start_pos == req.num_computed_tokens
            assert c.token_ids == req.all_token_ids[c.start_pos : c.start_pos + len(c.token_ids)]
            assert c.sample == (c.start_pos + len(c.token_ids) == req.num_tokens)
            assert len(c.block_table) == self.kv.blocks_for(c.start_pos + len(c.token_ids))
            assert c.block_table == self.kv.block_table(c.request_id)
        if any(len(c.token_ids) > 1 for c in out.chunks):  # decodes go first
            waiting_decodes = [r for r in self.reqs.values() if r.status is S.DECODING]
            assert {r.request_id for r in waiting_decodes} <= {c.request_id for c in out.chunks}
        self.kv.check()

    def run(self, runner: Runner = position_runner, max_steps: int = 200) -> int:
        """Step until every request has ended and been reclaimed; returns the step count."""
        for n in range(max_steps):
            if not self.sched.has_unfinished:
                return n
            self.step(runner)
        raise AssertionError("scheduler did not drain")

    def assert_drained(self) -> None:
        """THE leak check: no request left, one record each, every pool count at baseline."""
        while self.sched.has_unfinished:
            assert not self.step().chunks, "drain only reclaims"
        ids = [r.request_id for r in self.sched.records]
        assert sorted(ids) == sorted(self.reqs) and len(set(ids)) == len(ids)
        self.kv.check()
        st_ = self.kv.stats()
        assert st_.in_use_blocks == 0 and st_.reserved_blocks == 0
        assert st_.free_blocks + st_.cached_blocks == st_.total_blocks
        assert st_.host_free_blocks == st_.host_total_blocks
        assert st_.logical_slots == 0 and st_.allocated_slots == 0
        assert self.sched.num_running == 0 and self.sched.num_waiting == 0

    def record(self, rid: str) -> TerminalRecord:
        (rec,) = [r for r in self.sched.records if r.request_id == rid]
        return rec

    def outputs_of(self, rid: str) -> list[int]:
        return self.reqs[rid].output_token_ids


def expected_tokens(prompt_len: int, n: int) -> list[int]:
    return [100 + prompt_len + i for i in range(n)]


# -- continuous vs static batching (docs/design.md#scheduler-tick) --


def batching_trace(batching: str, needs: dict[str, int]) -> tuple[dict[str, int], list[int]]:
    """Completion tick per request and sequences per tick; every request arrives at t=0."""
    h = Harness(max_num_seqs=2, batching=batching)
    for i, (rid, n) in enumerate(needs.items()):
        h.add(rid, [10 * (i + 1), 10 * (i + 1) + 1], max_tokens=n)
    completion: dict[str, int] = {}
    slots: list[int] = []
    while h.sched.has_unfinished:
        out = h.step()
        if not out.chunks:
            continue  # the final reclaim-only call is not a tick
        slots.append(len(out.chunks))
        for c in out.chunks:
            if h.reqs[c.request_id].is_finished:
                completion[c.request_id] = len(slots)
    h.assert_drained()
    for rid, n in needs.items():
        assert h.record(rid).num_generated == n
    return completion, slots


def test_d04_continuous_batching_refills_freed_slots() -> None:
    comp_cont, slots_cont = batching_trace("continuous", {"A": 1, "B": 4, "C": 1})
    comp_static, slots_static = batching_trace("static", {"A": 1, "B": 4, "C": 1})
    assert comp_cont == {"A": 1, "C": 2, "B": 4}
    assert comp_static == {"A": 1, "B": 4, "C": 5}
    assert slots_cont == [2, 2, 1, 1] and slots_static == [2, 1, 1, 1, 1]
    # slot utilisation = sequences serviced / (capacity * makespan), from the step trace
    assert sum(slots_static) / (2 * len(slots_static)) == pytest.approx(0.60)
    assert sum(slots_cont) / (2 * len(slots_cont)) == pytest.approx(0.75)


def test_d04_equal_lengths_give_equal_makespan() -> None:
    comp_cont, _ = batching_trace("continuous", {"A": 3, "B": 3})
    comp_static, _ = batching_trace("static", {"A": 3, "B": 3})
    assert comp_cont == comp_static == {"A": 3, "B": 3}


# -- chunked prefill: decode ITL vs the long prompt's own TTFT (docs/design.md#scheduler-tick) --


def chunked_prefill_trace(chunked: bool) -> tuple[float, float]:
    """Cost model: a step of T batched tokens takes ceil(T / 4) time units.

    D (3-token prompt) is decoding when L (10-token prompt) arrives at t=1. Unchunked, one
    step carries D's decode + all of L (11 tokens, 3 units); chunked with a 4-token budget,
    every step is <= 4 tokens (1 unit) and L's prefill spreads over 4 steps (3+3+3+1).
    Returns (D's max inter-token gap, L's TTFT).
    """
    budget = 4 if chunked else 16
    h = Harness(enable_chunked_prefill=chunked, max_num_batched_tokens=budget)

    def timed_step() -> None:
        out = h.sched.schedule()
        h.check(out)
        h.clock.t += math.ceil(batched_tokens(out) / 4)  # the step ends: tokens emit now
        sampled = {rid: position_runner(h.reqs[rid]) for rid in out.sampled_ids}
        for req in h.sched.update_from_output(out, sampled):
            req.times.emits.append(h.clock.t)

    h.add("D", [7, 8, 9], max_tokens=6)
    timed_step()
    assert h.clock.t == 1.0 and h.reqs["D"].times.emits == [1.0]
    h.add("L", list(range(20, 30)), max_tokens=2)
    while h.sched.has_unfinished:
        timed_step()
    h.assert_drained()
    d, long = h.reqs["D"], h.reqs["L"]
    assert d.output_token_ids == expected_tokens(3, 6)
    assert long.output_token_ids == expected_tokens(10, 2)
    gaps = [b - a for a, b in zip(d.times.emits, d.times.emits[1:], strict=False)]
    return max(gaps), long.times.emits[0] - long.arrival_time


def test_d05_chunked_prefill_trades_long_prompt_ttft_for_decode_itl() -> None:
    assert chunked_prefill_trace(chunked=False) == (3.0, 3.0)
    assert chunked_prefill_trace(chunked=True) == (1.0, 4.0)


# -- chunked prefill, prefix cache, admission order --


def test_chunked_prefill_splits_mid_block() -> None:
    h = Harness(max_num_batched_tokens=3)
    h.add("A", 10, max_tokens=2)
    chunks = [h.step().chunks[0] for _ in range(5)]
    assert [(c.start_pos, len(c.token_ids), c.sample) for c in chunks] == [
        (0, 3, False),
        (3, 3, False),
        (6, 3, False),
        (9, 1, True),
        (10, 1, True),
    ]
    assert [len(c.block_table) for c in chunks] == [1, 2, 3, 3, 3]
    assert chunks[0].block_table == chunks[3].block_table[:1]  # the table only grows
    assert chunks[3].token_ids == [10] and chunks[4].token_ids == [110]
    h.assert_drained()
    assert h.outputs_of("A") == [110, 111]


def test_without_chunking_a_prompt_runs_whole_or_not_at_all() -> None:
    h = Harness(enable_chunked_prefill=False, max_num_batched_tokens=8)
    h.add("A", 6, max_tokens=2)
    h.add("B", [9, 8, 7, 6, 5, 4], max_tokens=2)
    first = h.step()
    assert [(c.request_id, len(c.token_ids)) for c in first.chunks] == [("A", 6)]
    second = h.step()
    assert [(c.request_id, len(c.token_ids)) for c in second.chunks] == [("A", 1), ("B", 6)]
    h.run()
    h.assert_drained()
    assert h.outputs_of("B") == expected_tokens(6, 2)


def test_prefix_hits_partial_full_and_other_tenant() -> None:
    h = Harness()
    h.add("X", list(range(1, 11)), max_tokens=1)  # blocks [1..4] [5..8] become cached
    h.run()
    x_table = h.outputs[0].chunks[0].block_table
    h.add("partial", [1, 2, 3, 4, 60, 61, 62], max_tokens=1)
    h.add("full", list(range(1, 9)), max_tokens=1)
    h.add("tenant", list(range(1, 9)), max_tokens=1, cache_salt="other")
    out = h.step()
    got = {c.request_id: (c.start_pos, c.token_ids, c.sample) for c in out.chunks}
    assert got == {
        "partial": (4, [60, 61, 62], True),
        # full hit: the last prompt token is still computed, its logits sample
        "full": (4, [5, 6, 7, 8], True),
        "tenant": (0, list(range(1, 9)), True),
    }
    tables = {c.request_id: c.block_table for c in out.chunks}
    assert tables["partial"][0] == tables["full"][0] == x_table[0]
    assert x_table[0] not in tables["tenant"]
    h.run()
    h.assert_drained()
    assert h.outputs_of("full") == [108] and h.outputs_of("partial") == [107]


@pytest.mark.parametrize(
    ("policy", "order"), [("fcfs", ["R1", "R2", "R3"]), ("priority", ["R2", "R3", "R1"])]
)
def test_admission_order_fcfs_vs_priority(policy: str, order: list[str]) -> None:
    h = Harness(max_num_seqs=1, scheduling_policy=policy)
    for i, (rid, prio) in enumerate([("R1", 5), ("R2", 0), ("R3", 1)]):
        h.clock.t = float(i)
        h.add(rid, [i + 1, 9], max_tokens=2, priority=prio)
    h.run()
    started = []
    for out in h.outputs:
        for c in out.chunks:
            if c.start_pos == 0:
                started.append(c.request_id)
    assert started == order
    h.assert_drained()


# -- preemption (docs/design.md#preemption) --


def grow_two(h: Harness) -> None:
    """A and B, 8-token prompts predicted to stop at once, grow until blocks run out."""
    h.add("A", list(range(1, 9)), max_tokens=8)
    h.clock.t = 1.0
    h.add("B", list(range(11, 19)), max_tokens=8)
    assert h.kv.stats().reserved_blocks == 6  # 3 + 3: both reservations fit the 6 blocks


def test_preemption_by_recompute_restarts_at_zero() -> None:
    h = Harness(6, prefix_caching=False, admission_output_tokens=0)
    grow_two(h)
    for _ in range(6):
        h.step()
    out = h.outputs[-1]
    # step 6: A needs a 5th block for position 12, none free: B (later arrival) is the victim
    assert out.preempted_ids == ["B"] and out.swap_out == []
    assert [c.request_id for c in out.chunks] == ["A"]
    b = h.reqs["B"]
    assert b.status is S.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert b.output_token_ids == expected_tokens(8, 5)
    assert h.kv.num_held_blocks("B") == 0
    h.run()
    resumed = [c for o in h.outputs[6:] for c in o.chunks if c.request_id == "B"][0]
    assert resumed.start_pos == 0 and resumed.sample
    assert resumed.token_ids == b.prompt_token_ids + expected_tokens(8, 5)
    h.assert_drained()
    assert h.outputs_of("A") == expected_tokens(8, 8)
    assert h.outputs_of("B") == expected_tokens(8, 8)
    assert h.record("B").num_generated == 8 and h.record("B").status is S.FINISHED


def swap_until_b_is_preempted(num_host_blocks: int) -> tuple[Harness, SchedulerOutput]:
    """A and B grow in a 6-block pool under swap preemption until B is the victim."""
    h = Harness(
        6,
        num_host_blocks=num_host_blocks,
        prefix_caching=False,
        admission_output_tokens=0,
        preemption_mode="swap",
    )
    grow_two(h)
    for _ in range(6):
        h.step()
    return h, h.outputs[-1]


def test_preemption_by_swap_keeps_computed_tokens() -> None:
    h, out = swap_until_b_is_preempted(num_host_blocks=8)
    b_blocks = h.outputs[-2].chunks[1].block_table
    assert out.preempted_ids == ["B"]
    assert [d for d, _ in out.swap_out] == b_blocks and len(b_blocks) == 3
    b = h.reqs["B"]
    assert b.status is S.SWAPPED and b.num_computed_tokens == 12
    assert h.kv.stats().host_free_blocks == 5
    host_blocks = [hb for _, hb in out.swap_out]
    h.run()
    swap_ins = [(i, o) for i, o in enumerate(h.outputs) if o.swap_in]
    assert len(swap_ins) == 1
    i, o = swap_ins[0]
    assert [hb for hb, _ in o.swap_in] == host_blocks
    (chunk,) = [c for c in o.chunks if c.request_id == "B"]
    assert i == 8  # after A finished at step 8 and was reclaimed
    assert chunk.start_pos == 12 and chunk.token_ids == [112]  # no recompute
    assert h.outputs_of("B") == expected_tokens(8, 8) and b.num_preemptions == 1
    h.assert_drained()


def test_swap_falls_back_to_recompute_when_host_pool_is_full() -> None:
    h, out = swap_until_b_is_preempted(num_host_blocks=2)
    assert out.preempted_ids == ["B"] and out.swap_out == []
    assert h.reqs["B"].status is S.PREEMPTED and h.reqs["B"].num_computed_tokens == 0
    h.run()
    h.assert_drained()
    assert h.outputs_of("B") == expected_tokens(8, 8)


def test_swapped_request_resumes_before_new_admissions() -> None:
    h = Harness(
        7,
        num_host_blocks=8,
        prefix_caching=False,
        admission_output_tokens=0,
        preemption_mode="swap",
        max_num_seqs=2,
    )
    grow_two(h)
    h.clock.t = 2.0
    h.add("C", [31, 32], max_tokens=1)  # reserved, but the two slots are taken
    assert h.kv.stats().reserved_blocks == 7
    for _ in range(6):
        h.step()
    # A takes the last block; B, the later arrival, is short and steps back itself
    out = h.outputs[-1]
    assert out.preempted_ids == ["B"] and [c.request_id for c in out.chunks] == ["A"]
    # only blocks holding computed KV move: the victim got no new block this step
    assert [d for d, _ in out.swap_out] == h.outputs[-2].chunks[1].block_table
    h.run()
    firsts = {
        rid: min(i for i, o in enumerate(h.outputs) for c in o.chunks if c.request_id == rid)
        for rid in "AC"
    }
    swap_in_step = next(i for i, o in enumerate(h.outputs) if o.swap_in)
    # a slot is free from step 7 on, but C waits until the swapped B is back (step 9)
    assert firsts == {"A": 0, "C": swap_in_step} and swap_in_step == 8
    assert len([o for o in h.outputs if o.swap_out]) == 1  # no swap ping-pong
    h.assert_drained()
    assert h.outputs_of("B") == expected_tokens(8, 8)
    assert h.outputs_of("C") == [102]


@pytest.mark.parametrize(("policy", "victim"), [("fcfs", "B"), ("priority", "A")])
def test_victim_is_latest_arrival_or_lowest_priority(policy: str, victim: str) -> None:
    h = Harness(5, scheduling_policy=policy, admission_output_tokens=0)
    h.add("A", [1, 2, 3, 4], max_tokens=8, priority=5)
    h.step()
    h.clock.t = 1.0
    h.add("B", [11, 12, 13, 14, 15], max_tokens=6, priority=0)
    for _ in range(4):
        out = h.step()
        assert out.preempted_ids == []
    # A and B both need a third block and one is free: the more important one gets it,
    # the other is preempted before any block of this step was given to it
    out = h.step()
    survivor = "A" if victim == "B" else "B"
    assert out.preempted_ids == [victim]
    assert [c.request_id for c in out.chunks] == [survivor]
    v = h.reqs[victim]
    assert v.status is S.PREEMPTED and v.num_computed_tokens == 0 and v.num_preemptions == 1
    assert h.reqs[survivor].num_preemptions == 0
    h.run()
    h.assert_drained()
    assert h.outputs_of("A") == expected_tokens(4, 8)
    assert h.outputs_of("B") == expected_tokens(5, 6)


def test_backpressured_request_is_descheduled_keeps_kv_and_is_first_victim() -> None:
    h = Harness(7, admission_output_tokens=0)
    for i, rid in enumerate("ABC"):
        h.clock.t = float(i)
        h.add(rid, [10 * i + 1, 10 * i + 2, 10 * i + 3, 10 * i + 4], max_tokens=8)
    h.step()
    h.step()
    h.sched.set_backpressured("A", True)
    assert h.reqs["A"].status is S.BACKPRESSURED
    in_use = h.kv.stats().in_use_blocks
    assert h.kv.num_held_blocks("A") == 2 and in_use == 6
    for _ in range(3):
        out = h.step()
        assert [c.request_id for c in out.chunks] == ["B", "C"]
        assert h.kv.num_held_blocks("A") == 2  # descheduling frees nothing
    out = h.step()  # B takes the last block at position 8; C is short: A is the victim
    assert out.preempted_ids == ["A"] and [c.request_id for c in out.chunks] == ["B", "C"]
    assert h.reqs["A"].status is S.PREEMPTED
    h.sched.set_backpressured("A", False)
    h.run()
    h.assert_drained()
    for rid, i in zip("ABC", range(3), strict=True):
        assert h.outputs_of(rid) == expected_tokens(4, 8), (rid, i)


def test_backpressure_on_and_off() -> None:
    h = Harness()
    h.add("A", 4, max_tokens=5)
    h.add("B", 4, max_tokens=5)
    h.step()
    h.sched.set_backpressured("B", True)
    assert [c.request_id for c in h.step().chunks] == ["A"]
    assert h.reqs["B"].status is S.BACKPRESSURED and h.sched.num_running == 2
    h.sched.set_backpressured("B", False)
    assert h.reqs["B"].status is S.DECODING
    assert [c.request_id for c in h.step().chunks] == ["A", "B"]
    h.run()
    h.assert_drained()
    assert h.outputs_of("B") == expected_tokens(4, 5)


def test_sequence_outgrowing_the_whole_pool_fails_alone() -> None:
    h = Harness(3)  # 12 token slots, less than max_model_len: a misconfiguration
    assert h.add("A", 8, max_tokens=8).status is S.QUEUED
    h.run()
    h.assert_drained()
    rec = h.record("A")
    assert rec.status is S.FAILED and rec.finish_reason is FinishReason.ERROR
    assert rec.error == "the KV pool cannot hold 13 tokens" and rec.num_generated == 5
    assert h.outputs_of("A") == expected_tokens(8, 5)


# -- ending: deadline, abort, races (docs/design.md#cleanup) --


def test_deadline_times_out_queued_and_running_requests() -> None:
    h = Harness(4, admission_output_tokens=12)
    h.add("run", 4, max_tokens=12, deadline=3.0)  # reserves all 4 blocks
    res = h.add("wait", 4, max_tokens=4, deadline=2.0)
    assert res.status is S.QUEUED and res.reason is not None and "waiting" in res.reason
    assert h.kv.stats().reserved_blocks == 4  # the second got no reservation
    h.step()
    h.clock.t = 2.0
    out = h.step()
    assert [c.request_id for c in out.chunks] == ["run"]
    assert h.record("wait").status is S.TIMED_OUT
    assert h.record("wait").finish_reason is FinishReason.DEADLINE
    h.clock.t = 3.0
    assert h.step().chunks == []
    rec = h.record("run")
    assert rec.status is S.TIMED_OUT and rec.num_generated == 2 and rec.finished == 3.0
    h.assert_drained()


def test_abort_running_request_frees_its_blocks() -> None:
    h = Harness()
    h.add("A", 6, max_tokens=10)
    h.step()
    assert h.kv.stats().in_use_blocks == 2
    h.sched.abort("A")
    assert h.reqs["A"].status is S.CANCELLED and h.kv.stats().in_use_blocks == 2
    assert h.step().chunks == []
    rec = h.record("A")
    assert rec.status is S.CANCELLED and rec.finish_reason is FinishReason.CANCELLED
    assert rec.num_generated == 1 and rec.num_prompt_tokens == 6
    h.assert_drained()


def test_abort_while_step_runs_drops_the_token() -> None:
    h = Harness()
    h.add("A", 4, max_tokens=4)
    out = h.sched.schedule()
    h.sched.abort("A")
    assert h.sched.update_from_output(out, {"A": 5}) == []
    assert h.reqs["A"].output_token_ids == [] and h.reqs["A"].num_computed_tokens == 0
    h.assert_drained()
    assert h.record("A").status is S.CANCELLED


def test_cancel_racing_timeout_and_finish_writes_one_record() -> None:
    h = Harness()
    h.add("A", 4, max_tokens=1, deadline=5.0)
    h.add("B", 4, max_tokens=9, deadline=5.0)
    h.step()  # A finishes (max_tokens=1)
    h.sched.abort("A")  # races the finish: no-op
    h.sched.abort("B")
    h.sched.finish_request("B", FinishReason.DEADLINE)  # races the cancel: no-op
    h.clock.t = 5.0  # the deadline passes too
    first = h.sched.reclaim("B")
    assert first is not None and first.status is S.CANCELLED
    assert h.sched.reclaim("B") is None
    h.assert_drained()
    assert [(r.request_id, r.status) for r in h.sched.records] == [
        ("B", S.CANCELLED),
        ("A", S.FINISHED),
    ]
    assert h.record("A").finish_reason is FinishReason.MAX_TOKENS
    assert h.sched.reclaim("A") is None and h.kv.free("A") is False


def test_reclaim_of_live_request_is_refused() -> None:
    h = Harness()
    h.add("A", 4, max_tokens=1)
    with pytest.raises(ValueError, match="live request"):
        h.sched.reclaim("A")
    h.run()
    h.assert_drained()


def test_token_level_stops() -> None:
    h = Harness(max_model_len=12)
    h.add("eos", 4, max_tokens=9, eos_token_ids=frozenset({106}))
    h.add("ignore", 4, max_tokens=3, eos_token_ids=frozenset({105}), ignore_eos=True)
    h.add("min", 4, max_tokens=6, eos_token_ids=frozenset({104}), min_tokens=2)
    h.add("stop", 4, max_tokens=9, stop_token_ids=(105,))
    h.add("ctx", 8, max_tokens=9)
    h.run()
    h.assert_drained()
    got = {r.request_id: (r.finish_reason, r.num_generated) for r in h.sched.records}
    assert got == {
        "eos": (FinishReason.EOS, 3),
        "ignore": (FinishReason.MAX_TOKENS, 3),
        "min": (FinishReason.MAX_TOKENS, 6),  # its EOS 104 came first, before min_tokens
        "stop": (FinishReason.STOP_TOKEN, 2),
        "ctx": (FinishReason.CONTEXT_LIMIT, 4),
    }
    assert h.outputs_of("eos") == [104, 105, 106]
    assert h.outputs_of("min") == expected_tokens(4, 6)


# -- admission policies and rejection (docs/design.md#admission) --


def test_rejection_reasons_name_the_limit() -> None:
    h = Harness(4, max_model_len=20, enable_chunked_prefill=False, max_num_batched_tokens=16)
    too_long = h.add("long", 21)
    never_fits = h.add("huge", 17)
    budget = h.add("budget", 12, max_tokens=8)
    assert too_long.status is S.REJECTED and "max_model_len=20" in str(too_long.reason)
    assert never_fits.status is S.REJECTED and "pool has only 4" in str(never_fits.reason)
    assert "max_num_batched_tokens=16" in str(budget.reason)
    for rid, res in [("long", too_long), ("huge", never_fits), ("budget", budget)]:
        rec = h.record(rid)
        assert rec.status is S.REJECTED and rec.finish_reason is FinishReason.REJECTED
        assert rec.error == res.reason and rec.num_generated == 0
    assert h.kv.stats().reserved_blocks == 0
    h.assert_drained()


def test_policy_queue_waits_for_the_reservation() -> None:
    h = Harness(4)
    assert h.add("A", 8, max_tokens=8) == AdmissionResult(S.QUEUED)
    res = h.add("B", 4, max_tokens=4)
    assert res.status is S.QUEUED and "8 tokens does not fit" in str(res.reason)
    assert h.kv.stats().reserved_blocks == 4
    for _ in range(8):
        assert [c.request_id for c in h.step().chunks] == ["A"]
        assert (h.sched.num_running, h.sched.num_waiting) == (1, 1)
    h.clock.t = 9.0
    out = h.step()  # A reclaimed, B reserves and starts
    assert [c.request_id for c in out.chunks] == ["B"]
    assert h.sched.get_request("A") is None and h.sched.get_request("B") is h.reqs["B"]
    assert h.kv.stats().reserved_blocks == 2
    b = h.reqs["B"]
    assert (b.times.queued, b.times.first_scheduled) == (0.0, 9.0)
    h.run()
    h.assert_drained()
    assert h.outputs_of("B") == expected_tokens(4, 4)


def test_policy_reject() -> None:
    h = Harness(4, admission_policy="reject")
    h.add("A", 8, max_tokens=8)
    res = h.add("B", 4, max_tokens=4)
    assert res.status is S.REJECTED and "0 tokens reservable" in str(res.reason)
    assert h.record("B").status is S.REJECTED
    h.run()
    h.assert_drained()


def test_policy_degrade_reserves_what_fits_else_queues() -> None:
    h = Harness(6, admission_policy="degrade")
    assert h.add("A", 8, max_tokens=8).status is S.QUEUED  # 4 blocks
    res = h.add("B", 4, max_tokens=8)  # wants 3 blocks, 2 fit
    assert res == AdmissionResult(S.DEGRADED, "degraded: reserved 8 of 12 tokens")
    assert h.reqs["B"].status is S.DEGRADED
    res = h.add("C", 4, max_tokens=8)  # nothing left: not even prompt + 1
    assert res.status is S.QUEUED and h.reqs["C"].status is S.QUEUED
    assert h.kv.stats().reserved_blocks == 6
    h.run()
    h.assert_drained()
    for rid, plen in [("A", 8), ("B", 4), ("C", 4)]:
        assert h.outputs_of(rid) == expected_tokens(plen, 8)


# -- n > 1 --


def sample_index_runner(req: Request) -> int:
    """Child ``#i`` samples ``100 + position + 1000 * i``: the n samples differ."""
    return position_runner(req) + 1000 * int(req.request_id.partition("#")[2] or 0)


@pytest.mark.parametrize("mid_step", [False, True], ids=["after_update", "mid_step"])
def test_fork_shares_blocks_and_copies_the_partial_tail(mid_step: bool) -> None:
    """n=3: the parent is sample 0; fork adds two children sharing its blocks.

    ``mid_step`` forks as the engine does, between schedule() and update_from_output() of
    the step that samples the parent's first token: the children ride on its chunk.
    """
    h = Harness()
    if mid_step:
        h.add("P", 6, max_tokens=3, n=3)
        h.step(sample_index_runner)
    else:
        h.add("P", 6, max_tokens=3)
        h.step()
        for child in h.sched.fork("P", 2):
            h.reqs[child.request_id] = child
    firsts = [106, 1106, 2106] if mid_step else [106, 106, 106]
    assert list(h.reqs) == ["P", "P#1", "P#2"]
    assert [r.output_token_ids for r in h.reqs.values()] == [[t] for t in firsts]
    assert all(r.num_computed_tokens == 6 and r.status is S.DECODING for r in h.reqs.values())
    parent_table = h.kv.block_table("P")
    assert [h.kv.pool.refcount(b) for b in parent_table] == [3, 3]
    assert h.kv.stats().in_use_blocks == 2

    out = h.step(sample_index_runner)
    b0, b1 = parent_table
    assert [c.request_id for c in out.chunks] == ["P", "P#1", "P#2"]
    # the shared full block stays shared; two writers copy the partial tail, the last
    # holder writes in place
    assert [src for src, _ in out.copy_blocks] == [b1, b1]
    assert [c.block_table[0] for c in out.chunks] == [b0, b0, b0]
    tails = [c.block_table[1] for c in out.chunks]
    assert tails[2] == b1 and {tails[0], tails[1]} == {dst for _, dst in out.copy_blocks}
    h.run(sample_index_runner)
    h.assert_drained()
    assert h.outputs_of("P") == [106, 107, 108]
    assert h.outputs_of("P#1") == [firsts[1], 1107, 1108]
    assert h.outputs_of("P#2") == [firsts[2], 2107, 2108]


# -- a random workload: every limit holds, every output is exact, nothing leaks --


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(
        st.tuples(st.integers(1, 8), st.integers(1, 8), st.integers(0, 2)),
        min_size=1,
        max_size=7,
    ),
    num_blocks=st.integers(4, 10),  # >= 4: any one request (<= 15 positions) fits alone
    chunked=st.booleans(),
    mode=st.sampled_from(["recompute", "swap"]),
    policy=st.sampled_from(["fcfs", "priority"]),
    admission=st.sampled_from(["queue", "degrade"]),
    predicted=st.sampled_from([None, 0, 1, 2]),  # under-predicting output forces preemption
    budget=st.integers(3, 24),
    seqs=st.integers(1, 4),
)
def test_random_workloads_complete_exactly(
    lens: list[tuple[int, int, int]],
    num_blocks: int,
    chunked: bool,
    mode: str,
    policy: str,
    admission: str,
    predicted: int | None,
    budget: int,
    seqs: int,
) -> None:
    if not chunked:
        budget = max(budget, 16)  # whole sequences (<= 16 tokens) must fit one step
    h = Harness(
        num_blocks,
        num_host_blocks=4,
        enable_chunked_prefill=chunked,
        preemption_mode=mode,
        scheduling_policy=policy,
        admission_policy=admission,
        admission_output_tokens=predicted,
        max_num_batched_tokens=budget,
        max_num_seqs=seqs,
    )
    for i, (plen, max_tokens, prio) in enumerate(lens):
        prompt = [(i * 7 + j) % 5 + 1 for j in range(plen)]  # repeats: prefix hits happen
        assert h.add(f"r{i}", prompt, max_tokens=max_tokens, priority=prio).status in (
            S.QUEUED,
            S.DEGRADED,
        )
    # #speculative-decoding: no speculation, so a step commits at most one token per sequence
    for _ in range(500):
        if not h.sched.has_unfinished:
            break
        before = {rid: req.num_generated for rid, req in h.reqs.items()}
        h.step()
        grew = {rid: req.num_generated - before[rid] for rid, req in h.reqs.items()}
        assert max(grew.values()) <= 1, f"more than one token in one step: {grew}"
    assert not h.sched.has_unfinished, "scheduler did not drain"
    h.assert_drained()
    for i, (plen, max_tokens, _) in enumerate(lens):
        rec = h.record(f"r{i}")
        assert rec.status is S.FINISHED and rec.finish_reason is FinishReason.MAX_TOKENS
        assert h.outputs_of(f"r{i}") == expected_tokens(plen, max_tokens)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), chunked=st.booleans(), mode=st.sampled_from(["recompute", "swap"]))
def test_random_aborts_deadlines_backpressure_and_forks_never_leak(
    data: st.DataObject, chunked: bool, mode: str
) -> None:
    h = Harness(
        6,
        num_host_blocks=4,
        enable_chunked_prefill=chunked,
        preemption_mode=mode,
        max_num_batched_tokens=data.draw(st.integers(3, 20)) if chunked else 20,
        max_num_seqs=3,
        admission_output_tokens=data.draw(st.sampled_from([None, 0, 1])),
    )
    for i in range(data.draw(st.integers(1, 6))):
        deadline = data.draw(st.sampled_from([None, 3.0, 8.0]))
        plen, max_tokens = data.draw(st.integers(1, 10)), data.draw(st.integers(1, 8))
        n = data.draw(st.sampled_from([1, 1, 2, 3]))  # n > 1 forks at the first token
        h.add(f"r{i}", plen, max_tokens, deadline=deadline, n=n)
    for _ in range(60):
        if not h.sched.has_unfinished:
            break
        event = data.draw(st.sampled_from(["step", "step", "abort", "bp", "tick"]))
        req = h.reqs[data.draw(st.sampled_from(sorted(h.reqs)))]
        if event == "abort":
            h.sched.abort(req.request_id)
        elif event == "bp":
            h.sched.set_backpressured(req.request_id, data.draw(st.booleans()))
        elif event == "tick":
            h.clock.t += 1.0
        h.step()
    for rid in h.reqs:
        h.sched.set_backpressured(rid, False)
    h.run(max_steps=500)
    h.assert_drained()
    for rid, req in h.reqs.items():
        rec = h.record(rid)
        assert rec.num_generated == len(req.output_token_ids)
        assert req.output_token_ids == expected_tokens(req.num_prompt_tokens, rec.num_generated)
        if rec.status is S.FINISHED:
            assert rec.num_generated == req.sampling_params.max_tokens
        else:
            assert rec.status in (S.CANCELLED, S.TIMED_OUT)


# -- pinned by mutation testing (make mutation) --


def test_fork_children_inherit_priority_deadline_salt_and_eos() -> None:
    """Forked children carry the parent's priority, deadline, salt, EOS ids and progress."""
    h = Harness()
    eos = frozenset({7})
    h.clock.t = 1.0
    h.add("P", 6, max_tokens=3, priority=3, deadline=50.0, cache_salt="t1", eos_token_ids=eos)
    h.clock.t = 2.0
    h.step()
    parent = h.reqs["P"]
    children = h.sched.fork("P", 2)
    assert [c.request_id for c in children] == ["P#1", "P#2"]
    for child in children:
        h.reqs[child.request_id] = child
        assert child.prompt_token_ids == [1, 2, 3, 4, 5, 6]
        assert child.prompt_token_ids is not parent.prompt_token_ids
        assert child.sampling_params is parent.sampling_params
        assert (child.arrival_time, child.priority, child.deadline) == (1.0, 3, 50.0)
        assert (child.cache_salt, child.eos_token_ids) == ("t1", eos)
        assert (child.parent_id, child.index) == ("P", int(child.request_id[-1]))
        assert child.output_token_ids == [106] and child.output_token_ids is not (
            parent.output_token_ids
        )
        assert (child.num_generated, child.num_computed_tokens) == (1, 6)
        assert (child.times.queued, child.times.first_scheduled) == (1.0, 2.0)
        assert child.status is S.DECODING and h.sched.get_request(child.request_id) is child
    # the children stop on the parent's EOS id and time out at the parent's deadline
    h.step(lambda r: 7 if r.request_id == "P#1" else position_runner(r))
    assert h.reqs["P#1"].finish_reason is FinishReason.EOS
    h.clock.t = 50.0
    h.run()
    h.assert_drained()
    got = {r.request_id: (r.status, r.num_generated) for r in h.sched.records}
    assert got == {"P#1": (S.FINISHED, 2), "P": (S.TIMED_OUT, 2), "P#2": (S.TIMED_OUT, 2)}


def test_fork_before_the_first_token_starts_children_prefilling() -> None:
    """A child forked before any token is sampled starts PREFILLING, not DECODING."""
    h = Harness(max_num_batched_tokens=4)
    h.add("P", 6, max_tokens=2)
    h.step()  # a partial chunk: 4 of 6 prompt tokens
    (child,) = h.sched.fork("P", 1)
    h.reqs[child.request_id] = child
    assert child.status is S.PREFILLING and child.output_token_ids == []
    assert (child.num_generated, child.num_computed_tokens) == (0, 4)
    h.run()
    h.assert_drained()
    assert h.outputs_of("P") == h.outputs_of("P#1") == expected_tokens(6, 2)


def test_fork_of_a_request_that_is_not_running_is_refused() -> None:
    """fork() raises for a queued parent, and the queued parent is untouched."""
    h = Harness(max_num_seqs=1)
    h.add("A", 4, max_tokens=1)
    h.add("B", 4, max_tokens=1)
    h.step()
    with pytest.raises(ValueError, match="fork: parent B is not running"):
        h.sched.fork("B", 1)
    h.run()
    h.assert_drained()


def test_recompute_preemption_drops_the_victims_reservation_and_retakes_it() -> None:
    """A recompute victim loses its reservation and reserves again when re-admitted."""
    h = Harness(6, prefix_caching=False, admission_output_tokens=0)
    grow_two(h)
    for _ in range(6):
        h.step()
    assert h.outputs[-1].preempted_ids == ["B"]
    assert not h.sched.admission.holds("B") and h.sched.admission.holds("A")
    assert h.kv.stats().reserved_blocks == 3  # only A's
    for _ in range(3):
        h.step()
    out = h.outputs[-1]  # A reclaimed; B re-reserves 14 tokens (13 + 1) and recomputes
    assert [(c.request_id, c.start_pos, len(c.token_ids)) for c in out.chunks] == [("B", 0, 13)]
    assert h.sched.admission.holds("B") and h.kv.stats().reserved_blocks == 4
    h.run()
    h.assert_drained()
    assert h.outputs_of("B") == expected_tokens(8, 8)


def test_no_admission_in_a_step_that_preempted() -> None:
    """A step that preempts admits nothing new: the queued request waits one step."""
    h = Harness(7, prefix_caching=False, admission_output_tokens=0, max_num_seqs=2)
    grow_two(h)
    h.clock.t = 2.0
    h.add("C", [31, 32], max_tokens=1)
    for _ in range(7):
        h.step()
    trace = [[(c.request_id, c.start_pos) for c in o.chunks] for o in h.outputs[5:7]]
    assert h.outputs[5].preempted_ids == ["B"]
    assert trace == [[("A", 12)], [("A", 13), ("C", 0)]]
    h.run()
    h.assert_drained()
    assert h.outputs_of("C") == [102] and h.outputs_of("B") == expected_tokens(8, 8)


def test_running_requests_share_one_token_budget() -> None:
    """Decodes and a running partial prefill together never exceed max_num_batched_tokens."""
    h = Harness(32, max_num_batched_tokens=8)
    h.add("A", 4, max_tokens=6)
    h.add("B", [9, 8, 7, 6], max_tokens=6)
    h.step()
    h.add("C", list(range(20, 40)), max_tokens=2)
    trace = [[(c.request_id, c.start_pos, len(c.token_ids)) for c in h.step().chunks]]
    trace += [[(c.request_id, c.start_pos, len(c.token_ids)) for c in h.step().chunks]]
    assert trace == [
        [("A", 4, 1), ("B", 4, 1), ("C", 0, 6)],
        [("A", 5, 1), ("B", 5, 1), ("C", 6, 6)],  # C already running: 8 - 1 - 1 = 6
    ]
    h.run()
    h.assert_drained()
    assert h.outputs_of("C") == expected_tokens(20, 2)


def test_terminal_record_has_every_field() -> None:
    """The terminal record carries every count and stamp, committed tokens included."""
    h = Harness()
    h.clock.t = 1.0
    req = Request("M", [1, 2, 3, 4], SamplingParams(max_tokens=3), arrival_time=0.5)
    req.output_token_ids = [50]  # a migrated request: one token came from elsewhere
    h.reqs["M"] = req
    assert h.sched.add_request(req) == AdmissionResult(S.QUEUED)
    h.clock.t = 2.0
    h.step()
    req.times.first_token = 2.5  # stamped by the engine when it emits
    req.num_emitted = 2  # the engine's detokeniser count
    h.clock.t = 4.0
    h.step()
    h.assert_drained()
    assert h.record("M") == TerminalRecord(
        request_id="M",
        status=S.FINISHED,
        finish_reason=FinishReason.MAX_TOKENS,
        num_prompt_tokens=4,
        num_generated=2,
        num_committed=3,
        num_emitted=2,
        arrival=0.5,
        first_token=2.5,
        finished=4.0,
        error=None,
        queue_time_s=1.0,
    )
    assert req.record is h.record("M") and req.output_token_ids == [50, 105, 106]


def test_rejected_record_has_its_reason_and_no_queue_time() -> None:
    """A rejection is recorded at once: REJECTED, the reason as error, no queue time."""
    h = Harness(max_model_len=8)
    h.clock.t = 3.0
    res = h.add("R", 9, arrival_time=2.0)
    assert res.status is S.REJECTED
    assert h.sched.records.total == 1 and h.sched.get_request("R") is None
    assert h.record("R") == TerminalRecord(
        request_id="R",
        status=S.REJECTED,
        finish_reason=FinishReason.REJECTED,
        num_prompt_tokens=9,
        num_generated=0,
        num_committed=0,
        num_emitted=0,
        arrival=2.0,
        first_token=None,
        finished=3.0,
        error="prompt has 9 tokens, more than max_model_len=8",
        queue_time_s=None,
    )
    h.assert_drained()


def imported(h: Harness, rid: str, prompt: int, first_token: int, max_tokens: int = 3) -> Request:
    """A decode-side request whose prompt KV and first token came from a prefill worker."""
    req = Request(rid, list(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens))
    req.output_token_ids = [first_token]
    h.reqs[rid] = req
    return req


def test_imported_request_waits_for_its_kv_then_decodes() -> None:
    """add_imported takes blocks and a slot at once; nothing runs until kv_ready()."""
    h = Harness()
    h.clock.t = 1.0
    req = imported(h, "D", 6, 106)
    assert h.sched.add_imported(req, 6) == AdmissionResult(S.WAITING_FOR_KV)
    assert req.status is S.WAITING_FOR_KV and req.num_computed_tokens == 6
    assert (req.times.queued, req.times.first_scheduled) == (1.0, 1.0)
    assert h.kv.block_table("D") == [0, 1] and h.kv.stats().reserved_blocks == 3
    assert (h.sched.num_running, h.sched.num_waiting) == (1, 0)
    probe = Request("probe", [1, 2, 3, 4, 5, 6, 7], SamplingParams())
    assert h.kv.get_computed_blocks(probe) == ([], 0)  # not cached before it is verified
    h.clock.t = 2.0
    assert h.step().chunks == []  # the transfer is still writing the KV
    h.sched.kv_ready("D")
    assert req.status is S.DECODING
    assert h.kv.get_computed_blocks(probe) == ([0], 4)
    out = h.step()
    assert [(c.request_id, c.start_pos, c.token_ids) for c in out.chunks] == [("D", 6, [106])]
    h.run()
    h.assert_drained()
    assert req.output_token_ids == [106, 107, 108]
    rec = h.record("D")
    assert (rec.status, rec.num_generated, rec.num_committed, rec.queue_time_s) == (
        S.FINISHED,
        2,
        3,
        0.0,
    )


def test_kv_ready_after_the_request_ended_is_a_no_op() -> None:
    """kv_ready() for a request cancelled while its KV was in flight changes nothing."""
    h = Harness()
    req = imported(h, "D", 6, 106)
    h.sched.add_imported(req, 6)
    h.sched.abort("D")
    h.sched.kv_ready("D")
    assert req.status is S.CANCELLED
    h.step()
    h.sched.kv_ready("D")  # reclaimed: unknown now
    h.assert_drained()
    assert h.record("D").status is S.CANCELLED


def test_kv_ready_needs_a_waiting_request_with_a_token() -> None:
    """kv_ready() raises for a request not waiting for KV or with no token after the KV."""
    h = Harness()
    req = imported(h, "D", 6, 106)
    h.sched.add_imported(req, 6)
    h.sched.kv_ready("D")
    with pytest.raises(ValueError, match="kv_ready: request D is DECODING with no token"):
        h.sched.kv_ready("D")
    no_token = Request("E", [1, 2, 3, 4], SamplingParams(max_tokens=2))
    h.reqs["E"] = no_token
    h.sched.add_imported(no_token, 4)
    with pytest.raises(ValueError, match="kv_ready: request E is WAITING_FOR_KV"):
        h.sched.kv_ready("E")
    h.sched.abort("E")
    h.run()
    h.assert_drained()


def test_add_imported_refuses_bad_arguments() -> None:
    """A repeated id or a KV length outside (0, num_tokens] raises and admits nothing."""
    h = Harness()
    req = imported(h, "D", 6, 106)
    for bad in (0, 8):
        with pytest.raises(ValueError, match=f"request D: num_kv_tokens={bad} of 7"):
            h.sched.add_imported(req, bad)
    assert h.sched.get_request("D") is None
    assert h.sched.add_imported(req, 7).status is S.WAITING_FOR_KV  # all of it is allowed
    with pytest.raises(ValueError, match="request D is already in the scheduler"):
        h.sched.add_imported(req, 6)
    h.add("Q", 4)
    with pytest.raises(ValueError, match="request Q is already in the scheduler"):
        h.sched.add_request(h.reqs["Q"])
    h.sched.abort("D")
    h.run()
    h.assert_drained()


def test_add_imported_rejects_what_cannot_run_here_and_raises_no_room_for_what_cannot_now() -> None:
    """Past a hard limit an import is REJECTED (with its record); without a batch slot or its
    reservation *now* it raises NoRoom and changes nothing (no record, no reservation, no
    request), so the same request is admitted once room frees."""
    h = Harness(4, max_model_len=12, max_num_seqs=2)
    long = imported(h, "long", 12, 1)
    assert h.sched.add_imported(long, 12) == AdmissionResult(
        S.REJECTED, "prompt has 13 tokens, more than max_model_len=12"
    )
    big = imported(h, "big", 8, 9, max_tokens=4)
    assert h.sched.add_imported(big, 8).status is S.WAITING_FOR_KV  # reserves 12: 3 blocks
    no_room = imported(h, "no_room", 6, 7)
    before = h.kv.stats()
    with pytest.raises(
        NoRoom, match=r"^request no_room: KV reservation of 9 tokens does not fit \(4 tokens "
    ):
        h.sched.add_imported(no_room, 6)
    assert h.kv.stats() == before and not h.sched.admission.holds("no_room")
    h.add("small", 2, max_tokens=1)
    h.sched.kv_ready("big")
    h.step()  # "small" takes the second slot
    no_slot = imported(h, "no_slot", 2, 3)
    with pytest.raises(NoRoom, match="^request no_slot: all 2 batch slots are taken$"):
        h.sched.add_imported(no_slot, 2)
    rec = h.record("long")
    assert (rec.status, rec.finish_reason, rec.error) == (
        S.REJECTED,
        FinishReason.REJECTED,
        "prompt has 13 tokens, more than max_model_len=12",
    )
    for rid in ("long", "no_room", "no_slot"):
        assert h.sched.get_request(rid) is None and h.kv.num_held_blocks(rid) == 0
    assert [r.request_id for r in h.sched.records] == ["long"]  # NoRoom leaves no record
    assert h.reqs["no_slot"].status is S.QUEUED  # untouched
    h.run()
    assert h.outputs_of("big") == [9, 109, 110, 111]
    # Room is back: the imports turned away are admitted as they were.
    for req, n in ((no_room, 6), (no_slot, 2)):
        assert h.sched.add_imported(req, n).status is S.WAITING_FOR_KV
        h.sched.kv_ready(req.request_id)
        h.run()
    h.assert_drained()
    assert h.outputs_of("no_slot") == [3, 103, 104]
    assert h.outputs_of("no_room") == [7, 107, 108]


def test_prefill_only_request_hands_off_and_leases_its_kv() -> None:
    """A prefill-only request ends HANDED_OFF after one token, its blocks kept under a lease."""
    h = Harness()
    h.add("P", 6, max_tokens=4, prefill_only=True)
    h.step()
    p = h.reqs["P"]
    assert (p.status, p.finish_reason, p.output_token_ids) == (
        S.FINISHED,
        FinishReason.HANDED_OFF,
        [106],
    )
    table = h.kv.block_table("P")
    h.step()  # reclaimed: the blocks stay in use for the transfer
    assert h.kv.leased_ids == frozenset({"P"}) and h.kv.block_table("P") == table
    assert h.kv.stats().in_use_blocks == 2 and h.kv.stats().reserved_blocks == 0
    rec = h.record("P")
    assert (rec.status, rec.finish_reason, rec.num_generated) == (
        S.FINISHED,
        FinishReason.HANDED_OFF,
        1,
    )
    assert not h.sched.has_unfinished
    assert h.kv.free("P")  # the lease's release
    h.assert_drained()


def test_backpressure_set_before_the_first_token_pauses_at_it() -> None:
    """A request backpressured while prefilling pauses right after its first token."""
    h = Harness(max_num_batched_tokens=4)
    h.add("A", 6, max_tokens=4)
    h.step()  # 4 of 6 prompt tokens
    h.sched.set_backpressured("A", True)
    assert h.reqs["A"].status is S.PREFILLING
    out = h.step()  # the rest of the prompt: the first token, then the pause
    assert [(c.request_id, c.start_pos) for c in out.chunks] == [("A", 4)]
    assert h.reqs["A"].status is S.BACKPRESSURED and h.outputs_of("A") == [106]
    assert h.step().chunks == []
    h.sched.set_backpressured("A", False)
    assert h.reqs["A"].status is S.DECODING
    h.run()
    h.assert_drained()
    assert h.outputs_of("A") == expected_tokens(6, 4)


def test_victims_of_one_step_are_readmitted_in_arrival_order() -> None:
    """Two requests preempted in one step come back oldest first (FCFS)."""
    h = Harness(3, prefix_caching=False, admission_output_tokens=0)
    for i, rid in enumerate("ABC"):
        h.clock.t = float(i)
        h.add(rid, [10 * i + 1, 10 * i + 2, 10 * i + 3], max_tokens=3)
    h.step()
    h.step()
    out = h.step()  # all three need a second block, one is free: C, then B step back
    assert out.preempted_ids == ["C", "B"] and [c.request_id for c in out.chunks] == ["A"]
    firsts = [(c.request_id, c.start_pos) for _ in range(2) for c in h.step().chunks]
    assert firsts == [("B", 0), ("C", 0)]
    h.run()
    h.assert_drained()
    for rid in "ABC":
        assert h.outputs_of(rid) == expected_tokens(3, 3)


def test_equal_victim_keys_preempt_the_later_admitted_request() -> None:
    """On a tie in priority and arrival, the request admitted last is the victim."""
    h = Harness(6, prefix_caching=False, admission_output_tokens=0)
    h.add("A", list(range(1, 9)), max_tokens=8)
    h.add("B", list(range(11, 19)), max_tokens=8)  # same arrival time as A
    for _ in range(6):
        out = h.step()
    assert out.preempted_ids == ["B"] and [c.request_id for c in out.chunks] == ["A"]
    assert (h.reqs["A"].num_preemptions, h.reqs["B"].num_preemptions) == (0, 1)
    h.run()
    h.assert_drained()


def test_num_preemptions_counts_every_preemption() -> None:
    """A request preempted twice reports num_preemptions == 2 and still completes exactly."""
    h = Harness(6, prefix_caching=False, admission_output_tokens=0, scheduling_policy="priority")
    h.add("A", list(range(1, 9)), max_tokens=8, priority=0)
    h.clock.t = 1.0
    h.add("B", list(range(11, 19)), max_tokens=12, priority=5)
    for _ in range(6):
        h.step()
    h.clock.t = 2.0
    h.add("C", list(range(21, 27)), max_tokens=4, priority=0)
    h.run()
    h.assert_drained()
    assert {rid: r.num_preemptions for rid, r in h.reqs.items()} == {"A": 0, "B": 2, "C": 0}
    assert h.outputs_of("B") == expected_tokens(8, 12)
    assert h.outputs_of("C") == expected_tokens(6, 4)


def test_recompute_mode_drops_kv_even_when_host_blocks_are_free() -> None:
    """preemption_mode="recompute" never swaps, whatever the host pool holds."""
    h = Harness(6, num_host_blocks=8, prefix_caching=False, admission_output_tokens=0)
    grow_two(h)
    for _ in range(6):
        out = h.step()
    assert out.preempted_ids == ["B"] and out.swap_out == []
    assert h.reqs["B"].status is S.PREEMPTED and h.reqs["B"].num_computed_tokens == 0
    assert h.kv.stats().host_free_blocks == 8
    h.run()
    h.assert_drained()
    assert not any(o.swap_in or o.swap_out for o in h.outputs)


def test_without_chunking_a_chunk_exactly_filling_the_budget_runs() -> None:
    """Unchunked, a prompt that exactly fills the step's remaining budget is scheduled."""
    h = Harness(enable_chunked_prefill=False, max_num_batched_tokens=8)
    h.add("A", 4, max_tokens=3)
    h.step()
    h.add("B", [9, 8, 7, 6, 5, 4, 3], max_tokens=1)  # 7 tokens: 8 - A's decode
    out = h.step()
    assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [("A", 1), ("B", 7)]
    h.run()
    h.assert_drained()
    assert h.outputs_of("B") == [107]


def test_eos_at_exactly_min_tokens_stops() -> None:
    """EOS as the min_tokens-th token ends the request (min_tokens is reached)."""
    h = Harness()
    h.add("A", 4, max_tokens=6, eos_token_ids=frozenset({105}), min_tokens=2)
    h.add("B", 4, max_tokens=6, stop_token_ids=(105,), min_tokens=2)
    h.run()
    h.assert_drained()
    assert h.outputs_of("A") == h.outputs_of("B") == [104, 105]
    assert h.record("A").finish_reason is FinishReason.EOS
    assert h.record("B").finish_reason is FinishReason.STOP_TOKEN


def test_preempted_request_is_readmitted_before_later_queued_ones() -> None:
    """Within a priority level a preempted request goes back in before newer queued ones."""
    h = Harness(7, prefix_caching=False, admission_output_tokens=0, max_num_seqs=2)
    grow_two(h)
    h.clock.t = 2.0
    h.add("C", [31, 32], max_tokens=4)  # holds a reservation, waits for a slot
    h.clock.t = 3.0
    h.add("D", [41, 42], max_tokens=1)  # no reservation yet
    trace = [[(c.request_id, c.start_pos) for c in h.step().chunks] for _ in range(11)]
    assert trace[5:] == [
        [("A", 12)],  # B preempted
        [("A", 13), ("C", 0)],  # B cannot reserve yet; C already holds its reservation
        [("A", 14), ("C", 2)],
        [("C", 3), ("B", 0)],  # A gone: B, preempted, goes before the newer D
        [("B", 13), ("C", 4)],
        [("B", 14), ("D", 0)],
    ]
    h.run()
    h.assert_drained()
    assert h.outputs_of("D") == [102]


def test_a_failed_reservation_blocks_later_reservations() -> None:
    """A queued request that cannot reserve is not overtaken by a later one that could."""
    h = Harness(4)
    h.add("A1", 4, max_tokens=1)
    h.add("A2", [9, 9, 9, 9], max_tokens=4)
    h.clock.t = 1.0
    assert h.add("H", [5, 6, 7, 8], max_tokens=8).status is S.QUEUED  # 3 blocks, none free
    assert h.add("S", [3], max_tokens=2).status is S.QUEUED  # 1 block, none free
    firsts: dict[str, int] = {}
    for step in range(6):
        for c in h.step().chunks:
            firsts.setdefault(c.request_id, step)
    # A1 is gone at step 1 and frees 2 blocks: enough for S, not for H; S waits for H
    assert firsts == {"A1": 0, "A2": 0, "H": 4, "S": 4}
    assert [c.request_id for c in h.outputs[4].chunks] == ["H", "S"]
    h.run()
    h.assert_drained()
    assert h.outputs_of("S") == [101, 102]


def test_a_backpressured_request_keeps_its_batch_slot() -> None:
    """A paused request still counts against max_num_seqs: nothing is admitted in its place."""
    h = Harness(max_num_seqs=2)
    h.add("A", 4, max_tokens=4)
    h.add("B", 4, max_tokens=4)
    h.add("C", [7, 7], max_tokens=1)
    h.step()
    h.sched.set_backpressured("A", True)
    trace = [[(c.request_id, c.start_pos) for c in h.step().chunks] for _ in range(4)]
    assert trace == [[("B", 4)], [("B", 5)], [("B", 6)], [("C", 0)]]
    assert h.sched.num_running == 2
    h.sched.set_backpressured("A", False)
    h.run()
    h.assert_drained()
    assert h.outputs_of("A") == expected_tokens(4, 4) and h.outputs_of("C") == [102]


def test_children_forked_mid_step_get_their_token_when_the_parent_is_aborted() -> None:
    """Riders of a parent cancelled during the step still take their own sampled tokens."""
    h = Harness()
    h.add("P", 6, max_tokens=3)
    out = h.sched.schedule()
    children = h.sched.fork("P", 2)
    for child in children:
        h.reqs[child.request_id] = child
    h.sched.abort("P")
    got = h.sched.update_from_output(out, {"P": 106, "P#1": 1106, "P#2": 2106})
    assert [r.request_id for r in got] == ["P#1", "P#2"]
    assert [c.output_token_ids for c in children] == [[1106], [2106]]
    assert h.reqs["P"].output_token_ids == []
    h.run(sample_index_runner)
    h.assert_drained()
    assert h.outputs_of("P#1") == [1106, 1107, 1108]
    assert h.record("P").status is S.CANCELLED


def test_import_of_a_one_token_prompt_and_no_degraded_imports() -> None:
    """A 1-token KV import is valid; under the degrade policy an import that only fits degraded
    is not admitted (NoRoom), never degraded."""
    h = Harness(4, admission_policy="degrade")
    one = imported(h, "one", 1, 101, max_tokens=2)
    assert h.sched.add_imported(one, 1).status is S.WAITING_FOR_KV
    h.add("A", 4, max_tokens=4)  # reserves 2 blocks: 4 tokens stay reservable
    big = imported(h, "big", 2, 5, max_tokens=6)  # wants 8 tokens: only a degraded fit
    with pytest.raises(NoRoom, match=r"KV reservation of 8 tokens does not fit \(4 tokens"):
        h.sched.add_imported(big, 2)
    assert h.reqs["big"].status is S.QUEUED and h.sched.get_request("big") is None
    del h.reqs["big"]  # never admitted: no record owed
    h.sched.kv_ready("one")
    h.run()
    h.assert_drained()
    assert h.outputs_of("one") == [101, 102]


def test_a_reclaimed_request_id_leaves_no_state_behind() -> None:
    """After reclaim, a new request reusing the id reserves afresh and is not backpressured."""
    h = Harness(max_num_batched_tokens=4)
    h.add("A", 6, max_tokens=4)
    h.step()
    h.sched.set_backpressured("A", True)
    h.sched.abort("A")
    h.step()
    assert h.sched.get_request("A") is None and not h.sched.admission.holds("A")
    first = h.record("A")
    h.reqs["A"] = Request("A", [1, 2, 3, 4], SamplingParams(max_tokens=2))
    h.sched.add_request(h.reqs["A"])
    assert h.kv.stats().reserved_blocks == 2
    h.run()
    assert h.reqs["A"].status is S.FINISHED and h.outputs_of("A") == expected_tokens(4, 2)
    assert first.status is S.CANCELLED
    h.kv.check_idle()


def test_a_request_waiting_for_its_kv_is_never_a_preemption_victim() -> None:
    """A and B grow in an 8-block pool while D, admitted last (the usual victim), waits for its
    imported KV: a transfer is writing into D's blocks, so B is preempted, never D."""
    h = Harness(8, prefix_caching=False, admission_output_tokens=0)
    grow_two(h)
    h.clock.t = 2.0
    d = imported(h, "D", 6, 106)
    assert h.sched.add_imported(d, 6) == AdmissionResult(S.WAITING_FOR_KV)
    blocks = h.kv.block_table("D")
    preempted = [rid for _ in range(8) for rid in h.step().preempted_ids]
    assert preempted == ["B"]
    assert d.status is S.WAITING_FOR_KV and h.kv.block_table("D") == blocks and len(blocks) == 2


def test_several_swapped_requests_come_back_oldest_first() -> None:
    """#preemption: "Swapped requests come back, oldest first". Three requests swapped out in
    one step (victims latest arrival first: E, D, C) must come back by age, C first, as the
    recompute path readmits its victims (test_victims_of_one_step_are_readmitted_in_arrival_order).
    """
    h = Harness(
        5,
        num_host_blocks=8,
        prefix_caching=False,
        admission_output_tokens=0,
        preemption_mode="swap",
    )
    for i, rid in enumerate("ABCDE"):
        h.clock.t = float(i)
        h.add(rid, [10 * i + 1, 10 * i + 2, 10 * i + 3], max_tokens=3)
    h.step()
    h.step()
    out = h.step()  # all five need a second block, none is free: E, D, then C steps back
    assert out.preempted_ids == ["E", "D", "C"] and [c.request_id for c in out.chunks] == ["A", "B"]
    assert [h.reqs[rid].status for rid in "CDE"] == [S.SWAPPED] * 3
    # A and B end; 5 free blocks hold two of the three (2 blocks each): the oldest two go first
    trace = [[(c.request_id, c.start_pos) for c in h.step().chunks] for _ in range(2)]
    assert trace == [[("C", 4), ("D", 4)], [("E", 4)]]
    assert [o.swap_in != [] for o in h.outputs[3:5]] == [True, True]
    h.run()
    h.assert_drained()
    for rid in "ABCDE":
        assert h.outputs_of(rid) == expected_tokens(3, 3)


def test_only_a_request_scoring_its_prompt_has_its_prefill_chunks_return_every_row() -> None:
    """A request with prompt logprobs has every prefill chunk marked ``all_logits`` (the runner
    returns all its rows) until its first token; the others only their last row."""
    h = Harness(max_num_batched_tokens=4)
    h.add("S", 6, max_tokens=2, prompt_logprobs=1)
    h.add("G", 3, max_tokens=2)
    flags = [[(c.request_id, c.all_logits) for c in h.step().chunks] for _ in range(3)]
    assert flags == [[("S", True)], [("S", True), ("G", False)], [("S", False), ("G", False)]]
    h.run()
    h.assert_drained()
