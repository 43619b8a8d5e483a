"""What a user relies on, for every place a checkpoint can live: one shared test class (zarr-style).

``StoreConformance`` holds the tests; a subclass provides the ``target`` fixture, a
:class:`Target` (:mod:`~dcp_s3.testing._targets`): a root location (``s3://bucket/prefix`` or a
local directory), the storage options that reach it, and :class:`Raw` access to its objects that
does not go through dcp_s3 (boto3 or ``os``: :class:`S3Raw`, :class:`LocalRaw`, or a class of the
backend's own), with which the tests look at what was stored and damage it the way a crash or a
bad disk would. Every test goes through the public API only: ``dcp.save`` / ``dcp.load`` with the
location's writer and reader (:meth:`Target.writer` / :meth:`Target.reader`),
:class:`~dcp_s3.Checkpointer` and :mod:`dcp_s3.admin`. Each test wants a fresh, empty root.

dcp_s3's own subclasses: ``tests/test_conformance.py`` (a local directory, SeaweedFS and moto, in
CI) and ``tests/compat/conformance_external.py`` (any S3 server named by environment variables;
run by ``tests/compat/run_servers.py``). What a server answers where more than one answer is
acceptable (``overwrite=False`` on a server without conditional writes, listing multipart
uploads) is recorded with ``record_property`` (pytest's JUnit XML) for the compatibility table.
"""

from __future__ import annotations

import io
import os
import pickle
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

from dcp_s3 import (
    Checkpointer,
    CheckpointExistsError,
    CheckpointFormatError,
    ServerCapabilityError,
)
from dcp_s3.admin import (
    collect_garbage,
    copy_checkpoint,
    find_garbage,
    list_steps,
    remove_checkpoint,
    verify_checkpoint,
)
from dcp_s3.testing._targets import Raw, Target

__all__ = ["StoreConformance"]

MiB = 1 << 20
Record = Callable[[str, object], None]


# -- data -----------------------------------------------------------------------------------------------
def state(seed: int, *, big: bool = False) -> dict[str, Any]:
    """A state dict of several dtypes, values whose bits matter (NaN payloads, -0.0) and non-tensor items."""
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, Any] = {
        "w": torch.randn(256, 64, generator=g),
        "half": torch.randn(128, 32, generator=g).to(torch.bfloat16),
        "ids": torch.randint(-(2**62), 2**62, (100,), generator=g, dtype=torch.int64),
        "special": torch.tensor([0x7FC00001, 0x80000000, 0x7F800000, 0xFF800000, 1], dtype=torch.int64)
        .to(torch.int32)
        .view(torch.float32),
        "extra": {"seed": seed, "name": f"run-{seed}"},
    }
    if big:  # one item of 6.1 MiB: more than one 5 MiB part
        sd["big"] = torch.randn(1_600_000, generator=g)
    return sd


