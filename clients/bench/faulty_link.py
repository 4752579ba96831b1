"""A TCP relay that can fail on demand: the network between the agents and kvloopd in `bench chaos`.

Every connection accepted on the relay's port is piped to the upstream address. Two faults:
``reset()`` cuts every open connection with a TCP RST (a Connect stream or a Lookup channel torn down
mid-flight, as a NAT or load-balancer timeout does), and ``refuse(seconds)`` cuts them and resets
every new connection until the time is up (the daemon unreachable for a moment). The relay runs its
own event loop in a thread, so the faults are called from ordinary code.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time

from kvloop.common.addresses import parse_host_port

_CHUNK = 256 * 1024


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with RST, not FIN: the peer sees a reset connection, not an orderly end."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


class FaultyLink:
    def __init__(self, upstream: str, listen_host: str = "127.0.0.1") -> None:
        self.upstream = parse_host_port(upstream, "upstream")
        self.listen_host = listen_host
        self.address = ""
        self.connections_cut = 0
        self._refusing_until = 0.0
        self._open: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="faulty-link", daemon=True)
        self._server: asyncio.Server | None = None

    def start(self) -> str:
        """Start relaying; returns the HOST:PORT clients should use instead of the upstream."""
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._accept, self.listen_host, 0), self._loop
        ).result(10)
        port = self._server.sockets[0].getsockname()[1]
        self.address = f"{self.listen_host}:{port}"
        return self.address

    def reset(self) -> int:
        """Cut every open connection (RST both ways); returns how many were cut."""
        return asyncio.run_coroutine_threadsafe(self._cut_all(), self._loop).result(10)

    def refuse(self, seconds: float) -> int:
        """Cut every open connection and reset new ones for ``seconds``; returns how many were cut."""
        self._refusing_until = time.monotonic() + seconds
        return self.reset()

    def stop(self) -> None:
        if not self._thread.is_alive():
            return

        async def close() -> None:
            if self._server is not None:
                self._server.close()
            await self._cut_all()
            # the aborted connections end their pipes; cancel only what is still running after that
            # (asyncio's stream callback reports a cancelled handler as an error)
            pipes = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            if pipes:
                _, stragglers = await asyncio.wait(pipes, timeout=2)
                for task in stragglers:
                    task.cancel()
                await asyncio.gather(*stragglers, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _cut_all(self) -> int:
        pairs = list(self._open)
        self._open.clear()
        for downstream, upstream in pairs:
            _abort(downstream)
            _abort(upstream)
        self.connections_cut += len(pairs)
        return len(pairs)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if time.monotonic() < self._refusing_until:
            _abort(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:  # the daemon is down: the client sees its connection reset, as it would
            _abort(writer)
            return
        pair = (writer, up_writer)
        self._open.add(pair)
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        finally:
            if pair in self._open:
                self._open.discard(pair)
                writer.close()
                up_writer.close()

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(_CHUNK):
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
        except (ConnectionError, OSError):
            _abort(writer)
