"""What the ingress does with one HTTP request (docs/design.md#lifecycle): gate, parse, tokenise,
check the context limit, run each choice through the cluster's coordinator, answer or stream.

::

    body ──> IngressGate.admit (413 / 401 / 429: nothing tokenised yet, phase 1)
         ──> Content-Type (415) ──> protocol.parse_* (400 naming the field) ──> model (404)
         ──> choices over max_choices (400) ──> tokenise ──> context limit (400)
         ──> one Coordinator.generate per choice (phase 2: the router's admission queue
             secures each attempt's prefill slot and decode slot + KV, or refuses it:
             429 / 503 + Retry-After, 504 when its deadline passes while it waits)
         ──> the first token ──> 200 and JSON, or SSE chunks through a bounded queue

The response's status goes out with the first token, not before: every failure before it
(refused, timed out while queued, no replica) is an HTTP status a client's retry logic reads,
never an error event inside a 200. A client that hangs up while its request waits takes it
out of the queue. After the first token a stream can still end early by a fault migration
could not recover or its deadline: an error event, counted in
``tandem_stream_errors_total{cause}`` and logged.

Backpressure: when the SSE generator is not pulled, the choices' tasks block on the bounded
queue and stop pulling the coordinator; the attempt's inbox fills and asks its worker to pause
it (``pace``), and the engine pauses the request (BACKPRESSURED) once its own bounded buffer
fills. The generator stops being pulled when the client stops reading only where the replica
answers HTTP itself (direct ingress, as ``tandem serve`` runs it: the ASGI ``send`` waits on the
socket). Behind Serve's proxy the replica's ``send`` never blocks (a deque drained into a Ray
stream with no backpressure), so there a slow reader's chunks wait in the proxy -- at most
``max_tokens`` of them.

A client that disconnects cancels the SSE generator (before the first token: the wait for it),
which cancels its choices, which leave the router's queue or cancel their attempts on the
workers: the KV is freed within a scheduler tick.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeVar

from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from ray.exceptions import ActorUnavailableError, RayActorError

from api import protocol
from api.gate import IngressGate, Rejected, Ticket
from api.metrics import Metrics, RequestTiming, log_record
from api.protocol import APIError
from cluster.client_stream import ClientDelta
from cluster.coordinator import ClientRecord, Coordinator
from cluster.retry import GiveUp, RetriesExhausted
from contracts.actors import RouterClient, WorkerClient
from contracts.messages import RequestSpec
from contracts.roles import Role
from contracts.routing import (
    UNAVAILABLE_RETRY_AFTER_S,
    AdmissionRefused,
    Refusal,
    WorkerState,
)
from engine.request import FinishReason, RequestStatus
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

logger = logging.getLogger("tandem.api")
# SSE chunks a request may have ready for a slow client before its choices stop pulling.
STREAM_BUFFER = 8
# A client may ask for a shorter timeout than the topology's deadline (seconds, a float).
TIMEOUT_HEADER = "X-Request-Timeout"
_T = TypeVar("_T")


@dataclass
class _Choice:
    """One choice's accumulated output (the non-streaming answer, the usage count)."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # with the first delta, if asked
    started: bool = False  # a delta came (a stream's first chunk carries the prompt's report)


@dataclass(frozen=True)
class _Job:
    """A parsed, admitted request: its choices' prompts and parameters."""

    meta: protocol.ResponseMeta
    chat: bool
    prompts: list[list[int]]  # one per choice (prompt i's choices are i*n .. i*n + n - 1)
    params: list[SamplingParams]  # one per choice
    prompt_tokens: int  # each prompt counted once, whatever n
    stream: bool
    include_usage: bool
    logprobs: bool
    tenant: str
    deadline: float | None
    arrival: float
    priority: int
    # Completions: what each choice reports of its prompt, and the text echo shows of it.
    report: protocol.PromptReport = protocol.PromptReport()
    prompt_texts: list[str] = field(default_factory=list)  # one per choice, with echo
    score_only: bool = False  # max_tokens 0 (echo): drop the one token the engine samples


