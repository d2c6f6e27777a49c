"""The actors' typed interfaces: what each actor serves (a Protocol its class implements) and a
typed client over its Ray handle, so no caller names a method by string.

    coordinator ──RouterClient.admit / release──> router     workers ──RouterClient.report──> router
    coordinator ──WorkerClient.prefill / start_decode / handoff / start_generate / stop──> workers
    workers ──subscribe (one token stream per coordinator, every attempt's batches)──> coordinator
    router ──WorkerClient.ready──> worker (health check)

A client's methods return what Ray returns for the call (an ``ObjectRef``, awaitable; or an
``ObjectRefGenerator`` for a streaming method), so callers await them or ``ray.get`` them.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any, Protocol

from ray import ObjectRef, ObjectRefGenerator

from contracts.faults import Fault, FaultPlan
from contracts.messages import Delivery, KVSource, TransferRecord, WorkerInfo, WorkerLoad
from contracts.routing import Decision, RouteRequest, WorkerState
from engine.kv_cache_manager import KVStats
from engine.kv_events import KVEvent
from engine.outputs import BackpressureStats, TokenDelta
from engine.request import EngineRequest, TerminalRecord

# Messages a worker's token stream may run ahead of its coordinator before it blocks (Ray
# generator backpressure). The coordinator reads its streams without pause; a slow client is
# paced per attempt (``pace``).
STREAM_AHEAD_MESSAGES = 16


class WorkerAPI(Protocol):
    """What every worker actor serves (cluster.worker.EngineWorker)."""

    async def ready(self) -> WorkerInfo: ...
    async def probe(self) -> tuple[str, bool]: ...
    async def set_faults(self, plan: FaultPlan) -> None: ...
    def subscribe(self, consumer: str) -> AsyncGenerator[list[Delivery], None]: ...
    async def start_generate(self, attempt: EngineRequest, consumer: str) -> None: ...
    async def stop(self, attempt_id: str) -> None: ...
    async def pace(self, attempt_id: str, paused: bool) -> None: ...
    async def kv_stats(self, settled: bool = True) -> KVStats: ...
    async def records(self) -> list[TerminalRecord]: ...
    async def check_idle(self) -> KVStats: ...
    async def backpressure_stats(self) -> BackpressureStats: ...
    async def node_id(self) -> str: ...
    async def pid(self) -> int: ...
    async def faults_pending(self) -> int: ...
    async def add_faults(self, faults: list[Fault]) -> None: ...
    async def faults_fired(self) -> list[Fault]: ...


class PrefillAPI(WorkerAPI, Protocol):
    """A prefill worker (prefill_worker.worker.PrefillWorker)."""

    def prefill(self, attempt: EngineRequest) -> AsyncGenerator[KVSource | TokenDelta, None]: ...
    async def renew_lease(self, request_id: str, attempt_id: str) -> float | None: ...


class DecodeAPI(WorkerAPI, Protocol):
    """A decode worker (decode_worker.worker.DecodeWorker)."""

    async def reserve(self, attempt: EngineRequest) -> None: ...
    async def start_decode(
        self, attempt: EngineRequest, source: KVSource, consumer: str
    ) -> None: ...
    async def handoff(self, attempt_id: str, first: TokenDelta) -> None: ...
    async def transfer_records(self, after: int = 0) -> list[TransferRecord]: ...


class RouterAPI(Protocol):
    """The router actor (router.actor.RouterActor)."""

    async def wait_ready(self, timeout_s: float) -> None: ...
    async def key(self) -> str: ...
    async def report(
        self,
        info: WorkerInfo,
        load: WorkerLoad,
        events: list[KVEvent],
        resync: bool,
        handle: Any = None,
    ) -> bool: ...
    async def worker_started(
        self, name: str, incarnation: str, reconstructed: bool = False
    ) -> None: ...
    async def worker_failed(self, name: str) -> None: ...
    async def watch_health(self, version: int, timeout_s: float) -> tuple[int, dict[str, bool]]: ...
    async def admit(self, request: RouteRequest) -> Decision: ...
    async def release(self, attempt_id: str) -> None: ...
    async def hold(self, holder: str) -> None: ...
    async def queue_stats(self) -> tuple[int, int]: ...
    async def grants(self) -> dict[str, int]: ...
    async def decisions(self) -> list[dict[str, Any]]: ...
    async def health_events(self) -> list[dict[str, Any]]: ...
    async def failures_detected(self) -> dict[str, int]: ...
    async def liveness_address(self) -> str | None: ...
    async def worker_states(self) -> list[WorkerState]: ...


class WorkerClient:
    """A worker actor's Ray handle with the worker interfaces as typed methods."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def ready(self) -> ObjectRef[WorkerInfo]:
        return self.handle.ready.remote()

    def probe(self) -> ObjectRef[tuple[str, bool]]:
        """(incarnation, whether its engine answers): the router's direct check."""
        return self.handle.probe.remote()

    def set_faults(self, plan: FaultPlan) -> ObjectRef[None]:
        return self.handle.set_faults.remote(plan)

    def subscribe(self, consumer: str) -> ObjectRefGenerator:
        options = self.handle.subscribe.options(
            _generator_backpressure_num_objects=STREAM_AHEAD_MESSAGES
        )
        return options.remote(consumer)  # type: ignore[no-any-return]

    def start_generate(self, attempt: EngineRequest, consumer: str) -> ObjectRef[None]:
        return self.handle.start_generate.remote(attempt, consumer)

    def stop(self, attempt_id: str) -> ObjectRef[None]:
        return self.handle.stop.remote(attempt_id)

    def pace(self, attempt_id: str, paused: bool) -> ObjectRef[None]:
        return self.handle.pace.remote(attempt_id, paused)

    def prefill(self, attempt: EngineRequest) -> ObjectRefGenerator:
        return self.handle.prefill.remote(attempt)  # two items, then it holds the lease

    def renew_lease(self, attempt: EngineRequest) -> ObjectRef[float | None]:
        """Keep the prefill worker's lease on ``attempt``'s KV (its puller waits for room)."""
        return self.handle.renew_lease.remote(attempt.request_id, attempt.key)

    def reserve(self, attempt: EngineRequest) -> ObjectRef[None]:
        return self.handle.reserve.remote(attempt)

    def start_decode(
        self, attempt: EngineRequest, source: KVSource, consumer: str
    ) -> ObjectRef[None]:
        return self.handle.start_decode.remote(attempt, source, consumer)

    def handoff(self, attempt_id: str, first: TokenDelta) -> ObjectRef[None]:
        return self.handle.handoff.remote(attempt_id, first)

    def kv_stats(self, settled: bool = True) -> ObjectRef[KVStats]:
        return self.handle.kv_stats.remote(settled)

    def records(self) -> ObjectRef[list[TerminalRecord]]:
        return self.handle.records.remote()

    def check_idle(self) -> ObjectRef[KVStats]:
        return self.handle.check_idle.remote()

    def backpressure_stats(self) -> ObjectRef[BackpressureStats]:
        return self.handle.backpressure_stats.remote()

    def transfer_records(self, after: int = 0) -> ObjectRef[list[TransferRecord]]:
        return self.handle.transfer_records.remote(after)

    def node_id(self) -> ObjectRef[str]:
        return self.handle.node_id.remote()

    def pid(self) -> ObjectRef[int]:
        return self.handle.pid.remote()

    def faults_pending(self) -> ObjectRef[int]:
        return self.handle.faults_pending.remote()

    def add_faults(self, faults: list[Fault]) -> ObjectRef[None]:
        return self.handle.add_faults.remote(faults)

    def faults_fired(self) -> ObjectRef[list[Fault]]:
        return self.handle.faults_fired.remote()


