"""Two tiers for the :class:`~dcp_s3._checkpointer.manager.Checkpointer`: node-local disk in front of S3.

With ``Checkpointer(root, local_root=...)`` every save goes to the *local tier*: each rank saves its
own state — its shards, and its own copy of replicated items — as a self-contained DCP checkpoint
under ``<local_root>/rank<NNNNN>/`` (``dcp.save(no_dist=True)``: no collective, disk speed), in the
Checkpointer's step layout and with its commit protocol (parts, then the marker ``<step>.pth`` written
last, which also records the rank and the world size). So a node holds everything its ranks need to
load alone, with the same checksums as on S3. Steps chosen for S3 (``s3_every``, or
``save(..., tier="s3")``) are promoted in a background thread (:mod:`dcp_s3._checkpointer.promotion`).

Which step ``load()`` takes (all ranks agree, by one all-gather): the newest of

* the steps committed on S3, and
* the steps whose local copy is committed on *every* rank, saved by the same rank of a job of the
  same world size, and
* the steps whose copies of *all* their saving ranks are under every rank's local root, all of one
  save (a job of another world size: a resharded load, :mod:`dcp_s3._checkpointer.tier_reshard`).

Copies of different saves of one step (the save token in :data:`LOCAL_ENTRY`) never count as one step.
A ``rank<NNNNN>`` entry that is a symbolic link is never written, read or deleted through
(:mod:`dcp_s3._checkpointer.local_root`), and every marker field is checked before use
(:mod:`dcp_s3._checkpointer.markers`).

Each rank then checks its local copy of that step against what it is about to load: every chunk
its load needs is stored (same offsets and sizes: a different sharding is refused), and every object
the local ``.metadata`` references is there and not shorter than its items; the load itself checks
every item's checksum. A rank whose copy fails any of it loads from S3 instead, if the step is
there as the same save (its save token, :mod:`dcp_s3._checkpointer.saves`; if S3 holds another save of
it, every rank reads S3) — only those ranks read from S3 (each rank loads alone, ``no_dist``); if the step is not on S3
the step is not used and the next newest is tried, with a warning naming the rank and the reason.
When no rank has the step locally, the ordinary (collective, resharding) load from S3 runs. A load
never mixes steps; the reasons for every fallback are logged, warned and kept in ``tier_status()``.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import torch.distributed.checkpoint as dcp

from dcp_s3._checkpointer.generations import (
    PART_DIRS,
    commit_step,
    find_complete,
    generation_name,
    marker_entry,
    part_dirs_of,
    read_marker,
)
from dcp_s3._checkpointer.local_layout import layout_of, local_view
from dcp_s3._checkpointer.local_root import rank_dir, rank_dir_problem, rank_store
from dcp_s3._checkpointer.markers import LAYOUT, LOCAL_ENTRY, check_marker
from dcp_s3._checkpointer.ownership import CHECKPOINTER_STEPS, Ownership
from dcp_s3._checkpointer.promotion import commit_promoted, upload_rank
from dcp_s3._checkpointer.ranks import Ranks, rank, world_size
from dcp_s3._checkpointer.retention import delete_step, retain_last
from dcp_s3._checkpointer.steps import MARKER_FORMAT, MARKER_SUFFIX, scan
from dcp_s3._checkpointer.training_state import warn
from dcp_s3._dcp import Store
from dcp_s3._layout import new_token
from dcp_s3._untrusted.torch_files import torch_save_bytes
from dcp_s3.errors import CheckpointFormatError, ConfigError, DcpS3Error

__all__ = ["TIERS", "LOCAL_ENTRY", "LAYOUT", "StepStatus", "Tiers", "local_copy", "save_of"]

log = logging.getLogger(__name__)

#: Values of ``save(..., tier=...)``: the local tier only, or local and then promoted to S3.
TIERS = ("local", "s3")


@dataclass
class StepStatus:
    """Where one step is, as this rank knows it (``tier_status()`` returns these as dicts)."""

    step: str
    iteration: int
    tiers: list[str] = field(default_factory=list)  # "local", "s3" (rank 0 only knows the S3 commit)
    promotion: str = "not planned"  # "pending", "uploading", "uploaded" (ranks > 0), "done", "failed"
    saved_at: float = 0.0
    promoted_at: float | None = None
    local_seconds: float = 0.0  # how long the local save blocked
    upload_bytes: int = 0
    error: str = ""

    @property
    def lag(self) -> float | None:
        """Seconds from the local save to the S3 commit (so far, while pending)."""
        if self.promotion == "not planned":
            return None
        return (self.promoted_at or time.time()) - self.saved_at


class Tiers:
    """The local tier and the promotions of one Checkpointer (see the module docstring)."""

    def __init__(
        self,
        s3: Store,
        ranks: Ranks,
        local_root: str | os.PathLike[str],
        *,
        s3_every: int | None,
        keep_last_local: int | None,
        keep_last: int | None,
        attempts: int,
        promotion_timeout: float,
    ) -> None:
        if s3_every is not None and s3_every < 1:
            raise ConfigError(f"s3_every={s3_every} must be >= 1 (or None: only save(..., tier='s3') promotes)")
        if keep_last_local is not None and keep_last_local < 1:
            raise ConfigError(f"keep_last_local={keep_last_local} must be >= 1 (or None to keep every local step)")
        if attempts < 1:
            raise ConfigError(f"promotion_attempts={attempts} must be >= 1")
        self.s3, self.ranks = s3, ranks
        self.local_root = os.path.abspath(os.fspath(local_root))
        self.s3_every, self.keep_last_local, self.keep_last = s3_every, keep_last_local, keep_last
        self.attempts, self.timeout = attempts, promotion_timeout
        self._local: Store | None = None
        self._status: dict[str, StepStatus] = {}
        self._lock = threading.RLock()
        self._pool: ThreadPoolExecutor | None = None
        self._promotions: list[Future[None]] = []
        self._failures: list[str] = []
        self.last_load: dict[str, Any] = {}
        #: This rank's local steps the last :meth:`local_steps` could not use, and why (a hostile marker...).
        self.unusable: dict[str, str] = {}
        #: Why this rank's directory was not read by the last :meth:`local_steps` (a symbolic link), or None.
        self.refused: str | None = None

    @property
    def local(self) -> Store:
        """This rank's local root, ``<local_root>/rank<NNNNN>`` (opened at first use: the rank is known then),
        rooted at the local root so that nothing is followed through a link at the rank directory
        (:mod:`dcp_s3._checkpointer.local_root`)."""
        if self._local is None:
            self._local = rank_store(self.local_root, rank())
        return self._local

    def rank_dir_problem(self) -> str | None:
        """Why this rank's directory under the local root is not one of ours (a link...), or None."""
        return rank_dir_problem(self.local_root, rank_dir(rank()))

    # -- save -------------------------------------------------------------------------------------
    def save(
        self,
        parts: list[tuple[str, str, dict[str, Any], Any]],
        content: dict[str, Any],
        iteration: int,
        tier: str | None,
    ) -> str:
        """Save ``parts`` to this rank's local root, commit the local step, start its promotion if due."""
        if tier is not None and tier not in TIERS:
            raise ConfigError(f"tier={tier!r}: expected one of {TIERS} (or None: s3_every decides)")
        self.flush_warnings()
        promote = tier == "s3" or (tier is None and self.s3_every is not None and iteration % self.s3_every == 0)
        step = f"{int(iteration):07d}"
        token = self.ranks.run_on_rank0(new_token)  # the S3 generation: the same on every rank
        hostile = self.rank_dir_problem()
        if hostile is not None:  # after the collective above: the other ranks are not left waiting in it
            raise CheckpointFormatError(f"not saving step {step} to the local tier: {hostile}")
        local = self.local
        t0 = time.perf_counter()
        ltoken, first = new_token(), local.size(step + MARKER_SUFFIX) is None  # this rank's own generation
        suffixes = [f"{key}_{kind}" for key, kind, _, _ in parts]
        layouts = {}
        for key, kind, state, planner in parts:
            name = generation_name(step, key, kind, ltoken)
            layouts[f"{key}_{kind}"] = layout_of(state, copy.copy(planner))
            dcp.save(
                local_view(state),
                checkpoint_id=local.url(name),
                storage_writer=local.writer(name, overwrite=True),
                planner=planner,
                no_dist=True,
            )
        mine = {**content, LOCAL_ENTRY: {"rank": rank(), "world_size": world_size(), "save": token}, LAYOUT: layouts}
        mine[PART_DIRS] = {s: marker_entry(s, ltoken) for s in suffixes}
        commit_step(local, step, torch_save_bytes(mine), ltoken, suffixes, first=first)
        took = time.perf_counter() - t0
        status = StepStatus(
            step,
            int(iteration),
            ["local"],
            "pending" if promote else "not planned",
            saved_at=time.time(),
            local_seconds=took,
        )
        with self._lock:
            self._status[step] = status
        log.info(
            "saved step %s to the local tier %s in %.2fs%s",
            step,
            local.url(),
            took,
            "; promoting it to S3" if promote else "",
        )
        if promote:
            dirs = [
                (s, f"{step}.{marker_entry(s, ltoken)}", f"{step}.{marker_entry(s, token)}", layouts[s])
                for s in suffixes
            ]
            s3_marker = torch_save_bytes({**content, PART_DIRS: {s: marker_entry(s, token) for s in suffixes}})
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="dcp_s3-promotion")
            self._promotions.append(self._pool.submit(self._promote, status, dirs, s3_marker, token, world_size()))
        self._retain_local(keep=step)
        return local.url(step)

    def _promote(
        self, status: StepStatus, dirs: list[tuple[str, str, str, Any]], marker: bytes, token: str, world: int
    ) -> None:
        me = rank()
        status.promotion = "uploading"
        try:
            status.upload_bytes = upload_rank(
                self.local, self.s3, [(lo, s3, lay) for _, lo, s3, lay in dirs], me, self.attempts
            )
            if me != 0:  # rank 0 commits; this rank's part is done
                status.promotion, status.promoted_at = "uploaded", time.time()
                return
            commit_promoted(
                self.s3,
                status.step,
                [(s, s3) for s, _, s3, _ in dirs],
                marker,
                token,
                world,
                timeout=self.timeout,
                attempts=self.attempts,
            )
            status.promotion, status.promoted_at = "done", time.time()
            status.tiers.append("s3")
            log.info(
                "promoted step %s to %s: %.1fs after its local save",
                status.step,
                self.s3.url(),
                status.promoted_at - status.saved_at,
            )
            self._retain_s3(keep=status.step)
        except Exception as exc:
            status.promotion, status.error = "failed", f"{type(exc).__name__}: {exc}"
            message = (
                f"promotion of step {status.step} to {self.s3.url()} failed on rank {me} after "
                f"{self.attempts} attempts; it stays in the local tier only: {status.error}"
            )
            log.warning(message)
            with self._lock:
                self._failures.append(message)
        finally:
            self._retain_local(keep=None)

    def wait_promotions(self, timeout: float | None = None) -> None:
        """Wait for every promotion started so far (failures are reported by warnings, not raised)."""
        pending, self._promotions = self._promotions, []
        for fut in pending:
            fut.result(timeout)
        self.flush_warnings()

    def close(self) -> None:
        try:
            self.wait_promotions()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def flush_warnings(self) -> None:
        """Warn (on the caller's thread) about the promotions that failed since the last call."""
        with self._lock:
            failures, self._failures = self._failures, []
        for message in failures:
            warn(message)

    def status(self) -> list[dict[str, Any]]:
        self.flush_warnings()
        with self._lock:
            return [asdict(s) | {"lag": s.lag} for s in sorted(self._status.values(), key=lambda s: s.iteration)]

    # -- retention ---------------------------------------------------------------------------------------
    def _protected(self) -> set[str]:
        """Local steps a promotion still needs."""
        with self._lock:
            return {s.step for s in self._status.values() if s.promotion in ("pending", "uploading")}

    def _retain_local(self, keep: str | None) -> None:
        """``keep_last_local`` on this rank's root; never a step being promoted, never the newest."""
        if self.keep_last_local is None:
            return
        hostile = self.rank_dir_problem()
        if hostile is not None:
            log.warning("keep_last_local: deleting nothing: %s", hostile)
            return
        with self._lock:
            local = self.local
            try:
                # Only steps named as the tier names them: never another checkpoint lying in the rank directory.
                ownership = Ownership(f"keep_last_local={self.keep_last_local}", "", CHECKPOINTER_STEPS)
                done = [s for s in find_complete(local, None) if s.parts and ownership.owns(s.name)]
                protected = self._protected() | ({keep} if keep else set())
                for old in done[: max(0, len(done) - self.keep_last_local)]:
                    if old.name in protected:
                        continue
                    (listed,) = [s for s in scan(local.list_objects(f"{old.name}.")) if s.name == old.name] or [old]
                    delete_step(local, listed, uploads=False)
                    log.info("keep_last_local=%d: deleted local step %s", self.keep_last_local, local.url(old.name))
                    if old.name in self._status and "local" in self._status[old.name].tiers:
                        self._status[old.name].tiers.remove("local")
            except (DcpS3Error, OSError) as exc:
                log.warning("keep_last_local: could not delete old local steps under %s: %s", local.url(), exc)

    def _retain_s3(self, keep: str) -> None:
        if self.keep_last is None:
            return
        try:
            deleted = set(retain_last(self.s3, self.keep_last, keep=self.s3.url(keep)))
            with self._lock:
                for st in self._status.values():
                    if "s3" in st.tiers and self.s3.url(st.step) in deleted:
                        st.tiers.remove("s3")
        except (DcpS3Error, OSError) as exc:
            log.warning("keep_last=%d: could not delete old steps under %s: %s", self.keep_last, self.s3.url(), exc)

    # -- load --------------------------------------------------------------------------------------------
    def local_steps(self) -> dict[str, tuple[Any, dict[str, str]]]:
        """This rank's committed local steps saved by this rank of a job of this world size:
        step -> (marker, part directory by part)."""
        out: dict[str, tuple[Any, dict[str, str]]] = {}
        self.unusable = {}
        self.refused = hostile = self.rank_dir_problem()
        if hostile is not None:  # nothing is read through it: this rank has no local copy
            warn(f"the local tier of rank {rank()} is not used: {hostile}")
            return out
        for step in find_complete(self.local, None, names=CHECKPOINTER_STEPS):
            try:
                found = local_copy(self.local, step.name)
                if found is None:
                    continue
                marker, dirs, entry = found
                if (entry["rank"], entry["world_size"]) != (rank(), world_size()):
                    continue
                out[step.name] = (marker, dirs)
            except (DcpS3Error, OSError) as exc:
                self.unusable[step.name] = f"{type(exc).__name__}: {exc}"
                log.warning("local step %s is not usable: %s", self.local.url(step.name), exc)
        return out


