"""The workers' token streams without Ray: batches merge per attempt, the coordinator's inbox
paces its attempt and raises what ended it, and a real worker (EngineWorker, driven directly)
streams every attempt of a coordinator over one stream, takes over a lost stream with nothing
lost, and stops the attempts of a reader that left."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from cluster.token_stream import PAUSE_AT, RESUME_AT, Inbox, Outbox
from cluster.worker import EngineWorker
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.outputs import TokenDelta, TokenLogprobs
from engine.request import EngineRequest, FinishReason
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
CONFIG = EngineConfig(kv_cache_bytes=2**22, max_num_seqs=8, max_num_batched_tokens=128)


def test_batches_of_one_attempt_merge_in_order() -> None:
    lp = TokenLogprobs(logprob=-0.5, top=[(3, -0.5)], rank=1)
    first = TokenDelta("a", [1, 2], "ab", queue_time_s=0.25, logprobs=[lp, lp])
    snap_batch = TokenDelta("a", [3], "c", sampler_snapshot="snap", logprobs=[lp])  # type: ignore[arg-type]
    last = TokenDelta("a", [], "d", finished=True, finish_reason=FinishReason.MAX_TOKENS, seed=5)
    outbox = Outbox()
    for batch in (first, snap_batch, last):
        outbox.put("a@1", batch)
    outbox.put("b@1", TokenDelta("b", [9]))
    error = RuntimeError("transfer failed")
    outbox.put("b@1", error)
    outbox.put("b@1", TokenDelta("b", [10]))  # after an error: kept apart, in order
    assert outbox.ready.is_set()
    [(aid_a, [merged]), (aid_b, items_b)] = outbox.take()
    assert not outbox.ready.is_set() and outbox.take() == []
    assert (aid_a, aid_b) == ("a@1", "b@1")
    assert merged == TokenDelta(
        "a",
        [1, 2, 3],
        "abcd",
        finished=True,
        finish_reason=FinishReason.MAX_TOKENS,
        sampler_snapshot="snap",  # type: ignore[arg-type]
        logprobs=[lp, lp, lp],
        queue_time_s=0.25,
        seed=5,
    )
    assert items_b == [TokenDelta("b", [9]), error, TokenDelta("b", [10])]


def test_a_merged_snapshot_belongs_to_the_last_tokens_or_is_none() -> None:
    with_snap = TokenDelta("a", [1], sampler_snapshot="s1")  # type: ignore[arg-type]
    assert with_snap.then(TokenDelta("a", [2])).sampler_snapshot is None  # unknown after token 2
    assert with_snap.then(TokenDelta("a", [], "x")).sampler_snapshot == "s1"  # no new token


def test_an_inbox_paces_its_attempt_and_keeps_its_error() -> None:
    async def body() -> None:
        paced: list[bool] = []
        inbox = Inbox(paced.append)
        for i in range(PAUSE_AT + 3):
            inbox.put([TokenDelta("a", [i])])
        assert paced == [True]  # once, at PAUSE_AT
        got = [(await inbox.get()).token_ids[0] for _ in range(PAUSE_AT + 3 - RESUME_AT)]
        assert got == list(range(PAUSE_AT + 3 - RESUME_AT)) and paced == [True, False]
        waiter = asyncio.ensure_future(inbox.get())
        for _ in range(RESUME_AT):
            await inbox.get()
        await asyncio.sleep(0)
        assert not waiter.done()
        error = RuntimeError("gone")
        inbox.fail(error)
        for _ in range(3):  # it stays the answer
            with pytest.raises(RuntimeError, match="gone"):
                await (waiter if not waiter.done() else inbox.get())

    asyncio.run(asyncio.wait_for(body(), 10))


def attempt(rid: str, prompt: list[int], params: SamplingParams = GREEDY) -> EngineRequest:
    return EngineRequest(rid, tuple(prompt), params, attempt=1)


async def read_all(stream, expected: int) -> dict[str, list[int]]:  # type: ignore[no-untyped-def]
    """Tokens per attempt from a subscription until ``expected`` attempts finished."""
    tokens: dict[str, list[int]] = {}
    done = 0
    async for deliveries in stream:
        for aid, items in deliveries:
            for item in items:
                assert isinstance(item, TokenDelta), item
                tokens.setdefault(aid, []).extend(item.token_ids)
                done += item.finished
        if done == expected:
            return tokens
    raise AssertionError("stream ended")


def test_a_worker_streams_every_attempt_of_a_coordinator_over_one_stream(
    test_llama: Path, torch_threads: None
) -> None:
    prompts = {f"r{i}": [(7 * i + j) % 200 + 3 for j in range(20 + i)] for i in range(3)}
    reference = LLMEngine.from_checkpoint(test_llama, CONFIG)
    outs = reference.generate(list(prompts.values()), GREEDY)
    expected = {f"{rid}@1": out.token_ids for rid, [out] in zip(prompts, outs, strict=True)}
    worker = EngineWorker("w", "a", str(test_llama), "m", CONFIG)

    async def body() -> None:
        await worker.ready()
        stream = worker.subscribe("c1")
        for rid, prompt in prompts.items():
            await worker.start_generate(attempt(rid, prompt), "c1")
        got = await read_all(stream, len(prompts))
        assert got == expected
        # A lost stream is taken over by the next one, with what it had not sent.
        await worker.start_generate(attempt("late", prompts["r0"]), "c1")
        again = worker.subscribe("c1")
        late = await read_all(again, 1)
        assert late == {"late@1": expected["r0@1"]}
        await stream.aclose()  # the old one ending cancels nothing: it was taken over
        await worker.start_generate(attempt("more", prompts["r1"]), "c1")
        assert await read_all(again, 1) == {"more@1": expected["r1@1"]}
        # A reader that leaves: its attempts stop, their KV is freed.
        endless = dataclasses.replace(GREEDY, max_tokens=10_000)
        long = attempt("long", prompts["r2"], endless)
        await worker.start_generate(long, "c1")
        async for deliveries in again:
            if any(aid == "long@1" for aid, _ in deliveries):
                break
        await again.aclose()
        stats = await asyncio.wait_for(worker.check_idle(), 30)
        assert stats.in_use_blocks == 0
        [record] = [r for r in await worker.records() if r.request_id == "long@1"]
        assert record.finish_reason is FinishReason.CANCELLED

    try:
        asyncio.run(asyncio.wait_for(body(), 120))
    finally:
        worker.engine.shutdown()
