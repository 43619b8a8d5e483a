"""A Checkpointer step re-saved all or nothing: killed at any phase, the next load is entirely old or new.

The Getting started loop (docs/getting-started.md) (resume at 1000, train, save at 1000 again) runs in a child process
(``tests/resave_child.py``) held at a phase of the save and SIGKILLed there; a fresh process then
loads, and model, optimizer and scheduler state are compared bit-exact with the old save and
with the new one. Local directories for every phase, the session's SeaweedFS for some.
"""

from __future__ import annotations

import io
import re
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from dcp_s3._checkpointer import Checkpointer, latest_checkpoint
from dcp_s3._checkpointer.generations import find_complete
from dcp_s3._checkpointer.retention import retain_last
from dcp_s3._cli import commands as cli
from dcp_s3._dcp import open_store
from dcp_s3._local_server import LocalS3Server
from dcp_s3.admin._cleanup import collect_garbage, find_garbage
from dcp_s3.admin._listing import list_steps
from dcp_s3.admin._verify import verify_checkpoint
from dcp_s3.errors import CheckpointFormatError
from tests.checkpointer.resave_child import build, first_state, snapshot, train_a_bit
from tests.held_child import HeldChild

CHILD = str(Path(__file__).with_name("resave_child.py"))
GENERATION = r"[0-9a-f]{16}"

# The commit protocol is dcp_s3's, the same on every torch: only what depends on torch's own save paths (async_save,
# FSDP2 state dicts) is in the torch-range subset.
pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


class Child(HeldChild):
    """``resave_child.py`` in another process, held at ``phase`` until released or killed."""

    def __init__(self, tmp: Path, phase: str, *args: str, env: dict[str, str] | None = None) -> None:
        super().__init__(CHILD, tmp, phase, *args, env={**(env or {}), "PYTHONWARNINGS": "ignore"})

    def finish(self) -> None:
        code, out = self.release()
        assert code == 0, out


