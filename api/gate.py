"""Phase-1 admission (docs/design.md#admission): the coarse checks an HTTP request passes before
tokenising.

Only what is known from the headers and the body size is judged here, cheapest first: body
size (413), API key (401), the tenant's token bucket (429) and its concurrency limit (429).
The exact KV / token-budget judgement is phase 2, in the engine's scheduler.

Nothing is taken unless every check passes: the bucket is checked, then concurrency, and only
then are a token and a slot taken, so a request refused for concurrency costs no token. State
exists only for tenants that got past the key check, so memory is bounded by the configured
tenants whatever keys clients send.

The tenant is also the prefix-cache salt downstream (P10), which is why every request has one:
with auth off, everyone is the tenant ``default``.
"""

from __future__ import annotations

import hashlib
import math
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pydantic import ConfigDict, Field, ValidationInfo, field_validator

from engine.config import ConfigSection

DEFAULT_TENANT = "default"  # every request's tenant when auth is off
CONCURRENCY_RETRY_AFTER_S = 1.0  # a slot frees when some request ends: no exact time exists

# Tenant names become cache salts, log fields and possibly metric labels: keep them to a
# plain, printable syntax (the Kubernetes label-value one, as topology domains use).
_TENANT_RE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?")
_BEARER_RE = re.compile(r"bearer[ \t]+(\S+)[ \t]*", re.IGNORECASE)


def _check_tenant(name: str) -> str:
    if not _TENANT_RE.fullmatch(name):
        raise ValueError(
            f"tenant name {name!r} must be 1-63 of [A-Za-z0-9_.-], alphanumeric at both ends"
        )
    return name


def _key_digest(key: str) -> bytes:
    """Keys are looked up by digest, so the lookup's timing says nothing about a real key."""
    return hashlib.sha256(key.encode()).digest()


class TenantQuota(ConfigSection):
    requests_per_s: float = Field(gt=0, description="token-bucket refill rate")
    burst: int = Field(ge=1, description="token-bucket size: requests admitted back to back")
    max_concurrent: int = Field(ge=1, description="requests of the tenant in flight at once")


class GateConfig(ConfigSection):
    """The ``serve:`` section's admission part: how large a request may be and who may send
    it. Its errors never show input values, which could be API keys; the field path names what
    was wrong."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", allow_inf_nan=False, hide_input_in_errors=True
    )

    max_body_bytes: int = Field(2**20, ge=1, description="largest request body accepted")
    max_choices: int = Field(
        64,
        ge=1,
        description="most choices one request may ask for: its prompts x n, each one request "
        "to the cluster (an admission-queue place, a prefill, a decode); checked once the body "
        "is parsed, before tokenising (400 naming prompt, or n). 64: 4 prompts at the largest "
        "n, and a small part of the admission queue (router.admission.max_queued), so one HTTP "
        "request cannot fill it",
    )
    api_keys: dict[str, str] = Field(
        default_factory=dict,
        description="API key -> tenant name; empty = auth off, every request is tenant "
        f"{DEFAULT_TENANT!r}",
    )
    quotas: dict[str, TenantQuota] = Field(
        default_factory=dict, description="per tenant; tenants not listed get default_quota"
    )
    default_quota: TenantQuota | None = Field(
        None,
        description="the quota of tenants not in quotas; None: no per-tenant limit (the "
        "cluster's admission queue bounds the load: router.admission)",
    )

    @field_validator("api_keys")
    @classmethod
    def _check_api_keys(cls, keys: dict[str, str]) -> dict[str, str]:
        for key, tenant in keys.items():
            # Show the key's length only: the message may end up in a log.
            if not key or any(c.isspace() for c in key) or not key.isprintable():
                raise ValueError(
                    f"an API key (of {len(key)} chars, tenant {tenant!r}) is empty or has "
                    "whitespace or unprintable characters: it could never arrive as a Bearer token"
                )
            _check_tenant(tenant)
        return keys

    @field_validator("quotas")
    @classmethod
    def _check_quota_names(
        cls, quotas: dict[str, TenantQuota], info: ValidationInfo
    ) -> dict[str, TenantQuota]:
        for tenant in quotas:
            _check_tenant(tenant)
        if "api_keys" not in info.data:  # api_keys itself was wrong; that error says so
            return quotas
        keys: dict[str, str] = info.data["api_keys"]
        known = set(keys.values()) if keys else {DEFAULT_TENANT}
        unknown = sorted(set(quotas) - known)
        if unknown:
            raise ValueError(
                f"names tenants {unknown} that no request can have; the tenants are {sorted(known)}"
            )
        return quotas


class RejectCode(StrEnum):
    INVALID_API_KEY = "invalid_api_key"
    BODY_TOO_LARGE = "body_too_large"
    RATE_LIMITED = "rate_limited"
    TOO_MANY_CONCURRENT_REQUESTS = "too_many_concurrent_requests"


class Rejected(Exception):
    """A refused request: the HTTP status, an OpenAI-style error code and a message that says
    what was wrong and the limit. ``retry_after_s`` is set for 429 only."""

    def __init__(
        self, status: int, code: RejectCode, message: str, retry_after_s: float | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        """Response headers: ``Retry-After`` in whole seconds (RFC 9110), rounded up."""
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}

    def __reduce__(self) -> tuple[Any, ...]:  # may cross a Ray boundary
        return (Rejected, (self.status, self.code, self.message, self.retry_after_s))


@dataclass
class _TenantState:
    tokens: float  # in the bucket, up to burst
    stamp: float  # clock reading the tokens were computed at
    in_flight: int = 0


class Ticket:
    """An admitted request's hold on one concurrency slot of its tenant."""

    def __init__(self, gate: IngressGate, tenant: str) -> None:
        self.tenant = tenant
        self._gate = gate
        self._released = False

    def release(self) -> None:
        """Return the slot; only the first call does anything."""
        self._gate._release(self)


