"""The rate controller against a simulated throttling store: jobs sharing one prefix, event-driven (no threads, no
sleeping, no server), so that a policy can be judged over many seeds in seconds.

    python -m benchmarks.throttle_sim --baseline 2948174   # before (the controller at that commit) / after, 20 seeds
    python -m benchmarks.throttle_sim --seeds 50            # the working tree alone

A *job* is ``ranks`` processes, each with its own :class:`RateController` told its share of the per-prefix
budget (``ranks`` ranks of one prefix) and, for a job of several ranks, following the job's count of ranks still
sending (as the storage layer does through the job's c10d store). *Independent jobs* are several one-rank jobs
(separate ``no_dist`` saves, no process group, no shared store): each is told the whole budget and can learn of
the others only from the store's answers. Every rank sends its requests over 8 threads against one store that
refuses past ``capacity`` requests/s (a token bucket as deep as the ranks sending, as ``tests/throttle_proxy.py``
in the real-server benchmark); answers take ``latency`` plus an exponential ``noise``; ranks start over ``skew``
seconds. A refused request is sent again. Figures: makespan over the ideal ``(requests - bucket depth) /
capacity``, refused fraction in all and in the second half of the makespan (steady state: ``steady``), the
benchmark's definitions.

``--baseline REF`` loads the controller (``dcp_s3/_objstore/throttle.py`` and its modules) as it was at git ``REF``
beside the current one, so
that one run gives before and after on the same seeds. ``tests/objstore/test_throttle.py`` holds the same cases
to their targets.
"""

from __future__ import annotations

import argparse
import heapq
import importlib.util
import random
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from benchmarks import common
from dcp_s3._objstore import throttle
from dcp_s3._objstore.rate_limits import RateKey

KEY = RateKey("b", "run/", "write")


@dataclass(frozen=True)
class Outcome:
    """One simulated run: makespan and its ideal (s), refused fraction in all and in the second half."""

    makespan: float
    ideal: float
    refused: float
    steady: float

    @property
    def over_ideal(self) -> float:
        return self.makespan / self.ideal


class Finished:
    """A job's count of ranks still sending (what the storage layer keeps in the job's c10d store)."""

    def __init__(self, ranks: int) -> None:
        self.ranks, self.done = ranks, 0

    def active(self) -> int:
        return self.ranks - self.done


def run(
    capacity: float,
    budget: float,
    *,
    jobs: Sequence[int],
    requests: int | Sequence[int],
    latency: float = 0.05,
    noise: float = 0.1,
    skew: float = 1.0,
    seed: int = 0,
    drop_at: float | None = None,
    threads: int = 8,
    follow: bool = True,
    module: ModuleType = throttle,
) -> Outcome:
    """``jobs[j]`` ranks in job ``j`` (``[8]``: one job of 8 ranks; ``[1] * 8``: 8 independent jobs), each rank
    sending ``requests`` (or ``requests[i]``, ranks numbered across jobs) over ``threads`` threads; the store takes
    ``capacity``/s (halved from ``drop_at``); each job is told ``budget`` for the prefix and each rank its share.
    ``follow``: the ranks of a job of several follow its count of ranks still sending. ``module``: the throttle
    module whose ``RateController`` paces (a baseline's)."""
    rng = random.Random(seed)
    random.seed(seed)  # the controllers' random phases
    now = [0.0]
    ranks = sum(jobs)
    counts = list(requests) if not isinstance(requests, int) else [requests] * ranks
    controllers, counters, job_of = [], [], []
    for size in jobs:
        finished = Finished(size)
        counters.append(finished)
        for _ in range(size):
            controller = module.RateController(write_rate=budget, clock=lambda: now[0])
            controller.set_share(size, 1)
            if follow and size > 1:  # one process alone has no job to follow
                controller.follow(finished)
            controllers.append(controller)
            job_of.append(finished)
    starts = [rng.uniform(0, skew) for _ in range(ranks)]
    left, in_flight, done = list(counts), [0] * ranks, [0.0] * ranks
    store = {"tokens": float(ranks), "stamp": 0.0}
    events = [(starts[i] + rng.uniform(0, 0.01), i, "ask") for i in range(ranks) for _ in range(threads)]
    heapq.heapify(events)
    answers: list[tuple[float, bool]] = []
    while events:
        t, i, what = heapq.heappop(events)
        now[0] = t
        if what == "ask":
            if left[i] <= 0:
                continue
            wait = controllers[i].try_acquire(KEY)
            if wait > 0:
                heapq.heappush(events, (t + wait, i, "ask"))
                continue
            left[i] -= 1
            in_flight[i] += 1
            rate = capacity * (0.5 if drop_at is not None and t >= drop_at else 1.0)
            store["tokens"] = min(float(ranks), store["tokens"] + (t - store["stamp"]) * rate)
            store["stamp"] = t
            ok = store["tokens"] >= 1
            store["tokens"] -= ok
            heapq.heappush(events, (t + latency + rng.expovariate(1 / noise), i, "ok" if ok else "refused"))
            continue
        controllers[i].release(KEY, refused=what == "refused")
        in_flight[i] -= 1
        answers.append((t, what == "ok"))
        left[i] += what == "refused"
        done[i] = t
        job_of[i].done += left[i] == 0 and in_flight[i] == 0
        heapq.heappush(events, (t, i, "ask"))
    paced = sum(counts) - ranks
    ideal = paced / capacity
    if drop_at is not None and ideal > drop_at:
        ideal = drop_at + (paced - drop_at * capacity) / (capacity / 2)
    t0, t1 = min(starts), max(done)
    second = [ok for t, ok in answers if t >= (t0 + t1) / 2]
    return Outcome(
        makespan=t1 - t0,
        ideal=ideal,
        refused=1 - sum(ok for _, ok in answers) / len(answers),
        steady=1 - sum(second) / max(1, len(second)),
    )