class Service:
    """Everything one ingress replica needs; the Serve deployment delegates its routes here."""

    def __init__(
        self,
        coordinator: Coordinator,
        router: RouterClient,
        tokenizer: Tokenizer,
        model_name: str,
        max_model_len: int,
        vocab_size: int,
        gate: IngressGate,
        metrics: Metrics,
        request_timeout_s: float | None,
        decode_workers: dict[str, WorkerClient] | None = None,
    ) -> None:
        self.coordinator = coordinator
        self.router = router
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.gate = gate
        self.metrics = metrics
        self.request_timeout_s = request_timeout_s
        self.decode_workers = decode_workers or {}
        self._transfer_seen: dict[str, int] = {}  # worker -> last transfer record observed

    # -- routes --------------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._handle(request, "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, "chat")

    def models(self) -> Response:
        return JSONResponse(protocol.models_response([self.model_name]))

    async def health(self) -> Response:
        """200 ``ok`` at full capacity, 200 ``degraded`` with less (which workers are down,
        the share of serving slots left), 503 ``unavailable`` when nothing can serve a
        request now (the router restarting, or no decode/colocated worker up)."""
        try:
            states = await self._worker_states()
        except RouterUnavailable as exc:
            body = {"status": "unavailable", "reason": str(exc)}
            return JSONResponse(body, status_code=503, headers=_RETRY_SOON)
        body = health_body(states)
        status = 503 if body["status"] == "unavailable" else 200
        return JSONResponse(
            body, status_code=status, headers=_RETRY_SOON if status == 503 else None
        )

    async def check_alive(self) -> None:
        """Serve's replica health check: raises only when this replica is broken -- its
        router is gone for good (a new replica would start one). Dependencies restarting
        (the router, workers) make it degraded, not broken: Serve keeps the replica."""
        try:
            await asyncio.wait_for(self.router.key(), ROUTER_CALL_TIMEOUT_S)
        except (ActorUnavailableError, TimeoutError):  # ActorDiedError goes to Serve
            logger.info("health check: the router is restarting")

    async def cluster(self) -> Response:
        """The router's view, for operators (``GET /v1/cluster``, ``tandem status``)."""
        try:
            states = await self._worker_states()
            waiting, deepest = await _ask_router(self.router.queue_stats())
        except RouterUnavailable as exc:
            err = APIError(503, f"the router's view is unavailable: {exc}", code="unavailable")
            return JSONResponse(err.body(), status_code=503, headers=_RETRY_SOON)
        return JSONResponse(
            {
                "status": health_body(states)["status"],
                "workers": [worker_view(s) for s in states],
                "admission_queue": {"waiting": waiting, "most_waiting": deepest},
                "retry_budget_tokens": self.coordinator.budget.tokens,
            }
        )

    async def _worker_states(self) -> list[WorkerState]:
        return await _ask_router(self.router.worker_states())

    async def metrics_response(self) -> Response:
        """The ingress's own metrics always; the workers' gauges as the router last saw them
        (left as they were while the router does not answer)."""
        await self._collect_transfers()
        self.metrics.retry_budget.set(self.coordinator.budget.tokens)
        failures, tally = self.metrics.failures, self.coordinator.tally
        failures.retries = {r.value: n for r, n in tally.retries.items()}
        failures.migrations = {r.value: n for r, n in tally.migrations.items()}
        failures.transport = dict(tally.transport)
        with contextlib.suppress(RouterUnavailable):
            failures.detected = await _ask_router(self.router.failures_detected())
            states = await self._worker_states()
            failures.leases_expired = sum(s.leases_expired for s in states)
            for s in states:
                if s.healthy:
                    self.metrics.set_worker(
                        s.name, s.kv_usage, s.queue_depth, s.num_running, s.prefix_hit_ratio
                    )
                else:
                    self.metrics.worker_down(s.name)
            waiting, _ = await _ask_router(self.router.queue_stats())
            self.metrics.admission_queue.set(waiting)
        text, content_type = self.metrics.render()
        return Response(text, media_type=content_type)

    async def _collect_transfers(self) -> None:
        """Observe the KV pulls the decode workers finished since the last scrape."""
        for name, worker in self.decode_workers.items():
            try:
                records = await worker.transfer_records(self._transfer_seen.get(name, 0))
            except Exception:  # a worker restarting: its records come with the next scrape
                continue
            for r in records:
                self.metrics.observe_transfer(r.finished - r.started, r.num_bytes)
            if records:
                self._transfer_seen[name] = records[-1].seq

    # -- one request ---------------------------------------------------------------------------

    async def _handle(self, request: Request, kind: str) -> Response:
        arrival = time.time()
        body = await request.body()
        try:
            ticket = self.gate.admit(request.headers, len(body))
        except Rejected as exc:
            self._rejected(arrival, "unknown", str(exc.code))
            err = APIError(exc.status, exc.message, code=str(exc.code))
            return JSONResponse(err.body(), status_code=exc.status, headers=exc.headers())
        try:
            job = self._parse(body, kind, ticket.tenant, arrival, request.headers)
        except APIError as exc:
            ticket.release()
            cause = "context_length" if exc.code == "context_length_exceeded" else "invalid_request"
            self._rejected(arrival, ticket.tenant, cause)
            return JSONResponse(exc.body(), status_code=exc.status)
        deltas = self._run(job)
        try:
            first = await _unless_client_leaves(request, anext(deltas, None))
        except APIError as exc:  # before the first token: a real status
            ticket.release()
            return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())
        except _ClientLeft:  # nobody to answer; the choices are cancelled (and counted)
            ticket.release()
            await deltas.aclose()
            return Response(status_code=499)
        if job.stream:
            return StreamingResponse(
                self._stream(job, ticket, first, deltas),
                media_type="text/event-stream",
                headers=_SSE_HEADERS,
            )
        try:
            return await _unless_client_leaves(request, self._complete(job, first, deltas))
        except _ClientLeft:
            await deltas.aclose()
            return Response(status_code=499)
        finally:
            ticket.release()

    def _rejected(self, arrival: float, tenant: str, cause: str) -> None:
        self.metrics.observe_rejection(cause)
        timing = RequestTiming(
            request_id="-",
            tenant=tenant,
            status=RequestStatus.REJECTED,
            finish_reason=None,
            arrival=arrival,
            emit_times=[],
            finished=time.time(),
            num_prompt_tokens=0,
            queue_time_s=None,
        )
        self.metrics.observe_request(timing)

    def _timeout(self, header: str | None, field: float | None) -> float | None:
        """The request's timeout in seconds (None: no deadline): the topology's default
        (``retry.deadline_s``; none unless set), which the ``X-Request-Timeout`` header or
        the body's ``timeout`` may shorten, never lengthen (the shorter of the two wins), nor
        set past ``protocol.MAX_TIMEOUT_S``."""
        limit = self.request_timeout_s
        asked: dict[str, float] = {} if field is None else {"timeout": field}
        if header is not None:
            try:
                value = float(header)
            except ValueError:
                value = math.nan
            if not 0 < value < math.inf:
                raise APIError(
                    400,
                    f"{TIMEOUT_HEADER}: {header!r} is not a positive number of seconds",
                    param=TIMEOUT_HEADER,
                    code="invalid_timeout",
                )
            asked[TIMEOUT_HEADER] = value
        cap = min(math.inf if limit is None else limit, protocol.MAX_TIMEOUT_S)
        for param, value in asked.items():
            if value > cap:
                raise APIError(
                    400,
                    f"{param}: {value:g} s is longer than this server's limit of {cap:g} s",
                    param=param,
                    code="invalid_timeout",
                )
        return min(asked.values(), default=limit)

    def _parse(
        self, body: bytes, kind: str, tenant: str, arrival: float, headers: Mapping[str, str]
    ) -> _Job:
        protocol.check_content_type(headers.get("content-type"))
        max_choices = self.gate.config.max_choices
        report, texts = protocol.PromptReport(), []
        if kind == "chat":
            req: Any = protocol.parse_chat(body)
            protocol.check_model(req.model, [self.model_name])
            protocol.check_choices(1, req.n, max_choices)
            prompts = [protocol.chat_prompt(req, self.tokenizer)]
        else:
            req = protocol.parse_completion(body)
            protocol.check_model(req.model, [self.model_name])
            protocol.check_choices(len(req.prompt), req.n, max_choices)
            prompts = protocol.completion_prompts(req, self.tokenizer)
            report = req.prompt_report
            if report.echo:
                texts = protocol.echo_texts(req, prompts, self.tokenizer)
        timeout_s = self._timeout(headers.get(TIMEOUT_HEADER), req.timeout)
        longest = max(len(p) for p in prompts)
        default_max = max(self.max_model_len - longest, 1)
        base = protocol.sampling_params(
            req, vocab_size=self.vocab_size, default_max_tokens=default_max
        )
        if base.seed is None:  # drawn once here: every choice and every retry shares it
            base = replace(base, seed=secrets.randbits(63))
        for p in prompts:
            if len(p) + base.max_tokens > self.max_model_len:
                raise APIError(
                    400,
                    f"this model's maximum context length is {self.max_model_len} tokens; the "
                    f"request asks for {len(p)} prompt + {base.max_tokens} output tokens",
                    param="max_tokens" if len(p) < self.max_model_len else "prompt",
                    code="context_length_exceeded",
                )
        choice_prompts, choice_params = [], []
        for p in prompts:
            for i in range(req.n):
                choice_prompts.append(p)
                choice_params.append(protocol.choice_params(base, i))
        choice_texts = [t for t in texts for _ in range(req.n)]
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        return _Job(
            meta=protocol.ResponseMeta(
                f"{prefix}-{uuid.uuid4().hex}", req.model, int(arrival), seed=base.seed
            ),
            chat=kind == "chat",
            prompts=choice_prompts,
            params=choice_params,
            prompt_tokens=sum(len(p) for p in prompts),
            stream=bool(req.stream),
            include_usage=req.include_usage,
            logprobs=base.logprobs is not None,
            tenant=tenant,
            deadline=None if timeout_s is None else arrival + timeout_s,
            arrival=arrival,
            priority=req.priority,
            report=report,
            prompt_texts=choice_texts,
            score_only=report.echo and req.max_tokens == 0,
        )

    async def _complete(
        self,
        job: _Job,
        first: tuple[int, ClientDelta] | None,
        deltas: AsyncIterator[tuple[int, ClientDelta]],
    ) -> Response:
        choices = [_Choice(i) for i in range(len(job.prompts))]
        try:
            if first is not None:
                _absorb(choices[first[0]], first[1])
                async for index, delta in deltas:
                    _absorb(choices[index], delta)
        except APIError as exc:
            return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())
        done = [
            protocol.Choice(
                c.index,
                c.text,
                c.token_ids,
                c.finish_reason or FinishReason.MAX_TOKENS,
                c.logprobs if job.logprobs else None,
                None if job.chat else _prompt(job, c.index, c.prompt_logprobs),
            )
            for c in choices
        ]
        if job.chat:
            body = protocol.chat_response(
                job.meta, done, prompt_tokens=job.prompt_tokens, tokenizer=self.tokenizer
            )
        else:
            body = protocol.completion_response(
                job.meta,
                done,
                prompt_tokens=job.prompt_tokens,
                tokenizer=self.tokenizer,
                report=job.report,
            )
        return JSONResponse(body)

    async def _stream(
        self,
        job: _Job,
        ticket: Ticket,
        first: tuple[int, ClientDelta] | None,
        deltas: AsyncIterator[tuple[int, ClientDelta]],
    ) -> AsyncIterator[bytes]:
        choices = [_Choice(i) for i in range(len(job.prompts))]
        try:
            if job.chat:
                for index in range(len(choices)):
                    yield protocol.sse(protocol.chat_chunk(job.meta, index, role=True))
            rest = deltas if first is None else _chain(first, deltas)
            async for index, delta in rest:
                choice = choices[index]
                for chunk in self._chunks(job, choice, delta):
                    yield protocol.sse(chunk)
                _absorb(choice, delta)
            if job.include_usage:
                completion_tokens = sum(len(c.token_ids) for c in choices)
                kind: Literal["text_completion", "chat.completion.chunk"] = (
                    "chat.completion.chunk" if job.chat else "text_completion"
                )
                yield protocol.sse(
                    protocol.usage_chunk(
                        job.meta,
                        kind,
                        prompt_tokens=job.prompt_tokens,
                        completion_tokens=completion_tokens,
                    )
                )
        except APIError as exc:  # headers are sent: the error travels as an SSE event
            self.metrics.observe_stream_error(exc.code or "internal")
            sent = sum(len(c.token_ids) for c in choices)
            logger.warning("%s: stream ended after %d token(s): %s", job.meta.id, sent, exc)
            yield protocol.sse(exc.body())
        finally:
            ticket.release()
        yield protocol.SSE_DONE

    def _chunks(self, job: _Job, choice: _Choice, delta: ClientDelta) -> list[dict[str, Any]]:
        """The SSE objects for one delta of one choice (before it is absorbed)."""
        finish = delta.finish_reason if delta.finished else None
        if job.chat:
            logprobs = None
            if job.logprobs and delta.logprobs:
                logprobs = protocol.chat_logprobs(self.tokenizer, delta.token_ids, delta.logprobs)
            out = []
            if delta.text or logprobs is not None:
                out.append(
                    protocol.chat_chunk(
                        job.meta, choice.index, content=delta.text, logprobs=logprobs
                    )
                )
            if finish is not None:
                out.append(protocol.chat_chunk(job.meta, choice.index, finish_reason=finish))
            return out
        lps = delta.logprobs if job.logprobs else None
        if not choice.started:  # the first chunk: what the choice reports of its prompt leads
            prompt = _prompt(job, choice.index, delta.prompt_logprobs)
            fields = protocol.completion_fields(
                self.tokenizer, job.report, prompt, delta.text, delta.token_ids, lps
            )
        else:
            echoed = len(job.prompt_texts[choice.index]) if job.report.echo else 0
            fields = {"text": delta.text, "logprobs": None}
            if lps:
                fields["logprobs"] = protocol.completion_logprobs(
                    self.tokenizer, delta.token_ids, lps, text_offset=echoed + len(choice.text)
                )
        if not fields["text"] and fields["logprobs"] is None and finish is None:
            return []
        return [protocol.completion_chunk(job.meta, choice.index, finish_reason=finish, **fields)]

    async def _run(self, job: _Job) -> AsyncGenerator[tuple[int, ClientDelta], None]:
        """Run every choice concurrently; yield (choice index, delta) as they come. Raises
        APIError when a choice fails for good; cancelling this generator cancels them all."""
        ready: asyncio.Queue[tuple[int, ClientDelta | BaseException | None]] = asyncio.Queue(
            STREAM_BUFFER
        )

        async def run_choice(index: int) -> None:
            spec = RequestSpec(
                request_id=f"{job.meta.id}-{index}",
                prompt_token_ids=job.prompts[index],
                params=job.params[index],
                cache_salt=job.tenant,
                deadline=job.deadline,
                arrival_time=job.arrival,
                priority=job.priority,
            )
            timing = _Timing(self.metrics, job, index)
            outcome: Exception | None = None  # None: the choice finished
            run = self.coordinator.generate(spec)
            try:
                # Closed on the way out, so a cancelled choice's CANCELLED record is in by
                # the time it is observed (its generator may sit at a yield, not at an await).
                async with contextlib.aclosing(run):
                    async for delta in run:
                        timing.emitted(delta)
                        await ready.put((index, _no_tokens(delta) if job.score_only else delta))
            except Exception as exc:
                outcome = exc
            finally:  # one record per choice, a cancelled one (the client went away) too
                timing.done(run.record)
            await ready.put((index, outcome))

        tasks = [asyncio.ensure_future(run_choice(i)) for i in range(len(job.prompts))]
        try:
            running = len(tasks)
            while running:
                index, item = await ready.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    error = _api_error(item)
                    if error.code in REFUSALS:
                        self.metrics.observe_rejection(error.code)
                    raise error from item
                elif item.finish_reason is FinishReason.DEADLINE:  # it passed mid-request
                    raise APIError(
                        504,
                        f"request timed out after {_timeout_s(job):.1f} s",
                        type="timeout_error",
                        code="timeout",
                    )
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


