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
from collections.abc import AsyncGenerator
from typing import Any

from cluster.faults import FaultAction, FaultPoint
from cluster.messages import Attempt, KVSource, TokenBatch, WorkerInfo
from cluster.roles import Role
from cluster.worker import EngineWorker
from engine.batch import SchedulerOutput
from engine.kv_cache_manager import prefix_hashes
from kv_transfer.exporter import FaultAction as TransferFault
from kv_transfer.exporter import FaultKind, KVExportRegistry, ReleaseReason
from kv_transfer.format import KVLayout, TransferHeader, TransferKey, extract_layer
from kv_transfer.grpc_transport import KVTransferServer

_TRANSFER_FAULTS = {
    FaultAction.CORRUPT: FaultKind.CORRUPT,
    FaultAction.TRUNCATE: FaultKind.TRUNCATE,
    FaultAction.DROP: FaultKind.DROP,
    FaultAction.RAISE: FaultKind.CLOSE,
}


class PrefillWorker(EngineWorker):
    role = Role.PREFILL

    def __init__(self, *args: Any, lease_timeout_s: float = 30.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lease_timeout_s = lease_timeout_s
        runner = self.engine.engine.runner
        self.layout = KVLayout.from_cache(runner.kv_cache)
        self.registry = KVExportRegistry()
        self.registry.fault_hook = self._transfer_fault
        self.server = KVTransferServer(self.registry, host="127.0.0.1", port=0)
        self.server.start()
        # attempt id -> (export, attempt number, block table once scheduled); the engine
        # thread reads it in the layer hook, the event loop adds and removes entries.
        self._exports: dict[str, tuple[Any, int, list[int]]] = {}
        runner.layer_hook = self._on_layer
        self._expiry: asyncio.Task[None] | None = None

    def kv_address(self) -> str | None:
        return str(self.server.address)

    def _on_layer(self, layer: int, out: SchedulerOutput) -> None:
        """Engine thread: the step's last chunks of exported attempts have layer ``layer``."""
        for chunk in out.chunks:
            entry = self._exports.get(chunk.request_id)
            if entry is None or not chunk.sample:
                continue
            export, number, blocks = entry
            if layer == 0:
                blocks[:] = chunk.block_table
            export.layer_ready(layer)
            self.faults.check(FaultPoint.PREFILL_LAYERS, number, layer + 1)

    def _transfer_fault(self, key: TransferKey, index: int) -> TransferFault | None:
        """The harness's transfer faults, in the exporter's terms (index 0 = header,
        1..layers = the layer chunks, then the trailer)."""
        number = int(key.attempt_id.rpartition("@")[2] or 0)
        fault = self.faults.take(FaultPoint.TRANSFER_CHUNK, number, index)
        if fault is None:
            return None
        if fault.action is FaultAction.STALL:
            return TransferFault(FaultKind.DELAY, fault.seconds)
        return TransferFault(_TRANSFER_FAULTS[fault.action])

    async def _expire_leases(self) -> None:
        """Leases whose deadline passed are released even if nobody comes back for them."""
        while True:
            self.registry.expire()
            await asyncio.sleep(1.0)

    async def ready(self) -> WorkerInfo:
        if self._expiry is None:
            self._expiry = asyncio.get_running_loop().create_task(self._expire_leases())
        return await super().ready()

    async def prefill(self, attempt: Attempt, transport: str) -> AsyncGenerator[Any, None]:
        """Yields the KVSource, then the first token as a TokenBatch (``finish_reason``
        "handed_off" when decode continues), then holds the lease until it ends."""
        spec = attempt.request
        aid = attempt.attempt_id
        kv_cache = self.engine.engine.runner.kv_cache
        blocks: list[int] = []
        loop = asyncio.get_running_loop()
        released = asyncio.Event()

        def on_release(reason: ReleaseReason) -> None:  # any thread, exactly once
            loop.call_soon_threadsafe(released.set)
            asyncio.run_coroutine_threadsafe(self._free_lease(aid), loop)

        tokens = spec.prompt_token_ids + attempt.resume_output
        header = TransferHeader(
            key=TransferKey(spec.request_id, aid),
            layout=self.layout,
            num_blocks=math.ceil(len(tokens) / self.block_size),
            num_tokens=len(tokens),
            block_hashes=prefix_hashes(
                tokens, self.block_size, spec.cache_salt, self.engine.engine.kv.model_id
            ),
            cache_salt=spec.cache_salt,
            model_id=self.engine.engine.kv.model_id,
            deadline=spec.deadline or time.time() + self.lease_timeout_s,
        )
        export = self.registry.publish(
            header,
            source=lambda layer: extract_layer(kv_cache, layer, blocks),
            lease_deadline=time.time() + self.lease_timeout_s,
            on_release=on_release,
        )
        self._exports[aid] = (export, attempt.number, blocks)
        handed_off = False
        try:
            yield KVSource(self.name, self.kv_address() or "", transport)
            self._touch()
            outs = [
                out
                async for out in self.engine.generate(
                    spec.prompt_token_ids,
                    spec.params,
                    request_id=aid,
                    deadline=spec.deadline,
                    cache_salt=spec.cache_salt,
                    prefill_only=True,
                    resume_output=attempt.resume_output,
                    sampler_snapshot=attempt.sampler_snapshot,
                )
            ]
            final = outs[-1]
            handed_off = final.finish_reason == "handed_off"
            if not handed_off:
                export.fail(f"the request ended at its first token ({final.finish_reason})")
            logprobs = [lp for o in outs for lp in o.logprobs or []]
            yield TokenBatch(
                token_ids=[t for o in outs for t in o.token_ids],
                finished=True,
                finish_reason=final.finish_reason,
                sampler_snapshot=final.sampler_snapshot,
                logprobs=logprobs if attempt.request.params.logprobs is not None else None,
                queue_time_s=next(
                    (o.queue_time_s for o in outs if o.queue_time_s is not None), None
                ),
            )
            if handed_off:
                await released.wait()
        finally:
            self._exports.pop(aid, None)
            if not handed_off:
                export.fail("prefill did not hand off")
            self.registry.release(header.key, ReleaseReason.ABORTED)  # no-op once released
            self._touch()

    async def _free_lease(self, attempt_id: str) -> None:
        await self.engine.call(lambda e: e.release_kv(attempt_id))
        self._touch()
