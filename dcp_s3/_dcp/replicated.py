"""Replicated loads that read each byte from S3 once: ``S3StorageReader(replica_group=...)``.

Ranks that load the same thing (the replicas of one shard in HSDP, or every rank of a
fleet loading a whole model) have the same load plan. Without help each one GETs every
byte of it, so R replicas read R times the checkpoint. Given the group of such ranks,
``read_replicated``:

1. checks that every member has the same plan (a digest of every read item, the
   destination dtypes and sizes, all-gathered; members that differ get a ``ConfigError``
   naming them, on every rank, so none is left waiting; so does an error on any member);
2. cuts the plan, in storage order (so neighbouring items stay in one member's ranged
   GETs), into one share per member of about equal bytes; each member reads its share
   into its destination tensors with the ordinary reader;
3. tells every member whether every share was read (a failure anywhere is raised
   everywhere), then broadcasts each share from its reader to the others: tensor bytes go
   in batches of at most ``BATCH_BYTES`` through a staging buffer on the group's collective
   device (CPU for gloo, the current CUDA device for NCCL), or straight from/into the
   destination when it is contiguous on that device;
4. commits every item to the planner (``commit_tensor``/``load_bytes``) in plan order.
"""

from __future__ import annotations

import hashlib
import io
import pickle
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from dcp_s3._planners.sharing import collective_device, error_payload, group_ranks
from dcp_s3.errors import ConfigError, DcpS3Error

#: How the reader reads a plan on this rank alone (``S3StorageReader``'s ordinary read).
ReadAll = Callable[[LoadPlan, LoadPlanner], None]

__all__ = ["read_replicated", "BATCH_BYTES"]

#: Largest broadcast of staged bytes (a single row larger than this goes alone).
BATCH_BYTES = 64 << 20
_ALIGN = 16  # every piece starts at a multiple of this in a batch, so it can be viewed as any dtype


@dataclass
class _Entry:
    req: ReadItem
    dest: torch.Tensor | None  # None for byte items
    nbytes: int
    order: tuple[str, int]  # (object, offset): storage order
    data: bytes | None = None  # a byte item's value, once read or received


@dataclass(frozen=True)
class _Piece:
    entry: int  # index into the entries
    row0: int
    rows: int  # -1: the whole entry (0-dim tensors and byte items)
    nbytes: int


class _Capture:
    """The planner as the reader sees it for a member's own share: the destinations resolved
    up front, commits held back until the share has been broadcast."""

    def __init__(self, entries: dict[int, _Entry]) -> None:
        self._by_id = entries

    def resolve_tensor(self, req: ReadItem) -> torch.Tensor:
        dest = self._by_id[id(req)].dest
        assert dest is not None
        return dest

    def commit_tensor(self, req: ReadItem, tensor: torch.Tensor) -> None:
        pass  # committed for every entry, in plan order, once all shares are in

    def load_bytes(self, req: ReadItem, value: io.BytesIO) -> None:
        self._by_id[id(req)].data = value.getvalue()


def read_replicated(
    read_all: ReadAll, storage_data: Mapping[Any, Any], plan: LoadPlan, planner: LoadPlanner, group: dist.ProcessGroup
) -> None:
    """Read ``plan`` on every rank of ``group``, each byte from S3 by one rank only (see the module doc):
    ``read_all`` reads a plan on this rank, ``storage_data`` is the checkpoint's (``Metadata.storage_data``)."""
    size = dist.get_world_size(group)
    if size == 1:
        read_all(plan, planner)
        return
    me = dist.get_rank(group)
    ranks = group_ranks(group)
    device = collective_device(group)
    entries: list[_Entry] = []
    digest, error = b"", None
    try:
        entries = [_entry(req, planner, storage_data) for req in plan.items]
        digest = _digest(entries)
    except Exception as exc:  # reported to every member, then raised
        error = exc
    digests = _exchange(digest, error, group, ranks)
    differ = [ranks[i] for i, d in enumerate(digests) if d != digests[0]]
    if differ:
        raise ConfigError(
            f"replica_group: ranks {differ} have a different load plan than rank {ranks[0]} (group ranks {ranks}); "
            "the members of a replica group must load the same tensors with the same shapes, dtypes and shards"
        )
    owners = _owners(entries, size)
    mine = [e for e, o in zip(entries, owners, strict=True) if o == me]
    try:
        read_all(LoadPlan([e.req for e in mine]), cast(LoadPlanner, _Capture({id(e.req): e for e in mine})))
    except Exception as exc:
        error = exc
    _exchange(b"", error, group, ranks)
    for owner in range(size):
        share = [i for i, o in enumerate(owners) if o == owner]
        for batch in _batches(entries, share):
            _broadcast_batch(entries, batch, owner == me, ranks[owner], group, device)
    for e in entries:
        if e.dest is not None:
            planner.commit_tensor(e.req, e.dest)
        else:
            assert e.data is not None
            planner.load_bytes(e.req, io.BytesIO(e.data))


