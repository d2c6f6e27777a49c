"""gRPC framing shared by both transports: message encoding, the pull-stream reader, status
mapping, and the per-peer channel cache.

Each Pull stream message is a ``KVBatch``: the ``KVMessage`` records that were ready when it
left, written by hand as protobuf field-1 records (tag, length, message), so any protobuf parser
reads it. A chunk message with payload is written as ``data`` field first, then the
protobuf-serialized rest of the ``KVMessage`` (field order is free on the protobuf wire). That
lets the sender build a batch with one copy of each payload (one ``bytes.join`` over memoryviews
-- building it through the protobuf API costs several) and the receiver take ``data`` as a
memoryview of the received bytes instead of copying it through the parser.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc
import numpy as np
import torch
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import DecodeError

from engine.kv_layout import KVLayout, LayoutMismatch, byte_view
from kv_transfer import kv_transfer_pb2 as pb
from kv_transfer.errors import (
    KVFrameError,
    KVIntegrityError,
    KVLayoutMismatch,
    KVPeerUnavailable,
    KVTransferAborted,
    KVTransferError,
    KVTransferTimeout,
    KVTruncatedError,
    KVUnknownTransfer,
)
from kv_transfer.exporter import Frame, ReleaseReason
from kv_transfer.format import (
    LayerChunk,
    TransferHeader,
    TransferKey,
    check_layer_order,
    decode_header,
    decode_trailer,
    transfer_digest,
    verify_chunk,
)
from kv_transfer.memory import keep_transfer_buffers_resident

Tensor = torch.Tensor
Sink = Callable[[LayerChunk], None]
Buffer = bytes | memoryview

# The service and its RPCs, from the proto's descriptor: a renamed or removed RPC fails here,
# at import, instead of answering UNIMPLEMENTED on the wire.
SERVICE = pb.DESCRIPTOR.services_by_name["KVTransfer"]
PULL, RELEASE, OPEN_PAIR_GROUP, HEALTH = (
    SERVICE.methods_by_name[name] for name in ("Pull", "Release", "OpenPairGroup", "Health")
)


def rpc_path(method: MethodDescriptor) -> str:
    """``method``'s gRPC path, ``/<package>.<Service>/<Method>``."""
    return f"/{method.containing_service.full_name}/{method.name}"


# gRPC mode: payload bytes per stream message at most (big layers split, small ones packed):
# few enough messages that their overhead stays small, small enough that sender and receiver
# overlap (measured on a 12 MiB transfer: 1 MiB messages ~25% faster than 4 MiB ones; on
# 5 MiB layers alike).
CHUNK_BYTES = 1 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
]
RELEASE_TIMEOUT_S = 10.0
_DATA_TAG = bytes([15 << 3 | 2])  # KVMessage.data: field 15, length-delimited
_BATCH_TAG = bytes([1 << 3 | 2])  # KVBatch.messages: field 1, length-delimited

_STATUS = [
    (KVUnknownTransfer, grpc.StatusCode.NOT_FOUND),
    (KVTransferAborted, grpc.StatusCode.ABORTED),
    (KVTransferTimeout, grpc.StatusCode.DEADLINE_EXCEEDED),
    (KVPeerUnavailable, grpc.StatusCode.UNAVAILABLE),
]
_ERRORS: dict[grpc.StatusCode, type[KVTransferError]] = {
    grpc.StatusCode.NOT_FOUND: KVUnknownTransfer,
    grpc.StatusCode.ABORTED: KVTransferAborted,
    grpc.StatusCode.DEADLINE_EXCEEDED: KVTransferTimeout,
    grpc.StatusCode.UNAVAILABLE: KVPeerUnavailable,
    # The peer's side went away or broke mid-call (server stopped, crashed, or raised).
    grpc.StatusCode.CANCELLED: KVPeerUnavailable,
    grpc.StatusCode.INTERNAL: KVPeerUnavailable,
    grpc.StatusCode.UNKNOWN: KVPeerUnavailable,
}


def status_for(error: KVTransferError) -> grpc.StatusCode:
    for kind, code in _STATUS:
        if isinstance(error, kind):
            return code
    return grpc.StatusCode.INTERNAL


