"""Endpoint metrics: docs/design.md#metrics definitions on hand-built timings, exact exposition of
known observations, independent registries, per-worker labels and the one log line per request."""

from __future__ import annotations

import json
import logging

import pytest
from helpers import worker_state
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from api.choices import _api_error
from api.metrics import (
    REJECTION_CAUSES,
    STREAM_ERROR_CAUSES,
    InvalidMetric,
    Metrics,
    RequestTiming,
    log_record,
)
from api.operator_plane import health_body, worker_view
from cluster.retry import GiveUp, RetriesExhausted
from contracts.roles import Role
from contracts.routing import AdmissionRefused, Refusal, WorkerState
from engine.request import FinishReason, RequestStatus

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples(m: Metrics) -> Samples:
    """Every sample of ``render()``, parsed back, keyed by name and labels (no _created)."""
    body, content_type = m.render()
    assert content_type.startswith("text/plain")
    out: Samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            if not s.name.endswith("_created"):
                out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(got: Samples, name: str, **labels: str) -> float:
    return got[(name, frozenset(labels.items()))]


def timing(
    emits: list[float],
    arrival: float = 100.0,
    status: RequestStatus = RequestStatus.FINISHED,
    finish_reason: FinishReason | None = FinishReason.EOS,
    prompt: int = 4,
    queue: float | None = None,
    finished: float | None = None,
) -> RequestTiming:
    return RequestTiming(
        request_id="r",
        tenant="alpha",
        status=status,
        finish_reason=finish_reason,
        arrival=arrival,
        emit_times=emits,
        finished=finished if finished is not None else (emits[-1] if emits else arrival) + 0.125,
        num_prompt_tokens=prompt,
        queue_time_s=queue,
    )


# -- docs/design.md#metrics on hand-built timings
# ---------------------------------------------------------------


def test_no_output_token() -> None:
    t = timing([])
    assert (t.ttft(), t.itls(), t.tpot(), t.e2e()) == (None, [], None, None)


def test_one_output_token() -> None:
    t = timing([100.25])
    assert (t.ttft(), t.itls(), t.tpot(), t.e2e()) == (0.25, [], None, 0.25)


def test_two_output_tokens() -> None:
    t = timing([100.25, 100.75])
    assert (t.ttft(), t.itls(), t.tpot(), t.e2e()) == (0.25, [0.5], 0.5, 0.75)


def test_many_tokens_some_sharing_an_emit() -> None:
    t = timing([100.5, 100.75, 100.75, 100.75, 101.5])
    assert t.ttft() == 0.5
    assert t.itls() == [0.25, 0.0, 0.0, 0.75]  # released together: gaps of zero, still counted
    assert t.tpot() == 1.0 / 4  # (last - first) / (N_out - 1), not / the distinct emits
    assert t.e2e() == 1.5
    assert t.num_output_tokens == 5


def test_all_tokens_in_one_emit() -> None:
    t = timing([101.0, 101.0, 101.0])
    assert (t.ttft(), t.itls(), t.tpot(), t.e2e()) == (1.0, [0.0, 0.0], 0.0, 1.0)


@given(
    arrival=st.floats(0, 1e9),
    first=st.floats(0, 1e3),
    gaps=st.lists(st.floats(0, 10), max_size=40),
)
def test_identity_e2e_is_ttft_plus_itls(arrival: float, first: float, gaps: list[float]) -> None:
    emits = [arrival + first]
    for g in gaps:
        emits.append(emits[-1] + g)
    t = timing(emits, arrival=arrival)
    itls, ttft, e2e, tpot = t.itls(), t.ttft(), t.e2e(), t.tpot()
    assert len(itls) == len(emits) - 1
    assert ttft is not None and e2e is not None
    assert e2e == pytest.approx(ttft + sum(itls), rel=1e-9, abs=1e-6)
    if len(emits) >= 2:
        assert tpot is not None
        assert tpot == pytest.approx(sum(itls) / len(itls), rel=1e-9, abs=1e-6)
    else:
        assert tpot is None


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"status": RequestStatus.DECODING}, "status 'decoding'"),
        ({"finish_reason": FinishReason.HANDED_OFF}, "finish_reason 'handed_off'"),
        ({"prompt": -1}, "num_prompt_tokens -1"),
    ],
)
def test_invalid_timing_is_refused(kw: dict[str, object], says: str) -> None:
    with pytest.raises(InvalidMetric, match=says):
        timing([100.5], **kw)  # type: ignore[arg-type]


