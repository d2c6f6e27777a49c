"""Retry policy (P6, P7) and the fault-injection plan, as units."""

from __future__ import annotations

import pytest

from cluster.retry import Exclusions, GiveUp, RetryBudget, RetryPolicy
from contracts.faults import Fault, FaultAction, FaultInjected, FaultPlan, FaultPoint


def test_attempts_bound_retries() -> None:
    budget = RetryBudget(RetryPolicy(max_attempts=3, budget_burst=100))
    assert budget.may_retry(1, None) is None
    assert budget.may_retry(2, None) is None
    assert budget.may_retry(3, None) is GiveUp.MAX_ATTEMPTS
    assert RetryBudget(RetryPolicy(max_attempts=1)).may_retry(1, None) is GiveUp.MAX_ATTEMPTS


def test_deadline_bounds_retries() -> None:
    budget = RetryBudget(RetryPolicy(max_attempts=5, backoff_s=1.0))
    assert budget.may_retry(1, deadline=100.0, now=98.0) is None
    assert budget.may_retry(1, deadline=100.0, now=99.5) is GiveUp.DEADLINE


def test_budget_caps_retries_to_a_share_of_admitted_requests() -> None:
    """A failure storm: every request fails once. With ratio 0.2 and burst 2, at most
    2 + 0.2 * admitted retries happen, not one per request."""
    budget = RetryBudget(RetryPolicy(max_attempts=10, budget_ratio=0.2, budget_burst=2.0))
    retried = 0
    for _ in range(100):
        budget.admitted()
        retried += budget.may_retry(1, None) is None
    assert retried == 2 + 19  # the burst of 2, then one per five admitted (the 6th, 11th, ..)
    assert budget.may_retry(1, None) is GiveUp.BUDGET


def test_a_started_stream_migrates_with_the_budget_spent_and_spends_none() -> None:
    """The budget limits retries before the first token, never a started stream's migration;
    max_attempts and the deadline still bound both."""
    budget = RetryBudget(RetryPolicy(max_attempts=3, budget_burst=1.0, backoff_s=1.0))
    assert budget.may_retry(1, None) is None  # spends the only token
    assert budget.may_retry(1, None) is GiveUp.BUDGET
    assert budget.may_retry(1, None, started=True) is None
    assert budget.tokens == 0.0
    assert budget.may_retry(3, None, started=True) is GiveUp.MAX_ATTEMPTS
    assert budget.may_retry(1, 100.0, started=True, now=99.5) is GiveUp.DEADLINE
    budget.admitted()
    assert budget.tokens == 0.2  # a migration took nothing from what refills


def test_exclusions_keep_failing_workers_and_dead_domains() -> None:
    ex = Exclusions()
    ex.died("a")
    ex.failed("decode-1")
    ex.died(None)  # a worker of no known domain
    assert ex.workers == {"decode-1"} and ex.domains == {"a"}


def test_a_fault_fires_once_at_its_count_and_attempt() -> None:
    plan = FaultPlan([Fault(FaultPoint.DECODE_TOKENS, FaultAction.RAISE, at=3, attempt=2)])
    assert plan.check(FaultPoint.DECODE_TOKENS, attempt=1, count=5) is None
    assert plan.check(FaultPoint.DECODE_TOKENS, attempt=2, count=2) is None
    assert plan.check(FaultPoint.PREFILL_LAYERS, attempt=2, count=9) is None
    with pytest.raises(FaultInjected):
        plan.check(FaultPoint.DECODE_TOKENS, attempt=2, count=3)
    assert plan.check(FaultPoint.DECODE_TOKENS, attempt=2, count=4) is None  # fired already


def test_data_faults_are_returned_to_the_transport() -> None:
    plan = FaultPlan([Fault(FaultPoint.TRANSFER_CHUNK, FaultAction.CORRUPT, at=1)])
    assert plan.check(FaultPoint.TRANSFER_CHUNK, attempt=1, count=0) is None
    fault = plan.check(FaultPoint.TRANSFER_CHUNK, attempt=1, count=1)
    assert fault is not None and fault.action is FaultAction.CORRUPT
