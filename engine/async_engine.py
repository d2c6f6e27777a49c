"""AsyncLLMEngine: the asyncio streaming interface over one LLMEngine, stepped by one thread.

::

    event loop (any number of consumers)            engine thread (the only one touching LLMEngine)
    generate() ──_Add / _Abort / _Resume──> command deque ──> drained at the start of each tick
        ^                                                             │ LLMEngine.step()
        └── RequestStream: bounded buffer <── push + loop.call_soon_threadsafe(wake) ┘

What a disaggregated worker needs beyond requests (KV layers, layer notifications, load and KV
events, imports, leases) is ``AsyncLLMEngine.kv``, a :class:`~engine.kv_surface.KVSurface`.

Error convention (STYLE 14): every error is *raised from the async iterator* — admission errors
(``RequestRejected``, ``ValueError``, ``InvalidSamplingParams``) from the first ``__anext__``,
:class:`EngineDeadError` from whichever ``__anext__`` comes after the engine died or shut down.
A stream that ends normally ends with ``finished=True`` on every one of its n sequences.

Backpressure (docs/design.md#backpressure, #cleanup): a request's buffer holds at most
``max_buffered_outputs`` entries (one entry = one tick's deltas of the request). When it fills,
the engine thread pauses the request (``Scheduler.set_backpressured``: no more tokens, KV kept)
and resumes it once the consumer has drained it below half. The few deltas a paused request can
still produce (its final output, a token after a recompute) are folded into the newest entry, so
the bound is exact.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from engine.admission import NoRoom
from engine.config import EngineConfig
from engine.engine import LLMEngine, RequestRejected
from engine.kv_cache_manager import KVStats
from engine.kv_surface import KVSurface
from engine.outputs import BackpressureStats, TokenDelta
from engine.request import EngineRequest, RecordLog, Request, SpecStats, TerminalRecord
from engine.request_stream import RequestStream, wake_all
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped (a step raised, or shutdown): no request can progress."""


@dataclass
class _Add:
    stream: RequestStream
    admit: Callable[[LLMEngine], Any]  # adds the request under stream.request_id
    admitted: asyncio.Future[Any] | None = None  # gets admit's result (or its exception)
    # On NoRoom: wait (parked) and try again after each tick, until this deadline, if any.
    wait_for_room: bool = False
    deadline: float | None = None
    parked: bool = False  # it has waited for room once (counted once)
    reservation: bool = False  # a decode slot held before the prefill (its wait: no KV leased)


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Resume:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]


_Command = _Add | _Abort | _Resume | _Call


