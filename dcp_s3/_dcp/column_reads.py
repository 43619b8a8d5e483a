"""The reads of a column piece of a raw item (tensor parallelism's ``Shard(1)``): only the bytes of its columns.

A piece of some columns of a row-major tensor (dimension 1 cut, every later dimension whole) is one contiguous
run per row, the other columns of the row between two runs. Runs whose gap is under ``COLUMN_GAP`` (and the
transfer's ``coalesce_gap``) are read together with it, at most ``max_range_size`` bytes a request (narrow rows
cost few requests, as whole rows did); otherwise each row's run is its own request, and a rank reads its own
columns only. Each request reads into a buffer of its own (allocated only while in flight); once in, each row's
run is cast and copied into the destination.

Used (:mod:`dcp_s3._dcp.item_reads`) for raw items without block checksums — a safetensors export's tensors,
checked by their header (:mod:`dcp_s3._dcp.safetensors_header`); items with block checksums read whole
blocks, so whole rows, as before.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.planner import ReadItem

from dcp_s3._objstore.base import RangeRead
from dcp_s3._objstore.config import TransferConfig
from dcp_s3._torch_compat import element_size

__all__ = ["COLUMN_GAP", "column_reads", "is_column_piece"]

#: A column piece's per-row runs are read separately where the gap between them (the other columns) is at least
#: this long; shorter gaps are read through.
COLUMN_GAP = 64 << 10


def is_column_piece(lengths: Any, sizes: Any) -> bool:
    """Whether a read of ``lengths`` of a stored chunk of ``sizes`` is some of its columns: dimension 1 cut, every
    later dimension whole (each row's bytes are then one contiguous run)."""
    return (
        len(sizes) >= 2 and lengths[1] < sizes[1] and tuple(lengths[2:]) == tuple(sizes[2:]) and math.prod(lengths) > 0
    )


def column_reads(
    key: str,
    base: int,
    req: ReadItem,
    dest: torch.Tensor,
    sizes: Any,
    dtype: torch.dtype,
    transfer: TransferConfig,
) -> Iterator[RangeRead]:
    """The reads of ``req`` (a column piece: :func:`is_column_piece`) of the tensor of ``sizes`` and ``dtype``
    whose raw bytes start at byte ``base`` of ``key``, into ``dest`` (the piece's destination)."""
    elem = element_size(dtype)
    inner = math.prod(sizes[2:]) * elem  # bytes of one step along dimension 1
    row_bytes = sizes[1] * inner
    run = req.lengths[1] * inner
    col = req.storage_offsets[1] * inner
    row0, rows = req.storage_offsets[0], req.lengths[0]
    merge = row_bytes - run < min(COLUMN_GAP, transfer.coalesce_gap + 1)
    per_read = max(1, (transfer.max_range_size - run) // row_bytes + 1) if merge else 1
    for r in range(0, rows, per_read):
        n = min(per_read, rows - r)
        lo = base + (row0 + r) * row_bytes + col
        piece = _ColumnRows(dest.narrow(0, r, n), dtype, row_bytes // elem, run // elem, (n - 1) * row_bytes + run)
        yield RangeRead(key, lo, lo + piece.length, piece.open, piece.done)


class _ColumnRows:
    """The bytes of ``out``'s rows (``out``: the destination rows of one request), from the first byte of the
    first row's run to the last of the last's: ``open`` gives a buffer of ``length`` bytes, ``done`` copies each
    row's run (``run`` elements, ``stride`` apart) into ``out``, cast, and drops the buffer."""

    def __init__(self, out: torch.Tensor, dtype: torch.dtype, stride: int, run: int, length: int) -> None:
        self.out, self.dtype, self.stride, self.run, self.length = out, dtype, stride, run, length
        self._buf: np.ndarray | None = None

    def open(self) -> memoryview:
        self._buf = np.empty(self.length, np.uint8)
        return self._buf.data

    def done(self) -> None:
        buf, self._buf = self._buf, None
        assert buf is not None  # the object store opens a read before it is done
        flat = torch.from_numpy(buf).view(self.dtype)
        rows = flat.as_strided((self.out.shape[0], self.run), (self.stride, 1))
        self.out.copy_(rows.reshape(self.out.shape))