# -- exact exposition ------------------------------------------------------------------------

KNOWN = [
    # ttft 0.5, itls 0.25 0 0.75, tpot 1/3, e2e 1.5, queue 1/8
    timing([100.5, 100.75, 100.75, 101.5], prompt=7, queue=0.125),
    # ttft 0.25, no itl, tpot undefined, e2e 0.25
    timing([100.25], finish_reason=FinishReason.MAX_TOKENS, prompt=3),
    # nothing emitted: counted, no latency but the queue time
    timing(
        [], status=RequestStatus.FAILED, finish_reason=FinishReason.ERROR, prompt=5, queue=0.0625
    ),
    timing([], status=RequestStatus.REJECTED, finish_reason=FinishReason.REJECTED, prompt=0),
    timing([], status=RequestStatus.CANCELLED, finish_reason=None, prompt=1),
]


def test_request_counters_and_token_totals() -> None:
    m = Metrics()
    for t in KNOWN:
        m.observe_request(t)
    got = samples(m)
    requests = {
        (dict(labels)["status"], dict(labels)["finish_reason"]): v
        for (name, labels), v in got.items()
        if name == "tandem_requests_total"
    }
    assert requests == {
        ("finished", "eos"): 1,
        ("finished", "max_tokens"): 1,
        ("failed", "error"): 1,
        ("rejected", "rejected"): 1,
        ("cancelled", "none"): 1,
    }
    assert value(got, "tandem_prompt_tokens_total") == 16
    assert value(got, "tandem_generation_tokens_total") == 5


def buckets(got: Samples, name: str) -> dict[str, float]:
    return {dict(labels)["le"]: v for (n, labels), v in got.items() if n == f"{name}_bucket"}


def test_latency_histograms_exact() -> None:
    m = Metrics()
    for t in KNOWN:
        m.observe_request(t)
    got = samples(m)

    ttft = "tandem_time_to_first_token_seconds"
    assert (value(got, f"{ttft}_count"), value(got, f"{ttft}_sum")) == (2, 0.75)
    b = buckets(got, ttft)
    assert (b["0.1"], b["0.25"], b["0.5"], b["+Inf"]) == (0, 1, 2, 2)  # le is inclusive

    itl = "tandem_inter_token_latency_seconds"
    assert (value(got, f"{itl}_count"), value(got, f"{itl}_sum")) == (3, 1.0)
    b = buckets(got, itl)
    assert (b["0.001"], b["0.2"], b["0.3"], b["0.5"], b["0.75"], b["+Inf"]) == (1, 1, 2, 2, 3, 3)

    tpot = "tandem_time_per_output_token_seconds"
    assert (value(got, f"{tpot}_count"), value(got, f"{tpot}_sum")) == (1, 1.0 / 3)
    b = buckets(got, tpot)
    assert (b["0.3"], b["0.4"]) == (0, 1)

    e2e = "tandem_e2e_request_latency_seconds"
    assert (value(got, f"{e2e}_count"), value(got, f"{e2e}_sum")) == (2, 1.75)
    b = buckets(got, e2e)
    assert (b["0.1"], b["0.25"], b["1.0"], b["2.5"]) == (0, 1, 1, 2)

    queue = "tandem_queue_time_seconds"
    assert (value(got, f"{queue}_count"), value(got, f"{queue}_sum")) == (2, 0.1875)
    b = buckets(got, queue)
    assert (b["0.05"], b["0.1"], b["0.25"]) == (0, 1, 2)


