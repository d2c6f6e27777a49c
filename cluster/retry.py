"""Retry policy (PROMISES P6, P7): bounded by attempts, by a cluster-wide budget and by the
request's deadline, and steered away from what just failed.

The budget is a token bucket shared by every request of one coordinator: each admitted request
adds ``budget_ratio`` tokens (up to ``budget_burst``), each retry spends one. A failure storm then
costs at most ``budget_ratio`` extra attempts per request on average instead of multiplying load
by ``max_attempts`` (the retry-amplification problem).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


class RetriesExhausted(RuntimeError):
    """A request failed and may not be retried (attempts, budget or deadline spent, or retries
    off). ``attempts`` tells how many ran; ``cause`` what the last one died of."""

    def __init__(
        self, request_id: str, why: str, attempts: int, cause: str, rejected: bool = False
    ) -> None:
        super().__init__(f"request {request_id}: {why} after {attempts} attempt(s): {cause}")
        self.request_id = request_id
        self.why = why
        self.attempts = attempts
        self.cause = cause
        self.rejected = rejected  # it ended for want of KV room (an engine's admission)

    def __reduce__(self) -> tuple[Any, ...]:  # keeps its fields across Ray and pickling
        return (type(self), (self.request_id, self.why, self.attempts, self.cause, self.rejected))


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 3  # 1 = no retry
    budget_ratio: float = 0.2
    budget_burst: float = 10.0
    backoff_s: float = 0.0


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
    ) -> str | None:
        """None when one more attempt is allowed (and spends a budget token), else why not."""
        if attempts >= self.policy.max_attempts:
            return f"max_attempts={self.policy.max_attempts} reached"
        now = time.time() if now is None else now
        if deadline is not None and now + self.policy.backoff_s >= deadline:
            return "deadline passed"
        if self.tokens < 1.0:
            return "retry budget spent"
        self.tokens -= 1.0
        return None


@dataclass
class Exclusions:
    """Workers and failure domains a request's next attempt must avoid (P7: never a domain that
    just failed for the retry, when another one can serve)."""

    workers: set[str] = field(default_factory=set)
    domains: set[str] = field(default_factory=set)

    def failed(self, worker: str, domain: str | None) -> None:
        self.workers.add(worker)
        if domain is not None:
            self.domains.add(domain)
