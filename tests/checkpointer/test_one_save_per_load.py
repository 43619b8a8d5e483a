"""One save per load: every load path of the Checkpointer, given two saves of one step, returns one save.

Each test crafts a situation where the parts of a step exist as two different saves (a re-save kept
local while S3 holds the promoted one, two jobs racing a first save, copies of a rerun) and checks that
a load returns tensors bit-exact equal to ONE of them, or refuses the step and says why in
``last_load``. Real gloo ranks, real SeaweedFS, real processes racing.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from test_checkpointer import build, same, snapshot, train, trainable
from test_tiers import damage, local_objects

from dcp_s3._checkpointer import Checkpointer
from dcp_s3._local_server import LocalS3Server
from tests.checkpointer import resave_child
from tests.checkpointer.test_checkpointer_atomic import Child
from tests.checkpointer.test_checkpointer_atomic import which as old_or_new

pytestmark = [pytest.mark.multiproc]


def fresh_load(root: str, local: str) -> tuple[int, dict[str, Any], dict[str, Any], list[str]]:
    model, optim, sched = build(seed=99)
    ckpt = Checkpointer(root, local_root=local)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        it = ckpt.load({"m": model}, {"m": optim}, {"m": sched})
    ckpt.close()
    return it, snapshot(model, optim), ckpt.last_load, [str(w.message) for w in caught]


def is_save(ref: dict[str, Any], got: dict[str, Any]) -> bool:
    try:
        same(trainable(ref["model"]), trainable(got["model"]))
        same(ref["optim"], got["optim"])
    except AssertionError:
        return False
    return True


def which(got: dict[str, Any], saves: dict[str, dict[str, Any]]) -> str:
    """The name of the save ``got`` is bit-exact equal to, or ``"mixed"``."""
    return next((name for name, ref in saves.items() if is_save(ref, got)), "mixed")


def resaved_local_job(rank: int, world: int, env: dict[str, str], root: str, base: str) -> dict[str, Any]:
    """Issue 35 item 1: step 100 saved and promoted (save A), re-saved to the local tier only (save B),
    then one rank's local copy damaged (truncated: found by the check; corrupt: found by the load)."""
    os.environ.update(env)
    local = f"{base}/node{rank}"
    model, optim, sched = build(seed=1)
    ckpt = Checkpointer(root, local_root=local)
    train(model, optim, sched, seed=1)
    ckpt.save({"m": model}, {"m": optim}, {"m": sched}, iteration=100, tier="s3")
    ckpt.wait_promotions()
    saves = {"A": snapshot(model, optim)}
    train(model, optim, sched, seed=2)
    ckpt.save({"m": model}, {"m": optim}, {"m": sched}, iteration=100, tier="local")
    saves["B"] = snapshot(model, optim)
    # A newer step that rank 1 then loses (never on S3): skipped, and last_load must say why.
    train(model, optim, sched, seed=3)
    ckpt.save({"m": model}, {"m": optim}, {"m": sched}, iteration=110, tier="local")
    ckpt.close()
    dist.barrier()
    if rank == 1:
        for p in (Path(local) / "rank00001").glob("0000110*"):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    dist.barrier()
    out: dict[str, Any] = {}
    for how, part in (("truncated", "optim"), ("corrupt", "model")):
        dist.barrier()
        if rank == 1:
            (obj,) = local_objects(local, rank, part, "0000100")
            original = obj.read_bytes()
            damage(obj, how)
        dist.barrier()
        it, got, where, warned = fresh_load(root, local)
        out[how] = {
            "it": it,
            "save": which(got, saves),
            "source": where["source"],
            "reasons": where["reasons"],
            "skipped": where.get("skipped", {}),
            "warned": warned,
        }
        dist.barrier()
        if rank == 1:
            obj.write_bytes(original)
    return out


