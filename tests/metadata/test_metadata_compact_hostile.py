"""Crafted compact ``.metadata`` from a hostile bucket: every lie is a ``CheckpointFormatError``
naming the object, found in bounded time and memory (at decode, or when the entry is used)."""

from __future__ import annotations

import dataclasses
import json
import struct
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from dcp_s3._metadata.compact import MAGIC
from dcp_s3._metadata.formats import dump_metadata, load_metadata
from dcp_s3.errors import CheckpointFormatError
from tests.metadata.test_metadata_compact import hand_built

pytestmark = pytest.mark.torch_range  # also run on the lowest and the highest supported torch (.ci/run)

WHERE = "s3://bucket/run/.metadata"


def split(blob: bytes) -> tuple[dict[str, Any], bytes]:
    (n,) = struct.unpack_from("<Q", blob, len(MAGIC))
    start = len(MAGIC) + 8
    return json.loads(blob[start : start + n]), blob[start + n + (-n % 8) :]


def join(header: Any, arrays: bytes, raw_header: bytes | None = None) -> bytes:
    head = raw_header if raw_header is not None else json.dumps(header).encode()
    return MAGIC + struct.pack("<Q", len(head)) + head + b"\0" * (-len(head) % 8) + arrays


def genuine() -> tuple[dict[str, Any], bytes]:
    return split(dump_metadata(hand_built(), "compact"))


def refused(data: bytes, match: str | None = None) -> CheckpointFormatError:
    with pytest.raises(CheckpointFormatError, match=match) as info:
        md = load_metadata(data, WHERE)
        dict(md.storage_data.items())  # lazily checked entries: built (and checked) here
    assert str(info.value).startswith(WHERE), info.value
    return info.value


def entry(header: dict[str, Any], fqn: str) -> dict[str, Any]:
    return next(e for e in header["entries"] if e["fqn"] == fqn)


def test_genuine_parses() -> None:
    header, arrays = genuine()
    md = load_metadata(join(header, arrays), WHERE)
    assert md == hand_built()


