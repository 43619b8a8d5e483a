"""A local tier's rank directory is made and named by dcp_s3: one that is a symbolic link (``rank00000 ->
elsewhere``) is hostile on every path. A save refuses it, naming it; a load (normal and resharded) reads nothing
through it; ``keep_last_local`` deletes nothing through it, and never a step the tier did not name; ``dcp-s3 ls``
reports it. Each test makes the link itself, pointing at a directory that holds a sentinel file and a genuine
local-tier step, and checks that nothing there is read, written or deleted."""

from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from test_checkpointer import build, same, snapshot, train, trainable

from dcp_s3._checkpointer import Checkpointer
from dcp_s3._checkpointer.local_root import rank_store
from dcp_s3._checkpointer.tier_reshard import shared_copies
from dcp_s3._cli import commands as cli
from dcp_s3.errors import CheckpointFormatError

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def tree(top: Path) -> dict[str, bytes]:
    """Every file below ``top`` (links not followed) with its bytes: what a test compares before and after."""
    out = {}
    for dirpath, _, files in os.walk(top):
        for f in files:
            path = Path(dirpath, f)
            out[str(path.relative_to(top))] = b"<link>" if path.is_symlink() else path.read_bytes()
    return out


def elsewhere_with_steps(tmp_path: Path, iterations: tuple[int, ...], seed: int = 5) -> tuple[Path, dict]:
    """A directory outside any local root holding a sentinel and genuine local-tier steps (rank 0's directory
    of another root, moved there), and the state of the last one saved."""
    other = tmp_path / "other-local"
    model, optim, sched = build(seed=seed, shard=False)
    with Checkpointer(str(tmp_path / "other-root"), local_root=other) as ckpt:
        for it in iterations:
            train(model, optim, sched, seed=it)
            ckpt.save({"m": model}, {"m": optim}, iteration=it, tier="local")
    target = tmp_path / "elsewhere"
    shutil.move(other / "rank00000", target)
    (target / "sentinel").write_text("not dcp_s3's")
    return target, snapshot(model, optim)


def test_a_save_refuses_a_linked_rank_dir(tmp_path: Path) -> None:
    target, _ = elsewhere_with_steps(tmp_path, (10,))
    local = tmp_path / "local"
    local.mkdir()
    os.symlink(target, local / "rank00000")
    before = tree(target)
    model, optim, _ = build(seed=0, shard=False)
    with (
        Checkpointer(str(tmp_path / "root"), local_root=local, keep_last_local=1) as ckpt,
        pytest.raises(CheckpointFormatError, match=re.escape(str(local / "rank00000")) + ".* symbolic link"),
    ):
        ckpt.save({"m": model}, {"m": optim}, iteration=20, tier="local")
    assert tree(target) == before  # nothing written there, nothing deleted (keep_last_local=1)