#: The cases the benchmark reports: (name, jobs, requests per rank, overload, budget / capacity, capacity halved at
#: this many seconds or None). Overload = every request offered in 1 s over the capacity, as in ``benchmarks.throttle``.
CASES: list[tuple[str, list[int], int, float, float, float | None]] = [
    ("8 independent jobs, 20x", [1] * 8, 17, 20, 1, None),
    ("8 independent jobs, 5x", [1] * 8, 17, 5, 1, None),
    ("8 independent jobs, 50x", [1] * 8, 17, 50, 1, None),
    ("8 independent jobs x 64 requests, 20x", [1] * 8, 64, 20, 1, None),
    # The sizes of issue 53's calibrated run on the proxy (benchmarks.throttle --calibrate 0.5: 11-13 writes/s there).
    ("8 independent jobs x 33 requests, 20x", [1] * 8, 33, 20, 1, None),
    ("8 independent jobs x 8 requests, 5x", [1] * 8, 8, 5, 1, None),
    ("4 independent jobs, 20x", [1] * 4, 17, 20, 1, None),
    ("16 independent jobs, 20x", [1] * 16, 17, 20, 1, None),
    ("2 jobs of 4 ranks, 20x", [4, 4], 17, 20, 1, None),
    ("one job of 8 ranks, 5x", [8], 17, 5, 1, None),
    ("one job of 8 ranks, 20x", [8], 17, 20, 1, None),
    ("one job of 8 ranks, 50x", [8], 17, 50, 1, None),
    ("one job of 8 ranks, budget 4x", [8], 17, 20, 4, None),
    ("one process, budget 20x", [1], 136, 20, 20, None),
    ("one job of 8 ranks, 20x, capacity halves at 8 s", [8], 17, 20, 1, 8.0),
]


def measure(module: ModuleType, seeds: int) -> list[dict[str, Any]]:
    rows = []
    for name, jobs, requests, overload, multiple, drop_at in CASES:
        capacity = sum(jobs) * requests / overload
        outs = [
            run(capacity, multiple * capacity, jobs=jobs, requests=requests, seed=s, drop_at=drop_at, module=module)
            for s in range(seeds)
        ]
        rows.append(
            {
                "case": name,
                "seeds": seeds,
                "over_ideal": [o.over_ideal for o in outs],
                "refused": [o.refused for o in outs],
                "steady": [o.steady for o in outs],
            }
        )
    return rows


#: The controller's modules in ``dcp_s3/_objstore`` (``dcp_s3/objstore`` before issue 51), each importing only those before it (``rate_limits`` and
#: ``rate_bucket`` were part of ``throttle.py`` until they were split out of it).
CONTROLLER_MODULES = ("rate_limits", "rate_bucket", "throttle")


