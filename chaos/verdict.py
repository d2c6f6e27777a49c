"""What a chaos run's records come to: per-request verdicts against the reference (and a
structured request's against its grammar), which requests a fault touched, the timeline,
detection, recovery and stranded KV. Plain functions over plain data (no Ray, no HTTP), so each
rule is tested on its own.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from chaos.inject import FaultEvent
from chaos.load import Outcome, Planned
from chaos.plan import Structured
from chaos.reference import Expected
from chaos.structured import why_invalid
from engine.metrics import percentile

STEADY_WINDOW_S = 10.0  # before a fault: what "steady" is measured over
RECOVERY_WINDOW_S = 5.0  # after it: each window judged against steady
RECOVERY_TOLERANCE = 0.10  # throughput and p99 TTFT back within 10%
# Faults that end processes (detected within max_detect_kill_s; their peers' KV is stranded).
KILLS = ("kill_worker", "churn", "cancel_race", "kill_host", "lose_domain")


@dataclass
class Attempt:
    """One routed attempt, from the router's decision log."""

    attempt_id: str
    response_id: str  # the client request (response) it is an attempt of
    prefill: str | None
    decode: str


def mismatch(outcome: Outcome, answers: list[Expected]) -> str | None:
    """Why ``outcome`` differs from the reference (None: it does not). A complete request
    must equal it; one cut short (cancelled, failed) must be a prefix of it — a duplicated,
    missing or changed token shows either way."""
    complete = outcome.status == "ok"
    for index, want in enumerate(answers):
        got = outcome.choices.get(index)
        if got is None:
            if complete:
                return f"choice {index} missing"
            continue
        n = len(got.tokens)
        if complete and n != len(want.tokens):
            return f"choice {index}: {n} tokens, the reference has {len(want.tokens)}"
        for name in ("tokens", "token_logprobs", "top_logprobs"):
            mine, theirs = getattr(got, name), getattr(want, name)
            if mine != theirs[:n]:
                at = next(
                    (i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b), n
                )
                return f"choice {index}: {name} differ from token {at}"
        if complete and (got.text, got.finish_reason) != (want.text, want.finish_reason):
            return f"choice {index}: text or finish_reason differ"
        if not complete and not want.text.startswith(got.text):
            return f"choice {index}: the text received is not a prefix of the reference"
    return None


def invalid_output(outcome: Outcome, kind: Structured) -> str | None:
    """Why a structured request's output breaks its grammar (None: it does not). Each choice
    that ended by itself (``finish_reason`` "stop") must parse and match it whole; one that
    ended at max_tokens or was cut short is not judged here (``endings`` counts them): its
    tokens are a prefix of the reference's, which the same grammar masked (``mismatch``)."""
    for index, choice in sorted(outcome.choices.items()):
        if choice.finish_reason == "stop":
            why = why_invalid(kind, choice.text)
            if why is not None:
                return f"choice {index}: {why}"
    return None


def endings(outcome: Outcome, n: int) -> list[str]:
    """How each of ``n`` choices ended: "stop" (by itself), "length" (at max_tokens) or
    "cut" (cancelled, failed, hung: no finish_reason)."""
    out = []
    for index in range(n):
        choice = outcome.choices.get(index)
        reason = choice.finish_reason if choice is not None else None
        out.append(reason if reason in ("stop", "length") else "cut")
    return out


def structured_checks(
    plan: list[Planned], outcomes: list[Outcome], rows: list[dict[str, Any]]
) -> list[Check]:
    """A run's grammar check (none for a run without structured requests): ``rows`` are the
    run's per-request rows, each with its ``invalid`` verdict."""
    requests = [
        (p.structured, r["invalid"], endings(o, p.body.get("n", 1)))
        for p, o, r in zip(plan, outcomes, rows, strict=True)
        if p.structured
    ]
    return [structured_check(requests)] if requests else []


