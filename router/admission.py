"""Cluster admission (docs/design.md#cluster-admission): the seed's two-phase admission at the
scale of a prefill -> decode path. No Ray here: the router actor (router/actor.py) drives it.

A request enters the path only once the router's ledger has room for the whole path: a batch
slot and the KV its engine will reserve on every worker of the attempt (the prefill worker and
the decode worker). Until then it waits in the :class:`AdmissionQueue`, or is refused before
its first byte. Waiting is not a failure: it spends no attempt and no retry. The engines are
not asked here: a decode engine that finds no room when the KV arrives parks the import.

What a worker has room for is its engine's limits minus what its last report says it holds,
minus what the router granted that the worker has not reported yet (the :class:`Ledger`'s
*promises*). A report lists the attempts its engine admitted since the one before; their
promises end then (the load and KV claims of that report include them), and a restarted
router, whose ledger is empty, rebuilds the rest from the next reports. A grant is held by its
coordinator, which renews its hold; one whose coordinator fell silent is released (a replica
that died with requests admitted leaks nothing).

Queue order: started streams (migrations, whose client has tokens) first, then by priority
(lower first), then per-tenant fairness (the tenant with the fewest granted requests in flight),
then arrival. The head waits for room; nothing overtakes it (no starvation).
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from dataclasses import dataclass, field

from contracts.routing import AdmissionRefused, Decision, Refusal, RouteRequest, WorkerState
from router.config import AdmissionConfig
from router.policy import needed_blocks

# A promise the worker never reported (its attempt never reached it: a coordinator that died
# between the grant and its calls) is dropped after this long, so it cannot hold room forever.
PROMISE_TTL_S = 60.0
# Grants used to estimate the admission rate (queue wait predictions), and how old they may be.
RATE_WINDOW = 32
RATE_MAX_AGE_S = 120.0


@dataclass(eq=False)
class Waiter:
    """One request waiting in the queue."""

    request: RouteRequest
    seq: int  # arrival order
    enqueued: float
    waited: bool = False  # not admitted at once: the cluster was full (or the queue was not)

    @property
    def key(self) -> tuple[bool, int]:
        """Its class: started streams first, then priority."""
        return (not self.request.started, self.request.priority)


class AdmissionQueue:
    """Waiting requests by (class, priority), each class a FIFO per tenant."""

    def __init__(self) -> None:
        self._classes: dict[tuple[bool, int], dict[str, deque[Waiter]]] = {}
        self._len = 0
        self._seq = itertools.count()

    def __len__(self) -> int:
        return self._len

    def push(self, request: RouteRequest, now: float) -> Waiter:
        waiter = Waiter(request, next(self._seq), now)
        tenants = self._classes.setdefault(waiter.key, {})
        tenants.setdefault(request.tenant, deque()).append(waiter)
        self._len += 1
        return waiter

    def remove(self, waiter: Waiter) -> bool:
        """Take ``waiter`` out; False if it was not queued (granted or removed already)."""
        tenants = self._classes.get(waiter.key, {})
        fifo = tenants.get(waiter.request.tenant)
        if fifo is None or waiter not in fifo:
            return False
        fifo.remove(waiter)
        if not fifo:
            del tenants[waiter.request.tenant]
            if not tenants:
                del self._classes[waiter.key]
        self._len -= 1
        return True

    def head(self, in_flight: dict[str, int]) -> Waiter | None:
        """Who is admitted next: the first class; in it, the tenant with the fewest requests
        in flight (``in_flight``), then the earliest arrival."""
        if not self._classes:
            return None
        tenants = self._classes[min(self._classes)]
        fifo = min(
            tenants.values(), key=lambda q: (in_flight.get(q[0].request.tenant, 0), q[0].seq)
        )
        return fifo[0]

    def waiters(self) -> list[Waiter]:
        """Every waiter (any order)."""
        return [w for tenants in self._classes.values() for q in tenants.values() for w in q]


@dataclass
class AdmissionRate:
    """Admissions per second of requests that had to wait: how fast the queue drains."""

    times: deque[float] = field(default_factory=lambda: deque(maxlen=RATE_WINDOW))

    def record(self, now: float) -> None:
        self.times.append(now)

    def per_second(self, now: float) -> float | None:
        """None until there are a few recent admissions to measure."""
        while self.times and now - self.times[0] > RATE_MAX_AGE_S:
            self.times.popleft()
        if len(self.times) < 4 or self.times[-1] <= self.times[0]:
            return None
        return (len(self.times) - 1) / (self.times[-1] - self.times[0])


def refusal(
    request: RouteRequest,
    config: AdmissionConfig,
    num_ahead: int,
    rate: float | None,
    now: float,
) -> AdmissionRefused | None:
    """Why ``request``, which cannot be admitted now and has ``num_ahead`` requests waiting
    before it, is refused instead of waiting (None: it waits). A started stream is never
    refused: its client has tokens already."""
    if request.started:
        return None
    per_admission = 1.0 / rate if rate else 1.0
    if num_ahead >= config.max_queued:
        return AdmissionRefused(
            request.request_id,
            Refusal.QUEUE_FULL,
            f"{num_ahead} requests are waiting for capacity (the bound is {config.max_queued})",
            retry_after_s=max(1.0, math.ceil(per_admission)),
        )
    if config.predict_wait and request.deadline is not None and rate:
        wait = (num_ahead + 1) / rate
        left = request.deadline - now
        if wait > left:
            return AdmissionRefused(
                request.request_id,
                Refusal.WAIT_EXCEEDS_DEADLINE,
                f"the predicted wait of {wait:.1f} s ({num_ahead} ahead, {rate:.2f} "
                f"admissions/s) is longer than the {max(left, 0.0):.1f} s left to its deadline",
                retry_after_s=max(1.0, math.ceil(wait - left)),
            )
    return None


@dataclass
class Grant:
    """What one admitted attempt was granted: a slot and blocks on each of its workers, of
    which ``promises`` are those its workers have not reported admitting yet."""

    attempt_id: str
    tenant: str
    granted: float
    promises: dict[str, int]  # worker -> blocks promised there, until the worker reports it
    holder: str = ""  # the coordinator holding it ("": until released)


class Ledger:
    """The grants in flight and their promises, kept on the workers' states (``promised_seqs``,
    ``promised_blocks``, which the policy's room check and load read)."""

    def __init__(self, states: dict[str, WorkerState]) -> None:
        self.states = states
        self.grants: dict[str, Grant] = {}
        self.in_flight: dict[str, int] = {}  # tenant -> grants not yet released
        self.holders: dict[str, float] = {}  # coordinator -> when it last renewed its hold

    def grant(self, decision: Decision, request: RouteRequest, now: float) -> Grant:
        """Record ``decision`` as granted: promise a slot and the blocks on its workers."""
        promises: dict[str, int] = {}
        if decision.prefill is not None:
            promises[decision.prefill] = needed_blocks(
                self.states[decision.prefill], request, prefill_only=True
            )
        promises[decision.decode] = needed_blocks(
            self.states[decision.decode], request, prefill_only=False
        )
        grant = Grant(decision.request_id, request.tenant, now, promises, request.holder)
        if request.holder:
            self.hold(request.holder, now)
        self.release(grant.attempt_id)  # a repeated id replaces its grant, never adds to it
        self.grants[grant.attempt_id] = grant
        self.in_flight[grant.tenant] = self.in_flight.get(grant.tenant, 0) + 1
        for worker, blocks in promises.items():
            self._promise(worker, 1, blocks)
        return grant

    def hold(self, holder: str, now: float) -> None:
        """``holder`` (a coordinator) is alive: its grants stay."""
        self.holders[holder] = now

    def admitted(self, worker: str, attempt_ids: tuple[str, ...]) -> None:
        """``worker`` reported admitting these attempts: its report counts them now."""
        for attempt_id in attempt_ids:
            grant = self.grants.get(attempt_id)
            if grant is not None and worker in grant.promises:
                self._promise(worker, -1, -grant.promises.pop(worker))

    def release(self, attempt_id: str) -> bool:
        """The attempt ended (or never reached its workers): drop its grant; False if none."""
        grant = self.grants.pop(attempt_id, None)
        if grant is None:
            return False
        for worker, blocks in grant.promises.items():
            self._promise(worker, -1, -blocks)
        left = self.in_flight[grant.tenant] - 1
        if left:
            self.in_flight[grant.tenant] = left
        else:
            del self.in_flight[grant.tenant]
        return True

    def forget_worker(self, worker: str) -> None:
        """``worker`` failed or restarted: its promises are void (its attempts fail and are
        released by their coordinators; what it holds comes with its next report)."""
        for grant in self.grants.values():
            grant.promises.pop(worker, None)
        state = self.states[worker]
        state.promised_seqs = state.promised_blocks = 0

    def expire(
        self, now: float | None = None, holder_timeout_s: float = math.inf, awake: float = 0.0
    ) -> list[str]:
        """Drop grants none of whose workers ever reported them within PROMISE_TTL_S, and
        grants whose holder has not renewed its hold for ``holder_timeout_s`` of the router's
        awake time (``awake``: when the router's last pause ended -- a paused router saw no
        renewal, and blames no holder for it)."""
        now = time.time() if now is None else now
        silent = {
            h for h, seen in self.holders.items() if now - max(seen, awake) > holder_timeout_s
        }
        stale = [
            g.attempt_id
            for g in self.grants.values()
            if (now - g.granted > PROMISE_TTL_S and g.promises) or g.holder in silent
        ]
        for holder in silent:
            del self.holders[holder]
        for attempt_id in stale:
            self.release(attempt_id)
        return stale

    def _promise(self, worker: str, seqs: int, blocks: int) -> None:
        state = self.states[worker]
        state.promised_seqs += seqs
        state.promised_blocks += blocks
