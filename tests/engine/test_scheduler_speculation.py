"""The scheduler's side of speculative decoding (docs/design.md#speculative-decoding), without a
model: which requests are asked for drafts and how many they may take, the chunk that carries
them, drafts that never preempt, accepting a draft, and the KV given back for rejected ones."""

from __future__ import annotations

from typing import Any

import pytest
from test_scheduler import Harness

from engine.batch import SchedulerOutput
from engine.config import SpeculativeConfig
from engine.request import FinishReason, Request, RequestStatus

S = RequestStatus


class Drafter:
    """Proposes ``drafts`` (cut to what the scheduler allows) and records each ask."""

    def __init__(self, drafts: list[int]) -> None:
        self.drafts = drafts
        self.asked: list[tuple[str, int]] = []

    def __call__(self, req: Request, most: int) -> list[int]:
        self.asked.append((req.request_id, most))
        return self.drafts[:most]


def harness(drafts: list[int], max_batch: int = 8, **kw: Any) -> tuple[Harness, Drafter]:
    h = Harness(speculative=SpeculativeConfig(max_batch=max_batch), **kw)
    drafter = Drafter(drafts)
    h.sched.drafter = drafter
    return h, drafter


def decode_once(h: Harness, token: int = 7) -> SchedulerOutput:
    """One step that feeds each sampling chunk ``token`` and accepts no draft."""
    out = h.sched.schedule()
    h.sched.update_from_output(out, dict.fromkeys(out.sampled_ids, token))
    for rid in out.sampled_ids:
        h.sched.end_verification(rid)
    return out


def test_only_a_decoding_request_is_asked_and_its_chunk_carries_the_drafts() -> None:
    h, drafter = harness([50, 51, 52, 53, 54, 55, 56, 57, 58, 59])
    h.add("a", 6, max_tokens=8)
    out = decode_once(h)  # the prefill: not asked
    assert drafter.asked == [] and len(out.chunks[0].token_ids) == 6
    out = h.sched.schedule()
    # max_tokens 8, one token out: at most 6 drafts (the 8th token's KV is never computed).
    assert drafter.asked == [("a", 6)]
    [chunk] = out.chunks
    assert chunk.token_ids == [7, 50, 51, 52, 53, 54, 55] and chunk.num_drafts == 6
    assert chunk.drafts == [50, 51, 52, 53, 54, 55] and chunk.num_logit_rows == 7
    assert chunk.start_pos == 6 and chunk.sample
    assert len(chunk.block_table) == h.kv.blocks_for(6 + 7)


def test_drafts_stop_at_the_context_limit_and_the_token_budget() -> None:
    h, drafter = harness(list(range(100, 116)), max_model_len=12, max_num_batched_tokens=9)
    h.add("a", 8, max_tokens=20)
    decode_once(h)
    h.sched.schedule()
    assert drafter.asked == [("a", 12 - 9 - 1)]  # positions 8 .. 10 computed, never 11
    # Budget 6: two decodes (2 tokens), the drafts from the 4 left -- a guess never takes a
    # token's place.
    h2, drafter2 = harness(list(range(100, 116)), max_num_batched_tokens=6)
    h2.add("a", 2, max_tokens=30)
    h2.add("b", 2, max_tokens=30)
    decode_once(h2)
    out = h2.sched.schedule()
    assert drafter2.asked == [("a", 6 - 2)]  # b: no budget left, not asked
    assert [c.num_drafts for c in out.chunks] == [4, 0]
    assert sum(len(c.token_ids) for c in out.chunks) == 6


def test_no_drafts_above_max_batch_running_sequences() -> None:
    h, drafter = harness([50, 51], max_batch=1)
    h.add("a", 4, max_tokens=10)
    h.add("b", 4, max_tokens=10)
    decode_once(h)
    out = h.sched.schedule()
    assert drafter.asked == [] and all(c.num_drafts == 0 for c in out.chunks)


def test_drafts_that_find_no_free_block_are_dropped_and_nobody_is_preempted() -> None:
    """Reservations of prompt + 1 token (``admission_output_tokens``) fill the 3-block pool: a
    decode may outgrow its reservation into a free block, a guess may not."""
    h, drafter = harness(list(range(100, 116)), num_blocks=3, admission_output_tokens=1)
    h.add("a", 4, max_tokens=6)
    h.add("b", 3, max_tokens=5)
    decode_once(h)  # a holds 1 block (positions 0..3), b 1 (0..2); one free
    out = h.sched.schedule()
    assert drafter.asked == [("a", 4), ("b", 3)]
    assert [c.num_drafts for c in out.chunks] == [0, 0]  # a takes the free block for its token
    assert out.preempted_ids == [] and h.kv.stats().free_blocks == 0