def save_of(marker: Any) -> str | None:
    """The save token of a local copy's marker (None: a marker written before tokens were recorded)."""
    save = marker[LOCAL_ENTRY].get("save")
    return save if isinstance(save, str) else None


def local_copy(store: Store, step: str) -> tuple[dict[str, Any], dict[str, str], dict[str, Any]] | None:
    """(marker, part directory by part, its :data:`LOCAL_ENTRY`) of the local step ``step`` in ``store`` (one
    rank's directory), or None if it has no marker or is not a local-tier step. The marker is stored bytes:
    ``CheckpointFormatError`` (naming it) for an entry whose rank or world size is not a whole number in
    range, or parts that are not part names."""
    found = read_marker(store, step)
    if found is None:
        return None
    marker, where = found[1], store.url(step + MARKER_SUFFIX)
    if not isinstance(marker, dict) or marker.get("format") != MARKER_FORMAT or LOCAL_ENTRY not in marker:
        return None
    check_marker(marker, where)  # every field read below, and the iteration a load returns
    entry, parts = marker[LOCAL_ENTRY], marker.get("parts")
    if not isinstance(parts, list):
        raise CheckpointFormatError(f"{where}: it lists no 'parts'")
    dirs = part_dirs_of(marker, step, where) or {p: f"{step}.{p}" for p in parts}
    return marker, dirs, entry
