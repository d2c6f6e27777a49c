"""Every way a KV transfer fails, as one exception family: a caller (the decode worker) catches
:class:`KVTransferError` and retries or migrates; the subclass says why, and its ``kind`` names
it in metrics."""

from __future__ import annotations


class KVTransferError(Exception):
    """Base of every KV transfer failure."""

    kind = "other"  # the label of tandem_transport_failures_total


class KVIntegrityError(KVTransferError):
    """A chunk's bytes, shape, dtype or position disagree with the header or its checksums."""

    kind = "integrity"


class KVTruncatedError(KVTransferError):
    """A chunk, part of a chunk, or the trailer never arrived."""

    kind = "truncated"


class KVTransferTimeout(KVTransferError):
    """The pull's deadline passed before the transfer completed."""

    kind = "timeout"


class KVTransferAborted(KVTransferError):
    """The sender gave the transfer up (released, expired, or its prefill failed)."""

    kind = "aborted"


class KVPeerUnavailable(KVTransferError):
    """The peer could not be reached, or its connection (or pair group) broke."""

    kind = "peer_unavailable"


class KVUnknownTransfer(KVTransferError):
    """The peer holds no such transfer (never published, or already released)."""

    kind = "unknown_transfer"


class KVLayoutMismatch(KVTransferError):
    """Sender and receiver caches differ in a layout field (the engine's ``LayoutMismatch``,
    seen across a transfer)."""

    kind = "layout_mismatch"


class KVFrameError(KVTransferError):
    """A header, trailer or wire message could not be decoded."""

    kind = "frame"
