"""Phase-1 admission: each rejection, the token bucket against an exact model, concurrency slots,
tenant isolation and config validation."""

from __future__ import annotations

import pickle
import threading
from collections.abc import Mapping
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError
from starlette.datastructures import Headers

from api.gate import (
    CONCURRENCY_RETRY_AFTER_S,
    DEFAULT_TENANT,
    GateConfig,
    IngressGate,
    RejectCode,
    Rejected,
    TenantQuota,
    Ticket,
)


class Clock:
    """A clock the test moves by hand; steps are multiples of 1/64 so float sums stay exact."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def quota(rate: float = 1.0, burst: int = 100, conc: int = 100) -> TenantQuota:
    return TenantQuota(requests_per_s=rate, burst=burst, max_concurrent=conc)


def gate_for(
    q: TenantQuota, keys: dict[str, str] | None = None, **kw: object
) -> tuple[IngressGate, Clock]:
    clock = Clock()
    config = GateConfig.model_validate({"api_keys": keys or {}, "default_quota": q, **kw})
    return IngressGate(config, clock=clock), clock


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def rejection(
    gate: IngressGate, headers: Mapping[str, str] | None = None, size: int = 10
) -> Rejected:
    with pytest.raises(Rejected) as info:
        gate.admit(headers or {}, size)
    return info.value


# -- each rejection --------------------------------------------------------------------------


def test_body_too_large() -> None:
    gate, _ = gate_for(quota(), max_body_bytes=1000)
    gate.admit({}, 1000).release()  # exactly the limit passes
    r = rejection(gate, size=1001)
    assert (r.status, r.code, r.retry_after_s) == (413, "body_too_large", None)
    assert r.message == "request body is 1001 bytes, more than max_body_bytes=1000"
    assert r.headers() == {}
    assert gate.in_flight(DEFAULT_TENANT) == 0


def test_default_body_limit_is_one_mib() -> None:
    assert GateConfig().max_body_bytes == 2**20


KEYS = {"k-alpha": "alpha", "k-beta": "beta"}


@pytest.mark.parametrize(
    ("headers", "says"),
    [
        ({}, "got no"),
        ({"Authorization": "k-alpha"}, "must be 'Bearer <key>'"),
        ({"Authorization": "Basic k-alpha"}, "must be 'Bearer <key>'"),
        ({"Authorization": "Bearer"}, "must be 'Bearer <key>'"),
        ({"Authorization": "Bearer k-alpha extra"}, "must be 'Bearer <key>'"),
        ({"Authorization": "Bearer k-gamma"}, "not recognised"),
        ({"Authorization": "Bearer K-ALPHA"}, "not recognised"),  # keys are case-sensitive
        ({"X-Api-Key": "k-alpha"}, "got no"),
        ({"authorization": "Bearer k-alpha", "AUTHORIZATION": "Bearer k-beta"}, "got 2"),
    ],
)
def test_invalid_api_key(headers: dict[str, str], says: str) -> None:
    gate, _ = gate_for(quota(), KEYS)
    r = rejection(gate, headers)
    assert (r.status, r.code, r.retry_after_s) == (401, "invalid_api_key", None)
    assert says in r.message
    assert "k-alpha" not in r.message and "k-gamma" not in r.message  # keys never echoed
    assert gate.in_flight("alpha") == gate.in_flight("beta") == 0


@pytest.mark.parametrize(
    "headers",
    [
        {"Authorization": "Bearer k-alpha"},
        {"authorization": "bearer k-alpha"},
        {"AUTHORIZATION": "BEARER   k-alpha "},
        Headers(raw=[(b"authorization", b"Bearer k-alpha")]),  # what Starlette hands over
    ],
)
def test_header_name_and_scheme_are_case_insensitive(headers: Mapping[str, str]) -> None:
    gate, _ = gate_for(quota(), KEYS)
    ticket = gate.admit(headers, 10)
    assert ticket.tenant == "alpha"
    assert gate.in_flight("alpha") == 1


def test_starlette_duplicate_authorization_is_refused() -> None:
    gate, _ = gate_for(quota(), KEYS)
    raw = [(b"authorization", b"Bearer k-alpha"), (b"authorization", b"Bearer k-beta")]
    assert rejection(gate, Headers(raw=raw)).code == "invalid_api_key"


def test_auth_off_makes_everyone_default() -> None:
    gate, _ = gate_for(quota())
    assert gate.admit({}, 1).tenant == DEFAULT_TENANT
    assert gate.admit(bearer("anything"), 1).tenant == DEFAULT_TENANT
    assert gate.in_flight(DEFAULT_TENANT) == 2


def test_rate_limited_with_exact_retry_after() -> None:
    gate, clock = gate_for(quota(rate=4.0, burst=3))
    for _ in range(3):
        gate.admit({}, 1)
    r = rejection(gate)
    assert (r.status, r.code) == (429, "rate_limited")
    assert r.retry_after_s == 0.25  # one token at 4/s from an empty bucket
    assert r.message == "tenant 'default' is over its rate of 4 requests/s (burst 3)"
    assert r.headers() == {"Retry-After": "1"}  # whole seconds, rounded up
    clock.now += 0.125
    assert rejection(gate).retry_after_s == 0.125  # half a token is there
    clock.now += 0.125
    gate.admit({}, 1)  # exactly when promised
    assert rejection(gate).retry_after_s == 0.25


def test_retry_after_header_rounds_up() -> None:
    gate, _ = gate_for(quota(rate=0.4, burst=1))
    gate.admit({}, 1)
    r = rejection(gate)
    assert r.retry_after_s == pytest.approx(2.5)
    assert r.headers() == {"Retry-After": "3"}


def test_too_many_concurrent() -> None:
    gate, _ = gate_for(quota(conc=2))
    gate.admit({}, 1)
    gate.admit({}, 1)
    r = rejection(gate)
    assert (r.status, r.code) == (429, "too_many_concurrent_requests")
    assert r.retry_after_s == CONCURRENCY_RETRY_AFTER_S
    assert r.message == "tenant 'default' already has 2 requests in flight, max_concurrent=2"
    assert gate.in_flight(DEFAULT_TENANT) == 2


def test_checks_run_in_order() -> None:
    gate, _ = gate_for(quota(rate=1.0, burst=1, conc=1), KEYS, max_body_bytes=100)
    gate.admit(bearer("k-alpha"), 1)  # alpha: bucket empty and its one slot taken
    assert rejection(gate, bearer("wrong"), size=101).code == "body_too_large"
    assert rejection(gate, bearer("wrong"), size=100).code == "invalid_api_key"
    assert rejection(gate, bearer("k-alpha")).code == "rate_limited"  # before concurrency


def test_concurrency_rejection_takes_no_token() -> None:
    gate, _ = gate_for(quota(rate=1.0, burst=3, conc=2))
    a = gate.admit({}, 1)
    b = gate.admit({}, 1)  # one token left
    for _ in range(5):
        assert rejection(gate).code == "too_many_concurrent_requests"
    a.release()
    gate.admit({}, 1)  # the last token: the five refusals took none
    b.release()
    assert rejection(gate).code == "rate_limited"


def test_rejected_survives_pickling() -> None:
    r = Rejected(429, RejectCode.RATE_LIMITED, "slow down", 0.5)
    back = pickle.loads(pickle.dumps(r))
    assert (back.status, back.code, back.message, back.retry_after_s) == (
        429,
        "rate_limited",
        "slow down",
        0.5,
    )


# -- the bucket refills at the configured rate --------------------------------------------------


def test_bucket_refills_at_exactly_the_rate() -> None:
    gate, clock = gate_for(quota(rate=8.0, burst=8))
    for _ in range(8):
        gate.admit({}, 1)
    for _ in range(3):  # one second at 8/s: exactly 8 more, the 9th refused
        clock.now += 1.0
        for _ in range(8):
            gate.admit({}, 1)
        assert rejection(gate).code == "rate_limited"
    clock.now += 1 / 8 - 1 / 64  # just short of a token
    assert rejection(gate).retry_after_s == 1 / 64


def test_burst_caps_the_bucket() -> None:
    gate, clock = gate_for(quota(rate=2.0, burst=5))
    clock.now += 3600.0  # a long idle spell refills to burst, no further
    for _ in range(5):
        gate.admit({}, 1)
    assert rejection(gate).code == "rate_limited"


def test_clock_stepping_back_refills_nothing() -> None:
    gate, clock = gate_for(quota(rate=1.0, burst=1))
    gate.admit({}, 1)
    clock.now -= 10.0
    assert rejection(gate).retry_after_s == 1.0
    clock.now += 1.0
    gate.admit({}, 1)


# -- concurrency slots --------------------------------------------------------------------------


def test_release_returns_the_slot_exactly_once() -> None:
    gate, _ = gate_for(quota(conc=2))
    a = gate.admit({}, 1)
    b = gate.admit({}, 1)
    a.release()
    assert gate.in_flight(DEFAULT_TENANT) == 1
    a.release()  # a second release must not free b's slot
    assert gate.in_flight(DEFAULT_TENANT) == 1
    gate.admit({}, 1)
    assert rejection(gate).code == "too_many_concurrent_requests"
    b.release()
    b.release()
    assert gate.in_flight(DEFAULT_TENANT) == 1


def test_unknown_tenant_has_nothing_in_flight() -> None:
    gate, _ = gate_for(quota())
    assert gate.in_flight("nobody") == 0


def test_threads_admit_exactly_burst_and_release_to_zero() -> None:
    burst = 300
    gate, _ = gate_for(quota(rate=1.0, burst=burst, conc=burst))  # the clock stands still
    tickets: list[Ticket] = []
    refused: list[str] = []
    lock = threading.Lock()

    def worker() -> None:
        for _ in range(100):
            try:
                t = gate.admit({}, 1)
            except Rejected as r:
                with lock:
                    refused.append(r.code)
            else:
                with lock:
                    tickets.append(t)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(tickets) == burst and set(refused) == {"rate_limited"} and len(refused) == 300
    assert gate.in_flight(DEFAULT_TENANT) == burst

    def release_all() -> None:
        for t in tickets:  # every thread releases every ticket: each slot comes back once
            t.release()

    threads = [threading.Thread(target=release_all) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert gate.in_flight(DEFAULT_TENANT) == 0


# -- tenants are isolated -----------------------------------------------------------------------


def test_one_tenants_exhaustion_never_rejects_another() -> None:
    gate, _ = gate_for(
        quota(rate=1.0, burst=2, conc=2),
        KEYS,
        quotas={"beta": quota(rate=1.0, burst=1, conc=1)},
    )
    gate.admit(bearer("k-alpha"), 1)
    gate.admit(bearer("k-alpha"), 1)
    assert rejection(gate, bearer("k-alpha")).code == "rate_limited"
    assert gate.admit(bearer("k-beta"), 1).tenant == "beta"  # beta's own quota
    assert rejection(gate, bearer("k-beta")).code == "rate_limited"
    assert (gate.in_flight("alpha"), gate.in_flight("beta")) == (2, 1)


def test_per_tenant_quota_overrides_default() -> None:
    gate, _ = gate_for(quota(burst=100, conc=100), KEYS, quotas={"alpha": quota(conc=1)})
    gate.admit(bearer("k-alpha"), 1)
    assert rejection(gate, bearer("k-alpha")).code == "too_many_concurrent_requests"
    for _ in range(5):
        gate.admit(bearer("k-beta"), 1)  # beta has the default's 100 slots


# -- the property: an exact model of every tenant's bucket and slots ---------------------------

RATES = [0.5, 1.0, 2.0, 4.0, 8.0]  # dyadic, like the clock steps: the gate's floats are exact

quotas_st = st.builds(
    quota,
    rate=st.sampled_from(RATES),
    burst=st.integers(1, 5),
    conc=st.integers(1, 4),
)
op_st = st.one_of(
    st.tuples(st.just("admit"), st.sampled_from(["alpha", "beta"])),
    st.tuples(st.just("release"), st.integers(0, 40)),
    st.tuples(st.just("tick"), st.integers(0, 96)),  # in 1/64 s
)


@given(qa=quotas_st, qb=quotas_st, ops=st.lists(op_st, max_size=80))
def test_any_interleaving_matches_the_exact_model(
    qa: TenantQuota, qb: TenantQuota, ops: list[tuple[str, object]]
) -> None:
    quotas = {"alpha": qa, "beta": qb}
    gate, clock = gate_for(quota(), KEYS, quotas=quotas)
    now = Fraction(0)
    tokens = {t: Fraction(q.burst) for t, q in quotas.items()}  # each tenant on its own
    stamp = {t: Fraction(0) for t in quotas}
    live = {t: 0 for t in quotas}
    admitted: dict[str, list[Fraction]] = {t: [] for t in quotas}
    tickets: list[tuple[Ticket, bool]] = []  # (ticket, released in the model)
    for op, arg in ops:
        if op == "tick":
            assert isinstance(arg, int)
            now += Fraction(arg, 64)
            clock.now = 1000.0 + float(now)
        elif op == "release":
            assert isinstance(arg, int)
            if tickets:
                i = arg % len(tickets)
                ticket, gone = tickets[i]
                ticket.release()
                if not gone:
                    live[ticket.tenant] -= 1
                    tickets[i] = (ticket, True)
        else:
            tenant = str(arg)
            q = quotas[tenant]
            rate = Fraction(q.requests_per_s)
            tokens[tenant] = min(Fraction(q.burst), tokens[tenant] + (now - stamp[tenant]) * rate)
            stamp[tenant] = now
            try:
                ticket = gate.admit(bearer("k-" + tenant), 1)
            except Rejected as r:
                if tokens[tenant] < 1:
                    assert r.code == "rate_limited"
                    assert r.retry_after_s == (1 - tokens[tenant]) / rate  # exact
                else:
                    assert r.code == "too_many_concurrent_requests"
                    assert live[tenant] == q.max_concurrent
            else:
                assert tokens[tenant] >= 1 and live[tenant] < q.max_concurrent
                tokens[tenant] -= 1
                live[tenant] += 1
                admitted[tenant].append(now)
                tickets.append((ticket, False))
        for tenant, q in quotas.items():
            assert gate.in_flight(tenant) == live[tenant] <= q.max_concurrent
    for tenant, q in quotas.items():
        times = admitted[tenant]
        for i in range(len(times)):  # every window [t_i, t_j]
            for j in range(i, len(times)):
                window = times[j] - times[i]
                assert j - i + 1 <= q.burst + Fraction(q.requests_per_s) * window


# -- config validation names the field ----------------------------------------------------------


def error_locs(exc: ValidationError) -> list[tuple[int | str, ...]]:
    return [tuple(e["loc"]) for e in exc.errors()]


@pytest.mark.parametrize(
    ("data", "loc"),
    [
        ({"requests_per_s": 0, "burst": 1, "max_concurrent": 1}, ("requests_per_s",)),
        ({"requests_per_s": float("inf"), "burst": 1, "max_concurrent": 1}, ("requests_per_s",)),
        ({"requests_per_s": 1, "burst": 0, "max_concurrent": 1}, ("burst",)),
        ({"requests_per_s": 1, "burst": 1, "max_concurrent": 0}, ("max_concurrent",)),
        ({"requests_per_s": 1, "burst": 1, "max_concurrent": 1, "brust": 2}, ("brust",)),
    ],
)
def test_quota_errors_name_the_field(data: dict[str, object], loc: tuple[str, ...]) -> None:
    with pytest.raises(ValidationError) as info:
        TenantQuota.model_validate(data)
    assert error_locs(info.value) == [loc]


@pytest.mark.parametrize(
    ("data", "loc", "says"),
    [
        ({"max_body_bytes": 0}, ("max_body_bytes",), "greater than or equal to 1"),
        ({"api_keys": {"k": "bad tenant"}}, ("api_keys",), "'bad tenant'"),
        ({"api_keys": {"k": "-x"}}, ("api_keys",), "'-x'"),
        ({"api_keys": {"k": "x" * 64}}, ("api_keys",), "1-63"),
        ({"api_keys": {"two words": "a"}}, ("api_keys",), "whitespace"),
        ({"api_keys": {"": "a"}}, ("api_keys",), "empty"),
        ({"quotas": {"a/b": {}}}, ("quotas", "a/b", "requests_per_s"), "Field required"),
        (
            {"quotas": {"a/b": {"requests_per_s": 1, "burst": 1, "max_concurrent": 1}}},
            ("quotas",),
            "'a/b'",
        ),
        (
            {
                "api_keys": {"k": "alpha"},
                "quotas": {"alhpa": {"requests_per_s": 1, "burst": 1, "max_concurrent": 1}},
            },
            ("quotas",),
            "['alhpa']",
        ),
        (
            {"quotas": {"alpha": {"requests_per_s": 1, "burst": 1, "max_concurrent": 1}}},
            ("quotas",),
            "the tenants are ['default']",
        ),
        ({"default_quota": {"requests_per_s": -1}}, ("default_quota", "requests_per_s"), "0"),
        ({"max_body_byte": 5}, ("max_body_byte",), "Extra inputs"),
    ],
)
def test_gate_config_errors_name_the_field(
    data: dict[str, object], loc: tuple[str, ...], says: str
) -> None:
    with pytest.raises(ValidationError) as info:
        GateConfig.model_validate(data)
    assert error_locs(info.value)[0] == loc
    assert says in str(info.value)


def test_api_key_never_appears_in_a_config_error() -> None:
    with pytest.raises(ValidationError) as info:
        GateConfig.model_validate({"api_keys": {"s3cret key": "alpha"}})
    assert "s3cret" not in str(info.value)


def test_tenant_names_accepted() -> None:
    config = GateConfig.model_validate(
        {"api_keys": {"k1": "a", "k2": "team-1.prod_x", "k3": "a"}, "quotas": {"a": quota()}}
    )
    assert set(config.api_keys.values()) == {"a", "team-1.prod_x"}


def test_by_default_a_tenant_has_no_limit_but_is_counted() -> None:
    """No default quota: a flood is the admission queue's to bound (429 queue_full there), not
    the gate's; listed tenants keep theirs."""
    keys = {"key-a": "alice", "key-b": "bob"}
    gate = IngressGate(GateConfig(api_keys=keys, quotas={"bob": quota(1.0, 1, 1)}))
    tickets = [gate.admit(bearer("key-a"), 10) for _ in range(2000)]
    assert gate.in_flight("alice") == 2000
    gate.admit(bearer("key-b"), 10)
    assert rejection(gate, bearer("key-b")).code is RejectCode.RATE_LIMITED
    for ticket in tickets:
        ticket.release()
    assert gate.in_flight("alice") == 0
    assert GateConfig().default_quota is None


def test_unknown_keys_leave_no_state_behind() -> None:
    """The gate keeps state only for tenants its keys name: a flood of made-up bearer keys is
    refused (401) without growing its memory, whatever keys a client sends."""
    gate, _ = gate_for(quota(), KEYS)
    gate.admit(bearer("k-alpha"), 10).release()
    before = dict(gate._tenants)
    for i in range(5000):
        assert rejection(gate, bearer(f"made-up-{i}")).code is RejectCode.INVALID_API_KEY
    assert gate._tenants == before and list(before) == ["alpha"]
