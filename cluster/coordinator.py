"""The coordinator: drives one client request across the cluster, attempt by attempt.

It lives with the client-facing side (the Serve ingress; the driver in tests). Per request::

    router.admit ──> prefill.prefill(attempt) ── KVSource ──> decode.start_decode(attempt, source)
      (waits for       │ first token (TTFT)                  │ tokens 2.. (the decode worker's
       room on both)   │                                     │ token stream: cluster/token_stream)
                       └──────────────> client <─────────────┘          ... router.release

Each attempt is admitted by the router before it starts (router/admission.py): it waits there
until both of its workers have a slot and its KV for it, or is refused (AdmissionRefused,
raised to the caller before any token: the queue is full, or its deadline would pass first).
So no attempt is turned away for capacity once it runs, and a client's stream, once started,
ends only by its own stop conditions, its client, its deadline or a fault migration could not
recover.

The client's stream is owned here, never by a worker (:class:`ClientStream`): the tokens and
text it has received and the sampler state after them survive any worker. When an attempt
fails (actor death, transport error, no room) the request is retried before its first token,
or migrated after it: the next attempt recomputes prompt + received tokens on a healthy pair
and continues from the sampler snapshot, so the client sees no duplicate and no gap
(docs/design.md#retries-and-migration). A worker that hangs is caught the same way: every wait
on a worker also ends when the router marks it FAILED for missed heartbeats (one long poll per
event loop, ``_HealthWatch``). Every request ends with exactly one :class:`ClientRecord`, which
its :class:`RequestRun` hands back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import ray
from ray.exceptions import RayActorError

from cluster.client_stream import AttemptFailed, ClientStream, FailureReason
from cluster.prompt_share import PromptShare
from cluster.retry import Exclusions, GiveUp, RetriesExhausted, RetryBudget, RetryPolicy
from cluster.token_stream import Hub, Inbox
from contracts.actors import RouterClient, WorkerClient
from contracts.messages import KVPullFailed, KVSource, WorkerInfo
from contracts.routing import (
    HOLD_RENEW_S,
    UNAVAILABLE_RETRY_AFTER_S,
    AdmissionRefused,
    Decision,
    NoReplicaAvailable,
    Refusal,
    RouteRequest,
)
from engine.admission import RequestRejected
from engine.kv_cache_manager import prefix_hashes
from engine.outputs import TokenDelta
from engine.request import EngineRequest, FinishReason, RecordLog, RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class FailureTally:
    """Attempts that ended early, counted as the ingress's Prometheus counters read them:
    retried before the first token or migrated after it, by reason; and KV transfers that
    failed, by how."""

    retries: Counter[FailureReason] = field(default_factory=Counter)
    migrations: Counter[FailureReason] = field(default_factory=Counter)
    transport: Counter[str] = field(default_factory=Counter)

    def failed(self, exc: AttemptFailed, started: bool, again: bool) -> None:
        if exc.transport is not None:
            self.transport[exc.transport] += 1
        if again:
            (self.migrations if started else self.retries)[exc.reason] += 1


@dataclass(frozen=True)
class ClientRecord:
    """Exactly one per client request."""

    request_id: str  # the client request's
    choice: int  # which of its choices
    status: RequestStatus  # FINISHED, TIMED_OUT, FAILED, REJECTED (no KV room) or CANCELLED
    finish_reason: FinishReason | None  # the engine's, when it ended for its client
    num_prompt_tokens: int
    num_output_tokens: int  # tokens delivered to the client
    attempts: int
    migrations: int  # attempts that resumed after tokens were delivered
    arrival: float
    first_token: float | None
    finished: float
    error: str | None = None
    # Engine queue time (queued -> first scheduled) of the attempt that made the first token.
    queue_time_s: float | None = None


class RequestRun:
    """One request as the coordinator drives it: iterate it for the client's deltas (raises
    RetriesExhausted when it fails for good); ``record`` is its ClientRecord once it ended,
    whichever way (close it, e.g. with ``contextlib.aclosing``, to end it early)."""

    def __init__(self) -> None:
        self._deltas: AsyncGenerator[TokenDelta, None] | None = None
        self.record: ClientRecord | None = None

    def start(self, deltas: AsyncGenerator[TokenDelta, None]) -> None:
        self._deltas = deltas

    def __aiter__(self) -> AsyncIterator[TokenDelta]:
        return self

    async def __anext__(self) -> TokenDelta:
        assert self._deltas is not None
        return await self._deltas.__anext__()

    async def aclose(self) -> None:
        if self._deltas is not None:
            await self._deltas.aclose()


class _HealthWatch:
    """The router's view of worker health, kept current by one long poll per event loop;
    ``failed(worker)`` is an event that is set while the worker is FAILED, and ``on_failed``
    is called with its name when it goes FAILED."""

    def __init__(self, router: RouterClient, on_failed: Callable[[str], None]) -> None:
        self.router = router
        self.on_failed = on_failed
        self._events: dict[str, asyncio.Event] = {}
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def failed(self, worker: str) -> asyncio.Event:
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._task is None or self._task.done():
            if self._loop is not loop:
                self._events = {}  # events belong to the loop that waits on them
            self._loop = loop
            self._task = loop.create_task(self._watch())
        return self._events.setdefault(worker, asyncio.Event())

    async def _watch(self) -> None:
        version = -1
        while True:
            try:
                version, health = await self.router.watch_health(version, 10.0)
            except RayActorError:  # the router restarts; its view comes back with it
                await asyncio.sleep(0.2)
                continue
            for name, healthy in health.items():
                event = self._events.setdefault(name, asyncio.Event())
                if not healthy:
                    if not event.is_set():
                        self.on_failed(name)
                    event.set()
                elif event.is_set():
                    self._events[name] = asyncio.Event()  # healthy again: a fresh watch


class _Hold:
    """Renews a coordinator's hold on its grants (``RouterActor.hold``) every HOLD_RENEW_S,
    from one task per event loop: a coordinator that dies stops, and the router releases its
    grants after ``router.admission.holder_timeout_s``."""

    def __init__(self, router: RouterClient, holder: str) -> None:
        self.router, self.holder = router, holder
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def ensure(self) -> None:
        """Renewing from the running loop (a loop that ended took its task with it)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._task is None or self._task.done():
            self._loop = loop
            self._task = loop.create_task(self._renew())

    async def _renew(self) -> None:
        while True:
            with contextlib.suppress(Exception):  # a restarting router: its ledger is new
                await asyncio.wait_for(self.router.hold(self.holder), HOLD_RENEW_S * 2)
            await asyncio.sleep(HOLD_RENEW_S)


