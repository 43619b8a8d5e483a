"""The byte plan of a Hugging Face export (coordinator, once per save): which tensor goes in which shard file
at which offset, and where each byte of each file comes from.

Input: the ranks' save plans after DCP's planner removed replicated duplicates, so every chunk of every
tensor is written by one rank. Each file is ``[8-byte length][JSON header][tensors' bytes, packed in order]``
(:func:`dcp_s3._dcp.safetensors_header.build_header`); tensors go into files in the order they first
appear in the plans, a new file starting where the next tensor would pass ``max_shard_size`` (a larger
tensor alone in its file), as ``save_pretrained`` shards.

A chunk (offsets, sizes) of a row-major tensor is one contiguous run of the full tensor's bytes when it
spans whole trailing dimensions (``Shard(0)``, a replicated tensor); otherwise it is ``prod(sizes[:j])``
runs. Each rank writes its chunks, row-major, one after the other into one *piece object*, in the order of
their first byte in the export; the file is then the header followed by spans of the piece objects. The
runs are checked to tile every file's data exactly once: a tensor a plan covers twice or not at all is a
``ConfigError`` naming it, before any byte is written.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

from dcp_s3._dcp.hf_reader import TORCH_DTYPES
from dcp_s3._dcp.safetensors_header import DTYPE_SIZES, build_header
from dcp_s3._objstore.base import Span
from dcp_s3.errors import ConfigError

__all__ = ["ExportPlan", "RankPieces", "plan_export", "shard_name", "ChunkKey", "MAX_RUNS"]

#: Most contiguous runs an export may be cut into (a column-sharded tensor has one per row and rank); each
#: costs a few hundred bytes of the coordinator's memory and, where shorter than 5 MiB, a copy through it.
MAX_RUNS = 2_000_000
_ST_DTYPES = {dtype: name for name, dtype in TORCH_DTYPES.items()}
#: A write item of a rank: the tensor's name and the chunk's offsets.
ChunkKey = tuple[str, tuple[int, ...]]


def shard_name(i: int, n: int) -> str:
    """``model-00001-of-00003.safetensors``, as ``save_pretrained`` names shards."""
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


@dataclass(frozen=True)
class RankPieces:
    """What one rank writes: its chunks, in this order, into its piece object ``name`` of ``size`` bytes."""

    name: str
    order: list[ChunkKey]
    size: int


@dataclass
class ExportPlan:
    """The coordinator's plan: per file, its name and pieces (header bytes, then spans of piece objects
    named relative to the export); the index's weight map and the tensors' total bytes."""

    files: list[tuple[str, list[bytes | Span]]] = field(default_factory=list)
    weight_map: dict[str, str] = field(default_factory=dict)
    total_size: int = 0
    ranks: list[RankPieces] = field(default_factory=list)


@dataclass
class _Tensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    chunks: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)  # rank, offsets, sizes

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


def _tensors(plans: Sequence[SavePlan]) -> list[_Tensor]:
    tensors: dict[str, _Tensor] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
                raise ConfigError(f"{fqn!r} is not a tensor: a Hugging Face export holds tensors only")
            td = item.tensor_data
            dtype = _ST_DTYPES.get(td.properties.dtype)
            if dtype is None:
                raise ConfigError(f"{fqn!r}: dtype {td.properties.dtype} has no safetensors name")
            shape = tuple(int(d) for d in td.size)
            t = tensors.setdefault(fqn, _Tensor(fqn, dtype, shape))
            if (t.dtype, t.shape) != (dtype, shape):
                raise ConfigError(f"{fqn!r}: ranks disagree on its dtype or shape ({t.dtype}{t.shape}, {dtype}{shape})")
            t.chunks.append((rank, tuple(int(o) for o in td.chunk.offsets), tuple(int(s) for s in td.chunk.sizes)))
    return list(tensors.values())


def _runs(shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...], esize: int) -> list[int]:
    """Byte offsets (in the full tensor) of the chunk's contiguous runs, in the chunk's row-major order,
    and (last element) the run length."""
    if math.prod(sizes) == 0:
        return [0]
    if not shape:
        return [0, esize]
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    j = len(shape) - 1
    while j > 0 and sizes[j] == shape[j]:
        j -= 1
    run = sizes[j] * strides[j] * esize
    starts = [
        (sum((offsets[d] + i[d]) * strides[d] for d in range(j)) + offsets[j] * strides[j]) * esize
        for i in itertools.product(*(range(sizes[d]) for d in range(j)))
    ]
    return [*starts, run]


def _files(tensors: list[_Tensor], max_shard_size: int) -> list[list[_Tensor]]:
    files: list[list[_Tensor]] = []
    size = 0
    for t in tensors:
        if not files or (files[-1] and size + t.nbytes > max_shard_size):
            files.append([])
            size = 0
        files[-1].append(t)
        size += t.nbytes
    return files or [[]]


def plan_export(
    plans: Sequence[SavePlan], max_shard_size: int, staging: str, metadata: dict[str, str] | None = None
) -> ExportPlan:
    """The export of ``plans`` (one per rank) in files of about ``max_shard_size`` bytes of tensors; piece
    objects named ``<staging>/rank-<r>``; ``metadata``: every file's ``__metadata__`` besides ``format``."""
    tensors = _tensors(plans)
    if not tensors:
        raise ConfigError("nothing to export: the state dict holds no tensors")
    files = _files(tensors, max_shard_size)
    out = ExportPlan()
    # (file, byte in file, run length, rank, chunk key, byte in chunk), for every run of every chunk.
    runs: list[tuple[int, int, int, int, ChunkKey, int]] = []
    headers: list[bytes] = []
    ends: list[list[tuple[int, str]]] = []  # per file: (end of each tensor, its name), for errors
    for f, members in enumerate(files):
        header, spans = build_header(
            [(t.name, t.dtype, t.shape) for t in members], {"format": "pt", **(metadata or {})}
        )
        headers.append(header)
        ends.append([(end, t.name) for t, (_, end) in zip(members, spans, strict=True)])
        name = shard_name(f, len(files))
        for t, (begin, _) in zip(members, spans, strict=True):
            out.weight_map[t.name] = name
            out.total_size += t.nbytes
            esize = DTYPE_SIZES[t.dtype]
            for rank, offsets, sizes in t.chunks:
                *starts, run = _runs(t.shape, offsets, sizes, esize)
                if run == 0:
                    continue
                if len(runs) + len(starts) > MAX_RUNS:
                    raise ConfigError(
                        f"{t.name!r}: the export would be cut into more than {MAX_RUNS} runs (chunks split "
                        "across inner dimensions); save from Shard(0) or replicated placements"
                    )
                runs.extend((f, begin + s, run, rank, (t.name, offsets), k * run) for k, s in enumerate(starts))
    runs.sort(key=lambda r: (r[0], r[1]))
    _check_tiling(runs, headers, ends, files)
    # Each rank's chunks into its piece object, in the order of their first byte in the export.
    firsts: dict[int, dict[ChunkKey, int]] = {}
    for _, _, _, rank, key, _ in runs:
        firsts.setdefault(rank, {}).setdefault(key, len(firsts[rank]))
    chunk_bytes: dict[ChunkKey, int] = {}
    for _, _, n, _, key, _ in runs:
        chunk_bytes[key] = chunk_bytes.get(key, 0) + n
    where: dict[tuple[int, ChunkKey], int] = {}
    for rank in range(len(plans)):
        order = sorted(firsts.get(rank, {}), key=lambda k: firsts[rank][k])
        at = 0
        for key in order:
            where[(rank, key)] = at
            at += chunk_bytes[key]
        out.ranks.append(RankPieces(f"{staging}/rank-{rank:05d}", order, at))
    pieces: list[list[bytes | Span]] = [[h] for h in headers]
    for f, _, n, rank, key, within in runs:
        obj = out.ranks[rank].name
        start = where[(rank, key)] + within
        last = pieces[f][-1]
        if isinstance(last, Span) and last.key == obj and last.end == start:
            pieces[f][-1] = Span(obj, last.start, start + n)
        else:
            pieces[f].append(Span(obj, start, start + n))
    out.files = [(shard_name(f, len(files)), p) for f, p in enumerate(pieces)]
    return out


def _check_tiling(
    runs: list[tuple[int, int, int, int, ChunkKey, int]],
    headers: list[bytes],
    ends: list[list[tuple[int, str]]],
    files: list[list[_Tensor]],
) -> None:
    """Every byte of every file's data comes from exactly one run."""
    expected = [len(h) for h in headers]
    for f, at, n, *_ in runs:
        if at != expected[f]:
            raise ConfigError(_coverage_error(ends[f], min(at, expected[f]), at < expected[f]))
        expected[f] = at + n
    for f, members in enumerate(files):
        total = len(headers[f]) + sum(t.nbytes for t in members)
        if expected[f] != total:
            raise ConfigError(_coverage_error(ends[f], expected[f], False))


def _coverage_error(ends: list[tuple[int, str]], at: int, twice: bool) -> str:
    i = bisect.bisect_right([e for e, _ in ends], at)
    name = ends[min(i, len(ends) - 1)][1] if ends else "?"
    how = "more than once (overlapping chunks)" if twice else "not at all (a chunk is missing)"
    return f"tensor {name!r}: some of its elements are saved {how}; a Hugging Face export needs every element once"
