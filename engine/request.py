"""The request and its state machine (docs/design.md#request-states) — the one place that defines
both.

::

    QUEUED ──> RUNNABLE ──> PREFILLING ──> DECODING <──> BACKPRESSURED
      │  ╲         ^            │   ^          │
      │   DEGRADED │            v   │          v
      │            └──── PREEMPTED / SWAPPED <─┘
      └──> WAITING_FOR_KV ──> DECODING            (disaggregated decode side)
    prefill side: DECODING ──> FINISHED (HANDED_OFF) after the first token, KV kept under a lease

    any non-terminal ──> CANCELLED | TIMED_OUT | FAILED
    PREFILLING | DECODING | BACKPRESSURED ──> FINISHED
    QUEUED | DEGRADED ──> REJECTED

Only the scheduler (or the worker that owns the request) calls :meth:`Request.transition`.
Terminal records are written by the one reclaim routine (``Scheduler.reclaim``).
"""

from __future__ import annotations

import enum
import itertools
import secrets
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Generic, TypeVar, overload

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # engine.outputs imports FinishReason from here
    from engine.outputs import SamplingSnapshot


class IllegalTransition(RuntimeError):
    """A state change that the docs/design.md#request-states state machine does not allow."""


class RequestStatus(enum.Enum):
    QUEUED = "queued"  # admitted with a KV *reservation*; no physical blocks
    DEGRADED = "degraded"  # admitted with a smaller reservation than asked
    RUNNABLE = "runnable"  # picked by a tick; reservation turned into physical blocks
    PREFILLING = "prefilling"
    DECODING = "decoding"
    PREEMPTED = "preempted"  # KV dropped; will recompute
    SWAPPED = "swapped"  # KV moved to host memory
    BACKPRESSURED = "backpressured"  # client reads slower than we generate
    WAITING_FOR_KV = "waiting_for_kv"  # decode side: blocks reserved, KV in flight
    FINISHED = "finished"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"
    FAILED = "failed"
    REJECTED = "rejected"

    # Members are singletons: identity hashes them as well as Enum's hash of the name, which
    # is Python code (statuses are looked up in sets several times per sequence per step).
    __hash__ = object.__hash__

    @property
    def is_terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset(
    {
        RequestStatus.FINISHED,
        RequestStatus.CANCELLED,
        RequestStatus.TIMED_OUT,
        RequestStatus.FAILED,
        RequestStatus.REJECTED,
    }
)

S = RequestStatus
_ABORTS = {S.CANCELLED, S.TIMED_OUT, S.FAILED}
ALLOWED_TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = {
    S.QUEUED: frozenset({S.RUNNABLE, S.DEGRADED, S.WAITING_FOR_KV, S.REJECTED, *_ABORTS}),
    S.DEGRADED: frozenset({S.RUNNABLE, S.REJECTED, *_ABORTS}),
    S.RUNNABLE: frozenset({S.PREFILLING, S.PREEMPTED, S.SWAPPED, *_ABORTS}),
    S.PREFILLING: frozenset(
        {S.PREFILLING, S.DECODING, S.PREEMPTED, S.SWAPPED, S.FINISHED, *_ABORTS}
    ),
    S.DECODING: frozenset({S.BACKPRESSURED, S.PREEMPTED, S.SWAPPED, S.FINISHED, *_ABORTS}),
    S.BACKPRESSURED: frozenset({S.DECODING, S.PREEMPTED, S.SWAPPED, S.FINISHED, *_ABORTS}),
    S.PREEMPTED: frozenset({S.RUNNABLE, *_ABORTS}),
    S.SWAPPED: frozenset({S.RUNNABLE, *_ABORTS}),
    S.WAITING_FOR_KV: frozenset({S.DECODING, S.RUNNABLE, *_ABORTS}),
    S.FINISHED: frozenset(),
    S.CANCELLED: frozenset(),
    S.TIMED_OUT: frozenset(),
    S.FAILED: frozenset(),
    S.REJECTED: frozenset(),
}
del S