def structured_check(requests: list[tuple[Structured, str | None, list[str]]]) -> Check:
    """The check that structured outputs match their grammar, over each structured request's
    kind, why it is invalid (None: it is not) and how its choices ended: none invalid, and some
    choice judged (one that ended by itself) -- a run that judged nothing proved nothing."""
    ends: dict[str, Counter[str]] = {}
    for kind, _, ended in requests:
        ends.setdefault(kind, Counter()).update(ended)
    invalid = sum(why is not None for _, why, _ in requests)
    judged = sum(c["stop"] for c in ends.values())
    per_kind = "; ".join(
        f"{kind} {c['stop']} stop, {c['length']} length, {c['cut']} cut"
        for kind, c in sorted(ends.items())
    )
    return Check(
        "structured outputs match their grammar",
        invalid == 0 and judged > 0,
        f"{invalid} invalid; {judged} choices judged (stop), length and cut not ({per_kind})",
        "0 (and some judged)",
    )


def differs_from_transformers(outcome: Outcome, names: list[str]) -> str | None:
    """Why a greedy request's token ids are not those transformers generated (None: they
    are): a complete one must equal them, one cut short be a prefix."""
    got = outcome.choices.get(0)
    tokens = got.tokens if got else []
    if outcome.status == "ok" and tokens != names:
        at = next((i for i, (a, b) in enumerate(zip(tokens, names, strict=False)) if a != b), None)
        return f"{len(tokens)} tokens, transformers {len(names)}; first difference at {at}"
    if outcome.status != "ok" and tokens != names[: len(tokens)]:
        return "the tokens received are not a prefix of transformers'"
    return None


def touched_by(outcome: Outcome, attempts: list[Attempt], events: list[FaultEvent]) -> list[str]:
    """The faults that touched ``outcome``: one that hit everyone while it was open, or one
    that hit a worker its attempts ran on while it was open (from the fault until the worker
    was back: ``until``). A request whose routing is not
    known (no attempt of it was routed, or it failed before a response id) is touched by any
    fault while it was open."""
    start, end = outcome.sent or outcome.scheduled, outcome.finished or math.inf
    mine = {w for a in attempts for w in (a.prefill, a.decode) if w}
    out = []
    for e in events:
        if not (start <= (e.until or e.at) and e.at <= end):
            continue
        if e.everyone or not mine or mine & set(e.workers):
            out.append(fault_tag(e))
    return out


def fault_tag(event: FaultEvent) -> str:
    """How a request's row names a fault that touched it: its kind and its number."""
    return f"{event.kind}#{event.number}"


@dataclass
class Bin:
    t: float  # seconds from the run's start
    tokens_per_s: float
    requests: int  # first tokens in this second
    errors: int
    ttft_p50: float  # NaN: no first token in this bin
    ttft_p99: float


def timeline(outcomes: list[Outcome], start: float, end: float, width_s: float = 1.0) -> list[Bin]:
    """Per ``width_s`` bin: tokens received, errors and TTFT (from the scheduled send, so a
    client that fell behind does not hide queueing) of requests whose first token came in it."""
    n = max(1, math.ceil((end - start) / width_s))
    tokens = [0] * n
    errors = [0] * n
    ttfts: list[list[float]] = [[] for _ in range(n)]

    def at(t: float) -> int:
        return min(n - 1, max(0, int((t - start) / width_s)))

    for o in outcomes:
        for when, count in o.token_times:
            tokens[at(when)] += count
        if o.status in ("error", "hung") and o.finished is not None:
            errors[at(o.finished)] += 1
        if o.first_token is not None:
            ttfts[at(o.first_token)].append(o.first_token - o.scheduled)
    return [
        Bin(
            t=i * width_s,
            tokens_per_s=tokens[i] / width_s,
            requests=len(ttfts[i]),
            errors=errors[i],
            ttft_p50=percentile(ttfts[i], 50),
            ttft_p99=percentile(ttfts[i], 99),
        )
        for i in range(n)
    ]


@dataclass
class Window:
    tokens_per_s: float
    ttft_p99: float  # NaN: no first token in the window
    requests: int


