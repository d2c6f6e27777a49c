"""What a disaggregated worker needs of an engine beyond requests: the KV layout, reading and
writing a layer's blocks, layer-ready notifications, the load and prefix-cache events for the
router, finishing an import, ending a lease. Workers reach the engine only through this and
:class:`~engine.async_engine.AsyncLLMEngine`'s request methods, never through its ``engine``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.batch import SchedulerOutput
from engine.engine import LLMEngine
from engine.kv_cache_manager import prefix_hashes
from engine.kv_events import KVEvent, KVEventKind
from engine.kv_layout import KVLayout, extract_layer, write_layer
from engine.outputs import SamplingSnapshot

if TYPE_CHECKING:
    from engine.async_engine import AsyncLLMEngine


@dataclass(frozen=True)
class EngineLoad:
    """What a worker reports to the router: its queue, its batch, the KV blocks its requests
    claim (reserved or held, leases included), the requests admitted since the last read, and
    the prefix-cache events since then (or, for a resync, CLEARED then everything cached now)."""

    num_waiting: int
    num_running: int
    kv_events: list[KVEvent]
    claimed_blocks: int = 0
    admitted: list[str] = dataclasses.field(default_factory=list)


# Called on the engine thread with (layer, the request's block table) once the forward of the
# request's last prompt chunk has written that layer's KV.
LayerListener = Callable[[int, list[int]], None]


class KVSurface:
    """The KV and lease side of one :class:`AsyncLLMEngine` (``AsyncLLMEngine.kv``)."""

    def __init__(self, engine: AsyncLLMEngine) -> None:
        self._engine = engine
        # request id -> listener; added and removed on the event loop, read by the engine thread
        # (single dict operations, atomic in CPython).
        self._layer_listeners: dict[str, LayerListener] = {}

    @property
    def layout(self) -> KVLayout:
        return self._engine.engine.runner.kv_layout

    @property
    def block_size(self) -> int:
        return self._engine.engine.config.block_size

    @property
    def num_kv_blocks(self) -> int:
        return self._engine.engine.kv.pool.num_blocks

    @property
    def model_id(self) -> str:
        return self._engine.engine.kv.model_id

    def block_hashes(self, token_ids: Sequence[int], cache_salt: str) -> list[int]:
        """The prefix-cache hashes of ``token_ids``' full blocks, as this engine keys them."""
        return prefix_hashes(token_ids, self.block_size, cache_salt, self.model_id)

    def read_layer(self, layer: int, block_ids: Sequence[int]) -> torch.Tensor:
        """One layer of ``block_ids``' KV (a copy). Any thread, for blocks the caller holds
        (leased, or reserved for its import): the engine neither writes nor frees them then."""
        return extract_layer(self._engine.engine.runner.kv_cache, layer, block_ids)

    def write_layer(self, layer: int, block_ids: Sequence[int], payload: torch.Tensor) -> None:
        """Write one layer of imported KV into ``block_ids`` (blocks reserved for a request in
        WAITING_FOR_KV, which no step reads). Any thread. Raises LayoutMismatch."""
        write_layer(self._engine.engine.runner.kv_cache, layer, block_ids, payload)

    def watch_layers(self, request_id: str, listener: LayerListener) -> None:
        """Call ``listener(layer, block_table)`` on the engine thread as the forward of
        ``request_id``'s last prompt chunk writes each layer (a prefill worker streams a layer
        while later layers compute). Until :meth:`unwatch_layers`."""
        self._engine.engine.runner.layer_hook = self._on_layer
        self._layer_listeners[request_id] = listener

    def unwatch_layers(self, request_id: str) -> None:
        self._layer_listeners.pop(request_id, None)

    def _on_layer(self, layer: int, out: SchedulerOutput) -> None:
        for chunk in out.chunks:
            listener = self._layer_listeners.get(chunk.request_id)
            if listener is not None and chunk.sample:
                listener(layer, chunk.block_table)

    async def load(self, resync: bool = False) -> EngineLoad:
        """The queue, the batch and the prefix-cache events since the last call, read between
        two steps. ``resync``: CLEARED then everything cached now instead of the events, from
        which a router that missed reports rebuilds its index of this engine exactly."""

        def read(e: LLMEngine) -> EngineLoad:
            events = e.kv.pool.take_events()
            if resync:  # superseded by the snapshot
                cached = tuple(e.kv.pool.cached_hashes())
                events = [KVEvent(KVEventKind.CLEARED), KVEvent(KVEventKind.STORED, cached)]
            admitted = self._engine.take_admitted()
            return EngineLoad(
                e.scheduler.num_waiting,
                e.scheduler.num_running,
                events,
                claimed_blocks=e.kv.claimed_blocks(),
                admitted=admitted,
            )

        return await self._engine.call(read)  # type: ignore[no-any-return]

    async def finish_import(
        self,
        request_id: str,
        *,
        next_token: int | None = None,
        sampler_snapshot: SamplingSnapshot | None = None,
        error: str | None = None,
    ) -> None:
        """See :meth:`LLMEngine.finish_import`: the imported KV is in (decode from
        ``next_token``), or the import failed (``error``: the request ends FAILED)."""
        await self._engine.call(
            lambda e: e.finish_import(
                request_id, next_token=next_token, sampler_snapshot=sampler_snapshot, error=error
            )
        )

    async def release(self, request_id: str) -> bool:
        """End the lease on a handed-off request's blocks; False if already released."""
        return await self._engine.call(lambda e: e.release_kv(request_id))  # type: ignore[no-any-return]
