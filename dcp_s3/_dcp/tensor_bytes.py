"""How one tensor becomes bytes in a data object, streamed without whole-tensor copies (and, for a
read into a tensor that cannot take them in place, how they come back: :class:`StagedRows`).

A tensor item is exactly what ``torch.save(tensor)`` writes (so stock
``FileSystemReader`` loads it), but produced in three pieces: the small zip
header that ``torch.save`` writes under ``skip_data``, the tensor's raw bytes
taken straight from its memory (CUDA tensors in bounded chunks), and the zip
trailer. The header length is the payload offset the reader uses to fetch raw
bytes directly into the destination tensor.
"""

from __future__ import annotations

import io
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, cast

import torch
from torch.distributed.checkpoint.planner import ReadItem

from dcp_s3._dcp.staging import DeviceStaging, Event, device_chunks
from dcp_s3._torch_compat import TORCH_VERSION
from dcp_s3.errors import TorchCompatibilityError

__all__ = ["TensorBlob", "tensor_blob", "raw_bytes_view", "streamable", "compact", "payload_chunks", "StagedRows"]

#: Largest device-to-host copy made at once for non-CPU tensors.
DEVICE_COPY_CHUNK = 64 << 20


class _Recorder(io.RawIOBase):
    """A seekable sink that records ``torch.save``'s writes and the hole it skips."""

    def __init__(self) -> None:
        self.pos = 0
        self.writes: list[tuple[int, bytes]] = []

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, b: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        data = bytes(b)
        self.writes.append((self.pos, data))
        self.pos += len(data)
        return len(data)

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == io.SEEK_SET else self.pos + offset if whence == io.SEEK_CUR else -1
        if self.pos < 0:
            raise io.UnsupportedOperation("seek from end")
        return self.pos


@dataclass(frozen=True)
class TensorBlob:
    """``header + payload + trailer`` is the ``torch.save`` file of ``tensor``."""

    header: bytes
    tensor: torch.Tensor  # contiguous; its raw bytes are the payload
    trailer: bytes
    borrowed: bool = False  # the payload is the caller's CPU memory itself (no copy was made)

    @property
    def payload_offset(self) -> int:
        return len(self.header)

    @property
    def length(self) -> int:
        return len(self.header) + self.tensor.nbytes + len(self.trailer)

    def payload_chunks(self, staging: DeviceStaging | None = None) -> Iterator[memoryview]:
        """The raw bytes, as views of CPU memory (device tensors: bounded host copies, through
        ``staging``'s pinned buffers when given: each view is then valid until the next is asked for)."""
        return payload_chunks(self.tensor, staging)


