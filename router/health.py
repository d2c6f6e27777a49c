"""The router's judgement of a worker's silence (docs/design.md#worker-health, P16).

A worker is FAILED for silence only when two things agree: it sent no report for
``timeout_s`` **of the router's own awake time** (a pause of the router -- SIGSTOP, a long GC, a
starved CPU -- restarts every silence from the moment it ends: ``contracts.pause``), and a probe
sent to it directly, at half the timeout, went unanswered for at least ``PROBE_MIN_WAIT_S`` (or
half the timeout, if shorter). A
probe that answers clears the suspicion (the reports were late, the worker is fine); one that
fails outright (the actor is dead, its engine silent) fails it at once. So a silence is never
turned into a FAILED mark, and a request never failed over one, on the router's word alone.

Plain bookkeeping with the clock passed in: the actor sends the probes.
"""

from __future__ import annotations

import time
from enum import Enum

from contracts.pause import PauseClock

# A probe must have had at least this long to answer before its silence fails a worker (it is
# normally sent half a timeout earlier; after a pause the silence and the probe start over).
PROBE_MIN_WAIT_S = 0.5


class Judgement(Enum):
    FINE = "fine"
    PROBE = "probe"  # silent for half the timeout: ask it directly (once since the last pause)
    FAIL = "fail"  # silent for the timeout, and the probe sent since the last pause unanswered


class SilenceWatch:
    """Each worker's silence, measured while the router was awake, and its pending probe."""

    def __init__(self, timeout_s: float, clock: PauseClock) -> None:
        self.timeout_s = timeout_s
        self.clock = clock
        self.last_seen: dict[str, float] = {}  # monotonic time of its last report
        self.probes: dict[str, float] = {}  # monotonic time its pending probe was sent

    def heard(self, name: str) -> None:
        """A report (or a probe's answer): the worker is alive now."""
        self.last_seen[name] = time.monotonic()
        self.probes.pop(name, None)

    def forget(self, name: str) -> None:
        """It is FAILED: it is judged again once readmitted and heard."""
        self.last_seen.pop(name, None)
        self.probes.pop(name, None)

    def silence_s(self, name: str, now: float) -> float:
        """How long the router has been awake without hearing from ``name``."""
        seen = self.last_seen.get(name)
        return 0.0 if seen is None else now - max(seen, self.clock.awake_since())

    def judge(self, name: str, now: float) -> Judgement:
        """What ``name``'s silence calls for at monotonic time ``now``; PROBE records the
        probe as sent (the caller sends it)."""
        if name not in self.last_seen:
            return Judgement.FINE  # never heard: not this watch's to judge
        silent = self.silence_s(name, now)
        if silent <= self.timeout_s / 2:
            return Judgement.FINE
        sent = self.probes.get(name)
        if sent is None or sent < self.clock.awake_since():
            self.probes[name] = now
            return Judgement.PROBE
        if silent > self.timeout_s and now - sent >= min(PROBE_MIN_WAIT_S, self.timeout_s / 2):
            return Judgement.FAIL
        return Judgement.FINE
