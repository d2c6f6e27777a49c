"""What held the harness's own event loop. A chaos run's load and faults leave on schedule
only while its loop runs; when it does not (a blocking call on the loop), the run is judged
late (``on_schedule``) -- and this names the call: a thread that sees the loop miss its beat for
``stall_s`` reports the loop thread's stack, once per stall, while the stall lasts."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import TracebackType

BEAT_S = 0.1


class LoopWatchdog:
    """``async with LoopWatchdog(say):`` around the work to watch; ``stalls`` keeps each
    stall's stack (the innermost frames last), and ``say`` is told of it as it happens."""

    def __init__(self, say: Callable[[str], None], stall_s: float = 1.0) -> None:
        self.say = say
        self.stall_s = stall_s
        self.stalls: list[str] = []
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._loop_thread = threading.get_ident()
        self._beat: asyncio.Task[None] | None = None
        self._thread = threading.Thread(target=self._watch, name="loop-watchdog", daemon=True)

    async def __aenter__(self) -> LoopWatchdog:
        self._loop_thread = threading.get_ident()
        self._last = time.monotonic()
        self._beat = asyncio.create_task(self._beats())
        self._thread.start()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.cancel()
        self._thread.join()

    async def _beats(self) -> None:
        while True:
            self._last = time.monotonic()
            await asyncio.sleep(BEAT_S)

    def _watch(self) -> None:
        reported = False  # this stall's stack was taken
        while not self._stop.wait(BEAT_S):
            held = time.monotonic() - self._last
            if held < self.stall_s:
                reported = False
            elif not reported:
                reported = True
                frame = sys._current_frames().get(self._loop_thread)
                stack = "".join(traceback.format_stack(frame)) if frame is not None else "?"
                self.stalls.append(stack)
                self.say(f"this client's event loop is held ({held:.1f} s so far), in:\n{stack}")
