"""The coordinator: drives one client request across the cluster, attempt by attempt.

It lives with the client-facing side (the Serve ingress; the driver in tests). Per request::

    router.choose ──> prefill.prefill(attempt) ── KVSource ──> decode.decode(attempt, source)
                           │ first token (TTFT)                  │ tokens 2.. (streamed)
                           └──────────────> client <─────────────┘

The client's stream is owned here, never by a worker: the tokens it has received, the sampler
state after them and the stop-string holdback (the TextStream) all survive any worker. When an
attempt fails (actor death, transport error, no room) the request is retried before its first
token, or migrated after it: the next attempt recomputes prompt + received tokens on a healthy
pair and continues from the sampler snapshot, so the client sees no duplicate and no gap (P5).
A worker that hangs is caught the same way: every wait on a worker also ends when the router
marks it FAILED for missed heartbeats (one long poll per event loop, ``_HealthWatch``).
Every request ends with exactly one :class:`ClientRecord` (P8).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError

from cluster.messages import Attempt, KVPullFailed, KVSource, RequestSpec, TokenBatch, WorkerInfo
from cluster.retry import Exclusions, RetriesExhausted, RetryBudget, RetryPolicy
from engine.detokenizer import TextStream
from engine.engine import RequestRejected
from engine.kv_cache_manager import prefix_hashes
from engine.request import RecordLog
from engine.sampler import SamplingSnapshot, TokenLogprobs
from engine.tokenizer import Tokenizer
from router.policy import NoReplicaAvailable, RouteRequest

logger = logging.getLogger(__name__)
ROUTER_RESTART_WAIT_S = 30.0
# Token batches a worker's stream may run ahead of this side before it blocks (Ray generator
# backpressure); the engine behind it then fills its own bounded buffer and pauses the request.
STREAM_AHEAD_BATCHES = 4
_STREAMING = frozenset({"generate", "decode"})


class AttemptFailed(RuntimeError):
    """One attempt could not go on; ``worker`` (if known) is the one to blame."""

    def __init__(
        self,
        message: str,
        worker: str | None = None,
        dead: bool = False,
        rejected: bool = False,
        no_replica: bool = False,
    ) -> None:
        super().__init__(message)
        self.worker = worker
        self.dead = dead  # the worker itself is gone (tell the router)
        self.rejected = rejected  # its engine's admission refused the request (no KV room)
        self.no_replica = no_replica  # the router had no replica left outside the exclusions


@dataclass
class ClientDelta:
    """What the client receives: new token ids and the text now safe to show."""

    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per token id, when the request asked


@dataclass(frozen=True)
class ClientRecord:
    """Exactly one per client request (P8)."""

    request_id: str
    status: str  # "finished" | "timed_out" | "failed" | "cancelled"
    finish_reason: str | None
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


@dataclass
class _ClientStream:
    spec: RequestSpec
    text: TextStream
    tokens: list[int] = field(default_factory=list)
    snapshot: SamplingSnapshot | None = None
    first_token_at: float | None = None
    queue_time_s: float | None = None  # of the attempt that produced the first token
    finish_reason: str | None = None


class _HealthWatch:
    """The router's view of worker health, kept current by one long poll per event loop;
    ``failed(worker)`` is an event that is set while the worker is FAILED."""

    def __init__(self, router: Any) -> None:
        self.router = router
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
                version, health = await self.router.watch_health.remote(version, 10.0)
            except RayActorError:  # the router restarts; its view comes back with it
                await asyncio.sleep(0.2)
                continue
            for name, healthy in health.items():
                event = self._events.setdefault(name, asyncio.Event())
                if not healthy:
                    event.set()
                elif event.is_set():
                    self._events[name] = asyncio.Event()  # healthy again: a fresh watch


class Coordinator:
    def __init__(
        self,
        router: Any,
        workers: dict[str, Any],
        infos: dict[str, WorkerInfo],
        tokenizer: Tokenizer,
        model_id: str,
        retry: RetryPolicy,
        transport: str = "grpc",
    ) -> None:
        self.router = router
        self.workers = workers
        self.infos = infos
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.budget = RetryBudget(retry)
        self.transport = transport
        self.records: RecordLog[ClientRecord] = RecordLog()  # the latest, bounded
        self._health = _HealthWatch(router)

    # -- the client API ------------------------------------------------------------------------

    async def generate(self, spec: RequestSpec) -> AsyncGenerator[ClientDelta, None]:
        """Stream a request's text; raises RetriesExhausted when it fails for good."""
        params = spec.params
        if params.n != 1:
            raise ValueError(f"n={params.n}: the cluster serves n=1 per request")
        stream = _ClientStream(
            spec, TextStream(self.tokenizer, params.stop, params.include_stop_str_in_output)
        )
        self.budget.admitted()
        attempts = migrations = 0
        exclusions = Exclusions()
        status, error = "failed", None
        refused = False  # some replica's admission refused it (and is excluded since)
        try:
            while True:
                attempts += 1
                migrations += bool(stream.tokens)
                attempt = Attempt(spec, attempts, list(stream.tokens), stream.snapshot)
                try:
                    async for delta in self._run_attempt(attempt, stream, exclusions):
                        yield delta
                    status = "timed_out" if stream.finish_reason == "timeout" else "finished"
                    return
                except AttemptFailed as exc:
                    logger.warning("%s failed: %s", attempt.attempt_id, exc)
                    # No room: refused here, or no replica left but those that refused it.
                    no_room = exc.rejected or (exc.no_replica and refused)
                    refused = refused or exc.rejected
                    if exc.worker is not None:
                        info = self.infos.get(exc.worker)
                        domain = info.domain if info and exc.dead else None
                        exclusions.failed(exc.worker, domain)
                        if exc.dead:
                            await self._report_dead(exc.worker)
                    why = self.budget.may_retry(attempts, spec.deadline)
                    if why is not None:
                        error = str(exc)
                        if why == "deadline passed":
                            status = "timed_out"
                        raise RetriesExhausted(
                            spec.request_id, why, attempts, str(exc), rejected=no_room
                        ) from exc
                    await asyncio.sleep(self.budget.policy.backoff_s)
        except (asyncio.CancelledError, GeneratorExit):
            status, error = "cancelled", None
            raise
        finally:
            self.records.append(
                ClientRecord(
                    request_id=spec.request_id,
                    status=status,
                    finish_reason=stream.finish_reason if status != "cancelled" else None,
                    num_prompt_tokens=len(spec.prompt_token_ids),
                    num_output_tokens=len(stream.tokens),
                    attempts=attempts,
                    migrations=migrations,
                    arrival=spec.arrival_time,
                    first_token=stream.first_token_at,
                    finished=time.time(),
                    queue_time_s=stream.queue_time_s,
                    error=error,
                )
            )

    # -- one attempt ---------------------------------------------------------------------------

    async def _run_attempt(
        self, attempt: Attempt, stream: _ClientStream, exclusions: Exclusions
    ) -> AsyncGenerator[ClientDelta, None]:
        spec = attempt.request
        tokens = spec.prompt_token_ids + attempt.resume_output
        route = RouteRequest(
            request_id=attempt.attempt_id,
            prompt_hashes=prefix_hashes(tokens, self._block_size(), spec.cache_salt, self.model_id),
            num_prompt_tokens=len(tokens),
            exclude_workers=frozenset(exclusions.workers),
            exclude_domains=frozenset(exclusions.domains),
        )
        decision = await self._choose(route, spec.deadline)
        generators: list[Any] = []
        try:
            if decision.prefill is None:  # colocated, or prefill on the decode worker
                gen = self._call(decision.decode, "generate", attempt)
                generators.append(gen)
                async for delta in self._deliver(gen, decision.decode, stream):
                    yield delta
                return
            prefill = self._call(decision.prefill, "prefill", attempt, self.transport)
            generators.append(prefill)
            source: KVSource = await self._next(prefill, decision.prefill)
            decode = self._call(decision.decode, "decode", attempt, source)
            generators.append(decode)
            first: TokenBatch = await self._next(prefill, decision.prefill)
            handed_off = first.finish_reason == "handed_off"
            if handed_off:
                first = TokenBatch(
                    first.token_ids,
                    sampler_snapshot=first.sampler_snapshot,
                    logprobs=first.logprobs,
                    queue_time_s=first.queue_time_s,
                )
            for delta in self._accept(first, decision.prefill, stream):
                yield delta
            if not handed_off or stream.finish_reason is not None:
                return
            handoff = self._call(decision.decode, "handoff", attempt.attempt_id, first)
            await self._await(handoff, decision.decode)
            async for delta in self._deliver(decode, decision.decode, stream):
                yield delta
        finally:
            for gen in generators:
                ray.cancel(gen)  # a worker still streaming this attempt stops and frees KV

    async def _choose(self, route: RouteRequest, deadline: float | None) -> Any:
        """The router's decision; while the router actor restarts (Ray brings it back, and the
        workers' resyncs rebuild its view) wait for it, up to the deadline."""
        give_up = min(deadline or math.inf, time.time() + ROUTER_RESTART_WAIT_S)
        while True:
            try:
                return await self.router.choose.remote(route)
            except NoReplicaAvailable as exc:
                why = getattr(exc, "cause", exc)  # the router's message, not Ray's traceback
                raise AttemptFailed(f"no replica: {why}", no_replica=True) from exc
            except RayActorError as exc:
                if time.time() >= give_up:
                    raise AttemptFailed(f"router unavailable: {exc}") from exc
                await asyncio.sleep(0.1)

    def _call(self, worker: str, method: str, *args: Any) -> Any:
        call = getattr(self.workers[worker], method)
        if method in _STREAMING:  # a slow client stops the worker's stream, then its engine
            call = call.options(_generator_backpressure_num_objects=STREAM_AHEAD_BATCHES)
        return call.remote(*args)

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
        except RayActorError as exc:
            raise AttemptFailed(f"{worker} died: {type(exc).__name__}", worker, dead=True) from exc
        except Exception as exc:  # the worker raised (transfer error, no room, injected fault)
            cause = getattr(exc, "cause", exc)  # a RayTaskError wraps the worker's exception
            if isinstance(cause, KVPullFailed):  # the KV's source is to blame, not the puller
                raise AttemptFailed(str(cause), cause.worker, dead=cause.dead) from exc
            rejected = isinstance(cause, RequestRejected)
            raise AttemptFailed(f"{worker}: {cause}", worker, rejected=rejected) from exc

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
        raise AttemptFailed(f"{worker} is FAILED (router: missed heartbeats)", worker, True)

    async def _deliver(
        self, gen: Any, worker: str, stream: _ClientStream
    ) -> AsyncGenerator[ClientDelta, None]:
        while stream.finish_reason is None:
            batch = await self._next(gen, worker)
            for delta in self._accept(batch, worker, stream):
                yield delta
            if batch.finished and stream.finish_reason is None:
                raise AttemptFailed(f"{worker} ended without a finish reason", worker)

    def _accept(self, batch: TokenBatch, worker: str, stream: _ClientStream) -> list[ClientDelta]:
        """Take a worker's batch into the client's stream: tokens, snapshot, stop strings."""
        if batch.error is not None:
            raise AttemptFailed(f"{worker}: {batch.error}", worker)
        deltas: list[ClientDelta] = []
        want_logprobs = stream.spec.params.logprobs is not None
        for i, token in enumerate(batch.token_ids):
            if stream.first_token_at is None:
                stream.first_token_at = time.time()
                stream.queue_time_s = batch.queue_time_s
            stream.tokens.append(token)
            step = stream.text.step(token)
            logprobs = [batch.logprobs[i]] if want_logprobs and batch.logprobs else None
            if step.text or not deltas:
                deltas.append(ClientDelta([token], step.text, logprobs=logprobs))
            else:
                deltas[-1].token_ids.append(token)
                if logprobs is not None and deltas[-1].logprobs is not None:
                    deltas[-1].logprobs.extend(logprobs)
            if step.stop_matched is not None:
                stream.finish_reason = "stop"
                break
        if batch.sampler_snapshot is not None:
            stream.snapshot = batch.sampler_snapshot
        elif batch.token_ids:
            # Greedy requests carry no per-token snapshots (only the prefill's, after token 1):
            # one from before these tokens would misalign a migration, which then rebuilds the
            # sampler from the tokens alone (all a greedy request needs).
            stream.snapshot = None
        if stream.finish_reason is None and batch.finished:
            if batch.finish_reason in (None, "handed_off", "error", "abort", "timeout"):
                if batch.finish_reason == "timeout":
                    stream.finish_reason = "timeout"
                elif batch.finish_reason != "handed_off":
                    raise AttemptFailed(
                        f"{worker} ended the attempt: {batch.finish_reason}", worker
                    )
            else:
                stream.finish_reason = batch.finish_reason
        if stream.finish_reason is not None:
            tail = stream.text.finish()
            deltas.append(ClientDelta([], tail, finished=True, finish_reason=stream.finish_reason))
        return deltas

    async def _report_dead(self, worker: str) -> None:
        try:
            await self.router.worker_failed.remote(worker)
        except Exception:
            logger.warning("could not tell the router that %s failed", worker, exc_info=True)

    def _block_size(self) -> int:
        return next(iter(self.infos.values())).block_size
