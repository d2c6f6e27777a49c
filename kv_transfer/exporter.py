"""Sender side of KV transfers, in the prefill worker's process.

The prefill worker publishes a transfer before (or while) its forward runs and marks layers
ready as the engine writes them; transport server threads stream each layer as soon as it is
ready. Until the puller acknowledges, the blocks stay leased: the lease ends exactly once, on
ack, abort, prefill failure, peer death, or when its deadline passes.

The lease runs for ``lease_s`` from the moment the KV is complete (every layer ready), not from
publication: a prompt queued behind others, or a long prefill, does not eat its puller's time
(issue 26). While the puller is alive but cannot pull yet (its engine has no room: the request
is parked) it renews the lease (:meth:`KVExportRegistry.renew`), so only a puller that is gone
or stuck lets it expire. Lease deadlines are enforced by the owner calling
:meth:`KVExportRegistry.expire` (the prefill worker's housekeeping tick); a pull that arrives for
an export whose deadline has passed also expires it on the spot, so an owner that ticks late
never serves a stale lease.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import StrEnum

import torch

from contracts.faults import Fault, FaultAction
from kv_transfer.errors import KVTransferAborted, KVTransferTimeout, KVUnknownTransfer
from kv_transfer.format import (
    LayerChunk,
    Trailer,
    TransferHeader,
    TransferKey,
    block_checksums,
    encode_header,
    encode_trailer,
    transfer_digest,
)

Tensor = torch.Tensor


class ReleaseReason(StrEnum):
    ACKED = "acked"  # the puller has the KV
    ABORTED = "aborted"  # either side gave the transfer up
    EXPIRED = "expired"  # the lease deadline passed
    PEER_DEAD = "peer_dead"  # the puller is known dead
    FAILED = "failed"  # the prefill itself failed


# (key, index of the message about to go out: 0 = header, 1..L = layer 0..L-1, L + 1 = trailer)
# -> the fault to apply to it (None: send it as is): STALL, DROP, RAISE (end the stream here),
# CORRUPT or TRUNCATE (contracts.faults). Runs in the server thread right before the message
# is sent, so it may also release or fail the export to abort the stream at exactly that point.
FaultHook = Callable[[TransferKey, int], Fault | None]


@dataclass(frozen=True)
class Frame:
    """An encoded header or trailer, as it goes on the wire."""

    kind: str  # "header" | "trailer"
    data: bytes


class Export:
    """One published transfer. Thread-safe: an engine thread marks layers ready while server
    threads stream them and any thread may release it."""

    def __init__(
        self,
        registry: KVExportRegistry,
        header: TransferHeader,
        source: Callable[[int], Tensor],
        lease_s: float,
        on_release: Callable[[ReleaseReason], None],
    ) -> None:
        self.header = header
        self.lease_s = lease_s
        self.lease_deadline = math.inf  # until the KV is complete
        self.pullers: set[str] = set()
        self._registry = registry
        self._source = source
        self._on_release = on_release
        self._cond = threading.Condition()
        self._ready = [False] * header.layout.num_layers
        self._released: ReleaseReason | None = None
        self._failure = ""

    @property
    def key(self) -> TransferKey:
        return self.header.key

    @property
    def released(self) -> ReleaseReason | None:
        return self._released

    def layer_ready(self, layer: int) -> None:
        """The engine has written ``layer``'s KV for every block of the transfer."""
        if not 0 <= layer < len(self._ready):
            raise ValueError(f"layer_ready({layer}): transfer has layers 0..{len(self._ready) - 1}")
        with self._cond:
            self._ready[layer] = True
            if all(self._ready) and self.lease_deadline == math.inf:
                self.lease_deadline = time.time() + self.lease_s  # the lease starts now
            self._cond.notify_all()

    def message_ready(self, index: int) -> bool:
        """Whether stream message ``index`` (see :data:`FaultHook`) can go out without waiting
        for the engine: the header and trailer always can, a layer once it is written."""
        layers = len(self._ready)
        return not 1 <= index <= layers or self._ready[index - 1]

    def all_ready(self) -> None:
        with self._cond:
            self._ready = [True] * len(self._ready)
            if self.lease_deadline == math.inf:
                self.lease_deadline = time.time() + self.lease_s
            self._cond.notify_all()

    def renew(self, now: float) -> bool:
        """The puller is alive and will pull: ``lease_s`` more from ``now`` (a lease not started
        yet stays unstarted). False once released."""
        with self._cond:
            if self._released is not None:
                return False
            if self.lease_deadline != math.inf:
                self.lease_deadline = max(self.lease_deadline, now + self.lease_s)
            return True

    def fail(self, reason: str) -> bool:
        """The prefill failed: pullers get :class:`KVTransferAborted`, the lease ends (FAILED)."""
        return self.release(ReleaseReason.FAILED, failure=reason)

    def release(self, reason: ReleaseReason, failure: str = "") -> bool:
        """End the lease; True for the one call that did, False for every later one."""
        with self._cond:
            if self._released is not None:
                return False
            self._released = reason
            self._failure = failure
            self._cond.notify_all()
        self._registry._forget(self, reason)
        self._on_release(reason)
        return True

    def wake(self) -> None:
        """Re-check waiters' conditions (a transport calls this when a pull is cancelled)."""
        with self._cond:
            self._cond.notify_all()

    def check_live(self) -> None:
        if self._released is not None:
            what = f"prefill failed: {self._failure}" if self._failure else self._released.value
            raise KVTransferAborted(f"transfer {self.key} released ({what})")

    def wait_layer(self, layer: int, deadline: float, cancelled: Callable[[], bool]) -> None:
        """Block until ``layer`` is ready; raise if the export is released or the deadline passes
        first. Returns early (for the caller to notice) if ``cancelled()`` turns true."""
        with self._cond:
            while not self._ready[layer] and self._released is None and not cancelled():
                left = deadline - time.time()
                if left <= 0:
                    raise KVTransferTimeout(
                        f"transfer {self.key}: layer {layer} not ready by the pull deadline"
                    )
                self._cond.wait(left)
        self.check_live()

    def pause(self, seconds: float, deadline: float, cancelled: Callable[[], bool]) -> None:
        """Sleep (a DELAY fault) but wake for a release or cancellation; honour the deadline."""
        end = min(time.time() + seconds, deadline)
        with self._cond:
            while self._released is None and not cancelled() and time.time() < end:
                self._cond.wait(end - time.time())
        self.check_live()
        if time.time() >= deadline:
            raise KVTransferTimeout(f"transfer {self.key}: sender stalled past the pull deadline")

    def read_layer(self, layer: int) -> LayerChunk:
        payload = self._source(layer)
        return LayerChunk(layer, payload, block_checksums(payload))