class IngressGate:
    """Phase-1 admission for one HTTP ingress; thread-safe (one lock over all tenants)."""

    def __init__(self, config: GateConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._tenant_of = {_key_digest(k): t for k, t in config.api_keys.items()}
        self._lock = threading.Lock()
        self._tenants: dict[str, _TenantState] = {}

    def admit(self, headers: Mapping[str, str], body_size: int) -> Ticket:
        """Admit a request or raise ``Rejected``; the caller must ``release()`` the ticket when
        the request ends, however it ends."""
        limit = self.config.max_body_bytes
        if body_size > limit:
            raise Rejected(
                413,
                RejectCode.BODY_TOO_LARGE,
                f"request body is {body_size} bytes, more than max_body_bytes={limit}",
            )
        tenant = self._authenticate(headers)
        quota = self.config.quotas.get(tenant, self.config.default_quota)
        with self._lock:
            now = self._clock()
            state = self._tenants.get(tenant)
            if quota is None:  # unlimited: only counted
                state = state or self._tenants.setdefault(tenant, _TenantState(0.0, now))
                state.in_flight += 1
                return Ticket(self, tenant)
            if state is None:
                state = self._tenants[tenant] = _TenantState(tokens=float(quota.burst), stamp=now)
            # A clock that steps back (an injected one may) refills nothing.
            elapsed = max(0.0, now - state.stamp)
            state.tokens = min(float(quota.burst), state.tokens + elapsed * quota.requests_per_s)
            state.stamp = now
            if state.tokens < 1.0:
                raise Rejected(
                    429,
                    RejectCode.RATE_LIMITED,
                    f"tenant {tenant!r} is over its rate of {quota.requests_per_s:g} requests/s "
                    f"(burst {quota.burst})",
                    retry_after_s=(1.0 - state.tokens) / quota.requests_per_s,
                )
            if state.in_flight >= quota.max_concurrent:
                raise Rejected(
                    429,
                    RejectCode.TOO_MANY_CONCURRENT_REQUESTS,
                    f"tenant {tenant!r} already has {state.in_flight} requests in flight, "
                    f"max_concurrent={quota.max_concurrent}",
                    retry_after_s=CONCURRENCY_RETRY_AFTER_S,
                )
            state.tokens -= 1.0
            state.in_flight += 1
        return Ticket(self, tenant)

    def in_flight(self, tenant: str) -> int:
        """Admitted, unreleased requests of ``tenant`` (0 for one never seen)."""
        with self._lock:
            state = self._tenants.get(tenant)
            return 0 if state is None else state.in_flight

    def _authenticate(self, headers: Mapping[str, str]) -> str:
        if not self._tenant_of:
            return DEFAULT_TENANT
        values = [v for k, v in headers.items() if k.lower() == "authorization"]
        if len(values) != 1:
            what = "no" if not values else f"{len(values)}"
            raise Rejected(
                401,
                RejectCode.INVALID_API_KEY,
                f"expected one 'Authorization: Bearer <key>' header, got {what}",
            )
        match = _BEARER_RE.fullmatch(values[0])
        if match is None:
            raise Rejected(
                401,
                RejectCode.INVALID_API_KEY,
                "the Authorization header must be 'Bearer <key>'",
            )
        tenant = self._tenant_of.get(_key_digest(match.group(1)))
        if tenant is None:
            raise Rejected(401, RejectCode.INVALID_API_KEY, "the API key is not recognised")
        return tenant

    def _release(self, ticket: Ticket) -> None:
        with self._lock:
            if ticket._released:
                return
            ticket._released = True
            self._tenants[ticket.tenant].in_flight -= 1