def load_in_fresh_process(tmp: Path, root: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    out = tmp / f"snapshot-{time.monotonic_ns()}.pt"
    Child(tmp, "none", "load", root, str(out), env=env).finish()
    return torch.load(out, weights_only=True)


def load_here(root: str) -> dict[str, Any]:
    model, optim, sched = build(5)
    it = Checkpointer(root).load({"m": model}, {"m": optim}, {"m": sched})
    return snapshot(model, optim, sched, it)


def same(a: Any, b: Any) -> bool:
    """Bit-exact equality of nested dicts/lists of tensors and plain values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def which(got: dict[str, Any], old: dict[str, Any], new: dict[str, Any]) -> str:
    """ "old" or "new" if every part of ``got`` is that save's; else which part came from where."""
    assert not same(old, new)
    for name, ref in (("old", old), ("new", new)):
        if same(got, ref):
            return name
    parts = {k: "old" if same(got[k], old[k]) else "new" if same(got[k], new[k]) else "neither" for k in got}
    return f"mixed: {parts}"


@pytest.fixture(scope="module")
def saves(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The state the first save stores, and the one the child's re-save stores (computed here the same way)."""
    root = str(tmp_path_factory.mktemp("reference"))
    model, optim, sched = first_state()
    Checkpointer(root).save({"m": model}, {"m": optim}, {"m": sched}, iteration=1000)
    old = snapshot(model, optim, sched, 1000)
    model, optim, sched = build(5)
    assert Checkpointer(root).load({"m": model}, {"m": optim}, {"m": sched}) == 1000
    train_a_bit(model, optim, sched, seed=2)
    return {"old": old, "new": snapshot(model, optim, sched, 1000)}


def first_save(root: str) -> None:
    model, optim, sched = first_state()
    Checkpointer(root).save({"m": model}, {"m": optim}, {"m": sched}, iteration=1000)


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir())


PHASES = [("model", "old"), ("optim", "old"), ("marker", "old"), ("marker-written", "new"), ("cleanup", "new")]


# -- SIGKILL at every phase of a re-save --------------------------------------------------------------------
@pytest.mark.parametrize(("phase", "expected"), PHASES)
def test_killed_resave_loads_entirely_old_or_entirely_new(
    tmp_path: Path, saves: dict[str, dict[str, Any]], phase: str, expected: str
) -> None:
    run = tmp_path / "run"
    first_save(str(run))
    before = files(run)
    child = Child(tmp_path, phase, "resave", str(run))
    child.wait_held()
    child.kill()
    if expected == "old":  # nothing of the step in use was touched: every file of the first save as it was
        now = files(run)
        assert {k: now.get(k) for k in before} == before
    got = load_in_fresh_process(tmp_path, str(run))
    assert which(got, saves["old"], saves["new"]) == expected
    # What the killed save left (a generation its marker does not name, or the old parts) is gc's.
    # (A local write's temporary file, killed before its rename, is not a checkpoint object: gc keeps it.)
    garbage = find_garbage(str(run), older_than=0)
    assert (garbage.objects or phase == "model") and not garbage.skipped
    collect_garbage(garbage)
    [step] = list_steps(str(run))
    assert step.complete and not step.unreadable and step.parts == ["m_model", "m_optim"]
    left = {k: v for k, v in files(run).items() if "/.tmp-" not in k}
    if expected == "old":
        assert left == before
    else:
        assert all(k.startswith(("0001000.m_model.", "0001000.m_optim.", "0001000.pth")) for k in left), left
    assert which(load_here(str(run)), saves["old"], saves["new"]) == expected
    if expected == "old":  # and the re-save, run again, goes through
        Child(tmp_path, "none", "resave", str(run)).finish()
        assert which(load_here(str(run)), saves["old"], saves["new"]) == "new"


@pytest.mark.parametrize(("phase", "expected"), [("optim", "old"), ("cleanup", "new")])
def test_killed_resave_on_s3_loads_entirely_old_or_entirely_new(
    bucket: str, s3_env: LocalS3Server, tmp_path: Path, saves: dict[str, dict[str, Any]], phase: str, expected: str
) -> None:
    root, env = f"s3://{bucket}/run", s3_env.env()
    first_save(root)
    child = Child(tmp_path, phase, "resave", root, env=env)
    child.wait_held()
    child.kill()
    assert which(load_in_fresh_process(tmp_path, root, env=env), saves["old"], saves["new"]) == expected
    assert latest_checkpoint(root) == f"{root}/0001000"
    # Both the step in use and what the kill left are listed; gc removes only the leftover.
    client = s3_env.client()

    def keys() -> set[str]:
        return {o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="run/").get("Contents", [])}

    garbage = find_garbage(root, older_than=0)
    assert garbage.objects and not garbage.skipped
    leftover = {f"run/{o.name}" for o in garbage.objects}
    collect_garbage(garbage)
    assert not keys() & leftover
    assert which(load_here(root), saves["old"], saves["new"]) == expected


@pytest.mark.torch_range
def test_killed_async_resave_loads_old(tmp_path: Path, saves: dict[str, dict[str, Any]]) -> None:
    run = tmp_path / "run"
    first_save(str(run))
    child = Child(tmp_path, "marker", "resave", str(run), "1")  # every part uploaded, the marker not written
    child.wait_held()
    child.kill()
    assert which(load_in_fresh_process(tmp_path, str(run)), saves["old"], saves["new"]) == "old"
    Child(tmp_path, "none", "resave", str(run), "1").finish()
    assert which(load_here(str(run)), saves["old"], saves["new"]) == "new"


