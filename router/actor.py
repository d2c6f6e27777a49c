"""The router actor ``tandem-router``: the cluster's view of its workers, and the choice of a
prefill/decode pair per attempt (router/policy.py) over an exact prefix index
(router/prefix_index.py).

What it knows comes from the workers' reports (load + KV events, pushed after every change and
as a heartbeat) and from the coordinator (``worker_failed``). A worker is FAILED when it is
reported dead or falls silent for ``heartbeat_timeout_s``: its index entries are dropped at
once (no credit for cache that is gone, P12), its reports are ignored, and it gets no traffic
until a health check (``ready()`` on its actor, which Ray restarts) answers; ``ready()`` makes
the worker resync (CLEARED, then all it holds), so a false alarm costs no credit for cache
that is still there. A restarted router starts empty and rebuilds from the resyncs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import ray

from contracts.actors import RouterAPI, WorkerClient
from contracts.messages import WorkerInfo, WorkerLoad
from contracts.roles import Role
from contracts.routing import Decision, RouteRequest, WorkerState
from engine.kv_events import KVEvent
from router.config import RouterConfig
from router.policy import choose
from router.prefix_index import PrefixIndex

logger = logging.getLogger("tandem.router")
HEALTH_CHECK_INTERVAL_S = 0.5


class RouterActor:
    def __init__(
        self,
        workers: list[tuple[str, Role, str]],
        config: RouterConfig,
        heartbeat_timeout_s: float,
        namespace: str,
    ) -> None:
        self.states: dict[str, WorkerState] = {
            name: WorkerState(name=name, role=role, domain=domain, healthy=False, block_size=16)
            for name, role, domain in workers
        }
        self.config = config
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.namespace = namespace
        self.index = PrefixIndex()
        self.incarnations: dict[str, str] = {}
        self.last_seen: dict[str, float] = {}
        self.log: deque[dict[str, Any]] = deque(maxlen=1000)
        self._checking: set[str] = set()
        self._monitor: asyncio.Task[None] | None = None
        # Health changes, for watch_health: the version counts them, the event fires on each.
        self.health_version = 0
        self._health_changed = asyncio.Event()

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

    async def report(self, info: WorkerInfo, load: WorkerLoad, events: list[KVEvent]) -> bool:
        """Take a worker's report; False if it was ignored (an unknown worker, or a FAILED one
        not yet readmitted by its health check), so the worker resyncs with its next one."""
        self._start_monitor()
        name = info.name
        state = self.states.get(name)
        if state is None:
            return False
        if self.incarnations.get(name) != info.incarnation:
            self.index.drop_worker(name)  # a restarted worker: its old cache is gone
            self.incarnations[name] = info.incarnation
        if not state.healthy and name in self._checking:
            return False  # failed: it rejoins through the health check
        self.index.apply(name, events)
        state.block_size = info.block_size
        self.last_seen[name] = time.time()
        self._set_healthy(state, True)
        state.queue_depth = load.queue_depth
        state.num_running = load.num_running
        state.kv_usage = load.kv_usage
        state.prefix_hit_ratio = load.prefix_hit_ratio
        return True

    async def worker_failed(self, name: str) -> None:
        """The coordinator saw ``name`` die (actor death, transport UNAVAILABLE)."""
        self._fail(name, "reported dead")

    def _fail(self, name: str, why: str) -> None:
        state = self.states.get(name)
        if state is None:
            return
        if state.healthy:
            logger.warning("worker %s FAILED: %s", name, why)
        self._set_healthy(state, False)
        self.index.drop_worker(name)
        if name not in self._checking:
            self._checking.add(name)
            asyncio.get_running_loop().create_task(self._health_check(name))

    def _set_healthy(self, state: WorkerState, healthy: bool) -> None:
        if state.healthy != healthy:
            state.healthy = healthy
            self.health_version += 1
            self._health_changed.set()
            self._health_changed = asyncio.Event()

    async def watch_health(self, version: int, timeout_s: float) -> tuple[int, dict[str, bool]]:
        """Each worker's health, once it differs from ``version`` (or after ``timeout_s``): a
        long poll, so coordinators learn at once that a worker they wait on went FAILED."""
        if version == self.health_version:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._health_changed.wait(), timeout_s)
        return self.health_version, {name: s.healthy for name, s in self.states.items()}

    async def _health_check(self, name: str) -> None:
        """Poll the (restarting) actor until it answers; then it may report again."""
        try:
            while True:
                try:
                    worker = WorkerClient(ray.get_actor(name, namespace=self.namespace))
                    info: WorkerInfo = await asyncio.wait_for(worker.ready(), 5.0)
                    self.incarnations[name] = info.incarnation
                    self.index.drop_worker(name)
                    self.last_seen[name] = time.time()
                    return
                except Exception:
                    await asyncio.sleep(HEALTH_CHECK_INTERVAL_S)
        finally:
            self._checking.discard(name)

    def _start_monitor(self) -> None:
        if self._monitor is None:
            self._monitor = asyncio.get_running_loop().create_task(self._watch_heartbeats())

    async def _watch_heartbeats(self) -> None:
        while True:
            now = time.time()
            for name, state in self.states.items():
                seen = self.last_seen.get(name)
                if state.healthy and seen is not None and now - seen > self.heartbeat_timeout_s:
                    self._fail(name, f"silent for {now - seen:.1f} s")
            await asyncio.sleep(self.heartbeat_timeout_s / 4)

    # -- decisions -----------------------------------------------------------------------------

    async def choose(self, request: RouteRequest) -> Decision:
        """Pick the attempt's workers (raises NoReplicaAvailable); logs the breakdown."""
        decision = choose(request, list(self.states.values()), self.index, self.config)
        # Count the work sent until the workers' next reports say so themselves: a burst of
        # decisions between two reports must see each other, or it herds onto one replica.
        for name in {decision.prefill, decision.decode}:
            if name is not None:
                self.states[name].queue_depth += 1
        line = decision.log_line()
        self.log.append(line)
        if logger.isEnabledFor(logging.DEBUG):  # the breakdown is ~100 us to serialise
            logger.debug("route %s", json.dumps(line, default=str))
        return decision

    async def decisions(self) -> list[dict[str, Any]]:
        return list(self.log)

    async def worker_states(self) -> list[WorkerState]:
        return list(self.states.values())


if TYPE_CHECKING:  # mypy checks that the actor serves its interface
    _: type[RouterAPI] = RouterActor