class Coordinator:
    def __init__(
        self,
        router: RouterClient,
        workers: dict[str, WorkerClient],
        infos: dict[str, WorkerInfo],
        model_id: str,
        retry: RetryPolicy,
        unavailable_wait_s: float,
        reserve_decode: bool = True,
        share_prompts: bool = True,
    ) -> None:
        self.router = router
        # The choices of an n > 1 request prefill their prompt once (cluster/prompt_share.py;
        # the topology's router.share_prompts).
        self.share_prompts = share_prompts
        # Reserve the decode worker's slot and blocks before the prefill starts (the topology's
        # router.reserve_decode_first).
        self.reserve_decode = reserve_decode
        # How long an attempt waits for a router that is not there (it restarts) before its
        # request is refused: the topology's router.admission.unavailable_wait_s.
        self.unavailable_wait_s = unavailable_wait_s
        self.workers = workers
        self.infos = infos
        self.model_id = model_id
        self.budget = RetryBudget(retry)
        self.records: RecordLog[ClientRecord] = RecordLog()  # the latest, bounded
        self.tally = FailureTally()
        self._health = _HealthWatch(router, self._worker_failed)
        self._releases: set[asyncio.Task[None]] = set()  # grants being given back
        # The workers' token streams to this coordinator (made on the loop that reads them).
        self.consumer = f"coordinator-{uuid.uuid4().hex[:12]}"
        self._hold = _Hold(router, self.consumer)  # the grants' holder: this coordinator
        self._hubs: dict[str, Hub] = {}
        self._hubs_loop: asyncio.AbstractEventLoop | None = None

    # -- the client API ------------------------------------------------------------------------

    def generate(self, request: EngineRequest, share: PromptShare | None = None) -> RequestRun:
        """Drive ``request`` (one choice of a client request) through the cluster; iterate the
        result for the client's deltas. ``share``: the choices with its prompt, which prefill
        it once (cluster/prompt_share.py)."""
        if request.params.n != 1:
            raise ValueError(f"n={request.params.n}: the cluster serves n=1 per request")
        run = RequestRun()
        run.start(self._drive(request, run, share if self.share_prompts else None))
        return run

    async def _drive(
        self, spec: EngineRequest, run: RequestRun, share: PromptShare | None
    ) -> AsyncGenerator[TokenDelta, None]:
        stream = ClientStream(spec)
        self.budget.admitted()
        attempts = migrations = 0
        exclusions = Exclusions()
        status, error = RequestStatus.FAILED, None
        refused = False  # some replica's admission refused it (and is excluded since)
        lead = share if share is not None and share.leads(spec.choice) else None
        shared_on: str | None = None  # the first attempt's decode worker, holding the prompt
        try:
            if share is not None and lead is None and self._shareable(spec):
                shared_on = await share.where()
            while True:
                attempts += 1
                migrations += bool(stream.tokens)
                attempt = replace(
                    spec,
                    attempt=attempts,
                    resume_output=tuple(stream.tokens),
                    sampler_snapshot=stream.snapshot,
                    # A sampled stream carries its sampler state, so a migration resumes it.
                    snapshots=spec.params.temperature > 0,
                )
                try:
                    shared, shared_on = shared_on, None  # a retry is routed as any request
                    attempt_run = self._run_attempt(attempt, stream, exclusions, shared, lead)
                    async with contextlib.aclosing(attempt_run):
                        async for delta in attempt_run:
                            yield delta
                    timed_out = stream.finish_reason is FinishReason.DEADLINE
                    status = RequestStatus.TIMED_OUT if timed_out else RequestStatus.FINISHED
                    return
                except AdmissionRefused as exc:  # before any work: the client gets a status
                    error = str(exc)
                    timed_out = exc.reason is Refusal.DEADLINE_PASSED
                    status = RequestStatus.TIMED_OUT if timed_out else RequestStatus.REJECTED
                    raise
                except AttemptFailed as exc:
                    logger.warning("%s failed: %s", attempt.key, exc)
                    # No room: refused here, or no replica left but those that refused it.
                    no_room = exc.rejected or (exc.no_replica and refused)
                    refused = refused or exc.rejected
                    if exc.worker is not None and exc.dead:
                        info = self.infos.get(exc.worker)
                        exclusions.died(info.domain if info else None)
                        await self._report_dead(exc.worker)
                    elif exc.worker is not None:
                        exclusions.failed(exc.worker)
                    why = self.budget.may_retry(attempts, spec.deadline, bool(stream.tokens))
                    self.tally.failed(exc, started=bool(stream.tokens), again=why is None)
                    if why is not None:
                        error = str(exc)
                        if why is GiveUp.DEADLINE:
                            status = RequestStatus.TIMED_OUT
                        elif no_room:
                            status = RequestStatus.REJECTED
                        raise RetriesExhausted(
                            spec.key, why, attempts, str(exc), rejected=no_room
                        ) from exc
                    await asyncio.sleep(self.budget.policy.backoff_s)
        except (asyncio.CancelledError, GeneratorExit):
            status, error = RequestStatus.CANCELLED, None
            raise
        finally:
            if lead is not None:
                lead.found(None)  # it ended: the choices still waiting prefill on their own
            run.record = self._record(spec, stream, status, error, attempts, migrations)

    def _record(
        self,
        spec: EngineRequest,
        stream: ClientStream,
        status: RequestStatus,
        error: str | None,
        attempts: int,
        migrations: int,
    ) -> ClientRecord:
        """The request's one ClientRecord, kept in ``records``."""
        record = ClientRecord(
            request_id=spec.request_id,
            choice=spec.choice,
            status=status,
            finish_reason=stream.finish_reason if status is not RequestStatus.CANCELLED else None,
            num_prompt_tokens=len(spec.prompt_token_ids),
            num_output_tokens=len(stream.tokens),
            attempts=attempts,
            migrations=migrations,
            arrival=spec.arrival_time or 0.0,
            first_token=stream.first_token_at,
            finished=time.time(),
            queue_time_s=stream.queue_time_s,
            error=error,
        )
        self.records.append(record)
        return record

    # -- one attempt ---------------------------------------------------------------------------

    async def _run_attempt(
        self,
        attempt: EngineRequest,
        stream: ClientStream,
        exclusions: Exclusions,
        share_decode: str | None = None,
        lead: PromptShare | None = None,
    ) -> AsyncGenerator[TokenDelta, None]:
        """``share_decode``: the decode worker holding the prompt (a later choice's first
        attempt); ``lead``: this choice's decode worker is where the others find its prompt,
        once it streams (its KV is in then)."""
        spec = attempt
        tokens = spec.prompt_token_ids + spec.resume_output
        # A request scoring its prompt computes all of it (no prefix hit): no cache credit.
        scored = spec.params.prompt_logprobs is not None
        route = RouteRequest(
            request_id=attempt.key,
            prompt_hashes=[] if scored else self._hashes(tokens, spec.cache_salt),
            num_prompt_tokens=len(tokens),
            exclude_workers=frozenset(exclusions.workers),
            exclude_domains=frozenset(exclusions.domains),
            max_tokens=spec.params.max_tokens,
            num_resumed_tokens=len(attempt.resume_output),
            priority=spec.priority,
            tenant=spec.cache_salt,
            deadline=spec.deadline,
            client_request_id=spec.request_id,
            numerics=exclusions.numerics,
            holder=self.consumer,
            share_decode=share_decode,
        )
        decision = await self._admit(route, spec.deadline)
        aid = attempt.key
        decode = self.workers[decision.decode]
        hub = self._hub(decision.decode)
        inbox = hub.open(aid)
        prefill: Any = None
        over = False  # the attempt ended on its worker (nothing to stop there)
        try:
            if decision.prefill is None:  # colocated, or prefill on the decode worker
                await self._await(decode.start_generate(attempt, self.consumer), decision.decode)
                async for delta in self._deliver(inbox, decision.decode, stream):
                    if lead is not None:
                        lead.found(decision.decode)
                    yield delta
                over = True
                return
            if self.reserve_decode:  # room for the KV before any prefill work (P9)
                await self._await(decode.reserve(attempt), decision.decode)
            prefill = self.workers[decision.prefill].prefill(attempt)
            source: KVSource = await self._next(prefill, decision.prefill)
            started = decode.start_decode(attempt, source, self.consumer)
            await self._await(started, decision.decode)
            first: TokenDelta = await self._next(prefill, decision.prefill)
            if (head := stream.accept(first, decision.prefill)) is not None:
                yield head
            if stream.finished:
                return
            # The decode worker continues from the token; the prompt's logprobs stay here.
            handoff = replace(first, prompt_logprobs=None)
            await self._await(decode.handoff(aid, handoff), decision.decode)
            # Until the decode worker's first batch, its KV is still coming from the prefill
            # worker: that one's FAILED ends the attempt too (a partitioned sender never ends
            # the pull by itself).
            async for delta in self._deliver(inbox, decision.decode, stream, decision.prefill):
                if lead is not None:
                    lead.found(decision.decode)
                yield delta
            over = True
        finally:
            if stream.tokens and not exclusions.numerics:  # the stream's bits: keep them
                info = self.infos.get(decision.decode)
                exclusions.numerics = info.numerics if info else ""
            if prefill is not None:
                ray.cancel(prefill)  # a prefill still holding its lease lets it go
            hub.close(aid, stop=not over)  # a decode still running stops and frees its KV
            self._release(aid)

    async def _admit(self, route: RouteRequest, deadline: float | None) -> Decision:
        """The router's decision, once the attempt's workers have room for it (it waits in the
        router's admission queue meanwhile; leaving, e.g. cancelled, takes it out). While the
        router actor restarts (Ray brings it back, and the workers' resyncs rebuild its view)
        wait for it -- up to the deadline (then DEADLINE_PASSED) or ``unavailable_wait_s``
        (then UNAVAILABLE: 503 with Retry-After)."""
        self._hold.ensure()
        start = time.time()
        give_up = min(deadline or math.inf, start + self.unavailable_wait_s)
        backoff = 0.05
        while True:
            ref = self.router.admit(route)
            try:
                return await ref
            except asyncio.CancelledError:
                ray.cancel(ref)  # out of the queue (or its grant given back)
                raise
            except AdmissionRefused as exc:
                raise getattr(exc, "cause", exc) from None  # the router's, not Ray's wrapper
            except NoReplicaAvailable as exc:
                why = getattr(exc, "cause", exc)  # the router's message, not Ray's traceback
                raise AttemptFailed(f"no replica: {why}", no_replica=True) from exc
            except RayActorError:
                now = time.time()
                if now >= give_up:
                    passed = deadline is not None and now >= deadline
                    reason = Refusal.DEADLINE_PASSED if passed else Refusal.UNAVAILABLE
                    raise AdmissionRefused(
                        route.request_id,
                        reason,
                        f"the router was unavailable for {now - start:.1f} s",
                        retry_after_s=None if passed else UNAVAILABLE_RETRY_AFTER_S,
                    ) from None
                await asyncio.sleep(min(backoff, give_up - now))
                backoff = min(backoff * 2, 0.25)  # back within a beat of the router

    def _release(self, attempt_id: str) -> None:
        """Give the attempt's grant back to the router (without waiting for it)."""
        task = asyncio.ensure_future(self._await_release(attempt_id))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _await_release(self, attempt_id: str) -> None:
        try:
            await self.router.release(attempt_id)
        except Exception:  # a restarting router has no grant to release: its ledger is new
            logger.debug("release of %s: router unavailable", attempt_id, exc_info=True)

    async def _next(self, gen: Any, worker: str) -> Any:
        try:
            ref = await self._unless_failed(gen.__anext__(), worker)
        except StopAsyncIteration as exc:
            raise AttemptFailed(f"{worker} ended its stream early", worker) from exc
        except RayActorError as exc:
            raise AttemptFailed(f"{worker} died: {type(exc).__name__}", worker, dead=True) from exc
        return await self._await(ref, worker)

    async def _await(self, ref: Any, worker: str) -> Any:
        """The result of a call to ``worker``, its failures as AttemptFailed (blaming the
        right worker)."""
        try:
            return await self._unless_failed(ref, worker)
        except AttemptFailed:  # marked FAILED while we waited: dead, not to be excluded by name
            raise
        except RayActorError as exc:
            raise AttemptFailed(f"{worker} died: {type(exc).__name__}", worker, dead=True) from exc
        except Exception as exc:  # the worker raised (transfer error, no room, injected fault)
            raise _failure(exc, worker) from exc

    async def _unless_failed(self, awaitable: Any, worker: str) -> Any:
        """Await a worker's answer, unless the router marks the worker FAILED first (a hung
        worker is found by its missed heartbeats; its request moves on instead of waiting)."""
        failed = self._health.failed(worker)
        answer = asyncio.ensure_future(awaitable)
        try:
            if not failed.is_set():
                failure = asyncio.ensure_future(failed.wait())
                try:
                    await asyncio.wait({answer, failure}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    failure.cancel()
            if answer.done():
                return answer.result()
        finally:
            if not answer.done():
                answer.cancel()
        raise _marked_failed(worker)

    async def _deliver(
        self, inbox: Inbox, worker: str, stream: ClientStream, sender: str | None = None
    ) -> AsyncGenerator[TokenDelta, None]:
        """``worker``'s batches for the attempt as client deltas. ``sender``: the prefill worker
        the first batch waits on (its KV transfer), FAILED -> AttemptFailed blaming it."""
        while not stream.finished:
            try:
                if sender is not None:
                    batch = await self._unless_failed(inbox.get(), sender)
                    sender = None
                else:
                    batch = await inbox.get()
            except AttemptFailed:
                raise
            except RayActorError as exc:
                raise AttemptFailed(f"{worker} died: {type(exc).__name__}", worker, True) from exc
            except Exception as exc:  # the attempt failed there (transfer, injected fault), or
                raise _failure(exc, worker) from exc  # its stream broke
            delta = stream.accept(batch, worker)
            if delta is not None:
                yield delta
            if batch.finished and not stream.finished:
                raise AttemptFailed(f"{worker} ended without a finish reason", worker)

    def _hub(self, worker: str) -> Hub:
        """``worker``'s token stream to this coordinator, on the running loop."""
        loop = asyncio.get_running_loop()
        if self._hubs_loop is not loop:  # streams belong to the loop that reads them
            self._hubs, self._hubs_loop = {}, loop
        if worker not in self._hubs:
            self._hubs[worker] = Hub(worker, self.workers[worker], self.consumer)
        return self._hubs[worker]

    def _worker_failed(self, worker: str) -> None:
        """The router marked ``worker`` FAILED: what it streams to us will not come."""
        hub = self._hubs.get(worker)
        if hub is not None:
            hub.fail(_marked_failed(worker))

    async def _report_dead(self, worker: str) -> None:
        try:
            await self.router.worker_failed(worker)
        except Exception:
            logger.warning("could not tell the router that %s failed", worker, exc_info=True)

    def _hashes(self, tokens: tuple[int, ...], cache_salt: str) -> list[int]:
        return prefix_hashes(tokens, self._block_size(), cache_salt, self.model_id)

    def _block_size(self) -> int:
        return next(iter(self.infos.values())).block_size

    def _shareable(self, spec: EngineRequest) -> bool:
        """Whether a later choice gains from its lead's prompt: a full block to share, and no
        prompt scoring (which computes the whole prompt)."""
        return (
            spec.params.prompt_logprobs is None and len(spec.prompt_token_ids) > self._block_size()
        )


def _marked_failed(worker: str) -> AttemptFailed:
    """The router marked ``worker`` FAILED (missed heartbeats): its attempts end here."""
    why = f"{worker} is FAILED (router: missed heartbeats)"
    return AttemptFailed(why, worker, dead=True, reason=FailureReason.WORKER_FAILED)


def _failure(exc: Exception, worker: str) -> AttemptFailed:
    """What ``worker`` raised for an attempt, as the AttemptFailed that blames the right worker."""
    cause = getattr(exc, "cause", exc)  # a RayTaskError wraps the worker's exception
    if isinstance(cause, KVPullFailed):  # the KV's source is to blame, not the puller
        return AttemptFailed(
            str(cause),
            cause.worker,
            dead=cause.dead,
            reason=FailureReason.KV_TRANSFER,
            transport=cause.kind,
        )
    rejected = isinstance(cause, RequestRejected)
    return AttemptFailed(f"{worker}: {cause}", worker, rejected=rejected)
