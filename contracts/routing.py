"""Routing messages: what the coordinator asks the router, what it answers, and the router's
view of each worker (``worker_states``). Free of Ray and torch: the router's policy and its
benchmark build them directly."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, NamedTuple

from contracts.messages import WorkerInfo, WorkerLoad
from contracts.roles import Role


class Mode(StrEnum):
    DISAGGREGATED = "disaggregated"
    LOCAL_PREFILL = "local_prefill"
    COLOCATED = "colocated"


class Refusal(StrEnum):
    """Why the cluster's admission refused a request before any work (docs/design.md#admission):
    each is an HTTP status with ``Retry-After`` at the edge, never a truncated stream."""

    QUEUE_FULL = "queue_full"  # the admission queue holds its bound already (429)
    WAIT_EXCEEDS_DEADLINE = "queue_wait_exceeds_deadline"  # predicted wait > time left (503)
    DEADLINE_PASSED = "deadline_passed_in_queue"  # it waited until its deadline (504)
    UNAVAILABLE = "no_replica_available"  # nothing could serve it for too long (503)


# The Retry-After of a request refused because nothing could serve it (UNAVAILABLE): workers
# and the router restart in seconds.
UNAVAILABLE_RETRY_AFTER_S = 5.0


class AdmissionRefused(RuntimeError):
    """The router's admission queue refused ``request_id`` (``reason``); ``retry_after_s`` is
    when trying again has a chance (None: do not)."""

    def __init__(
        self, request_id: str, reason: Refusal, detail: str, retry_after_s: float | None
    ) -> None:
        super().__init__(f"request {request_id!r} refused ({reason.value}): {detail}")
        self.request_id = request_id
        self.reason = reason
        self.detail = detail
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple[Any, ...]:  # crosses Ray actor boundaries
        return (type(self), (self.request_id, self.reason, self.detail, self.retry_after_s))


class NoReplicaAvailable(RuntimeError):
    """No replica of ``pool`` may serve the request; ``reasons`` says why for each worker of
    the pool (empty when the pool has no workers at all)."""

    def __init__(self, pool: str, request_id: str, reasons: dict[str, str]) -> None:
        why = ", ".join(f"{name} {reason}" for name, reason in sorted(reasons.items()))
        super().__init__(
            f"no {pool} replica for request {request_id!r}: {why or 'the pool has no workers'}"
        )
        self.pool = pool
        self.request_id = request_id
        self.reasons = reasons

    def __reduce__(self) -> tuple[Any, ...]:  # crosses Ray actor boundaries
        return (type(self), (self.pool, self.request_id, self.reasons))


class DetectedBy(StrEnum):
    """How the router found a worker FAILED (``tandem_worker_failures_detected_total``)."""

    RESTART = "restart"  # a new process announced itself under the name
    ACTOR_DEATH = "actor_death"  # a coordinator saw the actor die and reported it
    HEARTBEAT = "heartbeat"  # its reports stopped for the heartbeat timeout, a probe unanswered
    PROBE = "probe"  # a direct probe failed (dead, unresponsive engine, or silent to a new router)


@dataclass(slots=True)
class WorkerState:
    """What the router knows of one worker: its last announcement and load report as they
    came (the actor replaces them on each report), and what the router adds -- health, and the
    admission ledger's grants the worker has not reported yet. ``choose`` only reads it."""

    info: WorkerInfo  # its identity, block size and engine limits
    report: WorkerLoad  # its queue, running requests and KV use
    healthy: bool = True  # reported, and not FAILED: it takes traffic
    failed: bool = False  # FAILED (reported dead or silent) until its health check readmits it
    # Admission (router/admission.py): what the router granted that the worker has not
    # reported yet.
    promised_seqs: int = 0
    promised_blocks: int = 0
    cached_blocks: int = 0  # prefix-cache blocks the router's index credits it with

    @classmethod
    def unreported(cls, name: str, role: Role, domain: str, block_size: int = 16) -> WorkerState:
        """A worker not heard from yet: no traffic (not healthy), idle, and unlimited in what
        it has not told (its first report brings its limits). 16: EngineConfig's block size."""
        info = WorkerInfo(
            name,
            role,
            domain,
            kv_address=None,
            block_size=block_size,
            incarnation="",
            max_model_len=1_000_000_000,
            max_num_seqs=1_000_000,
            num_kv_blocks=1_000_000_000,
        )
        return cls(info, WorkerLoad(name, "", queue_depth=0, num_running=0, kv_usage=0.0), False)

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def role(self) -> Role:
        return self.info.role

    @property
    def domain(self) -> str:
        return self.info.domain

    @property
    def load(self) -> int:
        """Requests ahead of a new one here: queued, running, and granted but not yet seen."""
        return self.report.queue_depth + self.report.num_running + self.promised_seqs

    @property
    def free_seqs(self) -> int:
        return self.info.max_num_seqs - self.load

    @property
    def free_blocks(self) -> int:
        return self.info.num_kv_blocks - self.report.claimed_blocks - self.promised_blocks


