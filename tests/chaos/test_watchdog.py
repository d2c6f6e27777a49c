"""The harness names what holds its event loop: a blocking call on the loop is reported once,
with the stack that made it, while it lasts; a loop that keeps running reports nothing."""

from __future__ import annotations

import asyncio
import time

from chaos.watchdog import LoopWatchdog


def _blocking_call(seconds: float) -> None:
    time.sleep(seconds)  # what a synchronous client call does to the loop


def test_a_blocking_call_on_the_loop_is_named_once_per_stall() -> None:
    said: list[str] = []

    async def body() -> LoopWatchdog:
        async with LoopWatchdog(said.append, stall_s=0.5) as dog:
            await asyncio.sleep(0.8)  # the loop runs: nothing to say
            assert dog.stalls == []
            _blocking_call(1.5)
            await asyncio.sleep(0.5)
            _blocking_call(0.8)
            await asyncio.sleep(0.3)
        return dog

    dog = asyncio.run(body())
    assert len(dog.stalls) == 2 and len(said) == 2
    for stack, line in zip(dog.stalls, said, strict=True):
        assert "_blocking_call" in stack.splitlines()[-2], stack  # the innermost call
        assert line.startswith("this client's event loop is held (") and stack in line
