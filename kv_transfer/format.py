"""The KV block format: what one transfer carries, how it is checked, and how it is framed.

A transfer moves the KV of one request's blocks, layer by layer. Each layer travels as a
:class:`LayerChunk` whose payload is one layer of those blocks as the engine lays them out
(engine/kv_layout.py), with one checksum per block. The
:class:`TransferHeader` goes first and the :class:`Trailer` last; both are msgpack frames.

Block checksum: ``xxh3_64(V bytes, seed=xxh3_64(K bytes))`` of that block in that layer (two
one-shot calls, no hasher object per block). Trailer digest: ``xxh3_64`` of every block checksum,
layer by layer, as little-endian uint64 -- a receiver that saw every chunk in order recomputes
it exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch
import xxhash

from engine.kv_layout import KVLayout, byte_view
from engine.request import EngineRequest
from kv_transfer.errors import KVFrameError, KVIntegrityError, KVTruncatedError

Tensor = torch.Tensor

_U64 = 2**64
_HEADER_TAG = "kvh1"
_TRAILER_TAG = "kvt1"


@dataclass(frozen=True)
class TransferKey:
    """One attempt at moving one request's KV: the client request's id (for logs) and the
    attempt's engine key (a retry's is new)."""

    request_id: str
    attempt_id: str

    @classmethod
    def of(cls, attempt: EngineRequest) -> TransferKey:
        return cls(attempt.request_id, attempt.key)

    def __str__(self) -> str:
        return f"{self.request_id}#{self.attempt_id}"


@dataclass(frozen=True)
class TransferHeader:
    key: TransferKey
    layout: KVLayout
    num_blocks: int
    num_tokens: int
    block_hashes: list[int]  # prefix-cache hashes of the full blocks, in order
    cache_salt: str
    model_id: str
    deadline: float  # unix time: the sender holds the blocks until then

    def __post_init__(self) -> None:
        if type(self.num_blocks) is not int or self.num_blocks < 0:
            raise ValueError(
                f"TransferHeader.num_blocks must be an int >= 0, got {self.num_blocks!r}"
            )
        cap = self.num_blocks * self.layout.block_size
        if type(self.num_tokens) is not int or not 0 <= self.num_tokens <= cap:
            raise ValueError(
                f"TransferHeader.num_tokens {self.num_tokens!r} outside 0..{cap} "
                f"({self.num_blocks} blocks of {self.layout.block_size})"
            )
        if len(self.block_hashes) > self.num_blocks:
            raise ValueError(
                f"TransferHeader.block_hashes has {len(self.block_hashes)} hashes for "
                f"{self.num_blocks} blocks"
            )
        if any(type(h) is not int or not 0 <= h < _U64 for h in self.block_hashes):
            raise ValueError("TransferHeader.block_hashes must be uint64 ints")
        if not math.isfinite(self.deadline):
            raise ValueError(f"TransferHeader.deadline must be finite, got {self.deadline!r}")

    @property
    def layer_nbytes(self) -> int:
        return self.layout.layer_nbytes(self.num_blocks)


@dataclass
class LayerChunk:
    """One layer of a transfer: ``payload[0 = K | 1 = V, i]`` is the i-th block of the table."""

    layer: int
    payload: Tensor
    checksums: list[int]


@dataclass(frozen=True)
class Trailer:
    num_chunks: int
    digest: int


def block_checksums(payload: Tensor) -> list[int]:
    """One checksum per block of a ``[2, n_blocks, ...]`` payload (see the module docstring)."""
    n = payload.shape[1]
    flat = byte_view(payload).data  # K blocks, then V blocks
    size = len(flat) // (2 * n) if n else 0
    xxh3 = xxhash.xxh3_64_intdigest
    # Slicing a memoryview is the cheapest per-block step Python offers; this loop runs once
    # per block per layer on both sides of every transfer.
    return [
        xxh3(flat[(n + b) * size : (n + b + 1) * size], seed=xxh3(flat[b * size : (b + 1) * size]))
        for b in range(n)
    ]


def transfer_digest(checksums: Sequence[Sequence[int]]) -> int:
    """The trailer digest over every layer's block checksums, in layer order."""
    h = xxhash.xxh3_64()
    for layer in checksums:
        h.update(np.asarray(layer, dtype="<u8").tobytes())
    return h.intdigest()