def _entry(req: ReadItem, planner: LoadPlanner, storage_data: Mapping[Any, Any]) -> _Entry:
    info = storage_data.get(req.storage_index)
    order = (str(info.relative_path), int(info.offset)) if info is not None else ("", 0)
    if req.type == LoadItemType.BYTE_IO:
        return _Entry(req, None, int(info.length) if info is not None else 0, order)
    dest = planner.resolve_tensor(req).detach()
    return _Entry(req, dest, dest.numel() * dest.element_size(), order)


def _digest(entries: list[_Entry]) -> bytes:
    h = hashlib.sha256()
    for e in entries:
        r = e.req
        dtype = str(e.dest.dtype) if e.dest is not None else "bytes"
        h.update(
            repr(
                (
                    r.type.name,
                    r.dest_index,
                    tuple(r.dest_offsets),
                    r.storage_index,
                    tuple(r.storage_offsets),
                    tuple(r.lengths),
                    dtype,
                    e.nbytes,
                )
            ).encode()
        )
    return h.digest()


def _owners(entries: list[_Entry], size: int) -> list[int]:
    """Member reading each entry: the plan in storage order, cut into ``size`` runs of about equal bytes."""
    order = sorted(range(len(entries)), key=lambda i: entries[i].order)
    total = sum(e.nbytes for e in entries) or 1
    owners = [0] * len(entries)
    done = 0
    for i in order:
        n = entries[i].nbytes
        owners[i] = min(size - 1, (2 * done + n) * size // (2 * total))  # the member whose run holds its midpoint
        done += n
    return owners


def _pieces(entries: list[_Entry], share: list[int]) -> Iterator[_Piece]:
    """A share's bytes as pieces of at most ``BATCH_BYTES`` (whole rows of a tensor), in storage order."""
    for i in sorted(share, key=lambda j: entries[j].order):
        e = entries[i]
        if e.dest is None or e.dest.dim() == 0 or e.nbytes == 0:
            yield _Piece(i, 0, -1, e.nbytes)
            continue
        rows_total = e.dest.shape[0]
        row_bytes = e.nbytes // rows_total
        step = max(1, BATCH_BYTES // max(1, row_bytes))
        for r in range(0, rows_total, step):
            n = min(step, rows_total - r)
            yield _Piece(i, r, n, n * row_bytes)


def _batches(entries: list[_Entry], share: list[int]) -> Iterator[list[tuple[_Piece, int]]]:
    """Pieces grouped into broadcasts of at most ``BATCH_BYTES``, each with its aligned offset."""
    batch: list[tuple[_Piece, int]] = []
    end = 0
    for piece in _pieces(entries, share):
        at = -(-end // _ALIGN) * _ALIGN
        if batch and at + piece.nbytes > BATCH_BYTES:
            yield batch
            batch, at = [], 0
        batch.append((piece, at))
        end = at + piece.nbytes
    if batch:
        yield batch


def _tensor_of(entries: list[_Entry], piece: _Piece) -> torch.Tensor:
    dest = entries[piece.entry].dest
    assert dest is not None
    return dest if piece.rows < 0 else dest.narrow(0, piece.row0, piece.rows)


def _broadcast_batch(
    entries: list[_Entry],
    batch: list[tuple[_Piece, int]],
    sending: bool,
    src: int,
    group: dist.ProcessGroup,
    device: torch.device,
) -> None:
    if len(batch) == 1 and entries[batch[0][0].entry].dest is not None:
        t = _tensor_of(entries, batch[0][0])
        if t.is_contiguous() and t.device == device and t.numel():
            dist.broadcast(t.view(-1).view(torch.uint8), src=src, group=group)  # in place: no staging
            return
    pieces_end = batch[-1][1] + batch[-1][0].nbytes
    buf = torch.empty(pieces_end, dtype=torch.uint8, device=device)
    if sending:
        for piece, at in batch:
            e = entries[piece.entry]
            if e.dest is None:
                if piece.nbytes:
                    assert e.data is not None
                    buf[at : at + piece.nbytes].copy_(torch.frombuffer(bytearray(e.data), dtype=torch.uint8))
            elif piece.nbytes:
                buf[at : at + piece.nbytes].copy_(_tensor_of(entries, piece).reshape(-1).view(torch.uint8))
    dist.broadcast(buf, src=src, group=group)
    if sending:
        return
    for piece, at in batch:
        e = entries[piece.entry]
        raw = buf[at : at + piece.nbytes]
        if e.dest is None:
            e.data = raw.cpu().numpy().tobytes()
        elif piece.nbytes:
            t = _tensor_of(entries, piece)
            t.copy_(raw.view(t.dtype).view(t.shape))


def _exchange(value: bytes, error: Exception | None, group: dist.ProcessGroup, ranks: list[int]) -> list[bytes]:
    """Every member's ``value``; if any member had an ``error``, it is raised on every member instead
    (a member's own error on itself), so that no member is left waiting in a later collective."""
    reports: list[Any] = [None] * len(ranks)
    dist.all_gather_object(reports, (value, None if error is None else error_payload(error)), group=group)
    if error is not None:
        raise error
    for rank, (_, report) in zip(ranks, reports, strict=True):
        if report is not None:
            try:
                exc = pickle.loads(report)  # pickled by a rank of this job
            except Exception:
                exc = DcpS3Error(f"rank {rank} of the replica group failed to read its share")
            raise exc
    return [v for v, _ in reports]
