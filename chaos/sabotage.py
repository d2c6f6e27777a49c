"""``tandem chaos run PLAN --sabotage KIND[,KIND...]``: a self-test of the harness. Each kind
plants in the live cluster one violation the verdict promises to catch -- on a decode worker,
through the workers' own fault vocabulary (``contracts.faults.SABOTAGE``, RAISE) -- and the run
must then FAIL the check that names it, pointing at the planted attempt. A verdict that passes a
sabotaged run is a harness bug; the command's exit status says whether each one was caught.

No plan fault is done for a sabotage (it is not a ``FaultEvent``): what it spoils counts as
untouched, as a real bug would.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from chaos.plan import Checks
from contracts.faults import Fault, FaultAction, FaultPoint
from contracts.roles import Role


class Kind(StrEnum):
    TOKEN = "token"  # a token id changed
    LOGPROB = "logprob"  # a top-k alternative's logprob changed
    DROP = "drop"  # a token dropped from a stream
    DUPLICATE = "duplicate"  # a token sent twice
    LEAK = "leak"  # a KV block held past the settle time
    LOST_RECORD = "lost_record"  # an attempt's terminal record lost
    DOUBLE_RECORD = "double_record"  # ... or written twice
    HANG = "hang"  # a stream held past the hang bound, its worker healthy
    FAIL = "fail"  # a request failed though no fault touched it


def parse(text: str) -> list[Kind]:
    """``--sabotage``'s value: kinds separated by commas, or ``all``; ValueError naming a kind
    that is not one."""
    if text == "all":
        return list(Kind)
    kinds = []
    for name in text.split(","):
        try:
            kinds.append(Kind(name.strip()))
        except ValueError:
            raise ValueError(
                f"--sabotage {name!r}: not a kind; one of {', '.join(Kind)}, or all"
            ) from None
    return list(dict.fromkeys(kinds))


# The check each kind must fail (chaos.run's names).
CHECK = {
    Kind.TOKEN: "outputs equal the reference",
    Kind.LOGPROB: "outputs equal the reference",
    Kind.DROP: "outputs equal the reference",
    Kind.DUPLICATE: "outputs equal the reference",
    Kind.LEAK: "pools and leases back to baseline",
    Kind.LOST_RECORD: "one terminal record per attempt on each worker",
    Kind.DOUBLE_RECORD: "one terminal record per attempt on each worker",
    Kind.HANG: "no request hung",
    Kind.FAIL: "non-targeted requests succeed",
}
STREAM_ACTION = {
    Kind.TOKEN: FaultAction.SPOIL_TOKEN,
    Kind.LOGPROB: FaultAction.SPOIL_LOGPROB,
    Kind.DROP: FaultAction.DROP_TOKEN,
    Kind.DUPLICATE: FaultAction.REPEAT,
    Kind.LOST_RECORD: FaultAction.LOSE_RECORD,
    Kind.DOUBLE_RECORD: FaultAction.DOUBLE_RECORD,
}
SPOIL_AT = 3  # a stream is spoiled at its third token (not the prefill's first)
LEAK_PAST_SETTLE_S = 20.0  # a leaked block comes back this long after the settle time
HOLD_PAST_BOUND_S = 30.0  # a held stream would resume this long after the hang bound


@dataclass
class Planted:
    """One sabotage: where it was armed (the worker of its first fault), the attempt it fired
    on, and whether the verdict caught it (the check named in ``CHECK`` failed, pointing at
    it: ``how``)."""

    kind: Kind
    worker: str
    faults: list[tuple[str, Fault]] = field(repr=False)  # (worker, fault); the first spoils
    attempt: str | None = None  # None: it never fired (the load gave it no request)
    caught: bool = False
    how: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "worker": self.worker,
            "attempt": self.attempt,
            "caught": self.caught,
            "how": self.how,
        }


def arm(kinds: list[Kind], decoders: list[str], checks: Checks, max_attempts: int) -> list[Planted]:
    """The sabotages to arm: each kind on the next of ``decoders`` (the workers that stream
    tokens) in turn. ``fail`` fails a request's every attempt: its first on one worker, each
    later one on whichever serves it (up to the retry policy's ``max_attempts``; no plan fault
    runs beside a sabotage, so only that request migrates)."""
    out = []
    for i, kind in enumerate(kinds):
        worker = decoders[i % len(decoders)]
        point = FaultPoint.DECODE_TOKENS
        if kind in STREAM_ACTION:
            faults = [(worker, Fault(point, STREAM_ACTION[kind], at=SPOIL_AT))]
        elif kind is Kind.LEAK:
            seconds = checks.settle_s + LEAK_PAST_SETTLE_S
            faults = [(worker, Fault(point, FaultAction.LEAK_BLOCK, at=1, seconds=seconds))]
        elif kind is Kind.HANG:
            seconds = checks.hang_bound_s + HOLD_PAST_BOUND_S
            faults = [(worker, Fault(point, FaultAction.HOLD, at=2, seconds=seconds))]
        else:
            faults = [(worker, Fault(point, FaultAction.RAISE, at=1, attempt=1))]
            faults += [
                (other, Fault(point, FaultAction.RAISE, at=1, attempt=n))
                for n in range(2, max_attempts + 1)
                for other in decoders
            ]
        out.append(Planted(kind, worker, faults))
    return out


def decoders(workers: list[tuple[str, Role]]) -> list[str]:
    """The workers whose streams reach clients: decode and colocated ones."""
    return [name for name, role in workers if role in (Role.DECODE, Role.COLOCATED)]


def judge(
    planted: list[Planted],
    checks: dict[str, bool],
    rows_by_attempt: dict[str, dict[str, Any]],
    leaks: dict[str, str],
    missing: list[str],
    repeated: list[str],
) -> None:
    """Mark each planted sabotage caught when its check failed and pointed at it: the spoiled
    request mismatched (stream kinds), hung, or failed untouched; the leaking worker failed its
    leak check; the attempt's record is among the missing or repeated ones."""
    for p in planted:
        if p.attempt is None:
            p.how = "never fired: no request reached it"
            continue
        row = rows_by_attempt.get(p.attempt, {})
        failed = not checks.get(CHECK[p.kind], True)
        request = f"request {row.get('index')}"
        if p.kind in (Kind.TOKEN, Kind.LOGPROB, Kind.DROP, Kind.DUPLICATE):
            why = row.get("mismatch")
            p.caught, p.how = failed and bool(why), f"{request}: {why}"
        elif p.kind is Kind.LEAK:
            p.caught, p.how = failed and p.worker in leaks, leaks.get(p.worker, "no leak found")
        elif p.kind is Kind.LOST_RECORD:
            p.caught, p.how = failed and p.attempt in missing, f"missing: {missing[:4]}"
        elif p.kind is Kind.DOUBLE_RECORD:
            p.caught, p.how = failed and p.attempt in repeated, f"repeated: {repeated[:4]}"
        elif p.kind is Kind.HANG:
            p.caught, p.how = (
                failed and row.get("status") == "hung",
                f"{request}: {row.get('status')}",
            )
        else:
            bad = row.get("status") == "error" and not row.get("touched")
            p.caught, p.how = failed and bad, f"{request}: {row.get('status')} {row.get('error')}"