def load_baseline(ref: str) -> ModuleType:
    """``dcp_s3/_objstore/throttle.py`` as it was at git ``ref``, as a module of its own, with the controller's
    modules it imports as they were at ``ref`` too (those that exist there), not the working tree's."""
    folder = Path(tempfile.mkdtemp())
    replaced: dict[str, ModuleType | None] = {}
    import dcp_s3._objstore.config  # noqa: F401 -- what an old ref's modules import as dcp_s3.objstore.config

    # Before issue 51 the object stores were ``dcp_s3.objstore``: an old ref's modules import that name.
    for qualified in [m for m in sys.modules if m.startswith("dcp_s3._objstore.")]:
        old_name = qualified.replace("dcp_s3._objstore.", "dcp_s3.objstore.", 1)
        replaced.setdefault(old_name, sys.modules.get(old_name))
        sys.modules[old_name] = sys.modules[qualified]
    try:
        for name in CONTROLLER_MODULES:
            for folder_name in ("_objstore", "objstore"):
                shown = subprocess.run(
                    ["git", "show", f"{ref}:dcp_s3/{folder_name}/{name}.py"],
                    cwd=common.REPO_ROOT,
                    capture_output=True,
                    text=True,
                )
                if shown.returncode == 0:
                    break
            if shown.returncode != 0:
                if name == "throttle":
                    raise RuntimeError(f"no dcp_s3 throttle module at {ref}: {shown.stderr.strip()}")
                continue  # the others are absent at refs before the split
            path = folder / f"{name}_baseline.py"
            path.write_text(shown.stdout)
            spec = importlib.util.spec_from_file_location(f"{name}_baseline", path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module  # (its dataclasses look their module up)
            spec.loader.exec_module(module)
            # The next modules' ``from dcp_s3._objstore.<name> import ...`` find this one (until the end).
            for prefix in ("dcp_s3._objstore", "dcp_s3.objstore"):
                replaced.setdefault(f"{prefix}.{name}", sys.modules.get(f"{prefix}.{name}"))
                sys.modules[f"{prefix}.{name}"] = module
    finally:
        for qualified, original in replaced.items():
            if original is None:
                sys.modules.pop(qualified, None)
            else:
                sys.modules[qualified] = original
    return module


def render(before: list[dict[str, Any]], after: list[dict[str, Any]], ref: str, seeds: int) -> str:
    def cell(values: list[float], fmt: Callable[[float], str]) -> str:
        return f"{fmt(statistics.median(values))} / {fmt(statistics.mean(values))} ({fmt(max(values))})"

    ratio, share = (lambda v: f"{v:.2f}"), (lambda v: f"{v:.1%}")
    rows = [
        [
            b["case"],
            cell(b["over_ideal"], ratio),
            cell(a["over_ideal"], ratio),
            cell(b["steady"], share),
            cell(a["steady"], share),
            cell(b["refused"], share),
            cell(a["refused"], share),
        ]
        for b, a in zip(before, after, strict=True)
    ]
    table = common.markdown_table(
        [
            "case",
            "makespan / ideal, before",
            "after",
            "refused, 2nd half, before",
            "after",
            "refused, all, before",
            "after",
        ],
        rows,
    )
    return (
        f"Simulated (`python -m benchmarks.throttle_sim`): median / mean (worst) over {seeds} seeds; before = "
        f"`dcp_s3/_objstore/throttle.py` at `{ref}`, after = the working tree, same seeds, one run. Every rank "
        f"sends its requests over 8 threads; answers take 50 ms + an exponential 100 ms; ranks start over 1 s; "
        f"the store refuses past the capacity with a bucket as deep as the ranks. Overload = all requests "
        f"offered in 1 s over the capacity; the budget each job is told is the capacity unless said.\n\n{table}\n"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default=None, help="git ref of the controller to compare with (default: none)")
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--out", default=str(common.RESULTS_DIR / "throttle_sim.json"))
    args = ap.parse_args()
    after = measure(throttle, args.seeds)
    before = measure(load_baseline(args.baseline), args.seeds) if args.baseline else after
    ref = args.baseline or "(working tree)"
    out = Path(args.out)
    common.write_json(
        out,
        {
            "benchmark": "throttle_sim",
            "baseline": ref,
            "before": before,
            "after": after,
            "machine": common.machine_info(),
            "args": vars(args),
        },
    )
    text = render(before, after, ref, args.seeds)
    print(text)
    out.with_suffix(".md").write_text(text)
    print(f"wrote {out} and {out.with_suffix('.md')}", file=sys.stderr)


if __name__ == "__main__":
    main()
