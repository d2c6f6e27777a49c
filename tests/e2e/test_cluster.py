"""The disaggregated cluster on a real local Ray cluster (one per test run): router, 2 prefill
and 2 decode worker actors in two failure domains, KV over gRPC on 127.0.0.1.

Every client stream is compared token for token with the colocated engine (which the engine
tests hold equal to transformers); every test ends with every pool back to baseline (P1) and
one client record per request (P8). Faults are injected with the harness (contracts/faults.py).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import Coroutine
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import ray
from ray.exceptions import ActorUnavailableError

from cluster.retry import RetriesExhausted
from contracts.faults import Fault, FaultAction, FaultPlan, FaultPoint
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.outputs import TokenDelta, TokenLogprobs
from engine.request import EngineRequest, RequestStatus
from engine.sampling_params import SamplingParams
from tandem.launch import Cluster, start_cluster
from tandem.topology import Topology

pytestmark = pytest.mark.e2e
TIMEOUT_S = 240.0
ENGINE = {"kv_cache_bytes": 4 * 2**20, "max_num_seqs": 16, "max_num_batched_tokens": 256}
TOPOLOGY = """
model: {{path: {path}, name: test-llama}}
domains: [a, b]
pools:
  prefill: {{replicas: 2, num_cpus: 0.5, engine: {engine}}}
  decode: {{replicas: 2, num_cpus: 0.5, engine: {engine}}}
