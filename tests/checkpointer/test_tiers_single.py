"""Two tiers in one process: retention in each tier, a promotion that keeps failing, the requests of a restart."""

from __future__ import annotations

import threading
import warnings
from pathlib import Path

import pytest
from counting_proxy import CountingProxy, reset
from fault_proxy import FaultProxy, Rule
from test_checkpointer import build, train

from dcp_s3._checkpointer import Checkpointer
from dcp_s3._checkpointer.generations import find_complete
from dcp_s3._dcp import Store, open_store
from dcp_s3._local_server import LocalS3Server
from dcp_s3.errors import ConfigError

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def test_retention_in_each_tier(bucket: str, tmp_path: Path) -> None:
    root, local = f"s3://{bucket}/run", str(tmp_path / "local")
    model, optim, sched = build(seed=0, shard=False)
    ckpt = Checkpointer(root, local_root=local, s3_every=20, keep_last=1, keep_last_local=2)
    for it in (10, 20, 30, 40, 50, 60, 70):
        train(model, optim, sched, seed=it)
        ckpt.save({"m": model}, {"m": optim}, {"m": sched}, iteration=it)
    ckpt.wait_promotions()
    local_steps = [s.name for s in find_complete(open_store(f"{local}/rank00000"), None)]
    assert local_steps == ["0000060", "0000070"], local_steps
    assert [s.name for s in find_complete(open_store(root), None)] == ["0000060"]
    status = {s["step"]: s for s in ckpt.tier_status()}
    assert status["0000060"]["tiers"] == ["local", "s3"] and status["0000060"]["promotion"] == "done"
    assert status["0000040"]["tiers"] == [] and status["0000070"]["tiers"] == ["local"]
    assert status["0000060"]["lag"] > 0
    # The newest step of either tier loads: 70, from the local tier.
    model2, optim2, sched2 = build(seed=1, shard=False)
    assert Checkpointer(root, local_root=local).load({"m": model2}, {"m": optim2}, {"m": sched2}) == 70
    ckpt.close()


def test_failing_promotion_warns_and_is_queryable(
    bucket: str, s3_env: LocalS3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, local = f"s3://{bucket}/run", str(tmp_path / "local")
    model, optim, sched = build(seed=0, shard=False)
    # Every upload to S3 is refused (501: not retried by the client), so each promotion attempt fails.
    with FaultProxy(
        s3_env.endpoint_url, [Rule(ops={"PutObject", "CreateMultipartUpload", "UploadPart"}, fault="501")]
    ) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        ckpt = Checkpointer(root, local_root=local, promotion_attempts=2)
        ckpt.save({"m": model}, {"m": optim}, {"m": sched}, iteration=5, tier="s3")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ckpt.wait_promotions()
        refused = proxy.injected()
    messages = [str(w.message) for w in caught if "promotion of step 0000005" in str(w.message)]
    assert len(messages) == 1 and "after 2 attempts" in messages[0] and bucket in messages[0], messages
    assert refused >= 2  # tried again before giving up
    (row,) = ckpt.tier_status()
    assert row["promotion"] == "failed" and row["tiers"] == ["local"] and row["error"], row
    # The step stays loadable from the local tier.
    model2, optim2, _ = build(seed=1, shard=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert Checkpointer(root, local_root=local).load({"m": model2}, {"m": optim2}) == 5
    ckpt.close()


def test_bad_arguments(tmp_path: Path) -> None:
    root = str(tmp_path / "s3-stand-in")
    with pytest.raises(ConfigError, match="s3_every"):
        Checkpointer(root, local_root=tmp_path / "l", s3_every=0)
    with pytest.raises(ConfigError, match="async_save"):
        Checkpointer(root, local_root=tmp_path / "l", async_save=True)
    model, optim, _ = build(seed=0, shard=False)
    with pytest.raises(ConfigError, match="tier="):
        Checkpointer(root, local_root=tmp_path / "l").save({"m": model}, iteration=1, tier="disk")
    with pytest.raises(ConfigError, match="needs local_root"):
        Checkpointer(root).save({"m": model}, iteration=1, tier="s3")


def test_local_retention_keeps_a_step_being_promoted(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, local = f"s3://{bucket}/run", str(tmp_path / "local")
    go = threading.Event()
    stream_to = Store.stream_to

    def held(self: Store, *args: object) -> None:
        assert go.wait(120), "never released"  # a hang guard
        stream_to(self, *args)

    monkeypatch.setattr(Store, "stream_to", held)
    model, optim, sched = build(seed=0, shard=False)
    ckpt = Checkpointer(root, local_root=local, keep_last_local=1)
    mine = open_store(f"{local}/rank00000")
    ckpt.save({"m": model}, {"m": optim}, {"m": sched}, iteration=10, tier="s3")  # its upload is held
    for it in (20, 30):
        train(model, optim, sched, seed=it)
        ckpt.save({"m": model}, {"m": optim}, {"m": sched}, iteration=it)
    assert [s.name for s in find_complete(mine, None)] == ["0000010", "0000030"]  # 10: still being promoted
    go.set()
    ckpt.wait_promotions()
    assert [s.name for s in find_complete(open_store(root), None)] == ["0000010"]
    assert [s.name for s in find_complete(mine, None)] == ["0000030"]  # promoted: now retention's
    ckpt.close()


def test_tiered_restart_requests_do_not_grow_with_the_steps_kept(
    bucket: str, s3_env: LocalS3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restart (from the local tier, and with the local tier empty: from S3) reads S3 newest first: the
    same requests with 2 and with 6 committed S3 steps (issue 35 item 17)."""
    counted: dict[tuple[int, str], dict[str, int]] = {}
    with CountingProxy(s3_env.endpoint_url) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        for kept in (2, 6):
            root = f"s3://{bucket}/run{kept}"
            model, optim, sched = build(seed=0, shard=False)
            with Checkpointer(root, local_root=tmp_path / f"local{kept}", s3_every=1, keep_last_local=1) as ckpt:
                for it in range(1, kept + 1):
                    train(model, optim, sched, seed=it)
                    ckpt.save({"m": model}, {"m": optim}, {"m": sched}, iteration=it)
            assert len(find_complete(open_store(root), None)) == kept
            for source, local in (("local", f"local{kept}"), ("s3", f"empty{kept}")):
                model2, optim2, sched2 = build(seed=1, shard=False)
                reset(proxy.url)
                restart = Checkpointer(root, local_root=tmp_path / local)
                assert restart.load({"m": model2}, {"m": optim2}, {"m": sched2}) == kept
                assert restart.last_load["source"] == source, restart.last_load
                got = reset(proxy.url)
                counted[(kept, source)] = {op: got.requests(op) for op in sorted({op for op, _, _, _ in got.rows})}
    print(counted)
    assert counted[(2, "local")] == counted[(6, "local")], counted
    assert counted[(2, "s3")] == counted[(6, "s3")], counted
