"""The KV transfer gRPC service (both transports' control plane, and the gRPC transport's data
plane) and the gRPC client.

Throughput choices (see ``bench/kv_transfer_bench.py``): unlimited message sizes; a sync gRPC
server spends ~0.3-1 ms of thread hand-offs per stream message, so a pull packs what is ready
into one ``KVBatch`` -- in gRPC mode up to ``CHUNK_BYTES`` of payload (layers split into
``CHUNK_BYTES`` pieces, so sending and receiving overlap), in torch mode up to
``TORCH_BATCH_BYTES`` of announced payload; the header always goes alone, so a puller can get
ready while the first layers are read. Chunk messages are built and parsed by hand around the
payload (``wire.py``) so each payload byte is copied once into a batch and once out of it.
Torch mode announces each payload before sending it, sends only once the puller's receives
are posted, and keeps ``TORCH_SENDS_IN_FLIGHT`` sends outstanding while it reads on.

Each pull holds one server thread for its whole stream (waiting for layers included), so
``max_workers`` bounds the concurrent pulls a worker serves.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import torch

from engine.kv_layout import KVLayout
from kv_transfer import kv_transfer_pb2 as pb
from kv_transfer.errors import KVTransferError
from kv_transfer.exporter import Frame, KVExportRegistry, ReleaseReason
from kv_transfer.format import LayerChunk, TransferHeader, TransferKey
from kv_transfer.memory import keep_transfer_buffers_resident
from kv_transfer.torch_transport import DEFAULT_TIMEOUT_S, PairGroupHost, PendingOp, payload_bytes
from kv_transfer.wire import (
    CHANNEL_OPTIONS,
    CHUNK_BYTES,
    HEALTH,
    OPEN_PAIR_GROUP,
    PULL,
    RELEASE,
    SERVICE,
    BatchWriter,
    Channels,
    GrpcStreamReader,
    chunk_messages,
    frame_message,
    reason_from_pb,
    status_for,
    torch_chunk_message,
)

# Torch mode: layer payloads a pull may have on the pair group, not yet received.
TORCH_SENDS_IN_FLIGHT = 2
# Torch mode: payload bytes announced per stream message at most (when more are ready).
TORCH_BATCH_BYTES = 4 << 20
# The sender gives up this long (at most a tenth of the time it was given) before the puller's
# deadline, so the layers it holds and the reason it ends reach the puller while it still listens.
SENDER_MARGIN_S = 0.5


def sender_deadline(puller_deadline: float, now: float) -> float:
    """When the sender of a pull due at ``puller_deadline`` stops waiting and says why."""
    return puller_deadline - min(SENDER_MARGIN_S, max(puller_deadline - now, 0.0) / 10)


class KVTransferServer:
    """Serves a registry's exports to pullers, in gRPC or torch mode, on ``host``:``port``
    (port 0: the OS picks; read :attr:`address` after :meth:`start`)."""

    def __init__(
        self,
        registry: KVExportRegistry,
        host: str = "127.0.0.1",
        port: int = 0,
        max_workers: int = 32,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        keep_transfer_buffers_resident()
        self.registry = registry
        self.host = host
        self.chunk_bytes = chunk_bytes
        # Each pull holds a worker thread while it waits for layers and streams them.
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kv-server"),
            options=[*CHANNEL_OPTIONS, ("grpc.so_reuseport", 0)],
        )
        self._server.add_generic_rpc_handlers([self._handlers()])
        self._port = self._server.add_insecure_port(f"{host}:{port}")
        self._pairs: PairGroupHost | None = None
        self._pairs_lock = threading.Lock()

    @property
    def address(self) -> str:
        return f"{self.host}:{self._port}"

    def start(self) -> None:
        self._server.start()

    def stop(self, grace: float | None = None) -> None:
        """Stop serving; in-flight pulls are cancelled after ``grace`` seconds."""
        self._server.stop(grace).wait()
        if self._pairs is not None:
            self._pairs.close()

    def _handlers(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE.full_name,
            {
                PULL.name: grpc.unary_stream_rpc_method_handler(
                    self._pull,
                    request_deserializer=pb.PullRequest.FromString,
                    response_serializer=None,  # the handler yields wire bytes (wire.py)
                ),
                RELEASE.name: _unary(self._release, pb.ReleaseRequest),
                OPEN_PAIR_GROUP.name: _unary(self._open_pair_group, pb.PairGroupRequest),
                HEALTH.name: _unary(self._health, pb.HealthRequest),
            },
        )

    def _pair_host(self) -> PairGroupHost:
        """The rendezvous store and pair groups, made on the first torch-mode puller."""
        with self._pairs_lock:
            if self._pairs is None:
                self._pairs = PairGroupHost(self.host)
            return self._pairs

    def _pull(self, request: pb.PullRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        key = TransferKey(request.request_id, request.attempt_id)
        remaining = context.time_remaining()
        now = time.time()
        deadline = sender_deadline(min(request.deadline, now + (remaining or math.inf)), now)
        batch = BatchWriter()
        pair: _PairPull | None = None
        done = threading.Event()
        try:
            if request.mode == pb.TORCH:
                pair = _PairPull(self._pair_host(), request.group_id, request.tag, deadline)
            export = self.registry.get(key, request.puller_id)
            if pair is not None:
                pair.expect_ready(export.header)

            def on_done() -> None:  # RPC over (finished or cancelled): stop waiting
                done.set()
                export.wake()
                if pair is not None:
                    # Discard the group. Waits on it fail at once on NCCL; on gloo they fail once
                    # the puller's end is gone (a cancelled pull discards it), else by deadline.
                    pair.end()

            context.add_callback(on_done)
            for index, item in self.registry.stream(export, deadline, done.is_set):
                if isinstance(item, Frame):
                    batch.add([frame_message(item)])
                elif pair is not None:
                    pair.announce(batch, item)
                else:
                    for pieces in chunk_messages(item, self.chunk_bytes):
                        if batch and batch.payload_bytes + len(pieces[2]) > self.chunk_bytes:
                            yield batch.take()
                        batch.add(pieces, len(pieces[2]))
                # Send what was produced once nothing more is ready, or the batch is full; the
                # header goes alone, so the puller can post its receives meanwhile.
                if batch and (
                    index == 0
                    or batch.payload_bytes >= (TORCH_BATCH_BYTES if pair else self.chunk_bytes)
                    or not export.message_ready(index + 1)
                ):
                    yield batch.take()
                    if pair is not None:
                        pair.send_announced(keep=TORCH_SENDS_IN_FLIGHT)
            if batch:
                yield batch.take()
            if pair is not None:
                pair.send_announced(keep=0)
                pair.completed = True
        except KVTransferError as e:
            # Let the puller take the layers it was already told about, then say why it ends.
            with contextlib.suppress(KVTransferError):
                if batch:
                    yield batch.take()
                if pair is not None:
                    pair.send_announced(keep=0)
            context.abort(status_for(e), str(e))
        finally:
            # Failed, aborted or cancelled (GeneratorExit at a yield): a payload may be left
            # half-matched, so the group is out of step; the puller discards its end too.
            if pair is not None:
                pair.end()

    def _release(
        self, request: pb.ReleaseRequest, context: grpc.ServicerContext
    ) -> pb.ReleaseReply:
        try:
            reason = reason_from_pb(request.reason)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        key = TransferKey(request.request_id, request.attempt_id)
        return pb.ReleaseReply(released=self.registry.release(key, reason))

    def _open_pair_group(
        self, request: pb.PairGroupRequest, context: grpc.ServicerContext
    ) -> pb.PairGroupReply:
        try:
            port = self._pair_host().open(request)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.PairGroupReply(store_port=port)

    def _health(self, request: pb.HealthRequest, context: grpc.ServicerContext) -> pb.HealthReply:
        return pb.HealthReply(exports=len(self.registry))


class _PairPull:
    """Torch mode, one pull: its payloads go over the pair group, each announced (on the gRPC
    stream) before it is sent, and on gloo sent only once the puller has said that its receives
    are posted (``torch_transport.signals_ready``)."""

    def __init__(self, host: PairGroupHost, group_id: str, tag: int, deadline: float) -> None:
        host.check(group_id, deadline)
        self.host = host
        self.group_id = group_id
        self.tag = tag
        self.deadline = deadline
        self.completed = False
        self._ready: PendingOp | None = None
        self._announced: list[torch.Tensor] = []  # payloads the puller was told of, not yet sent
        self._sends: deque[PendingOp] = deque()

    def expect_ready(self, header: TransferHeader) -> None:
        """Post the receive for the puller's ready signal before the header can reach it."""
        if header.layer_nbytes:
            self._ready = self.host.expect_ready(self.group_id, self.tag, self.deadline)

    def announce(self, batch: BatchWriter, chunk: LayerChunk) -> None:
        data = payload_bytes(chunk.payload)
        batch.add([torch_chunk_message(chunk, data.numel())], data.numel())
        self._announced.append(data)

    def send_announced(self, keep: int) -> None:
        """Start sending the announced payloads, then wait until at most ``keep`` are in
        flight (sends on one tag arrive in order)."""
        if self._announced and self._ready is not None:
            self._ready.wait()
            self._ready = None
        for data in self._announced:
            self._sends.append(self.host.send(self.group_id, self.tag, data, self.deadline))
        self._announced = []
        while len(self._sends) > keep:
            self._sends.popleft().wait()

    def end(self) -> None:
        """The pull is over; unless it completed, discard the group (failing any wait)."""
        if not self.completed:
            self.host.discard(self.group_id)


