"""The rate controller's policy as a function of time: simulated clients against a simulated store.

Event-driven (no threads, no sleeping): ``clients`` processes, each with its own controller and
``concurrency`` threads sending back to back, against a store that refuses past ``capacity``
requests per second (a token bucket with 0.2 s of burst), as the throttling proxy of
``test_rate_control.py`` does over real HTTP.
"""

from __future__ import annotations

import heapq
import random

import pytest

from dcp_s3.objstore.throttle import RateController, RateKey, is_throttle, rate_key

KEY = RateKey("b", "run/", "write")


def simulate(
    capacity: float, budget: float, *, clients: int, seconds: float = 60.0, latency: float = 0.02,
    concurrency: int = 4, drop_at: float | None = None,
) -> list[tuple[float, bool]]:
    random.seed(0)
    now = [0.0]
    controllers = [RateController(write_rate=budget, clock=lambda: now[0]) for _ in range(clients)]
    for c in controllers:
        c.set_share(clients, 1)
    store = {"tokens": 1.0, "stamp": 0.0}
    events = [(random.uniform(0, 0.01), i, "ask") for i in range(clients) for _ in range(concurrency)]
    heapq.heapify(events)
    answers: list[tuple[float, bool]] = []
    while events:
        t, i, what = heapq.heappop(events)
        if t > seconds:
            break
        now[0] = t
        controller = controllers[i]
        if what == "ask":
            wait = controller.try_acquire(KEY)
            if wait > 0:
                heapq.heappush(events, (t + wait, i, "ask"))
                continue
            cap = capacity * (0.5 if drop_at is not None and t >= drop_at else 1.0)
            store["tokens"] = min(max(1.0, cap * 0.2), store["tokens"] + (t - store["stamp"]) * cap)
            store["stamp"] = t
            ok = store["tokens"] >= 1
            store["tokens"] -= ok
            heapq.heappush(events, (t + latency, i, "ok" if ok else "refused"))
        else:
            controller.release(KEY, refused=what == "refused")
            answers.append((t, what == "ok"))
            heapq.heappush(events, (t, i, "ask"))
    return answers


def steady(answers: list[tuple[float, bool]], start: float, end: float, capacity: float) -> tuple[float, float]:
    """(refused fraction, goodput as a share of capacity) of the answers in [start, end)."""
    sel = [ok for t, ok in answers if start <= t < end]
    return 1 - sum(sel) / len(sel), sum(sel) / (end - start) / capacity


@pytest.mark.parametrize("clients", [1, 4, 16, 64])
def test_many_clients_share_a_prefix_with_few_refusals(clients: int) -> None:
    """Each client starts at its share of the prefix budget; in steady state (after 10 s) the refused
    fraction stays <= 5% and goodput >= 85% of the capacity (without control: every request at once)."""
    refused, goodput = steady(simulate(50, 50, clients=clients), 10, 60, 50)
    assert refused <= 0.05 and goodput >= 0.85, (refused, goodput)


def test_a_budget_far_above_the_capacity_is_learnt() -> None:
    """A single process told S3's 3,500/s against a prefix that takes 50/s: past the first seconds it paces
    at the capacity."""
    refused, goodput = steady(simulate(50, 3500, clients=1), 10, 60, 50)
    assert refused <= 0.05 and goodput >= 0.9, (refused, goodput)


def test_a_capacity_drop_mid_run_is_followed() -> None:
    answers = simulate(50, 50, clients=8, seconds=60, drop_at=30)
    refused, goodput = steady(answers, 35, 60, 25)
    assert refused <= 0.05 and goodput >= 0.8, (refused, goodput)


def test_slow_start_finds_spare_capacity_quickly() -> None:
    """A share far below what the store takes (16 ranks of a 160/s budget: 10/s each, store: 400/s, one client
    sending) grows: within 10 s the client sends at several times its share."""
    now = [0.0]
    controller = RateController(write_rate=160, clock=lambda: now[0])
    controller.set_share(16, 1)
    assert controller.rate(KEY) == pytest.approx(10)
    while now[0] < 10:
        wait = controller.try_acquire(KEY)
        if wait:
            now[0] += wait
            continue
        now[0] += 0.001
        controller.release(KEY, refused=False)
    assert controller.rate(KEY) > 40
    stats = controller.stats()[KEY]
    assert stats.refusals == 0 and stats.attempts > 150 and stats.peak_rate == controller.rate(KEY)


def test_in_flight_attempts_are_capped() -> None:
    now = [0.0]
    controller = RateController(write_rate=2, clock=lambda: now[0])
    granted = 0
    for _ in range(10):
        now[0] += 10  # tokens to spare: only the in-flight cap can refuse
        granted += controller.try_acquire(KEY) == 0
    assert granted == 2
    controller.release(KEY, refused=False)
    assert controller.try_acquire(KEY) == 0


def test_keys_and_throttle_answers() -> None:
    assert rate_key("PutObject", "b", "run/step-1/__0_0.distcp") == RateKey("b", "run/step-1/", "write")
    assert rate_key("GetObject", "b", "top") == RateKey("b", "", "read")
    assert rate_key("ListObjectsV2", "b", "run/") == RateKey("b", "run/", "read")
    assert rate_key("DeleteObjects", "b", None).kind == "write"
    assert is_throttle(503, None) and is_throttle(429, "") and is_throttle(400, "SlowDown")
    assert not is_throttle(500, "InternalError") and not is_throttle(403, "AccessDenied")
