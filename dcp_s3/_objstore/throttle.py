"""Request-rate control: pace a process's S3 requests per (bucket, key prefix, read/write class).

S3 limits request rates per partitioned key prefix and answers ``503 SlowDown`` past them; every rank
of a job saves at the same moment, so a large job meets it exactly when it checkpoints. One
:class:`RateController` per endpoint and process, shared by all threads, keeps a token bucket per
:class:`~dcp_s3._objstore.rate_limits.RateKey` whose rate follows the answers (additive increase,
multiplicative decrease: AIMD):

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

Pure Python, no botocore: :mod:`dcp_s3._objstore.rate_hooks` connects it to a client. The clock
and sleep are injectable, so the policy is tested as a function of time.

:mod:`dcp_s3._objstore.rate_limits` says what is paced together and which answers are refusals;
:mod:`dcp_s3._objstore.rate_bucket` holds one key's token bucket and the constants named above.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Protocol

from dcp_s3._objstore.rate_bucket import MIN_RATE, KeyBucket, KeyStats
from dcp_s3._objstore.rate_limits import RateKey
from dcp_s3.errors import S3ThrottledError

__all__ = [
    "RateController",
    "JobProgress",
]

IDLE_FORGET_S = (
    600.0  # a key unused this long is forgotten when the next save or load plans (its parent's learnt rate stays)
)
POLLS_PER_SECOND = (
    2000.0  # a job's ranks ask its JobProgress at most this often in all (and each at most once a second)
)


class JobProgress(Protocol):
    """Of the ``ranks`` ranks sharing this rank's prefixes in the running save or load, how many still send
    requests (the others have finished theirs)."""

    ranks: int

    def active(self) -> int | None:
        """Ranks still sending, or None when it cannot be told (then nothing changes)."""


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
        self._buckets: dict[RateKey, KeyBucket] = {}
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

    def _bucket(self, key: RateKey) -> KeyBucket:
        bucket = self._buckets.get(key)
        if bucket is None:
            # A new key (a new checkpoint's directory) starts from what a key under the same parent prefix
            # learnt from refusals, if that is below its share: the store's partition is usually the parent's.
            learnt = self._learnt.get(key.parent)
            bucket = self._buckets[key] = KeyBucket(
                self._start_rate(key), self._clock(), None if learnt is None else (learnt[0] * self._scale, learnt[1])
            )
        return bucket

    def _learn(self, key: RateKey, bucket: KeyBucket) -> None:
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