def _unary(handler: Callable[..., Any], request_type: Any) -> grpc.RpcMethodHandler:
    return grpc.unary_unary_rpc_method_handler(
        handler,
        request_deserializer=request_type.FromString,
        response_serializer=lambda reply: reply.SerializeToString(),
    )


class GrpcKVClient:
    """Pulls KV over the gRPC stream itself."""

    def __init__(self, puller_id: str, default_timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.puller_id = puller_id
        self.default_timeout_s = default_timeout_s
        self._channels = Channels()

    def pull(
        self,
        address: str,
        key: TransferKey,
        layout: KVLayout,
        sink: Callable[[LayerChunk], None],
        deadline: float | None,
    ) -> TransferHeader:
        """Pull ``key`` from the server at ``address``, handing ``sink`` each layer in order once
        it is verified; returns the header once the trailer checks out.

        Raises a :class:`KVTransferError` subclass on any failure (the sink has then received
        only verified layers, possibly not all). ``deadline`` is unix time (None: the client's
        default timeout from now). Exceptions the sink raises propagate unchanged.
        """
        deadline = time.time() + self.default_timeout_s if deadline is None else deadline
        request = pb.PullRequest(
            request_id=key.request_id,
            attempt_id=key.attempt_id,
            puller_id=self.puller_id,
            deadline=deadline,
            mode=pb.GRPC,
        )
        return self._channels.pull(address, request, GrpcStreamReader(key, layout, sink), deadline)

    def release(self, address: str, key: TransferKey, reason: ReleaseReason) -> bool:
        """End the sender's lease on ``key``; False if it was already released."""
        return self._channels.release(address, self.puller_id, key, reason)

    def health(self, address: str, timeout_s: float = 5.0) -> int:
        """The number of exports the server holds (raises KVPeerUnavailable if it is down)."""
        reply = self._channels.unary(address, HEALTH, pb.HealthRequest(), pb.HealthReply, timeout_s)
        return int(reply.exports)

    def close(self) -> None:
        self._channels.close()
