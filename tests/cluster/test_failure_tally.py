"""Why attempts ended early, as the coordinator counts it for the ingress's counters."""

from __future__ import annotations

import pickle

from cluster.client_stream import AttemptFailed, FailureReason
from cluster.coordinator import FailureTally, _failure
from contracts.messages import KVPullFailed
from engine.engine import RequestRejected
from kv_transfer.errors import KVIntegrityError, KVPeerUnavailable


def test_the_reason_follows_what_failed() -> None:
    assert AttemptFailed("x", "d", dead=True).reason is FailureReason.WORKER_DIED
    assert AttemptFailed("x", "d").reason is FailureReason.WORKER_ERROR
    assert AttemptFailed("x", no_replica=True).reason is FailureReason.NO_REPLICA
    assert AttemptFailed("x", "d", rejected=True).reason is FailureReason.NO_ROOM
    hung = AttemptFailed("x", "d", True, reason=FailureReason.WORKER_FAILED)
    assert hung.reason is FailureReason.WORKER_FAILED and hung.dead
    pulled = _failure(KVPullFailed("bad chunk", "prefill-1", False, "integrity"), "decode-0")
    assert (pulled.worker, pulled.reason, pulled.transport) == (
        "prefill-1",
        FailureReason.KV_TRANSFER,
        "integrity",
    )
    no_room = _failure(RequestRejected("full"), "decode-0")
    assert (no_room.reason, no_room.transport) == (FailureReason.NO_ROOM, None)


def test_a_pull_failure_keeps_its_kind_across_actors() -> None:
    """KVPullFailed crosses Ray actor boundaries by pickling; the kind names the error."""
    exc = KVPullFailed("m", "prefill-0", True, KVPeerUnavailable.kind)
    back = pickle.loads(pickle.dumps(exc))
    assert (str(back), back.worker, back.dead, back.kind) == (
        "m",
        "prefill-0",
        True,
        "peer_unavailable",
    )
    assert KVIntegrityError.kind == "integrity"


def test_retries_before_the_first_token_migrations_after_transport_either_way() -> None:
    tally = FailureTally()
    kv = AttemptFailed("t", "p", reason=FailureReason.KV_TRANSFER, transport="truncated")
    tally.failed(kv, started=False, again=True)
    tally.failed(AttemptFailed("d", "d", dead=True), started=True, again=True)
    tally.failed(AttemptFailed("d", "d", dead=True), started=True, again=False)  # gave up
    tally.failed(kv, started=False, again=False)
    assert tally.retries == {FailureReason.KV_TRANSFER: 1}
    assert tally.migrations == {FailureReason.WORKER_DIED: 1}
    assert tally.transport == {"truncated": 2}