def test_transfer_histograms_exact() -> None:
    m = Metrics()
    m.observe_transfer(0.003, 65536)
    m.observe_transfer(0.2, 5 * 2**20)
    got = samples(m)
    s, n = "tandem_kv_transfer_seconds", "tandem_kv_transfer_bytes"
    assert (value(got, f"{s}_count"), value(got, f"{s}_sum")) == (2, 0.203)
    b = buckets(got, s)
    assert (b["0.0025"], b["0.005"], b["0.1"], b["0.25"]) == (0, 1, 1, 2)
    assert (value(got, f"{n}_count"), value(got, f"{n}_sum")) == (2, 65536 + 5 * 2**20)
    b = buckets(got, n)
    assert (b["16384.0"], b["65536.0"], b["4.194304e+06"], b["1.6777216e+07"]) == (0, 1, 1, 2)


def test_rejections_by_cause_start_at_zero() -> None:
    m = Metrics()
    got = samples(m)
    zero = {c: value(got, "tandem_rejections_total", cause=c) for c in REJECTION_CAUSES}
    assert zero == dict.fromkeys(REJECTION_CAUSES, 0.0)
    assert set(REJECTION_CAUSES) == {
        "invalid_api_key",
        "body_too_large",
        "rate_limited",
        "too_many_concurrent_requests",
        "context_length",
        "kv_capacity",
        "invalid_request",
        "queue_full",
        "queue_wait_exceeds_deadline",
        "deadline_passed_in_queue",
        "no_replica_available",
    }
    m.observe_rejection("rate_limited")
    m.observe_rejection("rate_limited")
    m.observe_rejection("kv_capacity")
    got = samples(m)
    counts = {c: value(got, "tandem_rejections_total", cause=c) for c in REJECTION_CAUSES}
    assert counts == {**zero, "rate_limited": 2.0, "kv_capacity": 1.0}


def test_stream_errors_start_at_zero_and_count_by_cause() -> None:
    m = Metrics()
    got = samples(m)
    zero = {c: value(got, "tandem_stream_errors_total", cause=c) for c in STREAM_ERROR_CAUSES}
    assert zero == {"failed": 0.0, "timeout": 0.0, "kv_capacity": 0.0, "internal": 0.0}
    m.observe_stream_error("failed")
    m.observe_stream_error("timeout")
    m.observe_stream_error("failed")
    m.observe_stream_error("teapot")  # not a cause: counted as internal, no new series
    got = samples(m)
    counts = {c: value(got, "tandem_stream_errors_total", cause=c) for c in STREAM_ERROR_CAUSES}
    assert counts == {"failed": 2.0, "timeout": 1.0, "kv_capacity": 0.0, "internal": 1.0}
    assert not [key for key in got if ("cause", "teapot") in key[1]]


def test_unknown_values_are_refused_without_a_new_series() -> None:
    m = Metrics()
    before = samples(m)
    with pytest.raises(InvalidMetric, match="rejection cause 'teapot'"):
        m.observe_rejection("teapot")
    with pytest.raises(InvalidMetric, match="kv_usage 1.5"):
        m.set_worker("w", 1.5, 0, 0, 0.0)
    with pytest.raises(InvalidMetric, match="prefix_hit_ratio -0.1"):
        m.set_worker("w", 0.5, 0, 0, -0.1)
    with pytest.raises(InvalidMetric, match="queue_depth -1"):
        m.set_worker("w", 0.5, -1, 0, 0.0)
    with pytest.raises(InvalidMetric, match="negative"):
        m.observe_transfer(-1.0, 10)
    assert samples(m) == before


# -- per worker, per instance ------------------------------------------------------------------