def error_from_rpc(error: grpc.RpcError, what: str) -> KVTransferError:
    code = error.code() if isinstance(error, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = error.details() if isinstance(error, grpc.Call) else str(error)
    kind = _ERRORS.get(code, KVTransferError)
    return kind(f"{what}: {code.name}: {details}")


def reason_to_pb(reason: ReleaseReason) -> str:
    return reason.name  # the proto enum's value names are ReleaseReason's member names


def reason_from_pb(value: int) -> ReleaseReason:
    name = pb.ReleaseReason.Name(value)
    if name not in ReleaseReason.__members__:
        raise ValueError(f"release reason {name} is not a ReleaseReason")
    return ReleaseReason[name]


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _read_varint(raw: bytes | memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while pos < len(raw) and shift < 64:
        byte = raw[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    raise KVFrameError(f"bad varint in a message of {len(raw)} bytes")


def frame_message(frame: Frame) -> bytes:
    if frame.kind == "header":
        return pb.KVMessage(header=frame.data).SerializeToString()
    return pb.KVMessage(trailer=frame.data).SerializeToString()


def chunk_messages(chunk: LayerChunk, chunk_bytes: int = CHUNK_BYTES) -> Iterator[list[Buffer]]:
    """gRPC mode: the layer's payload in byte ranges, each message as the pieces to join (data
    field first); checksums ride on the first message."""
    data = byte_view(chunk.payload).data
    for offset in range(0, max(len(data), 1), chunk_bytes):
        part = data[offset : offset + chunk_bytes]
        sums = chunk.checksums if offset == 0 else ()
        meta = pb.KVMessage(chunk=pb.Chunk(layer=chunk.layer, offset=offset, checksums=sums))
        yield [_DATA_TAG, _varint(len(part)), part, meta.SerializeToString()]


def torch_chunk_message(chunk: LayerChunk, nbytes: int) -> bytes:
    """Torch mode: the layer's metadata; its ``nbytes`` payload follows on the pair group."""
    c = pb.Chunk(layer=chunk.layer, checksums=chunk.checksums, nbytes=nbytes)
    return pb.KVMessage(chunk=c).SerializeToString()


class BatchWriter:
    """Packs KVMessages into one ``KVBatch`` stream message, counting the payload bytes it
    carries or announces (the sender's cue to send it)."""

    def __init__(self) -> None:
        self._pieces: list[Buffer] = []
        self.payload_bytes = 0

    def __bool__(self) -> bool:
        return bool(self._pieces)

    def add(self, pieces: list[Buffer], payload_bytes: int = 0) -> None:
        size = sum(len(p) for p in pieces)
        self._pieces += [_BATCH_TAG, _varint(size), *pieces]
        self.payload_bytes += payload_bytes

    def take(self) -> bytes:
        """The batch's wire bytes (each piece copied once); the writer is empty again."""
        out = b"".join(self._pieces)
        self._pieces, self.payload_bytes = [], 0
        return out


def decode_batch(raw: bytes) -> Iterator[tuple[pb.KVMessage, memoryview]]:
    """The messages of one stream message, in order; KVFrameError if malformed or empty."""
    view = memoryview(raw)
    if not len(view):
        raise KVFrameError("empty KVBatch")
    pos = 0
    while pos < len(view):
        if view[pos : pos + 1] != _BATCH_TAG:
            raise KVFrameError(f"KVBatch: field tag {view[pos]:#x} at byte {pos}, not a message")
        n, pos = _read_varint(raw, pos + 1)
        if pos + n > len(view):
            raise KVFrameError(f"KVBatch: a {n}-byte message overruns the {len(raw)}-byte batch")
        yield decode_message(view[pos : pos + n])
        pos += n


def decode_message(raw: bytes | memoryview) -> tuple[pb.KVMessage, memoryview]:
    """Parse one KVMessage into (message without data, data); KVFrameError if malformed."""
    view = memoryview(raw)
    data, rest = view[:0], view
    if view[:1] == _DATA_TAG:
        n, pos = _read_varint(view, 1)
        if pos + n > len(view):
            raise KVFrameError(f"data field of {n} bytes overruns a {len(view)}-byte message")
        data, rest = view[pos : pos + n], view[pos + n :]
    try:
        msg = pb.KVMessage.FromString(bytes(rest))
    except DecodeError as e:
        raise KVFrameError(f"undecodable KVMessage of {len(view)} bytes: {e}") from e
    if msg.data:
        if len(data):
            raise KVFrameError("KVMessage carries its data field twice")
        data = memoryview(msg.data)
    return msg, data


class StreamReader:
    """Consumes one Pull stream -- header, chunk messages, trailer -- checking each step, and
    hands the sink every layer once it is verified (so the sink never sees a bad one)."""

    def __init__(self, key: TransferKey, layout: KVLayout, sink: Sink) -> None:
        self.key = key
        self.layout = layout
        self.sink = sink
        self.header: TransferHeader | None = None
        self.layer = 0  # next layer expected
        self.checksums: list[int] = []  # the current layer's, from its first message
        self.sums: list[list[int]] = []

    def read(self, responses: Iterable[bytes]) -> TransferHeader:
        trailer_seen = False
        for raw in responses:
            for msg, data in decode_batch(raw):
                if trailer_seen:
                    raise KVFrameError(f"transfer {self.key}: message after the trailer")
                kind = msg.WhichOneof("kind")
                if kind == "header":
                    self._on_header(msg.header)
                elif self.header is None:
                    raise KVFrameError(f"transfer {self.key}: {kind} before the header")
                elif kind == "chunk":
                    payload = self.payload(self.header, msg.chunk, data)
                    if payload is not None:
                        chunk = LayerChunk(msg.chunk.layer, payload, self.checksums)
                        self._deliver(self.header, chunk)
                elif kind == "trailer":
                    self._on_trailer(msg.trailer)
                    trailer_seen = True
                else:
                    raise KVFrameError(f"transfer {self.key}: empty message")
        if not trailer_seen:
            raise KVTruncatedError(
                f"transfer {self.key}: stream ended after {self.layer} layers without a trailer"
            )
        assert self.header is not None
        return self.header

    def payload(self, header: TransferHeader, chunk: pb.Chunk, data: memoryview) -> Tensor | None:
        """Take one chunk message; return the layer's payload once complete (else None)."""
        raise NotImplementedError

    def started(self, header: TransferHeader) -> None:
        """The header checked out (a reader may get ready for the layers here)."""

    def start_layer(self, header: TransferHeader, chunk: pb.Chunk) -> None:
        """Checks for a message that opens a layer: the previous one is done, it is the next."""
        check_layer_order(header, chunk.layer, self.layer)
        self.checksums = list(chunk.checksums)

    def _on_header(self, data: bytes) -> None:
        if self.header is not None:
            raise KVFrameError(f"transfer {self.key}: second header")
        header = decode_header(data)
        if header.key != self.key:
            raise KVIntegrityError(f"asked for transfer {self.key}, got a header for {header.key}")
        try:
            self.layout.check_compatible(header.layout)
        except LayoutMismatch as exc:
            raise KVLayoutMismatch(str(exc)) from None
        self.header = header
        self.started(header)

    def _deliver(self, header: TransferHeader, chunk: LayerChunk) -> None:
        verify_chunk(chunk, header, self.layer)
        self.sink(chunk)
        self.sums.append(chunk.checksums)
        self.layer += 1

    def _on_trailer(self, data: bytes) -> None:
        trailer = decode_trailer(data)
        expected = self.layout.num_layers
        if self.layer != expected or trailer.num_chunks != expected:
            raise KVTruncatedError(
                f"transfer {self.key}: trailer after {self.layer} of {expected} layers "
                f"(sender counted {trailer.num_chunks})"
            )
        if trailer.digest != transfer_digest(self.sums):
            raise KVIntegrityError(f"transfer {self.key}: trailer digest mismatch")


class GrpcStreamReader(StreamReader):
    """gRPC mode: reassembles each layer from its byte-range messages (one copy per byte), or
    takes a layer that came in one message as it is (no copy; the payload is then read-only)."""

    def __init__(self, key: TransferKey, layout: KVLayout, sink: Sink) -> None:
        super().__init__(key, layout, sink)
        self._buf: Tensor | None = None
        self._flat = np.empty(0, dtype=np.uint8)
        self._filled = 0

    def payload(self, header: TransferHeader, chunk: pb.Chunk, data: memoryview) -> Tensor | None:
        nbytes = header.layer_nbytes
        if chunk.offset == 0 and len(data) == nbytes and self._buf is None:
            # The whole layer in one message: use the received bytes in place (read-only).
            self.start_layer(header, chunk)
            shape = header.layout.payload_shape(header.num_blocks)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable"
                flat = torch.frombuffer(data, dtype=torch.uint8) if nbytes else torch.empty(0)
            return flat.view(header.layout.torch_dtype).view(shape)
        if chunk.offset == 0:
            if self._buf is not None:
                raise KVTruncatedError(
                    f"transfer {self.key}: layer {self.layer} ended at {self._filled} of "
                    f"{nbytes} bytes"
                )
            self.start_layer(header, chunk)
            self._buf = torch.empty(
                header.layout.payload_shape(header.num_blocks), dtype=header.layout.torch_dtype
            )
            self._flat = self._buf.view(torch.uint8).reshape(-1).numpy()
            self._filled = 0
        elif self._buf is None or chunk.layer != self.layer or chunk.offset != self._filled:
            raise KVTruncatedError(
                f"transfer {self.key}: bytes of layer {chunk.layer} at offset {chunk.offset}, "
                f"expected layer {self.layer} at offset {self._filled}"
            )
        end = self._filled + len(data)
        if end > nbytes:
            raise KVIntegrityError(
                f"transfer {self.key}: layer {self.layer} overruns its {nbytes} bytes"
            )
        self._flat[self._filled : end] = np.frombuffer(data, dtype=np.uint8)
        self._filled = end
        if end < nbytes:
            return None
        done, self._buf = self._buf, None
        return done


class Channels:
    """One gRPC channel per peer address, shared by every call to it (channels multiplex and
    reconnect on their own)."""

    def __init__(self) -> None:
        keep_transfer_buffers_resident()
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}

    def get(self, address: str) -> grpc.Channel:
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
                self._channels[address] = channel
            return channel

    def pull(
        self, address: str, request: pb.PullRequest, reader: StreamReader, deadline: float
    ) -> TransferHeader:
        what = f"pull {reader.key} from {address}"
        timeout = deadline - time.time()
        if timeout <= 0:
            raise KVTransferTimeout(f"{what}: deadline already passed")
        pull = self.get(address).unary_stream(
            rpc_path(PULL),
            request_serializer=pb.PullRequest.SerializeToString,
            response_deserializer=None,  # raw bytes: decode_batch takes the data zero-copy
        )
        call = pull(request, timeout=timeout)
        try:
            return reader.read(call)
        except grpc.RpcError as e:
            raise error_from_rpc(e, what) from e
        finally:
            call.cancel()  # no-op once complete; stops the sender when the reader gave up

    def release(
        self, address: str, puller_id: str, key: TransferKey, reason: ReleaseReason
    ) -> bool:
        request = pb.ReleaseRequest(
            request_id=key.request_id,
            attempt_id=key.attempt_id,
            puller_id=puller_id,
            reason=reason_to_pb(reason),
        )
        reply = self.unary(address, RELEASE, request, pb.ReleaseReply, RELEASE_TIMEOUT_S)
        return bool(reply.released)

    def unary(
        self,
        address: str,
        method: MethodDescriptor,
        request: Any,
        reply_type: Any,
        timeout: float,
    ) -> Any:
        call = self.get(address).unary_unary(
            rpc_path(method),
            request_serializer=type(request).SerializeToString,
            response_deserializer=reply_type.FromString,
        )
        try:
            return call(request, timeout=timeout)
        except grpc.RpcError as e:
            raise error_from_rpc(e, f"{method.name} on {address}") from e

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()