class _Timing:
    """Emit times of one choice, turned into its RequestTiming and record once it ends."""

    def __init__(self, metrics: Metrics, job: _Job, index: int) -> None:
        self.metrics = metrics
        self.job = job
        self.index = index
        self.emit_times: list[float] = []

    def emitted(self, delta: ClientDelta) -> None:
        now = time.time()
        self.emit_times.extend(now for _ in delta.token_ids)

    def done(self, record: ClientRecord | None) -> None:
        if record is None:  # the choice never started (cancelled before its first step)
            return
        timing = RequestTiming(
            request_id=record.request_id,
            tenant=self.job.tenant,
            status=record.status,
            finish_reason=record.finish_reason,
            arrival=self.job.arrival,
            emit_times=self.emit_times,
            finished=record.finished,
            num_prompt_tokens=record.num_prompt_tokens,
            queue_time_s=record.queue_time_s,
        )
        self.metrics.observe_request(timing)
        log_record(timing)


def _absorb(choice: _Choice, delta: ClientDelta) -> None:
    choice.started = True
    choice.token_ids.extend(delta.token_ids)
    choice.text += delta.text
    if delta.logprobs:
        choice.logprobs.extend(delta.logprobs)
    if delta.prompt_logprobs is not None:
        choice.prompt_logprobs = delta.prompt_logprobs
    if delta.finished:
        choice.finish_reason = delta.finish_reason


