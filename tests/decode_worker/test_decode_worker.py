"""The decode worker's logic, driven directly (no Ray): it continues an attempt a prefill worker
in the same process computed (its KV pulled over gRPC on loopback, the first token handed off)
with exactly the offline engine's tokens and acks the pull; a pull from a dead address fails
the attempt with KVPullFailed naming the worker it came from. Every pool ends at baseline."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncGenerator, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import eventually_idle

from cluster.worker import EngineWorker
from contracts.messages import Delivery, KVPullFailed, KVSource
from decode_worker.worker import DecodeWorker
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.outputs import TokenDelta
from engine.request import EngineRequest, FinishReason, RequestStatus
from engine.sampling_params import SamplingParams
from kv_transfer.exporter import ReleaseReason
from prefill_worker.worker import PrefillWorker

pytestmark = pytest.mark.e2e  # KV over gRPC on loopback; no Ray

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
CONFIG = EngineConfig(kv_cache_bytes=2**22, max_num_seqs=4, max_num_batched_tokens=128)
PROMPT = tuple((5 * j) % 200 + 3 for j in range(37))  # 3 blocks of 16, the last one partial
ATTEMPT = EngineRequest("r", PROMPT, GREEDY, attempt=1)


@pytest.fixture
def loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    """The workers' KV sockets on 127.0.0.1 (a Ray node's address otherwise)."""
    monkeypatch.setattr(EngineWorker, "host_address", staticmethod(lambda: "127.0.0.1"))


@pytest.fixture
def decode(test_llama: Path, torch_threads: None, loopback: None) -> Iterator[DecodeWorker]:
    worker = DecodeWorker("decode-0", "a", str(test_llama), "m", CONFIG)  # no router
    try:
        yield worker
    finally:
        worker.transport.close()
        worker.engine.shutdown()


@pytest.fixture
def prefill(test_llama: Path, torch_threads: None, loopback: None) -> Iterator[PrefillWorker]:
    worker = PrefillWorker("prefill-0", "a", str(test_llama), "m", CONFIG)
    try:
        yield worker
    finally:
        worker.server.stop(0)
        worker.engine.shutdown()


async def items_of(
    stream: AsyncGenerator[list[Delivery], None], attempt_id: str
) -> list[TokenDelta | Exception]:
    """What the consumer's stream carries for ``attempt_id`` until its last delta or its error."""
    got: list[TokenDelta | Exception] = []
    async for deliveries in stream:
        for aid, items in deliveries:
            assert aid == attempt_id
            got.extend(items)
        last = got[-1] if got else None
        if isinstance(last, Exception) or (isinstance(last, TokenDelta) and last.finished):
            return got
    raise AssertionError("the stream ended")


def test_decode_continues_the_prefill_with_the_offline_tokens(
    prefill: PrefillWorker, decode: DecodeWorker, test_llama: Path
) -> None:
    [[out]] = LLMEngine.from_checkpoint(test_llama, CONFIG).generate([list(PROMPT)], GREEDY)

    async def body() -> None:
        await prefill.ready()
        await decode.ready()
        stream = decode.subscribe("c")
        # The coordinator's walk (cluster/coordinator.py): source, decode, first token, hand-off.
        handing = prefill.prefill(ATTEMPT)
        source = await anext(handing)
        assert isinstance(source, KVSource)
        await decode.start_decode(ATTEMPT, source, "c")
        first = await anext(handing)
        assert isinstance(first, TokenDelta) and first.finish_reason is FinishReason.HANDED_OFF
        await decode.handoff(ATTEMPT.key, replace(first, prompt_logprobs=None))
        items = await items_of(stream, ATTEMPT.key)
        rest = [d for d in items if isinstance(d, TokenDelta)]
        assert rest == items  # no error
        assert first.token_ids + [t for d in rest for t in d.token_ids] == out.token_ids
        assert rest[-1].finish_reason is FinishReason.MAX_TOKENS
        with pytest.raises(StopAsyncIteration):  # the decode worker's ack ended the lease
            await anext(handing)
        assert prefill.registry.releases == {ReleaseReason.ACKED: 1}
        [record] = await decode.transfer_records()
        assert (record.attempt_id, record.transport) == (ATTEMPT.key, "grpc")
        await stream.aclose()
        await decode.check_idle()
        await eventually_idle(prefill.check_idle)

    asyncio.run(asyncio.wait_for(body(), 120))


