"""A TCP proxy on 127.0.0.1 that counts network round trips and can add latency.

(From the team's shared tools, ``shared/tools/turns_proxy.py``; it closes its loop on exit here.)

A *turn* is a client burst that follows a server reply (or opens the connection): the number
of times a client had to wait for the server. Pipelined messages sent together count once, so
the count is exact and does not depend on machine noise. ``delay`` adds that many seconds to
every burst in each direction (so one round trip costs 2 * delay more).

Use in-process: ``with TurnsProxy(("127.0.0.1", 5432), delay=0.0) as p: ... p.port ... p.turns``
(``p.reset()`` returns the count so far and starts again at 0).

Or as a process, for workers in other processes:
``python turns_proxy.py --upstream 127.0.0.1:5432 --port 15432 --delay-ms 0.5``: it prints
the total turns once a second when the count changed, and on exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time


class TurnsProxy:
    def __init__(self, upstream: tuple[str, int], delay: float = 0.0, port: int = 0) -> None:
        self.upstream = upstream
        self.delay = delay
        self.turns = 0
        self.connections = 0
        #: armed (``cut()``): the next reply of the server is dropped and the connection cut,
        #: after the server got (and ran) the client's request: a connection lost mid-trip
        self._cut_armed = 0
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.base_events.Server | None = None
        self.port = port

    def cut(self, reply: int = 1) -> None:
        """Cut the connection that gets the ``reply``-th reply of the server from now,
        dropping that reply (the requests before it were answered)."""
        with self._lock:
            self._cut_armed = reply

    def reset(self) -> int:
        with self._lock:
            n, self.turns = self.turns, 0
        return n

    def __enter__(self) -> TurnsProxy:
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        fut.result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            if self._server is not None:
                self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection(*self.upstream)
        for w in (cw, sw):
            s = w.get_extra_info("socket")
            if s is not None:
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.connections += 1
        state = {"last": "server"}  # the client speaks first: its first burst is a turn

        async def pump(r: asyncio.StreamReader, w: asyncio.StreamWriter, side: str) -> None:
            q: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

            async def writer() -> None:
                while True:
                    due, data = await q.get()
                    if not data:
                        w.close()
                        return
                    wait = due - time.monotonic()
                    if wait > 0:
                        await asyncio.sleep(wait)
                    w.write(data)
                    await w.drain()

            task = asyncio.ensure_future(writer())
            try:
                while True:
                    data = await r.read(65536)
                    if side == "client" and data and state["last"] != "client":
                        with self._lock:
                            self.turns += 1
                    if data:
                        state["last"] = side
                    if side == "server" and data:
                        with self._lock:
                            cut = self._cut_armed == 1
                            if self._cut_armed:
                                self._cut_armed -= 1
                        if cut:  # the request ran; its answer never arrives
                            for other in (cw, sw):
                                sock = other.get_extra_info("socket")
                                if sock is not None:
                                    with contextlib.suppress(OSError):
                                        sock.shutdown(socket.SHUT_RDWR)
                                other.close()
                            await q.put((0.0, b""))
                            break
                    await q.put((time.monotonic() + self.delay, data))
                    if not data:
                        break
            except (ConnectionError, OSError):
                await q.put((0.0, b""))
            await task

        try:
            await asyncio.gather(pump(cr, sw, "client"), pump(sr, cw, "server"), return_exceptions=True)
        except asyncio.CancelledError:
            pass  # the proxy is stopping
        finally:
            for w in (cw, sw):
                w.close()


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--upstream", required=True, help="HOST:PORT of the database server")
    ap.add_argument("--port", type=int, default=0, help="port to listen on, on 127.0.0.1 (0: any)")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay added to every burst")
    a = ap.parse_args()
    host, _, port = a.upstream.rpartition(":")
    with TurnsProxy((host, int(port)), a.delay_ms / 1000, a.port) as p:
        print(f"listening on 127.0.0.1:{p.port} -> {a.upstream}, one-way delay {a.delay_ms} ms", flush=True)
        last = -1
        try:
            while True:
                time.sleep(1)
                if p.turns != last:
                    last = p.turns
                    print(f"turns {last} connections {p.connections}", flush=True)
        except KeyboardInterrupt:
            print(f"turns {p.turns} connections {p.connections}", flush=True)
