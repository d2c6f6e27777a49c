"""KV payloads over a torch.distributed pair group; the gRPC ``Pull`` stream stays the control
plane (header, per-layer checksums, trailer), so both transports share one checked protocol.

Every (puller, server) pair gets its own two-rank process group -- never the global default
group, so a dead worker breaks only its own pairs. The server hosts the rendezvous
``TCPStore``; ``OpenPairGroup`` starts the server's rank 0 in the background and replies at once
with the store's port, then the puller joins as rank 1 (a dead server fails the RPC at once
instead of leaving the puller waiting in a rendezvous). Groups are cached per peer, and any
failed pull discards its group on both sides: a send or recv may be left half-matched, and gloo
closes a pair on any timeout anyway. Concurrent pulls on one gloo group are kept apart by
per-pull tags; NCCL ignores tags, so there a group serves one pull at a time.

Backend by device: gloo for CPU caches (bound to the given host, loopback here), NCCL for CUDA.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from engine.kv_layout import KVLayout
from kv_transfer import kv_transfer_pb2 as pb
from kv_transfer.errors import (
    KVIntegrityError,
    KVPeerUnavailable,
    KVTransferTimeout,
    KVTruncatedError,
)
from kv_transfer.exporter import ReleaseReason
from kv_transfer.format import LayerChunk, TransferHeader, TransferKey
from kv_transfer.wire import OPEN_PAIR_GROUP, Channels, Sink, StreamReader

Tensor = torch.Tensor
DEFAULT_TIMEOUT_S = 60.0
# Torch mode: payload bytes a puller keeps receives posted for, ahead of the announcements
# (at least one layer).
RECV_AHEAD_BYTES = 16 << 20


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def new_pair_group(store: Any, rank: int, backend: str, host: str, timeout_s: float) -> Any:
    """A standalone two-rank process group over ``store`` (blocks until both ranks join)."""
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = timeout
        # Bind to the given host: the default device resolves the machine's hostname, which may
        # be a non-loopback interface.
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        return dist.ProcessGroupGloo(store, rank, 2, opts)
    if backend == "nccl":
        nccl = dist.ProcessGroupNCCL  # absent from CPU-only builds: only reached with CUDA caches
        opts = nccl.Options()
        opts._timeout = timeout
        return nccl(store, rank, 2, opts)
    raise ValueError(f"pair group backend {backend!r} is not 'gloo' or 'nccl'")


def _listening_socket(host: str) -> tuple[int, int]:
    """A socket listening on ``host`` only (port chosen by the OS): its descriptor, handed
    over to the caller, and its port."""
    family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.bind(address)
        sock.listen(128)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    return sock.detach(), port


def signals_ready(backend: str) -> bool:
    """Whether a puller tells the sender that its receives are posted: on gloo, a send that
    precedes its receive moves several times slower (measured: 12 MiB took ~12 ms once the
    receive came, 4-7 ms into a receive already posted). Not on NCCL: it queues a pair's ops in
    order on one stream, where the signal would sit behind the receives it announces."""
    return backend == "gloo"


def payload_bytes(payload: Tensor) -> Tensor:
    """The payload as a flat uint8 tensor on its device (what goes over the group)."""
    return payload.contiguous().view(torch.uint8).reshape(-1)


def _op_timeout(deadline: float) -> timedelta:
    return timedelta(seconds=max(deadline - time.time(), 1e-3))


@dataclass
class _HostedGroup:
    puller_id: str
    backend: str
    ready: threading.Event = field(default_factory=threading.Event)
    pg: Any = None
    error: str = ""


class PairGroupHost:
    """The server's ends (rank 0) of its pair groups, keyed by group id; one live group per
    puller (a puller that reopens replaced its old group)."""

    def __init__(self, host: str) -> None:
        self.host = host
        # Its socket made here, bound to ``host``: TCPStore binds every interface itself.
        fd, port = _listening_socket(host)
        self._store = dist.TCPStore(
            host, port, is_master=True, wait_for_workers=False, master_listen_fd=fd, use_libuv=True
        )
        self._lock = threading.Lock()
        self._groups: dict[str, _HostedGroup] = {}

    def open(self, request: pb.PairGroupRequest) -> int:
        """Start building rank 0 of ``request.group_id``; returns the store port to join by."""
        entry = _HostedGroup(request.puller_id, request.backend)
        with self._lock:
            if request.group_id in self._groups:
                raise ValueError(f"pair group {request.group_id!r} already exists")
            stale = [g for g, e in self._groups.items() if e.puller_id == request.puller_id]
            old = [self._groups.pop(g) for g in stale]
            self._groups[request.group_id] = entry
        for e in old:
            _abort(e.pg)

        def build() -> None:
            try:
                store = dist.PrefixStore(request.group_id, self._store)
                entry.pg = new_pair_group(store, 0, request.backend, self.host, request.timeout_s)
            except Exception as e:  # any rendezvous failure: the group is simply unusable
                entry.error = repr(e)
                self._drop(request.group_id, entry)
            entry.ready.set()

        threading.Thread(target=build, name=f"pair-group-{request.group_id}", daemon=True).start()
        return self._store.port

    def send(self, group_id: str, tag: int, payload: Tensor, deadline: float) -> PendingOp:
        """Start sending one layer's bytes to the puller; wait on the result. Sends on one tag
        arrive in order, so a pull may keep a few in flight while it reads the next layers."""
        entry = self._ready(group_id, deadline)
        data = payload_bytes(payload)
        work = (
            self._start(group_id, entry, "send", entry.pg.send, data, tag) if data.numel() else None
        )
        return PendingOp(self, group_id, entry, work, data, deadline, "send")

    def expect_ready(self, group_id: str, tag: int, deadline: float) -> PendingOp | None:
        """Post the receive for the puller's one-byte "receives posted" signal on ``tag`` (gloo
        groups only: see :func:`signals_ready`)."""
        entry = self._ready(group_id, deadline)
        if not signals_ready(entry.backend):
            return None
        flag = torch.zeros(1, dtype=torch.uint8)
        work = self._start(group_id, entry, "ready signal", entry.pg.recv, flag, tag)
        return PendingOp(self, group_id, entry, work, flag, deadline, "ready signal")

    def _start(
        self, group_id: str, entry: _HostedGroup, what: str, op: Any, data: Tensor, tag: int
    ) -> Any:
        """Post one op to the puller (rank 1); a group the puller already tore down raises
        there, and is then discarded like a failed wait (:meth:`PendingOp.wait`)."""
        try:
            return op([data], 1, tag)
        except RuntimeError as e:
            self._drop(group_id, entry)
            raise KVPeerUnavailable(f"pair group {group_id}: {what} failed: {e}") from e

    def check(self, group_id: str, deadline: float) -> None:
        """Raise :class:`KVPeerUnavailable` unless ``group_id`` is (or becomes) usable."""
        self._ready(group_id, deadline)

    def discard(self, group_id: str) -> None:
        with self._lock:
            entry = self._groups.get(group_id)
        if entry is not None:
            self._drop(group_id, entry)

    def close(self) -> None:
        with self._lock:
            entries, self._groups = list(self._groups.values()), {}
        for e in entries:
            _abort(e.pg)

    def _ready(self, group_id: str, deadline: float) -> _HostedGroup:
        with self._lock:
            entry = self._groups.get(group_id)
        if entry is not None:
            entry.ready.wait(max(deadline - time.time(), 0))
        if entry is None or entry.pg is None:
            why = entry.error if entry is not None else "unknown or discarded"
            raise KVPeerUnavailable(f"pair group {group_id!r} is not usable: {why or 'not ready'}")
        return entry

    def _drop(self, group_id: str, entry: _HostedGroup) -> None:
        with self._lock:
            if self._groups.get(group_id) is entry:
                del self._groups[group_id]
        _abort(entry.pg)


@dataclass
class PendingOp:
    """A send or receive the server started on a pair group."""

    host: PairGroupHost
    group_id: str
    entry: _HostedGroup
    work: Any
    data: Tensor  # kept alive until the op completes
    deadline: float
    what: str

    def wait(self) -> None:
        """Block until done; on any failure the group is discarded."""
        if self.work is None:
            return
        try:
            self.work.wait(_op_timeout(self.deadline))
        except RuntimeError as e:
            self.host._drop(self.group_id, self.entry)
            if time.time() >= self.deadline:
                raise KVTransferTimeout(
                    f"pair group {self.group_id}: {self.what} not done by the deadline"
                ) from e
            raise KVPeerUnavailable(f"pair group {self.group_id}: {self.what} failed: {e}") from e


def _abort(pg: Any) -> None:
    """Give a discarded group up. On NCCL the abort fails both ends' pending ops now. On gloo
    (torch 2.13, measured) abort leaves the pair open: it closes, failing the peer's pending
    ops, once the group's last reference goes; until then waits end at their deadlines."""
    if pg is not None:
        with contextlib.suppress(RuntimeError):
            pg.abort()


