"""How the coordinator blames a worker for a failed attempt, without Ray: a worker the router
marks FAILED while an attempt waits on a call to it is *dead* (its request moves on, and the
worker, restarted, may serve the next attempt), never excluded by name -- two such exclusions
left a migrating stream with both decode workers excluded and its attempts spent (CI, both
decode workers killed)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from cluster.client_stream import AttemptFailed, FailureReason
from cluster.coordinator import Coordinator
from cluster.retry import RetryPolicy


class _Router:
    """The one router call the coordinator's health watch makes: the worker goes FAILED."""

    def __init__(self, failed: str) -> None:
        self.failed = failed

    async def watch_health(self, version: int, timeout_s: float) -> tuple[int, dict[str, bool]]:
        if version >= 0:
            await asyncio.sleep(timeout_s)
        await asyncio.sleep(0.05)  # after the call below has started waiting
        return version + 1, {self.failed: False}


def coordinator(router: Any) -> Coordinator:
    return Coordinator(router, {}, {}, "m", RetryPolicy(), unavailable_wait_s=1.0)


@pytest.mark.parametrize("call", ["_await", "_next"])
def test_a_call_to_a_worker_marked_failed_meanwhile_fails_it_as_dead(call: str) -> None:
    async def wait() -> None:
        never: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        class Stream:  # a worker's stream whose next item never comes
            def __anext__(self) -> Any:
                return never

        c = coordinator(_Router("decode-1"))
        target = Stream() if call == "_next" else never
        await getattr(c, call)(target, "decode-1")

    with pytest.raises(AttemptFailed) as failed:
        asyncio.run(asyncio.wait_for(wait(), 5.0))
    exc = failed.value
    assert (exc.worker, exc.dead, exc.rejected, exc.reason) == (
        "decode-1",
        True,
        False,
        FailureReason.WORKER_FAILED,
    )
    assert str(exc) == "decode-1 is FAILED (router: missed heartbeats)"
