"""A TCP load balancer on loopback in front of several operator replicas' webhook servers, standing
in for their Service: the API server's webhook calls reach whichever replica is up.

Each new connection goes to the next backend in turn; a backend that refuses the connection
(its process gone) is skipped for the next, as a load balancer with health checks does. Bytes
pass through untouched: TLS ends at the replica, whose certificate names 127.0.0.1. `remove`
takes a backend out of the rotation the way the endpoints controller takes out a pod that is
not ready or terminating: open connections stay. It runs its own event loop in a thread, so a
test that blocks (starting a process, kubectl) never stalls the API server's webhook calls.

What it does not model: kube-proxy sends a new connection to a killed pod's address until the
endpoints update (about a second); the API server does not retry a webhook POST, so a call
made on such a connection is refused there.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading


class Balancer:
    def __init__(self) -> None:
        self.port = 0
        self.backends: list[int] = []
        self.connections: collections.Counter[int] = collections.Counter()  # served, by backend port
        self.open: collections.Counter[int] = collections.Counter()  # open now, by backend port
        self._next = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="balancer", daemon=True)
        self._server: asyncio.base_events.Server | None = None
        self._lock = threading.Lock()

    def start(self) -> Balancer:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), self._loop).result(10)  # fmt: skip
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def add(self, port: int) -> None:
        with self._lock:
            if port not in self.backends:
                self.backends.append(port)

    def remove(self, port: int) -> None:
        with self._lock:
            if port in self.backends:
                self.backends.remove(port)

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _rotation(self) -> list[int]:
        with self._lock:
            if not self.backends:
                return []
            self._next = (self._next + 1) % len(self.backends)
            return self.backends[self._next:] + self.backends[:self._next]

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        for port in self._rotation():
            try:
                upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", port)
                break
            except OSError:
                continue
        else:
            client_writer.close()
            return
        self.connections[port] += 1
        self.open[port] += 1
        writers = (client_writer, upstream_writer)

        async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            # One side gone: so is the other, as a TCP proxy's peer sees it.
            for w in writers:
                w.close()

        try:
            await asyncio.gather(pump(client_reader, upstream_writer), pump(upstream_reader, client_writer))
        finally:
            self.open[port] -= 1
