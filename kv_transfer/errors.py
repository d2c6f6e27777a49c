"""Every way a KV transfer fails, as one exception family: a caller (the decode worker) catches
:class:`KVTransferError` and retries or migrates; the subclass says why."""

from __future__ import annotations

from engine.kv_layout import LayoutMismatch


class KVTransferError(Exception):
    """Base of every KV transfer failure."""


class KVIntegrityError(KVTransferError):
    """A chunk's bytes, shape, dtype or position disagree with the header or its checksums."""


class KVTruncatedError(KVTransferError):
    """A chunk, part of a chunk, or the trailer never arrived."""


class KVTransferTimeout(KVTransferError):
    """The pull's deadline passed before the transfer completed."""


class KVTransferAborted(KVTransferError):
    """The sender gave the transfer up (released, expired, or its prefill failed)."""


class KVPeerUnavailable(KVTransferError):
    """The peer could not be reached, or its connection (or pair group) broke."""


class KVUnknownTransfer(KVTransferError):
    """The peer holds no such transfer (never published, or already released)."""


class KVLayoutMismatch(KVTransferError, LayoutMismatch):
    """Sender and receiver caches differ in a layout field."""


class KVFrameError(KVTransferError):
    """A header, trailer or wire message could not be decoded."""
