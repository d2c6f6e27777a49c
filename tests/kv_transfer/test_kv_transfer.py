"""KV block transfer: the format's checks, the exporter's lease, and one contract run over both
transports (gRPC stream, torch.distributed pair group) against real servers on 127.0.0.1.

Caches hold random BIT PATTERNS (NaNs and infinities included), compared as bytes: a transfer
that went through float anywhere would change them."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import ipaddress
import math
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import psutil
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts.faults import Fault, FaultAction, FaultPoint
from engine.kv_layout import (
    INT8_SCALE_BYTES,
    KVLayout,
    LayoutMismatch,
    byte_view,
    extract_layer,
    write_layer,
)
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
from kv_transfer.exporter import Export, Frame, KVExportRegistry, ReleaseReason
from kv_transfer.format import (
    LayerChunk,
    Trailer,
    TransferHeader,
    TransferKey,
    block_checksums,
    decode_header,
    decode_trailer,
    encode_header,
    encode_trailer,
    verify_chunk,
)
from kv_transfer.grpc_transport import GrpcKVClient, KVTransferServer, sender_deadline
from kv_transfer.torch_transport import TorchKVClient, TorchStreamReader
from kv_transfer.transport import KVTransport, make_transport
from kv_transfer.wire import (
    CHANNEL_OPTIONS,
    CHUNK_BYTES,
    HEALTH,
    OPEN_PAIR_GROUP,
    PULL,
    RELEASE,
    SERVICE,
    BatchWriter,
    chunk_messages,
    decode_batch,
    decode_message,
    frame_message,
    rpc_path,
)

ROOT = Path(__file__).resolve().parents[2]
LAYERS, BLOCK, HEADS, HEAD_DIM = 4, 16, 4, 64
TRANSPORTS = ["grpc", "torch"]


def row_width(dtype: torch.dtype) -> int:
    """A token's head in the cache: HEAD_DIM values (int8: and its scale's bytes)."""
    return HEAD_DIM + (INT8_SCALE_BYTES if dtype == torch.int8 else 0)


def random_cache(num_blocks: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A cache of random bit patterns (every value, NaN payloads included, is some pattern)."""
    g = torch.Generator().manual_seed(seed)
    shape = (LAYERS, 2, num_blocks, BLOCK, HEADS, row_width(dtype))
    bits = {torch.bfloat16: torch.int16, torch.int8: torch.int8}.get(dtype, torch.int32)
    info = torch.iinfo(bits)
    return torch.randint(info.min, info.max + 1, shape, dtype=bits, generator=g).view(dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(byte_view(a), byte_view(b))


@dataclass
class Published:
    export: Export
    cache: torch.Tensor
    blocks: list[int]
    releases: list[ReleaseReason] = field(default_factory=list)

    @property
    def key(self) -> TransferKey:
        return self.export.key

    @property
    def layout(self) -> KVLayout:
        return self.export.header.layout

    def expected(self, layer: int) -> torch.Tensor:
        return extract_layer(self.cache, layer, self.blocks)


def publish(
    registry: KVExportRegistry,
    cache: torch.Tensor,
    blocks: list[int],
    request_id: str = "req",
    ready: bool = True,
    lease_s: float = 30.0,
    source: Callable[[int], torch.Tensor] | None = None,
) -> Published:
    layout = KVLayout.from_cache(cache)
    header = TransferHeader(
        key=TransferKey(request_id, f"{request_id}@1"),
        layout=layout,
        num_blocks=len(blocks),
        num_tokens=len(blocks) * BLOCK - 3,
        block_hashes=[(i * 0x9E3779B97F4A7C15) % 2**64 for i in range(len(blocks) - 1)],
        cache_salt="tenant-a",
        model_id="demo",
        deadline=time.time() + lease_s,
    )
    releases: list[ReleaseReason] = []
    export = registry.publish(
        header,
        source=source or (lambda layer: extract_layer(cache, layer, blocks)),
        lease_s=lease_s,
        on_release=releases.append,
    )
    if ready:
        export.all_ready()
    return Published(export, cache, blocks, releases)


class Recorder:
    """A sink that keeps every chunk it was given (and can write them into a cache)."""

    def __init__(self, dst: torch.Tensor | None = None, blocks: list[int] | None = None) -> None:
        self.chunks: list[LayerChunk] = []
        self.dst = dst
        self.blocks = blocks
        self.got_layer = [threading.Event() for _ in range(LAYERS)]

    def __call__(self, chunk: LayerChunk) -> None:
        self.chunks.append(chunk)
        if self.dst is not None:
            assert self.blocks is not None
            write_layer(self.dst, chunk.layer, self.blocks, chunk.payload)
        self.got_layer[chunk.layer].set()

    def assert_only_good(self, pub: Published, layers: int) -> None:
        """The sink got exactly layers 0..layers-1, each byte-identical to the source."""
        assert [c.layer for c in self.chunks] == list(range(layers))
        for c in self.chunks:
            assert same_bytes(c.payload, pub.expected(c.layer))


def soon(seconds: float = 10.0) -> float:
    return time.time() + seconds


def pull_in_thread(
    client: KVTransport, address: str, pub: Published, sink: Recorder, deadline: float
) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["header"] = client.pull(address, pub.key, pub.layout, sink, deadline)
        except BaseException as e:
            out["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def wait_until(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    end = time.time() + timeout
    while not cond():
        if time.time() > end:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.005)


@pytest.fixture
def registry() -> KVExportRegistry:
    return KVExportRegistry()


@pytest.fixture
def server(registry: KVExportRegistry) -> Iterator[KVTransferServer]:
    srv = KVTransferServer(registry, host="127.0.0.1", port=0)
    srv.start()
    yield srv
    srv.stop(0)


@pytest.fixture(params=TRANSPORTS)
def client(request: pytest.FixtureRequest) -> Iterator[KVTransport]:
    c = make_transport(request.param, puller_id="decode-0")
    yield c
    c.close()


# --- format -------------------------------------------------------------------------------


def test_layout_from_cache_and_mismatch_names_the_field() -> None:
    cache = random_cache(3, torch.bfloat16)
    layout = KVLayout.from_cache(cache)
    assert layout == KVLayout(LAYERS, BLOCK, HEADS, HEAD_DIM, "bfloat16")
    assert layout.layer_nbytes(3) == 2 * 3 * BLOCK * HEADS * HEAD_DIM * 2
    layout.check_compatible(KVLayout.from_cache(random_cache(9, torch.bfloat16)))
    other = KVLayout(LAYERS, BLOCK, HEADS, 128, "bfloat16")
    with pytest.raises(LayoutMismatch, match="head_dim: 64 here, 128 peer"):
        layout.check_compatible(other)
    with pytest.raises(LayoutMismatch, match="dtype"):
        layout.check_compatible(KVLayout.from_cache(random_cache(3, torch.float32)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_extract_then_write_moves_exact_bytes(dtype: torch.dtype) -> None:
    src, dst = random_cache(12, dtype, seed=1), random_cache(12, dtype, seed=2)
    before = dst.clone()
    src_ids, dst_ids = [7, 2, 9, 4], [0, 11, 3, 5]
    for layer in range(LAYERS):
        payload = extract_layer(src, layer, src_ids)
        assert payload.shape == (2, 4, BLOCK, HEADS, row_width(dtype)) and payload.is_contiguous()
        write_layer(dst, layer, dst_ids, payload)
    assert same_bytes(dst[:, :, dst_ids], src[:, :, src_ids])
    untouched = [b for b in range(12) if b not in dst_ids]
    assert same_bytes(dst[:, :, untouched], before[:, :, untouched])
    with pytest.raises(LayoutMismatch):
        write_layer(dst, 0, dst_ids[:3], extract_layer(src, 0, src_ids))


@settings(max_examples=60, deadline=None)
@given(
    block=st.integers(0, 5),
    kv=st.integers(0, 1),
    offset=st.integers(0, BLOCK * HEADS * HEAD_DIM * 2 - 1),
)
def test_a_flipped_byte_changes_exactly_its_blocks_checksum(
    block: int, kv: int, offset: int
) -> None:
    payload = extract_layer(random_cache(6, torch.bfloat16, seed=3), 1, range(6))
    sums = block_checksums(payload)
    assert len(set(sums)) == 6
    bad = payload.clone()
    bad[kv, block].view(torch.uint8).view(-1)[offset] ^= 0x01
    changed = [i for i, (a, b) in enumerate(zip(sums, block_checksums(bad), strict=True)) if a != b]
    assert changed == [block]


def test_verify_chunk_rejects_each_kind_of_damage() -> None:
    cache = random_cache(5, torch.bfloat16)
    registry = KVExportRegistry()
    header = publish(registry, cache, [4, 1, 3]).export.header
    good = LayerChunk(2, extract_layer(cache, 2, [4, 1, 3]), [])
    good.checksums = block_checksums(good.payload)
    verify_chunk(good, header, expected_layer=2)
    with pytest.raises(KVTruncatedError, match="layer 1 missing"):
        verify_chunk(good, header, expected_layer=1)
    with pytest.raises(KVIntegrityError, match="duplicate or out of order"):
        verify_chunk(good, header, expected_layer=3)
    with pytest.raises(KVIntegrityError, match="outside"):
        verify_chunk(LayerChunk(LAYERS, good.payload, good.checksums), header, LAYERS)
    with pytest.raises(KVIntegrityError, match="payload"):
        verify_chunk(LayerChunk(2, good.payload[:, :2], good.checksums), header, 2)
    with pytest.raises(KVIntegrityError, match="payload"):
        verify_chunk(LayerChunk(2, good.payload.float(), good.checksums), header, 2)
    with pytest.raises(KVIntegrityError, match="2 checksums for 3 blocks"):
        verify_chunk(LayerChunk(2, good.payload, good.checksums[:2]), header, 2)
    bad = good.payload.clone()
    bad[1, 2, 0, 0, 0] = bad[1, 2, 0, 0, 0] + 1
    with pytest.raises(KVIntegrityError, match="block 2 checksum"):
        verify_chunk(LayerChunk(2, bad, good.checksums), header, 2)


@st.composite
def headers(draw: st.DrawFn) -> TransferHeader:
    layout = KVLayout(
        draw(st.integers(1, 200)),
        draw(st.integers(1, 256)),
        draw(st.integers(1, 64)),
        draw(st.integers(1, 512)),
        draw(st.sampled_from(["float32", "float16", "bfloat16", "int8"])),
    )
    num_blocks = draw(st.integers(0, 50))
    return TransferHeader(
        key=TransferKey(draw(st.text(max_size=20)), draw(st.text(max_size=20))),
        layout=layout,
        num_blocks=num_blocks,
        num_tokens=draw(st.integers(0, num_blocks * layout.block_size)),
        block_hashes=draw(st.lists(st.integers(0, 2**64 - 1), max_size=num_blocks)),
        cache_salt=draw(st.text(max_size=20)),
        model_id=draw(st.text(max_size=20)),
        deadline=draw(st.floats(0, 4e9)),
    )


@settings(max_examples=100, deadline=None)
@given(
    header=headers(), trailer=st.builds(Trailer, st.integers(0, 10**6), st.integers(0, 2**64 - 1))
)
def test_header_and_trailer_roundtrip(header: TransferHeader, trailer: Trailer) -> None:
    assert decode_header(encode_header(header)) == header
    assert decode_trailer(encode_trailer(trailer)) == trailer


def _decodes_or_frame_error(decode: Callable[[bytes], object], data: bytes) -> None:
    try:
        decode(data)
    except KVFrameError:
        pass


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=200))
def test_decoders_raise_only_frame_errors_on_random_bytes(data: bytes) -> None:
    for decode in (decode_header, decode_trailer, decode_message, lambda d: list(decode_batch(d))):
        _decodes_or_frame_error(decode, data)


def test_a_hand_built_batch_is_plain_protobuf() -> None:
    """BatchWriter's records parse with the stock protobuf parser to the same messages (the
    payload first, the checksums on a layer's first piece), and decode_batch reads them back."""
    payload = extract_layer(random_cache(6, torch.bfloat16), 1, [5, 0, 2])
    chunk = LayerChunk(1, payload, block_checksums(payload))
    batch = BatchWriter()
    batch.add([frame_message(Frame("header", b"hdr"))])
    pieces = list(chunk_messages(chunk, chunk_bytes=20_000))
    for p in pieces:
        batch.add(p, len(p[2]))
    assert batch.payload_bytes == payload.numel() * 2 and len(pieces) == 3
    raw = batch.take()
    assert not batch and batch.payload_bytes == 0
    stock = pb.KVBatch.FromString(raw).messages
    ours = list(decode_batch(raw))
    assert [m.WhichOneof("kind") for m, _ in ours] == ["header", "chunk", "chunk", "chunk"]
    assert stock[0].header == b"hdr"
    for want, (msg, data) in zip(stock[1:], ours[1:], strict=True):
        assert bytes(data) == want.data
        assert msg.chunk == want.chunk
    assert list(stock[1].chunk.checksums) == chunk.checksums and not stock[2].chunk.checksums
    assert b"".join(m.data for m in stock[1:]) == byte_view(payload).tobytes()


@settings(max_examples=200, deadline=None)
@given(
    header=headers(), cut=st.integers(0, 10**6), flip=st.integers(0, 10**6), bit=st.integers(0, 7)
)
def test_decoders_raise_only_frame_errors_on_damaged_frames(
    header: TransferHeader, cut: int, flip: int, bit: int
) -> None:
    for frame, decode in (
        (encode_header(header), decode_header),
        (encode_trailer(Trailer(4, 12345)), decode_trailer),
    ):
        _decodes_or_frame_error(decode, frame[: cut % (len(frame) + 1)])
        flipped = bytearray(frame)
        flipped[flip % len(frame)] ^= 1 << bit
        _decodes_or_frame_error(decode, bytes(flipped))


# --- exporter -----------------------------------------------------------------------------


def _race_releases(registry: KVExportRegistry, pub: Published) -> list[bool]:
    """Ack, abort, fail, expiry and peer death from five threads released at once."""
    start = threading.Barrier(5)
    wins: list[bool] = []
    acts: list[Callable[[], object]] = [
        lambda: registry.release(pub.key, ReleaseReason.ACKED),
        lambda: registry.release(pub.key, ReleaseReason.ABORTED),
        lambda: pub.export.fail("boom"),
        lambda: registry.expire(),
        lambda: registry.peer_dead("decode-9"),
    ]

    def race(act: Callable[[], object]) -> None:
        start.wait()
        wins.append(bool(act()))

    threads = [threading.Thread(target=race, args=(a,)) for a in acts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return wins


def test_release_runs_exactly_once_whatever_races() -> None:
    registry = KVExportRegistry()
    cache = random_cache(2, torch.float32)
    for round_ in range(100):
        pub = publish(registry, cache, [0, 1], request_id=f"r{round_}", lease_s=-1)
        pub.export.pullers.add("decode-9")
        wins = _race_releases(registry, pub)
        assert len(pub.releases) == 1 and wins.count(True) == 1, (pub.releases, wins)
        assert len(registry) == 0
        assert not registry.release(pub.key, ReleaseReason.ACKED) and not pub.export.fail("again")
        assert len(pub.releases) == 1


def test_the_lease_starts_when_the_kv_is_complete_and_a_live_puller_renews_it() -> None:
    """A prompt queued or prefilled for longer than the lease does not lose its KV before its
    puller can take it: the lease runs from the last layer, and each renewal gives it
    ``lease_s`` more from then; a released export cannot be renewed."""
    registry = KVExportRegistry()
    cache = random_cache(2, torch.float32)
    pub = publish(registry, cache, [0, 1], request_id="q", ready=False, lease_s=5)
    assert registry.expire(time.time() + 3600) == []  # prefill not done: never expires
    assert registry.renew(pub.key) == 5  # a renewal before the start leaves it unstarted
    assert pub.export.lease_deadline == math.inf
    for layer in range(LAYERS - 1):
        pub.export.layer_ready(layer)
    assert registry.expire(time.time() + 3600) == []
    before = time.time()
    pub.export.layer_ready(LAYERS - 1)  # complete: the lease starts
    assert before + 5 <= pub.export.lease_deadline <= time.time() + 5
    assert registry.renew(pub.key, now=time.time() + 4) == 5
    assert registry.expire(time.time() + 6) == []  # renewed at +4: good until +9
    assert registry.expire(time.time() + 9.5) == [pub.key]
    assert registry.renew(pub.key) is None and pub.releases == [ReleaseReason.EXPIRED]
    late = publish(registry, cache, [0, 1], request_id="late", lease_s=5)
    assert registry.renew(late.key, now=time.time() + 6) is None  # past its deadline: gone


def test_lease_expiry_and_peer_death() -> None:
    registry = KVExportRegistry()
    cache = random_cache(3, torch.float32)
    now = time.time()
    a = publish(registry, cache, [0], request_id="a", lease_s=5)
    b = publish(registry, cache, [1], request_id="b", lease_s=50)
    c = publish(registry, cache, [2], request_id="c", lease_s=50)
    assert registry.expire(now) == [] and len(registry) == 3
    assert registry.expire(now + 10) == [a.key]
    assert registry.expire(now + 10) == [] and a.releases == [ReleaseReason.EXPIRED]
    with pytest.raises(KVUnknownTransfer):
        registry.get(a.key, "decode-1")
    registry.get(b.key, "decode-1")
    registry.get(c.key, "decode-2")
    assert registry.peer_dead("decode-1") == [b.key]
    assert b.releases == [ReleaseReason.PEER_DEAD] and c.releases == []
    # A pull after the deadline but before the owner's tick expires it on the spot.
    with pytest.raises(KVUnknownTransfer):
        registry.get(c.key, "decode-2", now=now + 100)
    assert c.releases == [ReleaseReason.EXPIRED] and len(registry) == 0
    # What tandem_kv_lease_expired_total reads (through the prefill worker's report).
    assert registry.releases == {ReleaseReason.EXPIRED: 2, ReleaseReason.PEER_DEAD: 1}


# --- transport contract -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_large_transfer_moves_exact_bytes(
    registry: KVExportRegistry, server: KVTransferServer, client: KVTransport, dtype: torch.dtype
) -> None:
    """32 MiB of random bytes, in each cache dtype (int8 rows with their scales as they are)."""
    row = row_width(dtype)
    layer_block = 2 * BLOCK * HEADS * row * torch.empty(0, dtype=dtype).element_size()
    n = (32 << 20) // (LAYERS * layer_block)  # 32 MiB of payload
    src = random_cache(n + 40, dtype, seed=5)
    src_ids = torch.randperm(n + 40, generator=torch.Generator().manual_seed(1))[:n].tolist()
    dst = torch.zeros(LAYERS, 2, n + 8, BLOCK, HEADS, row, dtype=dtype)
    dst_ids = torch.randperm(n + 8, generator=torch.Generator().manual_seed(2))[:n].tolist()
    pub = publish(registry, src, src_ids)
    sink = Recorder(dst, dst_ids)
    header = client.pull(server.address, pub.key, pub.layout, sink, soon(60))
    assert header == pub.export.header
    assert same_bytes(dst[:, :, dst_ids], src[:, :, src_ids])
    assert client.release(server.address, pub.key, ReleaseReason.ACKED)
    assert pub.releases == [ReleaseReason.ACKED] and len(registry) == 0
    assert not client.release(server.address, pub.key, ReleaseReason.ACKED)


@pytest.mark.e2e
@pytest.mark.parametrize("kind", TRANSPORTS)
def test_every_socket_a_transfer_opens_listens_on_the_given_host_only(kind: str) -> None:
    """A worker's KV sockets bind its node's address, never every interface: the gRPC server,
    and in torch mode the pair group's rendezvous store (TCPStore binds every interface unless
    handed its socket) and gloo's pair sockets. Here the host is loopback: every socket that
    started listening during a pull listens on 127.0.0.1."""

    def listening() -> set[tuple[str, int]]:
        """This process's listening sockets (an IPv4-mapped address read as its IPv4 one)."""
        sockets = set()
        for c in psutil.Process().net_connections("inet"):
            if c.status == psutil.CONN_LISTEN:
                ip = ipaddress.ip_address(c.laddr.ip)
                mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
                sockets.add((str(mapped or ip), c.laddr.port))
        return sockets

    before = listening()
    registry = KVExportRegistry()
    server = KVTransferServer(registry, host="127.0.0.1", port=0)
    server.start()
    client = make_transport(kind, puller_id="decode-0", host="127.0.0.1")
    try:
        src = random_cache(6, torch.float32, seed=3)
        pub = publish(registry, src, [1, 4])
        client.pull(server.address, pub.key, pub.layout, Recorder(), soon(60))
        opened = listening() - before
    finally:
        client.close()
        server.stop(0)
    assert len(opened) >= (1 if kind == "grpc" else 2), opened  # the server; and the store
    assert {ip for ip, _ in opened} == {"127.0.0.1"}, opened


def test_eight_concurrent_transfers_move_exact_bytes(
    registry: KVExportRegistry, server: KVTransferServer, client: KVTransport
) -> None:
    src = random_cache(8 * 24, torch.bfloat16, seed=7)
    dst = torch.zeros_like(src)
    pubs = [publish(registry, src, list(range(i, 8 * 24, 8)), f"r{i}") for i in range(8)]
    outs = []
    for i, pub in enumerate(pubs):
        dst_ids = list(range(i * 24, (i + 1) * 24))
        outs.append(pull_in_thread(client, server.address, pub, Recorder(dst, dst_ids), soon(60)))
    for thread, out in outs:
        thread.join()
        assert "error" not in out, out
    for i, pub in enumerate(pubs):
        assert same_bytes(dst[:, :, i * 24 : (i + 1) * 24], src[:, :, pub.blocks])
        assert client.release(server.address, pub.key, ReleaseReason.ACKED)
        assert pub.releases == [ReleaseReason.ACKED]
    assert len(registry) == 0


def _raw_pull(server: KVTransferServer, pub: Published) -> list[list[str]]:
    """Pull in gRPC mode with a bare gRPC client; the kinds of messages in each stream message."""
    request = pb.PullRequest(
        request_id=pub.key.request_id,
        attempt_id=pub.key.attempt_id,
        puller_id="raw",
        deadline=soon(),
        mode=pb.GRPC,
    )
    with grpc.insecure_channel(server.address, options=CHANNEL_OPTIONS) as channel:
        call = channel.unary_stream(rpc_path(PULL))(request.SerializeToString(), timeout=10)
        return [[m.WhichOneof("kind") for m, _ in decode_batch(raw)] for raw in call]


def test_what_is_ready_goes_in_one_stream_message(
    registry: KVExportRegistry, server: KVTransferServer
) -> None:
    """A computed transfer under CHUNK_BYTES: the header alone, then every layer and the trailer
    together (a stream message costs the sync server ~1 ms of thread hand-offs)."""
    pub = publish(registry, random_cache(8, torch.float32), [1, 5, 6])
    assert pub.export.header.layer_nbytes * LAYERS < CHUNK_BYTES
    assert _raw_pull(server, pub) == [["header"], ["chunk"] * LAYERS + ["trailer"]]


@pytest.mark.e2e  # starts its own gRPC server
def test_big_layers_go_in_chunk_sized_stream_messages(registry: KVExportRegistry) -> None:
    pub = publish(registry, random_cache(8, torch.float32), [1, 5, 6])
    layer = pub.export.header.layer_nbytes
    srv = KVTransferServer(registry, chunk_bytes=layer * 2 // 3)  # each layer in two pieces
    srv.start()
    try:
        # Never more than chunk_bytes of payload in a stream message: one piece each.
        assert _raw_pull(srv, pub) == [["header"]] + [["chunk"]] * (2 * LAYERS - 1) + [
            ["chunk", "trailer"]
        ]
    finally:
        srv.stop(0)


# Message index of layer l's chunk is l + 1 (0 is the header, LAYERS + 1 the trailer).
@pytest.mark.parametrize(
    ("kind", "error"),
    [
        (FaultAction.CORRUPT, KVIntegrityError),
        (FaultAction.TRUNCATE, KVTruncatedError),
        (FaultAction.DROP, KVTruncatedError),
        (FaultAction.RAISE, KVTruncatedError),
    ],
)
@pytest.mark.parametrize("layer", [0, LAYERS - 1])
def test_damaged_chunk_is_caught_before_the_sink(
    registry: KVExportRegistry,
    server: KVTransferServer,
    client: KVTransport,
    kind: FaultAction,
    error: type[KVTransferError],
    layer: int,
) -> None:
    pub = publish(registry, random_cache(40, torch.bfloat16, seed=layer), list(range(3, 40, 2)))
    registry.fault_hook = lambda key, index: (
        Fault(FaultPoint.TRANSFER_CHUNK, kind) if index == layer + 1 else None
    )
    sink = Recorder()
    with pytest.raises(error):
        client.pull(server.address, pub.key, pub.layout, sink, soon())
    sink.assert_only_good(pub, layer)
    assert pub.releases == []  # a failed pull does not end the lease; the puller's abort does
    assert client.release(server.address, pub.key, ReleaseReason.ABORTED)
    assert pub.releases == [ReleaseReason.ABORTED] and len(registry) == 0


@pytest.mark.parametrize(
    ("index", "kind", "error"),
    [
        (0, FaultAction.CORRUPT, KVTransferError),  # header: frame or key check
        (0, FaultAction.TRUNCATE, KVFrameError),
        (0, FaultAction.DROP, KVFrameError),  # a chunk before any header
        (LAYERS + 1, FaultAction.CORRUPT, KVTransferError),
        (LAYERS + 1, FaultAction.TRUNCATE, KVFrameError),
        (LAYERS + 1, FaultAction.DROP, KVTruncatedError),
    ],
)
def test_damaged_header_or_trailer_fails_the_pull(
    registry: KVExportRegistry,
    server: KVTransferServer,
    client: KVTransport,
    index: int,
    kind: FaultAction,
    error: type[KVTransferError],
) -> None:
    pub = publish(registry, random_cache(8, torch.float32), [1, 5, 6])
    registry.fault_hook = lambda key, i: (
        Fault(FaultPoint.TRANSFER_CHUNK, kind) if i == index else None
    )
    sink = Recorder()
    with pytest.raises(error):
        client.pull(server.address, pub.key, pub.layout, sink, soon())
    sink.assert_only_good(pub, 0 if index == 0 else LAYERS)


@pytest.mark.parametrize("index", range(LAYERS + 2))
def test_abort_at_every_point_releases_once(
    registry: KVExportRegistry, server: KVTransferServer, client: KVTransport, index: int
) -> None:
    """The sender aborts right before message ``index`` (header, each layer, trailer)."""
    pub = publish(registry, random_cache(8, torch.bfloat16), [7, 0, 3])

    def hook(key: TransferKey, i: int) -> None:
        if i == index:
            registry.release(key, ReleaseReason.ABORTED)

    registry.fault_hook = hook
    sink = Recorder()
    with pytest.raises(KVTransferAborted):
        client.pull(server.address, pub.key, pub.layout, sink, soon())
    sink.assert_only_good(pub, max(index - 1, 0) if index <= LAYERS else LAYERS)
    assert pub.releases == [ReleaseReason.ABORTED] and len(registry) == 0
    assert not client.release(server.address, pub.key, ReleaseReason.ABORTED)
    registry.fault_hook = None
    with pytest.raises(KVUnknownTransfer):  # and the transfer is gone for good
        client.pull(server.address, pub.key, pub.layout, Recorder(), soon())


def test_an_abort_that_tears_the_group_down_before_the_receives_are_posted(
    registry: KVExportRegistry, server: KVTransferServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Torch mode, abort right after the header: the sender discards its pair group, possibly
    before the puller has posted its receives (a race CI hit: posting then raised gloo's
    "connection closed"). The pull still ends as the abort the stream reports."""
    started = TorchStreamReader.started

    def late(self: TorchStreamReader, header: TransferHeader) -> None:
        pairs = server._pairs
        assert pairs is not None
        if header.key == pub.key:
            until = time.time() + 10
            while self.group.group_id in pairs._groups and time.time() < until:
                time.sleep(0.01)
            time.sleep(0.3)  # and the teardown has reached this end
        started(self, header)

    monkeypatch.setattr(TorchStreamReader, "started", late)
    pub = publish(registry, random_cache(8, torch.bfloat16), [7, 0, 3])

    def abort_after_header(key: TransferKey, i: int) -> None:
        if i == 1:
            registry.release(key, ReleaseReason.ABORTED)

    registry.fault_hook = abort_after_header
    client = make_transport("torch", puller_id="decode-0")
    try:
        with pytest.raises(KVTransferAborted):
            client.pull(server.address, pub.key, pub.layout, Recorder(), soon())
        assert pub.releases == [ReleaseReason.ABORTED] and len(registry) == 0
        registry.fault_hook = None  # and the client's next pull (on a new group) works
        again = publish(registry, random_cache(8, torch.bfloat16, seed=1), [1, 2], "req-2")
        sink = Recorder()
        client.pull(server.address, again.key, again.layout, sink, soon())
        sink.assert_only_good(again, LAYERS)
    finally:
        client.close()


def test_a_send_to_a_group_the_puller_tore_down_is_a_peer_error(server: KVTransferServer) -> None:
    """The sender's side of the race above: posting the ready-signal receive (or a send) on a
    group the puller already gave up can raise in gloo; the host turns that into
    :class:`KVPeerUnavailable` and drops the group, as a failed wait does."""
    client = make_transport("torch", puller_id="decode-0")
    assert isinstance(client, TorchKVClient)
    group_id = client._group(server.address, soon()).group_id
    pairs = server._pairs
    assert pairs is not None
    pairs.check(group_id, soon())  # formed on both ends
    client.close()  # the puller tears its end down (its last reference: gloo closes the pair)
    gc.collect()
    time.sleep(0.3)  # and the sender's end has seen it
    with pytest.raises(KVPeerUnavailable):  # gloo raises posting a receive on a closed pair
        pairs.expect_ready(group_id, 1, soon())
    assert group_id not in pairs._groups
    with pytest.raises(KVPeerUnavailable):  # and it stays unusable
        pairs.send(group_id, 1, torch.ones(1024), soon())


def test_abort_after_the_trailer_before_the_ack(
    registry: KVExportRegistry, server: KVTransferServer, client: KVTransport
) -> None:
    pub = publish(registry, random_cache(8, torch.bfloat16), [2, 4])
    sink = Recorder()
    client.pull(server.address, pub.key, pub.layout, sink, soon())
    sink.assert_only_good(pub, LAYERS)  # the data is complete and verified
    assert registry.release(pub.key, ReleaseReason.ABORTED)
    assert not client.release(server.address, pub.key, ReleaseReason.ACKED)  # the ack is late
    assert pub.releases == [ReleaseReason.ABORTED]


def test_prefill_failure_mid_stream_aborts_the_puller(
    registry: KVExportRegistry, server: KVTransferServer, client: KVTransport
) -> None:
    pub = publish(registry, random_cache(8, torch.bfloat16), [1, 2, 3], ready=False)
    sink = Recorder()
    thread, out = pull_in_thread(client, server.address, pub, sink, soon())
    pub.export.layer_ready(0)
    assert sink.got_layer[0].wait(10)
    pub.export.fail("engine died")
    thread.join()
    assert isinstance(out.get("error"), KVTransferAborted) and "engine died" in str(out["error"])
    sink.assert_only_good(pub, 1)
    assert pub.releases == [ReleaseReason.FAILED]


class GatedRecorder(Recorder):
    """A Recorder that stops at layer 1 until ``gate`` is set (a puller that fell behind)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def __call__(self, chunk: LayerChunk) -> None:
        if chunk.layer == 1:
            assert self.gate.wait(10)
        super().__call__(chunk)


def test_lease_expiry_mid_stream_releases_once(
    registry: KVExportRegistry, server: KVTransferServer, client: KVTransport
) -> None:
    pub = publish(registry, random_cache(8, torch.bfloat16), [1, 2, 3], ready=False, lease_s=30)
    sink = GatedRecorder()
    thread, out = pull_in_thread(client, server.address, pub, sink, soon())
    pub.export.layer_ready(0)
    assert sink.got_layer[0].wait(10)
    assert registry.expire(time.time() + 60) == []  # the KV is not complete: no lease yet
    pub.export.all_ready()
    assert registry.expire(time.time() + 60) == [pub.key]
    sink.gate.set()
    thread.join()
    assert isinstance(out.get("error"), KVTransferAborted)
    assert registry.expire(time.time() + 60) == []
    assert not client.release(server.address, pub.key, ReleaseReason.ACKED)
    assert pub.releases == [ReleaseReason.EXPIRED]


def test_no_byte_read_after_the_lease_ended_reaches_the_puller(
    registry: KVExportRegistry, server: KVTransferServer, client: KVTransport
) -> None:
    """#kv-transfer-leases: once a lease ends its blocks may be reused, so nothing read from
    them afterwards may leave. The puller has layers 0 and 1 when the lease expires while the
    server reads layer 2, and the blocks are overwritten right then (as a reused block would
    be): the pull aborts, and not one chunk or byte read after the expiry reached the puller
    (aborting alone, as test_lease_expiry_mid_stream_releases_once shows, would not say so)."""
    cache, blocks = random_cache(8, torch.bfloat16), [1, 2, 3]
    original = cache.clone()
    expired: list[list[TransferKey]] = []

    def source(layer: int) -> torch.Tensor:  # the server's read of a layer
        if layer == 2:  # the lease ends mid-read; another request reuses the blocks
            expired.append(registry.expire(time.time() + 60))
            cache[:, :, blocks] = random_cache(8, torch.bfloat16, seed=9)[:, :, blocks]
        return extract_layer(cache, layer, blocks)

    pub = publish(registry, cache, blocks, ready=False, source=source)
    sink = Recorder()
    thread, out = pull_in_thread(client, server.address, pub, sink, soon())
    for layer in (0, 1):
        pub.export.layer_ready(layer)
        assert sink.got_layer[layer].wait(10)
    pub.export.all_ready()  # the KV is complete: the lease starts
    thread.join()
    assert expired == [[pub.key]] and pub.releases == [ReleaseReason.EXPIRED]
    assert isinstance(out.get("error"), KVTransferAborted)
    assert [c.layer for c in sink.chunks] == [0, 1]  # nothing from the read that lost the race
    for c in sink.chunks:  # and only the bytes from before the reuse
        assert same_bytes(c.payload, extract_layer(original, c.layer, blocks))


def test_the_prefill_workers_sweep_expires_an_overdue_lease_nobody_pulls(
    registry: KVExportRegistry,
) -> None:
    """#kv-transfer-leases: "the prefill worker expires overdue leases every second". A lease
    nobody comes back for (no pull, no renewal: the puller died) is released EXPIRED by the
    worker's own loop within about a second of its deadline, so its blocks are freed."""
    from prefill_worker.worker import PrefillWorker  # the loop only needs a ``registry``

    pub = publish(registry, random_cache(2, torch.float32), [0, 1], lease_s=0.3)
    deadline = pub.export.lease_deadline

    worker: Any = SimpleNamespace(registry=registry)

    async def body() -> float:
        sweep = asyncio.create_task(PrefillWorker._expire_leases(worker))
        try:
            while not pub.releases and time.time() < deadline + 10:
                await asyncio.sleep(0.01)
            return time.time()
        finally:
            sweep.cancel()

    released_at = asyncio.run(body())
    assert pub.releases == [ReleaseReason.EXPIRED] and len(registry) == 0
    assert deadline <= released_at < deadline + 2.0  # the next tick, with slack for a busy box


def test_peer_death_releases_what_it_pulled(
    registry: KVExportRegistry, server: KVTransferServer, client: KVTransport
) -> None:
    pulled = publish(registry, random_cache(8, torch.bfloat16), [1, 2], "pulled", ready=False)
    other = publish(registry, random_cache(8, torch.bfloat16), [3, 4], "other")
    thread, out = pull_in_thread(client, server.address, pulled, Recorder(), soon())
    wait_until(lambda: "decode-0" in pulled.export.pullers, "the pull to register")
    assert registry.peer_dead("decode-0") == [pulled.key]
    thread.join()
    assert isinstance(out.get("error"), KVTransferAborted)
    assert pulled.releases == [ReleaseReason.PEER_DEAD] and other.releases == []


@pytest.mark.parametrize(
    ("given_s", "margin_s"),
    [(100.0, 0.5), (5.0, 0.5), (3.0, 0.3), (1.0, 0.1), (0.0, 0.0), (-2.0, 0.0)],
)
def test_the_sender_gives_up_a_margin_before_the_puller(given_s: float, margin_s: float) -> None:
    # Half a second early, but never more than a tenth of the time given (a short pull keeps
    # nine tenths to send in); a deadline already past leaves nothing to take a margin from.
    now = 1_000.0
    assert sender_deadline(now + given_s, now) == pytest.approx(now + given_s - margin_s)


@pytest.mark.parametrize("stall", ["layer_never_ready", "delayed_chunk"])
def test_stalled_sender_times_out_at_the_deadline(
    registry: KVExportRegistry, server: KVTransferServer, client: KVTransport, stall: str
) -> None:
    # A transfer first, so the deadline below is not spent opening the torch pair group. 3 s,
    # not 1: on a loaded 2-core CI machine the torch transport once took over 1 s to hand the
    # first (good) chunk over, and the sink had nothing when the deadline came.
    warm = publish(registry, random_cache(8, torch.bfloat16), [3], "warm")
    client.pull(server.address, warm.key, warm.layout, Recorder(), soon(60))
    assert client.release(server.address, warm.key, ReleaseReason.ACKED)
    pub = publish(registry, random_cache(8, torch.bfloat16), [1, 2], ready=False)
    if stall == "layer_never_ready":
        pub.export.layer_ready(0)
    else:
        pub.export.all_ready()
        registry.fault_hook = lambda key, i: (
            Fault(FaultPoint.TRANSFER_CHUNK, FaultAction.STALL, seconds=60) if i == 2 else None
        )
    sink = Recorder()
    start = time.time()
    with pytest.raises(KVTransferTimeout):
        client.pull(server.address, pub.key, pub.layout, sink, start + 3.0)
    # The sender gives up just before the deadline (so the puller hears why, and gets the layer
    # it was holding); nowhere near the 30 s group timeout or the 60 s stall.
    assert sender_deadline(start + 3.0, start) <= time.time() < start + 15
    sink.assert_only_good(pub, 1)
    assert pub.releases == []
    assert registry.release(pub.key, ReleaseReason.ABORTED) and pub.releases == [
        ReleaseReason.ABORTED
    ]


@pytest.mark.e2e  # starts its own gRPC server
def test_stopped_server_is_peer_unavailable(
    registry: KVExportRegistry, client: KVTransport
) -> None:
    srv = KVTransferServer(registry)
    srv.start()
    pub = publish(registry, random_cache(4, torch.float32), [0, 1])
    client.pull(srv.address, pub.key, pub.layout, Recorder(), soon())  # caches channel / group
    srv.stop(0)
    with pytest.raises(KVPeerUnavailable):
        client.pull(srv.address, pub.key, pub.layout, Recorder(), soon())
    with pytest.raises(KVPeerUnavailable):
        client.release(srv.address, pub.key, ReleaseReason.ACKED)
    fresh = type(client)("decode-1")  # same transport, no cached channel or pair group
    with pytest.raises(KVPeerUnavailable):
        fresh.pull(srv.address, pub.key, pub.layout, Recorder(), soon())
    fresh.close()
    assert pub.releases == []


def test_health_counts_exports(registry: KVExportRegistry, server: KVTransferServer) -> None:
    client = GrpcKVClient("router")
    assert client.health(server.address) == 0
    pub = publish(registry, random_cache(2, torch.float32), [0])
    assert client.health(server.address) == 1
    registry.release(pub.key, ReleaseReason.ABORTED)
    assert client.health(server.address) == 0
    client.close()


def test_unknown_transfer_and_layout_mismatch(
    registry: KVExportRegistry, server: KVTransferServer, client: KVTransport
) -> None:
    pub = publish(registry, random_cache(4, torch.float32), [0, 1])
    with pytest.raises(KVUnknownTransfer):
        client.pull(server.address, TransferKey("nope", "nope@1"), pub.layout, Recorder(), soon())
    theirs = KVLayout(LAYERS, BLOCK, HEADS, HEAD_DIM, "bfloat16")
    with pytest.raises(KVLayoutMismatch, match="dtype"):
        client.pull(server.address, pub.key, theirs, Recorder(), soon())
    sink = Recorder()
    client.pull(server.address, pub.key, pub.layout, sink, soon())  # still served afterwards
    sink.assert_only_good(pub, LAYERS)


@pytest.mark.e2e  # starts its own gRPC server
def test_receiver_gets_layer_zero_before_the_last_layer_is_ready(
    registry: KVExportRegistry, server: KVTransferServer, client: KVTransport
) -> None:
    pub = publish(registry, random_cache(16, torch.bfloat16), list(range(0, 16, 3)), ready=False)
    sink = Recorder()
    thread, out = pull_in_thread(client, server.address, pub, sink, soon())
    for layer in range(LAYERS):
        pub.export.layer_ready(layer)
        assert sink.got_layer[layer].wait(10)
        assert [c.layer for c in sink.chunks] == list(range(layer + 1))  # nothing ran ahead
    thread.join()
    assert out["header"] == pub.export.header
    sink.assert_only_good(pub, LAYERS)


# --- the real case: the exporter in another process ---------------------------------------

CROSS_BLOCKS = (32 << 20) // (LAYERS * 2 * BLOCK * HEADS * HEAD_DIM * 2) + 2


def _serve_in_child(requests: Any, replies: Any, host: Any = None) -> None:
    """Child process: publish a seeded cache once per transport (and, on a test bed's ``host``,
    one small export per abort point), serve them, report their releases."""
    address = "127.0.0.1"
    if host is not None:
        from tandem import testbed

        testbed.enter(host)  # from here on this process is on the bed's host
        address = host.address
    registry = KVExportRegistry()
    cache = random_cache(CROSS_BLOCKS, torch.bfloat16, seed=11)
    pubs = [publish(registry, cache, list(range(CROSS_BLOCKS))[::-1], kind) for kind in TRANSPORTS]
    for kind in TRANSPORTS if host is not None else []:
        small = random_cache(8, torch.bfloat16, seed=3)
        pubs += [publish(registry, small, [7, 0, 3], f"{kind}-abort-{i}") for i in ABORT_POINTS]

    def abort_before(key: TransferKey, index: int) -> None:
        if "-abort-" in key.request_id and index == int(key.request_id.rpartition("-")[2]):
            registry.release(key, ReleaseReason.ABORTED)

    registry.fault_hook = abort_before
    srv = KVTransferServer(registry, host=address)
    srv.start()
    replies.put(srv.address)
    requests.get()  # the parent is done
    replies.put({str(p.key): [r.value for r in p.releases] for p in pubs})
    srv.stop(0)


ABORT_POINTS = range(LAYERS + 2)  # before the header, each layer, the trailer


@contextlib.contextmanager
def server_in_child(host: Any = None) -> Iterator[tuple[str, Callable[[], Any]]]:
    """``_serve_in_child`` started; yields its address and a function that ends it and returns
    its releases."""
    ctx = mp.get_context("spawn")
    requests, replies = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_serve_in_child, args=(requests, replies, host), daemon=True)
    child.start()

    def finish() -> Any:
        requests.put("done")
        return replies.get(timeout=60)

    try:
        yield replies.get(timeout=60), finish
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()


def pull_the_big_one(kind: str, transport: KVTransport, address: str) -> None:
    cache = random_cache(CROSS_BLOCKS, torch.bfloat16, seed=11)
    blocks = list(range(CROSS_BLOCKS))[::-1]
    dst = torch.zeros_like(cache)
    key = TransferKey(kind, f"{kind}@1")
    transport.pull(address, key, KVLayout.from_cache(cache), Recorder(dst, blocks), soon(60))
    assert same_bytes(dst, cache)
    assert transport.release(address, key, ReleaseReason.ACKED)


@pytest.mark.e2e  # starts its own gRPC server
def test_cross_process_transfers_move_exact_bytes() -> None:
    with server_in_child() as (address, finish):
        for kind in TRANSPORTS:
            transport = make_transport(kind, puller_id=f"decode-{kind}")
            pull_the_big_one(kind, transport, address)
            transport.close()
        assert finish() == {f"{kind}#{kind}@1": ["acked"] for kind in TRANSPORTS}


@pytest.mark.e2e  # a test bed host
@pytest.mark.parametrize("kind", TRANSPORTS)
def test_across_bed_hosts_bytes_are_exact_and_aborts_release_once(bed: Any, kind: str) -> None:
    """The exporter on a test bed host (tandem/testbed.py), the puller in this machine's own
    namespace: every byte crosses the bed's link (veth, bridge, veth); the server binds the
    host's address, the torch pair group's puller end the bridge's. Exact bytes, and an abort
    before each stream message fails the pull with KVTransferAborted and releases once."""
    host = bed.hosts[1]
    with server_in_child(host) as (address, finish):
        assert address.startswith(f"{host.address}:")
        transport = make_transport(kind, puller_id=f"decode-{kind}", host=bed.bridge_address)
        try:
            pull_the_big_one(kind, transport, address)
            small = random_cache(8, torch.bfloat16, seed=3)
            for index in ABORT_POINTS:
                key = TransferKey(f"{kind}-abort-{index}", f"{kind}-abort-{index}@1")
                sink = Recorder()
                with pytest.raises(KVTransferAborted):
                    transport.pull(address, key, KVLayout.from_cache(small), sink, soon())
                got = min(max(index - 1, 0), LAYERS)
                assert [c.layer for c in sink.chunks] == list(range(got))
                for c in sink.chunks:
                    assert same_bytes(c.payload, extract_layer(small, c.layer, [7, 0, 3]))
                assert not transport.release(address, key, ReleaseReason.ABORTED)
        finally:
            transport.close()
        releases = finish()
    assert releases[f"{kind}#{kind}@1"] == ["acked"]
    for index in ABORT_POINTS:
        assert releases[f"{kind}-abort-{index}#{kind}-abort-{index}@1"] == ["aborted"]


# --- generated code -----------------------------------------------------------------------


def test_method_paths_come_from_the_proto() -> None:
    """The transports name every RPC the proto declares through its descriptor, under the
    path gRPC gives it (a renamed RPC fails at import, not on the wire)."""
    served = {m.name for m in (PULL, RELEASE, OPEN_PAIR_GROUP, HEALTH)}
    assert served == set(SERVICE.methods_by_name)
    assert rpc_path(PULL) == "/tandem.kv_transfer.KVTransfer/Pull"


def test_generated_protobuf_code_is_current(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    if shutil.which("bash") is None:
        pytest.skip("bash not available")
    env = {**os.environ, "PYTHON": sys.executable}
    subprocess.run(
        ["bash", str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)], env=env, check=True
    )
    for name in ("kv_transfer_pb2.py", "kv_transfer_pb2.pyi"):
        assert (tmp_path / name).read_bytes() == (ROOT / "kv_transfer" / name).read_bytes(), name