class AsyncLLMEngine:
    """Streams requests of many asyncio consumers through one :class:`LLMEngine`.

    ``engine`` belongs to the engine thread: read it only while :meth:`wait_idle` holds or
    after :meth:`shutdown`. Thread-safe views: :meth:`kv_stats`, :meth:`records`. What a
    disaggregated worker needs beyond requests (the KV layout, reading and writing a layer's
    blocks, layer-ready notifications, load and KV events, finishing an import, releasing a
    lease) is the "worker surface" below: workers never reach into ``engine``.
    """

    def __init__(self, engine: LLMEngine, *, max_buffered_outputs: int = 64) -> None:
        if max_buffered_outputs < 1:
            raise ValueError(f"max_buffered_outputs={max_buffered_outputs}: must be >= 1")
        self.engine = engine
        self.max_buffered_outputs = max_buffered_outputs
        # Guarded by _cond: the command queue, the lifecycle flags and the idle waiters.
        self._cond = threading.Condition()
        self._commands: deque[_Command] = deque()
        self._stopping = False
        self._dead: str | None = None  # why the engine thread ended
        self._idle = False  # the engine thread sleeps with nothing it can do
        self._idle_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        # Engine-thread only.
        self._streams: dict[str, RequestStream] = {}
        self._parked: list[_Add] = []  # imports waiting for room (NoRoom), in arrival order
        self.imports_parked = 0  # imports that had to wait for room, ever (read anywhere)
        self.reservations_waited = 0  # reservations that had to wait for room, ever
        self._admitted: list[str] = []  # ids admitted since the last load() read
        self._stalled = False  # the last tick changed nothing (every live request paused)
        # Published by the engine thread after every tick, read by anyone.
        self._snap_lock = threading.Lock()
        self._kv_stats = engine.kv.stats()
        self._speculation = dataclasses.replace(engine.speculation)
        self._records: RecordLog[TerminalRecord] = RecordLog()
        self._records_seen = 0  # scheduler records copied into _records
        self._bp = BackpressureStats(0, 0, 0)
        self.kv = KVSurface(self)  # what a disaggregated worker needs beyond requests
        threads = engine.config.num_threads
        started = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(threads, started), name="tandem-engine", daemon=True
        )
        self._thread.start()
        started.wait()

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        config: EngineConfig | None = None,
        *,
        model_id: str | None = None,
        kv_events: bool = False,
        max_buffered_outputs: int = 64,
    ) -> AsyncLLMEngine:
        """Load a local checkpoint (see LLMEngine.from_checkpoint) and start the engine thread.
        ``kv_events``: record prefix-cache events for :meth:`load` (a router's index). With
        ``config.num_threads`` set, loading computes single-threaded (see EngineConfig)."""
        if config is not None and config.num_threads is not None:
            torch.set_num_threads(1)
        engine = LLMEngine.from_checkpoint(path, config, model_id=model_id)
        if kv_events:
            engine.kv.pool.record_events()
        return cls(engine, max_buffered_outputs=max_buffered_outputs)

    # -- the protocol --------------------------------------------------------------------------

    async def generate(self, request: EngineRequest) -> AsyncGenerator[TokenDelta, None]:
        """Stream a request's deltas as the engine produces them (all n samples, each ending
        with ``finished=True``). Leaving early (aclose, break, cancellation) aborts it.

        Raises: RequestRejected / ValueError / InvalidSamplingParams from the first
        ``__anext__`` when admission refuses it; EngineDeadError once the engine is dead.
        """
        rid = request.key
        stream = RequestStream(
            rid, request.params.n, asyncio.get_running_loop(), self.max_buffered_outputs
        )
        self._submit(_Add(stream, lambda engine: engine.add_request(request)))
        # aclosing: closing this generator closes _consume now, so its abort is submitted
        # before aclose() returns (not later, when the loop finalizes an orphaned generator).
        async with contextlib.aclosing(self._consume(stream)) as deltas:
            async for out in deltas:
                yield out

    async def import_request(
        self, request: EngineRequest, reservation: bool = False
    ) -> tuple[list[int], AsyncGenerator[TokenDelta, None]]:
        """Disaggregated decode side (:meth:`LLMEngine.add_imported`): returns the block ids
        to write the imported KV into and the request's stream, which starts once
        :meth:`finish_import` runs. Without room right now (NoRoom) it waits, admitted in
        arrival order after the ticks that free a slot and its blocks, until its deadline
        (then NoRoom is raised). Raises RequestRejected (a hard limit) / ValueError here.
        ``reservation``: made before the KV exists (its prefill not started): a wait for room
        counts in ``reservations_waited``, not ``imports_parked``."""
        rid = request.key
        loop = asyncio.get_running_loop()
        admitted: asyncio.Future[list[int]] = loop.create_future()
        stream = RequestStream(rid, request.params.n, loop, self.max_buffered_outputs)

        def admit(engine: LLMEngine) -> list[int]:
            return engine.add_imported(request)

        deadline = request.deadline
        add = _Add(stream, admit, admitted, True, deadline, reservation=reservation)
        self._submit(add)
        try:
            blocks = await admitted
        except BaseException:
            if not stream.done:  # cancelled while waiting: it may still be admitted
                self._submit(_Abort(rid))
            raise
        return blocks, self._consume(stream)

    def make_request(
        self, prompt: str | Sequence[int], params: SamplingParams, **fields: Any
    ) -> EngineRequest:
        """:meth:`LLMEngine.make_request` (the tokenizer is read-only: any thread)."""
        return self.engine.make_request(prompt, params, **fields)

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between two ticks; returns its result or
        raises its exception (EngineDeadError once the engine is dead). The engine package's
        own building block (the worker surface's methods use it) and a test hook; callers
        outside the engine use the named methods."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._submit(_Call(fn, loop, future))
        return await future

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    @property
    def numerics(self) -> str:
        """The model's numerics class (which workers may share a request)."""
        return self.engine.runner.numerics

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    def take_admitted(self) -> list[str]:
        """Engine thread: the ids admitted since the last call (the router's ledger stops
        counting them as promised-but-unseen)."""
        admitted, self._admitted = self._admitted, []
        return admitted

    async def check_idle(self) -> KVStats:
        """The leak check: wait until nothing runs, then every pool must be at baseline
        (raises KVInvariantError otherwise; leases still held count as leaks)."""
        await self.wait_idle()
        await self.call(lambda e: e.kv.check_idle())
        return self.kv_stats()

    async def _consume(self, stream: RequestStream) -> AsyncGenerator[TokenDelta, None]:
        rid = stream.request_id
        try:
            while True:
                entry, ask_resume = await stream.get()
                if ask_resume:
                    self._submit(_Resume(rid))
                if entry is None:
                    return
                for out in entry:
                    yield out
        finally:
            if not stream.done:
                self._submit(_Abort(rid))  # no await here: this may run under GeneratorExit

    async def abort(self, request_id: str) -> None:
        """Cancel a request; its stream ends with FinishReason.CANCELLED. Unknown ids: no-op."""
        self._submit(_Abort(request_id))

    def kv_stats(self) -> KVStats:
        """The KV pools as of the end of the last tick (thread-safe snapshot)."""
        with self._snap_lock:
            return self._kv_stats

    def speculation(self) -> SpecStats:
        """Every request's drafts so far, summed (a snapshot as of the last tick)."""
        with self._snap_lock:
            return self._speculation

    def records(self) -> list[TerminalRecord]:
        """The latest terminal records (up to ``RECORDS_KEPT``), in order (a copy)."""
        with self._snap_lock:
            return list(self._records)

    def backpressure_stats(self) -> BackpressureStats:
        with self._snap_lock:
            return self._bp

    async def wait_idle(self) -> None:
        """Return once the engine thread sleeps with no command pending: every request has
        ended, or each live one is paused (or the engine is dead). Meant for tests."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._cond:
            if self._idle and not self._commands:  # after death: set once cleanup is done
                return
            self._idle_waiters.append((loop, future))
        await future

    def shutdown(self) -> None:
        """Stop the engine thread after its current tick; requests in flight end FAILED and
        their consumers raise EngineDeadError("shutdown"). Idempotent."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def __enter__(self) -> AsyncLLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    async def __aenter__(self) -> AsyncLLMEngine:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()

    def _submit(self, command: _Command) -> None:
        with self._cond:
            if self._dead is None:
                self._commands.append(command)
                self._idle = False
                self._cond.notify()
                return
            reason = self._dead
        _refuse(command, EngineDeadError(reason))

    # -- the engine thread ---------------------------------------------------------------------

    def _run(self, threads: int | None, started: threading.Event) -> None:
        if threads is not None:
            torch.set_num_threads(threads)  # this thread's OpenMP team (EngineConfig.num_threads)
        started.set()
        reason, cause = "shutdown", None
        try:
            while (commands := self._wait_for_work()) is not None:
                for command in commands:
                    self._apply(command)
                if self.engine.has_unfinished():
                    before = self._progress()
                    self._dispatch(self.engine.step())
                    self._stalled = self._progress() == before
                    self.engine.finished_outputs()  # the offline API's copies: not kept here
                self._retry_parked()  # after the tick that may have freed their room
                self._publish()
        except Exception as exc:
            logger.exception("engine step failed; failing every request in flight")
            reason, cause = f"engine step failed: {exc!r}", exc
        self._terminate(reason, cause)

    def _wait_for_work(self) -> list[_Command] | None:
        """Sleep until a command comes, a deadline is due or the last tick made progress.
        Returns the commands to apply, or None on shutdown."""
        with self._cond:
            while not self._commands and not self._stopping:
                timeout = self._sleep_for()
                if timeout == 0.0:
                    break
                self._set_idle()
                if not self._cond.wait(timeout) and timeout is not None:
                    break  # a deadline is due: tick so the scheduler times the request out
            self._idle = False
            if self._stopping:
                return None
            commands = list(self._commands)
            self._commands.clear()
            return commands

    def _sleep_for(self) -> float | None:
        """0 while there is work, else how long to sleep (None: until a command comes)."""
        parked = [c.deadline for c in self._parked if c.deadline is not None]
        if not self.engine.has_unfinished() and not parked:
            return None
        if self.engine.has_unfinished() and not self._stalled:
            return 0.0
        deadlines = [r.deadline for r in self._live_requests() if r.deadline is not None]
        deadlines += parked
        if not deadlines:
            return None
        # A far deadline (a client's huge timeout) must not overflow Condition.wait.
        return min(max(0.0, min(deadlines) - time.time()), threading.TIMEOUT_MAX)

    def _set_idle(self) -> None:
        """Under _cond: mark the thread asleep and release wait_idle() callers."""
        self._idle = True
        waiters, self._idle_waiters = self._idle_waiters, []
        for loop, future in waiters:
            try:
                loop.call_soon_threadsafe(_resolve, future)
            except RuntimeError:
                pass  # that caller's loop has closed

    def _apply(self, command: _Command) -> None:
        if isinstance(command, _Add):
            self._add(command)
            return
        if isinstance(command, _Call):
            try:
                result = command.fn(self.engine)
            except Exception as exc:
                _settle(command.loop, command.future, error=exc)
            else:
                _settle(command.loop, command.future, result=result)
            return
        stream = self._streams.get(command.request_id)
        if stream is None:
            if isinstance(command, _Abort):
                self._unpark(command.request_id, RequestRejected("cancelled waiting for room"))
            return  # unknown or already ended
        if isinstance(command, _Abort):
            for sid in stream.seq_ids:
                self.engine.abort(sid)
        elif stream.take_resume():
            self._set_backpressured(stream, False)

    def _add(self, command: _Add) -> None:
        stream = command.stream
        if stream.request_id in self._streams:  # its n > 1 samples may still be running
            stream.end(ValueError(f"duplicate request id {stream.request_id!r}"))
            return
        if any(c.stream.request_id == stream.request_id for c in self._parked):
            stream.end(ValueError(f"duplicate request id {stream.request_id!r}"))
            return
        self._admit(command)

    def _admit(self, command: _Add) -> bool:
        """Run the command's admission; False when it was parked (NoRoom, waiting allowed)."""
        stream = command.stream
        try:
            result = command.admit(self.engine)
        except NoRoom as exc:
            if command.wait_for_room:
                if command.reservation:
                    self.reservations_waited += not command.parked
                else:
                    self.imports_parked += not command.parked
                command.parked = True
                self._parked.append(command)
                return False
            _refuse(command, exc)
            return True
        except (RequestRejected, ValueError) as exc:
            _refuse(command, exc)  # raised from the consumer's first __anext__ (or the await)
            return True
        self._streams[stream.request_id] = stream
        self._admitted.append(stream.request_id)
        if command.admitted is not None:
            _settle(stream.loop, command.admitted, result=result)
        return True

    def _retry_parked(self) -> None:
        """Offer parked imports again, in arrival order (the first that still finds no room
        keeps the rest waiting behind it); those past their deadline are refused."""
        now = time.time()
        for command in list(self._parked):
            if command.deadline is not None and now >= command.deadline:
                why = "its deadline passed while it waited for room"
                self._unpark(command.stream.request_id, NoRoom(why))
        while self._parked:
            command = self._parked.pop(0)
            if not self._admit(command):  # parked again, at the end: put it back in front
                self._parked.insert(0, self._parked.pop())
                return

    def _unpark(self, request_id: str, error: BaseException) -> None:
        for command in [c for c in self._parked if c.stream.request_id == request_id]:
            self._parked.remove(command)
            _refuse(command, error)

    def _dispatch(self, outputs: list[TokenDelta]) -> None:
        """Hand each request its tick's deltas; pause full buffers; close ended streams."""
        entries: dict[str, list[TokenDelta]] = {}
        for out in outputs:
            entries.setdefault(out.request_id, []).append(out)
        woken = []
        for rid, entry in entries.items():
            stream = self._streams[rid]
            depth, pause = stream.push(entry)
            woken.append(stream)
            if depth > self._bp.max_buffered:
                self._count(max_buffered=depth)
            if pause:
                self._set_backpressured(stream, True)
            if stream.loop.is_closed():
                for sid in stream.seq_ids:  # its consumer is gone without closing the stream
                    self.engine.abort(sid)
            scheduler = self.engine.scheduler
            ended = any(o.finished for o in entry)
            if ended and all(scheduler.get_request(sid) is None for sid in stream.seq_ids):
                del self._streams[rid]
                stream.end()
        wake_all(woken)

    def _set_backpressured(self, stream: RequestStream, on: bool) -> None:
        for sid in stream.seq_ids:
            self.engine.scheduler.set_backpressured(sid, on)
        if on:
            self._count(pauses=self._bp.pauses + 1)
        else:
            self._count(resumes=self._bp.resumes + 1)

    def _count(self, **changes: int) -> None:
        with self._snap_lock:
            self._bp = dataclasses.replace(self._bp, **changes)

    def _live_requests(self) -> list[Request]:
        get = self.engine.scheduler.get_request
        found = (get(sid) for s in self._streams.values() for sid in s.seq_ids)
        return [r for r in found if r is not None]

    def _progress(self) -> list[tuple[Any, ...]]:
        """What a tick can change; equal before and after a tick means the next one (with no
        command in between and no deadline due) would change nothing either."""
        return [
            (r.request_id, r.status, r.num_computed_tokens, r.num_tokens)
            for r in self._live_requests()
        ]

    def _publish(self) -> None:
        stats = self.engine.kv.stats()
        records = self.engine.scheduler.records
        fresh, self._records_seen = records.since(self._records_seen), records.total
        with self._snap_lock:
            self._kv_stats = stats
            self._speculation = dataclasses.replace(self.engine.speculation)
            for record in fresh:
                self._records.append(record)

    def _terminate(self, reason: str, cause: Exception | None) -> None:
        """Fail every request (docs/design.md#cleanup FAILED, through the one reclaim path) and
        every stream."""
        with self._cond:
            self._dead = reason  # from now on _submit refuses commands
            self._idle = False
            pending = list(self._commands)
            self._commands.clear()
        for command in [*pending, *self._parked]:
            _refuse(command, EngineDeadError(reason))
        self._parked.clear()
        try:
            self.engine.fail_all(reason)
            self._publish()
        except Exception:
            logger.exception("cleanup after the engine stopped failed; KV may be leaked")
        for stream in self._streams.values():
            error = EngineDeadError(reason)
            error.__cause__ = cause
            stream.end(error)
        self._streams.clear()
        with self._cond:
            self._set_idle()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _settle(
    loop: asyncio.AbstractEventLoop,
    future: asyncio.Future[Any],
    result: Any = None,
    error: BaseException | None = None,
) -> None:
    """Complete ``future`` from the engine thread (no-op if its caller left or its loop is
    closed)."""

    def done() -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    try:
        loop.call_soon_threadsafe(done)
    except RuntimeError:
        pass  # that caller's loop has closed


def _refuse(command: _Command, error: BaseException) -> None:
    """A command that will never run: its waiter gets ``error``."""
    if isinstance(command, _Add):
        command.stream.end(error)
        if command.admitted is not None:
            _settle(command.stream.loop, command.admitted, error=error)
    elif isinstance(command, _Call):
        _settle(command.loop, command.future, error=error)
