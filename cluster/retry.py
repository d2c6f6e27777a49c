"""Retry policy (docs/design.md#retries-and-migration): bounded by attempts, by a cluster-wide
budget and by the request's deadline, and steered away from what just failed.

The budget is a token bucket shared by every request of one coordinator: each admitted request
adds ``budget_ratio`` tokens (up to ``budget_burst``), each retry before the request's first
token spends one. A failure storm then costs at most ``budget_ratio`` extra attempts per request
on average instead of multiplying load by ``max_attempts`` (the retry-amplification problem).
The migration of a stream that has tokens is not a retry the budget limits: the client is
mid-answer, and only ``max_attempts`` and the deadline bound it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class RetryPolicy(BaseModel):
    """The topology's ``retry`` section."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    max_attempts: int = Field(3, ge=1, description="attempts per request; 1 = no retry")
    budget_ratio: float = Field(
        0.2, ge=0, description="retries allowed per admitted request (token bucket refill)"
    )
    budget_burst: float = Field(
        10.0, ge=0, description="most retry tokens the bucket holds (a burst of failures)"
    )
    deadline_s: float | None = Field(
        None,
        gt=0,
        description="default deadline of a request, seconds, over all attempts (queueing "
        "included); None: none, as vLLM and OpenAI (a client sets one with X-Request-Timeout "
        "or the body's timeout)",
    )
    backoff_s: float = Field(
        0.05, ge=0, description="wait before a retry, seconds (lets a failure be noticed)"
    )


class GiveUp(StrEnum):
    """Why a failed request is not retried."""

    MAX_ATTEMPTS = "max_attempts reached"
    DEADLINE = "deadline passed"
    BUDGET = "retry budget spent"


class RetriesExhausted(RuntimeError):
    """A request failed and may not be retried: ``why`` (attempts, deadline or budget spent),
    ``attempts`` how many ran, ``cause`` what the last one died of, ``rejected`` whether it
    ended for want of KV room (an engine's admission refused it)."""

    def __init__(
        self, request_id: str, why: GiveUp, attempts: int, cause: str, rejected: bool = False
    ) -> None:
        super().__init__(f"request {request_id}: {why} after {attempts} attempt(s): {cause}")
        self.request_id = request_id
        self.why = why
        self.attempts = attempts
        self.cause = cause
        self.rejected = rejected

    def __reduce__(self) -> tuple[Any, ...]:  # keeps its fields across Ray and pickling
        return (type(self), (self.request_id, self.why, self.attempts, self.cause, self.rejected))


@dataclass
class RetryBudget:
    policy: RetryPolicy
    tokens: float = field(init=False)

    def __post_init__(self) -> None:
        self.tokens = self.policy.budget_burst

    def admitted(self) -> None:
        self.tokens = min(self.policy.budget_burst, self.tokens + self.policy.budget_ratio)

    def may_retry(
        self,
        attempts: int,
        deadline: float | None,
        started: bool = False,
        now: float | None = None,
    ) -> GiveUp | None:
        """None when one more attempt is allowed, else why not. A retry before the first token
        spends a budget token; the migration of a ``started`` stream neither needs nor spends
        one (the budget stops retry storms; it must not strand a client mid-answer)."""
        if attempts >= self.policy.max_attempts:
            return GiveUp.MAX_ATTEMPTS
        now = time.time() if now is None else now
        if deadline is not None and now + self.policy.backoff_s >= deadline:
            return GiveUp.DEADLINE
        if started:
            return None
        if self.tokens < 1.0:
            return GiveUp.BUDGET
        self.tokens -= 1.0
        return None


@dataclass
class Exclusions:
    """What a request's next attempt must avoid: workers that failed it (refused it, broke
    its transfer), and the failure domains where a worker died (a soft preference: the router
    uses such a domain again when nothing elsewhere is healthy). A dead worker is not excluded
    by name: the router keeps it out while it is FAILED, and once back it is a new process."""

    workers: set[str] = field(default_factory=set)
    domains: set[str] = field(default_factory=set)
    # The numerics class of the workers whose tokens the client has: a migration stays in it
    # (its continuation the same bits as the fault-free stream's; "" before any token).
    numerics: str = ""

    def failed(self, worker: str) -> None:
        self.workers.add(worker)

    def died(self, domain: str | None) -> None:
        if domain is not None:
            self.domains.add(domain)