class FinishReason(enum.Enum):
    EOS = "eos"
    STOP_TOKEN = "stop_token"
    STOP_STRING = "stop_string"
    MAX_TOKENS = "max_tokens"
    CONTEXT_LIMIT = "context_limit"
    CANCELLED = "cancelled"
    DEADLINE = "deadline"
    ERROR = "error"
    REJECTED = "rejected"
    # Disaggregated prefill side: the first token is out and the KV is leased to a decode
    # worker, which continues the request. Never reaches a client.
    HANDED_OFF = "handed_off"

    @property
    def status(self) -> RequestStatus:
        """The terminal status a request ending for this reason enters."""
        return _REASON_STATUS.get(self, RequestStatus.FINISHED)


_REASON_STATUS = {
    FinishReason.CANCELLED: RequestStatus.CANCELLED,
    FinishReason.DEADLINE: RequestStatus.TIMED_OUT,
    FinishReason.ERROR: RequestStatus.FAILED,
    FinishReason.REJECTED: RequestStatus.REJECTED,
}


@dataclass
class RequestTimes:
    """Wall-clock stamps (``time.time()``) of one request; metrics derive from these
    (docs/design.md#metrics)."""

    arrival: float
    queued: float | None = None
    first_scheduled: float | None = None
    first_token: float | None = None
    emits: list[float] = field(default_factory=list)
    finished: float | None = None


@dataclass
class SpecStats:
    """Seed §7's accounting of speculation (docs/design.md#speculative-decoding), for one
    request or one engine: verification steps that carried drafts, draft tokens verified, and
    those accepted (equal to the token drawn at their place)."""

    num_steps: int = 0
    num_drafted: int = 0
    num_accepted: int = 0

    def add(self, drafted: int, accepted: int) -> None:
        self.num_steps += 1
        self.num_drafted += drafted
        self.num_accepted += accepted

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted draft tokens (0 when nothing was drafted)."""
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification step commits on average: its accepted drafts plus the token it
        draws itself (1 when nothing was drafted)."""
        return 1 + self.num_accepted / self.num_steps if self.num_steps else 1.0


@dataclass(frozen=True)
class TerminalRecord:
    """Exactly one per request (docs/design.md#cleanup): what billing and logs read."""

    request_id: str
    status: RequestStatus
    finish_reason: FinishReason
    num_prompt_tokens: int
    num_generated: int  # tokens the sampler produced (incl. ones cut by a stop string)
    num_committed: int  # tokens kept in the output sequence (the billable count)
    num_emitted: int  # tokens whose text reached the client
    arrival: float
    first_token: float | None
    finished: float
    error: str | None = None
    queue_time_s: float | None = None  # queued -> first scheduled; None if never scheduled
    speculation: SpecStats | None = None  # its drafts, when it speculated


R = TypeVar("R")
RECORDS_KEPT = 10_000


class RecordLog(Generic[R]):
    """The latest terminal records, oldest first, bounded: a long-running server keeps only
    the last ``keep`` (the ingress counts and logs each request's record as it ends; these
    are for inspection). ``total`` counts every record ever appended: a cursor for readers
    that copy the new ones."""

    def __init__(self, keep: int | None = None) -> None:
        self._items: deque[R] = deque(maxlen=RECORDS_KEPT if keep is None else keep)
        self.total = 0

    def append(self, record: R) -> None:
        self._items.append(record)
        self.total += 1

    def since(self, seen_total: int) -> list[R]:
        """The records appended after the first ``seen_total`` (those still kept)."""
        n = max(0, min(self.total - seen_total, len(self._items)))
        return list(itertools.islice(reversed(self._items), n))[::-1]

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[R]:
        return iter(self._items)

    def __reversed__(self) -> Iterator[R]:
        return reversed(self._items)

    @overload
    def __getitem__(self, key: int) -> R: ...
    @overload
    def __getitem__(self, key: slice) -> list[R]: ...
    def __getitem__(self, key: int | slice) -> R | list[R]:
        return self._items[key] if isinstance(key, int) else list(self._items)[key]


def fork_id(parent_id: str, index: int) -> str:
    """The engine's id of sample ``index`` (>= 1) of an n > 1 request (the parent is sample 0)."""
    return f"{parent_id}#{index}"


