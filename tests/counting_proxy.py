"""A request- and byte-counting S3 proxy for multi-rank tests (a ``FaultProxy`` that also counts).

Every rank's S3 client points at ``proxy.url``; the proxy forwards to the real server and
records, per (operation, key), how many requests it served and how many response-body
bytes it sent. Ranks run in other processes, so the counts are read and reset over HTTP on
the proxy itself (``counts(url)`` / ``reset(url)``), which lets one spawned job measure
several phases. Faults can still be planned with ``set_rules`` (see ``fault_proxy.Rule``).
"""

from __future__ import annotations

import json
import socket
import urllib.request
from collections import Counter

from fault_proxy import FaultProxy, _Request, _response_head

__all__ = ["CountingProxy", "counts", "reset", "Counts"]

_CONTROL = "/__counting_proxy__/"


class Counts:
    """Requests and body bytes per operation and key, as read from the proxy."""

    def __init__(self, rows: list[list]) -> None:
        self.rows = [(str(op), str(key), int(n), int(nbytes)) for op, key, n, nbytes in rows]

    def requests(self, op_prefix: str = "", key_suffix: str = "") -> int:
        return sum(n for op, key, n, _ in self.rows if op.startswith(op_prefix) and key.endswith(key_suffix))

    def bytes(self, op_prefix: str = "", key_suffix: str = "") -> int:
        return sum(b for op, key, _, b in self.rows if op.startswith(op_prefix) and key.endswith(key_suffix))


class CountingProxy(FaultProxy):
    def __init__(self, upstream: str, **kwargs: object) -> None:
        super().__init__(upstream, **kwargs)  # type: ignore[arg-type]
        self.requests: Counter[tuple[str, str]] = Counter()
        self.body_bytes: Counter[tuple[str, str]] = Counter()

    def _serve(self, client: socket.socket, req: _Request) -> bool:
        if req.target.startswith(_CONTROL):
            with self._lock:
                rows = [[op, key, n, self.body_bytes[(op, key)]] for (op, key), n in self.requests.items()]
                if req.target.endswith("reset"):
                    self.requests.clear()
                    self.body_bytes.clear()
            body = json.dumps(rows).encode()
            client.sendall(_response_head("HTTP/1.1 200 OK", [("Content-Type", "application/json")], len(body)) + body)
            return True
        return super()._serve(client, req)

    def _forward(self, req: _Request) -> tuple[str, list[tuple[str, str]], bytes]:
        status_line, headers, body = super()._forward(req)
        with self._lock:
            self.requests[(req.op, req.key)] += 1
            self.body_bytes[(req.op, req.key)] += len(body) if req.method != "HEAD" else 0
        return status_line, headers, body


def _call(url: str, what: str) -> Counts:
    with urllib.request.urlopen(f"{url}{_CONTROL}{what}", timeout=30) as resp:
        return Counts(json.loads(resp.read()))


def counts(url: str) -> Counts:
    """What the proxy at ``url`` has forwarded since the last reset."""
    return _call(url, "counts")


def reset(url: str) -> Counts:
    """The counts so far, then zero them."""
    return _call(url, "reset")
