"""Many codec frame indexes as arrays: ``FrameTable``.

A compressed item's storage entry carries a ``codec.FrameIndex`` (its frames' stored ends and
raw-frame bits) and the CRC32C of each frame. The writer's gathered results
(:mod:`dcp_s3._packed.results`) and the compact ``.metadata`` (:mod:`dcp_s3._metadata.compact`) hold many of them;
as objects that is a few microseconds each to pickle, unpickle or encode. A ``FrameTable``
holds them as one row of integers per index (``FIELDS``, the compact format's frame
columns) plus their frame ends, frame CRCs and raw-frame bit masks concatenated, and is
concatenated, reordered and rebuilt with array steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from dcp_s3._codec.format import FrameIndex

__all__ = ["FrameTable", "FIELDS"]

#: Integers of one frame index, in row order (``codec`` is an index into ``FrameTable.codecs``;
#: ``crcs`` is 1 when the frames' CRC32Cs are recorded).
FIELDS = ("codec", "version", "element_size", "grouping", "raw_length", "frame_size", "frames", "crcs")
_FRAMES, _CRCS = FIELDS.index("frames"), FIELDS.index("crcs")
Framed = tuple[FrameIndex, "tuple[int, ...] | None"]


class FrameTable:
    """Frame indexes (and their frame CRC32Cs) as arrays; see the module doc."""

    def __init__(
        self, codecs: list[str], rows: np.ndarray, ends: np.ndarray, crcs: np.ndarray, raw: np.ndarray
    ) -> None:
        self.codecs, self.rows, self.ends, self.crcs, self.raw = codecs, rows, ends, crcs, raw

    def __reduce__(self) -> tuple[Any, ...]:
        return (FrameTable, (self.codecs, self.rows, self.ends, self.crcs, self.raw))

    def __len__(self) -> int:
        return len(self.rows)

    @staticmethod
    def fits(frames: Any, crcs: Any) -> bool:
        """Whether ``(frames, crcs)`` is a frame index and checksums a table can hold."""
        return (
            type(frames) is FrameIndex
            and type(frames.codec) is str
            and (
                crcs is None
                or (
                    type(crcs) is tuple
                    and len(crcs) == len(frames.ends)
                    and all(type(c) is int and 0 <= c < 1 << 32 for c in crcs)
                )
            )
        )

    @classmethod
    def of(cls, framed: Sequence[Framed]) -> FrameTable:
        """A table of ``framed`` (each ``fits``)."""
        codecs: dict[str, int] = {}
        rows: list[tuple[int, ...]] = []
        ends: list[int] = []
        crcs: list[int] = []
        raw = bytearray()
        for frames, frame_crcs in framed:
            rows.append(
                (
                    codecs.setdefault(frames.codec, len(codecs)),
                    frames.version,
                    frames.element_size,
                    frames.grouping,
                    frames.raw_length,
                    frames.frame_size,
                    len(frames.ends),
                    int(frame_crcs is not None),
                )
            )
            ends.extend(frames.ends)
            crcs.extend(frame_crcs or ())
            raw += frames.raw_frames.to_bytes(-(-len(frames.ends) // 8), "little")
        return cls(
            list(codecs),
            np.array(rows, np.int64).reshape(-1, len(FIELDS)),
            np.array(ends, np.int64),
            np.array(crcs, np.uint32),
            np.frombuffer(bytes(raw), np.uint8),
        )

    @classmethod
    def concat(cls, tables: Sequence[FrameTable]) -> FrameTable:
        """The tables one after another (codecs merged)."""
        codecs: dict[str, int] = {}
        rows = []
        for table in tables:
            renumber = np.array([codecs.setdefault(c, len(codecs)) for c in table.codecs] or [0], np.int64)
            part = table.rows.copy()
            part[:, 0] = renumber[part[:, 0]]
            rows.append(part)
        return cls(
            list(codecs),
            np.concatenate(rows) if rows else np.zeros((0, len(FIELDS)), np.int64),
            *(
                np.concatenate([getattr(t, k) for t in tables]) if tables else empty
                for k, empty in (
                    ("ends", np.zeros(0, np.int64)),
                    ("crcs", np.zeros(0, np.uint32)),
                    ("raw", np.zeros(0, np.uint8)),
                )
            ),
        )

    def _spans(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per index: its number of frame ends, of CRCs and of raw-bit bytes."""
        n = self.rows[:, _FRAMES]
        return n, n * (self.rows[:, _CRCS] != 0), (n + 7) // 8

    def take(self, order: np.ndarray) -> FrameTable:
        """The indexes at ``order``, in that order; codecs renumbered to the used ones, sorted."""
        used = sorted({self.codecs[i] for i in np.unique(self.rows[order, 0]).tolist()})
        renumber = np.array([used.index(c) if c in used else -1 for c in self.codecs] or [0], np.int64)
        rows = self.rows[order]
        rows[:, 0] = renumber[rows[:, 0]]
        parts = [
            _ragged(values, lens, order)
            for values, lens in zip((self.ends, self.crcs, self.raw), self._spans(), strict=True)
        ]
        return FrameTable(used, rows, *parts)

    def framed(self) -> list[Framed]:
        """Every index and its checksums, as objects."""
        out: list[Framed] = []
        starts = [np.concatenate(([0], np.cumsum(lens))).tolist() for lens in self._spans()]
        for i, row in enumerate(self.rows.tolist()):
            codec, version, element_size, grouping, raw_length, frame_size, _, has = row
            ends = tuple(self.ends[starts[0][i] : starts[0][i + 1]].tolist())
            bits = int.from_bytes(self.raw[starts[2][i] : starts[2][i + 1]].tobytes(), "little")
            index = FrameIndex(self.codecs[codec], version, element_size, grouping, raw_length, frame_size, ends, bits)
            out.append((index, tuple(self.crcs[starts[1][i] : starts[1][i + 1]].tolist()) if has else None))
        return out


def _ragged(values: np.ndarray, lens: np.ndarray, order: np.ndarray) -> np.ndarray:
    """The segments of ``values`` (consecutive, of lengths ``lens``) at ``order``, concatenated."""
    starts = np.concatenate(([0], np.cumsum(lens)[:-1])).astype(np.int64)
    taken = lens[order]
    total = int(taken.sum())
    if not total:
        return values[:0]
    begin = np.concatenate(([0], np.cumsum(taken)[:-1]))
    return values[np.repeat(starts[order] - begin, taken) + np.arange(total)]
