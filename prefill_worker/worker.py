"""The prefill worker actor: computes an attempt's KV and first token, serves the KV to the
decode worker layer by layer, and holds it under a lease until the decode side is done with it.

::

    prefill(attempt) ── yields KVSource ───────────────> coordinator starts decode.decode()
        engine: chunked prefill; after the LAST chunk's forward writes layer l,
        the layer hook marks layer l ready ──> the KV server streams it to the puller
    ── yields the first token (handed_off) ─────────────> client (TTFT)
    ── waits: lease released by ACK | expiry | abort | peer death, then frees the blocks

The blocks stay referenced from allocation until the lease ends (the engine leases them when
the request hands off), so a served layer is never read from a reused block; a request that
ends otherwise fails the export first, and the puller discards what it got.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from cluster.worker import EngineWorker
from contracts.actors import PrefillAPI
from contracts.faults import Fault, FaultPoint
from contracts.messages import KVSource, WorkerInfo
from contracts.roles import Role
from engine.outputs import TokenDelta
from engine.request import EngineRequest, FinishReason
from kv_transfer.exporter import Export, KVExportRegistry, ReleaseReason
from kv_transfer.format import TransferHeader, TransferKey
from kv_transfer.grpc_transport import KVTransferServer


class PrefillWorker(EngineWorker):
    role = Role.PREFILL

    def __init__(self, *args: Any, lease_timeout_s: float = 30.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lease_timeout_s = lease_timeout_s
        self.registry = KVExportRegistry()
        self.registry.fault_hook = self._transfer_fault
        self.server = KVTransferServer(self.registry, host=self.host_address(), port=0)
        self.server.start()
        self._expiry: asyncio.Task[None] | None = None
        self._attempts: dict[TransferKey, int] = {}  # the attempt number of each export here

    def kv_address(self) -> str | None:
        return str(self.server.address)

    def leases_expired(self) -> int:
        return self.registry.releases[ReleaseReason.EXPIRED]

    def _transfer_fault(self, key: TransferKey, index: int) -> Fault | None:
        """The harness's fault due at KV stream message ``index`` (a CRASH ends the process
        here; the exporter applies the rest)."""
        return self.faults.check(FaultPoint.TRANSFER_CHUNK, self._attempts.get(key, 0), index)

    async def _expire_leases(self) -> None:
        """Leases whose deadline passed are released even if nobody comes back for them."""
        while True:
            self.registry.expire()
            await asyncio.sleep(1.0)

    async def ready(self) -> WorkerInfo:
        if self._expiry is None:
            self._expiry = asyncio.get_running_loop().create_task(self._expire_leases())
        return await super().ready()

    async def prefill(self, attempt: EngineRequest) -> AsyncGenerator[KVSource | TokenDelta, None]:
        """Yields the KVSource, then the first token as one TokenDelta (``finish_reason``
        HANDED_OFF when decode continues), then holds the lease until it ends."""
        self.faults.check(FaultPoint.ACCEPTED, attempt.attempt, 1)
        aid = attempt.key
        blocks: list[int] = []  # the block table, once the engine has scheduled the prompt
        loop = asyncio.get_running_loop()
        released = asyncio.Event()

        def on_release(reason: ReleaseReason) -> None:  # any thread, exactly once
            loop.call_soon_threadsafe(released.set)
            asyncio.run_coroutine_threadsafe(self._free_lease(aid), loop)

        tokens = attempt.prompt_token_ids + attempt.resume_output
        header = TransferHeader(
            key=TransferKey.of(attempt),
            layout=self.engine.kv.layout,
            num_blocks=math.ceil(len(tokens) / self.engine.kv.block_size),
            num_tokens=len(tokens),
            block_hashes=self.engine.kv.block_hashes(tokens, attempt.cache_salt),
            cache_salt=attempt.cache_salt,
            model_id=self.engine.kv.model_id,
            deadline=attempt.deadline or time.time() + self.lease_timeout_s,
        )
        self._attempts[header.key] = attempt.attempt
        export = self.registry.publish(
            header,
            source=lambda layer: self.engine.kv.read_layer(layer, blocks),
            lease_s=self.lease_timeout_s,
            on_release=on_release,
        )
        self.engine.kv.watch_layers(aid, self._layer_listener(export, attempt.attempt, blocks))
        handed_off = False
        try:
            yield KVSource(self.name, self.kv_address() or "")
            self._touch()
            first: TokenDelta | None = None
            async for delta in self.engine.generate(replace(attempt, prefill_only=True)):
                first = delta if first is None else first.then(delta)
            assert first is not None and first.finished  # a stream ends with finished=True
            handed_off = first.finish_reason is FinishReason.HANDED_OFF
            if not handed_off:
                export.fail(f"the request ended at its first token ({first.finish_reason})")
            yield first
            if handed_off:
                await released.wait()
        finally:
            self.engine.kv.unwatch_layers(aid)
            if not handed_off:
                export.fail("prefill did not hand off")
            self.registry.release(header.key, ReleaseReason.ABORTED)  # no-op once released
            self._attempts.pop(header.key, None)
            self._touch()

    def _layer_listener(
        self, export: Export, attempt: int, blocks: list[int]
    ) -> Callable[[int, list[int]], None]:
        """Engine thread: the attempt's last prompt chunk has written ``layer``: serve it."""

        def on_layer(layer: int, block_table: list[int]) -> None:
            if layer == 0:
                blocks[:] = block_table
            export.layer_ready(layer)
            self.faults.check(FaultPoint.PREFILL_LAYERS, attempt, layer + 1)

        return on_layer

    async def renew_lease(self, request_id: str, attempt_id: str) -> float | None:
        """The puller of this attempt's KV is alive and will pull (its request may be parked
        for room): the lease goes on. Its length, or None if it is gone."""
        return self.registry.renew(TransferKey(request_id, attempt_id))

    async def _free_lease(self, attempt_id: str) -> None:
        await self.engine.kv.release(attempt_id)
        self._touch()


if TYPE_CHECKING:  # mypy checks that the actor serves its interface
    _: type[PrefillAPI] = PrefillWorker
