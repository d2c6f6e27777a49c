"""Both ends of the token stream from a worker to a coordinator (``WorkerAPI.subscribe``): one
stream per (worker, coordinator), not one per attempt. The worker's end is an :class:`Outbox` per
coordinator, where each attempt's deltas merge until the stream takes them; the coordinator's end
is a :class:`Hub` per worker, which demultiplexes them into one :class:`Inbox` per attempt.

::

    worker       attempts ──> Outbox ── one Ray message per wake-up ──┐
                                [(attempt, [delta, error?]), ...]       │
    coordinator  Inbox(attempt a)   Inbox(attempt b)   ...   <── Hub ───┘ (demultiplexes)

One message per engine step instead of one per token per request: at batch 64 the per-token way
spends more CPU in Ray than the engine spends computing (docs/benchmarks.md#served-path).

Flow control per attempt: an inbox holding ``PAUSE_AT`` undelivered batches asks its worker to
stop taking the attempt's tokens (``pace``), and to go on once its reader has taken it down to
``RESUME_AT``; paused long enough, the worker's engine pauses the request (BACKPRESSURED). A
worker whose stream fails (its death) or that the router marks FAILED fails every inbox it
feeds: their readers raise at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

import ray

from contracts.actors import WorkerClient
from contracts.messages import Delivery
from engine.outputs import TokenDelta

logger = logging.getLogger(__name__)
PAUSE_AT = 8  # undelivered batches of one attempt before its worker is asked to pause it
RESUME_AT = 2


# -- the worker's end ---------------------------------------------------------------------------


class Outbox:
    """What one coordinator has not received yet: per attempt, its batches merged into one,
    then the exception that ended it there, if any."""

    def __init__(self) -> None:
        self.pending: dict[str, list[TokenDelta | Exception]] = {}
        self.ready = asyncio.Event()

    def put(self, attempt_id: str, item: TokenDelta | Exception) -> None:
        items = self.pending.setdefault(attempt_id, [])
        if items and isinstance(item, TokenDelta) and isinstance(items[-1], TokenDelta):
            items[-1] = items[-1].then(item)
        else:
            items.append(item)
        self.ready.set()

    def take(self) -> list[Delivery]:
        taken, self.pending = self.pending, {}
        self.ready.clear()
        return list(taken.items())


# -- the coordinator's end ----------------------------------------------------------------------


class Inbox:
    """One attempt's batches from its worker, in order; ``get`` raises what ended it there."""

    def __init__(self, pace: Callable[[bool], None]) -> None:
        self._items: deque[TokenDelta | BaseException] = deque()
        self._ready = asyncio.Event()
        self._pace = pace
        self._paused = False

    def put(self, items: list[TokenDelta | Exception]) -> None:
        self._items.extend(items)
        self._ready.set()
        if not self._paused and len(self._items) >= PAUSE_AT:
            self._paused = True
            self._pace(True)

    def fail(self, error: BaseException) -> None:
        """Nothing more will come: the reader raises ``error`` after what came before."""
        self._items.append(error)
        self._ready.set()

    async def get(self) -> TokenDelta:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        if self._paused and len(self._items) <= RESUME_AT:
            self._paused = False
            self._pace(False)
        if isinstance(item, BaseException):
            self._items.appendleft(item)  # it stays the answer
            raise item
        return item


class Hub:
    """One worker's token stream to this coordinator (``consumer``), read while attempts
    there have open inboxes."""

    def __init__(self, name: str, worker: WorkerClient, consumer: str) -> None:
        self.name = name
        self.worker = worker
        self.consumer = consumer
        self.inboxes: dict[str, Inbox] = {}
        self._task: asyncio.Task[None] | None = None
        self._calls: set[asyncio.Task[None]] = set()

    def open(self, attempt_id: str) -> Inbox:
        """The inbox of an attempt about to start on this worker (before its start call, so
        nothing it sends is missed)."""
        inbox = Inbox(lambda paused: self._call(self.worker.pace(attempt_id, paused)))
        self.inboxes[attempt_id] = inbox
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._read())
        return inbox

    def close(self, attempt_id: str, stop: bool) -> None:
        """The attempt is over for the coordinator; ``stop``: it may still run on the worker,
        which is told to cancel it."""
        self.inboxes.pop(attempt_id, None)
        if stop:
            self._call(self.worker.stop(attempt_id))

    def fail(self, error: BaseException) -> None:
        """The worker failed (the router says so): every attempt it feeds fails with ``error``
        (its readers raise it), and its stream is dropped -- the next attempt here (on its
        restarted process) subscribes anew, so the old stream's late error cannot reach it."""
        self._fail_inboxes(error)
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def _fail_inboxes(self, error: BaseException) -> None:
        for inbox in self.inboxes.values():
            inbox.fail(error)
        self.inboxes.clear()

    async def _read(self) -> None:
        while self.inboxes:
            stream = self.worker.subscribe(self.consumer)
            try:
                async for ref in stream:
                    deliveries: list[Delivery] = await ref
                    for attempt_id, items in deliveries:
                        inbox = self.inboxes.get(attempt_id)
                        if inbox is not None:  # else: a late message of a closed attempt
                            inbox.put(items)
            except Exception as exc:  # its death (RayActorError), or the stream broke
                logger.warning("token stream of %s failed: %r", self.name, exc)
                self._fail_inboxes(exc)
                await asyncio.sleep(0.1)  # Ray restarts it; new attempts subscribe again
            finally:
                ray.cancel(stream)  # a stream its reader left would run on (cancelled: no-op)

    def _call(self, ref: object) -> None:
        """Send a call without waiting for it (its failure is the stream's to report)."""

        async def settle() -> None:
            try:
                await ref  # type: ignore[misc]
            except Exception:
                logger.debug("call to %s failed", self.name, exc_info=True)

        task = asyncio.ensure_future(settle())
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)