def test_accepting_a_draft_counts_its_kv_and_commits_the_next_token() -> None:
    h, _ = harness([50, 51, 52, 53, 54, 55])
    h.add("a", 6, max_tokens=10)
    decode_once(h, token=50)
    out = h.sched.schedule()
    [chunk] = out.chunks
    assert chunk.num_drafts == 6 and len(chunk.block_table) == h.kv.blocks_for(6 + 7) == 4
    req = h.reqs["a"]
    h.sched.update_from_output(out, {"a": 50})  # the last token's row drew 50: drafts' KV waits
    assert req.num_computed_tokens == 7 and req.output_token_ids == [50, 50]
    assert h.sched.accept_draft("a", 9)  # its last token, 50, is the first draft: that KV
    assert req.output_token_ids == [50, 50, 9] and req.num_computed_tokens == 8
    with pytest.raises(ValueError, match="no token awaiting its KV"):
        req.num_computed_tokens = 9
        h.sched.accept_draft("a", 9)
    req.num_computed_tokens = 8
    h.sched.end_verification("a")  # 9 tokens: the blocks for 9 positions kept, one freed
    assert h.kv.num_held_blocks("a") == h.kv.blocks_for(9) == 3
    assert h.kv.block_table("a") == chunk.block_table[:3]
    assert h.kv.stats().logical_slots == 8
    h.kv.check()


def test_a_draft_is_refused_once_the_request_stops_or_its_client_is_behind() -> None:
    h, _ = harness([50, 51, 52])
    h.add("a", 4, max_tokens=3)
    h.add("b", 4, max_tokens=10)
    decode_once(h)
    out = h.sched.schedule()
    h.sched.update_from_output(out, {"a": 7, "b": 7})
    assert h.sched.accept_draft("a", 8)  # a's third token: max_tokens
    assert h.reqs["a"].finish_reason is FinishReason.MAX_TOKENS
    before = list(h.reqs["a"].output_token_ids)
    assert not h.sched.accept_draft("a", 9) and h.reqs["a"].output_token_ids == before
    h.sched.set_backpressured("b", True)
    assert h.reqs["b"].status is S.BACKPRESSURED
    assert not h.sched.accept_draft("b", 9) and h.reqs["b"].output_token_ids == [7, 7]
    assert not h.sched.accept_draft("gone", 9)
    h.sched.end_verification("a")  # ended: reclaim frees it all, nothing to do here
    h.sched.set_backpressured("b", False)
    h.sched.abort("b")
    h.assert_drained()


def test_no_draft_for_a_prefill_chunk_of_one_token_and_none_without_both_parts() -> None:
    h, drafter = harness([50, 51], max_num_batched_tokens=4)
    h.add("a", 5, max_tokens=10)
    decode_once(h)  # 4 of the 5 prompt tokens
    out = decode_once(h)  # the last prompt token alone: a step of one token, but a prefill
    assert drafter.asked == [] and out.chunks[0].num_drafts == 0
    decode_once(h)
    assert drafter.asked == [("a", 3)]  # decoding now; the budget of 4 leaves 3
    no_drafter = Harness(speculative=SpeculativeConfig())  # speculation on, no draft source
    no_drafter.add("a", 4, max_tokens=10)
    for _ in range(3):
        assert all(c.num_drafts == 0 for c in decode_once(no_drafter).chunks)
    off = Harness()  # a draft source, speculation off
    off.sched.drafter = drafter
    off.add("a", 4, max_tokens=10)
    for _ in range(3):
        decode_once(off)
    assert drafter.asked == [("a", 3)]


def test_drafts_up_to_max_batch_and_down_to_one() -> None:
    h, drafter = harness([50, 51], max_batch=2)
    h.add("a", 4, max_tokens=3)
    h.add("b", 4, max_tokens=10)
    decode_once(h)
    h.sched.schedule()
    assert drafter.asked == [("a", 1), ("b", 8)]  # a: its 3rd token is its last


def test_every_block_past_the_next_token_goes_back_when_every_draft_is_rejected() -> None:
    h, _ = harness(list(range(100, 110)))
    h.add("a", 4, max_tokens=16)
    decode_once(h)
    out = decode_once(h)  # the last token and 10 drafts over positions 4..14: blocks 0..3
    assert out.chunks[0].num_drafts == 10
    assert h.kv.num_held_blocks("a") == h.kv.blocks_for(6) == 2
    assert h.kv.stats().in_use_blocks == 2
    h.kv.check()
    h.sched.end_verification("gone")  # unknown: nothing to do
    h.sched.abort("a")
    h.assert_drained()
