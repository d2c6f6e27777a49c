"""Cluster admission: the router's queue order, its ledger of promises, its refusals, and the
router actor admitting from its queue (driven directly, no Ray)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest
from helpers import worker_state
from hypothesis import given
from hypothesis import strategies as st

from contracts.messages import WorkerInfo, WorkerLoad
from contracts.roles import Role
from contracts.routing import (
    AdmissionRefused,
    Decision,
    Mode,
    NoReplicaAvailable,
    Refusal,
    RouteRequest,
    WorkerState,
)
from engine.admission import Admission
from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.kv_events import KVEvent, KVEventKind
from engine.request import Request
from engine.sampling_params import SamplingParams
from router.actor import RESTARTED_UNSEEN, RouterActor
from router.admission import PROMISE_TTL_S, AdmissionQueue, AdmissionRate, Ledger, refusal
from router.config import AdmissionConfig, RouterConfig
from router.policy import FULL, choose, has_room, needed_blocks
from router.prefix_index import PrefixIndex

BS = 4


def route(
    rid: str = "r@1",
    n: int = 10,
    *,
    max_tokens: int = 6,
    resumed: int = 0,
    priority: int = 0,
    tenant: str = "",
    deadline: float | None = None,
    holder: str = "",
) -> RouteRequest:
    return RouteRequest(
        rid,
        [],
        n,
        max_tokens=max_tokens,
        num_resumed_tokens=resumed,
        priority=priority,
        tenant=tenant,
        deadline=deadline,
        holder=holder,
    )


# -- the reservation: one formula for the engine and the router -----------------------------------


@given(
    prompt=st.integers(1, 60),
    resumed=st.integers(0, 20),
    max_tokens=st.integers(1, 40),
    predicted=st.sampled_from([None, 0, 1, 7]),
    max_model_len=st.integers(8, 100),
    num_blocks=st.integers(1, 40),
    prefill_only=st.booleans(),
)
def test_the_router_reserves_exactly_what_the_engine_reserves(
    prompt: int,
    resumed: int,
    max_tokens: int,
    predicted: int | None,
    max_model_len: int,
    num_blocks: int,
    prefill_only: bool,
) -> None:
    """needed_blocks (the router's ledger) == the blocks the engine's phase-2 admission
    reserves for the same request on the same worker, prefill-only or not."""
    resumed = min(resumed, max_tokens - 1)
    config = EngineConfig(block_size=BS, admission_output_tokens=predicted)
    kv = KVCacheManager(num_blocks, BS)
    req = Request("r", list(range(prompt)), SamplingParams(max_tokens=max_tokens))
    req.output_token_ids = list(range(resumed))
    req.prefill_only = prefill_only
    engine_blocks = kv.blocks_for(Admission(config, kv, max_model_len).target_tokens(req))
    state = worker_state(
        "decode-0",
        Role.DECODE,
        "a",
        block_size=BS,
        num_kv_blocks=num_blocks,
        max_model_len=max_model_len,
        admission_output_tokens=predicted,
    )
    r = route(n=prompt + resumed, max_tokens=max_tokens, resumed=resumed)
    assert needed_blocks(state, r, prefill_only) == engine_blocks


def test_room_counts_reports_and_promises() -> None:
    w = worker_state("decode-0", Role.DECODE, "a", block_size=BS, max_num_seqs=3, num_kv_blocks=10)
    r = route(n=10, max_tokens=6)  # 16 tokens: 4 blocks
    assert needed_blocks(w, r, prefill_only=False) == 4
    assert needed_blocks(w, r, prefill_only=True) == 3  # 11 tokens
    assert has_room(w, r, prefill_only=False)
    w.report, w.promised_blocks = replace(w.report, claimed_blocks=3), 3  # 4 free: just enough
    assert has_room(w, r, prefill_only=False)
    w.promised_blocks = 4
    assert not has_room(w, r, prefill_only=False) and has_room(w, r, prefill_only=True)
    w.promised_blocks = 0
    w.report, w.promised_seqs = replace(w.report, queue_depth=1, num_running=1), 1  # 3 of 3 slots
    assert w.load == 3 and w.free_seqs == 0 and not has_room(w, r, prefill_only=True)


def test_a_full_worker_is_skipped_saying_so() -> None:
    workers = [
        worker_state("prefill-0", Role.PREFILL, "a", block_size=BS, max_num_seqs=1),
        worker_state("decode-0", Role.DECODE, "a", block_size=BS, max_num_seqs=1, num_running=1),
        worker_state("decode-1", Role.DECODE, "b", block_size=BS, max_num_seqs=1),
    ]
    config = RouterConfig(local_prefill_max_tokens=0)
    decision = choose(route(n=40), workers, PrefixIndex(), config)
    assert (decision.prefill, decision.decode) == ("prefill-0", "decode-1")
    assert decision.skipped == {"decode-0": FULL}
    workers[2].promised_seqs = 1
    with pytest.raises(NoReplicaAvailable) as err:
        choose(route(n=40), workers, PrefixIndex(), config)
    assert err.value.reasons == {"decode-0": FULL, "decode-1": FULL}


# -- the queue -------------------------------------------------------------------------------------

waiter_spec = st.tuples(st.booleans(), st.integers(-1, 1), st.sampled_from(["t1", "t2", "t3"]))


@given(
    specs=st.lists(waiter_spec, min_size=1, max_size=30),
    in_flight=st.dictionaries(st.sampled_from(["t1", "t2", "t3"]), st.integers(0, 3)),
)
def test_queue_order_is_started_then_priority_then_fair_share_then_arrival(
    specs: list[tuple[bool, int, str]], in_flight: dict[str, int]
) -> None:
    """Draining the queue (each admission adds one to its tenant's in-flight count) follows the
    brute-force order: min over waiters of (not started, priority, tenant's in flight, seq)."""
    queue = AdmissionQueue()
    model = []
    for seq, (started, priority, tenant) in enumerate(specs):
        r = route(f"r{seq}@1", n=20, resumed=int(started), priority=priority, tenant=tenant)
        model.append((queue.push(r, 0.0), seq))
    flying = dict(in_flight)
    while model:
        best = min(
            model,
            key=lambda ws: (
                not ws[0].request.started,
                ws[0].request.priority,
                flying.get(ws[0].request.tenant, 0),
                ws[1],
            ),
        )
        assert queue.head(flying) is best[0]
        assert queue.remove(best[0]) and not queue.remove(best[0])
        model.remove(best)
        flying[best[0].request.tenant] = flying.get(best[0].request.tenant, 0) + 1
        assert len(queue) == len(model)
    assert queue.head(flying) is None and queue.waiters() == []


def test_one_tenant_flooding_does_not_starve_another() -> None:
    queue = AdmissionQueue()
    flood = [queue.push(route(f"a{i}@1", tenant="a"), 0.0) for i in range(5)]
    late = queue.push(route("b0@1", tenant="b"), 1.0)
    in_flight = {"a": 2}  # "a" already has two requests running, "b" none
    assert queue.head(in_flight) is late
    queue.remove(late)
    assert queue.head({"a": 2, "b": 1}) is flood[0]


# -- refusals and the drain rate --------------------------------------------------------------------


def test_refusals() -> None:
    config = AdmissionConfig(max_queued=3)
    now = 1000.0
    assert refusal(route(), config, num_ahead=2, rate=None, now=now) is None
    full = refusal(route("x@1"), config, num_ahead=3, rate=0.5, now=now)
    assert full is not None and full.reason is Refusal.QUEUE_FULL and full.retry_after_s == 2.0
    assert refusal(route("x@1"), config, num_ahead=3, rate=None, now=now).retry_after_s == 1.0  # type: ignore[union-attr]
    # A started stream (a migration) is never refused, full queue or not.
    assert refusal(route("x@2", resumed=3), config, num_ahead=99, rate=0.1, now=now) is None
    # 2 ahead at 1 admission/s: a 3 s wait. 2.5 s left: refused; 3 s left: it waits.
    late = refusal(route(deadline=now + 2.5), config, num_ahead=2, rate=1.0, now=now)
    assert late is not None and late.reason is Refusal.WAIT_EXCEEDS_DEADLINE
    assert late.retry_after_s == 1.0
    assert refusal(route(deadline=now + 3.0), config, num_ahead=2, rate=1.0, now=now) is None
    unpredicted = AdmissionConfig(max_queued=3, predict_wait=False)
    assert refusal(route(deadline=now + 0.1), unpredicted, 2, 1.0, now) is None
    assert refusal(route(deadline=now + 0.1), config, 2, None, now) is None  # no rate yet


def test_admission_rate_needs_recent_samples() -> None:
    rate = AdmissionRate()
    for t in (0.0, 0.5, 1.0):
        rate.record(t)
    assert rate.per_second(1.0) is None  # too few to measure
    rate.record(1.5)
    assert rate.per_second(1.5) == pytest.approx(2.0)
    assert rate.per_second(1000.0) is None  # all too old


# -- the ledger ------------------------------------------------------------------------------------


def states() -> dict[str, WorkerState]:
    return {
        "prefill-0": worker_state("prefill-0", Role.PREFILL, "a", block_size=BS, max_num_seqs=4),
        "decode-0": worker_state("decode-0", Role.DECODE, "b", block_size=BS, max_num_seqs=4),
    }


def decision(rid: str, prefill: str | None = "prefill-0") -> Decision:
    mode = Mode.DISAGGREGATED if prefill else Mode.LOCAL_PREFILL
    return Decision(rid, mode, prefill, "decode-0", 0, 10, ())


def test_a_grant_promises_until_each_worker_reports_it() -> None:
    s = states()
    ledger = Ledger(s)
    r = route("r@1", n=10, max_tokens=6, tenant="t")  # prefill 3 blocks, decode 4
    ledger.grant(decision("r@1"), r, now=0.0)
    p, d = s["prefill-0"], s["decode-0"]
    assert (p.promised_seqs, p.promised_blocks, d.promised_seqs, d.promised_blocks) == (1, 3, 1, 4)
    assert ledger.in_flight == {"t": 1}
    ledger.admitted("prefill-0", ("r@1", "other@1"))  # unknown ids are ignored
    assert (p.promised_seqs, p.promised_blocks, d.promised_seqs, d.promised_blocks) == (0, 0, 1, 4)
    ledger.admitted("prefill-0", ("r@1",))  # again: nothing left to clear there
    assert (p.promised_seqs, p.promised_blocks) == (0, 0)
    assert ledger.release("r@1") and not ledger.release("r@1")
    assert (d.promised_seqs, d.promised_blocks) == (0, 0) and ledger.in_flight == {}


def test_forget_and_expire() -> None:
    s = states()
    ledger = Ledger(s)
    ledger.grant(decision("a@1"), route("a@1"), now=0.0)
    ledger.grant(decision("b@1", prefill=None), route("b@1"), now=PROMISE_TTL_S / 2)
    ledger.forget_worker("decode-0")  # it restarted: promised nothing any more
    assert (s["decode-0"].promised_seqs, s["decode-0"].promised_blocks) == (0, 0)
    assert s["prefill-0"].promised_seqs == 1
    assert ledger.in_flight == {"": 2}  # the grants stay until released
    assert ledger.expire(now=PROMISE_TTL_S + 1) == ["a@1"]  # its prefill never reported
    assert s["prefill-0"].promised_seqs == 0 and ledger.in_flight == {"": 1}
    ledger.grant(decision("c@1"), route("c@1"), now=0.0)
    ledger.admitted("prefill-0", ("c@1",))
    ledger.admitted("decode-0", ("c@1",))
    # c was seen everywhere, b's only promise went with its worker: both wait for release.
    assert ledger.expire(now=10 * PROMISE_TTL_S) == []
    assert set(ledger.grants) == {"b@1", "c@1"}


def test_a_repeated_attempt_id_replaces_its_grant() -> None:
    s = states()
    ledger = Ledger(s)
    ledger.grant(decision("a@1"), route("a@1"), now=0.0)
    ledger.grant(decision("a@1"), route("a@1"), now=1.0)
    assert s["decode-0"].promised_seqs == 1 and ledger.in_flight == {"": 1}


def test_a_grant_whose_holder_fell_silent_is_released() -> None:
    """A coordinator renews its hold on its grants; an ingress replica that died with requests
    admitted stops, and after the timeout its grants go -- slots, blocks and the tenant's
    in-flight count (which orders the queue) -- while a live holder's and an unheld grant stay."""
    s = states()
    ledger = Ledger(s)
    ledger.grant(decision("a@1"), route("a@1", tenant="t", holder="dead"), now=0.0)
    ledger.grant(decision("b@1"), route("b@1", tenant="t", holder="alive"), now=0.0)
    ledger.grant(decision("c@1"), route("c@1", tenant="u"), now=0.0)  # no holder
    for name in ("prefill-0", "decode-0"):
        ledger.admitted(name, ("a@1", "b@1", "c@1"))  # every promise reported: not expirable
    assert ledger.in_flight == {"t": 2, "u": 1}
    ledger.hold("alive", 20.0)
    assert ledger.expire(now=25.0, holder_timeout_s=30.0) == []
    assert ledger.expire(now=31.0, holder_timeout_s=30.0) == ["a@1"]
    assert ledger.in_flight == {"t": 1, "u": 1} and set(ledger.grants) == {"b@1", "c@1"}
    assert ledger.holders == {"alive": 20.0}
    # A pause of the router (awake since 29 s) blames no holder for renewals it did not see.
    assert ledger.expire(now=50.0, holder_timeout_s=30.0, awake=29.0) == []
    assert ledger.expire(now=10 * PROMISE_TTL_S, holder_timeout_s=30.0) == ["b@1"]
    assert set(ledger.grants) == {"c@1"}  # held until released


# -- the router actor, driven directly -------------------------------------------------------------


def info(name: str, role: Role, max_num_seqs: int = 2, blocks: int = 64) -> WorkerInfo:
    return WorkerInfo(
        name,
        role,
        "a" if name.endswith("0") else "b",
        None,
        BS,
        incarnation="i1",
        max_model_len=256,
        vocab_size=100,
        max_num_seqs=max_num_seqs,
        num_kv_blocks=blocks,
    )


def load(
    name: str, running: int = 0, claimed: int = 0, admitted: tuple[str, ...] = ()
) -> WorkerLoad:
    return WorkerLoad(
        name, "i1", 0, running, claimed / 64, claimed_blocks=claimed, admitted=admitted
    )


WORKERS = [("prefill-0", Role.PREFILL, "a"), ("decode-0", Role.DECODE, "a")]


async def router(max_queued: int = 8) -> RouterActor:
    config = RouterConfig(
        local_prefill_max_tokens=0, admission=AdmissionConfig(max_queued=max_queued)
    )
    actor = RouterActor(WORKERS, config, heartbeat_timeout_s=3600.0, namespace="test")
    for name, role, _ in WORKERS:
        await actor.report(info(name, role), load(name), [], resync=True)
    return actor


def test_the_router_admits_as_room_frees_in_order_and_refuses_past_its_bound() -> None:
    async def body() -> None:
        actor = await router(max_queued=2)
        calls = [asyncio.ensure_future(actor.admit(route(f"r{i}@1", n=8))) for i in range(4)]
        await asyncio.sleep(0.01)
        assert [c.done() for c in calls] == [True, True, False, False]  # 2 slots each
        assert (await actor.queue_stats()) == (2, 2)
        with pytest.raises(AdmissionRefused) as full:
            await actor.admit(route("r9@1", n=8))
        assert full.value.reason is Refusal.QUEUE_FULL and full.value.retry_after_s == 1.0
        # A migration is never refused and goes first, full queue or not.
        started = asyncio.ensure_future(actor.admit(route("r0@2", n=12, resumed=2)))
        await asyncio.sleep(0.01)
        assert (await actor.queue_stats())[0] == 3
        # r0 ends: its grant is released and both workers report it gone. The migration
        # (first in the queue) takes the room, then r1's release lets r2 in.
        await actor.release("r0@1")
        await actor.report(
            info("prefill-0", Role.PREFILL), load("prefill-0", admitted=("r1@1",)), [], resync=False
        )
        await actor.report(
            info("decode-0", Role.DECODE), load("decode-0", 1, 4, ("r1@1",)), [], resync=False
        )
        await asyncio.sleep(0.01)
        assert started.done() and not calls[2].done()
        assert (await started).decode == "decode-0"
        await actor.release("r1@1")
        await actor.report(info("decode-0", Role.DECODE), load("decode-0"), [], resync=False)
        await asyncio.sleep(0.01)
        assert calls[2].done() and not calls[3].done()
        assert [line["request_id"] for line in await actor.decisions()] == [
            "r0@1",
            "r1@1",
            "r0@2",
            "r2@1",
        ]
        calls[3].cancel()  # its client left: it leaves the queue
        await asyncio.sleep(0.01)
        assert (await actor.queue_stats()) == (0, 3)

    asyncio.run(asyncio.wait_for(body(), 10))


def test_a_queued_request_past_its_deadline_is_refused_and_leaves() -> None:
    async def body() -> None:
        actor = await router()
        loop = asyncio.get_running_loop()
        held = [await actor.admit(route(f"h{i}@1")) for i in range(2)]
        assert [d.decode for d in held] == ["decode-0", "decode-0"]
        start = loop.time()
        with pytest.raises(AdmissionRefused) as late:
            await actor.admit(route("late@1", deadline=time.time() + 0.2))
        assert late.value.reason is Refusal.DEADLINE_PASSED and late.value.retry_after_s is None
        assert 0.15 < loop.time() - start < 1.0
        assert (await actor.queue_stats())[0] == 0

    asyncio.run(asyncio.wait_for(body(), 10))


def test_a_request_no_worker_outside_its_exclusions_can_serve_fails_at_once() -> None:
    """Waiting cannot help a request whose excluded workers leave none: it is not queued."""

    async def body() -> None:
        actor = await router()
        excluded = RouteRequest("x@2", [], 8, exclude_workers=frozenset({"decode-0"}))
        with pytest.raises(NoReplicaAvailable):
            await actor.admit(excluded)
        assert (await actor.queue_stats())[0] == 0

    asyncio.run(asyncio.wait_for(body(), 10))


def test_an_excluded_domain_serves_when_nothing_else_is_healthy() -> None:
    """An excluded domain steers a retry away only while a worker elsewhere is healthy: with
    every worker in it (and healthy again), the retry is admitted there rather than failed;
    with its only decode worker FAILED, it waits."""

    async def body() -> None:
        actor = await router()
        retry = RouteRequest("x@2", [], 8, exclude_domains=frozenset({"a"}))
        decision = await actor.admit(retry)
        assert (decision.prefill, decision.decode) == ("prefill-0", "decode-0")
        await actor.worker_failed("decode-0")
        waiting = asyncio.ensure_future(actor.admit(route("y@2", n=8)))
        await asyncio.sleep(0.05)
        assert not waiting.done() and (await actor.queue_stats())[0] == 1
        waiting.cancel()

    asyncio.run(asyncio.wait_for(body(), 10))


def test_a_request_nothing_can_serve_waits_then_is_refused_unavailable() -> None:
    """Every decode worker FAILED (silent past its heartbeat timeout): a request waits
    ``unavailable_wait_s``, then is refused UNAVAILABLE with Retry-After -- while a request
    waiting only for capacity is never refused for it."""

    async def body() -> None:
        config = RouterConfig(
            local_prefill_max_tokens=0, admission=AdmissionConfig(unavailable_wait_s=0.3)
        )
        actor = RouterActor(WORKERS, config, heartbeat_timeout_s=0.2, namespace="test")
        beating = {"prefill-0", "decode-0"}

        async def heartbeats() -> None:
            first = True
            while True:
                for name, role, _ in WORKERS:
                    if name in beating:
                        await actor.report(info(name, role), load(name), [], resync=first)
                first = False
                await asyncio.sleep(0.02)

        beat = asyncio.ensure_future(heartbeats())
        await asyncio.sleep(0.05)
        held = [await actor.admit(route(f"h{i}@1", n=8)) for i in range(2)]  # both slots
        full = asyncio.ensure_future(actor.admit(route("full@1", n=8)))
        await asyncio.sleep(0.6)  # twice the unavailable wait: a capacity wait goes on
        assert not full.done() and len(held) == 2
        full.cancel()
        beating.discard("decode-0")  # falls silent: FAILED after 0.2 s
        await asyncio.sleep(0.35)
        assert [s.failed for s in await actor.worker_states()] == [False, True]
        start = time.time()
        with pytest.raises(AdmissionRefused) as refused:
            await actor.admit(route("u@1", n=8))
        assert refused.value.reason is Refusal.UNAVAILABLE
        assert refused.value.retry_after_s == 5.0
        assert 0.3 <= time.time() - start < 1.0
        assert (await actor.queue_stats())[0] == 0
        beat.cancel()

    asyncio.run(asyncio.wait_for(body(), 10))


def test_a_restarted_router_takes_only_resyncs_and_fails_no_worker_it_has_not_heard() -> None:
    """A router that starts (again) has no view of the workers: a worker's plain report is
    refused (False: the worker resyncs), its resync taken; until then the worker is not
    healthy (no traffic) but not FAILED either (a coordinator's watch keeps its streams)."""

    async def body() -> None:
        config = RouterConfig(local_prefill_max_tokens=0)
        actor = RouterActor(WORKERS, config, heartbeat_timeout_s=3600.0, namespace="test")
        version, health = await actor.watch_health(-1, 0.0)
        assert health == {"prefill-0": True, "decode-0": True}
        assert [s.healthy for s in await actor.worker_states()] == [False, False]
        decode = info("decode-0", Role.DECODE)
        assert await actor.report(decode, load("decode-0"), [], resync=False) is False
        assert not (await actor.worker_states())[1].healthy
        assert await actor.report(decode, load("decode-0"), [], resync=True) is True
        assert await actor.report(decode, load("decode-0"), [], resync=False) is True
        assert (await actor.worker_states())[1].healthy
        await actor.worker_failed("decode-0")
        version, health = await actor.watch_health(version, 0.0)
        assert health == {"prefill-0": True, "decode-0": False}
        assert (await actor.worker_states())[1].failed

    asyncio.run(asyncio.wait_for(body(), 10))


def test_a_request_whose_predicted_wait_passes_its_deadline_is_refused_at_once() -> None:
    """Once the queue's drain rate is measured (admissions of requests that waited), a request
    whose predicted wait is longer than the time left to its deadline is refused with
    WAIT_EXCEEDS_DEADLINE, not queued; one with time enough waits."""

    async def body() -> None:
        actor = await router(max_queued=16)
        for i in range(2):
            await actor.admit(route(f"h{i}@1"))
        waiters = [asyncio.ensure_future(actor.admit(route(f"w{i}@1"))) for i in range(6)]
        await asyncio.sleep(0.01)
        for i in range(4):  # each release lets one waiter in, 50 ms apart: 20 admissions/s
            await asyncio.sleep(0.05)
            await actor.release(f"h{i}@1" if i < 2 else f"w{i - 2}@1")
            await actor.report(info("decode-0", Role.DECODE), load("decode-0"), [], resync=False)
        await asyncio.sleep(0.01)
        assert [w.done() for w in waiters] == [True] * 4 + [False] * 2
        rate = actor.rate.per_second(time.time())
        assert rate is not None and 10 < rate < 30
        with pytest.raises(AdmissionRefused) as late:  # 3 to wait for: ~0.15 s > 0.05 s left
            await actor.admit(route("late@1", deadline=time.time() + 0.05))
        assert late.value.reason is Refusal.WAIT_EXCEEDS_DEADLINE
        assert late.value.retry_after_s == 1.0
        assert len(actor.queue) == 2  # not queued
        patient = asyncio.ensure_future(actor.admit(route("ok@1", deadline=time.time() + 5)))
        await asyncio.sleep(0.01)
        assert not patient.done() and len(actor.queue) == 3  # waits
        patient.cancel()
        for w in waiters[4:]:
            w.cancel()

    asyncio.run(asyncio.wait_for(body(), 10))


def test_a_worker_restarted_under_a_known_name_is_failed_at_once_with_its_credit_dropped() -> None:
    """P12 without waiting for a heartbeat timeout: a worker process that starts under a name
    the router knows with another incarnation says so from its constructor; the router drops
    the old process's cache credit and takes it out of routing until it is readmitted. Its
    first start (no incarnation known) and a repeat of the known one change nothing."""

    async def body() -> None:
        actor = await router()
        stored = KVEvent(KVEventKind.STORED, (11, 12, 13))
        prefill = info("prefill-0", Role.PREFILL)
        assert await actor.report(prefill, load("prefill-0"), [stored], resync=False)
        await actor.worker_started("prefill-0", "i1")  # the incarnation it knows
        await actor.worker_started("decode-9", "x")  # a name it does not know
        states = {s.name: s for s in await actor.worker_states()}
        assert (states["prefill-0"].healthy, states["prefill-0"].cached_blocks) == (True, 3)
        await actor.worker_started("prefill-0", "i2")
        states = {s.name: s for s in await actor.worker_states()}
        assert (states["prefill-0"].healthy, states["prefill-0"].failed) == (False, True)
        assert states["prefill-0"].cached_blocks == 0
        assert await actor.failures_detected() == {"restart": 1}
        await actor.worker_failed("decode-0")
        assert await actor.failures_detected() == {"restart": 1, "actor_death": 1}

    asyncio.run(asyncio.wait_for(body(), 10))


def test_a_worker_ray_restarted_while_no_router_watched_is_failed_when_it_says_so() -> None:
    """A restarted router knows no incarnation. A worker whose process Ray reconstructed says so
    from its constructor: its previous process died unseen (while the router was down), so it is
    FAILED at once -- what a coordinator still waiting on the dead process hears -- not after
    the first look's silence rule. A first start the router does not know changes nothing."""

    async def body() -> None:
        actor = RouterActor(WORKERS, RouterConfig(), heartbeat_timeout_s=3600.0, namespace="t")
        await actor.worker_started("prefill-0", "j1", reconstructed=False)
        await actor.worker_started("decode-0", "j2", reconstructed=True)
        states = {s.name: s for s in await actor.worker_states()}
        assert (states["prefill-0"].failed, states["decode-0"].failed) == (False, True)
        events = await actor.health_events()
        assert [(e["worker"], e["event"], e["why"]) for e in events] == [
            ("decode-0", "failed", RESTARTED_UNSEEN)
        ]
        assert await actor.failures_detected() == {"restart": 1}

    asyncio.run(asyncio.wait_for(body(), 10))


def test_the_health_log_records_each_transition_once() -> None:
    """A worker that falls silent is logged FAILED once, with why; its reports are refused
    while its health check has not answered (nothing logged: no "up" without a "checked");
    another report of its death adds nothing."""

    async def body() -> None:
        config = RouterConfig(local_prefill_max_tokens=0)
        actor = RouterActor(WORKERS, config, heartbeat_timeout_s=0.2, namespace="test")
        for name, role, _ in WORKERS:
            await actor.report(info(name, role), load(name), [], resync=True)
        assert [(e["worker"], e["event"]) for e in await actor.health_events()] == [
            ("prefill-0", "up"),
            ("decode-0", "up"),
        ]
        prefill = info("prefill-0", Role.PREFILL)
        until = time.time() + 2.0
        while not (await actor.worker_states())[1].failed:  # decode-0 is silent
            assert time.time() < until
            await actor.report(prefill, load("prefill-0"), [], resync=False)
            await asyncio.sleep(0.02)
        decode = info("decode-0", Role.DECODE)
        assert await actor.report(decode, load("decode-0"), [], resync=True) is False
        await actor.worker_failed("decode-0")
        events = (await actor.health_events())[2:]
        assert [(e["worker"], e["event"]) for e in events] == [("decode-0", "failed")]
        assert events[0]["why"].startswith("silent for ")
        assert float(events[0]["why"].split()[2]) >= 0.2
        # Counted once, by how it was found: the later report of its death adds nothing.
        assert await actor.failures_detected() == {"heartbeat": 1}

    asyncio.run(asyncio.wait_for(body(), 10))
