"""Request-rate control: pace a process's S3 requests per (bucket, key prefix, read/write class).

S3 limits request rates per partitioned key prefix and answers ``503 SlowDown`` past them; every rank
of a job saves at the same moment, so a large job meets it exactly when it checkpoints. One
:class:`RateController` per endpoint and process, shared by all threads, keeps a token bucket per
:data:`RateKey` whose rate follows the answers (additive increase, multiplicative decrease: AIMD):

- it starts at the rank's share of a per-prefix budget (:meth:`RateController.set_share`: the
  writer and reader give it the world size and the prefix layout at plan time), with a random
  phase, so a job's ranks do not all burst at once;
- every attempt, retries included, takes a token first, and at most ``max(2, rate)`` attempts of a
  key are in flight;
- until its first refusal a key is in slow start: each answer while requests wait for tokens adds
  ``SLOW_START_GAIN`` requests/s (the rate grows by half of itself per second), so a conservative
  share costs little where the store has capacity to spare;
- a refusal cuts the rate to ``DECREASE`` × the rate the key was achieving (at most once per
  ``decrease_interval``, so one burst of refusals counts once); from then on, while requests are
  paced and none is refused, the rate grows by ``INCREASE`` × the rate at the last refusal per second.

Pure Python, no botocore: :mod:`dcp_s3.objstore.rate_hooks` connects it to a client. The clock
and sleep are injectable, so the policy is tested as a function of time.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "RateKey", "RateController", "KeyStats", "is_throttle", "rate_key", "THROTTLE_CODES", "THROTTLE_STATUSES",
]

#: Error codes that mean "too many requests" (S3's SlowDown and the codes botocore treats as throttling).
THROTTLE_CODES = frozenset({
    "SlowDown", "SlowDownRead", "SlowDownWrite", "Throttling", "ThrottlingException", "ThrottledException",
    "RequestThrottledException", "TooManyRequestsException", "RequestLimitExceeded", "BandwidthLimitExceeded",
    "RequestThrottled", "LimitExceededException", "ProvisionedThroughputExceededException",
})
#: HTTP statuses that mean the same whatever the code (a 503 without a body, a proxy's 429).
THROTTLE_STATUSES = frozenset({429, 503})
#: Operations of the read class (S3's GET/HEAD limit); every other one is a write (PUT/POST/DELETE).
READ_OPERATIONS = frozenset({
    "GetObject", "HeadObject", "HeadBucket", "ListObjects", "ListObjectsV2", "ListParts", "ListMultipartUploads",
})

DECREASE = 0.8  # multiplicative decrease on a refusal (a sawtooth between 0.8 and 1 of the capacity: ~90% goodput)
INCREASE = 0.02  # additive increase per second while paced, as a fraction of the rate at the last refusal
MIN_RATE = 0.5  # requests per second below which no key is paced
SLOW_START_GAIN = 0.5  # requests/s added per answer before the first refusal


@dataclass(frozen=True, slots=True)
class RateKey:
    """What S3 rate-limits together: a bucket, a key prefix (the key's directory) and a request class."""

    bucket: str
    prefix: str
    kind: str  # "read" or "write"

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix} ({self.kind})"


def rate_key(operation: str, bucket: str, key: str | None) -> RateKey:
    """The :class:`RateKey` of ``operation`` on ``key`` (a listing's prefix, or None for the bucket)."""
    prefix = key.rpartition("/")[0] + "/" if key and "/" in key else ""
    return RateKey(bucket, prefix, "read" if operation in READ_OPERATIONS else "write")


def is_throttle(status: int | None, code: str | None) -> bool:
    """Whether an answer tells the client to slow down (decided by code and status, never by message)."""
    return (code or "") in THROTTLE_CODES or status in THROTTLE_STATUSES


@dataclass
class KeyStats:
    """What one key saw in this process: attempts sent, refusals, seconds spent waiting for a token, the
    current paced rate and the highest rate reached (requests per second)."""

    attempts: int = 0
    refusals: int = 0
    wait_s: float = 0.0
    rate: float = 0.0
    peak_rate: float = 0.0