def test_tiered_load_never_combines_two_saves_of_one_step(bucket: str, s3_env: LocalS3Server, tmp_path: Path) -> None:
    out = run_ranks(resaved_local_job, 2, s3_env.env(), f"s3://{bucket}/run", str(tmp_path), timeout=400)
    for r, res in enumerate(out):
        for how in ("truncated", "corrupt"):
            got = res[how]
            # Every rank's tensors are of one save: S3's (A), read by every rank, since rank 0's local
            # copy is of save B and rank 1's is damaged.
            assert got["it"] == 100 and got["save"] == "A", (r, how, got)
            assert got["source"] == "s3", (r, how, got)
            # Why, short, naming the real rank and cause (issue 35 item 16).
            reasons = got["reasons"]
            assert set(reasons) == {0, 1}, reasons
            assert "S3 holds save" in reasons[0], reasons
            assert all(len(v) < 500 and "Traceback" not in v and "RANK" not in v for v in reasons.values()), reasons
            # The skipped newer step has its reason too.
            assert "ranks [0] only" in got["skipped"].get("0000110", ""), got["skipped"]
    truncated, corrupt = out[0]["truncated"]["reasons"][1], out[0]["corrupt"]["reasons"][1]
    assert "truncated" in truncated, truncated
    assert "failed to load" in corrupt and "checksum" in corrupt.lower(), corrupt


def reasons_job(rank: int, world: int, env: dict[str, str], root: str, base: str) -> dict[str, Any]:
    """Step 100 promoted (one save in both tiers), step 110 local only and lost by rank 1, rank 1's copy
    of 100 corrupt (found by the load's checksum): a legitimate mixed load of 100."""
    os.environ.update(env)
    local = Path(base) / f"node{rank}"
    model, optim, sched = build(seed=1)
    ckpt = Checkpointer(root, local_root=local)
    train(model, optim, sched, seed=1)
    ckpt.save({"m": model}, {"m": optim}, {"m": sched}, iteration=100, tier="s3")
    ckpt.wait_promotions()
    saves = {"A": snapshot(model, optim)}
    train(model, optim, sched, seed=3)
    ckpt.save({"m": model}, {"m": optim}, {"m": sched}, iteration=110, tier="local")
    ckpt.close()
    dist.barrier()
    if rank == 1:
        for p in (local / "rank00001").glob("0000110*"):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        (obj,) = local_objects(str(local), rank, "model", "0000100")
        damage(obj, "corrupt")
    dist.barrier()
    it, got, where, _ = fresh_load(root, str(local))
    return {"it": it, "save": which(got, saves), "last_load": where}


def test_last_load_reasons_are_short_and_every_skipped_step_has_one(
    bucket: str, s3_env: LocalS3Server, tmp_path: Path
) -> None:
    """Issue 35 item 16: the reason of a rank that read S3 is one short line naming that rank's real cause
    (not torch's 1.6 KB ``CheckpointException`` text saying "RANK 0"), and the skipped newer step has one."""
    out = run_ranks(reasons_job, 2, s3_env.env(), f"s3://{bucket}/run", str(tmp_path), timeout=400)
    for res in out:
        where = res["last_load"]
        assert res["it"] == 100 and res["save"] == "A" and where["source"] == "mixed", res
        (why,) = where["reasons"].values()
        assert list(where["reasons"]) == [1] and len(why) < 500, where
        assert "checksum" in why.lower() and "RANK" not in why and "Traceback" not in why, why
        assert "ranks [0] only" in where["skipped"]["0000110"], where


def rank_copies_job(rank: int, world: int, env: dict[str, str], root: str, base: str) -> dict[str, Any]:
    """Step 100: save A promoted, save B kept local; then rank 1's local copy is put back to save A's (a
    node restored from a backup): rank 0 holds B, rank 1 holds A, S3 holds A."""
    os.environ.update(env)
    local = Path(base) / f"node{rank}"
    model, optim, sched = build(seed=1)
    ckpt = Checkpointer(root, local_root=local)
    train(model, optim, sched, seed=1)
    ckpt.save({"m": model}, {"m": optim}, {"m": sched}, iteration=100, tier="s3")
    ckpt.wait_promotions()
    saves = {"A": snapshot(model, optim)}
    shutil.copytree(local / f"rank{rank:05d}", Path(base) / "backup-A" / f"node{rank}")
    train(model, optim, sched, seed=2)
    ckpt.save({"m": model}, {"m": optim}, {"m": sched}, iteration=100, tier="local")
    saves["B"] = snapshot(model, optim)
    ckpt.close()
    dist.barrier()
    if rank == 1:
        shutil.rmtree(local / "rank00001")
        shutil.copytree(Path(base) / "backup-A" / "node1", local / "rank00001")
    dist.barrier()
    it, got, where, _ = fresh_load(root, str(local))
    if rank == 0:
        torch.save(saves, f"{base}/saves.pt")
    return {
        "it": it,
        "save": which(got, saves),
        "source": where["source"],
        "s3_ranks": where["s3_ranks"],
        "reasons": where["reasons"],
    }