def _prompt(job: _Job, index: int, logprobs: list[TokenLogprobs | None] | None) -> protocol.Prompt:
    """Choice ``index``'s prompt, for what it reports of it (``job.report``)."""
    text = job.prompt_texts[index] if job.report.echo else ""
    return protocol.Prompt(text, job.prompts[index], logprobs)


def _no_tokens(delta: ClientDelta) -> ClientDelta:
    """``max_tokens: 0`` with echo: the prompt is scored and the token the engine sampled
    after it (it always samples one) dropped; the choice ends ``length``, as vLLM's."""
    return replace(
        delta,
        token_ids=[],
        text="",
        logprobs=None if delta.logprobs is None else [],
        finish_reason=FinishReason.MAX_TOKENS if delta.finished else None,
    )


def _timeout_s(job: _Job) -> float:
    assert job.deadline is not None, "only a request with a deadline times out"
    return job.deadline - job.arrival


# The HTTP status of each refusal by the cluster's admission (all before the first token).
_REFUSAL_STATUS = {
    Refusal.QUEUE_FULL: 429,
    Refusal.WAIT_EXCEEDS_DEADLINE: 503,
    Refusal.DEADLINE_PASSED: 504,
    Refusal.UNAVAILABLE: 503,
}
REFUSALS = frozenset({"kv_capacity", *(r.value for r in Refusal)})