transport: grpc
router: {{local_prefill_max_tokens: 0}}
retry: {{max_attempts: 3, budget_ratio: 1.0, backoff_s: 0.0}}
lease_timeout_s: 20
heartbeat_interval_s: 0.2
heartbeat_timeout_s: 2.0
"""
# With logprobs: tokens and every logprob must equal the colocated engine's, bit for bit.
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(
    temperature=0.8, top_p=0.95, seed=11, max_tokens=10, ignore_eos=True, logprobs=2
)
_ids = itertools.count()
# Every client request id collect() sent, by cluster (its coordinator): each gets one record.
ISSUED: dict[int, list[str]] = {}


# One loop for the module: Ray's async handles and the coordinator live across tests.
LOOP = asyncio.new_event_loop()


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return LOOP.run_until_complete(asyncio.wait_for(coro, TIMEOUT_S))


def prompt(n: int, offset: int = 0) -> list[int]:
    return [(31 * i + 7 + offset) % 1500 + 20 for i in range(n)]


@pytest.fixture(scope="module")
def cluster(ray_session: None, bf16_llama: Path) -> Any:
    text = TOPOLOGY.format(path=bf16_llama, engine=ENGINE)
    topology = Topology.from_yaml_text(text)
    c = run(start_cluster(topology, model_dir=bf16_llama))
    yield c
    run(c.shutdown())


@pytest.fixture(scope="module")
def colocated(bf16_llama: Path) -> LLMEngine:
    """The fault-free reference, in bf16: disaggregated, retried and migrated streams must
    equal it bit for bit (deterministic numerics, issue 16)."""
    return LLMEngine.from_checkpoint(bf16_llama, EngineConfig(**ENGINE), model_id="test-llama")


def expected(engine: LLMEngine, tokens: list[int], params: SamplingParams) -> list[int]:
    return expected_with_logprobs(engine, tokens, params)[0]


def expected_with_logprobs(
    engine: LLMEngine, tokens: list[int], params: SamplingParams
) -> tuple[list[int], list[TokenLogprobs]]:
    [[out]] = engine.generate([tokens], params)
    return out.token_ids, out.logprobs or []


async def collect(c: Cluster, tokens: list[int], params: SamplingParams, **kw: Any) -> list[int]:
    return (await collect_with_logprobs(c, tokens, params, **kw))[0]


async def collect_with_logprobs(
    c: Cluster, tokens: list[int], params: SamplingParams, **kw: Any
) -> tuple[list[int], list[TokenLogprobs]]:
    spec = EngineRequest(f"r{next(_ids)}", tuple(tokens), params, arrival_time=time.time(), **kw)
    ISSUED.setdefault(id(c.coordinator), []).append(spec.request_id)
    deltas: list[TokenDelta] = [d async for d in c.coordinator.generate(spec)]
    assert [d.finished for d in deltas].count(True) == 1 and deltas[-1].finished
    ids = [t for d in deltas for t in d.token_ids]
    return ids, [lp for d in deltas for lp in d.logprobs or []]


async def assert_clean(c: Cluster) -> None:
    """P1 on every worker, P8 for every client request so far; then wait until the router
    sees every worker healthy again (a crashed one rejoins after its restart). Disarms faults
    that did not fire, so they cannot hit the next test."""
    for worker in c.workers.values():
        while True:  # a crashed worker is restarting (Ray): its fresh pool must be clean too
            try:
                await worker.set_faults(FaultPlan())
                await worker.check_idle()
                break
            except ActorUnavailableError:
                await asyncio.sleep(0.2)
    ids = Counter(r.request_id for r in c.coordinator.records)
    assert all(n == 1 for n in ids.values()), [i for i, n in ids.items() if n > 1]
    lost = [i for i in ISSUED.get(id(c.coordinator), []) if i not in ids]
    assert not lost, f"requests without a terminal record: {lost}"
    while not all(w.healthy for w in await c.router.worker_states()):
        await asyncio.sleep(0.1)


async def arm(c: Cluster, role: str, *faults: Fault) -> None:
    for name, worker in c.workers.items():
        if name.startswith(role):
            await worker.set_faults(FaultPlan([Fault(**vars(f)) for f in faults]))


def test_disaggregated_equals_colocated(cluster: Cluster, colocated: LLMEngine) -> None:
    cases = [(prompt(n, n), p) for n in (3, 16, 17, 40, 90) for p in (GREEDY, SEEDED)]

    async def body() -> None:
        got = await asyncio.gather(*(collect_with_logprobs(cluster, t, p) for t, p in cases))
        assert got == [expected_with_logprobs(colocated, t, p) for t, p in cases]
        # Each record has the queue time of the prefill engine that made its first token.
        records = cluster.coordinator.records[-len(cases) :]
        assert all(r.queue_time_s is not None and r.queue_time_s >= 0 for r in records)
        await assert_clean(cluster)

    run(body())


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize(
    "role, point, at, migrations",
    [
        ("prefill", FaultPoint.ACCEPTED, 1, 0),  # queued on the prefill worker: retried
        ("decode", FaultPoint.ACCEPTED, 1, 0),  # queued on the decode worker: retried
        ("prefill", FaultPoint.PREFILL_LAYERS, 1, 0),  # mid-transfer: retried, nothing sent yet
        ("decode", FaultPoint.DECODE_TOKENS, 4, 1),  # mid-stream: migrated after 4 tokens
    ],
)
def test_killed_worker_gives_the_fault_free_stream(
    cluster: Cluster,
    colocated: LLMEngine,
    role: str,
    point: FaultPoint,
    at: int,
    migrations: int,
    params: SamplingParams,
) -> None:
    tokens = prompt(70 if role == "prefill" else 33, 3)

    async def body() -> None:
        await arm(cluster, role, Fault(point, FaultAction.CRASH, at=at, attempt=1))
        got = await collect_with_logprobs(cluster, tokens, params)
        assert got == expected_with_logprobs(colocated, tokens, params)
        [record] = cluster.coordinator.records[-1:]
        assert record.attempts == 2 and record.migrations == migrations
        await assert_clean(cluster)

    run(body())


def test_a_first_token_that_ends_the_request_leaves_both_workers_clean(
    cluster: Cluster, colocated: LLMEngine
) -> None:
    """max_tokens = 1, disaggregated: the prefill's token is the whole answer (docs §9.2 step
    5), so the decode side, reserved and pulling, is stopped; its reservation, the pull and the
    prefill's lease all end, and each worker has one record of the attempt."""
    tokens = prompt(40, 13)
    one = replace(GREEDY, max_tokens=1)

    async def body() -> None:
        assert await collect(cluster, tokens, one) == expected(colocated, tokens, one)
        [record] = cluster.coordinator.records[-1:]
        assert (record.attempts, record.num_output_tokens) == (1, 1)
        await assert_clean(cluster)  # every pool and lease at baseline
        attempt = f"{record.request_id}@1"
        kept = {
            name: [r.status for r in await w.records() if r.request_id == attempt]
            for name, w in cluster.workers.items()
        }
        assert sorted(len(v) for v in kept.values() if v) == [1, 1], kept  # prefill + decode

    run(body())


