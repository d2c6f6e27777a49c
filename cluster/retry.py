"""Retry policy (docs/design.md#retries-and-migration): bounded by attempts, by a cluster-wide
budget and by the request's deadline, and steered away from what just failed.

The budget is a token bucket shared by every request of one coordinator: each admitted request
adds ``budget_ratio`` tokens (up to ``budget_burst``), each retry spends one. A failure storm then
costs at most ``budget_ratio`` extra attempts per request on average instead of multiplying load
by ``max_attempts`` (the retry-amplification problem).
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
        self, attempts: int, deadline: float | None, now: float | None = None
    ) -> GiveUp | None:
        """None when one more attempt is allowed (and spends a budget token), else why not."""
        if attempts >= self.policy.max_attempts:
            return GiveUp.MAX_ATTEMPTS
        now = time.time() if now is None else now
        if deadline is not None and now + self.policy.backoff_s >= deadline:
            return GiveUp.DEADLINE
        if self.tokens < 1.0:
            return GiveUp.BUDGET
        self.tokens -= 1.0
        return None


@dataclass
class Exclusions:
    """Workers and failure domains a request's next attempt must avoid (never a domain that
    just failed for the retry, when another one can serve)."""

    workers: set[str] = field(default_factory=set)
    domains: set[str] = field(default_factory=set)

    def failed(self, worker: str, domain: str | None) -> None:
        self.workers.add(worker)
        if domain is not None:
            self.domains.add(domain)
