"""Prometheus metrics of the HTTP endpoint, and one JSON log line per terminal request.

Latencies follow docs/design.md#metrics exactly. System boundary: ``arrival`` is when the HTTP
endpoint received the request (before the gate and tokenising); an *emit* is when a token's
text was handed to the client's response stream, one stamp per output token (tokens released
together share a stamp). With E2E ending at the last emit the identity
``e2e == ttft + sum(itls)`` holds exactly; the time after the last emit (final flush, usage
chunk) shows only in the log line's ``duration_s``.

Output-token counts are *emitted* tokens, what the client received (docs/design.md#cleanup:
generated, emitted and committed differ; the engine's terminal record has the other two).

Each ``Metrics`` owns its registry, so several apps or tests in one process never collide.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from api.gate import RejectCode
from cluster.client_stream import FailureReason
from contracts.routing import DetectedBy, Refusal
from engine import metrics as latency
from engine.request import FinishReason, RequestStatus, RequestTimes
from kv_transfer.errors import KVTransferError

logger = logging.getLogger("tandem.requests")

# Label values are the engine's terminal statuses and finish reasons (the one outcome type); a
# request that ended without a finish reason (failed, cancelled, rejected) counts as "none".
STATUSES = tuple(s.value for s in RequestStatus if s.is_terminal)
REJECTION_CAUSES = (
    *(code.value for code in RejectCode),  # phase 1, the gate
    "context_length",  # phase 2: prompt + max_tokens beyond the model's context
    "kv_capacity",  # phase 2: the KV reservation can never fit
    "invalid_request",  # bad JSON, unknown model, invalid sampling values
    *(r.value for r in Refusal),  # phase 2: the cluster's admission queue (before any token)
)
# Why a stream ended with an error event after its first token (the APIError codes): a fault
# that migration could not recover ("failed"), its deadline ("timeout"), anything else.
STREAM_ERROR_CAUSES = ("failed", "timeout", "kv_capacity", "internal")
FAILURE_REASONS = tuple(reason.value for reason in FailureReason)
_TRANSFER_ERRORS: tuple[type[KVTransferError], ...] = (
    KVTransferError,
    *KVTransferError.__subclasses__(),
)
TRANSPORT_FAILURE_KINDS = tuple(sorted({c.kind for c in _TRANSFER_ERRORS}))
DETECTION_HOWS = tuple(how.value for how in DetectedBy)

# Buckets (seconds unless named). Each spans the fastest case the demo model on a CPU gives to
# the slowest a client still waits for, denser where SLOs usually sit.
# TTFT: ~ms for a cached short prompt, seconds for long prompts or a queue, up to the 60 s
# default deadline.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
# ITL and TPOT: one decode step, ~ms on a GPU, tens of ms on a CPU; the tail catches stalls
# (a migration, a preemption). Tokens sharing an emit give ITL 0, in the first bucket.
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)  # fmt: skip
# E2E: whole generations, up to past the default deadline.
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0,
               120.0, 300.0)  # fmt: skip
# Queue time: zero when idle, up to the deadline when overloaded.
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                 20.0, 40.0, 60.0)  # fmt: skip
# KV transfer time: ~100 us for a few blocks over loopback to seconds for long prompts.
TRANSFER_SECONDS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                            0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)  # fmt: skip
# KV transfer size: powers of 4 from 4 KiB (one small block) to 4 GiB (a long prompt of a
# large model).
TRANSFER_BYTES_BUCKETS = tuple(float(1024 * 4**k) for k in range(1, 12))


class InvalidMetric(ValueError):
    """A value the metrics refuse (an unknown label value would grow a new series)."""


@dataclass(frozen=True)
class RequestTiming:
    """The stamps of one terminal request (``time.time()``, one clock, see the module doc)."""

    request_id: str
    tenant: str
    status: RequestStatus  # terminal
    finish_reason: FinishReason | None  # not HANDED_OFF: that never ends a client's request
    arrival: float
    emit_times: list[float]  # when each output token reached the client, in order
    finished: float
    num_prompt_tokens: int
    queue_time_s: float | None

    def __post_init__(self) -> None:
        if not self.status.is_terminal:
            raise InvalidMetric(f"status {self.status.value!r} is not one of {STATUSES}")
        if self.finish_reason is FinishReason.HANDED_OFF:
            raise InvalidMetric("finish_reason 'handed_off' never ends a client's request")
        if self.num_prompt_tokens < 0:
            raise InvalidMetric(f"num_prompt_tokens {self.num_prompt_tokens} is negative")

    @property
    def num_output_tokens(self) -> int:
        return len(self.emit_times)

    # The definitions are the engine's (engine/metrics.py, docs/design.md#metrics): one place for
    # them.
    def _times(self) -> RequestTimes:
        return RequestTimes(arrival=self.arrival, emits=list(self.emit_times))

    def ttft(self) -> float | None:
        return latency.ttft(self._times())

    def itls(self) -> list[float]:
        return latency.itls(self._times())

    def tpot(self) -> float | None:
        return latency.tpot(self._times())

    def e2e(self) -> float | None:
        return latency.e2e(self._times())


class Metrics:
    """The endpoint's metrics in a registry of its own; thread-safe (prometheus_client is)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._declare_latencies()
        self._declare_counts()
        self._declare_worker_gauges()
        r = self.registry
        self.stream_errors = Counter(
            "tandem_stream_errors_total",
            "Streams that ended with an error event after their first token, by cause.",
            ["cause"],
            registry=r,
        )
        self.failures = FailureCounts()
        r.register(self.failures)
        self.speculation = SpeculationCounts()
        r.register(self.speculation)
        # Every cause is exported from the start (at 0), so a rate() over it is defined
        # before the first rejection.
        for cause in REJECTION_CAUSES:
            self.rejections.labels(cause=cause)
        for cause in STREAM_ERROR_CAUSES:
            self.stream_errors.labels(cause=cause)

    def _declare_latencies(self) -> None:
        """The histograms of a request's latencies and of its KV transfer."""
        r = self.registry
        self.ttft = Histogram(
            "tandem_time_to_first_token_seconds",
            "Arrival at the endpoint to the first token emitted to the client.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "tandem_inter_token_latency_seconds",
            "Time between consecutive tokens emitted to the client (one sample per gap).",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "tandem_time_per_output_token_seconds",
            "(last emit - first emit) / (output tokens - 1), per request with >= 2 tokens.",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "tandem_e2e_request_latency_seconds",
            "Arrival to the last token emitted, per request that emitted any.",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "tandem_queue_time_seconds",
            "Time a request waited in a scheduler queue before it first ran.",
            buckets=QUEUE_BUCKETS,
            registry=r,
        )
        self.transfer_seconds = Histogram(
            "tandem_kv_transfer_seconds",
            "Duration of one KV transfer from a prefill to a decode worker.",
            buckets=TRANSFER_SECONDS_BUCKETS,
            registry=r,
        )
        self.transfer_bytes = Histogram(
            "tandem_kv_transfer_bytes",
            "Size of one KV transfer from a prefill to a decode worker.",
            buckets=TRANSFER_BYTES_BUCKETS,
            registry=r,
        )

    def _declare_counts(self) -> None:
        """Terminal requests, refusals and tokens."""
        r = self.registry
        self.requests = Counter(
            "tandem_requests_total",
            "Terminal requests, rejected ones included, by status and the engine's finish reason.",
            ["status", "finish_reason"],
            registry=r,
        )
        self.rejections = Counter(
            "tandem_rejections_total",
            "Refused requests by cause (gate codes and phase-2 causes).",
            ["cause"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "tandem_prompt_tokens_total", "Prompt tokens of terminal requests.", registry=r
        )
        self.generation_tokens = Counter(
            "tandem_generation_tokens_total",
            "Output tokens emitted to clients by terminal requests.",
            registry=r,
        )

    def _declare_worker_gauges(self) -> None:
        """The workers' load as the router last saw it, and the ingress's own queues."""
        r = self.registry
        self.kv_usage = Gauge(
            "tandem_kv_usage_ratio", "KV blocks in use / total.", ["worker"], registry=r
        )
        self.queue_depth = Gauge(
            "tandem_queue_depth", "Requests admitted but not running.", ["worker"], registry=r
        )
        self.running = Gauge("tandem_running_requests", "Requests running.", ["worker"], registry=r)
        self.prefix_hit = Gauge(
            "tandem_prefix_cache_hit_ratio",
            "Prompt tokens served from the prefix cache / prompt tokens.",
            ["worker"],
            registry=r,
        )
        self.worker_up = Gauge(
            "tandem_worker_up",
            "1 while the router counts the worker as serving, 0 while it is down (FAILED, "
            "restarting, not reported yet); a down worker's load gauges are not exported.",
            ["worker"],
            registry=r,
        )
        self.retry_budget = Gauge(
            "tandem_retry_budget_tokens",
            "Retries this ingress may still start before a request's first token (the token "
            "bucket of the retry section; the migration of a started stream spends none).",
            registry=r,
        )
        self.admission_queue = Gauge(
            "tandem_admission_queue_depth",
            "Requests waiting in the router's admission queue for a prefill/decode path.",
            registry=r,
        )

    def observe_request(self, t: RequestTiming) -> None:
        """Count a terminal request and observe its latencies (those defined for it). A
        rejected request is observed here too; ``observe_rejection`` adds its cause."""
        reason = t.finish_reason.value if t.finish_reason else "none"
        self.requests.labels(status=t.status.value, finish_reason=reason).inc()
        self.prompt_tokens.inc(t.num_prompt_tokens)
        self.generation_tokens.inc(t.num_output_tokens)
        ttft, tpot, e2e = t.ttft(), t.tpot(), t.e2e()
        if ttft is not None:
            self.ttft.observe(ttft)
        for itl in t.itls():
            self.itl.observe(itl)
        if tpot is not None:
            self.tpot.observe(tpot)
        if e2e is not None:
            self.e2e.observe(e2e)
        if t.queue_time_s is not None:
            self.queue_time.observe(t.queue_time_s)

    def observe_rejection(self, cause: str) -> None:
        if cause not in REJECTION_CAUSES:
            raise InvalidMetric(f"rejection cause {cause!r} is not one of {REJECTION_CAUSES}")
        self.rejections.labels(cause=cause).inc()

    def observe_stream_error(self, cause: str) -> None:
        """A stream cut after its first token; causes outside STREAM_ERROR_CAUSES count as
        ``internal``."""
        self.stream_errors.labels(cause=cause if cause in STREAM_ERROR_CAUSES else "internal").inc()

    def observe_transfer(self, seconds: float, nbytes: int) -> None:
        if seconds < 0 or nbytes < 0:
            raise InvalidMetric(f"transfer of {nbytes} bytes in {seconds} s: negative value")
        self.transfer_seconds.observe(seconds)
        self.transfer_bytes.observe(nbytes)

    def set_worker(
        self, name: str, kv_usage: float, queue_depth: int, running: int, prefix_hit_ratio: float
    ) -> None:
        """The latest load report of one worker."""
        for field, ratio in (("kv_usage", kv_usage), ("prefix_hit_ratio", prefix_hit_ratio)):
            if not 0.0 <= ratio <= 1.0:
                raise InvalidMetric(f"worker {name!r}: {field} {ratio} is not in [0, 1]")
        for field, count in (("queue_depth", queue_depth), ("running", running)):
            if count < 0:
                raise InvalidMetric(f"worker {name!r}: {field} {count} is negative")
        self.worker_up.labels(worker=name).set(1)
        self.kv_usage.labels(worker=name).set(kv_usage)
        self.queue_depth.labels(worker=name).set(queue_depth)
        self.running.labels(worker=name).set(running)
        self.prefix_hit.labels(worker=name).set(prefix_hit_ratio)

    def worker_down(self, name: str) -> None:
        """``name`` is not serving: up 0, and its last load is not exported as if current."""
        self.worker_up.labels(worker=name).set(0)
        for gauge in (self.kv_usage, self.queue_depth, self.running, self.prefix_hit):
            with contextlib.suppress(KeyError):  # never exported, or dropped already
                gauge.remove(name)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type, for a ``/metrics`` response."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class FailureCounts(Collector):
    """Counters kept where the failures are seen, exported as they were at the last scrape
    (``Metrics.failures`` is updated before each render): retries and migrations by reason
    and failed KV transfers by kind (this ingress's coordinator), workers found FAILED by how
    (the router, since it started), KV leases that expired (the prefill workers, since each
    started). A restart of the process that counts starts its count again, which Prometheus
    reads as a counter reset."""

    def __init__(self) -> None:
        self.retries: Mapping[str, int] = {}
        self.migrations: Mapping[str, int] = {}
        self.transport: Mapping[str, int] = {}
        self.detected: Mapping[str, int] = {}
        self.leases_expired = 0
        self.imports_parked = 0
        self.reservations_waited = 0

    def collect(self) -> Iterator[CounterMetricFamily]:
        families = (
            (
                "tandem_retries",
                "Attempts retried before the first token, by why the last one ended.",
                "reason",
                self.retries,
                FAILURE_REASONS,
            ),
            (
                "tandem_migrations",
                "Streams moved to another worker after their first token, by "
                "why the attempt ended.",
                "reason",
                self.migrations,
                FAILURE_REASONS,
            ),
            (
                "tandem_transport_failures",
                "KV transfers that failed, by how.",
                "kind",
                self.transport,
                TRANSPORT_FAILURE_KINDS,
            ),
            (
                "tandem_worker_failures_detected",
                "Workers the router marked FAILED, by how it found out.",
                "how",
                self.detected,
                DETECTION_HOWS,
            ),
        )
        for name, doc, label, counts, known in families:
            family = CounterMetricFamily(name, doc, labels=[label])
            for value in sorted({*known, *counts}):
                family.add_metric([value], counts.get(value, 0))
            yield family
        expired = CounterMetricFamily(
            "tandem_kv_lease_expired", "KV leases that expired before decode claimed them."
        )
        expired.add_metric([], self.leases_expired)
        yield expired
        parked = CounterMetricFamily(
            "tandem_kv_imports_parked",
            "KV imports that waited on their decode worker for room (the router's ledger "
            "counted room the engine did not have yet): a wait, not a failure.",
        )
        parked.add_metric([], self.imports_parked)
        yield parked
        waited = CounterMetricFamily(
            "tandem_decode_reservations_waited",
            "Decode slots reserved before their prefill that waited for room (no KV existed "
            "yet, none was leased): a wait, not a failure.",
        )
        waited.add_metric([], self.reservations_waited)
        yield waited


class SpeculationCounts(Collector):
    """Speculative decoding over every worker (docs/design.md#speculative-decoding), as vLLM
    names it: verifications that carried drafts, draft tokens verified, draft tokens accepted.
    Summed from the workers' last reports at each scrape; ``accepted / draft_tokens`` is the
    acceptance rate, ``1 + accepted / drafts`` the mean acceptance length."""

    def __init__(self) -> None:
        self.totals: list[tuple[int, int, int]] = []  # per worker: steps, drafted, accepted

    def collect(self) -> Iterator[CounterMetricFamily]:
        names = (
            ("tandem_spec_decode_num_drafts", "Verification steps that carried drafts."),
            ("tandem_spec_decode_num_draft_tokens", "Draft tokens verified."),
            (
                "tandem_spec_decode_num_accepted_tokens",
                "Draft tokens accepted: equal to the token sampled at their place.",
            ),
        )
        for column, (name, doc) in enumerate(names):
            family = CounterMetricFamily(name, doc)
            family.add_metric([], sum(t[column] for t in self.totals))
            yield family


def log_record(t: RequestTiming) -> str:
    """The one JSON line of a terminal request, with its derived metrics; logged on
    ``tandem.requests`` at INFO and returned."""
    itls = t.itls()
    line = json.dumps(
        {
            "request_id": t.request_id,
            "tenant": t.tenant,
            "status": t.status.value,
            "finish_reason": t.finish_reason.value if t.finish_reason else None,
            "arrival": t.arrival,
            "num_prompt_tokens": t.num_prompt_tokens,
            "num_output_tokens": t.num_output_tokens,
            "queue_time_s": t.queue_time_s,
            "ttft_s": t.ttft(),
            "tpot_s": t.tpot(),
            "itl_max_s": max(itls) if itls else None,
            "e2e_s": t.e2e(),
            "duration_s": t.finished - t.arrival,  # to the end: includes the tail after emits
        },
        allow_nan=False,
    )
    logger.info(line)
    return line
