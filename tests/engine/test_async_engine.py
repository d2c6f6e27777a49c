"""AsyncLLMEngine: streams equal the offline engine's output, cancellation frees KV within a
tick, backpressure pauses slow consumers (bounded buffers), engine death and shutdown fail
every consumer with EngineDeadError. Every test ends with the leak check.

No sleeps decide anything: waits are on events, on ``wait_idle`` (the engine thread asleep, so
its state can be read), or polls of ``records()``, all under one generous ``asyncio.wait_for``.
"""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any

import pytest
from helpers import assert_engine_clean

from engine import request as engine_request
from engine.async_engine import AsyncLLMEngine, EngineDeadError
from engine.config import EngineConfig
from engine.engine import LLMEngine, RequestRejected
from engine.outputs import BackpressureStats, TokenDelta
from engine.request import FinishReason, RequestStatus, TerminalRecord
from engine.sampling_params import InvalidSamplingParams, SamplingParams

CONFIG = EngineConfig(dtype="float32", kv_cache_bytes=4 * 2**20)
TIMEOUT_S = 120.0  # bounds every test body; nothing waits on time otherwise


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


@pytest.fixture
def engine(test_llama: Path) -> LLMEngine:
    return LLMEngine.from_checkpoint(test_llama, CONFIG)


def reference(path: Path, prompts: list, params: list[SamplingParams]) -> list[list[tuple]]:
    """(token_ids, text, finish_reason) of each sample, from the offline engine."""
    outs = LLMEngine.from_checkpoint(path, CONFIG).generate(prompts, params)
    return [[(c.token_ids, c.text, c.finish_reason) for c in per_prompt] for per_prompt in outs]


def by_sample(outs: list[TokenDelta]) -> list[tuple]:
    """Concatenate a stream's deltas per sample index; each sample's last delta is its only
    finished one."""
    samples: dict[int, list[TokenDelta]] = {}
    for o in outs:
        samples.setdefault(o.index, []).append(o)
    result = []
    for _, deltas in sorted(samples.items()):
        assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
        tokens = [t for d in deltas for t in d.token_ids]
        result.append((tokens, "".join(d.text for d in deltas), deltas[-1].finish_reason))
    return result


async def collect(gen: AsyncIterator[TokenDelta]) -> list[TokenDelta]:
    return [o async for o in gen]


async def wait_record(aengine: AsyncLLMEngine, rid: str) -> TerminalRecord:
    while True:
        for r in aengine.records():
            if r.request_id == rid:
                return r
        await asyncio.sleep(0.005)


def assert_idle_kv(aengine: AsyncLLMEngine) -> None:
    s = aengine.kv_stats()
    assert s.in_use_blocks == 0 and s.reserved_blocks == 0
    assert s.free_blocks + s.cached_blocks == s.total_blocks


PROMPTS: list[str | list[int]] = [
    "The quick brown fox",
    list(range(100, 117)),  # 17 tokens: one past a block boundary
    "Once upon a time in a land far away, there lived",
    [7],
    "hello world",
    list(range(300, 340)),
    "A serving engine schedules",
    "What",
]
PARAMS = [greedy(n) for n in (12, 20, 5, 30, 9, 16, 25)] + [
    SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=12)
]


def test_concurrent_staggered_streams_match_offline(engine: LLMEngine, test_llama: Path) -> None:
    expected = reference(test_llama, PROMPTS, PARAMS)

    async def main() -> list[list[TokenDelta]]:
        async with AsyncLLMEngine(engine) as aengine:
            progressed = [asyncio.Event() for _ in PROMPTS]

            async def consume(i: int) -> list[TokenDelta]:
                if i:  # start once the previous request is mid-stream
                    await progressed[i - 1].wait()
                outs = []
                async for o in aengine.generate(
                    aengine.make_request(PROMPTS[i], PARAMS[i], request_id=f"r{i}")
                ):
                    outs.append(o)
                    if len(outs) == 2:
                        progressed[i].set()
                progressed[i].set()
                return outs

            tasks = [asyncio.create_task(consume(i)) for i in range(len(PROMPTS))]
            results = await asyncio.gather(*tasks)
            await aengine.wait_idle()
            assert_idle_kv(aengine)
            records = {r.request_id: r for r in aengine.records()}
            assert set(records) == {f"r{i}" for i in range(8)} | {"r7#1"}
            assert {r.status for r in records.values()} == {RequestStatus.FINISHED}
            return results

    results = run(main())
    for outs, exp in zip(results, expected, strict=True):
        assert by_sample(outs) == exp
    assert [len(s) for s in expected] == [1] * 7 + [2]
    assert_engine_clean(engine)


