"""A detector's clock of its own pauses (P16, docs/design.md#worker-health).

A failure detector that measures another process's silence must not count the time it was not
running itself: a SIGSTOP, a long GC, a starved CPU or a frozen VM stops the detector too, and
when it resumes every heartbeat looks late -- though the senders were fine and their reports
are queued at its door. ``PauseClock`` notices such a pause as a late wake of a task that should
wake every ``tick_s`` (on the monotonic clock), and says since when the detector has been awake
without a pause: silences are measured from then, not from before the pause.
"""

from __future__ import annotations

import asyncio
import time

TICK_S = 0.05
# A wake this late is a pause of this process, not scheduling noise (a busy event loop is late
# by milliseconds; a pause that matters is as long as a fraction of a heartbeat timeout).
PAUSE_S = 0.5


class PauseClock:
    """Since when this process has run without a pause of more than ``pause_s``."""

    def __init__(self, tick_s: float = TICK_S, pause_s: float = PAUSE_S) -> None:
        self.tick_s = tick_s
        self.pause_s = pause_s
        self._last_tick = time.monotonic()
        self._awake_since = self._last_tick
        self.pauses = 0  # how many were noticed
        self.longest_s = 0.0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start ticking (on the running loop); idempotent."""
        if self._task is None:
            self._last_tick = time.monotonic()
            self._task = asyncio.get_running_loop().create_task(self._tick())

    def awake_since(self) -> float:
        """The monotonic time the last pause ended (or the clock started). A tick overdue right
        now counts as a pause that just ended: on resume, the detector's own timers may run
        before this clock's does."""
        if self._task is not None:  # (not ticking: no pause can be told from a quiet loop)
            self._check(time.monotonic())
        return self._awake_since

    def _check(self, now: float) -> None:
        late = now - self._last_tick
        if late > self.tick_s + self.pause_s:
            self._awake_since = now
            self.pauses += 1
            self.longest_s = max(self.longest_s, late - self.tick_s)
            self._last_tick = now

    async def _tick(self) -> None:
        while True:
            now = time.monotonic()
            self._check(now)
            self._last_tick = now
            await asyncio.sleep(self.tick_s)
