"""The client's side of one request, across every attempt that serves it: the tokens and text
it has received, the sampler state after them, and how the request ended. No Ray: the
coordinator feeds it each worker's :class:`TokenDelta` and forwards the deltas it returns.

Text is the workers' engines' (their detokenizers hold back a partial stop string or UTF-8
sequence; a worker that continues the request primes its detokenizer with the tokens before),
so a request is detokenised once, wherever it runs, and the text continues exactly across a
hand-off or a migration.
"""

from __future__ import annotations

import time
from dataclasses import replace
from enum import StrEnum

from engine.outputs import SamplingSnapshot, TokenDelta
from engine.request import EngineRequest, FinishReason

# How an attempt may end that also ends the request for its client.
CLIENT_ENDS = frozenset(
    {
        FinishReason.EOS,
        FinishReason.STOP_TOKEN,
        FinishReason.STOP_STRING,
        FinishReason.MAX_TOKENS,
        FinishReason.CONTEXT_LIMIT,
        FinishReason.DEADLINE,
    }
)


class FailureReason(StrEnum):
    """Why an attempt ended early: the label of ``tandem_retries_total`` and
    ``tandem_migrations_total``."""

    WORKER_DIED = "worker_died"  # Ray reported the actor dead
    WORKER_FAILED = "worker_failed"  # the router marked it FAILED (missed heartbeats)
    KV_TRANSFER = "kv_transfer"  # the decode worker could not pull the KV
    NO_ROOM = "no_room"  # its engine refused the request (no KV room)
    NO_REPLICA = "no_replica"  # nothing outside the exclusions could take it
    WORKER_ERROR = "worker_error"  # the worker raised, or ended the attempt without a reason


class AttemptFailed(RuntimeError):
    """One attempt could not go on; ``worker`` (if known) is the one to blame."""

    def __init__(
        self,
        message: str,
        worker: str | None = None,
        dead: bool = False,
        rejected: bool = False,
        no_replica: bool = False,
        reason: FailureReason | None = None,
        transport: str | None = None,
    ) -> None:
        super().__init__(message)
        self.worker = worker
        self.dead = dead  # the worker itself is gone (tell the router)
        self.rejected = rejected  # its engine's admission refused the request (no KV room)
        self.no_replica = no_replica  # the router had no replica left outside the exclusions
        self.transport = transport  # how the KV transfer failed (KVTransferError.kind), if it did
        if reason is None:
            reason = (
                FailureReason.NO_REPLICA
                if no_replica
                else FailureReason.NO_ROOM
                if rejected
                else FailureReason.WORKER_DIED
                if dead
                else FailureReason.WORKER_ERROR
            )
        self.reason = reason


class ClientStream:
    """What one client request has received so far (it survives any worker)."""

    def __init__(self, request: EngineRequest) -> None:
        self.request = request
        self.tokens: list[int] = []
        self.text = ""
        self.snapshot: SamplingSnapshot | None = None  # sampler state after ``tokens``
        self.first_token_at: float | None = None
        self.queue_time_s: float | None = None  # of the attempt that produced the first token
        self.finish_reason: FinishReason | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def accept(self, batch: TokenDelta, worker: str) -> TokenDelta | None:
        """Take ``worker``'s delta: its tokens, text and sampler state. Returns the client's
        delta (None when it brings nothing to send): finished only when the request ended for
        its client, without the worker's sampler state. Raises AttemptFailed when the attempt
        ended without ending the request (an error, a cancellation, a rejection, or no finish
        reason)."""
        if self.finished:
            raise RuntimeError(f"request {self.request.key} already ended")
        if batch.token_ids and self.first_token_at is None:
            self.first_token_at = time.time()
            self.queue_time_s = batch.queue_time_s
        self.tokens.extend(batch.token_ids)
        self.text += batch.text
        if batch.sampler_snapshot is not None:
            self.snapshot = batch.sampler_snapshot
        elif batch.token_ids:
            # Greedy requests carry no per-token snapshots (only the prefill's, after token 1):
            # one from before these tokens would misalign a migration, which then rebuilds the
            # sampler from the tokens alone (all a greedy request needs).
            self.snapshot = None
        reason = batch.finish_reason if batch.finished else None
        if batch.finished and reason not in CLIENT_ENDS and reason is not FinishReason.HANDED_OFF:
            why = f"{reason.value if reason else 'no finish reason'}"
            detail = f": {batch.error}" if batch.error else ""
            raise AttemptFailed(f"{worker} ended the attempt ({why}){detail}", worker)
        if reason in CLIENT_ENDS:
            self.finish_reason = reason
        if not (batch.token_ids or batch.text or self.finished):
            return None
        return replace(
            batch,
            finished=self.finished,
            finish_reason=self.finish_reason,
            error=None,
            logprobs=batch.logprobs if self.request.params.logprobs is not None else None,
            sampler_snapshot=None,
        )
