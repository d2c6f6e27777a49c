"""The liveness connection: a worker process that exits is known to the router within
milliseconds, whoever kills it; a connection that never says who it is counts for nothing."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from contracts.liveness import LivenessServer, hold

pytestmark = pytest.mark.e2e  # real sockets

CHILD = """
import asyncio, sys
from contracts.liveness import hold
asyncio.run(hold(sys.argv[1], "decode-3", "inc-7"))
"""


def test_a_killed_process_is_reported_lost_within_milliseconds() -> None:
    async def body() -> None:
        lost: list[tuple[str, str, float]] = []
        server = LivenessServer("127.0.0.1", lambda n, i: lost.append((n, i, time.time())))
        address = await server.start()
        child = subprocess.Popen([sys.executable, "-c", CHILD, address])
        try:
            await asyncio.sleep(3.0)  # it connected and said who it is
            assert lost == []
            killed = time.time()
            child.kill()
            until = time.time() + 5
            while not lost:
                assert time.time() < until, "the death was never reported"
                await asyncio.sleep(0.005)
        finally:
            child.kill()
            child.wait()
        [(name, incarnation, at)] = lost
        assert (name, incarnation) == ("decode-3", "inc-7")
        assert at - killed < 0.2

    asyncio.run(asyncio.wait_for(body(), 30))


def test_a_connection_that_ends_reports_its_worker_once_and_strangers_nothing() -> None:
    async def body() -> None:
        lost: list[tuple[str, str]] = []
        server = LivenessServer("127.0.0.1", lambda n, i: lost.append((n, i)))
        address = await server.start()
        host, port = address.rsplit(":", 1)
        task = asyncio.create_task(hold(address, "prefill-0", "a1"))
        _, stranger = await asyncio.open_connection(host, int(port))
        stranger.write(b"not a hello at all\n")  # three words: refused
        await stranger.drain()
        stranger.close()
        await asyncio.sleep(0.3)
        assert lost == [] and not task.done()
        task.cancel()  # the worker's end closes
        await asyncio.gather(task, return_exceptions=True)
        until = time.time() + 5
        while not lost:
            assert time.time() < until
            await asyncio.sleep(0.01)
        assert lost == [("prefill-0", "a1")]

    asyncio.run(asyncio.wait_for(body(), 30))
