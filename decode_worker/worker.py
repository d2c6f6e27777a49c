"""The decode worker actor: reserves blocks for an attempt, pulls its KV from the prefill worker
(checked block by block), then continues the request in its continuous batch.

::

    reserve(attempt):   before the prefill starts (the coordinator waits for it)
        import_request  -> a batch slot and the blocks held, request WAITING_FOR_KV (it waits
                           here for room if the router's admission raced the engine's reclaim)
    start_decode(attempt, source, consumer):
        the reservation taken (none: a worker restarted since -- import_request now, which
                           parks the import until there is room)
        pull            -> each verified layer written into those blocks (overlaps the prefill)
        ack             -> the prefill worker frees its lease
        handoff(token)  <- the first token and sampler state, relayed by the coordinator
        finish_import   -> DECODING; tokens 2.. to the consumer's stream (subscribe)

A reservation is released by ``stop`` (the attempt ended elsewhere: cancel, fault) or, unused,
after RESERVATION_TTL_S (its coordinator is gone; one still alive, its prefill slower than that,
has its import admitted anew once the release is done: the attempt then has two engine records,
CANCELLED and its own). A pull that fails (corrupt, truncated, peer
gone, deadline) fails the import: the request ends FAILED through the one reclaim path and the
error names the prefill worker, so the coordinator retries elsewhere. It can also serve whole requests (``start_generate``): the local prefill of
short uncached prompts, where disaggregation costs more than it saves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

import ray

from cluster.worker import EngineWorker
from contracts.actors import DecodeAPI, WorkerClient
from contracts.faults import FaultPoint
from contracts.messages import KVPullFailed, KVSource, TransferRecord
from contracts.roles import Role, Transport
from engine.outputs import TokenDelta
from engine.request import EngineRequest
from kv_transfer.errors import KVPeerUnavailable, KVTransferAborted, KVTransferError
from kv_transfer.exporter import ReleaseReason
from kv_transfer.format import LayerChunk, TransferKey
from kv_transfer.transport import make_transport

TRANSFER_RECORDS_KEPT = 10_000
# An unused reservation (its coordinator died between reserve and start_decode) is released
# after this; a prefill slower than that still decodes here, its import admitted anew.
RESERVATION_TTL_S = 120.0
logger = logging.getLogger(__name__)


_Imported = tuple[list[int], AsyncGenerator[TokenDelta, None]]  # blocks, stream


class DecodeWorker(EngineWorker):
    role = Role.DECODE

    def __init__(self, *args: Any, transport: Transport = Transport.GRPC, **kwargs: Any) -> None:
        """``transport``: what this worker pulls KV over (the topology's, resolved)."""
        super().__init__(*args, **kwargs)
        self.transport_kind = Transport(transport)
        self.transport = make_transport(
            self.transport_kind, puller_id=self.name, host=self.host_address()
        )
        self._handoffs: dict[str, asyncio.Future[TokenDelta]] = {}
        # Attempts reserved before their prefill: being admitted, and admitted (with the
        # timer that releases an unused one).
        self._reserving: dict[str, asyncio.Task[Any]] = {}
        self._reserved: dict[str, tuple[_Imported, asyncio.TimerHandle]] = {}
        # Reservations being released (their engine request not yet reclaimed): an import of
        # the same attempt waits for it, or its id would clash with the ending one.
        self._releasing: dict[str, asyncio.Future[None]] = {}
        # The latest pulls (bounded: a long-running worker keeps only these).
        self.transfers: deque[TransferRecord] = deque(maxlen=TRANSFER_RECORDS_KEPT)
        self._transfer_seq = 0

    def _handoff(self, attempt_id: str) -> asyncio.Future[TokenDelta]:
        if attempt_id not in self._handoffs:
            self._handoffs[attempt_id] = asyncio.get_running_loop().create_future()
        return self._handoffs[attempt_id]

    async def handoff(self, attempt_id: str, first: TokenDelta) -> None:
        """The prefill's first token and sampler state for ``attempt_id``."""
        future = self._handoff(attempt_id)
        if not future.done():
            future.set_result(first)

    async def reserve(self, attempt: EngineRequest) -> None:
        """Hold a batch slot and ``attempt``'s KV blocks in the engine before its prefill
        starts: returns once they are held (waiting for room here, up to the attempt's deadline,
        so a prefill's KV never waits leased for room). Raises as the engine's admission does
        (NoRoom at the deadline, RequestRejected)."""
        aid = attempt.key
        self.faults.check(FaultPoint.ACCEPTED, attempt.attempt, 1)  # reached, none computed
        # stop() cancels this call: waiting, or admitted but not yet resumed here, the
        # import's own cancellation aborts the request in the engine.
        task = asyncio.current_task()
        assert task is not None  # an actor call runs as a task
        self._reserving[aid] = task
        try:
            imported = await self.engine.import_request(attempt, reservation=True)
        finally:
            self._reserving.pop(aid, None)
        timer = asyncio.get_running_loop().call_later(
            RESERVATION_TTL_S, lambda: asyncio.ensure_future(self._release(aid))
        )
        self._reserved[aid] = (imported, timer)
        self._touch()

    async def stop(self, attempt_id: str) -> None:
        """Cancel the attempt; a reservation it holds or waits for goes too."""
        if (task := self._reserving.pop(attempt_id, None)) is not None:
            task.cancel()
        await self._release(attempt_id)
        await super().stop(attempt_id)

    async def _release(self, attempt_id: str) -> None:
        """Give an unused reservation's slot and blocks back (the request is cancelled)."""
        held = self._reserved.pop(attempt_id, None)
        if held is None:
            return
        held[1].cancel()
        released = self._releasing[attempt_id] = asyncio.get_running_loop().create_future()
        try:
            await self.engine.abort(attempt_id)
            async for _ in held[0][1]:  # ends (CANCELLED) once the engine reclaimed it
                pass
        except Exception:  # the engine died: its streams end with the error, nothing held
            logger.debug("%s: releasing %s", self.name, attempt_id, exc_info=True)
        finally:
            del self._releasing[attempt_id]
            released.set_result(None)

    async def start_decode(self, attempt: EngineRequest, source: KVSource, consumer: str) -> None:
        """Continue ``attempt`` here with its KV from ``source``; its tokens go to
        ``consumer``'s stream (:meth:`subscribe`)."""
        self._start(attempt, consumer, self._decode(attempt, source))

    async def _decode(
        self, attempt: EngineRequest, source: KVSource
    ) -> AsyncGenerator[TokenDelta, None]:
        """The attempt's tokens 2.. once its KV is pulled and its first token handed off."""
        aid = attempt.key
        handoff = self._handoff(aid)
        self._touch()
        lease = asyncio.get_running_loop().create_task(self._keep_lease(source, attempt))
        try:
            held = self._reserved.pop(aid, None)
            if held is not None:
                held[1].cancel()
            elif aid in self._releasing:  # its TTL ran out as the prefill ended: admit anew
                await asyncio.shield(self._releasing[aid])
            blocks, stream = held[0] if held else await self.engine.import_request(attempt)
            try:
                await self._pull(source, TransferKey.of(attempt), blocks, attempt.deadline)
                lease.cancel()
                first = await handoff
                await self.engine.kv.finish_import(
                    aid, next_token=first.token_ids[-1], sampler_snapshot=first.sampler_snapshot
                )
            except BaseException as exc:
                reason = f"KV import failed: {exc!r}"
                await asyncio.shield(self.engine.kv.finish_import(aid, error=reason))
                await stream.aclose()
                raise
            async with contextlib.aclosing(self._relay(stream, attempt)) as out:
                async for delta in out:
                    yield delta
        finally:
            lease.cancel()
            self._handoffs.pop(aid, None)
            self._touch()

    async def _keep_lease(self, source: KVSource, attempt: EngineRequest) -> None:
        """Renew the prefill worker's lease on ``attempt``'s KV until the pull is done: while
        the request waits here for room (parked) the KV stays leased to this live puller, so
        load alone never expires a lease; a puller that dies or hangs stops renewing."""
        try:
            prefill = WorkerClient(ray.get_actor(source.worker, namespace=self._namespace))
            while (lease_s := await prefill.renew_lease(attempt)) is not None:
                await asyncio.sleep(lease_s / 3)
        except asyncio.CancelledError:
            raise
        except Exception:  # the prefill worker is gone: the pull says so
            logger.debug("%s: lease renewal for %s ended", self.name, attempt.key, exc_info=True)

    async def _pull(
        self, source: KVSource, key: TransferKey, blocks: list[int], deadline: float | None
    ) -> None:
        """Pull and write every layer (in a thread: the transports block), then ack.

        Cancelled (the attempt stopped: its sender FAILED, the client gone), the pull's thread
        may still be waiting on the sender, and the caller frees ``blocks`` at once: from then
        on the sink writes nothing (a layer arriving late would land in blocks another request
        may hold) and ends the pull at its next chunk."""
        transport = self.transport
        closing = threading.Lock()
        closed = False

        def sink(chunk: LayerChunk) -> None:  # only verified chunks arrive here
            with closing:
                if closed:
                    raise KVTransferAborted(f"transfer {key}: the attempt was stopped")
                self.engine.kv.write_layer(chunk.layer, blocks, chunk.payload)

        started = time.time()
        try:
            header = await asyncio.to_thread(
                transport.pull, source.address, key, self.engine.kv.layout, sink, deadline
            )
        except KVTransferError as exc:
            dead = isinstance(exc, KVPeerUnavailable)
            message = f"pull from {source.worker}: {exc}"
            raise KVPullFailed(message, source.worker, dead, exc.kind) from exc
        except BaseException:
            with closing:  # a write in progress finishes first; none starts after
                closed = True
            raise
        done = time.time()
        await asyncio.to_thread(transport.release, source.address, key, ReleaseReason.ACKED)
        self._transfer_seq += 1
        self.transfers.append(
            TransferRecord(
                seq=self._transfer_seq,
                attempt_id=key.attempt_id,
                transport=self.transport_kind.value,
                num_bytes=header.layer_nbytes * self.engine.kv.layout.num_layers,
                started=started,
                finished=done,
            )
        )

    async def transfer_records(self, after: int = 0) -> list[TransferRecord]:
        """The completed pulls kept, those with ``seq > after`` (benchmarks, metrics)."""
        return [r for r in self.transfers if r.seq > after]


if TYPE_CHECKING:  # mypy checks that the actor serves its interface
    _: type[DecodeAPI] = DecodeWorker