# -- the layout of re-saves -----------------------------------------------------------------------------
def test_every_save_writes_its_generation_resaves_replace_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    model, optim, sched = first_state()
    ckpt = Checkpointer(run)
    generations = []
    for i in range(3):  # a first save, a re-save, then a re-save of the re-save
        if i:
            with torch.no_grad():
                model[0].weight.add_(1)
        ckpt.save({"m": model}, {"m": optim}, {"m": sched}, iteration=1000)
        marker = torch.load(run / "0001000.pth", weights_only=True)
        token = marker["part_dirs"]["m_model"].rpartition(".")[2]
        assert marker["part_dirs"] == {"m_model": f"m_model.{token}", "m_optim": f"m_optim.{token}"}
        assert dirs(run) == [f"0001000.m_model.{token}", f"0001000.m_optim.{token}"]  # the old parts are gone
        generations.append(token)
    assert len(set(generations)) == 3
    # Each part is a stock DCP checkpoint: torch's own reader loads it as it is on disk.
    state = {"0.weight": torch.zeros_like(model[0].weight)}
    dcp.load(state, storage_reader=FileSystemReader(str(run / f"0001000.m_model.{generations[2]}")), no_dist=True)
    assert torch.equal(state["0.weight"], model[0].weight)
    other, *_ = build(9)
    assert Checkpointer(run).load({"m": other}) == 1000
    assert torch.equal(other[0].weight, model[0].weight)
    [summary] = list_steps(str(run))
    assert summary.complete and summary.parts == ["m_model", "m_optim"] and summary.logical_bytes
    assert verify_checkpoint(str(run)).ok
    assert find_complete(open_store(str(run)))[0].parts["m_model"].name == f"0001000.m_model.{generations[2]}"
    capsys.readouterr()
    assert cli.main(["ls", str(run)]) == 0 and cli.main(["verify", str(run)]) == 0
    out = capsys.readouterr().out
    assert "0001000  complete" in out and "(1 complete, 0 incomplete)" in out and "OK: 1 checkpoint," in out


def test_retention_and_gc_remove_every_generation(tmp_path: Path) -> None:
    run = tmp_path / "run"
    model, optim, _ = first_state()
    ckpt = Checkpointer(run)
    for it in (1, 1, 2):
        ckpt.save({"m": model}, {"m": optim}, iteration=it)
    orphan = run / "0000001.m_model.0123456789abcdef"  # a killed re-save's generation, not named by the marker
    orphan.mkdir()
    (orphan / "__0_0.distcp").write_bytes(b"x" * 10)
    (orphan / "notes.md").write_text("mine")
    garbage = find_garbage(str(run), older_than=0)
    assert {o.name for o in garbage.objects} == {"0000001.m_model.0123456789abcdef/__0_0.distcp"}
    assert [e.name for e in garbage.kept] == ["0000001.m_model.0123456789abcdef/notes.md"]
    assert not find_garbage(str(run), older_than=3600).objects  # the age bound protects a save in progress
    assert retain_last(open_store(str(run)), 1, keep=str(run / "0000002")) == [str(run / "0000001")]
    left = sorted(re.sub(rf"^(0000002\..*)\.{GENERATION}$", r"\1.<token>", p.name) for p in run.iterdir())
    assert left == [
        "0000001.m_model.0123456789abcdef",
        "0000002.m_model.<token>",
        "0000002.m_optim.<token>",
        "0000002.pth",
    ]
    assert [p.name for p in orphan.iterdir()] == ["notes.md"]  # not a checkpoint object: kept


