"""The prefill worker's logic, driven directly (no Ray): ``prefill`` yields where to pull the KV
from, then the first token as one HANDED_OFF delta -- the offline engine's -- and holds the
lease until the puller acks or the attempt is aborted; then every pool is back to baseline.
The transfer fault hook is asked with the attempt number of the export it serves."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path

import pytest
from helpers import eventually_idle

from cluster.worker import EngineWorker
from contracts.faults import Fault, FaultAction, FaultPlan, FaultPoint
from contracts.messages import KVSource
from contracts.roles import Transport
from engine.block_pool import KVInvariantError
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.outputs import TokenDelta
from engine.request import EngineRequest, FinishReason
from engine.sampling_params import SamplingParams
from kv_transfer.errors import KVIntegrityError
from kv_transfer.exporter import ReleaseReason
from kv_transfer.format import LayerChunk, TransferKey
from kv_transfer.transport import KVTransport, make_transport
from prefill_worker.worker import PrefillWorker

pytestmark = pytest.mark.e2e  # its KV transfer server listens on loopback (gRPC); no Ray

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
CONFIG = EngineConfig(kv_cache_bytes=2**22, max_num_seqs=4, max_num_batched_tokens=128)
PROMPT = tuple((5 * j) % 200 + 3 for j in range(37))  # 3 blocks of 16, the last one partial


@pytest.fixture
def expected(test_llama: Path, torch_threads: None) -> list[int]:
    """The prompt's greedy tokens from an offline engine."""
    [[out]] = LLMEngine.from_checkpoint(test_llama, CONFIG).generate([list(PROMPT)], GREEDY)
    return list(out.token_ids)


@pytest.fixture
def prefill(
    test_llama: Path, torch_threads: None, monkeypatch: pytest.MonkeyPatch
) -> Iterator[PrefillWorker]:
    monkeypatch.setattr(EngineWorker, "host_address", staticmethod(lambda: "127.0.0.1"))
    worker = PrefillWorker("prefill-0", "a", str(test_llama), "m", CONFIG)  # no router
    try:
        yield worker
    finally:
        worker.server.stop(0)
        worker.engine.shutdown()


@pytest.fixture
def client() -> Iterator[KVTransport]:
    transport = make_transport(Transport.GRPC, puller_id="decode-0")
    yield transport
    transport.close()


def attempt(number: int = 1) -> EngineRequest:
    return EngineRequest("r", PROMPT, GREEDY, attempt=number)


async def handed_off(
    worker: PrefillWorker, request: EngineRequest
) -> tuple[AsyncGenerator[KVSource | TokenDelta, None], KVSource, TokenDelta]:
    """Start ``request``'s prefill: its stream, the KV source and the first token."""
    stream = worker.prefill(request)
    source = await anext(stream)
    first = await anext(stream)
    assert isinstance(source, KVSource) and isinstance(first, TokenDelta)
    return stream, source, first


async def pull(
    client: KVTransport, source: KVSource, request: EngineRequest, worker: PrefillWorker
) -> list[int]:
    """Pull the attempt's KV as a decode worker would; the layers received, in order."""
    layers: list[LayerChunk] = []
    key, layout = TransferKey.of(request), worker.engine.kv.layout
    header = await asyncio.to_thread(client.pull, source.address, key, layout, layers.append, None)
    assert header.num_tokens == len(PROMPT)
    return sorted({chunk.layer for chunk in layers})


def test_prefill_hands_off_the_first_token_and_holds_the_lease_until_the_ack(
    prefill: PrefillWorker, client: KVTransport, expected: list[int]
) -> None:
    request = attempt()

    async def body() -> None:
        await prefill.ready()
        stream, source, first = await handed_off(prefill, request)
        assert source == KVSource("prefill-0", str(prefill.server.address))
        assert first.token_ids == expected[:1]
        assert (first.finish_reason, first.finished) == (FinishReason.HANDED_OFF, True)
        # The lease keeps the prompt's blocks: the leak check fails until it ends.
        assert (await prefill.kv_stats()).in_use_blocks == 3
        with pytest.raises(KVInvariantError):
            await prefill.check_idle()
        layers = await pull(client, source, request, prefill)
        assert layers == list(range(prefill.engine.kv.layout.num_layers))
        key = TransferKey.of(request)
        assert await asyncio.to_thread(client.release, source.address, key, ReleaseReason.ACKED)
        with pytest.raises(StopAsyncIteration):  # the ack ended the lease: prefill returns
            await anext(stream)
        assert prefill.registry.releases[ReleaseReason.ACKED] == 1
        await eventually_idle(prefill.check_idle)

    asyncio.run(asyncio.wait_for(body(), 120))


def test_an_aborted_hand_off_releases_the_lease(
    prefill: PrefillWorker, expected: list[int]
) -> None:
    """The coordinator gives up after the first token (its client left): closing the prefill's
    stream releases the lease, ABORTED, without a puller."""

    async def body() -> None:
        stream, _, first = await handed_off(prefill, attempt())
        assert first.token_ids == expected[:1]
        await stream.aclose()
        assert prefill.registry.releases[ReleaseReason.ABORTED] == 1
        await eventually_idle(prefill.check_idle)

    asyncio.run(asyncio.wait_for(body(), 120))


def test_the_transfer_fault_hook_gets_the_attempt_number_of_the_export(
    prefill: PrefillWorker, client: KVTransport, expected: list[int]
) -> None:
    """A corruption armed for attempt 2 leaves attempt 1's transfer whole and breaks
    attempt 2's (the puller's checksums catch it)."""
    fault = Fault(FaultPoint.TRANSFER_CHUNK, FaultAction.CORRUPT, at=1, attempt=2)
    prefill.faults = FaultPlan([fault])

    async def body() -> None:
        for number in (1, 2):
            request = attempt(number)
            stream, source, first = await handed_off(prefill, request)
            assert first.token_ids == expected[:1]
            if number == 1:
                await pull(client, source, request, prefill)
                assert not fault.fired
                reason = ReleaseReason.ACKED
            else:
                with pytest.raises(KVIntegrityError):
                    await pull(client, source, request, prefill)
                assert fault.fired
                reason = ReleaseReason.ABORTED
            key = TransferKey.of(request)
            await asyncio.to_thread(client.release, source.address, key, reason)
            with pytest.raises(StopAsyncIteration):
                await anext(stream)
        assert prefill.registry.releases[ReleaseReason.ACKED] == 1
        await eventually_idle(prefill.check_idle)

    asyncio.run(asyncio.wait_for(body(), 120))
