"""One request's bounded output buffer between the engine thread and a consumer's event loop
(``engine.async_engine``'s streams; docs/design.md#backpressure).

The engine thread pushes one tick's deltas as one entry; once the buffer holds ``capacity``
entries it asks the engine to pause the request (BACKPRESSURED) and folds what still comes into
the newest entry (``TokenDelta.then``), so the bound is exact; the consumer asks for a resume
once it has drained the buffer below half.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque

from engine.outputs import TokenDelta
from engine.request import fork_id


def merge(older: list[TokenDelta], newer: list[TokenDelta]) -> list[TokenDelta]:
    """Fold one tick's deltas into the entry before it, sample by sample."""
    merged = {o.index: o for o in older}
    for o in newer:
        prev = merged.get(o.index)
        merged[o.index] = o if prev is None else prev.then(o)
    return list(merged.values())


class RequestStream:
    """One request's bounded output buffer: the engine thread pushes, the event loop pops."""

    def __init__(
        self, request_id: str, n: int, loop: asyncio.AbstractEventLoop, capacity: int
    ) -> None:
        self.request_id = request_id
        # The scheduler's ids of the n sequences: the parent is sample 0.
        self.seq_ids = [request_id] + [fork_id(request_id, i) for i in range(1, n)]
        self.loop = loop
        self.capacity = capacity
        self.done = False  # the consumer saw the end or an error (event loop only)
        self._lock = threading.Lock()
        self._entries: deque[list[TokenDelta]] = deque()
        self._closed = False
        self._error: BaseException | None = None
        self._paused = False  # changed by the engine thread only, under the lock
        self._resume_asked = False
        self._wakeup = asyncio.Event()

    # -- engine thread --

    def push(self, entry: list[TokenDelta]) -> tuple[int, bool]:
        """Buffer one tick's deltas; the caller wakes the consumer (:func:`wake_all`).
        Returns (depth, whether this push filled it: pause now)."""
        with self._lock:
            if len(self._entries) < self.capacity:
                self._entries.append(entry)
            else:
                self._entries[-1] = merge(self._entries[-1], entry)
            depth = len(self._entries)
            pause = depth >= self.capacity and not self._paused
            self._paused |= pause
        return depth, pause

    def take_resume(self) -> bool:
        """Whether the consumer has drained a paused buffer below half (then unpause it)."""
        with self._lock:
            self._resume_asked = False
            resume = self._paused and 2 * len(self._entries) < self.capacity
            self._paused &= not resume
            return resume

    def end(self, error: BaseException | None = None) -> None:
        """No more entries; the consumer raises ``error`` once it has drained the buffer."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._error = error
        self._wake()

    def _wake(self) -> None:
        wake_all([self])

    # -- event loop --

    async def get(self) -> tuple[list[TokenDelta] | None, bool]:
        """The next entry (None at the end) and whether to ask the engine to resume."""
        while True:
            self._wakeup.clear()  # before looking: a push after the look sets it again
            with self._lock:
                if self._entries:
                    entry = self._entries.popleft()
                    ask = self._paused and not self._resume_asked
                    ask &= 2 * len(self._entries) < self.capacity
                    self._resume_asked |= ask
                    return entry, ask
                if self._closed:
                    self.done = True
                    if self._error is not None:
                        raise self._error
                    return None, False
            await self._wakeup.wait()


def wake_all(streams: list[RequestStream]) -> None:
    """Wake the consumers of ``streams``: one call into each event loop, not one per stream
    (a tick feeds every request of the batch; a wake-up each would be a syscall and a loop
    iteration each, taken from the cores the next step computes on)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Event]] = {}
    for stream in streams:
        by_loop.setdefault(stream.loop, []).append(stream._wakeup)
    for loop, events in by_loop.items():
        if loop.is_closed():
            continue  # the consumer's loop is gone; the engine thread aborts the request
        try:
            loop.call_soon_threadsafe(_set_all, events)
        except RuntimeError:
            pass  # closed between the check and the call


def _set_all(events: list[asyncio.Event]) -> None:
    for event in events:
        event.set()