def resharded_job(rank: int, world: int, env: dict[str, str], root: str, base: str) -> dict[str, Any]:
    os.environ.update(env)
    it, got, where, _ = fresh_load(root, f"{base}/shared")
    return {"it": it, "save": which(got, torch.load(f"{base}/saves.pt", weights_only=True)), "source": where["source"]}


def test_copies_of_two_saves_are_combined_only_where_tokens_agree(
    bucket: str, s3_env: LocalS3Server, tmp_path: Path
) -> None:
    """The mixed load with proven tokens: rank 1's copy (save A, the save S3 holds) is used, rank 0's
    (save B) is not: rank 0 reads S3. The resharded load over those two copies (rank00000 of save B,
    rank00001 of save A under one root) never merges them: the step comes from S3, whole."""
    root = f"s3://{bucket}/run"
    out = run_ranks(rank_copies_job, 2, s3_env.env(), root, str(tmp_path), timeout=400)
    for res in out:
        assert res["it"] == 100 and res["save"] == "A", res
        assert res["source"] == "mixed" and res["s3_ranks"] == [0], res
        assert "S3 holds save" in res["reasons"][0], res
    shared = tmp_path / "shared"
    for r in (0, 1):
        shutil.copytree(tmp_path / f"node{r}" / f"rank{r:05d}", shared / f"rank{r:05d}")
    (got,) = run_ranks(resharded_job, 1, s3_env.env(), root, str(tmp_path), timeout=300)
    assert got == {"it": 100, "save": "A", "source": "s3"}, got


# -- first saves: two jobs racing the first save of one step -------------------------------------------------
@pytest.mark.parametrize("where", ["s3", "local-tier"])
def test_racing_first_saves_commit_exactly_one_save(
    where: str, bucket: str, s3_env: LocalS3Server, tmp_path: Path
) -> None:
    """Issue 35 item 7: job X begins the first save of step 1000 (its model part written, held before its
    optimizer part); job Y saves step 1000 from start to end; X goes on. The step is Y's save, every part
    of it; X fails naming the step."""
    env = s3_env.env()
    if where == "s3":
        root, local, extra = f"s3://{bucket}/run", None, []
    else:  # both jobs on one local-tier root (the S3 root a directory: nothing is promoted)
        root, local = str(tmp_path / "s3-stand-in"), str(tmp_path / "local")
        extra = [local]
    x = Child(tmp_path, "optim", "race", root, "11", *extra, env=env)
    x.wait_held()
    Child(tmp_path, "none", "race", root, "12", *extra, env=env).finish()
    code, out = x.release()
    assert code != 0 and "CheckpointExistsError" in out and "0001000" in out, out
    model, optim, sched = resave_child.build(5)
    ckpt = Checkpointer(root, local_root=local)
    it = ckpt.load({"m": model}, {"m": optim}, {"m": sched})
    got = resave_child.snapshot(model, optim, sched, it)
    refs = {seed: resave_child.snapshot(*resave_child.race_state(seed), 1000) for seed in (11, 12)}
    assert old_or_new(got, refs[11], refs[12]) == "new"  # Y's save, every part of it


def test_a_complete_unnamed_save_is_never_loaded(bucket: str, s3_env: LocalS3Server, tmp_path: Path) -> None:
    """A plain S3 load (the newest step, and ``path=``) where a step holds two complete saves' parts: job X
    killed after writing every part of its first save (before its marker), job Y's save committed. Only
    the directories Y's marker names are read."""
    env, root = s3_env.env(), f"s3://{bucket}/run"
    x = Child(tmp_path, "marker", "race", root, "11", env=env)
    x.wait_held()
    Child(tmp_path, "none", "race", root, "12", env=env).finish()
    x.kill()
    refs = {seed: resave_child.snapshot(*resave_child.race_state(seed), 1000) for seed in (11, 12)}
    for path in (None, f"{root}/0001000"):
        model, optim, sched = resave_child.build(5)
        it = Checkpointer(root).load({"m": model}, {"m": optim}, {"m": sched}, path=path)
        assert old_or_new(resave_child.snapshot(model, optim, sched, it), refs[11], refs[12]) == "new", path
