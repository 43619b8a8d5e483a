"""Safetensors headers and Hugging Face index files: parsed as untrusted input, and built (no torch, no I/O).

A safetensors object is ``[8-byte little-endian header length N][N bytes of JSON][data]``; the JSON maps
each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the data,
end exclusive), plus an optional ``"__metadata__"`` of strings (https://github.com/huggingface/safetensors,
"Format"). ``model.safetensors.index.json`` maps names to shard files (``"weight_map"``).

Threat model: the bytes come from a bucket someone else may write. Nothing here allocates more than
the bytes it was given, nor loops more than their length; every refusal is a ``CheckpointFormatError``
naming the object (``where``). Checks: the header length is at most :data:`MAX_HEADER_BYTES` and inside
the object; the JSON is UTF-8, an object, without duplicate keys or non-finite constants; each tensor's
dtype is known, its shape a list of non-negative ints, its offsets two ints inside the object's data,
their span exactly ``dtype size x prod(shape)``, and no two tensors' spans overlap; the index's
``weight_map`` maps strings to plain file names (no ``/``, ``\\``, ``..``, hidden names) ending in
``.safetensors``.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dcp_s3.errors import CheckpointFormatError

__all__ = [
    "MAX_HEADER_BYTES",
    "MAX_INDEX_BYTES",
    "MAX_SHARDS",
    "MAX_TOTAL_HEADER_BYTES",
    "PREFIX_BYTES",
    "DTYPE_SIZES",
    "TensorEntry",
    "header_length",
    "parse_header",
    "parse_index",
    "plain_file_name_problem",
    "check_whole_tensors",
    "build_header",
    "build_index",
    "EXPORT_KEY",
    "index_export_id",
    "check_export_id",
]

#: The largest header accepted: 100 MiB (the Rust ``safetensors`` crate's own limit).
MAX_HEADER_BYTES = 100 << 20
#: The largest ``model.safetensors.index.json`` accepted (a 1T-parameter model's index is a few MiB).
MAX_INDEX_BYTES = 100 << 20
#: Most shard files an index may name (a 10 TB model in 1 GB shards): each costs a HEAD and a GET.
MAX_SHARDS = 10_000
#: Most header bytes of all shards together, held at once while the metadata is built.
MAX_TOTAL_HEADER_BYTES = 256 << 20
#: The length prefix: an unsigned 64-bit little-endian integer.
PREFIX_BYTES = 8
#: Most dimensions a tensor may declare (torch's own limit).
MAX_DIMS = 64
#: Element size of every dtype the format names.
DTYPE_SIZES: Mapping[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
_ENTRY_KEYS = frozenset({"dtype", "shape", "data_offsets"})


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of a safetensors object: bytes ``[begin, end)`` of the object (end exclusive, the
    header already added), ``dtype`` as the format names it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def header_length(prefix: bytes | bytearray | memoryview, object_size: int, where: str) -> int:
    """The header length ``N`` the 8-byte ``prefix`` declares, checked against the cap and the object."""
    if object_size < PREFIX_BYTES or len(prefix) < PREFIX_BYTES:
        raise CheckpointFormatError(f"{where}: {object_size} bytes, too short for a safetensors object")
    n = int.from_bytes(bytes(prefix[:PREFIX_BYTES]), "little")
    if n > MAX_HEADER_BYTES:
        raise CheckpointFormatError(
            f"{where}: declares a {n}-byte safetensors header; at most {MAX_HEADER_BYTES} bytes are accepted"
        )
    if PREFIX_BYTES + n > object_size:
        raise CheckpointFormatError(f"{where}: declares a {n}-byte header in a {object_size}-byte object")
    return n


def _reject_constant(name: str) -> Any:
    raise CheckpointFormatError(f"non-finite number {name}")  # caught and named by _load_json


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise CheckpointFormatError(f"duplicate key {key!r}")  # caught and named by _load_json
        out[key] = value
    return out


def _load_json(raw: bytes | bytearray | memoryview, where: str, what: str) -> dict[str, Any]:
    try:
        value = json.loads(
            bytes(raw).decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_reject_constant
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise CheckpointFormatError(f"{where}: {what} is not valid JSON ({type(exc).__name__}: {exc})") from exc
    if not isinstance(value, dict):
        raise CheckpointFormatError(f"{where}: {what} is a JSON {type(value).__name__}, expected an object")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_header(
    raw: bytes | bytearray | memoryview, object_size: int, where: str
) -> tuple[list[TensorEntry], dict[str, str]]:
    """The tensors (sorted by offset) and the ``__metadata__`` of the header ``raw`` (the ``N`` bytes after
    the prefix) of a ``object_size``-byte object."""
    data_start = PREFIX_BYTES + len(raw)
    data_size = object_size - data_start
    if data_size < 0:
        raise CheckpointFormatError(f"{where}: header runs past the end of the object")
    header = _load_json(raw, where, "the safetensors header")
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointFormatError(f"{where}: __metadata__ must map strings to strings")
    entries: list[TensorEntry] = []
    for name, spec in header.items():
        entries.append(_entry(name, spec, data_start, data_size, where))
    entries.sort(key=lambda e: (e.begin, e.end))
    for prev, cur in itertools.pairwise(entries):
        if cur.begin < prev.end:
            raise CheckpointFormatError(
                f"{where}: tensors {prev.name!r} and {cur.name!r} overlap (bytes {prev.begin}-{prev.end} "
                f"and {cur.begin}-{cur.end})"
            )
    return entries, metadata


def _entry(name: str, spec: Any, data_start: int, data_size: int, where: str) -> TensorEntry:
    if not isinstance(spec, dict) or set(spec) != _ENTRY_KEYS:
        raise CheckpointFormatError(f"{where}: tensor {name!r} must be an object of exactly {sorted(_ENTRY_KEYS)}")
    dtype, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise CheckpointFormatError(f"{where}: tensor {name!r} has unknown dtype {str(dtype)[:32]!r}")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_is_int(d) and d >= 0 for d in shape):
        raise CheckpointFormatError(f"{where}: tensor {name!r}: shape must be at most {MAX_DIMS} non-negative ints")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets):
        raise CheckpointFormatError(f"{where}: tensor {name!r}: data_offsets must be two ints")
    begin, end = offsets
    if not 0 <= begin <= end <= data_size:
        raise CheckpointFormatError(
            f"{where}: tensor {name!r}: data_offsets [{begin}, {end}] lie outside the object's {data_size} data bytes"
        )
    if any(d == 0 for d in shape):
        expected = 0
    elif sum(d.bit_length() for d in shape) > 2 * data_size.bit_length() + 8:  # prod would dwarf the object
        expected = -1
    else:
        expected = math.prod(shape) * DTYPE_SIZES[dtype]
    if expected != end - begin:
        raise CheckpointFormatError(
            f"{where}: tensor {name!r}: {dtype} of shape {shape[:8]} does not take the "
            f"{end - begin} bytes its data_offsets give"
        )
    return TensorEntry(name, dtype, tuple(shape), data_start + begin, data_start + end)


def plain_file_name_problem(name: Any) -> str | None:
    """Why ``name`` is not a plain ``*.safetensors`` file name of the index's prefix, or None."""
    if not isinstance(name, str):
        return "not a string"
    if "/" in name or "\\" in name or "\x00" in name or name.startswith(".") or ".." in name:
        return "not a plain file name"
    if not name.endswith(".safetensors") or name == ".safetensors":
        return "not a .safetensors file"
    return None