def verify_chunk(chunk: LayerChunk, header: TransferHeader, expected_layer: int) -> None:
    """Raise unless ``chunk`` is exactly layer ``expected_layer`` of ``header``'s transfer.

    A chunk from a later layer means the ones between were lost (:class:`KVTruncatedError`); an
    earlier one is a duplicate or reordered, and wrong geometry or a checksum mismatch is damage
    (:class:`KVIntegrityError`).
    """
    check_layer_order(header, chunk.layer, expected_layer)
    layout = header.layout
    where = f"transfer {header.key} layer {chunk.layer}"
    want = layout.payload_shape(header.num_blocks)
    if tuple(chunk.payload.shape) != want or chunk.payload.dtype != layout.torch_dtype:
        raise KVIntegrityError(
            f"{where}: payload {tuple(chunk.payload.shape)} {chunk.payload.dtype}, "
            f"expected {want} {layout.torch_dtype}"
        )
    if len(chunk.checksums) != header.num_blocks:
        raise KVIntegrityError(
            f"{where}: {len(chunk.checksums)} checksums for {header.num_blocks} blocks"
        )
    got = block_checksums(chunk.payload)
    for b, (sent, seen) in enumerate(zip(chunk.checksums, got, strict=True)):
        if sent != seen:
            raise KVIntegrityError(f"{where}: block {b} checksum {seen:#x}, sender said {sent:#x}")


def check_layer_order(header: TransferHeader, layer: int, expected_layer: int) -> None:
    """The ordering part of :func:`verify_chunk`, for a receiver about to take a layer's bytes."""
    where = f"transfer {header.key} layer {layer}"
    if not 0 <= layer < header.layout.num_layers:
        raise KVIntegrityError(f"{where}: layer outside 0..{header.layout.num_layers - 1}")
    if layer > expected_layer:
        raise KVTruncatedError(f"{where}: chunk for layer {expected_layer} missing")
    if layer < expected_layer:
        raise KVIntegrityError(f"{where}: duplicate or out of order (expected {expected_layer})")


def encode_header(header: TransferHeader) -> bytes:
    lay = header.layout
    return msgpack.packb(
        [
            _HEADER_TAG,
            header.key.request_id,
            header.key.attempt_id,
            [lay.num_layers, lay.block_size, lay.kv_heads, lay.head_dim, lay.dtype],
            header.num_blocks,
            header.num_tokens,
            header.block_hashes,
            header.cache_salt,
            header.model_id,
            float(header.deadline),
        ]
    )


def decode_header(data: bytes) -> TransferHeader:
    """Decode a header frame; anything malformed raises :class:`KVFrameError`."""
    items = _unpack(data, "header", _HEADER_TAG, 10)
    _, rid, attempt, lay, blocks, tokens, hashes, salt, model, deadline = items
    _expect(rid, str, "header request_id")
    _expect(attempt, str, "header attempt_id")
    _expect(lay, list, "header layout")
    _expect(hashes, list, "header block_hashes")
    _expect(salt, str, "header cache_salt")
    _expect(model, str, "header model_id")
    _expect(deadline, float, "header deadline")
    if len(lay) != 5:
        raise KVFrameError(f"header layout has {len(lay)} fields, expected 5")
    try:
        return TransferHeader(
            key=TransferKey(rid, attempt),
            layout=KVLayout(*lay),
            num_blocks=blocks,
            num_tokens=tokens,
            block_hashes=hashes,
            cache_salt=salt,
            model_id=model,
            deadline=deadline,
        )
    except ValueError as e:
        raise KVFrameError(f"bad header: {e}") from e


def encode_trailer(trailer: Trailer) -> bytes:
    return msgpack.packb([_TRAILER_TAG, trailer.num_chunks, trailer.digest])


def decode_trailer(data: bytes) -> Trailer:
    """Decode a trailer frame; anything malformed raises :class:`KVFrameError`."""
    _, num_chunks, digest = _unpack(data, "trailer", _TRAILER_TAG, 3)
    _expect(num_chunks, int, "trailer num_chunks")
    _expect(digest, int, "trailer digest")
    if num_chunks < 0 or not 0 <= digest < _U64:
        raise KVFrameError(f"trailer out of range: num_chunks={num_chunks} digest={digest}")
    return Trailer(num_chunks, digest)


def _unpack(data: bytes, what: str, tag: str, length: int) -> list[Any]:
    try:
        items = msgpack.unpackb(data, raw=False, strict_map_key=True)
    # msgpack raises a zoo of types (ExtraData, FormatError, StackError, ValueError,
    # UnicodeDecodeError, ...) for malformed input; the contract is one KVFrameError.
    except Exception as e:
        raise KVFrameError(f"{what} frame of {len(data)} bytes does not decode: {e!r}") from e
    if type(items) is not list or len(items) != length or items[0] != tag:
        raise KVFrameError(f"{what} frame is not a {tag!r} list of {length} items")
    return items


def _expect(value: object, kind: type, what: str) -> None:
    if type(value) is not kind:  # exact: bool is an int, a header field never is
        raise KVFrameError(f"{what} is {type(value).__name__} {value!r}, expected {kind.__name__}")