def blank(sd: dict[str, Any]) -> dict[str, Any]:
    """A state dict of the same structure to load into: zero tensors, placeholder values."""
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {n: None for n in v} for k, v in sd.items()}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Bit-exact equality of every tensor (NaN payloads included) and equality of everything else."""
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
            assert torch.equal(bits(got[k]), bits(v)), f"{k} differs"
        else:
            assert got[k] == v, k


def failure(fn: Callable[[], object]) -> BaseException | None:
    """What ``fn`` raised (the dcp_s3 error inside DCP's ``CheckpointException``, a ``BaseException``), or None."""
    try:
        fn()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:
        failures = getattr(exc, "failures", None)
        return next(iter(failures.values()))[0] if failures else exc
    return None


def referenced(raw: Raw, checkpoint: str) -> set[str]:
    """The objects the committed ``.metadata`` of ``checkpoint`` names (relative to the target root)."""
    metadata = pickle.loads(raw.read(f"{checkpoint}/.metadata"))
    return {f"{checkpoint}/{info.relative_path}" for info in metadata.storage_data.values()}


def largest_item(raw: Raw, checkpoint: str) -> tuple[str, int, int]:
    """(object, offset, length) of the largest item of ``checkpoint``."""
    metadata = pickle.loads(raw.read(f"{checkpoint}/.metadata"))
    info = max(metadata.storage_data.values(), key=lambda i: int(i.length))
    return f"{checkpoint}/{info.relative_path}", int(info.offset), int(info.length)


def save(target: Target, sd: dict[str, Any], name: str, **writer: Any) -> None:
    dcp.save(sd, storage_writer=target.writer(name, **writer), no_dist=True)


def load(target: Target, like: dict[str, Any], name: str, **reader: Any) -> dict[str, Any]:
    out = blank(like)
    dcp.load(out, storage_reader=target.reader(name, **reader), no_dist=True)
    return out


class _Net(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _trained(seed: int) -> tuple[_Net, torch.optim.Optimizer, Any]:
    model = _Net(seed)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    model(torch.ones(2, 32)).sum().backward()
    optim.step()
    sched.step()
    return model, optim, sched


# -- the suite --------------------------------------------------------------------------------------------
class StoreConformance:
    """Subclass and define a ``target`` fixture returning a :class:`Target` with a fresh, empty root.

    The fixture may take any fixture (``tmp_path``, a server of a session-scoped fixture of the
    subclass's own conftest, ``monkeypatch`` to set credentials in the environment).
    """

    @pytest.fixture
    def target(self) -> Target:
        raise NotImplementedError(
            f"{type(self).__name__} subclasses StoreConformance: it defines the target fixture "
            "(a dcp_s3.testing.Target with a fresh, empty root)"
        )

    # -- dcp.save / dcp.load ------------------------------------------------------------------------
    def test_round_trip_is_bit_exact_with_multipart_objects(self, target: Target) -> None:
        sd = state(1, big=True)
        save(target, sd, "ck", part_size=5 * MiB if target.is_s3 else None)
        assert_same(load(target, sd, "ck"), sd)
        data = {k: v for k, v in target.raw.sizes("ck/").items() if k in referenced(target.raw, "ck")}
        # Objects larger than part_size go up as multipart uploads of several parts.
        assert max(data.values()) > 6 * MiB, data

    def test_partial_load_reads_ranges_of_objects(self, target: Target) -> None:
        sd = state(2, big=True)
        save(target, sd, "ck", part_size=5 * MiB if target.is_s3 else None)
        some = {"big": sd["big"], "half": sd["half"]}
        # Reads no larger than 2 MiB: the 6.1 MiB item arrives in several ranged reads.
        got = load(target, some, "ck", **({"max_range_size": 2 * MiB} if target.is_s3 else {}))
        assert_same(got, some)

    def test_overwrite_replaces_and_leaves_only_the_new_objects(self, target: Target) -> None:
        old, new = state(3), state(4)
        new["only_new"] = torch.arange(10)
        # The old save has objects the new one does not rewrite (two per rank on S3).
        save(target, old, "ck", **({"files_per_rank": 2} if target.is_s3 else {}))
        first = referenced(target.raw, "ck")
        save(target, new, "ck")
        assert_same(load(target, new, "ck"), new)
        objects = set(target.raw.sizes("ck/"))
        assert objects == referenced(target.raw, "ck") | {"ck/.metadata"}, objects
        assert not objects & first, "objects of the replaced checkpoint are left behind"

    def test_overwrite_false_refuses_or_says_the_server_cannot(self, target: Target, record_property: Record) -> None:
        old = state(5)
        save(target, old, "ck")
        before = set(target.raw.sizes("ck/"))
        # Over a checkpoint: refused in torch's words, before anything is written.
        error = failure(lambda: save(target, state(6), "ck", overwrite=False))
        assert isinstance(error, CheckpointExistsError), repr(error)
        assert str(error).startswith("Checkpoint already exists"), error
        assert set(target.raw.sizes("ck/")) == before
        assert_same(load(target, old, "ck"), old)
        # To an empty path: committed by a conditional PUT, or refused where the server ignores If-None-Match.
        fresh = state(7)
        error = failure(lambda: save(target, fresh, "fresh", overwrite=False))
        if error is None:
            record_property("overwrite_false", "committed")
        else:
            assert isinstance(error, ServerCapabilityError), repr(error)
            assert target.is_s3 and "If-None-Match" in str(error), error
            assert not target.raw.sizes("fresh/"), "refused, yet objects were written"
            record_property("overwrite_false", "ServerCapabilityError")
            # Opting into the best-effort check (a HEAD before the commit): saved, with a warning.
            with pytest.warns(RuntimeWarning, match="If-None-Match"):
                save(target, fresh, "fresh", overwrite=False, require_conditional_writes=False)
        assert_same(load(target, fresh, "fresh"), fresh)

    def test_verify_and_load_catch_a_flipped_byte(self, target: Target, record_property: Record) -> None:
        sd = state(8)
        save(target, sd, "ck")
        assert verify_checkpoint(target.url("ck"), **target.options).ok
        name, offset, length = largest_item(target.raw, "ck")
        data = bytearray(target.raw.read(name))
        data[offset + length // 2] ^= 0x10  # in the middle of the largest tensor's bytes
        target.raw.write(name, bytes(data))
        report = verify_checkpoint(target.url("ck"), **target.options)
        assert not report.ok
        assert [p.url for p in report.problems] == [target.url(name)], report.problems
        got: dict[str, Any] = {}
        error = failure(lambda: got.update(load(target, sd, "ck")))
        assert isinstance(error, CheckpointFormatError), f"a damaged object loaded: {error!r}"
        assert "checksum" in str(error), error
        record_property("load_of_flipped_byte", "refused")

    def test_truncated_object_is_the_same_error_everywhere(self, target: Target) -> None:
        """An object cut short (a crash mid-copy, a full disk) fails the load with CheckpointFormatError."""
        sd = state(13)
        save(target, sd, "ck")
        name, offset, length = largest_item(target.raw, "ck")
        target.raw.write(name, target.raw.read(name)[: offset + length // 2])
        error = failure(lambda: load(target, sd, "ck"))
        assert isinstance(error, CheckpointFormatError), repr(error)
        assert "shorter than the checkpoint metadata says" in str(error) and name.rsplit("/", 1)[-1] in str(error)

    # -- checkpoint manager ------------------------------------------------------------------------
    def test_checkpointer_round_trip_retention_and_delete(self, target: Target) -> None:
        root = target.url("run")
        ckpt = Checkpointer(root, keep_last=2, **target.options)
        trained = {}
        for it in (100, 200, 300, 400):
            model, optim, sched = trained[it] = _trained(it)
            ckpt.save({"model": model}, {"model": optim}, {"model": sched}, iteration=it)
        steps = list_steps(root, **target.options)
        assert [(s.name, s.complete) for s in steps] == [("0000300", True), ("0000400", True)], steps
        assert not [n for n in target.raw.sizes("run/") if n.startswith(("run/0000100", "run/0000200"))]

        model, optim, sched = _trained(7)
        assert Checkpointer(root, **target.options).load({"model": model}, {"model": optim}, {"model": sched}) == 400
        want, _, want_sched = trained[400]
        for k, v in want.state_dict().items():
            assert torch.equal(model.state_dict()[k], v), k
        assert sched.state_dict()["last_epoch"] == want_sched.state_dict()["last_epoch"]
        for p, q in zip(model.parameters(), want.parameters(), strict=True):
            assert torch.equal(optim.state[p]["exp_avg"], trained[400][1].state[q]["exp_avg"])

        # Re-saving the newest step (a job that resumed at 400 saves at 400 again) replaces it all or nothing:
        # new generation directories that the rewritten marker names; the old parts are gone.
        again, again_optim, _ = _trained(401)
        ckpt.save({"model": again}, {"model": again_optim}, iteration=400)
        assert [s.name for s in list_steps(root, **target.options)] == ["0000300", "0000400"]
        dirs = _torch_load(target.raw.read("run/0000400.pth"))["part_dirs"]
        for suffix in ("model_model", "model_optim"):
            assert not target.raw.sizes(f"run/0000400.{suffix}/")
            part = f"run/0000400.{dirs[suffix]}"
            assert set(target.raw.sizes(part + "/")) == referenced(target.raw, part) | {part + "/.metadata"}
        model = _trained(9)[0]
        assert Checkpointer(root, **target.options).load({"model": model}) == 400
        for k, v in again.state_dict().items():
            assert torch.equal(model.state_dict()[k], v), k

        removal = remove_checkpoint(target.url("run/0000400"), **target.options)
        assert removal.objects and not [n for n in target.raw.sizes("run/") if n.startswith("run/0000400")]
        assert Checkpointer(root, **target.options).load({"model": _trained(8)[0]}) == 300

    def test_compressed_round_trip(self, target: Target, record_property: Record) -> None:
        model = _Net(0)
        with torch.no_grad():  # compressible: few distinct values
            for p in model.parameters():
                p.copy_((torch.arange(p.numel()) % 7).reshape(p.shape).float())
        Checkpointer(target.url("run"), compression="zstd", **target.options).save({"model": model}, iteration=1)
        (summary,) = list_steps(target.url("run"), **target.options)
        assert summary.ratio is not None and summary.ratio > 1.5, summary
        assert verify_checkpoint(target.url("run"), **target.options).ok
        fresh = _Net(1)
        assert Checkpointer(target.url("run"), **target.options).load({"model": fresh}) == 1
        for k, v in model.state_dict().items():
            assert torch.equal(bits(fresh.state_dict()[k]), bits(v)), k
        # Loading some items of a compressed checkpoint: only their frames, in ranges of at most 2 MiB.
        sd = state(12, big=True)
        save(target, sd, "zck", compression="zstd", part_size=5 * MiB)
        some = {"big": sd["big"], "ids": sd["ids"]}
        assert_same(load(target, some, "zck", max_range_size=2 * MiB), some)
        record_property("compression", "ok")

    # -- admin ------------------------------------------------------------------------------------------
    def test_gc_removes_leftovers_and_nothing_else(self, target: Target, record_property: Record) -> None:
        old, new = state(9), state(10)
        save(target, old, "ck")
        leftovers = {n: target.raw.read(n) for n in referenced(target.raw, "ck")}
        save(target, new, "ck")
        # What crashes leave: the replaced save's objects (its saver died right after the commit),
        # and a checkpoint whose .metadata never landed, with an upload never finished.
        for name, data in leftovers.items():
            target.raw.write(name, data)
            target.raw.write("dead/" + name.rpartition("/")[2], data)
        upload = f"dead/__7_0.{uuid.uuid4().hex[:16]}.distcp"
        started = target.raw.start_upload(upload)
        target.raw.write("ck/notes.md", b"mine")
        before = set(target.raw.sizes())

        garbage = find_garbage(target.root, older_than=0, now=time.time() + 120, **target.options)
        expected = set(leftovers) | {"dead/" + n.rpartition("/")[2] for n in leftovers}
        assert {o.name for o in garbage.objects} == expected
        listed = target.raw.uploads()
        if started is None:
            assert not garbage.uploads
        elif listed is None:
            record_property("gc_uploads", "not listable")
            assert not garbage.uploads
        else:
            record_property("gc_uploads", "aborted")
            assert [u.name for u in garbage.uploads] == [upload]
        objects, aborted = collect_garbage(garbage)
        assert (objects, aborted) == (len(expected), len(garbage.uploads))
        assert set(target.raw.sizes()) == before - expected
        if listed is not None:
            assert target.raw.uploads() == []
        assert "ck/notes.md" in target.raw.sizes("ck/")
        assert_same(load(target, new, "ck"), new)
        assert verify_checkpoint(target.url("ck"), **target.options).ok

    def test_copy_to_a_local_directory_and_back(self, target: Target, tmp_path: Path) -> None:
        sd = state(11)
        save(target, sd, "ck")
        local = tmp_path / f"copy-{uuid.uuid4().hex[:8]}"
        report = copy_checkpoint(target.url("ck"), os.fspath(local), src_options=target.options)
        assert report.objects == len(target.raw.sizes("ck/"))
        # A local copy is in torch's own format: its stock reader loads it.
        got = blank(sd)
        dcp.load(got, storage_reader=FileSystemReader(local), no_dist=True)
        assert_same(got, sd)
        copy_checkpoint(os.fspath(local), target.url("back"), dst_options=target.options)
        assert_same(load(target, sd, "back"), sd)
        assert verify_checkpoint(target.url("back"), **target.options).ok
        with pytest.raises(CheckpointExistsError):
            copy_checkpoint(os.fspath(local), target.url("back"), dst_options=target.options)


def _torch_load(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)