def window(outcomes: list[Outcome], start: float, end: float) -> Window:
    tokens = sum(c for o in outcomes for when, c in o.token_times if start <= when < end)
    ttfts = [
        o.first_token - o.scheduled
        for o in outcomes
        if o.first_token is not None and start <= o.first_token < end
    ]
    return Window(tokens / max(end - start, 1e-9), percentile(ttfts, 99), len(ttfts))


def recovery_s(
    outcomes: list[Outcome], fault_at: float, not_before: float, load_end: float
) -> tuple[Window, float | None]:
    """The steady window before ``fault_at`` and the time from the fault until a
    RECOVERY_WINDOW_S window has throughput >= 90% of steady and p99 TTFT <= 110% of steady
    (stepping 0.5 s; None: not within the load)."""
    steady = window(outcomes, max(not_before, fault_at - STEADY_WINDOW_S), fault_at)
    t = fault_at
    while t + RECOVERY_WINDOW_S <= load_end:
        w = window(outcomes, t, t + RECOVERY_WINDOW_S)
        fast = w.tokens_per_s >= (1 - RECOVERY_TOLERANCE) * steady.tokens_per_s
        prompt = (
            math.isnan(steady.ttft_p99)
            or math.isnan(w.ttft_p99)
            or w.ttft_p99 <= (1 + RECOVERY_TOLERANCE) * steady.ttft_p99
        )
        if fast and prompt:
            return steady, t - fault_at
        t += 0.5
    return steady, None


ROUTER_OUTAGES = ("kill_router", "hang_router")  # no failure detector runs while they last
KILL_NOTICE_S = 1.0  # how soon a router marks a killed worker (its liveness connection closes)


def router_outages_over(event: FaultEvent, events: Sequence[FaultEvent]) -> list[FaultEvent]:
    """The router kills and pauses going on when ``event`` was done, or begun within
    ``KILL_NOTICE_S`` after it (the router died before it could mark it): none detects
    meanwhile; a restarted router finds a dead worker by its silence, after its first look."""
    return [
        o
        for o in events
        if o.kind in ROUTER_OUTAGES
        and o.until is not None
        and o.at - KILL_NOTICE_S <= event.at <= o.until
    ]


def detection_s(
    event: FaultEvent, health: list[dict[str, Any]], events: Sequence[FaultEvent] = ()
) -> float | None:
    """Fault to the router's first FAILED mark of one of its workers (None: never marked).
    A mark up to 50 ms before the fault's time counts as 0: a death is timed by polling the
    process every 5 ms, and the router can learn of it first (its connection closes as the
    process exits). A fault done while the router was down or paused (another of ``events``)
    is timed from when the router was back: no detector runs before."""
    since = max([event.at, *(o.until or 0.0 for o in router_outages_over(event, events))])
    marks = [
        h["at"]
        for h in health
        if h["event"] == "failed" and h["worker"] in event.workers and h["at"] >= event.at - 0.05
    ]
    return max(0.0, min(marks) - since) if marks else None


def false_alarms(events: list[FaultEvent], health: list[dict[str, Any]]) -> list[str]:
    """The router's FAILED marks (``health``: those of this run) of workers no fault had hit
    by then: a healthy worker blamed (for the router's own pause, a load, another worker's
    fault). "name (why)" each."""
    return [
        f"{h['worker']} ({h['why']})"
        for h in health
        if h["event"] == "failed"
        and not any(h["worker"] in e.workers and h["at"] >= e.at - 0.05 for e in events)
    ]