class RouterUnavailable(RuntimeError):
    """The router actor did not answer (it restarts, or is gone)."""


ROUTER_CALL_TIMEOUT_S = 2.0  # an operator's view waits no longer for a restarting router


async def _ask_router(call: Awaitable[_T]) -> _T:
    """The router's answer within ROUTER_CALL_TIMEOUT_S, else RouterUnavailable."""
    try:
        return await asyncio.wait_for(call, ROUTER_CALL_TIMEOUT_S)
    except (RayActorError, TimeoutError) as exc:
        raise RouterUnavailable(f"the router is not answering ({type(exc).__name__})") from exc


_RETRY_SOON = {"Retry-After": str(int(UNAVAILABLE_RETRY_AFTER_S))}
_SERVING_ROLES = (Role.DECODE, Role.COLOCATED)  # where requests are decoded


def health_body(states: list[WorkerState]) -> dict[str, Any]:
    """``/health``'s body from the router's view: ``ok`` (every worker up), ``degraded``
    (some down: which, and the share of decode slots left) or ``unavailable`` (no worker that
    decodes is up)."""
    down = sorted(s.name for s in states if not s.healthy)
    serving = [s for s in states if s.role in _SERVING_ROLES]
    slots = sum(s.max_num_seqs for s in serving)
    up_slots = sum(s.max_num_seqs for s in serving if s.healthy)
    capacity = up_slots / slots if slots else 0.0
    status = "ok" if not down else "degraded" if up_slots else "unavailable"
    body: dict[str, Any] = {"status": status, "workers": len(states), "down": down}
    body["capacity"] = round(capacity, 4)
    return body


