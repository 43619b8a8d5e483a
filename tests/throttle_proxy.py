"""A loopback S3 proxy that enforces request rates like S3 does, scaled down (stdlib only).

Per (key prefix, class) a token bucket: ``write_rate`` PUT/POST/DELETE and ``read_rate`` GET/HEAD
requests per second, ``burst_s`` seconds of them at once but at least ``min_burst`` (S3's real rates
take hundreds of requests arriving together; scaled down to a request per second, a bucket one token
deep would refuse any two senders that happen to send within a second of each other, which no
independent senders can avoid, so the benchmark sets ``min_burst`` to the number of senders). A request over the rate is answered
``503 SlowDown`` with AWS's XML body, and not forwarded; under ``Expect: 100-continue`` before its
body is read (the client then sends none), as S3 does. The prefix is the key's first
``prefix_depth`` path components (1: ``run1/`` for ``run1/step-1/__0_0.distcp``), so every
checkpoint under one root shares one budget, like one S3 partition.

``grow_after_s``: capacity doubles (up to ``max_growth``×) after that many seconds of continuous
refusals on a prefix (S3 adds capacity under sustained load). ``prefix_write_rates``: write rates of
particular prefixes (a hot one). ``drop_at_s``/``drop_factor``: the
rates fall to ``drop_factor``× that many seconds after the first request (a capacity drop mid-run).
``storm(seconds)``: every write refused for the next ``seconds`` (a 503 storm), whatever the rates.
``stats()`` gives accepted and refused requests per class, ``events`` each admission decision as
``(time.monotonic(), class, accepted, prefix)``; the proxy runs in its own thread and
can serve several client processes (its ``url`` goes to their environment).
"""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from urllib.parse import parse_qs, urlsplit

from fault_proxy import FaultProxy, _Request, error_response

__all__ = ["ThrottleProxy"]


class _Bucket:
    def __init__(self, rate: float, burst_s: float, now: float, min_burst: float = 1.0) -> None:
        self.rate, self.burst_s, self.min_burst = rate, burst_s, min_burst
        self.tokens, self.stamp = max(min_burst, rate * burst_s), now
        self.refusing_since: float | None = None
        self.growth = 1.0

    def take(self, now: float, factor: float) -> bool:
        rate = self.rate * self.growth * factor
        self.tokens = min(max(self.min_burst, rate * self.burst_s), self.tokens + (now - self.stamp) * rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            self.refusing_since = None
            return True
        return False


class ThrottleProxy(FaultProxy):
    def __init__(
        self,
        upstream: str,
        *,
        write_rate: float,
        read_rate: float,
        burst_s: float = 0.2,
        prefix_depth: int = 1,
        grow_after_s: float | None = None,
        max_growth: float = 4.0,
        drop_at_s: float | None = None,
        drop_factor: float = 0.5,
        prefix_write_rates: dict[str, float] | None = None,
        min_burst: float = 1.0,
        **kwargs: object,
    ) -> None:
        kwargs.setdefault("max_connections", 256)
        super().__init__(upstream, **kwargs)  # type: ignore[arg-type]
        self.rates = {"write": write_rate, "read": read_rate}
        self.prefix_write_rates = dict(prefix_write_rates or {})
        self.burst_s, self.prefix_depth, self.min_burst = burst_s, prefix_depth, min_burst
        self.grow_after_s, self.max_growth = grow_after_s, max_growth
        self.drop_at_s, self.drop_factor = drop_at_s, drop_factor
        self._buckets: dict[tuple[str, str], _Bucket] = {}
        self.accepted: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        self.started: float | None = None  # the first request
        self.events: list[tuple[float, str, bool, str]] = []
        self.storm_until = -1.0
        self._rate_lock = threading.Lock()

    def storm(self, seconds: float) -> None:
        """Refuse every write for the next ``seconds``."""
        with self._rate_lock:
            self.storm_until = time.monotonic() + seconds

    def _prefix(self, target: str) -> str:
        parts = urlsplit(target)
        path = parts.path.lstrip("/").partition("/")[2]  # path-style: /bucket/key
        if not path:  # a listing: its prefix parameter
            path = parse_qs(parts.query).get("prefix", [""])[0]
        return "/".join(path.split("/")[: self.prefix_depth])

    def _admit(self, method: str, target: str) -> bool:
        kind = "read" if method in ("GET", "HEAD") else "write"
        now = time.monotonic()
        with self._rate_lock:
            self.started = self.started if self.started is not None else now
            dropped = self.drop_at_s is not None and now - self.started >= self.drop_at_s
            factor = self.drop_factor if dropped else 1.0
            key = (self._prefix(target), kind)
            bucket = self._buckets.get(key)
            if bucket is None:
                rate = self.prefix_write_rates.get(key[0], self.rates[kind]) if kind == "write" else self.rates[kind]
                bucket = self._buckets[key] = _Bucket(rate, self.burst_s, now, self.min_burst)
            ok = bucket.take(now, factor) and not (kind == "write" and now < self.storm_until)
            if not ok:
                bucket.refusing_since = bucket.refusing_since or now
                if self.grow_after_s is not None and now - bucket.refusing_since >= self.grow_after_s:
                    bucket.growth = min(self.max_growth, bucket.growth * 2)
                    bucket.refusing_since = now
            (self.accepted if ok else self.refused)[kind] += 1
            self.events.append((now, kind, ok, key[0]))
            return ok

    def _answer_before_body(self, method: str, target: str, headers: dict[str, str]) -> bytes | None:
        if target.startswith("/__"):
            return None
        if self._admit(method, target):
            return None
        return error_response("503", method, urlsplit(target).path, "Connection: close\r\n")

    def _serve(self, client: socket.socket, req: _Request) -> bool:
        # Requests that announced their body were admitted in _answer_before_body already.
        if req.headers.get("expect", "").lower() != "100-continue" and not self._admit(req.method, req.target):
            client.sendall(error_response("503", req.method, req.key))
            return True
        return super()._serve(client, req)

    def stats(self) -> dict[str, dict[str, int]]:
        with self._rate_lock:
            return {"accepted": dict(self.accepted), "refused": dict(self.refused)}
