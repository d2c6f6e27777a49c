"""Process death in milliseconds: every worker process holds one TCP connection to the router
for its whole life, and the kernel closes it the moment the process exits (a crash, a
SIGKILL, the OOM killer), so the router knows at once, with or without a request there to
notice. A hang, a partition or a lost host keep the connection open: the heartbeat timeout
finds those (docs/design.md#worker-health).

The worker sends one line, ``NAME INCARNATION``, then waits for the router to close it; the
router reads until end of file and reports the loss of that incarnation.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 5.0


class LivenessServer:
    """The router's end: ``on_lost(name, incarnation)`` runs when a worker's connection
    closes."""

    def __init__(self, host: str, on_lost: Callable[[str, str], None]) -> None:
        self.host = host
        self.on_lost = on_lost
        self.address: str | None = None  # "host:port" once started
        self.connected: dict[str, str] = {}  # the workers holding a connection: incarnation
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, self.host, 0)
        port = self._server.sockets[0].getsockname()[1]
        self.address = f"{self.host}:{port}"
        return self.address

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            hello = await asyncio.wait_for(reader.readline(), HELLO_TIMEOUT_S)
            name, incarnation = hello.decode().split()
        except (TimeoutError, ValueError, UnicodeDecodeError, OSError):
            writer.close()
            return
        self.connected[name] = incarnation
        try:
            while await reader.read(4096):  # nothing more is sent: wait for the end
                pass
        except OSError:
            pass
        finally:
            writer.close()
            if self.connected.get(name) == incarnation:
                del self.connected[name]
        self.on_lost(name, incarnation)


async def hold(address: str, name: str, incarnation: str) -> None:
    """The worker's end: connect, say who this is, and return only when the connection ends
    (the router restarted or closed it; the caller connects again)."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(f"{name} {incarnation}\n".encode())
        await writer.drain()
        await reader.read()
    finally:
        writer.close()