def parse_index(raw: bytes | bytearray | memoryview, where: str) -> dict[str, str]:
    """The ``weight_map`` of ``model.safetensors.index.json`` bytes ``raw``: tensor name → shard file name."""
    index = _load_json(raw, where, "the index")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointFormatError(f"{where}: has no weight_map (an object mapping tensor names to files)")
    for name, file in weight_map.items():
        problem = plain_file_name_problem(file)
        if problem is not None:
            raise CheckpointFormatError(
                f"{where}: weight_map maps {name!r} to {str(file)[:200]!r}: {problem} (a shard must be a "
                "*.safetensors file directly under the index's prefix)"
            )
    if len(set(weight_map.values())) > MAX_SHARDS:  # every value is a str by now
        raise CheckpointFormatError(f"{where}: names more than {MAX_SHARDS} shard files")
    return weight_map


#: ``__metadata__`` key of torch's ``HuggingFaceStorageWriter``: each tensor's offset in the full tensor
#: (``{"name": {"saved_offsets": [...]}}``, as a JSON string); all zeros where the file holds whole tensors.
DCP_SHARDING_KEY = "DCP_SHARDING_INFO"


def check_whole_tensors(metadata: Mapping[str, str], where: str) -> None:
    """Refuse an object that torch's writer marks as holding pieces of tensors (``save_distributed=True``
    without consolidation: the pieces of one tensor lie in several files); whole tensors pass."""
    text = metadata.get(DCP_SHARDING_KEY)
    if text is None:
        return
    info = _load_json(text.encode(), where, DCP_SHARDING_KEY)
    for name, entry in info.items():
        offsets = entry.get("saved_offsets") if isinstance(entry, dict) else None
        if not isinstance(offsets, list) or not all(_is_int(o) for o in offsets):
            raise CheckpointFormatError(f"{where}: {DCP_SHARDING_KEY} of {name!r} has no saved_offsets list")
        if any(offsets):
            raise CheckpointFormatError(
                f"{where}: holds a piece of {name!r} at offsets {offsets[:8]} ({DCP_SHARDING_KEY}), not whole "
                "tensors: torch's per-rank shards are not read; load a consolidated export"
            )