def worker_view(s: WorkerState) -> dict[str, Any]:
    """One worker in ``/v1/cluster``."""
    state = "up" if s.healthy else "failed" if s.failed else "starting"
    return {
        "name": s.name,
        "role": s.role.value,
        "domain": s.domain,
        "state": state,
        "queue_depth": s.queue_depth,
        "running": s.num_running,
        "max_num_seqs": s.max_num_seqs,
        "kv_usage": s.kv_usage,
        "kv_blocks": s.num_kv_blocks,
        "cached_blocks": s.cached_blocks,
        "prefix_hit_ratio": s.prefix_hit_ratio,
    }


class _ClientLeft(Exception):
    """The HTTP client disconnected before its response started."""


async def _unless_client_leaves(request: Request, awaitable: Awaitable[_T]) -> _T:
    """``awaitable``'s result, unless the client disconnects first (then _ClientLeft, and
    ``awaitable`` is cancelled: a queued request leaves the router's queue)."""
    work = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(BaseException):
                await work
    if work.cancelled():
        raise _ClientLeft()
    return work.result()


async def _disconnect(request: Request) -> None:
    """Returns when the ASGI server says the client went away (the body is read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _chain(first: _T, rest: AsyncIterator[_T]) -> AsyncIterator[_T]:
    yield first
    async for item in rest:
        yield item


def _api_error(exc: BaseException) -> APIError:
    if isinstance(exc, AdmissionRefused):
        return APIError(
            _REFUSAL_STATUS[exc.reason],
            f"request refused before it started: {exc.detail}",
            code=exc.reason.value,
            retry_after_s=exc.retry_after_s,
        )
    if isinstance(exc, RetriesExhausted):
        if exc.why is GiveUp.DEADLINE:
            return APIError(504, f"request timed out: {exc}", code="timeout")
        if exc.rejected:  # phase 2: no replica had KV room for it
            return APIError(503, f"no capacity for the request: {exc}", code="kv_capacity")
        return APIError(
            503, f"request failed: {exc}", code="failed", retry_after_s=UNAVAILABLE_RETRY_AFTER_S
        )
    if isinstance(exc, ValueError):
        return APIError(400, str(exc), code="invalid_request")
    logger.exception("request failed", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}", type="internal_error")


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
