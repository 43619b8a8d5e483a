"""A TCP forwarder on 127.0.0.1 that counts the connections it accepts: TLS passes through it untouched,
so each connection it counts is one TLS handshake of the client."""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Any

__all__ = ["ConnectionCounter"]


class ConnectionCounter:
    """Forwards ``127.0.0.1:<port>`` to ``target`` (host, port); ``connections`` counts accepted connections.

    Use as a context manager; the listener and every forwarded connection are closed on exit."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.connections = 0
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def __enter__(self) -> ConnectionCounter:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._listener.close()
        with self._lock:
            for s in self._sockets:
                s.close()
        self._thread.join(timeout=10)

    def reset(self) -> None:
        with self._lock:
            self.connections = 0

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            upstream = socket.create_connection(self.target, timeout=30)
            with self._lock:
                self.connections += 1
                self._sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