# -- a hostile marker ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "bad", ["../0000001.m_model", "m_model/../../x", "m_model.zz", "m_model.0123456789abcdeF", {"m_model": "m_model"}]
)
def test_marker_naming_other_directories_is_refused_and_nothing_outside_is_deleted(tmp_path: Path, bad: Any) -> None:
    run = tmp_path / "run"
    model, optim, _ = first_state()
    ckpt = Checkpointer(run)
    ckpt.save({"m": model}, {"m": optim}, iteration=1)
    ckpt.save({"m": model}, {"m": optim}, iteration=2)
    ckpt.save({"m": model}, {"m": optim}, iteration=2)  # step 2 is re-saved: it has generations
    marker = torch.load(run / "0000002.pth", weights_only=True)
    marker["part_dirs"] = bad if isinstance(bad, dict) else dict(marker["part_dirs"], m_model=bad)
    buf = io.BytesIO()
    torch.save(marker, buf)
    (run / "0000002.pth").write_bytes(buf.getvalue())
    before = files(run)
    with pytest.raises(CheckpointFormatError, match="part_dirs"):
        Checkpointer(run).load({"m": build(3)[0]}, path=str(run / "0000002"))
    assert latest_checkpoint(run) == str(run / "0000001")  # the hostile step is not complete
    garbage = find_garbage(str(run), older_than=0)
    assert not garbage.objects and "marker cannot be followed" in garbage.skipped[0][1]
    [one, two] = list_steps(str(run))
    assert one.complete and two.unreadable and "part_dirs" in two.error
    assert not verify_checkpoint(str(run / "0000002")).ok
    # A re-save over it writes a new generation and deletes nothing the hostile marker named.
    ckpt.save({"m": model}, {"m": optim}, iteration=2)
    now = files(run)
    assert {k: now.get(k) for k in before if not k.startswith("0000002.pth")} == {
        k: v for k, v in before.items() if not k.startswith("0000002.pth")
    }
    assert Checkpointer(run).load({"m": build(3)[0]}, path=str(run / "0000001")) == 1
    assert Checkpointer(run).load({"m": build(3)[0]}) == 2


def test_a_marker_naming_the_directories_of_two_saves_is_refused(tmp_path: Path) -> None:
    """One save per load: a marker whose ``part_dirs`` mix two saves' generation directories (each one complete,
    each named well) is refused, never loaded as one step."""
    run = tmp_path / "run"
    model, optim, _ = first_state()
    ckpt = Checkpointer(run)
    ckpt.save({"m": model}, {"m": optim}, iteration=1)
    ckpt.save({"m": model}, {"m": optim}, iteration=1)  # re-saved: generation directories
    marker = torch.load(run / "0000001.pth", weights_only=True)
    other = "m_model.0123456789abcdef"  # a complete copy: another save's model part
    shutil.copytree(run / f"0000001.{marker['part_dirs']['m_model']}", run / f"0000001.{other}")
    marker["part_dirs"]["m_model"] = other
    buf = io.BytesIO()
    torch.save(marker, buf)
    (run / "0000001.pth").write_bytes(buf.getvalue())
    with pytest.raises(CheckpointFormatError, match="part_dirs.*belongs to no save"):
        Checkpointer(run).load({"m": build(3)[0]}, path=str(run / "0000001"))
    assert latest_checkpoint(run) is None


# -- ls: a failed read is unreadable, whatever its message ------------------------------------------------
def test_ls_shows_a_failed_read_with_an_empty_message_as_unreadable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    Checkpointer(run).save({"m": build(0)[0]}, iteration=1)

    def fail(*_: Any, **__: Any) -> Any:
        raise CheckpointFormatError("")

    monkeypatch.setattr("dcp_s3.admin._listing._read_metadata", fail)
    assert cli.main(["ls", str(run)]) == 0
    out = capsys.readouterr().out
    assert "UNREADABLE" in out.splitlines()[1] and "complete" not in out.splitlines()[1]
    assert "(0 complete, 1 incomplete)" in out
    [step] = list_steps(str(run))
    assert step.unreadable and step.error == "CheckpointFormatError"


# -- 2 gloo ranks (FSDP2): every rank writes into the same generation, rank 0 commits -------------------
def resave_job(rank: int, world: int, root: str, async_save: bool) -> list[str]:
    from test_checkpointer import build as build_sharded
    from test_checkpointer import same as same_tree
    from test_checkpointer import snapshot as snapshot_sharded
    from test_checkpointer import train, trainable

    model, optim, sched = build_sharded(seed=1)
    train(model, optim, sched, seed=10)
    ckpt = Checkpointer(root, async_save=async_save)
    ckpt.save({"m": model}, {"m": optim}, {"m": sched}, iteration=1000)
    train(model, optim, sched, seed=11)
    ckpt.save({"m": model}, {"m": optim}, {"m": sched}, iteration=1000)  # the re-save
    ckpt.wait()
    ref = snapshot_sharded(model, optim)
    model2, optim2, sched2 = build_sharded(seed=2)
    assert ckpt.load({"m": model2}, {"m": optim2}, {"m": sched2}) == 1000
    got = snapshot_sharded(model2, optim2)
    same_tree(trainable(ref["model"]), trainable(got["model"]))
    same_tree(ref["optim"], got["optim"])
    assert sched2.last_epoch == 2
    ckpt.close()
    return sorted(e.name for e in open_store(root).list_objects())