def test_worker_gauges_by_label() -> None:
    m = Metrics()
    m.set_worker("prefill-0", 0.25, 3, 2, 0.5)
    m.set_worker("decode-0", 0.75, 0, 4, 0.0)
    m.set_worker("prefill-0", 0.5, 1, 1, 0.625)  # the latest report replaces the last
    got = samples(m)
    per_worker = {
        name: {dict(labels)["worker"]: v for (n, labels), v in got.items() if n == name}
        for name in (
            "tandem_kv_usage_ratio",
            "tandem_queue_depth",
            "tandem_running_requests",
            "tandem_prefix_cache_hit_ratio",
        )
    }
    assert per_worker == {
        "tandem_kv_usage_ratio": {"prefill-0": 0.5, "decode-0": 0.75},
        "tandem_queue_depth": {"prefill-0": 1, "decode-0": 0},
        "tandem_running_requests": {"prefill-0": 1, "decode-0": 4},
        "tandem_prefix_cache_hit_ratio": {"prefill-0": 0.625, "decode-0": 0.0},
    }


def test_two_instances_are_independent() -> None:
    a, b = Metrics(), Metrics()  # one global registry would refuse the second
    a.observe_request(KNOWN[0])
    a.observe_rejection("body_too_large")
    a.set_worker("decode-0", 0.5, 1, 1, 0.5)
    got_a, got_b = samples(a), samples(b)
    assert value(got_a, "tandem_time_to_first_token_seconds_count") == 1
    assert value(got_b, "tandem_time_to_first_token_seconds_count") == 0
    assert value(got_a, "tandem_rejections_total", cause="body_too_large") == 1
    assert value(got_b, "tandem_rejections_total", cause="body_too_large") == 0
    assert not any(n == "tandem_kv_usage_ratio" for n, _ in got_b)
    assert samples(Metrics()) == got_b


# -- the log line ------------------------------------------------------------------------------


def test_one_json_line_per_terminal_request(caplog: pytest.LogCaptureFixture) -> None:
    t = RequestTiming(
        request_id="req-1",
        tenant="alpha",
        status=RequestStatus.FINISHED,
        finish_reason=FinishReason.STOP_STRING,
        arrival=100.0,
        emit_times=[100.5, 100.75, 100.75, 101.5],
        finished=101.625,
        num_prompt_tokens=7,
        queue_time_s=0.125,
    )
    with caplog.at_level(logging.INFO, logger="tandem.requests"):
        line = log_record(t)
    assert "\n" not in line
    [record] = caplog.records
    assert (record.name, record.levelno, record.getMessage()) == (
        "tandem.requests",
        logging.INFO,
        line,
    )
    assert json.loads(line) == {
        "request_id": "req-1",
        "tenant": "alpha",
        "status": "finished",
        "finish_reason": "stop_string",
        "arrival": 100.0,
        "num_prompt_tokens": 7,
        "num_output_tokens": 4,
        "queue_time_s": 0.125,
        "ttft_s": 0.5,
        "tpot_s": 1.0 / 3,
        "itl_max_s": 0.75,
        "e2e_s": 1.5,
        "duration_s": 1.625,
    }


def test_log_line_of_a_request_without_output(caplog: pytest.LogCaptureFixture) -> None:
    t = timing(
        [],
        status=RequestStatus.REJECTED,
        finish_reason=FinishReason.REJECTED,
        prompt=0,
        finished=100.0,
    )
    with caplog.at_level(logging.INFO, logger="tandem.requests"):
        got = json.loads(log_record(t))
    assert len(caplog.records) == 1
    assert {k: got[k] for k in ("ttft_s", "tpot_s", "itl_max_s", "e2e_s", "queue_time_s")} == (
        dict.fromkeys(("ttft_s", "tpot_s", "itl_max_s", "e2e_s", "queue_time_s"))
    )
    assert (got["num_output_tokens"], got["duration_s"]) == (0, 0.0)