def build_header(
    tensors: list[tuple[str, str, tuple[int, ...]]], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, list[tuple[int, int]]]:
    """The first bytes of a safetensors object holding ``tensors`` (name, dtype as the format names it,
    shape) packed in this order: the 8-byte length prefix and the JSON header, padded with spaces to a
    multiple of 8 bytes as ``safetensors`` pads it (so the data starts aligned); and each tensor's bytes
    ``[begin, end)`` in the object (end exclusive, the header included). What :func:`parse_header` reads back."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    at = 0
    offsets: list[tuple[int, int]] = []
    for name, dtype, shape in tensors:
        if name == "__metadata__" or name in header:
            raise CheckpointFormatError(f"tensor name {name!r} cannot be stored twice or as the header's metadata")
        nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + nbytes]}
        offsets.append((at, at + nbytes))
        at += nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)
    if len(raw) > MAX_HEADER_BYTES:
        raise CheckpointFormatError(
            f"a safetensors header of {len(raw)} bytes ({len(tensors)} tensors); readers accept at most "
            f"{MAX_HEADER_BYTES}: use a smaller max_shard_size"
        )
    start = PREFIX_BYTES + len(raw)
    return len(raw).to_bytes(PREFIX_BYTES, "little") + raw, [(start + b, start + e) for b, e in offsets]


def build_index(weight_map: Mapping[str, str], total_size: int, export_id: str | None = None) -> bytes:
    """``model.safetensors.index.json`` bytes as ``save_pretrained`` writes them: ``metadata.total_size``
    (the tensors' bytes) and ``weight_map`` (tensor name → shard file), sorted by name; ``export_id``, if given,
    as ``metadata[EXPORT_KEY]``."""
    metadata: dict[str, Any] = {"total_size": total_size}
    if export_id is not None:
        metadata[EXPORT_KEY] = export_id
    body = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
    return (json.dumps(body, indent=2, ensure_ascii=False) + "\n").encode()


#: Key of the id of a dcp_s3 export, in the index's ``metadata`` and every shard's ``__metadata__``: shard
#: names are fixed by the format, so an export racing to the same prefix could replace a shard after this
#: export's index was committed; a reader that finds a shard of another id refuses the export.
EXPORT_KEY = "dcp_s3_export_id"


def index_export_id(raw: bytes | bytearray | memoryview, where: str) -> str | None:
    """The export id the index ``raw`` (already accepted by :func:`parse_index`) records, if any."""
    metadata = _load_json(raw, where, "the index").get("metadata")
    value = metadata.get(EXPORT_KEY) if isinstance(metadata, dict) else None
    if value is not None and not isinstance(value, str):
        raise CheckpointFormatError(f"{where}: metadata.{EXPORT_KEY} must be a string")
    return value


def check_export_id(shard_metadata: Mapping[str, str], export_id: str | None, where: str, index: str) -> None:
    """Refuse a shard whose ``__metadata__`` names another export than its index (or none, where the index
    names one)."""
    if export_id is not None and shard_metadata.get(EXPORT_KEY) != export_id:
        raise CheckpointFormatError(
            f"{where}: belongs to another export than {index} (export id {str(shard_metadata.get(EXPORT_KEY))[:40]!r}"
            f", index {export_id!r}): an export racing to the same prefix replaced it; export again"
        )