def test_the_decode_side_is_reserved_before_any_prefill_work(
    cluster: Cluster, colocated: LLMEngine
) -> None:
    """The coordinator reserves the decode worker's batch slot and KV blocks before the prefill
    starts (router.reserve_decode_first): a decode worker that fails the attempt as it reserves
    costs no prefill work -- no prefill worker has a record of that attempt -- and the request
    completes, exactly, on its retry elsewhere."""
    tokens = prompt(40, 11)

    async def body() -> None:
        await arm(cluster, "decode", Fault(FaultPoint.ACCEPTED, FaultAction.RAISE, 1, attempt=1))
        assert await collect(cluster, tokens, GREEDY) == expected(colocated, tokens, GREEDY)
        [record] = cluster.coordinator.records[-1:]
        assert (record.attempts, record.migrations) == (2, 0)
        prefilled = [
            r.request_id
            for name, w in cluster.workers.items()
            if name.startswith("prefill")
            for r in await w.records()
            if r.request_id.startswith(f"{record.request_id}@")
        ]
        assert prefilled == [f"{record.request_id}@2"]
        await assert_clean(cluster)

    run(body())


@pytest.mark.parametrize("action", [FaultAction.CORRUPT, FaultAction.TRUNCATE, FaultAction.DROP])
def test_transport_faults_are_detected_and_retried(
    cluster: Cluster, colocated: LLMEngine, action: FaultAction
) -> None:
    tokens = prompt(50, 9)

    async def body() -> None:
        await arm(cluster, "prefill", Fault(FaultPoint.TRANSFER_CHUNK, action, at=1, attempt=1))
        got = await collect_with_logprobs(cluster, tokens, GREEDY)  # tokens and logprobs
        assert got == expected_with_logprobs(colocated, tokens, GREEDY)
        assert cluster.coordinator.records[-1].attempts == 2
        await assert_clean(cluster)

    run(body())


def test_retries_spent_give_a_typed_error_promptly(cluster: Cluster) -> None:
    async def body() -> None:
        await arm(
            cluster,
            "prefill",
            Fault(FaultPoint.TRANSFER_CHUNK, FaultAction.CORRUPT, at=0),
        )
        for worker in cluster.workers.values():  # every attempt fails, whichever worker
            await worker.set_faults(
                FaultPlan([Fault(FaultPoint.TRANSFER_CHUNK, FaultAction.CORRUPT) for _ in range(5)])
            )
        t0 = time.time()
        with pytest.raises(RetriesExhausted) as info:
            await collect(cluster, prompt(20, 1), GREEDY)
        assert info.value.attempts == 3 and time.time() - t0 < 30
        assert cluster.coordinator.records[-1].status is RequestStatus.FAILED
        for worker in cluster.workers.values():
            await worker.set_faults(FaultPlan())
        await assert_clean(cluster)

    run(body())


def test_shared_prefix_hits_the_worker_that_holds_it(cluster: Cluster) -> None:
    base = prompt(64, 77)

    async def body() -> None:
        await collect(cluster, base + [5], GREEDY)
        await asyncio.sleep(0.5)  # the KV events reach the router
        before = await cluster.router.decisions()
        await collect(cluster, base + [6], GREEDY)
        after = await cluster.router.decisions()
        first, second = before[-1], after[-1]
        assert second["prefill"] == first["prefill"]
        assert second["hit_blocks"] == 4
        await assert_clean(cluster)

    run(body())


def test_a_hung_worker_is_routed_around_its_request_migrated_then_it_rejoins(
    cluster: Cluster, colocated: LLMEngine
) -> None:
    """Heartbeats: a decode worker that stops answering (its event loop stalls) is marked
    FAILED by the router within the heartbeat timeout and gets no new work; the request it
    was streaming does not wait for it but migrates at once and ends exactly as the fault-free
    run; the hung worker frees that request's KV once it wakes, and rejoins after the health
    check."""
    slow, fresh = prompt(40, 21), prompt(40, 22)
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, logprobs=2)
    stall_s = 8.0

    async def body() -> None:
        before = len(await cluster.router.decisions())
        task = asyncio.ensure_future(collect_with_logprobs(cluster, slow, long))
        while len(decisions := await cluster.router.decisions()) <= before:
            await asyncio.sleep(0.01)
        hung = decisions[before]["decode"]
        # Stalled 6x the heartbeat timeout: its silence, not its answers, must give it away.
        stall = Fault(FaultPoint.DECODE_TOKENS, FaultAction.STALL, at=0, seconds=stall_s)
        stalled_at = time.time()
        await cluster.workers[hung].set_faults(FaultPlan([stall]))
        assert await task == expected_with_logprobs(colocated, slow, long)
        record = cluster.coordinator.records[-1]
        assert (record.attempts, record.migrations) == (2, 1)
        assert record.finished < stalled_at + stall_s  # it did not wait for the hung worker
        assert not any(w.healthy for w in await cluster.router.worker_states() if w.name == hung)
        assert await collect(cluster, fresh, GREEDY) == expected(colocated, fresh, GREEDY)
        assert (await cluster.router.decisions())[-1]["decode"] != hung
        await assert_clean(cluster)  # the woken worker freed the request; healthy again

    run(body())


