"""What the ingress does with one HTTP request (docs/design.md#lifecycle): gate, parse, tokenise,
check the context limit (``api.translate``), run each choice through the cluster's coordinator
(``api.choices``), answer or stream (``api.responses``). The operator plane's routes (health,
cluster view, metrics) are ``api.operator_plane``'s.

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
``tandem_stream_errors_total{cause}`` and logged. A bug on the way is a 500 error object (an
error event once streaming), logged with its traceback under the response's id.

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
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from api import responses, tokenize
from api.choices import Choices
from api.edge import error_response, internal_error
from api.errors import APIError
from api.gate import IngressGate, Rejected, Ticket
from api.metrics import Metrics, RequestTiming
from api.operator_plane import OperatorPlane
from api.translate import Kind, Translator, new_request_id
from cluster.coordinator import Coordinator
from contracts.actors import RouterClient, WorkerClient
from engine.request import RequestStatus
from engine.tokenizer import Tokenizer

_T = TypeVar("_T")


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
        self.model_name = model_name
        self.gate = gate
        self.metrics = metrics
        self.translator = Translator(
            tokenizer,
            model_name,
            max_model_len,
            vocab_size,
            gate.config.max_choices,
            request_timeout_s,
        )
        self.choices = Choices(coordinator, tokenizer, metrics)
        self.operator = OperatorPlane(coordinator, router, metrics, decode_workers or {})

    # -- routes --------------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._handle(request, "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, "chat")

    async def responses(self, request: Request) -> Response:
        return await self._handle(request, "responses")

    async def tokenize(self, request: Request) -> Response:
        t = self.translator
        return _json_or_error(
            lambda body: tokenize.tokenize(body, t.tokenizer, t.model_name, t.max_model_len),
            await request.body(),
        )

    async def detokenize(self, request: Request) -> Response:
        t = self.translator
        return _json_or_error(
            lambda body: tokenize.detokenize(body, t.tokenizer, t.model_name),
            await request.body(),
        )

    def models(self) -> Response:
        return JSONResponse(responses.models_response([self.model_name]))

    async def health(self) -> Response:
        return await self.operator.health()

    async def check_alive(self) -> None:
        await self.operator.check_alive()

    async def cluster(self) -> Response:
        return await self.operator.cluster()

    async def metrics_response(self) -> Response:
        return await self.operator.metrics_response()

    # -- one request ---------------------------------------------------------------------------

    async def _handle(self, request: Request, kind: Kind) -> Response:
        arrival = time.time()
        request_id = new_request_id(kind)
        body = await request.body()
        try:
            ticket = self.gate.admit(request.headers, len(body))
        except Rejected as exc:
            self._rejected(arrival, "unknown", str(exc.code))
            err = APIError(exc.status, exc.message, code=str(exc.code))
            return JSONResponse(err.body(), status_code=exc.status, headers=exc.headers())
        try:
            response = await self._admitted(request, request_id, kind, body, ticket, arrival)
        except Exception as exc:  # a bug: an error object for the client, the traceback logged
            ticket.release()
            response = error_response(internal_error(exc, request_id))
        # The response's id on every answer, errors too (whose body has no id): what a client
        # quotes to find the request in the logs and the workers' records. (Not X-Request-Id:
        # Ray Serve adds that header with its own id.)
        response.headers[REQUEST_ID_HEADER] = request_id
        return response

    async def _admitted(
        self,
        request: Request,
        request_id: str,
        kind: Kind,
        body: bytes,
        ticket: Ticket,
        arrival: float,
    ) -> Response:
        """The answer to an admitted request; ``ticket`` is released once it is complete."""
        try:
            job = self.translator.job(
                request_id, body, kind, ticket.tenant, arrival, request.headers
            )
        except APIError as exc:
            ticket.release()
            cause = "context_length" if exc.code == "context_length_exceeded" else "invalid_request"
            self._rejected(arrival, ticket.tenant, cause)
            return error_response(exc)
        deltas = self.choices.run(job)
        try:
            first = await _unless_client_leaves(request, anext(deltas, None))
        except APIError as exc:  # before the first token: a real status
            ticket.release()
            return error_response(exc)
        except _ClientLeft:  # nobody to answer; the choices are cancelled (and counted)
            ticket.release()
            await deltas.aclose()
            return Response(status_code=499)
        if job.stream:
            return StreamingResponse(
                self.choices.stream(job, ticket, first, deltas),
                media_type="text/event-stream",
                headers=_SSE_HEADERS,
            )
        try:
            return await _unless_client_leaves(request, self.choices.complete(job, first, deltas))
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


def _json_or_error(answer: Callable[[bytes], dict[str, Any]], body: bytes) -> Response:
    """``answer(body)`` as JSON, or the error object of the APIError it raises."""
    try:
        return JSONResponse(answer(body))
    except APIError as exc:
        return error_response(exc)


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


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
REQUEST_ID_HEADER = "X-Tandem-Request-Id"