class KVExportRegistry:
    """All transfers a prefill worker currently offers, by key."""

    def __init__(self) -> None:
        self.fault_hook: FaultHook | None = None
        self._lock = threading.Lock()
        self._exports: dict[TransferKey, Export] = {}
        self.releases: Counter[ReleaseReason] = Counter()  # leases ended, by how (metrics)

    def __len__(self) -> int:
        with self._lock:
            return len(self._exports)

    def publish(
        self,
        header: TransferHeader,
        source: Callable[[int], Tensor],
        lease_s: float,
        on_release: Callable[[ReleaseReason], None],
    ) -> Export:
        """Offer a transfer, leased for ``lease_s`` once its KV is complete. ``source(layer)``
        returns that layer's payload (called from server threads, once per pull per layer, only
        after ``layer_ready(layer)``); ``on_release`` runs exactly once, in whichever thread
        ends the lease."""
        export = Export(self, header, source, lease_s, on_release)
        with self._lock:
            if header.key in self._exports:
                raise ValueError(f"transfer {header.key} is already published")
            self._exports[header.key] = export
        return export

    def get(self, key: TransferKey, puller_id: str, now: float | None = None) -> Export:
        """The live export for ``key``, recording ``puller_id`` as pulling it."""
        now = time.time() if now is None else now
        with self._lock:
            export = self._exports.get(key)
            if export is not None and export.lease_deadline > now:
                export.pullers.add(puller_id)
                return export
        if export is not None:
            export.release(ReleaseReason.EXPIRED)
        raise KVUnknownTransfer(f"no live transfer {key} here")

    def renew(self, key: TransferKey, now: float | None = None) -> float | None:
        """Renew ``key``'s lease (its puller is alive, waiting for room to pull); the lease's
        length, for the next renewal's timing, or None if it is gone (released, expired)."""
        now = time.time() if now is None else now
        with self._lock:
            export = self._exports.get(key)
        if export is None or export.lease_deadline <= now or not export.renew(now):
            return None
        return export.lease_s

    def release(self, key: TransferKey, reason: ReleaseReason) -> bool:
        """End ``key``'s lease; False if it is unknown or already released."""
        with self._lock:
            export = self._exports.get(key)
        return export is not None and export.release(reason)

    def expire(self, now: float | None = None) -> list[TransferKey]:
        """Release (EXPIRED) every export whose lease deadline is at or before ``now``."""
        now = time.time() if now is None else now
        with self._lock:
            due = [e for e in self._exports.values() if e.lease_deadline <= now]
        return [e.key for e in due if e.release(ReleaseReason.EXPIRED)]

    def peer_dead(self, peer_id: str) -> list[TransferKey]:
        """Release (PEER_DEAD) every export that ``peer_id`` has pulled."""
        with self._lock:
            pulled = [e for e in self._exports.values() if peer_id in e.pullers]
        return [e.key for e in pulled if e.release(ReleaseReason.PEER_DEAD)]

    def stream(
        self, export: Export, deadline: float, cancelled: Callable[[], bool]
    ) -> Iterator[tuple[int, Frame | LayerChunk]]:
        """What one pull sends, in order, with each message's index: header frame, one chunk per
        layer (each as soon as it is ready), trailer frame -- with the fault hook applied. Raises
        :class:`KVTransferAborted` once the export is released and :class:`KVTransferTimeout` at
        ``deadline``; stops quietly when ``cancelled()``."""
        layout = export.header.layout
        sums: list[list[int]] = []
        for index in range(layout.num_layers + 2):
            item: Frame | LayerChunk
            if index == 0:
                item = Frame("header", encode_header(export.header))
            elif index <= layout.num_layers:
                export.wait_layer(index - 1, deadline, cancelled)
                if cancelled():
                    return
                item = export.read_layer(index - 1)
                sums.append(item.checksums)
            else:
                item = Frame("trailer", encode_trailer(Trailer(len(sums), transfer_digest(sums))))
            hook = self.fault_hook
            action = None if hook is None else hook(export.key, index)
            # After the source read and the hook: a release that raced either wins here, before
            # any byte read from possibly-reused blocks leaves.
            export.check_live()
            if action is not None:
                if action.action is FaultAction.STALL:
                    export.pause(action.seconds, deadline, cancelled)
                elif action.action is FaultAction.DROP:
                    continue
                elif action.action is FaultAction.RAISE:
                    return
                elif action.action in (FaultAction.CORRUPT, FaultAction.TRUNCATE):
                    item = _damage(item, action.action)
                else:
                    raise ValueError(f"the KV sender cannot apply {action.action}")
            if cancelled():
                return
            yield index, item

    def _forget(self, export: Export, reason: ReleaseReason) -> None:
        with self._lock:
            self.releases[reason] += 1
            if self._exports.get(export.key) is export:
                del self._exports[export.key]


def _damage(item: Frame | LayerChunk, kind: FaultAction) -> Frame | LayerChunk:
    """A copy of ``item`` with one byte flipped (CORRUPT) or its bytes halved (TRUNCATE)."""
    if isinstance(item, Frame):
        data = bytearray(item.data)
        if kind is FaultAction.TRUNCATE:
            return Frame(item.kind, bytes(data[: len(data) // 2]))
        data[len(data) // 2] ^= 0xFF
        return Frame(item.kind, bytes(data))
    flat = item.payload.contiguous().view(torch.uint8).reshape(-1)
    if kind is FaultAction.TRUNCATE:
        return LayerChunk(item.layer, flat[: flat.numel() // 2].clone(), item.checksums)
    bad = flat.clone()
    bad[bad.numel() // 2] ^= 0xFF
    return LayerChunk(
        item.layer, bad.view(item.payload.dtype).view(item.payload.shape), item.checksums
    )
