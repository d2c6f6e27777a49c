"""The router's judgement of a worker's silence (docs/design.md#worker-health, P16).

A worker is FAILED for silence only when two things agree: it sent no report for
``timeout_s`` **of the router's own awake time** (a pause of the router -- SIGSTOP, a long GC, a
starved CPU -- restarts every silence from the moment it ends: ``contracts.pause``), and a probe
sent to it directly, at half the timeout, went unanswered for at least ``PROBE_MIN_WAIT_S`` (or
half the timeout, if shorter). A probe that answers clears the suspicion (the reports were
late, the worker is fine); one that fails outright (the actor is dead, its engine silent) fails
it at once. So a silence is never turned into a FAILED mark, and a request never failed over
one, on the router's word alone.

``SilenceWatch`` is plain bookkeeping with the clock passed in; ``Probes`` sends the probes
(through the handle each worker sent with its resync) and a restarted router's first look.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from enum import Enum
from typing import Any

import ray

from contracts.actors import WorkerClient
from contracts.liveness import LivenessServer
from contracts.pause import PauseClock
from contracts.routing import DetectedBy

# A probe must have had at least this long to answer before its silence fails a worker (it is
# normally sent half a timeout earlier; after a pause the silence and the probe start over).
PROBE_MIN_WAIT_S = 0.5

# A restarted router waits at least this long for live workers to reach it: Ray tells their
# processes where the restarted actor is only then -- 2.75 s after it answered, here (two busy
# cores); a 0.8 s and a 2 s look blamed live workers.
FIRST_LOOK_MIN_S = 5.0
# Meanwhile it asks Ray's actor table this often which of them Ray is restarting: a worker
# whose process died while the router was down is FAILED within this of the router's start.
FIRST_LOOK_POLL_S = 0.25


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


class Probes:
    """The router's direct questions to its workers. ``fail(name, why, how)`` marks a worker
    FAILED, ``note(name, event, why)`` logs a health event (the actor's)."""

    def __init__(
        self,
        silence: SilenceWatch,
        timeout_s: float,
        fail: Callable[[str, str, DetectedBy], None],
        note: Callable[[str, str, str], None],
    ) -> None:
        self.silence = silence
        self.timeout_s = timeout_s
        self.fail = fail
        self.note = note
        # Each worker's actor handle, as it sent it with its resync: never looked up (Ray's
        # lookup is a GCS call that holds its caller while the actor restarts).
        self.handles: dict[str, Any] = {}
        self.ask: Callable[[str], Awaitable[tuple[str, bool]]] = self._ask_over_ray  # (tests)
        self.restarting: Callable[[list[str]], Awaitable[set[str]]] = _restarting  # (tests)

    async def probe(self, name: str, known: str | None) -> None:
        """Ask a silent ``name`` (incarnation ``known``) whether it is alive and its engine
        answers. A live, responsive worker is heard (its reports were late); a dead, restarted
        or unresponsive one is FAILED; no answer leaves it to the monitor (FAILED at the
        timeout)."""
        try:
            incarnation, responsive = await asyncio.wait_for(self.ask(name), self.timeout_s)
        except TimeoutError:
            return
        except Exception as exc:  # the actor is dead, or Ray is restarting it
            self.fail(name, f"a direct probe failed: {type(exc).__name__}", DetectedBy.PROBE)
            return
        if known is not None and incarnation != known:
            self.fail(name, "restarted", DetectedBy.RESTART)
        elif not responsive:
            self.fail(name, "its engine does not answer", DetectedBy.PROBE)
        elif name in self.silence.probes:
            self.silence.heard(name)  # alive: its reports were late, not missing
            self.note(name, "probed", "silent, but answered a direct probe")

    async def first_look(self, names: list[str], liveness: LivenessServer | None) -> None:
        """A restarted router: no detector ran while it was down. A live worker finds it --
        its report is answered (it resyncs) and it connects its liveness connection again --
        so one that has done neither within a heartbeat timeout (at least FIRST_LOOK_MIN_S) of
        the router's start is dead or being restarted by Ray: FAILED then, not left unreported
        until it returns. One Ray is restarting (Ray's actor table says so: its process died)
        is FAILED as soon as the table is read, every FIRST_LOOK_POLL_S meanwhile."""
        wait_s = max(self.timeout_s, FIRST_LOOK_MIN_S)
        until = time.monotonic() + wait_s
        failed: set[str] = set()
        while (left := until - time.monotonic()) > 0:
            try:
                dead = await self.restarting(names) - failed
            except Exception:  # the table is unreadable (a GCS hiccup): the deadline decides
                dead = set()
            for name in sorted(dead):
                if name not in self.silence.last_seen:
                    why = "Ray is restarting its actor (its process died while the router was down)"
                    self.fail(name, why, DetectedBy.RESTART)
                    failed.add(name)
            await asyncio.sleep(min(FIRST_LOOK_POLL_S, left))
        for name in sorted(set(names) - failed):
            connected = liveness is not None and name in liveness.connected
            if name not in self.silence.last_seen and not connected:
                why = f"neither reported nor connected to the restarted router in {wait_s:g} s"
                self.fail(name, why, DetectedBy.PROBE)

    async def _ask_over_ray(self, name: str) -> tuple[str, bool]:
        handle = self.handles.get(name) if ray.is_initialized() else None
        if handle is None:  # no Ray (a router under test), or it never resynced here
            await asyncio.Event().wait()
        return await WorkerClient(handle).probe()


async def _restarting(names: list[str]) -> set[str]:
    """Which of ``names`` Ray's actor table shows RESTARTING (their process died; Ray is
    starting another). A GCS read, off the event loop."""
    if not ray.is_initialized():
        return set()

    def read() -> set[str]:
        table = ray._private.state.actors(actor_state_name="RESTARTING")
        return {a["Name"] for a in table.values()} & set(names)

    return await asyncio.to_thread(read)
