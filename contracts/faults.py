"""The fault vocabulary: named points in the workers where a test (or a chaos run) makes a
worker crash, fail or stall, or makes the KV sender corrupt, cut or drop what it sends.

A :class:`FaultPlan` is armed on a worker actor (``set_faults``); the worker consults it at each
point with the attempt number and a count (layers streamed, tokens emitted, message index). A
fault fires once: at the first check where its conditions hold. The KV sender
(``kv_transfer.exporter``) applies the data faults it is handed in the same terms.

The :data:`SABOTAGE` actions are not faults a cluster survives but violations of its promises,
planted at DECODE_TOKENS by ``tandem chaos run --sabotage`` to show that the fault verdict
catches each one (a self-test of the harness; docs/design.md#chaos). Each spoils the one attempt
it fires on, at most one per attempt, and remembers which (``Fault.hit``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from enum import StrEnum


class FaultPoint(StrEnum):
    # count = 1: an attempt has reached the worker and waits there; none of it is computed yet
    ACCEPTED = "accepted"
    PREFILL_LAYERS = "prefill_layers"  # count = layers of the attempt's KV marked ready
    DECODE_TOKENS = "decode_tokens"  # count = tokens this worker emitted for the attempt
    # count = index of the KV stream message about to be sent: 0 = header, 1..L = layers
    # 0..L-1, L + 1 = trailer
    TRANSFER_CHUNK = "transfer_chunk"


class FaultAction(StrEnum):
    CRASH = "crash"  # the worker process dies at once (os._exit): Ray sees an actor death
    # The operation fails: at a worker point it raises FaultInjected; in the KV sender the
    # stream ends right there, cleanly, with nothing more (no trailer).
    RAISE = "raise"
    # Sleep ``seconds``: at DECODE_TOKENS in the actor's event loop (a hung worker: its
    # heartbeats stop), at PREFILL_LAYERS in the engine thread (a long step: the worker stays
    # healthy), at TRANSFER_CHUNK in the sender (a slow link; a release still wakes it).
    STALL = "stall"
    CORRUPT = "corrupt"  # flip one byte of the message, checksums left as computed (KV sender)
    TRUNCATE = "truncate"  # send only the first half of the message's bytes (KV sender)
    DROP = "drop"  # skip the message (KV sender)
    # Sabotage (DECODE_TOKENS): the delta's first token id changed, its last top-k
    # alternative's logprob changed, its first token dropped or sent twice, the stream held
    # ``seconds`` (the worker stays healthy), a KV block taken from the pool for ``seconds``,
    # the attempt's terminal record reported not at all or twice.
    SPOIL_TOKEN = "spoil_token"
    SPOIL_LOGPROB = "spoil_logprob"
    DROP_TOKEN = "drop_token"
    REPEAT = "repeat"
    HOLD = "hold"
    LEAK_BLOCK = "leak_block"
    LOSE_RECORD = "lose_record"
    DOUBLE_RECORD = "double_record"


SABOTAGE = frozenset(
    {
        FaultAction.SPOIL_TOKEN,
        FaultAction.SPOIL_LOGPROB,
        FaultAction.DROP_TOKEN,
        FaultAction.REPEAT,
        FaultAction.HOLD,
        FaultAction.LEAK_BLOCK,
        FaultAction.LOSE_RECORD,
        FaultAction.DOUBLE_RECORD,
    }
)


class FaultInjected(RuntimeError):
    """An injected failure (FaultAction.RAISE)."""


@dataclass
class Fault:
    point: FaultPoint
    action: FaultAction
    at: int = 0  # fires at the first check with count >= at
    attempt: int | None = None  # only on this attempt number (None: any)
    seconds: float = 0.0  # for STALL, HOLD, LEAK_BLOCK
    fired: bool = False
    hit: str | None = None  # the attempt it fired on, where the worker said (sabotage)


@dataclass
class FaultPlan:
    faults: list[Fault] = field(default_factory=list)

    def take(
        self, point: FaultPoint, attempt: int, count: int, key: str | None = None
    ) -> Fault | None:
        """The fault due at this point, marked fired (on attempt ``key``, when given); None
        when nothing is due. A sabotage fires only where the worker names the attempt, and
        skips one another sabotage already spoiled."""
        spoiled = {f.hit for f in self.faults if f.action in SABOTAGE and f.hit is not None}
        for fault in self.faults:
            if (
                not fault.fired
                and fault.point is point
                and count >= fault.at
                and (fault.attempt is None or fault.attempt == attempt)
                and not (fault.action in SABOTAGE and (key is None or key in spoiled))
            ):
                fault.fired = True
                fault.hit = key
                return fault
        return None

    def check(
        self, point: FaultPoint, attempt: int, count: int, key: str | None = None
    ) -> Fault | None:
        """Apply a due CRASH here; RAISE and STALL too, except at TRANSFER_CHUNK, where they
        and the data faults are returned for the KV sender to apply to its stream. A sabotage
        is returned for the worker to plant."""
        fault = self.take(point, attempt, count, key)
        if fault is None:
            return None
        if fault.action is FaultAction.CRASH:
            os._exit(1)
        if point is FaultPoint.TRANSFER_CHUNK:
            return fault
        if fault.action is FaultAction.RAISE:
            raise FaultInjected(f"{point} at {count} (attempt {attempt})")
        if fault.action is FaultAction.STALL:
            time.sleep(fault.seconds)
            return None
        return fault