def terminal_records(
    requests: list[tuple[Outcome, list[Attempt], bool]],
    records: dict[str, list[dict[str, Any]]],
    events: list[FaultEvent],
) -> tuple[list[str], list[str]]:
    """(missing, repeated) attempt ids: attempts of requests no fault touched (``requests``:
    each with its attempts and whether a fault touched it) without a terminal record on a worker
    they ran on -- unless a kill restarted that worker since (its records died with it) -- and
    attempts with more than one record on a worker (P8: exactly one per attempt)."""
    have = Counter((worker, r["request_id"]) for worker, rows in records.items() for r in rows)
    repeated = sorted({attempt for (_, attempt), n in have.items() if n > 1})
    missing = []
    for outcome, attempts, touched in requests:
        since = (outcome.sent or outcome.scheduled) - 1.0
        for a in [] if touched else attempts:
            for worker in (a.prefill, a.decode):
                restarted = any(
                    e.kind in KILLS and worker in e.workers and e.at >= since for e in events
                )
                if worker and not restarted and (worker, a.attempt_id) not in have:
                    missing.append(a.attempt_id)
    return missing, repeated


@dataclass
class Stranded:
    """KV a surviving worker held for attempts whose peer died, after the death."""

    attempts: int = 0
    block_seconds: float = 0.0
    blocks: int = 0
    worst_s: float = 0.0  # the longest one attempt's blocks were held after the death

    @property
    def per_block_s(self) -> float:
        return self.block_seconds / self.blocks if self.blocks else 0.0


def stranded(
    events: list[FaultEvent],
    attempts: dict[str, Attempt],
    records: dict[str, list[dict[str, Any]]],
    block_size: int,
) -> Stranded:
    """From each worker's terminal records: attempts that ended unfinished on a survivor whose
    peer (the other worker of the attempt) a kill took down while they ran, held from the kill
    to their end."""
    out = Stranded()
    kills = [e for e in events if e.kind in KILLS]
    for worker, rows in records.items():
        for r in rows:
            if r["status"] == "finished" or r["request_id"] not in attempts:
                continue
            a = attempts[r["request_id"]]
            peer = a.prefill if worker == a.decode else a.decode
            for e in kills:
                if peer in e.workers and worker not in e.workers and r["finished"] > e.at:
                    if r["arrival"] > e.at:
                        continue
                    held = r["finished"] - e.at
                    blocks = math.ceil((r["num_prompt_tokens"] + r["num_generated"]) / block_size)
                    out.attempts += 1
                    out.blocks += blocks
                    out.block_seconds += blocks * held
                    out.worst_s = max(out.worst_s, held)
                    break
    return out


@dataclass
class Check:
    name: str
    passed: bool
    measured: str
    threshold: str


def on_schedule(dispatch_delay_s: float, stalled_s: float, bound_s: float) -> Check:
    """Whether the load left this client when the plan says: a client that stalled sent its
    requests late, and its faults, timed from the schedule, struck a different load."""
    return Check(
        "the load left on schedule",
        dispatch_delay_s <= bound_s,
        f"latest send {dispatch_delay_s:.2f} s after its time"
        + (f"; this client stalled {stalled_s:.1f} s" if stalled_s else ""),
        f"<= {bound_s:g} s",
    )


@dataclass
class FaultRow:
    kind: str
    at_s: float
    workers: list[str]
    detail: str
    detect_s: float | None
    recovery_s: float | None
    steady_tokens_per_s: float
    steady_ttft_p99: float  # NaN: no first token in the steady window
    touched: int = 0
    touched_ok: int = 0
    lasted_s: float | None = None  # until the worker was up again / the service answered
    router_down: bool = False  # done while the router was down or paused: timed from its return


@dataclass
class Summary:
    plan: str
    verdict: bool
    checks: list[Check]
    faults: list[FaultRow]
    counts: dict[str, int]
    stranded: dict[str, float]
    max_dispatch_delay_s: float
    timeline: list[Bin]
    failures: list[dict[str, Any]] = field(default_factory=list)  # the first few, for people
    requests: list[dict[str, Any]] = field(default_factory=list)  # one row per request
    health: list[dict[str, Any]] = field(default_factory=list)  # the router's health log
    sabotage: list[dict[str, Any]] = field(default_factory=list)  # a self-test's, each caught?

    def as_dict(self) -> dict[str, Any]:
        """Everything but the per-request rows (``requests.jsonl``)."""
        out = asdict(self)
        del out["requests"]
        return out