def compact(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself if its storage holds exactly its bytes in order, else a compact copy."""
    tensor = tensor.detach()
    if not tensor.is_contiguous():
        return tensor.contiguous()
    if tensor.untyped_storage().nbytes() != tensor.nbytes:  # a view into a larger storage
        return tensor.clone()
    return tensor


def payload_chunks(tensor: torch.Tensor, staging: DeviceStaging | None = None) -> Iterator[memoryview]:
    """The raw bytes of a compact tensor as views of CPU memory.

    A CPU tensor yields one view of its own memory (no copy); a device tensor is
    copied to the host in chunks of at most ``DEVICE_COPY_CHUNK`` bytes — with ``staging``,
    through its pinned buffers on its side stream (``staging.device_chunks``: a view is valid
    only until the next is asked for), or as fresh pageable copies where it has none to give.
    """
    if tensor.nbytes == 0:
        return
    flat = tensor.reshape(-1).view(torch.uint8)
    staged = device_chunks(flat, staging.pool, staging.stream) if staging is not None else None
    if staged is not None:  # only CUDA tensors are given a staging (``Stagings.get``)
        yield from staged
        return
    if tensor.device.type == "cpu":
        yield raw_bytes_view(tensor)
        return
    for start in range(0, flat.numel(), DEVICE_COPY_CHUNK):
        host = flat[start : start + DEVICE_COPY_CHUNK].to("cpu")
        yield host.numpy().data


def streamable(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a plain dense tensor whose bytes ``tensor_blob`` can stream."""
    return (
        tensor.layout == torch.strided
        and not tensor.is_quantized
        and not tensor.is_nested
        and tensor.device.type != "meta"
    )


def raw_bytes_view(tensor: torch.Tensor) -> memoryview:
    """A byte view of a contiguous CPU tensor's memory (any dtype, bf16 included)."""
    if tensor.nbytes == 0:
        return memoryview(b"")
    return tensor.reshape(-1).view(torch.uint8).numpy().data


def tensor_blob(tensor: torch.Tensor) -> TensorBlob:
    """Split ``torch.save(tensor)`` into header, payload (the tensor) and trailer."""
    # torch.save writes the whole storage; a view or strided tensor becomes a compact copy.
    given = tensor
    tensor = compact(tensor)
    borrowed = tensor.device.type == "cpu" and tensor.data_ptr() == given.data_ptr() and tensor.nbytes == given.nbytes
    key = _frame_key(tensor)
    frame = _FRAMES.get(key) if key is not None else None
    if frame is None:
        frame = _save_frame(tensor)
        if key is not None:
            if len(_FRAMES) >= _MAX_FRAMES:
                _FRAMES.clear()
            _FRAMES[key] = frame
    return TensorBlob(frame[0], tensor, frame[1], borrowed)


#: Header and trailer of ``torch.save`` by what they depend on (``_frame_key``): a checkpoint's
#: tensors share few shapes, and pickling each one cost 0.2 ms (0.2 s of CPU per GB of a 615-tensor state).
_FRAMES: dict[tuple[object, ...], tuple[bytes, bytes]] = {}
_MAX_FRAMES = 4096


def _frame_key(tensor: torch.Tensor) -> tuple[object, ...] | None:
    """What ``torch.save``'s header and trailer of a compact, detached tensor depend on, or None where
    that is not known (a subclass, Python attributes): its dtype, shape, device, conjugate and negative
    bits, and torch's save settings. Strides, storage offset and size follow from the shape (compact)."""
    if type(tensor) is not torch.Tensor or tensor.requires_grad or getattr(tensor, "__dict__", None):
        return None
    config = getattr(getattr(getattr(torch.utils, "serialization", None), "config", None), "save", None)
    settings = tuple(getattr(config, name, None) for name in ("compute_crc32", "storage_alignment"))
    return (tensor.dtype, tuple(tensor.shape), str(tensor.device), tensor.is_conj(), tensor.is_neg(), settings)


def _save_frame(tensor: torch.Tensor) -> tuple[bytes, bytes]:
    """``torch.save(tensor)`` under ``skip_data``: the bytes before and after the storage record."""
    recorder = _Recorder()
    with torch.serialization.skip_data():
        torch.save(tensor, cast(IO[bytes], recorder))
    writes = sorted(recorder.writes)
    # torch.save writes its records in order and seeks once, over the storage bytes.
    gaps = [(pos + len(data), nxt) for (pos, data), (nxt, _) in itertools.pairwise(writes) if pos + len(data) != nxt]
    if not gaps and tensor.nbytes == 0:
        return b"".join(d for _, d in writes), b""
    if len(gaps) != 1 or gaps[0][1] - gaps[0][0] != tensor.nbytes:
        raise TorchCompatibilityError(
            f"torch {TORCH_VERSION}: unexpected torch.save layout: storage bytes are not one contiguous record"
        )
    hole_start = gaps[0][0]
    header = b"".join(d for pos, d in writes if pos < hole_start)
    trailer = b"".join(d for pos, d in writes if pos > hole_start)
    return header, trailer


class StagedRows:
    """Rows ``[r, r + n)`` of a read into a tensor the reader cannot fill in place (another device, dtype
    or layout): staged in a bounded CPU buffer, then narrowed, cast and copied into ``dest``.

    With ``staging`` (a CUDA ``dest``) the buffer is a pinned one from its pool and the copy is queued on
    its side stream; the buffer goes back to the pool with the copy's event, and the reader waits for
    every such copy (``DeviceStaging.pool.drain``) before DCP sees the tensor. Without a free pinned
    buffer, or without ``staging``, a pageable buffer and a blocking ``copy_``, as before."""

    def __init__(
        self,
        dest: torch.Tensor,
        sizes: torch.Size,
        dtype: torch.dtype,
        req: ReadItem,
        r: int,
        n: int,
        staging: DeviceStaging | None = None,
    ) -> None:
        self.dest, self.sizes, self.dtype, self.req, self.r, self.n = dest, sizes, dtype, req, r, n
        self.staging = staging
        self.buf: torch.Tensor | None = None
        self.pinned: list[torch.Tensor] = []

    def open(self) -> memoryview:
        shape = (self.n, *self.sizes[1:]) if len(self.sizes) else ()
        nbytes = math.prod(shape) * self.dtype.itemsize
        self.pinned = self.staging.pool.take(1, nbytes) if self.staging is not None and nbytes else []
        if self.pinned:
            self.buf = self.pinned[0][:nbytes].view(self.dtype).view(shape)
        else:
            self.buf = torch.empty(shape, dtype=self.dtype)
        return raw_bytes_view(self.buf)

    def done(self) -> None:
        assert self.buf is not None
        src = self.buf
        dest = self.dest
        event: Event | None = None
        try:
            if len(self.sizes):
                for dim in range(1, len(self.sizes)):
                    src = src.narrow(dim, self.req.storage_offsets[dim], self.req.lengths[dim])
                dest = dest.narrow(0, self.r, self.n)
            if self.pinned:
                assert self.staging is not None
                event = self.staging.stream.copy(dest, src)
            else:
                dest.copy_(src)
        finally:  # the pinned buffer goes back even when the copy raised: else the pool shrinks for good
            self.release(event)  # reused once the copy (if queued) has read it

    def release(self, event: Event | None = None) -> None:
        """Give the pinned buffer back (if still held) and drop the staging memory now, not when the plan ends;
        also for a piece whose read failed before ``done`` (the reader calls it once every read has ended)."""
        pinned, self.pinned = self.pinned, []
        self.buf = None
        if pinned:
            assert self.staging is not None
            self.staging.pool.give_back(pinned, event)
