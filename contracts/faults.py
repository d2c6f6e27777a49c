"""The fault vocabulary: named points in the workers where a test (or a chaos run) makes a
worker crash, fail or stall, or makes the KV sender corrupt, cut or drop what it sends.

A :class:`FaultPlan` is armed on a worker actor (``set_faults``); the worker consults it at each
point with the attempt number and a count (layers streamed, tokens emitted, message index). A
fault fires once: at the first check where its conditions hold. The KV sender
(``kv_transfer.exporter``) applies the data faults it is handed in the same terms.
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


class FaultInjected(RuntimeError):
    """An injected failure (FaultAction.RAISE)."""


@dataclass
class Fault:
    point: FaultPoint
    action: FaultAction
    at: int = 0  # fires at the first check with count >= at
    attempt: int | None = None  # only on this attempt number (None: any)
    seconds: float = 0.0  # for STALL
    fired: bool = False


@dataclass
class FaultPlan:
    faults: list[Fault] = field(default_factory=list)

    def take(self, point: FaultPoint, attempt: int, count: int) -> Fault | None:
        """The fault due at this point, marked fired; None when nothing is due."""
        for fault in self.faults:
            if (
                not fault.fired
                and fault.point is point
                and count >= fault.at
                and (fault.attempt is None or fault.attempt == attempt)
            ):
                fault.fired = True
                return fault
        return None

    def check(self, point: FaultPoint, attempt: int, count: int) -> Fault | None:
        """Apply a due CRASH here; RAISE and STALL too, except at TRANSFER_CHUNK, where they
        and the data faults are returned for the KV sender to apply to its stream."""
        fault = self.take(point, attempt, count)
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