class _Bucket:
    """Token bucket and AIMD state of one key (guarded by the controller's condition)."""

    def __init__(self, rate: float, now: float) -> None:
        self.start_rate = self.rate = rate
        self.tokens = random.random()  # a random phase: ranks starting together do not send together
        self.stamp = now
        self.in_flight = 0
        self.last_decrease = -math.inf
        self.paced_at = -math.inf  # when a request last had to wait for a token
        self.window_start, self.window_ok, self.achieved = now, 0, rate
        self.slow_start = True
        self.ceiling = rate
        self.stats = KeyStats(rate=rate, peak_rate=rate)

    def refill(self, now: float) -> None:
        burst = max(1.0, self.rate / 10)  # at most 100 ms of requests at once
        self.tokens = min(burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now

    def succeeded(self, now: float) -> None:
        self.window_ok += 1
        if now - self.window_start >= 1.0:
            self.achieved = self.window_ok / (now - self.window_start)
            self.window_start, self.window_ok = now, 0
        if now - self.paced_at < 1.0:  # only a rate that limits grows: no unbounded climb while idle
            if self.slow_start:
                self.rate += SLOW_START_GAIN
            else:
                self.rate += INCREASE * self.ceiling / max(self.rate, MIN_RATE)
            self._note_rate()

    def refused(self, now: float, decrease_interval: float) -> None:
        self.stats.refusals += 1
        self.slow_start = False
        if now - self.last_decrease < max(decrease_interval, 1.0 / self.rate):
            return
        self.last_decrease = now
        window = now - self.window_start
        achieved = self.window_ok / window if window >= 0.25 else self.achieved
        self.ceiling = max(MIN_RATE, min(self.rate, max(achieved, MIN_RATE)))  # what the store gave: its capacity
        self.rate = max(MIN_RATE, DECREASE * self.ceiling)
        self.tokens = min(self.tokens, 0.0)
        self._note_rate()

    def _note_rate(self) -> None:
        self.stats.rate = self.rate
        self.stats.peak_rate = max(self.stats.peak_rate, self.rate)


class RateController:
    """Paces requests of one process to one endpoint: :meth:`acquire` before each attempt,
    :meth:`release` with its outcome after it.

    ``write_rate``/``read_rate``: the per-prefix budget of the whole job (S3's published figures
    by default); a rank starts at its :meth:`set_share` of it.
    """

    def __init__(
        self, *, write_rate: float = 3500.0, read_rate: float = 5500.0, decrease_interval: float = 0.25,
        clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] | None = None,
    ) -> None:
        self.budget = {"write": float(write_rate), "read": float(read_rate)}
        self.share = 1.0
        self.decrease_interval = decrease_interval
        self._clock = clock
        self._cond = threading.Condition()
        self._sleep = sleep
        self._buckets: dict[RateKey, _Bucket] = {}

    def set_share(self, ranks: int, prefixes: int = 1) -> None:
        """Start keys at ``prefixes / ranks`` of the budget (``ranks`` ranks spread over ``prefixes``
        key prefixes share each prefix's budget). Keys still in slow start restart from it; those that
        met refusals keep the rate they learnt."""
        share = min(1.0, max(1, prefixes) / max(1, ranks))
        with self._cond:
            self.share = share
            for key, bucket in self._buckets.items():
                bucket.start_rate = self._start_rate(key)
                if bucket.slow_start:
                    bucket.rate = bucket.start_rate
                    bucket._note_rate()

    def _start_rate(self, key: RateKey) -> float:
        return max(MIN_RATE, self.budget[key.kind] * self.share)

    def _bucket(self, key: RateKey) -> _Bucket:
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(self._start_rate(key), self._clock())
        return bucket

    def acquire(self, key: RateKey) -> float:
        """Wait for a token and an in-flight slot of ``key``; the seconds waited."""
        start = self._clock()
        with self._cond:
            while (wait := self._try_acquire(key)) > 0:
                if self._sleep is not None:  # a test's clock: sleep outside the lock
                    self._cond.release()
                    try:
                        self._sleep(wait)
                    finally:
                        self._cond.acquire()
                else:
                    self._cond.wait(wait)
            waited = self._clock() - start
            self._buckets[key].stats.wait_s += waited
            return waited

    def try_acquire(self, key: RateKey) -> float:
        """Take a token and an in-flight slot of ``key`` now (0.0), or the seconds to wait before asking again."""
        with self._cond:
            return self._try_acquire(key)

    def _try_acquire(self, key: RateKey) -> float:
        bucket = self._bucket(key)
        now = self._clock()
        bucket.refill(now)
        if bucket.tokens >= 1.0 - 1e-9 and bucket.in_flight < max(2, math.ceil(bucket.rate)):
            bucket.tokens -= 1.0
            bucket.in_flight += 1
            bucket.stats.attempts += 1
            return 0.0
        bucket.paced_at = now
        return max(1e-4, (1.0 - bucket.tokens) / bucket.rate) if bucket.tokens < 1.0 else 0.05

    def release(self, key: RateKey, *, refused: bool) -> None:
        """The attempt of ``key`` is answered: ``refused`` (throttled) or not."""
        with self._cond:
            bucket = self._bucket(key)
            bucket.in_flight = max(0, bucket.in_flight - 1)
            now = self._clock()
            if refused:
                bucket.refused(now, self.decrease_interval)
            else:
                bucket.succeeded(now)
            self._cond.notify_all()

    def rate(self, key: RateKey) -> float:
        with self._cond:
            return self._bucket(key).rate

    def stats(self) -> dict[RateKey, KeyStats]:
        """Per key, what this process sent and met (copies)."""
        with self._cond:
            return {k: KeyStats(**vars(b.stats)) for k, b in self._buckets.items()}
