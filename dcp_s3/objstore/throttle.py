"""Request-rate control: pace a process's S3 requests per (bucket, key prefix, read/write class).

S3 limits request rates per partitioned key prefix and answers ``503 SlowDown`` past them; every rank
of a job saves at the same moment, so a large job meets it exactly when it checkpoints. One
:class:`RateController` per endpoint and process, shared by all threads, keeps a token bucket per
:data:`RateKey` whose rate follows the answers (additive increase, multiplicative decrease: AIMD):

- it starts at the rank's share of a per-prefix budget (:meth:`RateController.set_share`: the
  writer and reader give it the world size and the prefix layout at plan time), with a random
  phase (the first request waits up to one interval, ``1 / rate``), so a job's ranks do not all
  burst at once; a key under the same parent prefix as one that met refusals (the next checkpoint
  of a run) starts from the rate that one learnt, if lower, but that rate regains the share with the
  time since its last refusal (doubling every ``LEARNT_DOUBLING_S``), a new key never starts below
  ``START_FRACTION`` of the share, and it regains the share exponentially while it is not refused: one
  storm of refusals does not slow every later checkpoint of the process;
- every attempt, retries included, takes a token first, and at most ``max(2, rate)`` attempts of a
  key are in flight; a wait for a token can be given a deadline (:meth:`RateController.acquire`'s
  ``timeout``), past which it raises ``S3ThrottledError`` having taken nothing;
- above its start rate a key probes additively: while requests wait for tokens and none is refused,
  the rate grows by ``INCREASE`` × the rate it started from (or was last cut to) per second. With a
  known budget every rank's share is exact, and ranks that all grew exponentially would overshoot it
  together;
- a refusal cuts the rate to ``DECREASE`` × the rate sent × the fraction of the answers since the
  last cut that were accepted (at least ``MIN_ANSWERS`` of them, else the fraction counts as 1; at
  most a quarter at once): a budget far above the capacity, most of it refused, is left in a step or
  two, while a rank that meets one refusal among many answers loses only ``1 - DECREASE``. Refusals of
  attempts in flight at a cut (sent at the rate cut) do not cut again; any other does, however soon, so
  the key sending most is cut most often. After a cut the rate regains ``RECOVER`` × the level it was cut
  from exponentially (``RECOVERY_GAIN`` of itself per second, per second of answers, never per answer: no
  jump at a low rate), then probes additively again;
- a process *alone* (one rank per prefix, no rank of its job to follow: one of several independent jobs
  sharing a prefix, each told the whole budget) is told by nothing but refusals that the others finished:
  below its budget its probe is ``PROBE_INCREASE`` × the budget per second (the same step for every such
  process: their rates converge), doubling every ``PROBE_DOUBLING_S`` since its last refusal, and never
  less than the additive probe;
- no cut goes below ``MIN_RATE``, or below the start rate where that is lower: a rank's share of
  0.17 requests/s is honoured, not rounded up (``ranks × MIN_RATE`` can exceed a small capacity);
- while a save or load runs, the controller can follow the job's progress (:meth:`RateController.follow`:
  a :class:`JobProgress` counting which of the ranks sharing this rank's prefixes still send, kept by the
  storage layer in the job's c10d store): with ``active`` of its ``ranks`` still sending, every key's rate
  is scaled by ``ranks / active``, so the ranks still sending take up the capacity the finished ones leave,
  instead of finishing at their share while it lies idle. Polled at most every ``max(1 s, ranks / 2000 s)``,
  only by a rank that waits for a token; never per request.

Pure Python, no botocore: :mod:`dcp_s3.objstore.rate_hooks` connects it to a client. The clock
and sleep are injectable, so the policy is tested as a function of time.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from dcp_s3.errors import S3ThrottledError

__all__ = [
    "RateKey",
    "RateController",
    "KeyStats",
    "JobProgress",
    "is_throttle",
    "rate_key",
    "THROTTLE_CODES",
    "THROTTLE_STATUSES",
]

#: Error codes that mean "too many requests" (S3's SlowDown and the codes botocore treats as throttling).
THROTTLE_CODES = frozenset(
    {
        "SlowDown",
        "SlowDownRead",
        "SlowDownWrite",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottledException",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "RequestThrottled",
        "LimitExceededException",
        "ProvisionedThroughputExceededException",
    }
)
#: HTTP statuses that mean the same whatever the code (a 503 without a body, a proxy's 429).
THROTTLE_STATUSES = frozenset({429, 503})
#: Operations of the read class (S3's GET/HEAD limit); every other one is a write (PUT/POST/DELETE).
READ_OPERATIONS = frozenset(
    {
        "GetObject",
        "HeadObject",
        "HeadBucket",
        "ListObjects",
        "ListObjectsV2",
        "ListParts",
        "ListMultipartUploads",
    }
)

DECREASE = 0.8  # multiplicative decrease on a refusal
INCREASE = 0.01  # additive increase per second while paced, as a fraction of the start rate or the last cut
RECOVER = 0.85  # after a decrease the rate grows back exponentially to this fraction of the rate cut, then additively
MIN_RATE = 0.05  # requests per second: the lowest rate a decrease reaches (lower if the key started lower)
RECOVERY_GAIN = 0.2  # below the level to regain, the rate grows by this fraction of itself per second while paced
MIN_ANSWERS = 4  # answers since the last decrease before their accepted fraction may set the next one
PROBE_INCREASE = 0.002  # a process alone, below its budget: its probe per second starts at this fraction of it...
PROBE_DOUBLING_S = 2.0  # ...and doubles this often while nothing is refused
IDLE_FORGET_S = (
    600.0  # a key unused this long is forgotten when the next save or load plans (its parent's learnt rate stays)
)
LEARNT_DOUBLING_S = 5.0  # a learnt rate below the share doubles this often since its key's last refusal
START_FRACTION = 0.125  # a key never starts (a save or load never plans) below this fraction of its share
POLLS_PER_SECOND = (
    2000.0  # a job's ranks ask its JobProgress at most this often in all (and each at most once a second)
)


class JobProgress(Protocol):
    """Of the ``ranks`` ranks sharing this rank's prefixes in the running save or load, how many still send
    requests (the others have finished theirs)."""

    ranks: int

    def active(self) -> int | None:
        """Ranks still sending, or None when it cannot be told (then nothing changes)."""


@dataclass(frozen=True, slots=True)
class RateKey:
    """What S3 rate-limits together: a bucket, a key prefix (the key's directory) and a request class."""

    bucket: str
    prefix: str
    kind: str  # "read" or "write"

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix} ({self.kind})"

    @property
    def parent(self) -> tuple[str, str, str]:
        """Bucket, parent prefix and class: what the keys of successive checkpoints under one root share."""
        return self.bucket, self.prefix.rstrip("/").rpartition("/")[0], self.kind


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


