"""The pacing state of one :class:`~dcp_s3._objstore.rate_limits.RateKey`: a token bucket whose rate
follows the store's answers (AIMD), and the constants of that policy.

:class:`KeyBucket` holds what :mod:`dcp_s3._objstore.throttle` describes for one key: the start from the
rank's share (or from what a key under the same parent learnt, :func:`recovered`), the additive probe, the
cut on a refusal by the accepted fraction of the answers, the exponential recovery, the probe of a process
alone. The :class:`~dcp_s3._objstore.throttle.RateController` keeps one per key, guards them with its lock
and owns everything across keys (shares, learnt rates, the job's progress). Pure Python, no clock of its
own: the controller's clock gives every ``now``.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass

__all__ = [
    "KeyBucket",
    "KeyStats",
]

DECREASE = 0.8  # multiplicative decrease on a refusal
INCREASE = 0.01  # additive increase per second while paced, as a fraction of the start rate or the last cut
RECOVER = 0.85  # after a decrease the rate grows back exponentially to this fraction of the rate cut, then additively
MIN_RATE = 0.05  # requests per second: the lowest rate a decrease reaches (lower if the key started lower)
RECOVERY_GAIN = 0.2  # below the level to regain, the rate grows by this fraction of itself per second while paced
MIN_ANSWERS = 4  # answers since the last decrease before their accepted fraction may set the next one
PROBE_INCREASE = 0.002  # a process alone, below its budget: its probe per second starts at this fraction of it...
PROBE_DOUBLING_S = 2.0  # ...and doubles this often while nothing is refused
LEARNT_DOUBLING_S = 5.0  # a learnt rate below the share doubles this often since its key's last refusal
START_FRACTION = 0.125  # a key never starts (a save or load never plans) below this fraction of its share


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


class KeyBucket:
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
