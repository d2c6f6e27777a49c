"""The router actor ``tandem-router``: the cluster's view of its workers, its admission queue
(router/admission.py: an attempt gets its prefill/decode pair only once both have room for it),
and the choice of that pair (router/policy.py) over an exact prefix index
(router/prefix_index.py).

What it knows comes from the workers' reports (load + KV events, pushed after every change and
as a heartbeat) and from the coordinator (``worker_failed``). A worker is FAILED when it is
reported dead or falls silent for ``heartbeat_timeout_s`` of the router's own awake time and does
not answer a direct probe (router/health.py: the router's pauses are not the workers' silence,
P16); a restarted router gives each worker one heartbeat timeout to report or connect, so
one that died meanwhile is FAILED then, not left unreported until it returns. A FAILED worker's index entries are dropped at
once (no credit for cache that is gone, P12), its reports are ignored, and it gets no traffic
until a health check (``ready()`` on its actor, which Ray restarts) answers; ``ready()`` makes
the worker resync (CLEARED, then all it holds), so a false alarm costs no credit for cache
that is still there. A restarted router starts empty and rebuilds from the resyncs: it takes
no report from a worker it does not know until that worker resyncs (``report`` answers False
to the others, which makes them resync), and a worker it has not heard from yet is not FAILED
(``watch_health`` tells coordinators only of real failures, so a router restart migrates no
stream).

Admission: ``admit`` queues the attempt and returns its decision once granted (or raises
AdmissionRefused / NoReplicaAvailable); the coordinator calls ``release`` when the attempt
ends. Whatever may free room (a report, a release, a worker back) lets the queue's head in.
A head that nothing can serve (every worker of a role it needs FAILED or not back yet) waits
up to ``admission.unavailable_wait_s``; then every request so blocked is refused (503,
``Refusal.UNAVAILABLE``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter, deque
from typing import TYPE_CHECKING, Any

import ray

from contracts.actors import RouterAPI, WorkerClient
from contracts.liveness import LivenessServer
from contracts.messages import WorkerInfo, WorkerLoad
from contracts.pause import PauseClock
from contracts.roles import Role
from contracts.routing import (
    UNAVAILABLE_RETRY_AFTER_S,
    AdmissionRefused,
    Decision,
    DetectedBy,
    NoReplicaAvailable,
    Refusal,
    RouteRequest,
    WorkerState,
)
from engine.kv_events import KVEvent
from router.admission import AdmissionQueue, AdmissionRate, Ledger, Waiter, refusal
from router.config import RouterConfig
from router.health import Judgement, Probes, SilenceWatch
from router.policy import FULL, WAITABLE, choose
from router.prefix_index import PrefixIndex

logger = logging.getLogger("tandem.router")
HEALTH_CHECK_INTERVAL_S = 0.5
# How often silences are checked: a silent worker is FAILED at most this long after its
# heartbeat timeout (a quarter of the timeout, if that is shorter).
HEARTBEAT_CHECK_S = 0.25
# Why a worker Ray restarted while no router watched is FAILED (the router's first look).
RESTARTED_UNSEEN = "Ray restarted its actor while the router was down"


class RouterActor:
    def __init__(
        self,
        workers: list[tuple[str, Role, str]],
        config: RouterConfig,
        heartbeat_timeout_s: float,
        namespace: str,
        cluster_key: str = "",
    ) -> None:
        self.cluster_key = cluster_key  # what the cluster was started from (tandem.launch)
        self.states: dict[str, WorkerState] = {
            name: WorkerState.unreported(name, role, domain) for name, role, domain in workers
        }
        self.config = config
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.namespace = namespace
        self.index = PrefixIndex()
        self.incarnations: dict[str, str] = {}
        self.clock = PauseClock()
        self.silence = SilenceWatch(heartbeat_timeout_s, self.clock)
        self.probes = Probes(self.silence, heartbeat_timeout_s, self._fail, self._note)
        self.log: deque[dict[str, Any]] = deque(maxlen=1000)
        # Each worker's health transitions, in order: failed (why), checked (its health check
        # answered: it may report again), up (its report was taken). What detection and
        # recovery times are measured from.
        self.health_log: deque[dict[str, Any]] = deque(maxlen=1000)
        self.detected: Counter[DetectedBy] = Counter()
        self._checking: set[str] = set()
        self._monitor: asyncio.Task[None] | None = None
        self.liveness: LivenessServer | None = None
        self._liveness_started: asyncio.Task[str] | None = None
        # Health changes, for watch_health: the version counts them, the event fires on each.
        self.health_version = 0
        self._health_changed = asyncio.Event()
        self.queue = AdmissionQueue()
        self.ledger = Ledger(self.states)
        self.rate = AdmissionRate()
        self._waiting: dict[Waiter, asyncio.Future[Decision]] = {}
        self.max_queued_seen = 0  # the deepest the queue got (tests: it never passes its bound)
        self._stalled_since: float | None = None  # the head waits, no worker able to serve it

    async def key(self) -> str:
        """What this cluster was started from: an ingress attaching to it checks it is the
        cluster its topology describes."""
        self._start_monitor()  # a restarted router's first caller: its probes start now
        return self.cluster_key

    async def wait_ready(self, timeout_s: float) -> None:
        """Until every worker has reported once (start-up)."""
        self._start_monitor()
        deadline = time.time() + timeout_s
        while not all(s.healthy for s in self.states.values()):
            if time.time() > deadline:
                missing = [n for n, s in self.states.items() if not s.healthy]
                raise TimeoutError(f"workers never reported: {missing}")
            await asyncio.sleep(0.05)

    # -- reports -------------------------------------------------------------------------------

    async def report(
        self,
        info: WorkerInfo,
        load: WorkerLoad,
        events: list[KVEvent],
        resync: bool,
        handle: Any = None,
    ) -> bool:
        """Take a worker's report; False if it was ignored (an unknown worker, a FAILED one
        not yet readmitted by its health check, or one this router has no view of yet and
        that does not resync: a restarted router), so the worker resyncs with its next one."""
        self._start_monitor()
        name = info.name
        state = self.states.get(name)
        if state is None:
            return False
        if self.incarnations.get(name) != info.incarnation:
            if not resync:  # events on top of a view this router does not have
                return False
            self.index.drop_worker(name)  # a restarted worker: its old cache is gone
            self.ledger.forget_worker(name)  # and what it was promised
            self.incarnations[name] = info.incarnation
        if not state.healthy and name in self._checking:
            return False  # failed: it rejoins through the health check
        self.index.apply(name, events)
        state.info = info
        self.silence.heard(name)
        if handle is not None:
            self.probes.handles[name] = handle  # what a probe calls, some day
        if not state.healthy:
            self._note(name, "up")
        self._set_healthy(state, True)
        state.report = load
        self.ledger.admitted(name, load.admitted)
        self._pump()
        return True

    async def worker_started(
        self, name: str, incarnation: str, reconstructed: bool = False
    ) -> None:
        """``name``'s process (re)started. If this router knew another incarnation of it, the
        cache it credited died with that process (P12): FAILED at once -- no traffic, no credit
        -- until the health check readmits it (it then resyncs), not after a heartbeat timeout.
        If it knew none (this router restarted too) but Ray ``reconstructed`` the actor, the
        process before it died unseen by any router -- while this one was down: FAILED too, so
        coordinators still waiting on the dead process learn it now."""
        known = self.incarnations.get(name)
        if known is not None and known != incarnation:
            self._fail(name, "restarted", DetectedBy.RESTART)
        elif known is None and reconstructed:
            self._fail(name, RESTARTED_UNSEEN, DetectedBy.RESTART)

    async def worker_failed(self, name: str) -> None:
        """The coordinator saw ``name`` die (actor death, transport UNAVAILABLE)."""
        self._fail(name, "reported dead", DetectedBy.ACTOR_DEATH)

    def _fail(self, name: str, why: str, how: DetectedBy) -> None:
        """Mark ``name`` FAILED; ``how`` it was found out."""
        state = self.states.get(name)
        if state is None:
            return
        if state.healthy:
            logger.warning("worker %s FAILED: %s", name, why)
        if not state.failed:
            self._note(name, "failed", why)
            self.detected[how] += 1
        state.failed = True
        self._set_healthy(state, False)
        self.silence.forget(name)
        self.index.drop_worker(name)
        self.ledger.forget_worker(name)
        if name not in self._checking:
            self._checking.add(name)
            asyncio.get_running_loop().create_task(self._health_check(name))

    def _note(self, name: str, event: str, why: str = "") -> None:
        self.health_log.append({"worker": name, "event": event, "why": why, "at": time.time()})

    async def failures_detected(self) -> dict[str, int]:
        """Workers this router marked FAILED, by how it found out (since it started)."""
        return {how.value: n for how, n in self.detected.items()}

    async def health_events(self) -> list[dict[str, Any]]:
        """The workers' health transitions (``health_log``), oldest first."""
        return list(self.health_log)

    def _set_healthy(self, state: WorkerState, healthy: bool) -> None:
        if state.healthy != healthy:
            state.healthy = healthy
            self._health_news()

    def _health_news(self) -> None:
        self.health_version += 1
        self._health_changed.set()
        self._health_changed = asyncio.Event()

    async def watch_health(self, version: int, timeout_s: float) -> tuple[int, dict[str, bool]]:
        """Whether each worker is FAILED (False) or not, once that differs from ``version``
        (or after ``timeout_s``): a long poll, so coordinators learn at once that a worker they
        wait on went FAILED. A worker not reported yet (this router just restarted) is not
        FAILED: what it streams keeps flowing."""
        self._start_monitor()
        if version == self.health_version:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._health_changed.wait(), timeout_s)
        return self.health_version, {name: not s.failed for name, s in self.states.items()}

    async def _health_check(self, name: str) -> None:
        """Poll the (restarting) actor until it answers; then it may report again."""
        try:
            while True:
                try:
                    handle = self.probes.handles.get(name)
                    if handle is None:  # not resynced here yet: looked up off the event loop
                        lookup = ray.get_actor
                        handle = await asyncio.to_thread(lookup, name, namespace=self.namespace)
                    info: WorkerInfo = await asyncio.wait_for(WorkerClient(handle).ready(), 5.0)
                    self.incarnations[name] = info.incarnation
                    self.index.drop_worker(name)
                    self.silence.heard(name)
                    self.states[name].failed = False
                    self._note(name, "checked")
                    self._health_news()
                    return
                except Exception:
                    await asyncio.sleep(HEALTH_CHECK_INTERVAL_S)
        finally:
            self._checking.discard(name)

    def _start_monitor(self) -> None:
        if self._monitor is None:
            loop = asyncio.get_running_loop()
            self.clock.start()
            self._monitor = loop.create_task(self._watch_heartbeats())
            if ray.is_initialized():  # (a router under test without Ray has no processes)
                self.liveness = LivenessServer(ray.util.get_node_ip_address(), self._lost)
                self._liveness_started = loop.create_task(self.liveness.start())
                context = ray.get_runtime_context()
                if context.get_actor_id() is not None and context.was_current_actor_reconstructed:
                    loop.create_task(self.probes.first_look(list(self.states), self.liveness))

    async def liveness_address(self) -> str | None:
        """Where each worker process holds its connection (contracts/liveness.py)."""
        self._start_monitor()
        if self._liveness_started is None:
            return None
        return await asyncio.shield(self._liveness_started)

    def _lost(self, name: str, incarnation: str) -> None:
        """A worker's liveness connection closed: its process exited, if that incarnation is
        the one this router knows (a restarted process connects again under a new one)."""
        state = self.states.get(name)
        if state is not None and not state.failed and self.incarnations.get(name) == incarnation:
            self._fail(name, "its process exited", DetectedBy.ACTOR_DEATH)

    async def _watch_heartbeats(self) -> None:
        while True:
            mono, now = time.monotonic(), time.time()
            for name, state in self.states.items():
                if not state.healthy:
                    continue
                judged = self.silence.judge(name, mono)
                if judged is Judgement.PROBE:
                    probe = self.probes.probe(name, self.incarnations.get(name))
                    asyncio.get_running_loop().create_task(probe)
                elif judged is Judgement.FAIL:
                    silent = self.silence.silence_s(name, mono)
                    why = f"silent for {silent:.1f} s, and no answer to a direct probe"
                    self._fail(name, why, DetectedBy.HEARTBEAT)
            awake = now - (mono - self.clock.awake_since())  # the end of its last pause
            if self.ledger.expire(now, self.config.admission.holder_timeout_s, awake):
                self._pump()
            # Waiting for a worker to come back is measured in the router's awake time too.
            since = self._stalled_since
            if since is not None:
                waited = now - max(since, awake)
                if waited > self.config.admission.unavailable_wait_s:
                    self._refuse_unservable(now - since)
            await asyncio.sleep(min(self.heartbeat_timeout_s / 4, HEARTBEAT_CHECK_S))

    # -- admission and decisions ---------------------------------------------------------------

    async def admit(self, request: RouteRequest) -> Decision:
        """The attempt's workers, once every one of them has room for it (router/admission.py).
        Raises AdmissionRefused (queue full, a wait longer than its deadline, its deadline
        passed while queued) or NoReplicaAvailable (no worker outside its exclusions)."""
        self._start_monitor()
        now = time.time()
        waiter = self.queue.push(request, now)
        future: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()
        self._waiting[waiter] = future
        self._pump()
        if not future.done():  # it has to wait: may it?
            rate = self.rate.per_second(now)
            refused = refusal(request, self.config.admission, len(self.queue) - 1, rate, now)
            if refused is not None:
                del self._waiting[waiter]
                self.queue.remove(waiter)
                self._pump()  # it may have been the head: the next one may fit
                raise refused
            waiter.waited = True  # its admission will measure how fast the queue drains
            self.max_queued_seen = max(self.max_queued_seen, len(self.queue))
        timeout = None if request.deadline is None else max(0.0, request.deadline - now)
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError:
            if future.done() and not future.cancelled():
                return future.result()  # granted just as the deadline passed: it may try
            raise AdmissionRefused(
                request.request_id,
                Refusal.DEADLINE_PASSED,
                f"its deadline passed after {time.time() - now:.1f} s in the admission queue",
                retry_after_s=None,
            ) from None
        except asyncio.CancelledError:  # the caller gave up (its client went away)
            if future.done() and not future.cancelled() and future.exception() is None:
                self.ledger.release(request.request_id)
                self._pump()
            raise
        finally:
            self._waiting.pop(waiter, None)
            if self.queue.remove(waiter):
                self._pump()  # the head left: the next one may fit

    async def hold(self, holder: str) -> None:
        """Coordinator ``holder`` is alive: its grants stay (it renews every HOLD_RENEW_S)."""
        self.ledger.hold(holder, time.time())

    async def release(self, attempt_id: str) -> None:
        """The coordinator is done with ``attempt_id``'s grant (it ended, or never reached
        its workers)."""
        if self.ledger.release(attempt_id):
            self._pump()

    def _pump(self) -> None:
        """Admit from the queue's head while its attempt finds workers with room."""
        while (waiter := self.queue.head(self.ledger.in_flight)) is not None:
            request = waiter.request
            try:
                decision = choose(request, list(self.states.values()), self.index, self.config)
            except NoReplicaAvailable as exc:
                reasons = set(exc.reasons.values())
                if WAITABLE & reasons:  # full or restarting: it waits, nobody overtakes it
                    if FULL in reasons:
                        self._stalled_since = None
                    elif self._stalled_since is None:
                        self._stalled_since = time.time()
                    return
                self.queue.remove(waiter)
                self._settle(waiter, error=exc)
                continue
            self.queue.remove(waiter)
            now = time.time()
            self.ledger.grant(decision, request, now)
            if waiter.waited:
                self.rate.record(now)
            line = {**decision.log_line(), "client_request_id": request.client_request_id}
            self.log.append(line)
            if logger.isEnabledFor(logging.DEBUG):  # the breakdown is ~100 us to serialise
                logger.debug("route %s", json.dumps(line, default=str))
            self._settle(waiter, decision=decision)
        self._stalled_since = None

    def _refuse_unservable(self, waited_s: float) -> None:
        """Refuse every queued request that no worker could serve for ``waited_s``: all the
        workers of a role it needs are FAILED or not back (a capacity wait is not refused)."""
        states = list(self.states.values())
        for waiter in self.queue.waiters():
            try:
                choose(waiter.request, states, self.index, self.config)
            except NoReplicaAvailable as exc:
                if FULL in exc.reasons.values():
                    continue
                self.queue.remove(waiter)
                detail = f"no replica could serve it for {waited_s:.1f} s ({exc})"
                refused = AdmissionRefused(
                    waiter.request.request_id,
                    Refusal.UNAVAILABLE,
                    detail,
                    retry_after_s=UNAVAILABLE_RETRY_AFTER_S,
                )
                self._settle(waiter, error=refused)
        self._stalled_since = None
        self._pump()

    def _settle(
        self,
        waiter: Waiter,
        decision: Decision | None = None,
        error: BaseException | None = None,
    ) -> None:
        future = self._waiting.get(waiter)
        if future is None or future.done():
            if decision is not None:  # nobody waits for it any more
                self.ledger.release(decision.request_id)
            return
        if error is not None:
            future.set_exception(error)
        elif decision is not None:
            future.set_result(decision)

    async def queue_stats(self) -> tuple[int, int]:
        """(requests waiting now, the most that ever waited at once)."""
        return len(self.queue), self.max_queued_seen

    async def grants(self) -> dict[str, int]:
        """Grants not yet released, per tenant (the queue's fair-share order reads them)."""
        return dict(self.ledger.in_flight)

    async def decisions(self) -> list[dict[str, Any]]:
        return list(self.log)

    async def worker_states(self) -> list[WorkerState]:
        """Every worker as the router sees it (health, load, and the cache it is credited)."""
        for state in self.states.values():
            state.cached_blocks = self.index.held_by(state.name)
        return list(self.states.values())


if TYPE_CHECKING:  # mypy checks that the actor serves its interface
    _: type[RouterAPI] = RouterActor
