"""The fault-injection harness: named points in the workers where a test (or a chaos run)
makes a worker crash, fail or stall, and make the KV transport corrupt, cut or drop data.

A :class:`FaultPlan` is armed on a worker actor (``set_faults``); the worker consults it at each
point with the attempt number and a count (layers streamed, tokens emitted). A fault fires once:
at the first check where its conditions hold.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from enum import StrEnum


class FaultPoint(StrEnum):
    PREFILL_LAYERS = "prefill_layers"  # count = layers of the attempt's KV marked ready
    DECODE_TOKENS = "decode_tokens"  # count = tokens this worker emitted for the attempt
    TRANSFER_CHUNK = "transfer_chunk"  # count = index of the KV chunk about to be sent


class FaultAction(StrEnum):
    CRASH = "crash"  # the worker process dies at once (os._exit): Ray sees an actor death
    RAISE = "raise"  # the operation fails with FaultInjected
    # sleep ``seconds``: at DECODE_TOKENS in the actor's event loop (a hung worker: its
    # heartbeats stop), at PREFILL_LAYERS in the engine thread (a long step: the worker stays
    # healthy), at TRANSFER_CHUNK in the sender (a slow link)
    STALL = "stall"
    CORRUPT = "corrupt"  # flip bytes of the chunk (transfer only)
    TRUNCATE = "truncate"  # send part of the chunk (transfer only)
    DROP = "drop"  # skip the chunk (transfer only)


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
        """Apply a due CRASH / RAISE / STALL here; other actions are returned for the caller
        (the transport) to apply to its data."""
        fault = self.take(point, attempt, count)
        if fault is None:
            return None
        if fault.action is FaultAction.CRASH:
            os._exit(1)
        if fault.action is FaultAction.RAISE:
            raise FaultInjected(f"{point} at {count} (attempt {attempt})")
        if fault.action is FaultAction.STALL:
            time.sleep(fault.seconds)
            return None
        return fault