@dataclass(frozen=True)
class EngineRequest:
    """One request as every engine entry point takes it, built once per attempt (the HTTP
    edge builds it per choice, the coordinator per attempt, the offline API per prompt).

    Its ids are fields, never parsed out of a string: ``request_id`` is the client request's
    id, ``choice`` which of the response's choices it is, ``attempt`` which of the cluster's
    tries (0 outside a cluster); :attr:`key` is the engine's id for it, built from them.
    ``cache_salt`` is the tenant: it isolates prefix-cache hits (docs/design.md#prefix-caching,
    P10) and is what the router's per-tenant admission share counts.

    The hand-off data: ``prefill_only`` ends the request HANDED_OFF after its first token with
    its KV leased (a prefill worker); a migrated attempt carries the tokens its client already
    has as ``resume_output`` (recomputed with the prompt, counted as output) and the sampler
    state after them as ``sampler_snapshot``, so it continues exactly; ``snapshots`` attaches
    the sampler state to each of its deltas (what a later migration resumes from).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    choice: int = 0
    attempt: int = 0
    cache_salt: str = ""
    priority: int = 0  # lower runs first (the engine's priority policy, the router's queue)
    deadline: float | None = None  # absolute time.time() covering every attempt
    arrival_time: float | None = None  # time.time() the client's request came; None: now
    prefill_only: bool = False
    resume_output: tuple[int, ...] = ()
    sampler_snapshot: SamplingSnapshot | None = None
    snapshots: bool = False

    @property
    def key(self) -> str:
        """The engine's id of this request, built from the ids: ``<request_id>[/<choice>]
        [@<attempt>]`` (the parts that are not 0), so each attempt's is fresh: a retry never
        meets the attempt it replaces, and a late message of a dead attempt matches nothing."""
        choice = f"/{self.choice}" if self.choice else ""
        attempt = f"@{self.attempt}" if self.attempt else ""
        return f"{self.request_id}{choice}{attempt}"

    @property
    def num_kv_tokens(self) -> int:
        """Positions whose KV a prefill computes: the prompt plus the resumed output."""
        return len(self.prompt_token_ids) + len(self.resume_output)


@dataclass(eq=False)  # identity: queues test membership, and field-wise == would be O(tokens)
class Request:
    """One sequence being served. Token counting, not phase tracking, drives scheduling:
    the scheduler lets ``num_computed_tokens`` catch up with ``num_tokens``."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.time)
    priority: int = 0  # lower runs first under the priority policy
    deadline: float | None = None  # absolute time.time(); None means no deadline
    cache_salt: str = ""  # tenant salt: prefix-cache hits only within one salt
    eos_token_ids: frozenset[int] = frozenset()
    # Disaggregated prefill: end HANDED_OFF after the first token, keeping the KV (leased).
    prefill_only: bool = False
    # Sample ``index`` of an n > 1 request forked from ``parent_id`` (None: the parent itself)
    parent_id: str | None = None
    index: int = 0

    status: RequestStatus = RequestStatus.QUEUED
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_generated: int = 0
    num_emitted: int = 0
    num_preemptions: int = 0
    speculation: SpecStats = field(default_factory=SpecStats)
    finish_reason: FinishReason | None = None
    error: str | None = None
    record: TerminalRecord | None = None
    times: RequestTimes = field(init=False)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: empty prompt")
        self.times = RequestTimes(arrival=self.arrival_time)
        if self.sampling_params.seed is None:
            # Drawn once and recorded: its draws are a pure function of the seed, so the seed
            # alone reproduces them (docs/design.md#sampling-seeds).
            self.sampling_params = replace(self.sampling_params, seed=secrets.randbits(63))

    @property
    def seed(self) -> int:
        """The seed its sampling draws from: the one asked for, else the one drawn at arrival."""
        assert self.sampling_params.seed is not None  # set by __post_init__
        return self.sampling_params.seed

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def needs_prompt_logits(self) -> bool:
        """Its prefill returns the logits of every prompt position (prompt logprobs asked, and
        no token yet: a resumed request's client has them), so no cached block may stand in
        for computing its prompt."""
        return self.sampling_params.prompt_logprobs is not None and not self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_terminal

    def transition(self, new: RequestStatus) -> None:
        """Move to ``new``; raise IllegalTransition if docs/design.md#request-states does not allow
        it."""
        if new not in ALLOWED_TRANSITIONS[self.status]:
            raise IllegalTransition(f"request {self.request_id}: {self.status.name} -> {new.name}")
        self.status = new