def test_a_down_worker_is_up_0_and_its_load_is_no_longer_exported() -> None:
    """``tandem_worker_up`` follows the router's view; a worker that goes down stops exporting
    its last load as if it were current, and exports it again once back."""
    m = Metrics()
    m.set_worker("decode-0", 0.5, 2, 3, 0.25)
    m.set_worker("decode-1", 0.1, 0, 1, 0.0)
    m.worker_down("decode-1")
    m.worker_down("decode-2")  # never reported: up 0, nothing to drop
    got = samples(m)
    assert {w: value(got, "tandem_worker_up", worker=w) for w in ("decode-0", "decode-1")} == {
        "decode-0": 1.0,
        "decode-1": 0.0,
    }
    assert value(got, "tandem_worker_up", worker="decode-2") == 0.0
    for name in ("tandem_kv_usage_ratio", "tandem_queue_depth", "tandem_running_requests"):
        workers = {dict(labels)["worker"] for n, labels in got if n == name}
        assert workers == {"decode-0"}, name
    assert value(got, "tandem_running_requests", worker="decode-0") == 3.0
    m.set_worker("decode-1", 0.2, 1, 1, 0.5)
    got = samples(m)
    assert value(got, "tandem_worker_up", worker="decode-1") == 1.0
    assert value(got, "tandem_kv_usage_ratio", worker="decode-1") == 0.2


def test_the_retry_budget_is_a_gauge() -> None:
    m = Metrics()
    m.retry_budget.set(7.5)
    assert value(samples(m), "tandem_retry_budget_tokens") == 7.5


def test_health_body_says_ok_degraded_or_unavailable_with_what_is_down() -> None:
    """Full capacity: ok. A worker down: degraded, naming it, with the share of decode slots
    left (prefill workers hold none). No decoding worker up: unavailable."""

    def state(name: str, healthy: bool = True, failed: bool = False) -> WorkerState:
        role = Role(name.rsplit("-", 1)[0])
        return worker_state(name, role, "a", healthy=healthy, failed=failed, max_num_seqs=8)

    up = [state("prefill-0"), state("decode-0"), state("decode-1")]
    assert health_body(up) == {"status": "ok", "workers": 3, "down": [], "capacity": 1.0}
    one = [state("prefill-0", False, True), state("decode-0"), state("decode-1", False)]
    assert health_body(one) == {
        "status": "degraded",
        "workers": 3,
        "down": ["decode-1", "prefill-0"],
        "capacity": 0.5,
    }
    none = [state("prefill-0"), state("decode-0", False, True), state("decode-1", False, True)]
    assert health_body(none) == {
        "status": "unavailable",
        "workers": 3,
        "down": ["decode-0", "decode-1"],
        "capacity": 0.0,
    }
    colocated = [state("colocated-0"), state("colocated-1", False)]
    assert health_body(colocated)["status"] == "degraded"


def test_worker_view_names_the_state_and_every_field() -> None:
    s = worker_state(
        "decode-1",
        Role.DECODE,
        "b",
        healthy=False,
        failed=True,
        queue_depth=1,
        num_running=2,
        kv_usage=0.25,
        prefix_hit_ratio=0.5,
        max_num_seqs=16,
        num_kv_blocks=100,
        cached_blocks=7,
        numerics="bfloat16/invariant/columns",
        cpu_capability="AVX2",
        speculation=(3, 12, 7),
    )
    assert worker_view(s) == {
        "name": "decode-1",
        "role": "decode",
        "domain": "b",
        "state": "failed",
        "queue_depth": 1,
        "running": 2,
        "max_num_seqs": 16,
        "kv_usage": 0.25,
        "kv_blocks": 100,
        "cached_blocks": 7,
        "prefix_hit_ratio": 0.5,
        "numerics": "bfloat16/invariant/columns",
        "cpu_capability": "AVX2",
        "speculation": {"drafts": 3, "draft_tokens": 12, "accepted_tokens": 7},
    }
    starting = worker_state("decode-0", Role.DECODE, "a", healthy=False)
    assert worker_view(starting)["state"] == "starting"
    assert worker_view(worker_state("decode-0", Role.DECODE, "a"))["state"] == "up"


