"""The operator plane of an ingress replica, apart from the request path: ``GET /health``,
``GET /v1/cluster`` (the router's view of the workers and its admission queue) and
``GET /metrics`` (the ingress's own metrics, the workers' gauges as the router last saw them
and the KV transfers the decode workers finished). Each asks the router with a short timeout:
a restarting router makes the answer ``unavailable`` (503 + Retry-After), never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import Response
from fastapi.responses import JSONResponse
from ray.exceptions import ActorUnavailableError, RayActorError

from api.errors import APIError
from api.metrics import Metrics
from cluster.coordinator import Coordinator
from contracts.actors import RouterClient, WorkerClient
from contracts.roles import Role
from contracts.routing import UNAVAILABLE_RETRY_AFTER_S, WorkerState

logger = logging.getLogger("tandem.api")
_T = TypeVar("_T")


class OperatorPlane:
    """What operators and Serve ask one ingress replica about the cluster behind it."""

    def __init__(
        self,
        coordinator: Coordinator,
        router: RouterClient,
        metrics: Metrics,
        decode_workers: dict[str, WorkerClient],
    ) -> None:
        self.coordinator = coordinator
        self.router = router
        self.metrics = metrics
        self.decode_workers = decode_workers
        self._transfer_seen: dict[str, int] = {}  # worker -> last transfer record observed

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
            failures.leases_expired = sum(s.report.leases_expired for s in states)
            failures.imports_parked = sum(s.report.imports_parked for s in states)
            failures.reservations_waited = sum(s.report.reservations_waited for s in states)
            self.metrics.speculation.totals = [s.report.speculation for s in states]
            for s in states:
                if s.healthy:
                    r = s.report
                    self.metrics.set_worker(
                        s.name, r.kv_usage, r.queue_depth, r.num_running, r.prefix_hit_ratio
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
    slots = sum(s.info.max_num_seqs for s in serving)
    up_slots = sum(s.info.max_num_seqs for s in serving if s.healthy)
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
        "queue_depth": s.report.queue_depth,
        "running": s.report.num_running,
        "max_num_seqs": s.info.max_num_seqs,
        "kv_usage": s.report.kv_usage,
        "kv_blocks": s.info.num_kv_blocks,
        "cached_blocks": s.cached_blocks,
        "prefix_hit_ratio": s.report.prefix_hit_ratio,
        "numerics": s.info.numerics,  # its numerics class: requests never cross one
        "cpu_capability": s.info.cpu_capability,
        # Its speculative decoding since it started (docs/design.md#speculative-decoding).
        "speculation": dict(
            zip(("drafts", "draft_tokens", "accepted_tokens"), s.report.speculation, strict=True)
        ),
    }