def test_a_pull_from_a_dead_address_fails_naming_the_source_worker(decode: DecodeWorker) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = KVSource("prefill-9", f"127.0.0.1:{s.getsockname()[1]}")

    async def body() -> None:
        stream = decode.subscribe("c")
        await decode.start_decode(ATTEMPT, dead, "c")
        [error] = await items_of(stream, ATTEMPT.key)
        assert isinstance(error, KVPullFailed)
        assert (error.worker, error.dead) == ("prefill-9", True)
        assert "prefill-9" in str(error)
        await stream.aclose()
        await decode.check_idle()  # the blocks reserved for the import are freed
        [record] = await decode.records()
        assert (record.request_id, record.status) == (ATTEMPT.key, RequestStatus.FAILED)

    asyncio.run(asyncio.wait_for(body(), 60))


async def held(decode: DecodeWorker) -> tuple[int, int]:
    """(requests in the decode engine, KV blocks they hold), read on the engine thread."""
    return await decode.engine.call(lambda e: (e.scheduler.num_running, e.kv.stats().in_use_blocks))


@pytest.mark.parametrize("runs_out", [False, True], ids=["used", "ttl-races-the-start"])
def test_a_reservation_holds_slot_and_blocks_before_the_prefill_and_the_decode_uses_them(
    prefill: PrefillWorker, decode: DecodeWorker, test_llama: Path, runs_out: bool
) -> None:
    """The coordinator's order (router.reserve_decode_first): reserve on the decode worker,
    then prefill. The slot and the prompt's blocks are held before any prefill work; the
    decode takes that reservation (one engine request, one terminal record) and continues
    exactly. ``runs_out``: a prefill slower than the reservation's TTL, whose release (the
    timer's callback) races start_decode: the import waits until the released request is
    reclaimed -- its id would clash with the ending one -- then decodes exactly (the released
    reservation's CANCELLED record, then the attempt's own)."""
    [[out]] = LLMEngine.from_checkpoint(test_llama, CONFIG).generate([list(PROMPT)], GREEDY)

    async def body() -> None:
        await prefill.ready()
        await decode.ready()
        stream = decode.subscribe("c")
        await decode.reserve(ATTEMPT)
        assert await held(decode) == (1, 3)  # 37 prompt tokens: 3 blocks of 16
        handing = prefill.prefill(ATTEMPT)
        source = await anext(handing)
        releasing = asyncio.ensure_future(decode._release(ATTEMPT.key)) if runs_out else None
        await decode.start_decode(ATTEMPT, source, "c")
        first = await anext(handing)
        await decode.handoff(ATTEMPT.key, replace(first, prompt_logprobs=None))
        items = await items_of(stream, ATTEMPT.key)
        rest = [d for d in items if isinstance(d, TokenDelta)]
        assert rest == items  # no error
        assert first.token_ids + [t for d in rest for t in d.token_ids] == out.token_ids
        if releasing is not None:
            await releasing
        await stream.aclose()
        await decode.check_idle()
        await eventually_idle(prefill.check_idle)
        records = [(r.request_id, r.status) for r in await decode.records()]
        released = [(ATTEMPT.key, RequestStatus.CANCELLED)] if runs_out else []
        assert records == [*released, (ATTEMPT.key, RequestStatus.FINISHED)]

    asyncio.run(asyncio.wait_for(body(), 120))