@pytest.mark.multiproc
@pytest.mark.torch_range
@pytest.mark.parametrize("async_save", [False, True])
def test_resave_on_2_fsdp2_ranks(tmp_path: Path, async_save: bool) -> None:
    from dist_utils import run_ranks

    names = run_ranks(resave_job, 2, str(tmp_path / "run"), async_save)[0]
    dirs = {n.split("/")[0] for n in names if "/" in n}
    assert len(dirs) == 2 and all(re.fullmatch(rf"0001000\.m_(model|optim)\.{GENERATION}", d) for d in dirs), dirs
    assert {d.rpartition(".")[2] for d in dirs} == {
        torch.load(tmp_path / "run" / "0001000.pth", weights_only=True)["part_dirs"]["m_model"][8:]
    }
    # both ranks' data objects are in it
    ranks = {m[1] for n in names if (m := re.fullmatch(rf"0001000\.m_model\.{GENERATION}/__(\d+)_.*\.distcp", n))}
    assert ranks == {"0", "1"}, names


def test_finding_steps_reads_markers_newest_first_and_copies_keep_their_meaning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dcp_s3._dcp import store as store_module
    from dcp_s3.admin import copy_checkpoint

    run = tmp_path / "run"
    model, optim, _ = first_state()
    ckpt = Checkpointer(run)
    for it in (1, 2, 2, 3):  # step 2 re-saved
        ckpt.save({"m": model}, {"m": optim}, iteration=it)
    reads: list[str] = []
    read = store_module.Store.read

    def counting_read(self: Any, name: str) -> bytes:
        reads.append(name)
        return read(self, name)

    monkeypatch.setattr(store_module.Store, "read", counting_read)
    assert [s.name for s in find_complete(open_store(str(run)))] == ["0000003"]
    assert reads == ["0000003.pth"]  # the newest step's marker names its generation: one GET, no more
    assert [s.name for s in find_complete(open_store(str(run)), None)] == ["0000001", "0000002", "0000003"]
    assert reads == ["0000003.pth", "0000003.pth", "0000002.pth", "0000001.pth"]
    monkeypatch.undo()
    # A copy of the re-saved step under another name loads: part_dirs are relative to the step.
    copy_checkpoint(str(run / "0000002"), str(tmp_path / "copy" / "0000009"))
    other, other_optim, _ = build(4)
    assert Checkpointer(tmp_path / "copy").load({"m": other}, {"m": other_optim}) == 2
    assert torch.equal(other[0].weight, model[0].weight)
    assert verify_checkpoint(str(tmp_path / "copy")).ok


def test_resave_without_the_optimizer_drops_its_part(tmp_path: Path) -> None:
    from dcp_s3.errors import CheckpointNotFoundError

    run = tmp_path / "run"
    model, optim, _ = first_state()
    Checkpointer(run).save({"m": model}, {"m": optim}, iteration=5)
    Checkpointer(run).save({"m": model}, iteration=5)  # re-saved without the optimizer
    assert [d.rpartition(".")[0] for d in dirs(run)] == ["0000005.m_model"]  # the old optimizer part went too
    other, other_optim, _ = build(4)
    with pytest.raises(CheckpointNotFoundError, match=r"optimizer checkpoint .*0000005\.m_optim is missing"):
        Checkpointer(run).load({"m": other}, {"m": other_optim})
    with pytest.warns(RuntimeWarning, match="m_optim is missing"):
        assert Checkpointer(run).load({"m": other}, {"m": other_optim}, allow_missing_optim=True) == 5
    assert torch.equal(other[0].weight, model[0].weight) and not other_optim.state