@dataclass
class _PairGroup:
    group_id: str
    pg: Any
    serial: contextlib.AbstractContextManager[Any]
    tags: itertools.count[int] = field(default_factory=lambda: itertools.count(1))


@dataclass
class _PostedRecv:
    buf: Tensor
    work: Any  # None for an empty payload


class TorchStreamReader(StreamReader):
    """Torch mode: each chunk message announces a layer whose bytes arrive on the pair group.

    Receives are posted as soon as the header is in (layer sizes are known from it), up to
    ``RECV_AHEAD_BYTES`` ahead, and then (gloo) the sender is told so with a one-byte send on the
    pull's tag, which its payloads wait for. A layer's bytes are used only once its
    announcement is checked.

    Posting can fail when the sender already gave the group up (it aborted the transfer right
    after the header): the failure is kept, and the stream goes on to say why (an abort status
    is a :class:`KVTransferAborted`); only a layer whose receive was never posted fails the pull
    as a transport error."""

    def __init__(
        self,
        key: TransferKey,
        layout: KVLayout,
        sink: Sink,
        group: _PairGroup,
        tag: int,
        device: torch.device,
        deadline: float,
    ) -> None:
        super().__init__(key, layout, sink)
        self.group = group
        self.tag = tag
        self.device = device
        self.deadline = deadline
        self._posted: deque[_PostedRecv] = deque()
        self._next_post = 0  # next layer to post a receive for
        self._ready: Any = None  # the "receives posted" send, until it completes
        self._flag = torch.ones(1, dtype=torch.uint8)  # its byte, alive while it is sent
        self._broken: RuntimeError | None = None  # why posting on the group failed

    def started(self, header: TransferHeader) -> None:
        self._post_ahead(header)
        if self._broken is None and header.layer_nbytes and signals_ready(backend_for(self.device)):
            try:
                self._ready = self.group.pg.send([self._flag], 0, self.tag)
            except RuntimeError as e:
                self._broken = e

    def _post_ahead(self, header: TransferHeader) -> None:
        try:
            self._post_some(header)
        except RuntimeError as e:
            self._broken = e

    def _post_some(self, header: TransferHeader) -> None:
        nbytes = header.layer_nbytes
        while self._next_post < header.layout.num_layers and (
            not self._posted or len(self._posted) * nbytes < RECV_AHEAD_BYTES
        ):
            buf = torch.empty(
                header.layout.payload_shape(header.num_blocks),
                dtype=header.layout.torch_dtype,
                device=self.device,
            )
            work = self.group.pg.recv([payload_bytes(buf)], 0, self.tag) if nbytes else None
            self._posted.append(_PostedRecv(buf, work))
            self._next_post += 1

    def payload(self, header: TransferHeader, chunk: pb.Chunk, data: memoryview) -> Tensor | None:
        self.start_layer(header, chunk)
        nbytes = header.layer_nbytes
        if chunk.nbytes != nbytes:
            kind = KVTruncatedError if chunk.nbytes < nbytes else KVIntegrityError
            raise kind(
                f"transfer {self.key}: layer {chunk.layer} announces {chunk.nbytes} of "
                f"{nbytes} bytes"
            )
        if self._ready is not None:  # done once the sender took it, before its first payload
            self._wait(self._ready, "the ready signal")
            self._ready = None
        if not self._posted:  # only when posting failed
            raise KVPeerUnavailable(
                f"transfer {self.key}: pair group {self.group.group_id} failed: {self._broken}"
            ) from self._broken
        recv = self._posted.popleft()
        if recv.work is not None:
            self._wait(recv.work, f"layer {chunk.layer}")
        self._post_ahead(header)
        return recv.buf

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait(_op_timeout(self.deadline))
        except RuntimeError as e:
            if time.time() >= self.deadline:
                raise KVTransferTimeout(
                    f"transfer {self.key}: {what} not through by the deadline"
                ) from e
            raise KVPeerUnavailable(
                f"transfer {self.key}: pair group {self.group.group_id} failed: {e}"
            ) from e