def test_a_long_running_engine_keeps_only_the_latest_records(
    test_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every request writes a terminal record; a server keeps the latest RECORDS_KEPT of them
    (in the scheduler and in the published copy), not one per request forever."""
    monkeypatch.setattr(engine_request, "RECORDS_KEPT", 3)
    engine = LLMEngine.from_checkpoint(test_llama, CONFIG)

    async def main() -> list[TerminalRecord]:
        async with AsyncLLMEngine(engine) as aengine:
            for i in range(7):
                await collect(
                    aengine.generate(aengine.make_request([1, 2, 3], greedy(2), request_id=f"q{i}"))
                )
            await aengine.wait_idle()
            return aengine.records()

    records = run(main())
    assert [r.request_id for r in records] == ["q4", "q5", "q6"]
    assert engine.scheduler.records.total == 7 and len(engine.scheduler.records) == 3


def test_cancellation_frees_kv_within_a_tick(engine: LLMEngine) -> None:
    params = greedy(500)

    async def main() -> None:
        async with AsyncLLMEngine(engine) as aengine:
            # (a) aclose() after three deltas.
            gen = aengine.generate(
                aengine.make_request("The quick brown fox", params, request_id="aclose")
            )
            for _ in range(3):
                await anext(gen)
            await gen.aclose()
            # (b) the consuming task is cancelled while it waits for the next delta.
            got3 = asyncio.Event()

            async def consume() -> None:
                received = 0
                async for _ in aengine.generate(
                    aengine.make_request(list(range(50, 90)), params, request_id="task")
                ):
                    received += 1
                    if received == 3:
                        got3.set()

            task = asyncio.create_task(consume())
            await got3.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # (c) break, then the generator is garbage (the loop's finalizer closes it).
            dropped = aengine.generate(
                aengine.make_request("hello world", params, request_id="dropped")
            )
            async for _ in dropped:
                break
            del dropped
            gc.collect()

            for rid in ("aclose", "task", "dropped"):
                record = await wait_record(aengine, rid)
                assert record.status is RequestStatus.CANCELLED
                assert record.finish_reason is FinishReason.CANCELLED
                assert 1 <= record.num_generated < 500
            await aengine.wait_idle()
            assert_idle_kv(aengine)

    run(main())
    assert_engine_clean(engine)


def test_admission_errors_raise_at_first_iteration(engine: LLMEngine, test_llama: Path) -> None:
    too_long = [5] * (engine.max_model_len + 1)
    [[ok_expected]] = reference(test_llama, ["still serving"], [greedy(6)])

    async def main() -> None:
        async with AsyncLLMEngine(engine) as aengine:
            with pytest.raises(RequestRejected, match="max_model_len"):
                await anext(
                    aengine.generate(aengine.make_request(too_long, greedy(4), request_id="long"))
                )
            with pytest.raises(InvalidSamplingParams, match="top_k"):
                await anext(
                    aengine.generate(aengine.make_request("hi", SamplingParams(top_k=5000)))
                )
            with pytest.raises(ValueError, match="vocabulary"):
                await anext(
                    aengine.generate(
                        aengine.make_request([engine.model_config.vocab_size], greedy(4))
                    )
                )
            with pytest.raises(ValueError, match="reserved"):
                await anext(
                    aengine.generate(aengine.make_request("hi", greedy(4), request_id="a#1"))
                )
            # A duplicate of a request in flight is refused; the original is unharmed.
            first = aengine.generate(
                aengine.make_request("still serving", greedy(6), request_id="dup")
            )
            head = await anext(first)
            with pytest.raises(ValueError, match="duplicate"):
                await anext(
                    aengine.generate(aengine.make_request("other", greedy(4), request_id="dup"))
                )
            outs = [head, *await collect(first)]
            assert by_sample(outs) == [ok_expected]
            await aengine.wait_idle()
            statuses = {r.request_id: r.status for r in aengine.records()}
            assert statuses == {"long": RequestStatus.REJECTED, "dup": RequestStatus.FINISHED}
            assert_idle_kv(aengine)

    run(main())
    assert_engine_clean(engine)


def test_backpressure_pauses_slow_consumer_only(engine: LLMEngine, test_llama: Path) -> None:
    cap = 8
    # The fast request makes fewer entries than the bound, so it cannot pause however far its
    # reader lags behind the engine thread (a loaded CI box lagged 8 ticks and paused it once).
    fast_tokens = cap - 1
    prompts = ["The quick brown fox", "Once upon a time"]
    slow_exp, fast_exp = reference(test_llama, prompts, [greedy(40), greedy(fast_tokens)])

    async def main() -> None:
        async with AsyncLLMEngine(engine, max_buffered_outputs=cap) as aengine:
            slow = aengine.generate(aengine.make_request(prompts[0], greedy(40), request_id="slow"))
            slow_outs = [await anext(slow)]
            await aengine.wait_idle()  # the engine thread sleeps: the slow request is paused
            req = engine.scheduler.get_request("slow")
            assert req is not None and req.status is RequestStatus.BACKPRESSURED
            # The fast request runs to the end while the slow one stays paused, unread.
            fast = aengine.generate(aengine.make_request(prompts[1], greedy(fast_tokens)))
            assert by_sample(await collect(fast)) == fast_exp
            await aengine.wait_idle()
            assert req.status is RequestStatus.BACKPRESSURED
            buffered = req.num_generated - len(slow_outs)
            assert buffered in (cap - 1, cap)  # cap - 1 if the first read came after the pause
            assert aengine.backpressure_stats() == BackpressureStats(1, 0, cap)

            # Read one delta at a time: paused while the buffer holds >= cap / 2 ...
            while buffered >= cap // 2:
                slow_outs.append(await anext(slow))
                buffered -= 1
                await aengine.wait_idle()
                resumed = buffered < cap // 2
                assert aengine.backpressure_stats() == BackpressureStats(
                    1 + resumed, int(resumed), cap
                )
            # ... resumed below half, it refilled to exactly the bound and paused again.
            assert req.status is RequestStatus.BACKPRESSURED
            assert req.num_generated - len(slow_outs) == cap

            slow_outs += await collect(slow)
            assert by_sample(slow_outs) == slow_exp
            assert aengine.backpressure_stats().max_buffered == cap
            await aengine.wait_idle()
            assert_idle_kv(aengine)

    run(main())
    assert_engine_clean(engine)


def test_abort_while_paused_folds_final_delta_into_full_buffer(
    engine: LLMEngine, test_llama: Path
) -> None:
    [[(tokens, _, _)]] = reference(test_llama, ["hello world"], [greedy(30)])

    async def main() -> None:
        async with AsyncLLMEngine(engine, max_buffered_outputs=1) as aengine:
            gen = aengine.generate(aengine.make_request("hello world", greedy(30), request_id="p"))
            first = await anext(gen)  # empties the buffer: resumed, refilled, paused again
            await aengine.wait_idle()
            assert aengine.backpressure_stats() == BackpressureStats(2, 1, 1)
            await aengine.abort("p")
            await wait_record(aengine, "p")
            rest = await collect(gen)
            # The abort's final delta was merged into the one buffered entry: bound held.
            assert [(o.token_ids, o.finished, o.finish_reason) for o in [first, *rest]] == [
                (tokens[:1], False, None),
                (tokens[1:2], True, FinishReason.CANCELLED),
            ]
            assert aengine.backpressure_stats().max_buffered == 1
            [record] = aengine.records()
            assert record.status is RequestStatus.CANCELLED and record.num_generated == 2
            assert_idle_kv(aengine)

    run(main())
    assert_engine_clean(engine)


def test_deadline_of_paused_request_wakes_the_engine(engine: LLMEngine) -> None:
    async def main() -> None:
        async with AsyncLLMEngine(engine, max_buffered_outputs=1) as aengine:
            deadline = time.time() + 1.0
            gen = aengine.generate(
                aengine.make_request("hello", greedy(3000), request_id="d", deadline=deadline)
            )
            await anext(gen)  # then nobody reads: only the deadline can end it
            record = await wait_record(aengine, "d")
            assert record.status is RequestStatus.TIMED_OUT
            outs = await collect(gen)
            assert outs[-1].finished and outs[-1].finish_reason is FinishReason.DEADLINE
            await aengine.wait_idle()
            assert_idle_kv(aengine)

    run(main())
    assert_engine_clean(engine)


def test_a_paused_request_with_a_far_deadline_does_not_break_the_engine(
    engine: LLMEngine,
) -> None:
    """A deadline past what a thread may wait (a client's 1e308 s timeout) sleeps the engine
    at most threading.TIMEOUT_MAX, not an OverflowError that fails every request."""

    async def main() -> None:
        async with AsyncLLMEngine(engine, max_buffered_outputs=1) as aengine:
            gen = aengine.generate(
                aengine.make_request("hello", greedy(3000), request_id="far", deadline=1.7e308)
            )
            await anext(gen)  # nobody reads on: the engine sleeps until the deadline
            await asyncio.sleep(0.3)
            other = aengine.generate(aengine.make_request("hi", greedy(4), request_id="next"))
            outs = await collect(other)
            assert outs[-1].finished and outs[-1].finish_reason is FinishReason.MAX_TOKENS
            await aengine.wait_idle()  # asleep, "far" paused: closing it must abort it at once
            await gen.aclose()
            await aengine.wait_idle()
            assert_idle_kv(aengine)

    run(main())
    assert_engine_clean(engine)


def test_engine_failure_fails_every_consumer(engine: LLMEngine) -> None:
    ids = {"f0", "f1", "f2"}
    execute = engine.runner.execute
    raised: list[bool] = []

    def generated(rid: str) -> int:
        req = engine.scheduler.get_request(rid)
        return 0 if req is None else req.num_generated

    def fail_once_all_decode(out):  # raise once, when every request has streamed a token
        if not raised and all(generated(rid) >= 1 for rid in ids):
            raised.append(True)
            raise RuntimeError("injected runner fault")
        return execute(out)

    engine.runner.execute = fail_once_all_decode  # type: ignore[method-assign]

    async def main() -> None:
        async with AsyncLLMEngine(engine) as aengine:

            async def consume(rid: str) -> int:
                received = 0
                with pytest.raises(EngineDeadError, match="injected runner fault") as err:
                    async for _ in aengine.generate(
                        aengine.make_request(f"prompt {rid}", greedy(200), request_id=rid)
                    ):
                        received += 1
                assert isinstance(err.value.__cause__, RuntimeError)
                return received

            received = await asyncio.gather(*(consume(rid) for rid in sorted(ids)))
            assert all(n >= 1 for n in received)  # deltas buffered before the fault still arrive
            with pytest.raises(EngineDeadError):
                await anext(aengine.generate(aengine.make_request("after", greedy(4))))
            await aengine.abort("f0")  # a no-op now, not an error
            await aengine.wait_idle()
            records = aengine.records()
            assert {r.request_id for r in records} == ids
            for r in records:
                assert r.status is RequestStatus.FAILED and "injected" in (r.error or "")
            assert_idle_kv(aengine)

    run(main())
    assert raised == [True]
    assert_engine_clean(engine)


def test_shutdown_fails_requests_in_flight(engine: LLMEngine) -> None:
    async def main() -> AsyncLLMEngine:
        aengine = AsyncLLMEngine(engine)
        started = [asyncio.Event() for _ in range(3)]

        async def consume(i: int) -> None:
            with pytest.raises(EngineDeadError, match="^shutdown$"):
                async for _ in aengine.generate(
                    aengine.make_request(f"story {i}", greedy(500), request_id=f"s{i}")
                ):
                    started[i].set()

        tasks = [asyncio.create_task(consume(i)) for i in range(3)]
        for event in started:
            await event.wait()
        aengine.shutdown()
        await asyncio.gather(*tasks)
        with pytest.raises(EngineDeadError, match="shutdown"):
            await anext(aengine.generate(aengine.make_request("late", greedy(4))))
        await aengine.wait_idle()
        aengine.shutdown()  # idempotent
        return aengine

    aengine = run(main())
    records = aengine.records()
    assert sorted(r.request_id for r in records) == ["s0", "s1", "s2"]
    assert {r.status for r in records} == {RequestStatus.FAILED}
    assert {r.error for r in records} == {"shutdown"}
    assert_idle_kv(aengine)
    assert_engine_clean(engine)


def test_num_threads_gives_the_engine_thread_the_only_openmp_team(test_llama: Path) -> None:
    """With EngineConfig.num_threads the checkpoint loads single-threaded and the engine thread
    computes with num_threads (run in a child process: it changes torch's threads for good)."""
    script = f"""
import asyncio, torch
from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
torch.set_num_threads(2)
engine = AsyncLLMEngine.from_checkpoint({str(test_llama)!r}, EngineConfig(num_threads=3))
async def main():
    return await engine.call(lambda e: torch.get_num_threads())
print(torch.get_num_threads(), asyncio.run(main()))
engine.shutdown()
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split()[-2:] == ["1", "3"], out.stderr
