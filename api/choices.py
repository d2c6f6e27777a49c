"""A request's choices on the cluster: the one place the edge meets the cluster's request and
delta types. ``Choices.run`` sends each choice of a :class:`~api.translate.Job` to the
coordinator as an ``EngineRequest`` and yields the ``TokenDelta``s that come back, merged into
one stream; ``complete`` gathers each choice's into one (``TokenDelta.then``) for the response
object, ``stream`` turns them into SSE chunks.
A choice that fails for good is an ``APIError`` (``_api_error``: a refusal's status and
``Retry-After``, a deadline's 504, a bug's 500).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import replace
from typing import Any, Literal, TypeVar

from fastapi import Response
from fastapi.responses import JSONResponse

from api import responses
from api.edge import error_response, internal_error
from api.errors import APIError
from api.gate import Ticket
from api.metrics import Metrics, RequestTiming, log_record
from api.responses_api import ResponseEvents, error_event, event_sse
from api.tools import ToolCallParser
from api.translate import Job
from cluster.coordinator import ClientRecord, Coordinator, RequestRun
from cluster.prompt_share import prompt_shares
from cluster.retry import GiveUp, RetriesExhausted
from contracts.routing import UNAVAILABLE_RETRY_AFTER_S, AdmissionRefused, Refusal
from engine.outputs import TokenDelta, TokenLogprobs
from engine.request import EngineRequest, FinishReason
from engine.tokenizer import Tokenizer

logger = logging.getLogger("tandem.api")
# SSE chunks a request may have ready for a slow client before its choices stop pulling.
STREAM_BUFFER = 8
_T = TypeVar("_T")


# Each choice's deltas so far, merged into one (None: none came yet; a stream's first chunk
# carries what the choice reports of its prompt).
_Gathered = list[TokenDelta | None]


def _absorb(gathered: _Gathered, index: int, delta: TokenDelta) -> None:
    before = gathered[index]
    gathered[index] = delta if before is None else before.then(delta)


def _num_tokens(gathered: _Gathered) -> int:
    return sum(len(d.token_ids) for d in gathered if d is not None)


class Choices:
    """Runs a job's choices on the cluster and turns their deltas into its answer."""

    def __init__(self, coordinator: Coordinator, tokenizer: Tokenizer, metrics: Metrics) -> None:
        self.coordinator = coordinator
        self.tokenizer = tokenizer
        self.metrics = metrics

    async def complete(
        self,
        job: Job,
        first: tuple[int, TokenDelta] | None,
        deltas: AsyncIterator[tuple[int, TokenDelta]],
    ) -> Response:
        gathered: _Gathered = [None] * len(job.prompts)
        try:
            if first is not None:
                _absorb(gathered, *first)
                async for index, delta in deltas:
                    _absorb(gathered, index, delta)
        except APIError as exc:
            return error_response(exc)
        done = [
            replace(d, index=i, logprobs=(d.logprobs or []) if job.logprobs else None)
            for i, d in enumerate(g or TokenDelta(job.meta.id, []) for g in gathered)
        ]
        if job.responses is not None:  # one choice: the response is its events' last
            events = _response_events(job)
            events.feed(done[0].text)
            reason = done[0].finish_reason or FinishReason.MAX_TOKENS
            last = events.finish(reason, job.prompt_tokens, len(done[0].token_ids))
            return JSONResponse(last[-1]["response"])
        if job.chat:
            body = responses.chat_response(
                job.meta,
                done,
                prompt_tokens=job.prompt_tokens,
                tokenizer=self.tokenizer,
                report=job.report,
                tool_calls=job.tool_calls,
            )
        else:
            body = responses.completion_response(
                job.meta,
                done,
                prompt_tokens=job.prompt_tokens,
                tokenizer=self.tokenizer,
                report=job.report,
                prompts=[_prompt(job, i, d.prompt_logprobs) for i, d in enumerate(done)],
            )
        return JSONResponse(body)

    def stream(
        self,
        job: Job,
        ticket: Ticket,
        first: tuple[int, TokenDelta] | None,
        deltas: AsyncIterator[tuple[int, TokenDelta]],
    ) -> AsyncIterator[bytes]:
        """The job's answer as server-sent events; ``ticket`` released once it ends."""
        rest = deltas if first is None else _chain(first, deltas)
        if job.responses is not None:
            return self._event_stream(job, ticket, rest)
        return self._chunk_stream(job, ticket, rest)

    async def _event_stream(
        self, job: Job, ticket: Ticket, rest: AsyncIterator[tuple[int, TokenDelta]]
    ) -> AsyncIterator[bytes]:
        """A /v1/responses stream: its typed events (api/responses_api.py), an ``error`` event
        for a failure after the first token."""
        events = _response_events(job)
        sent = 0
        try:
            for event in events.start():
                yield event_sse(event)
            async for _, delta in rest:
                sent += len(delta.token_ids)
                out = events.feed(delta.text)
                if delta.finished:
                    reason = delta.finish_reason or FinishReason.MAX_TOKENS
                    out += events.finish(reason, job.prompt_tokens, sent)
                for event in out:
                    yield event_sse(event)
        except Exception as exc:  # headers are sent: the error travels as an event
            yield event_sse(error_event(self._stream_error(job, exc, sent), events.sequence))
        finally:
            ticket.release()

    async def _chunk_stream(
        self, job: Job, ticket: Ticket, rest: AsyncIterator[tuple[int, TokenDelta]]
    ) -> AsyncIterator[bytes]:
        """A chat or completions stream: SSE chunks, ``data: [DONE]`` last."""
        gathered: _Gathered = [None] * len(job.prompts)
        parsers = [ToolCallParser() for _ in gathered] if job.tool_calls else None
        try:
            if job.chat:
                for index in range(len(gathered)):
                    yield responses.sse(responses.chat_chunk(job.meta, index, role=True))
            async for index, delta in rest:
                if parsers is not None:
                    chunks = self.tool_chunks(job, index, parsers[index], delta)
                else:
                    chunks = self.chunks(job, index, gathered[index], delta)
                for chunk in chunks:
                    yield responses.sse(chunk)
                _absorb(gathered, index, delta)
            if job.include_usage:
                completion_tokens = _num_tokens(gathered)
                kind: Literal["text_completion", "chat.completion.chunk"] = (
                    "chat.completion.chunk" if job.chat else "text_completion"
                )
                yield responses.sse(
                    responses.usage_chunk(
                        job.meta,
                        kind,
                        prompt_tokens=job.prompt_tokens,
                        completion_tokens=completion_tokens,
                    )
                )
        except Exception as exc:  # headers are sent: the error travels as an SSE event
            yield responses.sse(self._stream_error(job, exc, _num_tokens(gathered)).body())
        finally:
            ticket.release()
        yield responses.SSE_DONE

    def _stream_error(self, job: Job, exc: Exception, sent: int) -> APIError:
        """What a stream that failed after ``sent`` tokens tells its client (a bug: a 500's
        error object), counted and logged."""
        error = exc if isinstance(exc, APIError) else internal_error(exc, job.meta.id)
        self.metrics.observe_stream_error(error.code or "internal")
        logger.warning("%s: stream ended after %d token(s): %s", job.meta.id, sent, error)
        return error

    def tool_chunks(
        self, job: Job, index: int, parser: ToolCallParser, delta: TokenDelta
    ) -> list[dict[str, Any]]:
        """The SSE objects for one delta of chat choice ``index`` whose text is read as
        content and tool calls (``parser``: the choice's); a delta's logprobs go out with it,
        in a chunk of their own where its text is held back."""
        content, calls = parser.feed(delta.text)
        if delta.finished:
            more, last = parser.finish()
            content, calls = content + more, [*calls, *last]
        logprobs = None
        if job.logprobs and delta.logprobs:
            logprobs = responses.chat_logprobs(
                self.tokenizer, delta.token_ids, delta.logprobs, as_ids=job.report.token_ids
            )
        out = []
        if content or calls or logprobs is not None:
            chunk = responses.chat_chunk(
                job.meta, index, content=content or None, logprobs=logprobs, tool_calls=calls
            )
            out.append(chunk)
        if delta.finished and delta.finish_reason is not None:
            out.append(
                responses.chat_chunk(
                    job.meta, index, finish_reason=delta.finish_reason, called=bool(parser.calls)
                )
            )
        return out

    def chunks(
        self, job: Job, index: int, before: TokenDelta | None, delta: TokenDelta
    ) -> list[dict[str, Any]]:
        """The SSE objects for one delta of choice ``index`` (``before``: its deltas so far)."""
        finish = delta.finish_reason if delta.finished else None
        if job.chat:
            logprobs = None
            if job.logprobs and delta.logprobs:
                logprobs = responses.chat_logprobs(
                    self.tokenizer, delta.token_ids, delta.logprobs, as_ids=job.report.token_ids
                )
            out = []
            if delta.text or logprobs is not None:
                out.append(
                    responses.chat_chunk(job.meta, index, content=delta.text, logprobs=logprobs)
                )
            if finish is not None:
                out.append(responses.chat_chunk(job.meta, index, finish_reason=finish))
            return out
        lps = delta.logprobs if job.logprobs else None
        if before is None:  # the first chunk: what the choice reports of its prompt leads
            prompt = _prompt(job, index, delta.prompt_logprobs)
            fields = responses.completion_fields(
                self.tokenizer, job.report, prompt, delta.text, delta.token_ids, lps
            )
        else:
            echoed = len(job.prompt_texts[index]) if job.report.echo else 0
            fields = {"text": delta.text, "logprobs": None}
            if lps:
                fields["logprobs"] = responses.completion_logprobs(
                    self.tokenizer,
                    delta.token_ids,
                    lps,
                    text_offset=echoed + len(before.text),
                    as_ids=job.report.token_ids,
                )
        if not fields["text"] and fields["logprobs"] is None and finish is None:
            return []
        return [responses.completion_chunk(job.meta, index, finish_reason=finish, **fields)]

    async def run(self, job: Job) -> AsyncGenerator[tuple[int, TokenDelta], None]:
        """Run every choice concurrently; yield (choice index, delta) as they come. Raises
        APIError when a choice fails for good; cancelling this generator cancels them all."""
        ready: asyncio.Queue[tuple[int, TokenDelta | BaseException | None]] = asyncio.Queue(
            STREAM_BUFFER
        )

        async def run_choice(index: int) -> None:
            spec = EngineRequest(
                request_id=job.meta.id,
                choice=index,
                prompt_token_ids=tuple(job.prompts[index]),
                params=job.params[index],
                cache_salt=job.tenant,
                deadline=job.deadline,
                arrival_time=job.arrival,
                priority=job.priority,
            )
            timing = _Timing(self.metrics, job, index)
            outcome: Exception | None = None  # None: the choice finished
            run: RequestRun | None = None
            try:  # a bug anywhere (even starting the run) ends the request, never hangs it
                run = self.coordinator.generate(spec, shares[index])
                # Closed on the way out, so a cancelled choice's CANCELLED record is in by
                # the time it is observed (its generator may sit at a yield, not at an await).
                async with contextlib.aclosing(run):
                    async for delta in run:
                        timing.emitted(delta)
                        await ready.put((index, _no_tokens(delta) if job.score_only else delta))
            except Exception as exc:
                outcome = exc
            finally:  # one record per choice, a cancelled one (the client went away) too
                timing.done(None if run is None else run.record)
            await ready.put((index, outcome))

        shares = prompt_shares([tuple(p) for p in job.prompts])
        tasks = [asyncio.ensure_future(run_choice(i)) for i in range(len(job.prompts))]
        try:
            running = len(tasks)
            while running:
                index, item = await ready.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    error = _api_error(item, job.meta.id)
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

    def __init__(self, metrics: Metrics, job: Job, index: int) -> None:
        self.metrics = metrics
        self.job = job
        self.index = index
        self.emit_times: list[float] = []

    def emitted(self, delta: TokenDelta) -> None:
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