def test_a_sender_failed_mid_transfer_ends_the_decode_leg_at_once(
    cluster: Cluster, colocated: LLMEngine
) -> None:
    """The prefill worker is marked FAILED while its KV stream to the decode worker is stalled
    (a partitioned sender: the pull would wait for it until its deadline): the decode leg is
    stopped at once and the request moves on to the other prefill worker, exactly; when the
    stalled stream resumes, its late layers are written nowhere (the decode worker freed those
    blocks), and every pool is back at baseline."""
    tokens = prompt(40, 23)
    long = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    stall_s = 8.0

    async def body() -> None:
        stall = Fault(
            FaultPoint.TRANSFER_CHUNK, FaultAction.STALL, at=2, attempt=1, seconds=stall_s
        )
        for name in ("prefill-0", "prefill-1"):
            await cluster.workers[name].set_faults(FaultPlan([stall]))
        before = len(await cluster.router.decisions())
        task = asyncio.ensure_future(collect(cluster, tokens, long))
        while len(decisions := await cluster.router.decisions()) <= before:
            await asyncio.sleep(0.01)
        sender = decisions[before]["prefill"]
        await asyncio.sleep(1.0)  # the first token is out; layer 1 waits in the stall
        stalled_at = time.time()
        await cluster.router.worker_failed(sender)  # as if its heartbeats had stopped
        assert await task == expected(colocated, tokens, long)
        record = cluster.coordinator.records[-1]
        assert record.attempts == 2 and record.finished < stalled_at + 2.0
        assert (await cluster.router.decisions())[-1]["prefill"] != sender
        await asyncio.sleep(max(stalled_at + stall_s + 1.0 - time.time(), 0))  # it resumed
        await settle(cluster)
        await assert_clean(cluster)
        assert await collect(cluster, tokens, long) == expected(colocated, tokens, long)

    run(body())


def test_a_long_engine_step_is_not_a_missed_heartbeat(
    cluster: Cluster, colocated: LLMEngine
) -> None:
    """A step can take seconds (a long prefill on CPU) and a busy worker is not a dead one: a
    prefill worker whose engine thread is inside one step for twice the heartbeat timeout keeps
    its heartbeats, stays healthy, and its request is served by that one attempt."""
    tokens = prompt(40, 23)
    stall_s = 4.5  # heartbeat_timeout_s is 2.0

    async def body() -> None:
        # STALL at a prefill layer sleeps in the engine thread's layer hook: a step that long.
        await arm(
            cluster,
            "prefill",
            Fault(FaultPoint.PREFILL_LAYERS, FaultAction.STALL, at=1, attempt=1, seconds=stall_s),
        )
        started = time.time()
        task = asyncio.ensure_future(collect(cluster, tokens, GREEDY))
        unhealthy: set[str] = set()
        while not task.done():
            states = await cluster.router.worker_states()
            unhealthy |= {w.name for w in states if not w.healthy}
            await asyncio.sleep(0.1)
        assert await task == expected(colocated, tokens, GREEDY)
        assert time.time() - started >= stall_s  # the long step was inside this request
        record = cluster.coordinator.records[-1]
        assert (record.attempts, record.migrations) == (1, 0)
        assert unhealthy == set()
        await assert_clean(cluster)

    run(body())


def test_cancel_and_deadline_races_leave_one_record_each(cluster: Cluster) -> None:
    """P8 across the cluster: clients leave and deadlines expire at staggered moments of the
    prefill, the hand-off and the decode; every request still ends with exactly one record and
    every pool is back to baseline."""
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)

    async def consume(rid: str, deadline: float) -> None:
        spec = EngineRequest(
            rid, tuple(prompt(80, 7)), params, deadline=deadline, arrival_time=time.time()
        )
        async for _ in cluster.coordinator.generate(spec):
            pass

    async def body() -> None:
        now = time.time()
        ids = [f"race-{i}" for i in range(8)]
        tasks = [
            asyncio.ensure_future(consume(rid, now + 0.01 + 0.04 * i)) for i, rid in enumerate(ids)
        ]
        for i, task in enumerate(tasks):
            await asyncio.sleep(0.03)
            if i % 2:
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        records = [r for r in cluster.coordinator.records if r.request_id in ids]
        assert sorted(r.request_id for r in records) == sorted(ids)
        assert {r.status for r in records} <= {
            RequestStatus.FINISHED,
            RequestStatus.CANCELLED,
            RequestStatus.TIMED_OUT,
        }
        await assert_clean(cluster)

    run(body())


