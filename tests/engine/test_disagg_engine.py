"""The engine's side of prefill/decode disaggregation, two engines in one process: a prefill-only
request hands off after its first token with its KV leased; a decode engine imports the KV and
continues; a migrated request resumes from the streamed tokens and the sampler snapshot. The KV
moves by a plain tensor copy here (the transports are tested in test_kv_transfer.py)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from helpers import assert_engine_clean

from engine.admission import NoRoom
from engine.async_engine import AsyncLLMEngine
from engine.batch import SchedulerOutput
from engine.config import EngineConfig
from engine.engine import LLMEngine, RequestRejected
from engine.kv_cache_manager import KVInvariantError, prefix_hashes
from engine.kv_events import KVEvent, KVEventKind
from engine.request import FinishReason, RequestStatus
from engine.sampling_params import SamplingParams

CONFIG = EngineConfig(kv_cache_bytes=4 * 2**20, max_num_batched_tokens=64, block_size=16)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
# Block-boundary cases: shorter than a block, exactly one, one past, several blocks + a bit.
PROMPT_LENS = [5, 16, 17, 40]


def prompt(n: int, offset: int = 0) -> list[int]:
    return [(37 * i + 11 + offset) % 200 + 3 for i in range(n)]


@pytest.fixture(scope="module")
def engines(test_llama: Path) -> tuple[LLMEngine, LLMEngine, LLMEngine]:
    """(colocated reference, prefill engine, decode engine) on the same checkpoint."""
    return tuple(LLMEngine.from_checkpoint(test_llama, CONFIG) for _ in range(3))  # type: ignore[return-value]


def run(engine: LLMEngine) -> None:
    while engine.has_unfinished():
        engine.step()


def reference(engine: LLMEngine, tokens: list[int], params: SamplingParams) -> list[int]:
    [[out]] = engine.generate([tokens], params)
    return out.token_ids


def prefill(engine: LLMEngine, tokens: list[int], params: SamplingParams, rid: str, **kw):
    engine.add_request(engine.make_request(tokens, params, request_id=rid, prefill_only=True, **kw))
    run(engine)
    [out] = engine.finished_outputs()
    return out


def hand_off(p: LLMEngine, d: LLMEngine, tokens: list[int], params: SamplingParams, out) -> str:
    """Import ``out`` (a handed-off prefill) into ``d``, copy its KV, release the lease."""
    rid = out.request_id + "-d"
    *known, first = out.token_ids
    dst = d.add_imported(d.make_request(tokens, params, request_id=rid, resume_output=known))
    src = p.kv.block_table(out.request_id)
    assert len(src) == len(dst)
    d.runner.kv_cache[:, :, dst] = p.runner.kv_cache[:, :, src]
    assert p.release_kv(out.request_id) and not p.release_kv(out.request_id)
    d.finish_import(rid, next_token=first, sampler_snapshot=out.sampler_snapshot)
    return rid


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_disaggregated_equals_colocated(engines, params: SamplingParams) -> None:
    ref_engine, p, d = engines
    for n in PROMPT_LENS:
        tokens = prompt(n)
        expected = reference(ref_engine, tokens, params)
        out = prefill(p, tokens, params, rid=f"p-{n}-{params.temperature}")
        assert out.finish_reason is FinishReason.HANDED_OFF and out.token_ids == expected[:1]
        assert out.record.finish_reason is FinishReason.HANDED_OFF
        # Leased: still in use until released; the leak check says so.
        assert out.request_id in p.kv.leased_ids
        with pytest.raises(KVInvariantError):
            p.kv.check_idle()
        rid = hand_off(p, d, tokens, params, out)
        run(d)
        [done] = d.finished_outputs()
        assert done.request_id == rid and done.token_ids == expected
    for e in engines:
        assert_engine_clean(e)


def test_migration_resumes_exactly(engines) -> None:
    """A decode worker dies after k streamed tokens: a fresh pair recomputes prompt + those
    tokens, restores the sampler, and the stream continues as the fault-free run."""
    ref_engine, p, d = engines
    tokens = prompt(21, offset=5)
    expected = reference(ref_engine, tokens, SAMPLED)
    first = prefill(p, tokens, SAMPLED, rid="mig")
    rid = hand_off(p, d, tokens, SAMPLED, first)
    for _ in range(4):
        d.step()
    streamed = list(d.scheduler.get_request(rid).output_token_ids)  # type: ignore[union-attr]
    snap = d.sampler_snapshot(rid)
    d.fail_all("decode worker died")  # what the dead worker's engine would have done
    assert 1 < len(streamed) < len(expected) and streamed == expected[: len(streamed)]
    again = prefill(p, tokens, SAMPLED, rid="mig-2", resume_output=streamed, sampler_snapshot=snap)
    assert again.token_ids == expected[: len(streamed) + 1]
    hand_off(p, d, tokens, SAMPLED, again)
    run(d)
    assert [o.token_ids for o in d.finished_outputs()][-1] == expected
    for e in engines:
        assert_engine_clean(e)


def test_import_waits_for_kv_then_caches_it(engines) -> None:
    _, p, d = engines
    tokens = prompt(40, offset=9)
    out = prefill(p, tokens, GREEDY, rid="wait")
    dst = d.add_imported(d.make_request(tokens, GREEDY, request_id="wait-d"))
    req = d.scheduler.get_request("wait-d")
    assert req is not None and req.status is RequestStatus.WAITING_FOR_KV
    for _ in range(3):  # nothing runs for it while the KV is in flight
        assert d.step() == []
    assert req.num_computed_tokens == 40 and req.output_token_ids == []
    # Unverified KV is not in the prefix cache: nobody may hit it yet.
    probe = d._new_request(d.make_request(tokens, GREEDY, request_id="probe"))
    assert d.kv.get_computed_blocks(probe) == ([], 0)
    d.runner.kv_cache[:, :, dst] = p.runner.kv_cache[:, :, p.kv.block_table("wait")]
    p.release_kv("wait")
    d.finish_import("wait-d", next_token=out.token_ids[0])
    assert d.kv.get_computed_blocks(probe)[1] == 32  # two full blocks, now cached
    run(d)
    d.finished_outputs()
    for e in engines:
        assert_engine_clean(e)


@pytest.mark.parametrize("how", ["error", "cancel", "deadline"])
def test_import_that_fails_is_reclaimed_once(engines, how: str) -> None:
    _, _, d = engines
    tokens = prompt(33)
    deadline = 0.0 if how == "deadline" else None
    d.add_imported(d.make_request(tokens, GREEDY, request_id=f"bad-{how}", deadline=deadline))
    if how == "error":
        d.finish_import(f"bad-{how}", error="checksum mismatch")
    elif how == "cancel":
        d.abort(f"bad-{how}")
    run(d)
    [out] = d.finished_outputs()
    expected = {"error": "failed", "cancel": "cancelled", "deadline": "timed_out"}[how]
    assert out.record.status.value == expected and out.token_ids == []
    d.finish_import(f"bad-{how}", next_token=7)  # a late "KV ready" after the end: no-op
    assert_engine_clean(d)


def test_import_without_room_now_raises_no_room_and_changes_nothing(test_llama: Path) -> None:
    small = LLMEngine.from_checkpoint(
        test_llama, CONFIG.model_copy(update={"max_num_seqs": 2, "kv_cache_bytes": 2**16})
    )
    big = small.max_model_len * 3 // 5
    small.add_imported(small.make_request(prompt(big), GREEDY, request_id="a"))
    before = small.kv.stats()
    with pytest.raises(NoRoom, match="KV reservation"):
        small.add_imported(small.make_request(prompt(big, offset=1), GREEDY, request_id="b"))
    assert small.kv.stats() == before
    small.add_imported(small.make_request(prompt(4), GREEDY, request_id="c"))
    with pytest.raises(NoRoom, match="batch slots"):
        small.add_imported(small.make_request(prompt(4), GREEDY, request_id="d"))
    for rid in ("a", "c"):
        small.finish_import(rid, error="test over")
    run(small)
    assert [r.request_id for r in small.scheduler.records] == ["a", "c"]  # none for b, d
    assert_engine_clean(small)
    small.add_imported(
        small.make_request(prompt(big, offset=1), GREEDY, request_id="b")
    )  # room again
    small.finish_import("b", error="test over")
    run(small)
    assert_engine_clean(small)


def test_prefix_cache_events_name_the_prompt_blocks(test_llama: Path) -> None:
    e = LLMEngine.from_checkpoint(test_llama, CONFIG.model_copy(update={"kv_cache_bytes": 2**17}))
    e.kv.pool.record_events()
    tokens = prompt(40)
    e.generate([tokens], SamplingParams(temperature=0.0, max_tokens=1))
    hashes = prefix_hashes(tokens, 16, "", e.kv.model_id)
    assert e.kv.pool.take_events() == [KVEvent(KVEventKind.STORED, tuple(hashes))]
    assert e.kv.pool.take_events() == []
    # Fill the pool with other prompts: the cached blocks get evicted and say so.
    blocks = e.kv.pool.num_blocks
    e.generate([prompt(16 * blocks - 2, offset=1)], SamplingParams(max_tokens=1))
    removed = {
        h
        for ev in e.kv.pool.take_events()
        if ev.kind is KVEventKind.REMOVED
        for h in ev.block_hashes
    }
    assert set(hashes) <= removed


def test_layer_hook_sees_each_layer_once_its_kv_is_written(test_llama: Path) -> None:
    """What layer-wise transfer relies on: when the hook fires for layer l, layer l's K/V of
    the step is in the cache (and later layers' is not yet)."""
    p = LLMEngine.from_checkpoint(test_llama, CONFIG)
    tokens = prompt(20, offset=3)
    p.add_request(p.make_request(tokens, GREEDY, request_id="hook", prefill_only=True))
    seen: list[tuple[int, bool, bool]] = []
    cache = p.runner.kv_cache

    def hook(layer: int, out: SchedulerOutput) -> None:
        assert [c.request_id for c in out.chunks] == ["hook"]
        blocks = p.kv.block_table("hook")
        written = bool(cache[layer, :, blocks].abs().sum() > 0)
        later = layer + 1 < cache.shape[0] and bool(cache[layer + 1, :, blocks].abs().sum() > 0)
        seen.append((layer, written, later))

    p.runner.layer_hook = hook
    try:
        run(p)
    finally:
        p.runner.layer_hook = None
    p.finished_outputs()
    layers = cache.shape[0]
    assert seen == [(layer, True, False) for layer in range(layers)]
    p.release_kv("hook")
    assert_engine_clean(p)


def test_async_handoff_through_import_request_and_call(test_llama: Path) -> None:
    """The interface the workers drive: a prefill-only stream ends with the snapshot, the
    decode side imports, `call` runs finish_import on the engine thread, the stream continues;
    per-token snapshots when asked. Output equals the colocated run."""
    tokens = prompt(27, offset=2)
    expected = reference(LLMEngine.from_checkpoint(test_llama, CONFIG), tokens, SAMPLED)

    async def body() -> None:
        with (
            AsyncLLMEngine(LLMEngine.from_checkpoint(test_llama, CONFIG)) as p,
            AsyncLLMEngine(LLMEngine.from_checkpoint(test_llama, CONFIG)) as d,
        ):
            outs = [
                o
                async for o in p.generate(
                    p.make_request(tokens, SAMPLED, request_id="a", prefill_only=True)
                )
            ]
            assert [t for o in outs for t in o.token_ids] == expected[:1]
            assert outs[-1].finish_reason is FinishReason.HANDED_OFF and outs[-1].sampler_snapshot
            blocks, stream = await d.import_request(
                d.make_request(tokens, SAMPLED, request_id="a-d", snapshots=True)
            )
            src = await p.call(lambda e: e.kv.block_table("a"))
            d.engine.runner.kv_cache[:, :, blocks] = p.engine.runner.kv_cache[:, :, src]
            assert await p.call(lambda e: e.release_kv("a"))
            await d.call(
                lambda e: e.finish_import(
                    "a-d", next_token=expected[0], sampler_snapshot=outs[-1].sampler_snapshot
                )
            )
            rest = [o async for o in stream]
            assert [t for o in rest for t in o.token_ids] == expected[1:]
            assert all(o.sampler_snapshot is not None for o in rest)
            with pytest.raises(KeyError):
                await d.call(lambda e: e.sampler_snapshot("gone"))
            with pytest.raises(RequestRejected):
                await d.import_request(
                    d.make_request(prompt(10**4), SAMPLED, request_id="too-long")
                )
            await p.wait_idle()
            await d.wait_idle()
            assert_engine_clean(p.engine)
            assert_engine_clean(d.engine)

    asyncio.run(asyncio.wait_for(body(), 120))


def test_the_worker_surface_moves_a_request_between_two_async_engines(test_llama: Path) -> None:
    """What a disaggregated pair of workers does, through AsyncLLMEngine's worker surface only
    (no ``.engine``, no ``call``): layer listeners on the prefill side see every layer with
    the block table, KV read there and written on the decode side, the import finished, the
    lease released; load() reports the queue, the batch and KV events (a resync: CLEARED then
    what is cached). The output equals the colocated run and both pools end at baseline."""
    tokens = prompt(40, offset=5)
    expected = reference(LLMEngine.from_checkpoint(test_llama, CONFIG), tokens, SAMPLED)

    async def body() -> None:
        p = AsyncLLMEngine.from_checkpoint(test_llama, CONFIG, model_id="m", kv_events=True)
        d = AsyncLLMEngine.from_checkpoint(test_llama, CONFIG, model_id="m", kv_events=True)
        with p, d:
            assert (p.kv.layout, p.kv.block_size, p.kv.model_id) == (d.kv.layout, 16, "m")
            assert p.kv.block_hashes(tokens, "t") == prefix_hashes(tokens, 16, "t", "m")
            seen: list[tuple[int, list[int]]] = []
            p.kv.watch_layers("a", lambda layer, table: seen.append((layer, list(table))))
            outs = [
                o
                async for o in p.generate(
                    p.make_request(tokens, SAMPLED, request_id="a", prefill_only=True)
                )
            ]
            p.kv.unwatch_layers("a")
            table = seen[0][1]
            assert seen == [(layer, table) for layer in range(p.kv.layout.num_layers)]
            assert len(table) == 3  # 40 tokens in blocks of 16
            blocks, stream = await d.import_request(
                d.make_request(tokens, SAMPLED, request_id="a-d")
            )
            for layer in range(p.kv.layout.num_layers):
                d.kv.write_layer(layer, blocks, p.kv.read_layer(layer, table))
            assert await p.kv.release("a") and not await p.kv.release("a")
            await d.kv.finish_import(
                "a-d", next_token=outs[0].token_ids[0], sampler_snapshot=outs[-1].sampler_snapshot
            )
            rest = [t async for o in stream for t in o.token_ids]
            assert outs[0].token_ids + rest == expected
            load = await p.kv.load()
            stored = prefix_hashes(tokens, 16, "", "m")[:2]
            assert (load.num_waiting, load.num_running) == (0, 0)
            assert load.kv_events == [KVEvent(KVEventKind.STORED, tuple(stored))]
            assert (await p.kv.load()).kv_events == []  # taken
            resync = await p.kv.load(resync=True)
            assert resync.kv_events[0] == KVEvent(KVEventKind.CLEARED)
            assert set(resync.kv_events[1].block_hashes) == set(stored)
            await p.check_idle()
            await d.check_idle()

    asyncio.run(asyncio.wait_for(body(), 120))


def test_an_import_without_room_waits_in_arrival_order_until_room_frees(test_llama: Path) -> None:
    """AsyncLLMEngine.import_request parks an import that finds no slot (NoRoom) and admits it,
    in arrival order, after the tick that frees one; a parked import that is cancelled or whose
    deadline passes leaves without a trace. load() names the admitted ids once each and the
    blocks their requests claim; each parked import is counted once (imports_parked; a
    reservation's wait in reservations_waited)."""
    config = CONFIG.model_copy(update={"max_num_seqs": 1})

    async def body() -> None:
        d = AsyncLLMEngine.from_checkpoint(test_llama, config, kv_events=True)
        with d:
            blocks, first = await d.import_request(
                d.make_request(prompt(20), GREEDY, request_id="a")
            )
            load = await d.kv.load()
            assert load.admitted == ["a"] and load.claimed_blocks == 2  # 20 + 12 tokens
            assert (await d.kv.load()).admitted == []  # taken
            b = asyncio.ensure_future(
                d.import_request(d.make_request(prompt(5, 1), GREEDY, request_id="b"))
            )
            c = asyncio.ensure_future(  # a decode reservation (before its prefill)
                d.import_request(
                    d.make_request(prompt(5, 2), GREEDY, request_id="c"), reservation=True
                )
            )
            late = asyncio.ensure_future(
                d.import_request(
                    d.make_request(prompt(5, 3), GREEDY, request_id="late", deadline=time.time())
                )
            )
            gone = asyncio.ensure_future(
                d.import_request(d.make_request(prompt(5, 4), GREEDY, request_id="gone"))
            )
            with pytest.raises(NoRoom, match="deadline passed while it waited"):
                await late
            await asyncio.sleep(0.2)
            assert not (b.done() or c.done() or gone.done())  # parked: no slot
            # late, b, gone: each counted once; c's wait is a reservation's
            assert (d.imports_parked, d.reservations_waited) == (3, 1)
            gone.cancel()
            await asyncio.sleep(0.1)
            assert (await d.kv.load()).admitted == []  # nothing else admitted meanwhile
            await d.kv.finish_import("a", error="done with it")  # ends: its slot frees
            assert [o async for o in first][-1].finish_reason is FinishReason.ERROR
            b_blocks, b_stream = await b
            assert not c.done()  # one slot: c still waits behind b
            await d.kv.finish_import("b", next_token=prompt(1)[0])
            b_outs = [o async for o in b_stream]
            assert len([t for o in b_outs for t in o.token_ids]) == GREEDY.max_tokens - 1
            assert b_outs[-1].finish_reason is FinishReason.MAX_TOKENS
            c_blocks, c_stream = await c
            await d.kv.finish_import("c", error="done")
            async for _ in c_stream:
                pass
            assert (await d.kv.load()).admitted == ["b", "c"]
            # offered again after every tick, counted once
            assert (d.imports_parked, d.reservations_waited) == (3, 1)
            records = [r.request_id for r in d.records()]
            assert sorted(records) == ["a", "b", "c"]  # none for "late" or "gone"
            assert len(blocks) == 2 and len(b_blocks) == len(c_blocks) == 1
            await d.check_idle()

    asyncio.run(asyncio.wait_for(body(), 120))
