"""The one interface a decode worker pulls KV through, whichever transport carries it."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import Protocol

from contracts.roles import Transport
from engine.kv_layout import KVLayout
from kv_transfer.exporter import ReleaseReason
from kv_transfer.format import LayerChunk, TransferHeader, TransferKey
from kv_transfer.grpc_transport import GrpcKVClient
from kv_transfer.torch_transport import TorchKVClient


class KVTransport(Protocol):
    def pull(
        self,
        address: str,
        key: TransferKey,
        layout: KVLayout,
        sink: Callable[[LayerChunk], None],
        deadline: float | None,
    ) -> TransferHeader: ...

    def release(self, address: str, key: TransferKey, reason: ReleaseReason) -> bool: ...

    def close(self) -> None: ...


def make_transport(
    kind: Transport | str, puller_id: str | None = None, host: str = "127.0.0.1"
) -> KVTransport:
    """A client for ``kind`` (GRPC or TORCH; AUTO is resolved by whoever knows the workers'
    devices, before this). ``puller_id`` names this puller to senders
    (what ``KVExportRegistry.peer_dead`` matches); pass the worker's name. The default is unique
    per call, so peer-death releases only work with an explicit one. ``host``: this side's
    address, where torch mode binds its end of each pair group."""
    pid = puller_id if puller_id is not None else f"puller-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    if kind == Transport.GRPC:
        return GrpcKVClient(pid)
    if kind == Transport.TORCH:
        return TorchKVClient(pid, host=host)
    raise ValueError(f"transport kind {kind!r} is not 'grpc' or 'torch'")