async def prefill_hits(c: Cluster, tokens: list[int]) -> dict[str, int]:
    """Serve ``tokens``; the prefix-cache hits the router credited each prefill candidate."""
    await collect(c, tokens, GREEDY)
    last = (await c.router.decisions())[-1]
    return {x["name"]: x["hit_blocks"] for x in last["candidates"] if x["role"] == "prefill"}


async def settle(c: Cluster) -> None:
    """The workers' reports reach the router, and it sees every worker healthy."""
    await asyncio.sleep(0.5)
    while True:
        try:
            if all(w.healthy for w in await c.router.worker_states()):
                return
        except ActorUnavailableError:  # the router itself is restarting
            pass
        await asyncio.sleep(0.1)


def test_router_view_recovers_after_worker_and_router_restarts(cluster: Cluster) -> None:
    """P12: a restarted worker's cache gets no credit; a restarted router rebuilds the index
    from the workers' resyncs (it credits cache that is there, exactly)."""
    base = prompt(64, 55)

    async def body() -> None:
        await collect(cluster, base + [1], GREEDY)
        await settle(cluster)
        holder = (await cluster.router.decisions())[-1]["prefill"]
        ray.kill(cluster.router.handle, no_restart=False)  # Ray restarts it, empty
        await settle(cluster)
        hits = await prefill_hits(cluster, base + [2])
        assert hits[holder] == 4  # rebuilt from the holder's resync
        ray.kill(cluster.workers[holder].handle, no_restart=False)
        await assert_clean(cluster)
        await settle(cluster)
        hits = await prefill_hits(cluster, base + [3])
        assert hits[holder] == 0  # its cache died with it: no credit
        await assert_clean(cluster)

    run(body())


def test_a_readmitted_worker_gets_its_cache_credited_again(cluster: Cluster) -> None:
    """P12 on a false alarm: a live worker the router marked FAILED (reported dead, or its
    heartbeats late) loses its index entries, and its reports are ignored until the health
    check readmits it; it then resyncs, so the cache it still holds is credited exactly."""
    base = prompt(64, 57)

    async def body() -> None:
        await collect(cluster, base + [1], GREEDY)
        await settle(cluster)
        holder = (await cluster.router.decisions())[-1]["prefill"]
        await cluster.router.worker_failed(holder)
        await settle(cluster)  # readmitted by the health check
        hits = await prefill_hits(cluster, base + [2])
        assert hits[holder] == 4
        await assert_clean(cluster)

    run(body())


def test_a_slow_consumer_backpressures_the_decode_engine(
    cluster: Cluster, colocated: LLMEngine
) -> None:
    """A client that stops pulling its stream stops the decode worker's engine: the worker's
    Ray stream blocks a few batches ahead, the engine's bounded buffer fills and the request
    goes BACKPRESSURED (KV kept, no tokens); pulling again completes it exactly."""
    tokens = prompt(30, 31)
    params = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)

    async def body() -> None:
        decodes = [w for n, w in cluster.workers.items() if n.startswith("decode")]
        before = [await w.backpressure_stats() for w in decodes]
        spec = EngineRequest(f"r{next(_ids)}", tuple(tokens), params, arrival_time=time.time())
        stream = cluster.coordinator.generate(spec)
        got: list[int] = []
        while len(got) < 3:  # past the hand-off: the decode worker is streaming
            got += (await stream.__anext__()).token_ids
        give_up = time.time() + 90
        while True:  # not pulling: wait for the engine to pause the request
            now = [await w.backpressure_stats() for w in decodes]
            if any(n.pauses > b.pauses for n, b in zip(now, before, strict=True)):
                break
            assert time.time() < give_up, f"never backpressured: {now}"
            await asyncio.sleep(0.2)
        assert all(n.max_buffered <= 64 for n in now)  # the engine's per-request bound
        async for delta in stream:
            got += delta.token_ids
        assert got == expected(colocated, tokens, params)
        await assert_clean(cluster)

    run(body())


def test_losing_a_failure_domain_keeps_serving(cluster: Cluster, colocated: LLMEngine) -> None:
    """Last: it kills domain a's workers for good."""
    tokens = prompt(30, 2)

    async def body() -> None:
        for name in ("prefill-0", "decode-0"):  # domain a
            ray.kill(cluster.workers[name].handle, no_restart=True)
        for _ in range(3):
            assert await collect(cluster, tokens, GREEDY) == expected(colocated, tokens, GREEDY)
        live = {n: w for n, w in cluster.workers.items() if n.endswith("-1")}
        for worker in live.values():
            await worker.check_idle()

    run(body())