def test_truncated_at_every_point_is_refused() -> None:
    blob = dump_metadata(hand_built(), "compact")
    for cut in [*range(0, 40), *range(40, len(blob), max(1, len(blob) // 97))]:
        refused(blob[:cut])


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b"\xff\xfe",
        b"[" * 200_000 + b"]" * 200_000,
        b'{"format": "dcp_s3.compact"}',
        json.dumps({"format": "dcp_s3.compact", "version": 99}).encode(),
        b"[]",
        b'"x"',
    ],
)
def test_header_not_describing_metadata(raw: bytes) -> None:
    _, arrays = genuine()
    refused(join(None, arrays, raw))


def test_header_length_lies() -> None:
    header, arrays = genuine()
    blob = join(header, arrays)
    for length in (1 << 63, len(blob), 1 << 40, 3):
        refused(blob[: len(MAGIC)] + struct.pack("<Q", length) + blob[len(MAGIC) + 8 :])


def mutation(fn: Callable[[dict[str, Any]], None]) -> Callable[[], bytes]:
    def make() -> bytes:
        header, arrays = genuine()
        fn(header)
        return join(header, arrays)

    return make


def _array(name: str, i: int, value: Any) -> Callable[[dict[str, Any]], None]:
    def fn(h: dict[str, Any]) -> None:
        h["arrays"][name][i] = value

    return fn


def _entry(fqn: str, key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def fn(h: dict[str, Any]) -> None:
        if value is None:
            del entry(h, fqn)[key]
        else:
            entry(h, fqn)[key] = value

    return fn


def _column(name: str, spec: Any, section: str = "storage") -> Callable[[dict[str, Any]], None]:
    def fn(h: dict[str, Any]) -> None:
        (h["storage"] if section == "storage" else h["storage"]["frames"])["columns"][name] = spec

    return fn


CASES: dict[str, Callable[[dict[str, Any]], None]] = {
    # arrays that lie about their size, place or type
    "count past the end": _array("chunk_offsets", 2, 1 << 40),
    "offset past the end": _array("chunk_sizes", 1, 1 << 30),
    "negative offset": _array("chunk_sizes", 1, -8),
    "float dtype": _array("chunk_offsets", 0, "<f8"),
    "object dtype": _array("chunk_offsets", 0, "|O"),
    "count is a bool": _array("chunk_offsets", 2, True),
    "fewer chunk values than used": _array("chunk_offsets", 2, 3),
    "entry without chunks": _entry("w", "rule", None),
    # state-dict entries
    "duplicate fqn": lambda h: h["entries"].append(dict(entry(h, "w"))),
    "fqn not a string": _entry("w", "fqn", 7),
    "unknown dtype": _entry("w", "dtype", "float1024"),
    "dtype via attribute path": _entry("w", "dtype", "nn.Module"),
    "unknown layout": _entry("w", "layout", "os"),
    "requires_grad not bool": _entry("w", "requires_grad", 1),
    "strides for too few dims": _entry("w", "strides", [4]),
    "negative stride": _entry("w", "strides", [-4, 1]),
    "stride not an int": _entry("w", "strides", ["4", 1]),
    "strides not a list": _entry("w", "strides", 4),
    "huge dim": _entry("w", "size", [1 << 70, 4]),
    "negative dim": _entry("w", "size", [-10, 4]),
    "too many dims": _entry("scalar", "size", [1] * 100),
    "rule dim out of range": _entry("w", "rule", {"dim": 5, "n": 4}),
    "rule n zero": _entry("w", "rule", {"dim": 0, "n": 0}),
    "rule n a string": _entry("w", "rule", {"dim": 0, "n": "4"}),
    "rule chunks too large": _entry("w", "size", [1 << 62, 1 << 10]),
    "whole rule on a matrix": _entry("w", "rule", {"dim": -1, "n": 1}),
    "explicit chunk count lies": _entry("grid", "chunks", 40),
    "stored count lies": _entry("w", "stored", 9),
    "stored count negative": _entry("partial", "stored", -1),
    "stored a word": _entry("w", "stored", "some"),
    "bytes stored twice": _entry("bytes", "bytes", 2),
    # storage section
    "storage count lies": lambda h: h["storage"].__setitem__("count", h["storage"]["count"] + 1),
    "object escapes": lambda h: h["storage"]["objects"].__setitem__(0, "../../other/__0_0.distcp"),
    "absolute object": lambda h: h["storage"]["objects"].__setitem__(0, "/etc/passwd"),
    "url object": lambda h: h["storage"]["objects"].__setitem__(0, "s3://x/y"),
    "object not a string": lambda h: h["storage"]["objects"].__setitem__(0, ["a"]),
    "object index past table": _column("object", {"c": 99}),
    "negative object index": _column("object", {"a": [-1, 1]}),
    "transform index past table": _column("transform", {"c": 5}),
    "frame index past table": _column("frame", {"c": 3}),
    "kind unknown": _column("kind", {"c": 2}),
    "crc too large": _column("crc", {"c": 1 << 33}),
    "length too small": _column("length", {"c": 1}),
    "offset + length overflow": _column("offset", {"c": (1 << 63) - 2}),
    "hint negative": _column("hint", {"c": -5}),
    "column unknown encoding": _column("length", {"z": 1}),
    "column two encodings": _column("length", {"c": 1, "a": [1, 1]}),
    "column missing": _column("length", None),
    "runs do not add up": _column("length", {"r": ["s.object", "s.object"]}),
    "period does not divide": _column("offset", {"m": [7, 0, 1]}),
    "step overflows": _column("offset", {"a": [0, (1 << 63) - 1]}),
    "segments do not add up": _column("object", {"s": [[{"c": 0}, 3], [{"c": 1}, 3]]}),
    "segments nest": _column("object", {"s": [[{"c": 0}, 1], [{"s": [[{"c": 0}, 1], [{"c": 0}, 100]]}, 100]]}),
    "segment head past the column": _column("object", {"s": [[{"c": 0}, 1 << 40], [{"c": 0}, 0]]}),
    "segment out of table": _column("object", {"s": [[{"c": 0}, 1], [{"c": 9}, 1]]}),
    "transform not strings": lambda h: h["storage"]["transforms"].__setitem__(0, {"L": [1]}),
    "frame count lies": _column("frames", {"c": 7}, "frames"),
    "frame codec unknown": _column("codec", {"c": 4}, "frames"),
    "frame values negative": _column("raw_length", {"c": -1}, "frames"),
    "frame raw length lies": _column("raw_length", {"c": 12}, "frames"),
    "frame crcs missing": _column("crcs", {"c": 0}, "frames"),
    # tagged values
    "planner_data nests deeply": lambda h: h.__setitem__("planner_data", _deep(300)),
    "planner_data unknown tag": lambda h: h.__setitem__("planner_data", {"X": 1}),
    "planner_data colliding int keys": lambda h: h.__setitem__(
        "planner_data", {"D": [[k * ((1 << 61) - 1), 0] for k in range(1, 50)]}
    ),
    "planner_data tuple key": lambda h: h.__setitem__("planner_data", {"D": [[{"T": [1]}, 0]]}),
    "storage_meta modules not strings": lambda h: h["storage_meta"].__setitem__("modules", {"L": [1]}),
    "version not a string": lambda h: h.__setitem__("metadata_version", 3),
    "storage missing": lambda h: h.pop("storage"),
}


def _deep(n: int) -> Any:
    value: Any = 0
    for _ in range(n):
        value = {"L": [value]}
    return value


@pytest.mark.parametrize("name", sorted(CASES))
def test_crafted_header_is_refused(name: str) -> None:
    header, arrays = genuine()
    CASES[name](header)
    refused(join(header, arrays))


def test_explicit_chunks_outside_the_tensor_and_lying_arrays() -> None:
    header, arrays = genuine()
    dtype, offset, count = header["arrays"]["chunk_offsets"]
    values = np.frombuffer(arrays, dtype=dtype, count=count, offset=offset).copy()
    for bad in (7, 5):  # row 7 of a 4-row tensor; column 5 + 3 past 6
        values[-2] = bad
        patched = bytearray(arrays)
        patched[offset : offset + values.nbytes] = values.tobytes()
        refused(join(header, bytes(patched)), "outside")
    # stored chunk numbers that repeat (two entries for one chunk) or run past the chunks
    header, arrays = genuine()
    dtype, offset, count = header["arrays"]["stored_chunks"]
    for numbers in ([1, 1], [1, 9]):
        patched = bytearray(arrays)
        patched[offset : offset + 8] = np.array(numbers, dtype=dtype).tobytes()
        refused(join(header, bytes(patched)), "stored chunk numbers")


def test_lies_found_when_an_entry_is_used_name_the_entry() -> None:
    header, arrays = genuine()
    header["storage"]["columns"]["length"] = {"c": 3}  # too short for every chunk
    md = load_metadata(join(header, arrays), WHERE)  # decoding alone does not walk every entry ...
    with pytest.raises(CheckpointFormatError, match=rf"^{WHERE}: storage entry w\[0, 0\]: "):
        md.storage_data[MetadataIndex("w", torch.Size([0, 0]))]  # ... a lookup checks the entry it builds


def test_huge_claims_cost_nothing_until_refused() -> None:
    """A rule of 2^40 chunks with constant columns: tiny bytes, refused at once (no 2^40 walk)."""
    header, arrays = genuine()
    entry(header, "w")["rule"] = {"dim": 0, "n": 1 << 40}
    entry(header, "w")["size"] = [1 << 40, 1]
    header["storage"]["count"] += (1 << 40) - 4
    for name in header["storage"]["columns"]:
        header["storage"]["columns"][name] = {"c": 0 if name != "frame" and name != "transform" else -1}
    start = time.perf_counter()
    refused(join(header, arrays), "refusing to expand")
    assert time.perf_counter() - start < 60  # a hang guard, not a benchmark


def test_strides_torch_2_15_records_round_trip_where_torch_has_them() -> None:
    """torch 2.15 records ``TensorProperties.strides``; the compact format keeps them, and a torch
    without the field reads such a file too (ignoring them, as its stock reader would)."""
    header, arrays = genuine()
    entry(header, "w")["strides"] = [4, 1]
    md = load_metadata(join(header, arrays), WHERE)
    props = md.state_dict_metadata["w"].properties
    if "strides" in {f.name for f in dataclasses.fields(props)}:
        assert props.strides == (4, 1)
        assert load_metadata(dump_metadata(md, "compact"), WHERE).state_dict_metadata["w"].properties == props
    else:
        assert not hasattr(props, "strides")