def test_a_stopped_reservation_gives_back_what_it_held_or_waited_for(
    test_llama: Path, torch_threads: None, loopback: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One batch slot: the first reservation holds it, the second waits for room. Stopping the
    waiting one ends its wait (nothing held); stopping the held one frees slot and blocks; both
    end CANCELLED, one record each; a reservation nobody uses is released after its TTL."""
    one = CONFIG.model_copy(update={"max_num_seqs": 1})
    decode = DecodeWorker("decode-0", "a", str(test_llama), "m", one)
    second = replace(ATTEMPT, attempt=2)

    async def body() -> None:
        await decode.ready()
        await decode.reserve(ATTEMPT)
        waiting = asyncio.ensure_future(decode.reserve(second))
        await asyncio.sleep(0.5)
        assert not waiting.done() and await held(decode) == (1, 3)
        await decode.stop(second.key)
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert await held(decode) == (1, 3)
        await decode.stop(ATTEMPT.key)
        await decode.check_idle()
        records = {r.request_id: r.status for r in await decode.records()}
        assert records == {ATTEMPT.key: RequestStatus.CANCELLED}  # the waiting one: never in
        monkeypatch.setattr("decode_worker.worker.RESERVATION_TTL_S", 0.3)
        third = replace(ATTEMPT, attempt=3)
        await decode.reserve(third)
        assert await held(decode) == (1, 3)
        await asyncio.sleep(0.6)  # past the TTL: its coordinator never came back
        await decode.check_idle()

    try:
        asyncio.run(asyncio.wait_for(body(), 60))
    finally:
        decode.transport.close()
        decode.engine.shutdown()


def test_an_import_with_no_reservation_parks_until_room_frees_then_decodes_exactly(
    test_llama: Path, torch_threads: None, loopback: None
) -> None:
    """The park path: a decode worker restarted after an attempt's reservation has none for it
    when start_decode comes, and here its only batch slot is held (another reservation). The
    import parks -- counted once in ``imports_parked``, no capacity error, the KV left with the
    prefill worker -- and once the slot frees it is admitted, pulls, and decodes exactly the
    offline tokens; the holder ends CANCELLED, the parked attempt FINISHED, pools at baseline."""
    one = CONFIG.model_copy(update={"max_num_seqs": 1})
    [[out]] = LLMEngine.from_checkpoint(test_llama, one).generate([list(PROMPT)], GREEDY)
    decode = DecodeWorker("decode-0", "a", str(test_llama), "m", one)
    prefill = PrefillWorker("prefill-0", "a", str(test_llama), "m", one)
    holder = replace(ATTEMPT, request_id="h")

    async def body() -> None:
        await prefill.ready()
        await decode.ready()
        stream = decode.subscribe("c")
        await decode.reserve(holder)  # the only slot
        handing = prefill.prefill(ATTEMPT)
        source = await anext(handing)
        await decode.start_decode(ATTEMPT, source, "c")  # no reservation for it here
        first = await anext(handing)
        await decode.handoff(ATTEMPT.key, replace(first, prompt_logprobs=None))
        await asyncio.sleep(0.5)
        assert decode.engine.imports_parked == 1
        assert await held(decode) == (1, 3)  # still only the holder
        await decode.stop(holder.key)
        items = await items_of(stream, ATTEMPT.key)
        rest = [d for d in items if isinstance(d, TokenDelta)]
        assert rest == items  # no error
        assert first.token_ids + [t for d in rest for t in d.token_ids] == out.token_ids
        assert decode.engine.imports_parked == 1
        await stream.aclose()
        await decode.check_idle()
        await eventually_idle(prefill.check_idle)
        records = [(r.request_id, r.status) for r in await decode.records()]
        assert records == [
            (holder.key, RequestStatus.CANCELLED),
            (ATTEMPT.key, RequestStatus.FINISHED),
        ]

    try:
        asyncio.run(asyncio.wait_for(body(), 120))
    finally:
        decode.transport.close()
        decode.engine.shutdown()
        prefill.server.stop(0)
        prefill.engine.shutdown()


def test_a_consumer_whose_stream_ends_has_its_attempts_here_cancelled(
    decode: DecodeWorker,
) -> None:
    """A coordinator that stops reading its token stream (closed, or its process gone) has
    every attempt it started here cancelled -- nobody would read their tokens -- while another
    consumer's attempt runs on; a new stream of the same consumer would take over instead."""
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    mine, theirs = EngineRequest("a", PROMPT, long, attempt=1), EngineRequest("b", PROMPT, GREEDY)

    async def body() -> None:
        await decode.ready()
        gone, other = decode.subscribe("gone"), decode.subscribe("other")
        await decode.start_generate(mine, "gone")
        await decode.start_generate(theirs, "other")
        [(aid, _)] = await anext(gone)  # tokens flow to it
        assert aid == mine.key
        await gone.aclose()
        items = await items_of(other, theirs.key)
        assert all(isinstance(d, TokenDelta) for d in items)
        await other.aclose()
        await decode.check_idle()
        records = {r.request_id: r.status for r in await decode.records()}
        assert records == {mine.key: RequestStatus.CANCELLED, theirs.key: RequestStatus.FINISHED}

    asyncio.run(asyncio.wait_for(body(), 60))