HOLD_RENEW_S = 1.0  # how often a coordinator renews its hold on its grants


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """One routing question. The exclusions carry a retry's history: never the worker or the
    failure domain that just failed it."""

    request_id: str  # the attempt's key (EngineRequest.key): grants are per attempt
    prompt_hashes: Sequence[int]  # engine.kv_cache_manager.prefix_hashes of the prompt
    num_prompt_tokens: int  # tokens whose KV is computed: the prompt + num_resumed_tokens
    exclude_workers: frozenset[str] = frozenset()
    exclude_domains: frozenset[str] = frozenset()
    # Admission (router/admission.py): what the KV reservation, the queue order and the
    # refusals need to know.
    max_tokens: int = 1  # the request's output limit (resumed tokens included)
    num_resumed_tokens: int = 0  # output the client already has: a started stream
    priority: int = 0  # lower is served first (as vLLM's)
    tenant: str = ""
    deadline: float | None = None  # absolute time.time()
    client_request_id: str = ""  # the client request it is an attempt of (the decision log's)
    # The coordinator that holds the grant: it renews its hold (RouterActor.hold) every
    # HOLD_RENEW_S; a grant whose holder fell silent is released ("": held until released).
    holder: str = ""
    # The numerics class every replica must be of: that of the workers whose tokens the client
    # already has (a migration keeps the stream's bits); "" any.
    numerics: str = ""
    # A later choice of an n > 1 request: the decode worker holding its first choice's prompt
    # KV. Eligible there, it prefills locally on the prompt's cached blocks (one prefill for
    # the n choices, the prompt's blocks shared); otherwise it is routed as any request.
    share_decode: str | None = None

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 1:
            raise ValueError(
                f"request {self.request_id!r}: num_prompt_tokens={self.num_prompt_tokens}: "
                "must be >= 1"
            )
        if not 0 <= self.num_resumed_tokens < self.num_prompt_tokens:
            raise ValueError(
                f"request {self.request_id!r}: num_resumed_tokens={self.num_resumed_tokens} of "
                f"num_prompt_tokens={self.num_prompt_tokens}"
            )

    @property
    def started(self) -> bool:
        """Its client has tokens already (a migration): never refused, first in the queue."""
        return self.num_resumed_tokens > 0


class Score(NamedTuple):
    """One candidate's cost, term by term (``total`` is their sum). Cache fields are 0 for a
    disaggregated decode candidate, which computes none of the prompt. A tuple: ``choose``
    builds one per candidate per request, and a frozen dataclass costs ~10x more to build."""

    name: str
    role: Role
    domain: str
    load: int
    hit_blocks: int  # leading prompt blocks the index says it holds
    credited_blocks: int  # what the cost counted: capped, 0 if herded
    herded: bool
    uncached_tokens: int
    queue: float
    uncached: float
    kv: float
    spread: float
    total: float

    def as_dict(self) -> dict[str, Any]:
        return {**self._asdict(), "role": self.role.value}


@dataclass(frozen=True, slots=True)
class Decision:
    """The replicas for one request. ``prefill`` is None when ``decode`` computes the prompt
    itself (local_prefill, colocated)."""

    request_id: str
    mode: Mode
    prefill: str | None
    decode: str
    hit_blocks: int  # of the replica that computes the prompt
    uncached_tokens: int  # what that replica computes
    scores: tuple[Score, ...]  # every candidate considered: by stage, in the workers' order
    skipped: dict[str, str] = field(default_factory=dict)  # worker -> why it was not eligible

    def log_line(self) -> dict[str, Any]:
        """One JSON-able record: the choice and every candidate's terms."""
        return {
            "request_id": self.request_id,
            "mode": self.mode.value,
            "prefill": self.prefill,
            "decode": self.decode,
            "hit_blocks": self.hit_blocks,
            "uncached_tokens": self.uncached_tokens,
            "candidates": [score.as_dict() for score in self.scores],
            "skipped": dict(self.skipped),
        }