def _response_events(job: Job) -> ResponseEvents:
    assert job.responses is not None
    return ResponseEvents(job.responses, job.meta.id, job.meta.created, job.tool_calls)


def _prompt(job: Job, index: int, logprobs: list[TokenLogprobs | None] | None) -> responses.Prompt:
    """Choice ``index``'s prompt, for what it reports of it (``job.report``)."""
    text = job.prompt_texts[index] if job.report.echo else ""
    return responses.Prompt(text, job.prompts[index], logprobs)


def _no_tokens(delta: TokenDelta) -> TokenDelta:
    """``max_tokens: 0`` with echo: the prompt is scored and the token the engine sampled
    after it (it always samples one) dropped; the choice ends ``length``, as vLLM's."""
    return replace(
        delta,
        token_ids=[],
        text="",
        logprobs=None if delta.logprobs is None else [],
        finish_reason=FinishReason.MAX_TOKENS if delta.finished else None,
    )


def _timeout_s(job: Job) -> float:
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


async def _chain(first: _T, rest: AsyncIterator[_T]) -> AsyncIterator[_T]:
    yield first
    async for item in rest:
        yield item


def _api_error(exc: BaseException, request_id: str) -> APIError:
    """What the client sees of a choice that failed for good (``request_id``: the log's)."""
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
    return internal_error(exc, request_id)