def test_a_load_reads_nothing_through_a_linked_rank_dir(bucket: str, tmp_path: Path) -> None:
    """Step 20 through the link (a genuine local copy) is newer than step 10 on S3: the load takes S3's."""
    target, linked = elsewhere_with_steps(tmp_path, (20,))
    root, local = f"s3://{bucket}/links", tmp_path / "local"
    model, optim, _ = build(seed=1, shard=False)
    with Checkpointer(root) as plain:
        plain.save({"m": model}, {"m": optim}, iteration=10)
    on_s3 = snapshot(model, optim)
    local.mkdir()
    os.symlink(target, local / "rank00000")
    before = tree(target)

    model2, optim2, _ = build(seed=2, shard=False)
    ckpt = Checkpointer(root, local_root=local)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ckpt.load({"m": model2}, {"m": optim2}) == 10
    ckpt.close()
    got = snapshot(model2, optim2)
    same(trainable(on_s3["model"]), trainable(got["model"]))
    assert not torch.equal(linked["model"]["inp.weight"], got["model"]["inp.weight"])
    assert "symbolic link" in ckpt.last_load["local_refused"], ckpt.last_load
    assert any("rank00000 is a symbolic link" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert tree(target) == before


def test_keep_last_local_deletes_nothing_through_a_linked_rank_dir(tmp_path: Path) -> None:
    target, _ = elsewhere_with_steps(tmp_path, (10, 20, 30))
    local = tmp_path / "local"
    local.mkdir()
    os.symlink(target, local / "rank00000")
    before = tree(target)
    with Checkpointer(str(tmp_path / "root"), local_root=local, keep_last_local=1) as ckpt:
        ckpt._tiers._retain_local(keep=None)  # what the end of every save and promotion runs
    assert tree(target) == before


def test_keep_last_local_deletes_only_steps_the_tier_named(tmp_path: Path) -> None:
    """Checkpoints in a rank directory under other names (``best``, ``10``) are not the tier's: never deleted."""
    local = tmp_path / "local"
    model, optim, sched = build(seed=0, shard=False)
    with Checkpointer(str(tmp_path / "root"), local_root=local) as ckpt:
        ckpt.save({"m": model}, {"m": optim}, iteration=10, tier="local")
    rank0 = local / "rank00000"
    for name in ("best", "10"):  # committed checkpoints of the same layout, named by someone else
        for p in rank0.glob("0000010.*"):
            dst = rank0 / p.name.replace("0000010", name, 1)
            shutil.copytree(p, dst) if p.is_dir() else shutil.copy2(p, dst)
    theirs = {k: v for k, v in tree(rank0).items() if not k.startswith("0000")}
    with Checkpointer(str(tmp_path / "root"), local_root=local, keep_last_local=1) as ckpt:
        for it in (20, 30):
            train(model, optim, sched, seed=it)
            ckpt.save({"m": model}, {"m": optim}, iteration=it, tier="local")
    after = tree(rank0)
    assert {k: v for k, v in after.items() if not k.startswith("0000")} == theirs
    assert sorted({k.split(".")[0] for k in after if k.startswith("0000")}) == ["0000030"], sorted(after)


def test_links_inside_a_rank_dir_are_not_followed(tmp_path: Path) -> None:
    """A step's marker and part directory that are links (to a genuine copy elsewhere): the load takes the older
    real step, retention deletes nothing through them, a save of that step refuses."""
    target, _ = elsewhere_with_steps(tmp_path, (20,))
    local = tmp_path / "local"
    model, optim, _ = build(seed=0, shard=False)
    with Checkpointer(str(tmp_path / "root"), local_root=local) as ckpt:
        ckpt.save({"m": model}, {"m": optim}, iteration=10, tier="local")
    real = snapshot(model, optim)
    rank0 = local / "rank00000"
    for p in target.glob("0000020*"):
        os.symlink(p, rank0 / p.name)
    before = tree(target)

    model2, optim2, _ = build(seed=2, shard=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Checkpointer(str(tmp_path / "root"), local_root=local, keep_last_local=1) as ckpt:
            assert ckpt.load({"m": model2}, {"m": optim2}) == 10
            ckpt._tiers._retain_local(keep=None)
            with pytest.raises(CheckpointFormatError, match="symbolic link"):
                ckpt.save({"m": model2}, {"m": optim2}, iteration=20, tier="local")
    same(trainable(real["model"]), trainable(snapshot(model2)["model"]))
    assert tree(target) == before


def test_a_rank_store_never_reads_through_its_rank_dir(tmp_path: Path) -> None:
    """The store of a rank directory is rooted at the local root: even one opened before the link was swapped
    in reads and lists nothing through it."""
    target, _ = elsewhere_with_steps(tmp_path, (10,))
    local = tmp_path / "local"
    (local / "rank00000").mkdir(parents=True)
    store = rank_store(str(local), 0)
    assert store.list_objects() == []
    (local / "rank00000").rmdir()
    os.symlink(target, local / "rank00000")
    assert store.list_objects() == [] and store.list_dir("") == ([], [])
    with pytest.raises(CheckpointFormatError, match="symbolic link"):
        store.read("0000010.pth")
    with pytest.raises(CheckpointFormatError, match="symbolic link"):
        store.write("x", b"x")
    assert not (target / "x").exists()


def test_the_resharded_path_and_ls_report_a_linked_rank_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Rank 1's copy of a 2-rank step sits behind a link: the step is not combined, and both the load's reason
    and ``dcp-s3 ls`` say the link is why."""
    local = tmp_path / "local"
    model, optim, _ = build(seed=0, shard=False)
    with Checkpointer(str(tmp_path / "root"), local_root=local) as ckpt:
        ckpt.save({"m": model}, {"m": optim}, iteration=10, tier="local")
    for r in (0, 1):  # as a 2-rank job of one save would have written them
        src = local / "rank00000" if r == 0 else tmp_path / "elsewhere"
        if r == 1:
            shutil.copytree(local / "rank00000", src)
        marker = src / "0000010.pth"
        content = torch.load(marker, weights_only=True)
        content["local_tier"] = {**content["local_tier"], "rank": r, "world_size": 2}
        torch.save(content, marker)
    (tmp_path / "elsewhere" / "sentinel").write_text("x")
    os.symlink(tmp_path / "elsewhere", local / "rank00001")
    before = tree(tmp_path / "elsewhere")

    shared, why = shared_copies(str(local))
    assert "0000010" not in shared and "rank00001 is a symbolic link" in why["0000010"], why

    code = cli.main(["ls", str(local)])
    out, err = capsys.readouterr()
    assert code == 0 and "Traceback" not in err, (out, err)
    assert re.search(r"rank 1 not read: .*rank00001 is a symbolic link", out + err), out + err
    assert "0000010: saved by 2 ranks, the copies of ranks [1] are not there" in out + err, out + err

    # A root whose only rank entry is a link is still listed as a local root: reported, nothing read.
    (local / "rank00000").rename(tmp_path / "rank0-moved")
    code = cli.main(["ls", str(local)])
    out, err = capsys.readouterr()
    assert code == 0 and "rank 1 not read" in out + err and "0 steps in the local tier" in out, (out, err)
    assert tree(tmp_path / "elsewhere") == before


def linked_rank_job(rank: int, world: int, env: dict[str, str], root: str, base: str) -> dict[str, Any]:
    os.environ.update(env)
    local = f"{base}/local"  # one local root for both ranks (one node's disk)
    model, optim, sched = build(seed=1)
    with Checkpointer(root, local_root=local) as ckpt:
        train(model, optim, sched, seed=10)
        ckpt.save({"m": model}, {"m": optim}, iteration=10, tier="s3")  # local, and promoted
        ckpt.wait_promotions()
    ref = snapshot(model, optim)
    dist.barrier()
    elsewhere = Path(base, "elsewhere")
    if rank == 1:  # rank 1's genuine directory moved out, a link in its place
        shutil.move(f"{local}/rank00001", elsewhere)
        (elsewhere / "sentinel").write_text("not dcp_s3's")
        os.symlink(elsewhere, f"{local}/rank00001")
    dist.barrier()
    before = tree(elsewhere)
    out: dict[str, Any] = {}
    model2, optim2, _ = build(seed=99)
    ckpt = Checkpointer(root, local_root=local)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out["iteration"] = ckpt.load({"m": model2}, {"m": optim2})
    got = snapshot(model2, optim2)
    same(trainable(ref["model"]), trainable(got["model"]))
    same(ref["optim"], got["optim"])
    out["last_load"] = {k: ckpt.last_load.get(k) for k in ("source", "s3_ranks", "reasons", "local_refused")}
    try:
        ckpt.save({"m": model2}, {"m": optim2}, iteration=20, tier="local")
        out["save"] = "saved"
    except CheckpointFormatError as exc:
        out["save"] = str(exc)
    ckpt.close()
    dist.barrier()
    out["untouched"] = tree(elsewhere) == before
    return out


@pytest.mark.multiproc
def test_a_linked_rank_dir_on_2_ranks(bucket: str, s3_env: Any, tmp_path: Path) -> None:
    """Rank 1's directory is a link (to its own genuine copy): rank 1 reads S3 for that step, rank 0 its local
    copy, every rank agrees; rank 1's next save refuses, naming the link; nothing there is touched."""
    r0, r1 = run_ranks(linked_rank_job, 2, s3_env.env(), f"s3://{bucket}/run", str(tmp_path))
    assert r0["iteration"] == r1["iteration"] == 10
    assert r1["last_load"]["s3_ranks"] == [1] and r0["last_load"]["s3_ranks"] == [1], r1["last_load"]
    assert "rank00001 is a symbolic link" in r1["last_load"]["reasons"][1], r1["last_load"]
    assert "rank00001 is a symbolic link" in r1["last_load"]["local_refused"] and not r0["last_load"]["local_refused"]
    assert r0["save"] == "saved" and "rank00001 is a symbolic link" in r1["save"], (r0["save"], r1["save"])
    assert r1["untouched"]
