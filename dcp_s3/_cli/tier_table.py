"""How ``dcp-s3 ls`` prints a tiered Checkpointer's local root (rows from :func:`dcp_s3.admin.list_local_tier`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dcp_s3._cli.text import say, table, when

__all__ = ["print_local_tier", "rank_ranges"]


def rank_ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2,5``."""
    runs: list[list[int]] = []
    for r in sorted(set(ranks)):
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) or "-"


def print_local_tier(root: str, rows: Sequence[Any], s3: str | None, refused: Mapping[int, str] | None = None) -> None:
    """One line per step (``LocalStep`` rows), then why each incomplete or unreadable one is so, and why each
    rank entry in ``refused`` (a link...) was not read."""
    head = ["STEP", "LOCAL", "RANKS", "LOCAL COMMIT"] + (["S3", "S3 COMMIT", "LAG"] if s3 else [])
    lines = [head]
    for r in rows:
        status = "complete" if r.complete else "UNREADABLE" if r.problems and not r.ranks else "INCOMPLETE"
        of = f" of {r.world_size}" if r.world_size is not None else ""
        line = [r.name, status, rank_ranges(r.ranks) + of, when(r.committed_at or 0)]
        if s3:
            lag = f"{r.lag:.1f}s" if r.lag is not None else "-"
            line += [r.s3 or "-", when(r.s3_committed_at or 0), lag]
        lines.append(line)
    print(table(lines, right={6} if s3 else set()))
    for r in rows:
        if r.why:
            say(f"{r.name}: {r.why}")
        if r.s3_error:
            say(f"{r.name} on S3: {r.s3_error}")
    for rank, why in sorted((refused or {}).items()):
        say(f"rank {rank} not read: {why}")
    done = sum(r.complete for r in rows)
    where = f"; S3 root {s3}" if s3 else ""
    print(f"{len(rows)} steps in the local tier under {root} ({done} complete on every rank{where})")