def recovered(learnt: float, share: float, since_refusal: float) -> float:
    """Where a key starts that learnt ``learnt`` requests/s from refusals ``since_refusal`` seconds ago, with a
    share of ``share``: ``learnt`` doubled every ``LEARNT_DOUBLING_S`` since, at least ``START_FRACTION`` of the
    share, at most the share."""
    grown = learnt * 2.0 ** min(64.0, max(0.0, since_refusal) / LEARNT_DOUBLING_S)
    return min(share, max(START_FRACTION * share, grown))


class _Bucket:
    """Token bucket and AIMD state of one key (guarded by the controller's condition)."""

    def __init__(self, rate: float, now: float, learnt: tuple[float, float] | None = None) -> None:
        self.start_rate = rate
        self.floor = min(MIN_RATE, rate)  # never above the rank's share: a share of 0.17/s is honoured
        # ``learnt``: the rate a key under the same parent learnt from refusals, and when it was last refused
        self.rate = rate if learnt is None else max(self.floor, recovered(learnt[0], rate, now - learnt[1]))
        self.unrefused = self.rate >= rate
        # Starting below the share from what an earlier key learnt: regained exponentially while not refused
        # (the refusals that taught it may have been a storm long over), probed additively above.
        self.ceiling = rate
        self.refused_at = -math.inf if learnt is None else learnt[1]  # the last refusal this rate comes from
        self.tokens = random.random()  # a random phase: ranks starting together do not send together
        self.stamp = self.grown_at = now
        self.in_flight = 0
        self.stale = 0  # answers still to come of attempts sent before the last cut: they do not cut again
        self.born = now
        self.last_decrease = -math.inf
        self.paced_at = -math.inf  # when a request last had to wait for a token
        self.answers: deque[bool] = deque(maxlen=4 * MIN_ANSWERS)  # since the last decrease: accepted or not
        self.stats = KeyStats(rate=self.rate, peak_rate=self.rate)

    def refill(self, now: float) -> None:
        burst = max(1.0, self.rate / 10)  # at most 100 ms of requests at once
        self.tokens = min(burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now

    def succeeded(self, now: float, alone: bool) -> None:
        if self.stale:
            self.stale -= 1
        else:
            self.answers.append(True)
        if now - self.paced_at < max(1.0, 2.0 / self.rate):  # only a rate that limits grows: no climb while idle
            dt = min(1.0, now - self.grown_at)  # growth per second, not per answer: no jump at a low rate
            if self.rate < self.ceiling:  # back to the last rate that was not refused: exponential
                self.rate = min(self.ceiling, self.rate * (1.0 + RECOVERY_GAIN * dt))
            elif alone and self.rate < self.start_rate:  # nothing tells it the others finished: ever faster
                quiet = now - max(self.refused_at, self.born)
                probe = PROBE_INCREASE * self.start_rate * 2.0 ** min(30.0, quiet / PROBE_DOUBLING_S)
                self.rate = min(self.start_rate, self.rate + max(INCREASE * self.ceiling, probe) * dt)
            else:  # above it (above the share, before any refusal): probing, additive
                self.rate += INCREASE * self.ceiling * dt
            self._note_rate()
        self.grown_at = now

    def refused(self, now: float, decrease_interval: float) -> None:
        self.stats.refusals += 1
        self.unrefused = False
        self.grown_at = self.refused_at = now
        if self.stale:  # sent at the rate already cut
            self.stale -= 1
            return
        self.answers.append(False)
        if now - self.last_decrease < decrease_interval:
            return
        self.last_decrease = now
        # Cut to DECREASE x the rate, or lower to what the store accepted of the attempts since the last cut
        # (a budget far above the capacity, most of it refused, is left in a step or two; never below a
        # quarter at once, and only from enough answers: a slow rank's few answers say little).
        accepted = sum(self.answers) / len(self.answers) if len(self.answers) >= MIN_ANSWERS else 1.0
        level = self.rate * max(0.25, min(1.0, accepted))  # what the store took
        self.rate = max(self.floor, DECREASE * level)
        self.ceiling = max(self.rate, RECOVER * level)  # regained quickly, then probed for additively
        self.answers.clear()
        self.stale = self.in_flight  # (this answer's attempt no longer counts as in flight)
        self.tokens = min(self.tokens, 0.0)
        self._note_rate()

    def scale(self, factor: float) -> None:
        """The ranks sending changed: the same capacity shared by ``1 / factor`` as many."""
        self.start_rate *= factor
        self.rate = max(self.floor, self.rate * factor)
        self.ceiling = max(self.rate, self.ceiling * factor)
        self._note_rate()

    def restart(self, now: float) -> None:
        """A new save or load plans: a rate cut below the start rate by refusals regains it with the time since
        the last refusal (doubling every ``LEARNT_DOUBLING_S``), never below ``START_FRACTION`` of it, and
        regains the rest exponentially while not refused."""
        if self.unrefused:
            self.rate = self.ceiling = self.start_rate
        else:
            self.rate = max(self.floor, recovered(self.rate, self.start_rate, now - self.refused_at))
            self.ceiling = max(self.ceiling, self.start_rate)
            self.unrefused = self.rate >= self.start_rate
        self._note_rate()

    def _note_rate(self) -> None:
        self.stats.rate = self.rate
        self.stats.peak_rate = max(self.stats.peak_rate, self.rate)


class RateController:
    """Paces requests of one process to one endpoint: :meth:`acquire` before each attempt,
    :meth:`release` with its outcome after it.

    ``write_rate``/``read_rate``: the per-prefix budget of the whole job (S3's published figures
    by default); a rank starts at its :meth:`set_share` of it. ``decrease_interval``: at least this long
    between two cuts of a key (none by default: refusals of attempts sent before a cut never cut again).
    """

    def __init__(
        self,
        *,
        write_rate: float = 3500.0,
        read_rate: float = 5500.0,
        decrease_interval: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] | None = None,
    ) -> None:
        self.budget = {"write": float(write_rate), "read": float(read_rate)}
        self.share = 1.0
        self.decrease_interval = decrease_interval
        self._clock = clock
        self._cond = threading.Condition()
        self._sleep = sleep
        self._buckets: dict[RateKey, _Bucket] = {}
        # Per parent prefix: the rate learnt from refusals (/ scale) and when the key that learnt it was last refused.
        self._learnt: dict[tuple[str, str, str], tuple[float, float]] = {}
        self._scale = 1.0  # ranks / active of the progress followed: every key's rate is scaled by it
        self._progress: JobProgress | None = None
        self._polled_at = -math.inf

    def set_share(self, ranks: int, prefixes: int = 1) -> None:
        """Start keys at ``prefixes / ranks`` of the budget (``ranks`` ranks spread over ``prefixes``
        key prefixes share each prefix's budget). Keys that met no refusal yet restart from it; those that
        met refusals keep the rate they learnt; keys unused for ``IDLE_FORGET_S`` are forgotten."""
        share = min(1.0, max(1, prefixes) / max(1, ranks))
        with self._cond:
            self._rescale(1.0)  # back to the whole job's scale before the new share
            self.share = share
            now = self._clock()  # every checkpoint has keys of its own: forget those of long-finished ones
            for key in [k for k, b in self._buckets.items() if not b.in_flight and now - b.stamp > IDLE_FORGET_S]:
                del self._buckets[key]
            for key, bucket in self._buckets.items():
                bucket.start_rate = self._start_rate(key)
                bucket.floor = min(MIN_RATE, bucket.start_rate)
                bucket.restart(now)

    def follow(self, progress: JobProgress) -> None:
        """Scale the rates by the ranks still sending in ``progress`` (a save or load starts) until
        :meth:`unfollow`."""
        with self._cond:
            self._rescale(1.0)
            self._progress = progress
            self._polled_at = self._clock()  # every rank is sending at the start

    def unfollow(self, progress: JobProgress) -> None:
        """The save or load ``progress`` counts is over: back to the whole job's rates (unless another one
        started following since)."""
        with self._cond:
            if self._progress is progress:
                self._progress = None
                self._rescale(1.0)

    def _rescale(self, scale: float) -> None:
        """Scale every key's rate to ``scale`` x its whole-job level (caller holds the lock)."""
        if scale == self._scale:
            return
        factor, self._scale = scale / self._scale, scale
        for bucket in self._buckets.values():
            bucket.scale(factor)

    def _poll_due(self) -> bool:
        return self._progress is not None and self._clock() - self._polled_at >= max(
            1.0, self._progress.ranks / POLLS_PER_SECOND
        )

    def _poll(self) -> None:
        """Ask the job's progress how many ranks still send, at most every ``max(1 s, ranks / POLLS_PER_SECOND)``
        (called without the lock: the answer may take a network round trip)."""
        with self._cond:
            progress = self._progress
            if progress is None or not self._poll_due():
                return
            self._polled_at = self._clock()  # this thread asks; the others go on waiting for tokens
        active = progress.active()
        if active is not None:
            with self._cond:
                if self._progress is progress:
                    self._rescale(progress.ranks / min(progress.ranks, max(1, active)))
                    self._cond.notify_all()

    def _alone(self) -> bool:
        """One rank per prefix and no other rank of the job to follow: nothing but the store's answers can tell
        this process that others sharing its prefixes (other jobs) have finished."""
        return self.share >= 1.0 and (self._progress is None or self._progress.ranks <= 1)

    def _start_rate(self, key: RateKey) -> float:
        return max(1e-3, self.budget[key.kind] * self.share * self._scale)

    def _bucket(self, key: RateKey) -> _Bucket:
        bucket = self._buckets.get(key)
        if bucket is None:
            # A new key (a new checkpoint's directory) starts from what a key under the same parent prefix
            # learnt from refusals, if that is below its share: the store's partition is usually the parent's.
            learnt = self._learnt.get(key.parent)
            bucket = self._buckets[key] = _Bucket(
                self._start_rate(key), self._clock(), None if learnt is None else (learnt[0] * self._scale, learnt[1])
            )
        return bucket

    def _learn(self, key: RateKey, bucket: _Bucket) -> None:
        if not bucket.unrefused:  # kept at the whole job's scale: the next checkpoint starts with every rank
            self._learnt[key.parent] = (bucket.rate / self._scale, bucket.refused_at)

    def acquire(self, key: RateKey, timeout: float | None = None) -> float:
        """Wait for a token and an in-flight slot of ``key``; the seconds waited. Past ``timeout`` seconds
        without one, ``S3ThrottledError`` (nothing taken)."""
        start = self._clock()
        with self._cond:
            while (wait := self._try_acquire(key)) > 0:
                if timeout is not None:
                    left = start + timeout - self._clock()
                    if left <= 0:
                        self._buckets[key].stats.wait_s += self._clock() - start
                        raise S3ThrottledError(f"no request token of {key} within {timeout:.3g} s")
                    wait = min(wait, left)
                if self._poll_due():  # a rank that waits asks whether others have finished
                    self._cond.release()
                    try:
                        self._poll()
                    finally:
                        self._cond.acquire()
                    continue
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
        """Take a token and an in-flight slot of ``key`` now (0.0), or the seconds to wait before asking again
        (a wait is when the job's progress is polled, as in :meth:`acquire`)."""
        with self._cond:
            wait = self._try_acquire(key)
            if wait <= 0 or not self._poll_due():
                return wait
        self._poll()
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
                bucket.succeeded(now, self._alone())
            self._learn(key, bucket)
            self._cond.notify_all()

    def rate(self, key: RateKey) -> float:
        with self._cond:
            return self._bucket(key).rate

    def stats(self) -> dict[RateKey, KeyStats]:
        """Per key, what this process sent and met (copies)."""
        with self._cond:
            return {k: KeyStats(**vars(b.stats)) for k, b in self._buckets.items()}
