"""A TCP proxy the tests own, to cut one process off from Redis while it runs on.

`cut()` is a network partition: the proxy stops passing bytes both ways, so requests in
flight and any sent meanwhile wait, nothing is refused, no connection closes (as TCP
retransmits through a cut link). `heal()` delivers everything held, late, in order.
Clients whose socket timeout passes meanwhile see a timeout, as they would on a real
network; cuts shorter than it deliver every held command late.

`drop()` is the other kind of blip: every connection through the proxy is closed at both
ends (Redis sees its clients go, as when a process dies or a middlebox restarts) and new
ones are closed as soon as they come, until `restore()`.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from types import TracebackType

HOST = "127.0.0.1"
CHUNK = 1 << 16


class Proxy:
    """Forwards HOST:`port` to HOST:`target`; use as a context manager."""

    def __init__(self, target: int) -> None:
        self.target = target
        self._open = threading.Event()
        self._open.set()
        self._closed = threading.Event()
        self._refusing = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server((HOST, 0))
        self.port = int(self._listener.getsockname()[1])
        self._acceptor = threading.Thread(target=self._accept, name="proxy-accept", daemon=True)
        self._acceptor.start()

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def cut(self) -> None:
        """From now on, hold every byte either way."""
        self._open.clear()

    def heal(self) -> None:
        """Deliver what was held and pass bytes again."""
        self._open.set()

    def drop(self) -> None:
        """Close every connection both ways, and each new one at once, until `restore()`."""
        self._refusing.set()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def restore(self) -> None:
        """Let connections through again (after `drop()`)."""
        self._refusing.clear()

    def close(self) -> None:
        self._closed.set()
        self._open.set()
        with contextlib.suppress(OSError):
            # wakes the acceptor's accept() (closing alone leaves it blocked until the join
            # gives up, 5 s a proxy: most of a quick chaos run's end)
            self._listener.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
        self._acceptor.join(5)

    def __enter__(self) -> Proxy:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
                if self._refusing.is_set():
                    client.close()  # dropped: the client sees its connection closed
                    continue
                upstream = socket.create_connection((HOST, self.target))
            except OSError:
                if self._closed.is_set():
                    return
                continue  # Redis is down: the client sees its connection closed
            with self._lock:
                self._sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(CHUNK)
                if not data:
                    break
                self._open.wait()  # a cut holds the bytes here until it heals
                if self._closed.is_set():
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
