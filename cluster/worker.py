"""What every worker actor shares: one engine, its reports to the router, fault hooks.

A worker is a Ray actor (async: its methods are coroutines on one event loop) serving
``contracts.actors.WorkerAPI`` around an :class:`~engine.async_engine.AsyncLLMEngine`, whose own
thread steps the model; it uses only the engine's named surface (requests, KV layers, load and
KV events, imports, leases). The prefill and
decode actors (``prefill_worker/``, ``decode_worker/``) add their half of the hand-off; any worker
can also serve a request whole (:meth:`EngineWorker.start_generate`: the colocated path, and the
decode worker's local prefill of short prompts).

Reports: after every change a worker pushes its load and the prefix-cache events since the last
report to the router actor (``RouterActor.report``), at most every ``report_interval_s``; the
router treats a worker silent for longer than its heartbeat timeout as FAILED.

Tokens go back over one stream per coordinator (``subscribe``; both of its ends are
``cluster.token_stream``). A coordinator starts attempts here with ``start_generate`` /
``start_decode``; each runs as a task that puts its batches in the coordinator's
:class:`~cluster.token_stream.Outbox`, where an attempt's batches merge until the stream takes
them (one message per wake-up carries every attempt's news). ``stop`` cancels an attempt (its KV is
freed within a tick); ``pace`` pauses one whose client reads slowly (the engine then fills its
bounded buffer and pauses the request, BACKPRESSURED). A coordinator whose stream ends (it
closed it, or its process died) has its attempts here cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
import torch
from ray.exceptions import ActorDiedError

from cluster.sabotage import spoil
from cluster.token_stream import Outbox
from contracts import liveness
from contracts.actors import RouterClient, WorkerAPI
from contracts.faults import Fault, FaultAction, FaultPlan, FaultPoint
from contracts.messages import Delivery, WorkerInfo, WorkerLoad
from contracts.roles import NAMESPACE, Role
from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.kv_cache_manager import KVStats
from engine.kv_events import KVEvent
from engine.outputs import BackpressureStats, TokenDelta
from engine.request import EngineRequest, TerminalRecord

logger = logging.getLogger(__name__)
# An engine step longer than this is a hung engine, not a long prefill: the worker stops its
# heartbeats (see EngineWorker._report_loop).
ENGINE_SILENCE_S = 60.0
LIVENESS_RETRY_S = 0.5  # after the liveness connection ends, connect again this soon


class _Served:
    """One attempt running here for a coordinator."""

    def __init__(self, consumer: str) -> None:
        self.consumer = consumer
        self.task: asyncio.Task[None] | None = None
        self.resumed = asyncio.Event()
        self.resumed.set()


def _reconstructed() -> bool:
    """Whether Ray restarted this actor (its previous process died): a router that knows no
    incarnation of it -- restarted itself meanwhile -- learns that death from this."""
    context = ray.get_runtime_context()
    return context.get_actor_id() is not None and context.was_current_actor_reconstructed


class EngineWorker:
    """Base class of the worker actors, and the colocated worker (Ray wraps the classes)."""

    role: Role = Role.COLOCATED

    def __init__(
        self,
        name: str,
        domain: str,
        model_dir: str,
        model_id: str,
        engine_config: EngineConfig,
        router: str | None = None,  # the router actor's name; None in tests that drive workers
        report_interval_s: float = 0.05,
        namespace: str = NAMESPACE,
    ) -> None:
        self.name = name
        self.domain = domain
        self.incarnation = uuid.uuid4().hex[:12]
        # The engine thread computes with the threads Ray gives this actor (OMP_NUM_THREADS)
        # unless the topology says, in the process's only OpenMP team (EngineConfig).
        threads = engine_config.num_threads or torch.get_num_threads()
        self.engine = AsyncLLMEngine.from_checkpoint(
            Path(model_dir),
            engine_config.model_copy(update={"num_threads": threads}),
            model_id=model_id,
            kv_events=True,
        )
        # By name, not handle: a handle among the constructor's arguments would live in the
        # object store, and Ray cannot restart an actor whose arguments were lost.
        self._router_name = router
        self._namespace = namespace
        self.router: RouterClient | None = None
        self._find_router()
        if self.router is not None:  # a restart: the router drops what it credited us at once
            self.router.worker_started(self.name, self.incarnation, _reconstructed())
        self.report_interval_s = report_interval_s
        self.faults = FaultPlan()
        self._changed: asyncio.Event | None = None  # created on the actor's loop
        self._reporter: asyncio.Task[None] | None = None
        self._liveness: asyncio.Task[None] | None = None
        self._engine_read_since: float | None = None  # a read of the engine pending since
        self._lookup: asyncio.Task[None] | None = None  # of the router, in the background
        # Resyncs asked for (start, readmission, a lost or ignored report) and delivered.
        self._resyncs_asked = 0
        self._resyncs_done = 0
        self._outboxes: dict[str, Outbox] = {}  # consumer -> what it has not received
        self._served: dict[str, _Served] = {}  # attempt id -> its task here
        self._spoiled_records: dict[str, FaultAction] = {}  # sabotage: attempt -> lose/double

    # -- lifecycle -----------------------------------------------------------------------------

    def _find_router(self) -> None:
        """The router actor, by name (None in tests without one, or while none is there)."""
        self.router = None
        if self._router_name is not None:
            try:
                handle = ray.get_actor(self._router_name, namespace=self._namespace)
            except ValueError:  # not (yet) started again under its name
                return
            self.router = RouterClient(handle)

    async def _look_router_up(self) -> None:
        """``_find_router`` off the event loop: Ray's lookup is a GCS call that waits while the
        router restarts, and this loop streams tokens and reports meanwhile (a blocking lookup
        here kept live workers from a restarted router for seconds)."""
        if self._router_name is None:
            return
        try:
            lookup = ray.get_actor
            handle = await asyncio.to_thread(lookup, self._router_name, namespace=self._namespace)
        except ValueError:  # not (yet) started again under its name
            self.router = None
            return
        self.router = RouterClient(handle)

    def _look_router_up_soon(self) -> None:
        """Start one lookup in the background; the current handle (if any) stays in use: a
        restarted actor answers on it."""
        if self._lookup is None or self._lookup.done():
            self._lookup = asyncio.get_running_loop().create_task(self._look_router_up())

    @staticmethod
    def _own_handle() -> Any:
        """This actor's handle, for the router to probe it by (None outside an actor: tests
        that drive a worker object directly)."""
        context = ray.get_runtime_context()
        return context.current_actor if context.get_actor_id() is not None else None

    def kv_address(self) -> str | None:
        return None

    @staticmethod
    def host_address() -> str:
        """The address this worker's KV sockets bind to: its Ray node's (127.0.0.1 in the local
        loopback mode, the host's own on a test bed or a real cluster), never all
        interfaces."""
        return str(ray.util.get_node_ip_address())

    async def ready(self) -> WorkerInfo:
        """Called after start, after a Ray restart, and by the router's health check when it
        readmits this worker (having dropped its index of us): starts the reporter and asks
        it for a resync."""
        self._resyncs_asked += 1
        if self._reporter is None:
            self._changed = asyncio.Event()
            loop = asyncio.get_running_loop()
            self._reporter = loop.create_task(self._report_loop())
            self._liveness = loop.create_task(self._hold_liveness())
        self._touch()  # report now: a readmitting router has no view of us
        return self.info()

    async def probe(self) -> tuple[str, bool]:
        """The router's direct check when it suspects this worker (its reports late, or the
        router just restarted): this process's incarnation, and whether its engine answers --
        the rule that stops its heartbeats (``ENGINE_SILENCE_S``)."""
        since = self._engine_read_since
        silent = since is not None and time.monotonic() - since > ENGINE_SILENCE_S
        return self.incarnation, not silent

    def info(self) -> WorkerInfo:
        return WorkerInfo(
            name=self.name,
            role=self.role,
            domain=self.domain,
            kv_address=self.kv_address(),
            block_size=self.engine.kv.block_size,
            incarnation=self.incarnation,
            max_model_len=self.engine.max_model_len,
            vocab_size=self.engine.vocab_size,
            max_num_seqs=self.engine.config.max_num_seqs,
            num_kv_blocks=self.engine.kv.num_kv_blocks,
            admission_output_tokens=self.engine.config.admission_output_tokens,
            numerics=self.engine.numerics,
            cpu_capability=torch.backends.cpu.get_cpu_capability(),
        )

    async def set_faults(self, plan: FaultPlan) -> None:
        """Arm the fault-injection harness (tests, chaos runs)."""
        self.faults = plan

    async def add_faults(self, faults: list[Fault]) -> None:
        """Arm ``faults`` beside those armed already (``tandem chaos run --sabotage``)."""
        self.faults.faults.extend(faults)

    async def faults_pending(self) -> int:
        """Faults armed here that have not fired yet (a chaos run waits for them)."""
        return sum(not f.fired for f in self.faults.faults)

    async def faults_fired(self) -> list[Fault]:
        """The faults armed here that fired, with the attempt each fired on where known."""
        return [f for f in self.faults.faults if f.fired]

    # -- reports -------------------------------------------------------------------------------

    def _touch(self) -> None:
        if self._changed is not None:
            self._changed.set()

    async def _read_state(self, resync: bool) -> tuple[WorkerLoad, list[KVEvent]]:
        """The load and the KV events since the last read, in one engine call (it runs between
        two steps). ``resync``: a router that missed reports (its restart, ours) rebuilds this
        worker's index exactly from it (docs/design.md#router-view)."""
        engine = await self.engine.kv.load(resync)
        stats, spec = self.engine.kv_stats(), self.engine.speculation()
        load = WorkerLoad(
            name=self.name,
            incarnation=self.incarnation,
            queue_depth=engine.num_waiting,
            num_running=engine.num_running,
            kv_usage=stats.in_use_blocks / stats.total_blocks,
            prefix_hit_ratio=stats.prefix_hit_ratio,
            claimed_blocks=engine.claimed_blocks,
            leases_expired=self.leases_expired(),
            imports_parked=self.engine.imports_parked,
            reservations_waited=self.engine.reservations_waited,
            speculation=(spec.num_steps, spec.num_drafted, spec.num_accepted),
            admitted=tuple(engine.admitted),
        )
        return load, engine.kv_events

    def leases_expired(self) -> int:
        """KV leases this process let expire (a prefill worker's; none elsewhere)."""
        return 0

    async def _hold_liveness(self) -> None:
        """Hold a connection to the router for the life of this process: the kernel closes it
        when the process exits, which tells the router at once (contracts/liveness.py).
        Connects again whenever it ends (a restarted router)."""
        while True:
            try:
                if self.router is None:
                    await self._look_router_up()
                address = await self.router.liveness_address() if self.router else None
                if address is not None:
                    await liveness.hold(address, self.name, self.incarnation)
            except Exception:  # the router restarting or gone: look again
                logger.debug("%s: liveness connection", self.name, exc_info=True)
            await asyncio.sleep(LIVENESS_RETRY_S)

    async def _report_loop(self) -> None:
        """Push load and KV events to the router, as a heartbeat too. The first report, the first
        after a readmission, and the first after a failed or ignored one resynchronise the
        router's view of this worker.

        The heartbeat does not wait for the engine: a step can take seconds (a long prefill on
        CPU), and a busy worker is not a dead one. While a read is pending the reports carry
        the last load and no events; the read's events go with a later report, none lost. An
        engine silent for ``ENGINE_SILENCE_S``, or dead, stops the reports, so the router's
        heartbeat timeout finds it."""
        assert self._changed is not None
        loop = asyncio.get_running_loop()
        load: WorkerLoad | None = None
        reading: asyncio.Task[tuple[WorkerLoad, list[KVEvent]]] | None = None
        reading_resync, reading_since = 0, 0.0  # the resync a pending read answers (0: none)
        while True:
            if reading is None:
                wanted = self._resyncs_asked > self._resyncs_done
                reading_resync = self._resyncs_asked if wanted else 0
                reading_since = loop.time()
                self._engine_read_since = time.monotonic()
                reading = loop.create_task(self._read_state(resync=wanted))
            await asyncio.wait({reading}, timeout=self.report_interval_s * 2)
            events: list[KVEvent] = []
            answered = 0
            if reading.done():
                self._engine_read_since = None
                try:
                    load, events = reading.result()
                    answered = reading_resync
                except Exception:
                    logger.warning("%s: engine read failed", self.name, exc_info=True)
                    load = None
                    self._resyncs_asked += 1
                reading = None
            elif loop.time() - reading_since > ENGINE_SILENCE_S:
                load = None  # a hung engine: fall silent
            if self.router is None:
                self._look_router_up_soon()
            try:
                if self.router is not None and load is not None:
                    resync = answered > 0
                    me = self._own_handle() if resync else None
                    if await self.router.report(self.info(), load, events, resync, me):
                        self._resyncs_done = max(self._resyncs_done, answered)
                    else:  # ignored while FAILED: the router's view of us starts over
                        self._resyncs_asked += 1
            except ActorDiedError:  # a crash (Ray may restart it) or gone for good (a new one
                # may take its name): the old handle is tried again meanwhile
                logger.warning("%s: the router died; looking it up again", self.name)
                self._resyncs_asked += 1
                self._look_router_up_soon()
            except Exception:  # the router restarting: keep trying, then resynchronise
                if self._resyncs_asked == self._resyncs_done:  # once per outage, not per try
                    logger.warning("%s: report to the router failed", self.name, exc_info=True)
                self._resyncs_asked += 1
            self._changed.clear()
            if self._resyncs_asked > self._resyncs_done:
                self._changed.set()  # a router without our view: resync at once, not at the beat
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=self.report_interval_s * 10)
            except TimeoutError:
                pass  # a heartbeat even when nothing changed
            await asyncio.sleep(self.report_interval_s)

    # -- the token stream to each coordinator --------------------------------------------------

    async def subscribe(self, consumer: str) -> AsyncGenerator[list[Delivery], None]:
        """The token stream to coordinator ``consumer``: a message whenever some of its
        attempts here have news. Ends (closed, cancelled, its caller gone): every attempt of
        ``consumer`` here is stopped, as nobody reads it any more. A new stream for the same
        consumer (it lost the old one) takes over, with what the old one had not sent."""
        outbox = Outbox()
        old = self._outboxes.get(consumer)
        self._outboxes[consumer] = outbox
        for attempt_id, items in old.take() if old is not None else []:
            for item in items:
                outbox.put(attempt_id, item)
        try:
            while True:
                await outbox.ready.wait()
                # Let the other attempts woken by the same engine step add theirs: one
                # message per step, not one per attempt.
                for _ in range(2):
                    await asyncio.sleep(0)
                yield outbox.take()
        finally:
            if self._outboxes.get(consumer) is outbox:  # not taken over: its reader is gone
                del self._outboxes[consumer]
                for served in list(self._served.values()):
                    if served.consumer == consumer and served.task is not None:
                        served.task.cancel()

    async def start_generate(self, attempt: EngineRequest, consumer: str) -> None:
        """Serve ``attempt`` whole here (colocated, or a decode worker's local prefill); its
        tokens go to ``consumer``'s stream."""
        self._start(attempt, consumer, self._generate(attempt))

    async def stop(self, attempt_id: str) -> None:
        """Cancel the attempt (its consumer gave up on it); its KV is freed within a tick."""
        served = self._served.get(attempt_id)
        if served is not None and served.task is not None:
            served.task.cancel()

    async def pace(self, attempt_id: str, paused: bool) -> None:
        """Pause (or resume) taking an attempt's tokens from the engine: its consumer's client
        reads slowly. Paused long enough, the engine pauses the request (BACKPRESSURED)."""
        served = self._served.get(attempt_id)
        if served is not None:
            if paused:
                served.resumed.clear()
            else:
                served.resumed.set()

    def _outbox(self, consumer: str) -> Outbox:
        return self._outboxes.setdefault(consumer, Outbox())

    def _start(
        self, attempt: EngineRequest, consumer: str, batches: AsyncGenerator[TokenDelta, None]
    ) -> None:
        aid = attempt.key
        if aid in self._served:
            raise ValueError(f"attempt {aid} is already running here")
        self.faults.check(FaultPoint.ACCEPTED, attempt.attempt, 1)
        served = self._served[aid] = _Served(consumer)
        served.task = asyncio.get_running_loop().create_task(self._serve(aid, served, batches))

    async def _serve(
        self, attempt_id: str, served: _Served, batches: AsyncGenerator[TokenDelta, None]
    ) -> None:
        """Move one attempt's batches to its consumer's outbox until it ends; an exception
        that ends it goes there too (the consumer raises it for that attempt)."""
        try:
            async for batch in batches:
                self._outbox(served.consumer).put(attempt_id, batch)
                await served.resumed.wait()
        except asyncio.CancelledError:
            pass  # stopped: its consumer expects nothing more
        except Exception as exc:
            self._outbox(served.consumer).put(attempt_id, exc)
        finally:
            await batches.aclose()
            del self._served[attempt_id]

    # -- serving a whole request ---------------------------------------------------------------

    async def _generate(self, attempt: EngineRequest) -> AsyncGenerator[TokenDelta, None]:
        """Prefill and decode here (colocated, or a decode worker's local prefill)."""
        self._touch()
        async with contextlib.aclosing(self._relay(self.engine.generate(attempt), attempt)) as out:
            async for delta in out:
                yield delta

    async def _relay(
        self, stream: AsyncGenerator[TokenDelta, None], attempt: EngineRequest
    ) -> AsyncGenerator[TokenDelta, None]:
        """The engine's deltas, with the decode-side fault point (a sabotage fires only on a
        delta with tokens: the worker names the attempt there)."""
        emitted = 0
        try:
            async for delta in stream:
                emitted += len(delta.token_ids)
                key = attempt.key if delta.token_ids else None
                fault = self.faults.check(FaultPoint.DECODE_TOKENS, attempt.attempt, emitted, key)
                if fault is not None:
                    delta = await self._plant(fault, delta)
                yield delta
        finally:
            await stream.aclose()
            self._touch()

    async def _plant(self, fault: Fault, delta: TokenDelta) -> TokenDelta:
        """Do a sabotage (contracts.faults.SABOTAGE) to the attempt ``fault`` fired on."""
        if fault.action is FaultAction.HOLD:
            await asyncio.sleep(fault.seconds)
        elif fault.action is FaultAction.LEAK_BLOCK:
            blocks = await self.engine.call(lambda e: e.kv.pool.allocate(1))
            give_back = self.engine.call(lambda e: e.kv.pool.decref(blocks))
            asyncio.get_running_loop().call_later(
                fault.seconds, lambda: asyncio.ensure_future(give_back)
            )
        elif fault.action in (FaultAction.LOSE_RECORD, FaultAction.DOUBLE_RECORD):
            assert fault.hit is not None
            self._spoiled_records[fault.hit] = fault.action
        return spoil(delta, fault.action, self.engine.vocab_size)

    # -- inspection (tests, the chaos harness) ------------------------------------------------

    async def kv_stats(self, settled: bool = True) -> KVStats:
        """The KV pools once the engine is idle (``settled``), or as of its last tick (a
        benchmark's live reading: bench/choices_bench.py)."""
        if settled:
            await self.engine.wait_idle()
        return self.engine.kv_stats()

    async def records(self) -> list[TerminalRecord]:
        """The engine's latest terminal records (a planted LOSE_RECORD / DOUBLE_RECORD reports
        its attempt's not at all, or twice)."""
        copies = {FaultAction.LOSE_RECORD: 0, FaultAction.DOUBLE_RECORD: 2}
        out = []
        for record in self.engine.records():
            planted = self._spoiled_records.get(record.request_id)
            out += [record] * (1 if planted is None else copies[planted])
        return out

    async def check_idle(self) -> KVStats:
        """The leak check: wait until nothing runs, then every pool must be at baseline
        (raises KVInvariantError otherwise). Leases still held count as leaks here."""
        return await self.engine.check_idle()

    async def backpressure_stats(self) -> BackpressureStats:
        """How often a slow consumer paused a request here, and the deepest buffer it saw."""
        return self.engine.backpressure_stats()

    async def node_id(self) -> str:
        """The Ray node this worker runs on (its failure domain is that node's label)."""
        return str(ray.get_runtime_context().get_node_id())

    async def pid(self) -> int:
        return os.getpid()


if TYPE_CHECKING:  # mypy checks that the actor serves its interface
    _: type[WorkerAPI] = EngineWorker
