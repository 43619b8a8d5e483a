"""A fault-injecting HTTP/1.1 reverse proxy for S3 tests (stdlib only, loopback only).

Point an S3 client at ``FaultProxy.url``; requests are forwarded unchanged (request line,
headers including the SigV4-signed ``Host``, and body bytes) to the upstream endpoint.
SeaweedFS checks the signature against the ``Host`` the client sent, which is the proxy's,
so no rewriting is needed. The one change: an ``Expect: 100-continue`` request is answered
``100 Continue`` by the proxy itself and forwarded without the ``Expect`` header (botocore
does not sign it).

A seeded :class:`Rule` list decides, per request, whether to inject a fault instead of (or
on top of) forwarding it:

``"500"``       answer ``500 InternalError`` (S3 XML body), request not forwarded
``"503"``       answer ``503 SlowDown`` (S3 XML body), request not forwarded
``"reset"``     close the client connection with a TCP RST, request not forwarded
``"truncate"``  forward, then send the response headers (full ``Content-Length``) and only
                half the body, then close
``"stall"``     sleep ``stall_s`` seconds, then forward normally
``"md5"``       answer ``400 MissingContentMD5`` (MinIO's gateway on DeleteObjects), not forwarded
``"501"``       answer ``501 NotImplemented`` (a server without the operation), not forwarded
``"trickle"``   forward, then send the whole answer (status line, headers, body) one byte every
                ``trickle_s`` seconds: every socket read gets a byte, so ``read_timeout`` never fires
``"trickle_body"`` forward, send the status line and headers at once, then the body one byte every
                ``trickle_s`` seconds

``drop_response_headers`` removes (method, header) pairs from responses (e.g. ``("HEAD", "etag")``).
``drop_request_headers`` removes headers from every forwarded request (e.g. ``If-None-Match``,
to play a server without conditional writes in front of moto, which checks no signatures).

The decision for a request is a function of the seed, the request's identity (method, key,
part number, range; not the bucket or upload id) and how many times that identity was seen,
so a plan injects the same faults whatever the thread interleaving (a resumed ranged GET
counts as the same request as the one it resumes). ``max_per_request`` bounds how many
faults (from any rule) one identity may already have had for a rule to fire, so a
transient plan can never exhaust retries.

Threads are bounded (``max_connections``), sockets time out, and the server shuts itself
down after ``lifetime_s`` even if the test forgets to.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import socket
import socketserver
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from http.client import HTTPResponse
from urllib.parse import parse_qs, urlsplit

__all__ = ["FaultProxy", "Rule", "classify", "error_response", "FAULTS"]

FAULTS = ("500", "503", "reset", "truncate", "stall", "md5", "501", "trickle", "trickle_body")

_ERRORS = {
    "500": (500, "Internal Server Error", "InternalError", "We encountered an internal error. Please try again."),
    "503": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
    # What servers lacking a feature answer: MinIO's gateway on a DeleteObjects without Content-MD5,
    # s3rver on ListMultipartUploads.
    "md5": (400, "Bad Request", "MissingContentMD5", "Missing required header for this request: Content-Md5."),
    "501": (
        501,
        "Not Implemented",
        "NotImplemented",
        "A header you provided implies functionality that is not implemented.",
    ),
}


def classify(method: str, target: str, headers: dict[str, str]) -> str:
    """The S3 operation of a path-style request, from method, query string and headers."""
    parts = urlsplit(target)
    query = parse_qs(parts.query, keep_blank_values=True)
    path = parts.path.lstrip("/")
    bucket, _, key = path.partition("/")
    method = method.upper()
    if not key:
        if method == "GET":
            return "ListMultipartUploads" if "uploads" in query else "ListObjects"
        if method == "HEAD":
            return "HeadBucket"
        if method == "PUT":
            return "CreateBucket"
        if method == "POST" and "delete" in query:
            return "DeleteObjects"
        if method == "DELETE":
            return "DeleteBucket"
        return f"Bucket{method.title()}"
    if method == "POST":
        if "uploads" in query:
            return "CreateMultipartUpload"
        if "uploadId" in query:
            return "CompleteMultipartUpload"
        return "PostObject"
    if method == "PUT":
        if "partNumber" in query and "uploadId" in query:
            return "UploadPartCopy" if "x-amz-copy-source" in headers else "UploadPart"
        return "PutObject"
    if method == "DELETE":
        return "AbortMultipartUpload" if "uploadId" in query else "DeleteObject"
    if method == "HEAD":
        return "HeadObject"
    if method == "GET":
        if "uploadId" in query:
            return "ListParts"
        return "GetObjectRange" if "range" in headers else "GetObject"
    return method


@dataclass
class Rule:
    """Inject ``fault`` into a fraction ``rate`` of requests whose operation is in ``ops``.

    ``faults`` (instead of ``fault``) picks one of several faults per injection. ``key_contains``
    narrows the rule to keys containing that text. ``max_per_request`` caps the faults injected
    into one request identity (None: no cap, e.g. a persistent failure); ``limit`` caps the
    rule's faults overall.
    """

    ops: Iterable[str]
    fault: str = "500"
    rate: float = 1.0
    faults: tuple[str, ...] = ()
    key_contains: str | None = None
    max_per_request: int | None = None
    limit: int | None = None
    stall_s: float = 1.0
    trickle_s: float = 0.5
    injected: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.ops = frozenset(self.ops)
        for f in self.faults or (self.fault,):
            if f not in FAULTS:
                raise ValueError(f"unknown fault {f!r}; expected one of {FAULTS}")


@dataclass
class _Request:
    method: str
    target: str
    version: str
    head: bytes  # request line + headers as received, Expect removed, ending with CRLFCRLF
    headers: dict[str, str]  # lower-cased names
    body: bytes
    op: str
    key: str


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        proxy = self.server.proxy
        if not proxy._slots.acquire(blocking=False):
            return  # over the connection bound: drop it (the client retries)
        with proxy._lock:
            proxy.connections += 1
        try:
            self.request.settimeout(proxy.socket_timeout)
            reader = self.request.makefile("rb")
            while not proxy._stopping.is_set():
                req = self._read_request(reader)
                if req is None:
                    return
                if not proxy._serve(self.request, req):
                    return
        except (OSError, ValueError):
            return
        finally:
            proxy._slots.release()

    def _read_request(self, reader) -> _Request | None:  # type: ignore[no-untyped-def]
        line = reader.readline(65537)
        if not line:
            return None
        if not line.strip():
            return None
        method, target, version = line.decode("latin-1").rstrip("\r\n").split(" ", 2)
        raw_headers: list[bytes] = []
        headers: dict[str, str] = {}
        while True:
            h = reader.readline(65537)
            if h in (b"\r\n", b"\n", b""):
                break
            name, _, value = h.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
            if name.strip().lower() != "expect":
                raw_headers.append(h)
        if headers.get("expect", "").lower() == "100-continue":
            early = self.server.proxy._answer_before_body(method, target, headers)
            if early is not None:  # the client sends no body after a final answer: close the connection
                self.request.sendall(early)
                return None
            self.request.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        if "chunked" in headers.get("transfer-encoding", "").lower():
            body = bytearray()
            while True:
                size_line = reader.readline(65537)
                body += size_line
                size = int(size_line.split(b";")[0].strip(), 16)
                if size == 0:
                    while True:  # trailers, then the final CRLF
                        t = reader.readline(65537)
                        body += t
                        if t in (b"\r\n", b"\n", b""):
                            break
                    break
                body += _read_exact(reader, size + 2)
            data = bytes(body)
        else:
            data = _read_exact(reader, int(headers.get("content-length", "0") or 0))
        path = urlsplit(target).path.lstrip("/")
        key = path.partition("/")[2]
        head = line + b"".join(raw_headers) + b"\r\n"
        return _Request(method, target, version, head, headers, data, classify(method, target, headers), key)


def _read_exact(reader, n: int) -> bytes:  # type: ignore[no-untyped-def]
    data = reader.read(n) if n else b""
    if len(data) != n:
        raise ValueError("client closed mid-request")
    return data


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    proxy: FaultProxy


class FaultProxy:
    """A reverse proxy to ``upstream`` (``http://host:port``) that injects planned faults.

    Use as a context manager; ``url`` is the address to give the S3 client. ``counts``
    holds requests seen per operation, ``faults`` faults injected per (operation, fault).
    """

    def __init__(
        self,
        upstream: str,
        rules: Iterable[Rule] = (),
        *,
        seed: int = 0,
        max_connections: int = 64,
        socket_timeout: float = 30.0,
        lifetime_s: float = 600.0,
        drop_request_headers: Iterable[str] = (),
        drop_response_headers: Iterable[tuple[str, str]] = (),
    ) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ValueError(f"upstream must be http://host:port, not {upstream!r}")
        self.upstream = (parts.hostname, parts.port)
        self.rules: list[Rule] = list(rules)
        self.seed = seed
        self.socket_timeout = socket_timeout
        self.lifetime_s = lifetime_s
        # Headers removed before forwarding, e.g. ``if-none-match`` to play a server that ignores it
        # (only against upstreams that do not check signatures, such as moto).
        self.drop_request_headers = frozenset(h.lower() for h in drop_request_headers)
        # (method, header) pairs removed from responses, e.g. ("HEAD", "etag") as the JuiceFS gateway answers.
        self.drop_response_headers = frozenset((m.upper(), h.lower()) for m, h in drop_response_headers)
        self.counts: Counter[str] = Counter()
        self.connections = 0  # client connections accepted (keep-alive reuses one for many requests)
        self.faults: Counter[tuple[str, str]] = Counter()
        self.log: list[tuple[str, str, str | None]] = []  # (op, key, fault) of every request
        self.trickle_starts: list[float] = []  # time.monotonic() when each trickled answer's first byte went out
        self._seen: Counter[tuple[str, ...]] = Counter()
        self._per_request: Counter[tuple[str, ...]] = Counter()
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_connections)
        self._stopping = threading.Event()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._timer: threading.Timer | None = None

    # -- lifecycle ----------------------------------------------------------------------------
    @property
    def url(self) -> str:
        assert self._server is not None, "proxy not started"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FaultProxy:
        server = _Server(("127.0.0.1", 0), _Handler)
        server.proxy = self
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.1}, name="fault-proxy", daemon=True
        )
        self._thread.start()
        self._timer = threading.Timer(self.lifetime_s, self.stop)
        self._timer.daemon = True
        self._timer.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._timer is not None:
            self._timer.cancel()
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def set_rules(self, rules: Iterable[Rule]) -> None:
        with self._lock:
            self.rules = list(rules)

    def injected(self, fault: str | None = None, op: str | None = None) -> int:
        with self._lock:
            return sum(
                n for (o, f), n in self.faults.items() if (fault is None or f == fault) and (op is None or o == op)
            )

    def _answer_before_body(self, method: str, target: str, headers: dict[str, str]) -> bytes | None:
        """A final answer to an ``Expect: 100-continue`` request, sent instead of ``100 Continue``
        (the body is never read), or None to read the body and serve it (subclasses decide)."""
        return None

    # -- the plan -----------------------------------------------------------------------------
    def _decide(self, req: _Request) -> tuple[str | None, Rule | None]:
        # A resumed ranged GET keeps its end and moves its start: it is the same request.
        ident = (
            req.method,
            req.key,
            parse_qs(urlsplit(req.target).query).get("partNumber", [""])[0],
            req.headers.get("range", "").rpartition("-")[2],
        )
        with self._lock:
            self.counts[req.op] += 1
            occurrence = self._seen[ident]
            self._seen[ident] += 1
            fault: str | None = None
            chosen: Rule | None = None
            for i, rule in enumerate(self.rules):
                if req.op not in rule.ops:  # type: ignore[operator]
                    continue
                if rule.key_contains is not None and rule.key_contains not in req.key:
                    continue
                if rule.limit is not None and rule.injected >= rule.limit:
                    continue
                if rule.max_per_request is not None and self._per_request[ident] >= rule.max_per_request:
                    continue
                digest = hashlib.sha256(repr((self.seed, i, ident, occurrence)).encode()).digest()
                rng = random.Random(digest)
                if rng.random() >= rule.rate:
                    continue
                fault = rng.choice(rule.faults) if rule.faults else rule.fault
                if fault == "truncate" and req.method != "GET":
                    fault = "reset"  # only GET responses have a body worth cutting
                rule.injected += 1
                self._per_request[ident] += 1
                self.faults[(req.op, fault)] += 1
                chosen = rule
                break
            self.log.append((req.op, req.key, fault))
            return fault, chosen

    # -- serving ------------------------------------------------------------------------------
    def _serve(self, client: socket.socket, req: _Request) -> bool:
        """Answer one request; False when the client connection must be closed."""
        fault, rule = self._decide(req)
        if fault in _ERRORS:
            client.sendall(error_response(fault, req.method, req.key))
            return True
        if fault == "reset":
            _reset(client)
            return False
        if fault == "stall":
            assert rule is not None
            if self._stopping.wait(rule.stall_s):
                return False
        status_line, headers, body = self._forward(req)
        if fault in ("trickle", "trickle_body"):
            assert rule is not None
            head = _response_head(status_line, headers, len(body))
            if fault == "trickle_body":
                client.sendall(head)
                head = b""
            data = head + body
            with self._lock:
                self.trickle_starts.append(time.monotonic())
            for i in range(len(data)):
                client.sendall(data[i : i + 1])
                if self._stopping.wait(rule.trickle_s):
                    return False
            return True
        if fault == "truncate" and len(body) >= 2:
            client.sendall(_response_head(status_line, headers, len(body)) + body[: len(body) // 2])
            with contextlib.suppress(OSError):  # a clean FIN: the client sees the body end early
                client.shutdown(socket.SHUT_RDWR)
            return False
        client.sendall(_response_head(status_line, headers, len(body)) + body)
        return not any(k.lower() == "connection" and v.lower() == "close" for k, v in headers)

    def _strip(self, head: bytes) -> bytes:
        if not self.drop_request_headers:
            return head
        lines = head.split(b"\r\n")
        kept = [
            line
            for line in lines
            if b":" not in line or line.split(b":", 1)[0].strip().lower().decode() not in self.drop_request_headers
        ]
        return b"\r\n".join(kept)

    def _forward(self, req: _Request) -> tuple[str, list[tuple[str, str]], bytes]:
        with socket.create_connection(self.upstream, timeout=self.socket_timeout) as up:
            up.sendall(self._strip(req.head) + req.body)
            resp = HTTPResponse(up, method=req.method)
            try:
                resp.begin()
                body = resp.read()
                version = "HTTP/1.1" if resp.version == 11 else "HTTP/1.0"
                status_line = f"{version} {resp.status} {resp.reason}"
                headers = [
                    (k, v) for k, v in resp.getheaders() if k.lower() not in ("transfer-encoding", "content-length")
                ]
                if req.method == "HEAD":  # keep the upstream's Content-Length: there is no body
                    headers += [(k, v) for k, v in resp.getheaders() if k.lower() == "content-length"]
                headers = [(k, v) for k, v in headers if (req.method, k.lower()) not in self.drop_response_headers]
            finally:
                resp.close()
        return status_line, headers, body


def error_response(fault: str, method: str, key: str, extra_headers: str = "") -> bytes:
    """An S3-shaped error answer (``fault`` as in ``_ERRORS``: XML body, no body for HEAD)."""
    status, reason, code, message = _ERRORS[fault]
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message>"
        f"<Resource>/{key}</Resource><RequestId>fault-proxy</RequestId></Error>"
    ).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\nx-amz-request-id: fault-proxy\r\n{extra_headers}\r\n"
    ).encode()
    return head + (b"" if method == "HEAD" else body)


def _response_head(status_line: str, headers: list[tuple[str, str]], length: int) -> bytes:
    lines = [status_line] + [f"{k}: {v}" for k, v in headers]
    if not any(k.lower() == "content-length" for k, _ in headers):
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _reset(sock: socket.socket) -> None:
    """Close with RST (SO_LINGER 0) rather than FIN."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    except OSError:
        pass


if __name__ == "__main__":  # pragma: no cover - manual smoke run
    import sys

    with FaultProxy(sys.argv[1], [Rule({"GetObjectRange"}, "truncate", rate=0.5)]) as p:
        print(p.url)
        time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 60)