class TorchKVClient:
    """Pulls KV with payloads over pair groups (see the module docstring)."""

    def __init__(
        self,
        puller_id: str,
        host: str = "127.0.0.1",
        device: torch.device | str = "cpu",
        group_timeout_s: float = 30.0,
        default_timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.puller_id = puller_id
        self.host = host  # this side's address for its end of pair groups
        self.device = torch.device(device)
        self.backend = backend_for(self.device)
        self.group_timeout_s = group_timeout_s
        self.default_timeout_s = default_timeout_s
        self._channels = Channels()
        self._lock = threading.Lock()
        self._groups: dict[str, _PairGroup] = {}

    def pull(
        self,
        address: str,
        key: TransferKey,
        layout: KVLayout,
        sink: Callable[[LayerChunk], None],
        deadline: float | None,
    ) -> TransferHeader:
        """As :meth:`GrpcKVClient.pull`; payloads land on this client's device."""
        deadline = time.time() + self.default_timeout_s if deadline is None else deadline
        group = self._group(address, deadline)
        try:
            with group.serial:
                tag = next(group.tags)
                request = pb.PullRequest(
                    request_id=key.request_id,
                    attempt_id=key.attempt_id,
                    puller_id=self.puller_id,
                    deadline=deadline,
                    mode=pb.TORCH,
                    group_id=group.group_id,
                    tag=tag,
                )
                reader = TorchStreamReader(key, layout, sink, group, tag, self.device, deadline)
                return self._channels.pull(address, request, reader, deadline)
        except BaseException:
            self._discard(address, group)
            raise

    def release(self, address: str, key: TransferKey, reason: ReleaseReason) -> bool:
        """End the sender's lease on ``key``; False if it was already released."""
        return self._channels.release(address, self.puller_id, key, reason)

    def close(self) -> None:
        with self._lock:
            groups, self._groups = list(self._groups.values()), {}
        for g in groups:
            _abort(g.pg)
        self._channels.close()

    def _group(self, address: str, deadline: float) -> _PairGroup:
        with self._lock:  # one rendezvous at a time: no duplicate groups to one peer
            group = self._groups.get(address)
            if group is None:
                group = self._open(address, deadline)
                self._groups[address] = group
            return group

    def _open(self, address: str, deadline: float) -> _PairGroup:
        group_id = f"kv/{self.puller_id}/{uuid.uuid4().hex}"
        timeout_s = min(self.group_timeout_s, max(deadline - time.time(), 1e-3))
        request = pb.PairGroupRequest(
            puller_id=self.puller_id,
            group_id=group_id,
            backend=self.backend,
            timeout_s=self.group_timeout_s,
        )
        reply = self._channels.unary(
            address, OPEN_PAIR_GROUP, request, pb.PairGroupReply, timeout_s
        )
        server_host = address.rsplit(":", 1)[0]
        try:
            store = dist.TCPStore(
                server_host, reply.store_port, is_master=False, timeout=timedelta(seconds=timeout_s)
            )
            pg = new_pair_group(
                dist.PrefixStore(group_id, store), 1, self.backend, self.host, self.group_timeout_s
            )
        except RuntimeError as e:
            raise KVPeerUnavailable(f"pair group with {address} did not form: {e}") from e
        serial: contextlib.AbstractContextManager[Any] = (
            threading.Lock() if self.backend == "nccl" else contextlib.nullcontext()
        )
        return _PairGroup(group_id, pg, serial)

    def _discard(self, address: str, group: _PairGroup) -> None:
        with self._lock:
            if self._groups.get(address) is group:
                del self._groups[address]
        _abort(group.pg)