class RouterClient:
    """The router actor's Ray handle with :class:`RouterAPI` as typed methods."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def wait_ready(self, timeout_s: float) -> ObjectRef[None]:
        return self.handle.wait_ready.remote(timeout_s)

    def key(self) -> ObjectRef[str]:
        return self.handle.key.remote()

    def report(
        self,
        info: WorkerInfo,
        load: WorkerLoad,
        events: list[KVEvent],
        resync: bool,
        handle: Any = None,
    ) -> ObjectRef[bool]:
        """``handle``: the worker's own actor handle, sent with its resyncs (the router probes
        it through it, never looking it up: Ray's lookup blocks while an actor restarts)."""
        return self.handle.report.remote(info, load, events, resync, handle)

    def worker_started(self, name: str, incarnation: str, reconstructed: bool) -> ObjectRef[None]:
        return self.handle.worker_started.remote(name, incarnation, reconstructed)

    def worker_failed(self, name: str) -> ObjectRef[None]:
        return self.handle.worker_failed.remote(name)

    def watch_health(
        self, version: int, timeout_s: float
    ) -> ObjectRef[tuple[int, dict[str, bool]]]:
        return self.handle.watch_health.remote(version, timeout_s)

    def admit(self, request: RouteRequest) -> ObjectRef[Decision]:
        return self.handle.admit.remote(request)

    def hold(self, holder: str) -> ObjectRef[None]:
        return self.handle.hold.remote(holder)

    def release(self, attempt_id: str) -> ObjectRef[None]:
        return self.handle.release.remote(attempt_id)

    def queue_stats(self) -> ObjectRef[tuple[int, int]]:
        return self.handle.queue_stats.remote()

    def grants(self) -> ObjectRef[dict[str, int]]:
        return self.handle.grants.remote()

    def decisions(self) -> ObjectRef[list[dict[str, Any]]]:
        return self.handle.decisions.remote()

    def health_events(self) -> ObjectRef[list[dict[str, Any]]]:
        return self.handle.health_events.remote()

    def worker_states(self) -> ObjectRef[list[WorkerState]]:
        return self.handle.worker_states.remote()

    def failures_detected(self) -> ObjectRef[dict[str, int]]:
        return self.handle.failures_detected.remote()

    def liveness_address(self) -> ObjectRef[str | None]:
        return self.handle.liveness_address.remote()