@pytest.mark.parametrize(
    ("exc", "status", "code", "retry_after"),
    [
        (AdmissionRefused("r", Refusal.QUEUE_FULL, "full", 1.0), 429, "queue_full", "1"),
        (
            AdmissionRefused("r", Refusal.WAIT_EXCEEDS_DEADLINE, "slow", 2.5),
            503,
            "queue_wait_exceeds_deadline",
            "3",
        ),
        (
            AdmissionRefused("r", Refusal.DEADLINE_PASSED, "late", None),
            504,
            "deadline_passed_in_queue",
            None,
        ),
        (
            AdmissionRefused("r", Refusal.UNAVAILABLE, "none up", 5.0),
            503,
            "no_replica_available",
            "5",
        ),
        (RetriesExhausted("r", GiveUp.BUDGET, 1, "decode-0 died"), 503, "failed", "5"),
        (RetriesExhausted("r", GiveUp.DEADLINE, 2, "x"), 504, "timeout", None),
        (
            RetriesExhausted("r", GiveUp.MAX_ATTEMPTS, 3, "x", rejected=True),
            503,
            "kv_capacity",
            None,
        ),
    ],
)
def test_each_failure_before_a_token_is_its_status_with_retry_after_where_retrying_helps(
    exc: Exception, status: int, code: str, retry_after: str | None
) -> None:
    err = _api_error(exc, "cmpl-1")
    assert (err.status, err.code) == (status, code)
    assert err.headers().get("Retry-After") == retry_after


def test_failure_counters_are_exported_with_every_label_from_the_start() -> None:
    """Retries, migrations, transport failures and detections as last counted where they are
    seen; every known label at 0 before its first count, so a rate() over it is defined."""
    m = Metrics()
    got = samples(m)
    for reason in ("worker_died", "worker_failed", "kv_transfer", "no_room", "no_replica"):
        assert value(got, "tandem_retries_total", reason=reason) == 0
        assert value(got, "tandem_migrations_total", reason=reason) == 0
    for kind in ("integrity", "truncated", "timeout", "aborted", "peer_unavailable", "frame"):
        assert value(got, "tandem_transport_failures_total", kind=kind) == 0
    for how in ("restart", "actor_death", "heartbeat"):
        assert value(got, "tandem_worker_failures_detected_total", how=how) == 0
    assert value(got, "tandem_kv_lease_expired_total") == 0
    assert value(got, "tandem_kv_imports_parked_total") == 0
    assert value(got, "tandem_decode_reservations_waited_total") == 0
    m.failures.retries = {"kv_transfer": 3}
    m.failures.migrations = {"worker_died": 2}
    m.failures.transport = {"integrity": 3}
    m.failures.detected = {"heartbeat": 1, "actor_death": 4}
    m.failures.leases_expired = 5
    m.failures.imports_parked = 6
    m.failures.reservations_waited = 7
    got = samples(m)
    assert value(got, "tandem_retries_total", reason="kv_transfer") == 3
    assert value(got, "tandem_retries_total", reason="worker_died") == 0
    assert value(got, "tandem_migrations_total", reason="worker_died") == 2
    assert value(got, "tandem_transport_failures_total", kind="integrity") == 3
    assert value(got, "tandem_worker_failures_detected_total", how="actor_death") == 4
    assert value(got, "tandem_kv_lease_expired_total") == 5
    assert value(got, "tandem_kv_imports_parked_total") == 6
    assert value(got, "tandem_decode_reservations_waited_total") == 7


def test_speculation_counters_sum_the_workers_last_reports() -> None:
    m = Metrics()
    names = ("drafts", "draft_tokens", "accepted_tokens")
    for name in names:
        assert value(samples(m), f"tandem_spec_decode_num_{name}_total") == 0
    m.speculation.totals = [(2, 8, 5), (1, 4, 0), (0, 0, 0)]
    got = samples(m)
    assert [value(got, f"tandem_spec_decode_num_{n}_total") for n in names] == [3, 12, 5]
