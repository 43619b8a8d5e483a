"""Hostile inputs and tools (issue 12, classes 4-8): what a bucket's contents, a local directory, an
endpoint or a log handler can do to a user of dcp_s3 and ``dcp-s3``, against real servers."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from botocore.compat import HAS_CRT
from torch.distributed.checkpoint.api import CheckpointException

from dcp_s3 import ClientConfig, S3StorageReader, S3StorageWriter, TransferConfig
from dcp_s3 import _cli as cli
from dcp_s3._checkpointer import Checkpointer
from dcp_s3._local_server import LocalS3Server
from dcp_s3._objstore.redact import RedactSecrets
from dcp_s3._objstore.uri import parse_s3_uri
from dcp_s3.admin import (
    collect_garbage,
    convert_checkpoint,
    copy_checkpoint,
    find_garbage,
    remove_checkpoint,
)
from dcp_s3.errors import (
    CheckpointExistsError,
    CheckpointFormatError,
    ConfigError,
    DcpS3Error,
    InvalidCheckpointIdError,
)

STATE = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5)}


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def keys(client: Any, bucket: str, prefix: str = "") -> dict[str, bytes]:
    """Every object under ``prefix`` with its content."""
    found = client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return {o["Key"]: client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read() for o in found}


def tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (not following links) with its content."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = Path(dirpath, name)
            out[str(path.relative_to(root))] = b"<link>" if path.is_symlink() else path.read_bytes()
    return out


def save(uri: str, **writer_options: Any) -> None:
    dcp.save(STATE, storage_writer=S3StorageWriter(uri, **writer_options), no_dist=True)


def load(uri: str) -> dict[str, torch.Tensor]:
    state = {k: torch.zeros_like(v) for k, v in STATE.items()}
    dcp.load(state, storage_reader=S3StorageReader(uri), no_dist=True)
    return state


@pytest.fixture
def moto_env(moto_server: LocalS3Server, monkeypatch: pytest.MonkeyPatch) -> LocalS3Server:
    for name, value in moto_server.env().items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    return moto_server


# -- 4. no writes outside the target ---------------------------------------------------------------
ESCAPING = ("ck/../../escape", "ck/a/../../x", "ck/./dot", "ck//double")


@pytest.mark.parametrize("key", ESCAPING)
def test_cp_refuses_a_key_that_would_land_outside_the_target(
    moto_env: LocalS3Server, tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str
) -> None:
    """moto stores ``ck/../../escape`` verbatim; cp must neither write it outside DIR nor write anything."""
    bucket = moto_env.create_bucket(f"hostile-{uuid.uuid4().hex[:12]}")
    client = moto_env.client()
    save(f"s3://{bucket}/ck")
    client.put_object(Bucket=bucket, Key=key, Body=b"attacker")
    work = tmp_path / "work"
    target = work / "dst" / "inner"
    (work / "dst").mkdir(parents=True)
    (work / "escape").write_bytes(b"precious")  # where ck/../../escape would land from dst/inner
    (work / "dst" / "x").write_bytes(b"precious")  # where ck/a/../../x would
    before = tree(tmp_path)

    code, out, err = run(capsys, "cp", f"s3://{bucket}/ck", str(target))
    assert code == 1 and out == ""
    assert repr(key.split("/", 1)[1]) in err and "outside" in err, err
    assert tree(tmp_path) == before  # nothing written, nothing replaced, anywhere
    assert not target.exists()
    with pytest.raises(CheckpointFormatError, match="outside the target"):
        copy_checkpoint(f"s3://{bucket}/ck", str(target))
    with pytest.raises(CheckpointFormatError):  # S3 to S3 too: a normalizing server would misplace it
        copy_checkpoint(f"s3://{bucket}/ck", f"s3://{bucket}/copy")
    assert not any(k.startswith("copy") for k in keys(client, bucket))
    client.delete_object(Bucket=bucket, Key=key)
    copy_checkpoint(f"s3://{bucket}/ck", str(target))  # the clean checkpoint copies fine
    assert (target / ".metadata").is_file()
    client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys(client, bucket)]})
    client.delete_bucket(Bucket=bucket)


def _local_checkpoint(root: Path) -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    dcp.save(STATE, storage_writer=FileSystemWriter(str(root)), no_dist=True)


def test_upload_does_not_follow_symlinks_out_of_the_directory(
    bucket: str, s3_env: LocalS3Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "ckpt"
    _local_checkpoint(src)
    outside = tmp_path / "private"
    outside.mkdir()
    (outside / "id_rsa").write_bytes(b"SECRET-KEY-MATERIAL")
    (outside / "dir").mkdir()
    (outside / "dir" / "notes").write_bytes(b"SECRET-NOTES")
    client = s3_env.client()

    for link, target in (("id_rsa", outside / "id_rsa"), ("linked", outside / "dir")):
        (src / link).symlink_to(target)
        code, _, err = run(capsys, "cp", str(src), f"s3://{bucket}/up")
        assert code == 1 and str(src / link) in err and "--follow-symlinks" in err, err
        assert keys(client, bucket) == {}  # refused before anything was uploaded
        (src / link).unlink()

    (src / "alias").symlink_to(src / ".metadata")  # a link that stays inside is fine
    (src / "id_rsa").symlink_to(outside / "id_rsa")
    (src / "linked").symlink_to(outside / "dir")
    code, _, _ = run(capsys, "cp", str(src), f"s3://{bucket}/up", "--follow-symlinks")
    assert code == 0
    stored = keys(client, bucket)
    assert stored["up/id_rsa"] == b"SECRET-KEY-MATERIAL" and stored["up/linked/notes"] == b"SECRET-NOTES"
    assert stored["up/alias"] == (src / ".metadata").read_bytes()


def test_download_does_not_write_through_a_link_out_of_the_destination(
    bucket: str, s3_env: LocalS3Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save(f"s3://{bucket}/run/ck")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "ck").symlink_to(outside)
    code, _, err = run(capsys, "cp", f"s3://{bucket}/run", str(dst))
    assert code == 1 and str(dst / "ck") in err and "symbolic link" in err, err
    assert list(outside.iterdir()) == []
    # --follow-symlinks is for reading a source: writes never go through a link.
    code, _, err = run(capsys, "cp", f"s3://{bucket}/run", str(dst), "--follow-symlinks")
    assert code == 1 and str(dst / "ck") in err and "symbolic link" in err, err
    assert list(outside.iterdir()) == []


def test_convert_refuses_to_replace_an_existing_output(
    bucket: str, s3_env: LocalS3Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    uri = f"s3://{bucket}/ck"
    save(uri)
    out = tmp_path / "model.pt"
    out.write_bytes(b"the user's file")
    code, _, err = run(capsys, "convert", uri, str(out))
    assert code == 1 and str(out) in err and "--force" in err, err
    assert out.read_bytes() == b"the user's file"
    code, _, _ = run(capsys, "convert", uri, str(out), "--force")
    assert code == 0 and torch.equal(torch.load(out, weights_only=True)["w"], STATE["w"])

    client = s3_env.client()
    client.put_object(Bucket=bucket, Key="plain/notes.md", Body=b"mine")
    with pytest.raises(CheckpointExistsError, match="plain"):
        convert_checkpoint(uri, f"s3://{bucket}/plain", fmt="dcp")
    assert set(keys(client, bucket, "plain/")) == {"plain/notes.md"}
    convert_checkpoint(uri, f"s3://{bucket}/plain", fmt="dcp", overwrite=True)
    assert torch.equal(load(f"s3://{bucket}/plain")["w"], STATE["w"])
    client.put_object(Bucket=bucket, Key="file.pt", Body=b"mine")
    with pytest.raises(CheckpointExistsError):
        convert_checkpoint(uri, f"s3://{bucket}/file.pt")
    assert keys(client, bucket, "file.pt")["file.pt"] == b"mine"


# -- 5. deletes touch only what they say ------------------------------------------------------------
USER_FILES = {"config.yaml": b"lr: 0.1\n", "train.log": b"step 1 loss 2.3\n", "notes.md": b"# do not delete\n"}


def _gc_lines(out: str, verb: str) -> set[str]:
    """URLs of the objects a gc/rm output says it removes (not uploads, not steps)."""
    found = set()
    for line in out.splitlines():
        if line.startswith(verb + " s3://") or line.startswith(verb + " /"):
            found.add(line[len(verb) + 1 :].split(" (")[0])
    return found


def test_gc_removes_only_checkpoint_objects_and_lists_each_first(
    bucket: str, s3_env: LocalS3Server, capsys: pytest.CaptureFixture[str]
) -> None:
    client = s3_env.client()
    for name, body in USER_FILES.items():  # a user's files next to an orphan data object
        client.put_object(Bucket=bucket, Key=f"run/exp/{name}", Body=body)
    client.put_object(Bucket=bucket, Key="run/exp/__0_0.distcp", Body=b"orphan")
    client.put_object(Bucket=bucket, Key="run/exp/p-1f/__1_0.0123456789abcdef.distcp", Body=b"orphan")
    client.put_object(Bucket=bucket, Key="run/exp/p-1f/readme.txt", Body=b"mine")
    ckpt = Checkpointer(f"s3://{bucket}/run")
    model = torch.nn.Linear(3, 2)
    ckpt.save({"model": model}, iteration=1)

    def part_dir(step: str) -> str:  # the save's generation directory
        return next(k.rpartition("/")[0] for k in keys(client, bucket) if k.startswith(f"run/{step}.model_model."))

    one = part_dir("0000001")
    client.put_object(Bucket=bucket, Key=f"{one}/notes.md", Body=b"about step 1")
    ckpt.save({"model": model}, iteration=2)
    client.delete_object(Bucket=bucket, Key="run/0000002.pth")  # step 2 crashed before its marker
    two = part_dir("0000002")
    client.put_object(Bucket=bucket, Key=f"{two}/eval.json", Body=b"{}")
    before = keys(client, bucket)

    code, out, _ = run(capsys, "gc", f"s3://{bucket}/run", "--older-than", "0")
    assert code == 0 and "dry run" in out
    listed = _gc_lines(out, "would remove")
    assert keys(client, bucket) == before
    expected = {f"s3://{bucket}/{k}" for k in before if k.startswith(f"{two}/") and not k.endswith("eval.json")}
    expected |= {f"s3://{bucket}/run/exp/__0_0.distcp", f"s3://{bucket}/run/exp/p-1f/__1_0.0123456789abcdef.distcp"}
    assert listed == expected, out
    for name in ("config.yaml", "train.log", "notes.md"):
        assert f"keeping s3://{bucket}/run/exp/{name} (not a checkpoint object)" in out

    code, out, _ = run(capsys, "gc", f"s3://{bucket}/run", "--older-than", "0", "--yes")
    assert code == 0 and _gc_lines(out, "removing") == expected
    after = keys(client, bucket)
    assert set(before) - set(after) == {u.split("/", 3)[3] for u in expected}  # exactly what was listed
    for name, body in USER_FILES.items():
        assert after[f"run/exp/{name}"] == body
    assert after[f"{one}/notes.md"] == b"about step 1"
    assert after[f"{two}/eval.json"] == b"{}"
    assert Checkpointer(f"s3://{bucket}/run").load({"model": torch.nn.Linear(3, 2)}) == 1


def test_gc_finds_unreferenced_data_objects_of_committed_checkpoints(bucket: str, s3_env: LocalS3Server) -> None:
    """A crashed or replaced save leaves data objects its .metadata does not reference; probes too."""
    client = s3_env.client()
    save(f"s3://{bucket}/run/flat")
    save(f"s3://{bucket}/run/spread", key_prefixes=4)
    real = set(keys(client, bucket))
    planted = {
        "run/flat/__0_0.0123456789abcdef.distcp",
        "run/flat/__1_0.distcp",
        "run/spread/p-2/__2_0.fedcba9876543210.distcp",
        "run/spread/p-0/__0_1.distcp",
        "run/flat/.dcp_s3-probe.0123456789abcdef",
        "run/empty/.dcp_s3-probe.00ff00ff00ff00ff",
    }
    kept = {
        "run/flat/README.md",
        "run/flat/p-1/notes.txt",
        "run/flat/model.distcp.bak",
        "run/flat/.dcp_s3-probe.txt",
        "run/flat/extra/__0_0.distcp",
    }  # inside a complete checkpoint: maybe its data, never guessed at
    for key in planted | kept:
        client.put_object(Bucket=bucket, Key=key, Body=b"x" * 10)

    assert find_garbage(f"s3://{bucket}/run").objects == []  # everything is younger than the 1h default
    later = time.time() + 7200  # two hours from now, every object is old
    garbage = find_garbage(f"s3://{bucket}/run", now=later)
    assert {o.name for o in garbage.objects} == {k[len("run/") :] for k in planted}
    assert garbage.steps == [] and garbage.uploads == []
    assert [where for where, _ in garbage.skipped] == [f"s3://{bucket}/run/flat/extra"]
    assert collect_garbage(garbage) == (len(planted), 0)
    assert set(keys(client, bucket)) == real | kept
    assert torch.equal(load(f"s3://{bucket}/run/flat")["w"], STATE["w"])
    assert torch.equal(load(f"s3://{bucket}/run/spread")["w"], STATE["w"])


def test_gc_leaves_a_checkpoint_whose_metadata_it_cannot_read(bucket: str, s3_env: LocalS3Server) -> None:
    client = s3_env.client()
    save(f"s3://{bucket}/run/ck")
    client.put_object(Bucket=bucket, Key="run/ck/.metadata", Body=b"\x80\x05not a pickle")
    client.put_object(Bucket=bucket, Key="run/ck/__9_0.distcp", Body=b"x")
    before = keys(client, bucket)
    garbage = find_garbage(f"s3://{bucket}/run", now=time.time() + 7200)
    assert garbage.objects == []
    assert [where for where, _ in garbage.skipped] == [f"s3://{bucket}/run/ck"]
    collect_garbage(garbage)
    assert keys(client, bucket) == before


def test_gc_never_aborts_an_upload_that_is_still_being_written(bucket: str, s3_env: LocalS3Server) -> None:
    client = s3_env.client()
    ckpt = Checkpointer(f"s3://{bucket}/run")
    ckpt.save({"model": torch.nn.Linear(3, 2)}, iteration=1)
    client.delete_object(Bucket=bucket, Key="run/0000001.pth")  # looks like a crashed step...
    key = "run/0000001.model_optim/__0_0.distcp"  # ...but a part is still uploading into it
    upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    user = client.create_multipart_upload(Bucket=bucket, Key="run/dataset.tar")["UploadId"]  # not ours
    time.sleep(3.0)
    client.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"x" * (5 << 20))
    before = keys(client, bucket)

    # Started more than 1.5 s ago but written to just now: neither it nor its step is touched.
    garbage = find_garbage(f"s3://{bucket}/run", older_than=1.5)
    assert garbage.uploads == [] and garbage.objects == [] and garbage.steps == []
    assert garbage.skipped and "in progress" in garbage.skipped[0][1]
    collect_garbage(garbage)
    assert keys(client, bucket) == before
    ids = {u["UploadId"] for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])}
    assert ids == {upload, user}

    garbage = find_garbage(f"s3://{bucket}/run", older_than=0)  # once idle for longer than the bound
    assert [u.upload_id for u in garbage.uploads] == [upload]  # never the user's own upload
    collect_garbage(garbage)
    ids = {u["UploadId"] for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])}
    assert ids == {user}


def test_gc_help_states_the_bound(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["gc", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "never an upload younger than AGE" in out and "default 1h" in out


def test_rm_dry_run_lists_everything_rm_deletes(
    bucket: str, s3_env: LocalS3Server, capsys: pytest.CaptureFixture[str]
) -> None:
    client = s3_env.client()
    ckpt = Checkpointer(f"s3://{bucket}/run")
    model = torch.nn.Linear(3, 2)
    for it in (1, 2):
        ckpt.save({"model": model}, iteration=it)
    client.put_object(Bucket=bucket, Key="run/0000001.model_model/notes.md", Body=b"mine")
    client.put_object(Bucket=bucket, Key="run/README", Body=b"mine")
    client.create_multipart_upload(Bucket=bucket, Key="run/0000001.model_model/__5_0.distcp")

    for argv in ((f"s3://{bucket}/run/0000001",), (f"s3://{bucket}/run", "-r")):
        before = keys(client, bucket)
        code, out, _ = run(capsys, "rm", *argv, "--dry-run")
        assert code == 0 and keys(client, bucket) == before
        listed = _gc_lines(out, "would remove")
        aborts = [line for line in out.splitlines() if line.startswith("would abort")]
        code, out, _ = run(capsys, "rm", *argv)
        assert code == 0 and _gc_lines(out, "removed") == listed
        gone = {f"s3://{bucket}/{k}" for k in set(before) - set(keys(client, bucket))}
        assert gone == listed, gone ^ listed
        assert len(aborts) == 1 and ("__5_0.distcp" if len(argv) == 1 else "run/x/__0_0.distcp") in aborts[0]
        if len(argv) == 1:
            assert f"kept s3://{bucket}/run/0000001.model_model/notes.md (not a checkpoint object)" in out
            assert keys(client, bucket)["run/0000001.model_model/notes.md"] == b"mine"
            assert not client.list_multipart_uploads(Bucket=bucket).get("Uploads")
            client.create_multipart_upload(Bucket=bucket, Key="run/x/__0_0.distcp")
    assert keys(client, bucket) == {} and not client.list_multipart_uploads(Bucket=bucket).get("Uploads")


def test_rm_of_a_plain_checkpoint_keeps_other_files(bucket: str, s3_env: LocalS3Server) -> None:
    client = s3_env.client()
    save(f"s3://{bucket}/exp", key_prefixes=2)
    for name, body in USER_FILES.items():
        client.put_object(Bucket=bucket, Key=f"exp/{name}", Body=body)
    removal = remove_checkpoint(f"s3://{bucket}/exp", dry_run=True)
    assert sorted(removal.kept) == sorted(USER_FILES)
    assert removal.objects[0] == ".metadata"  # un-commit first
    remove_checkpoint(f"s3://{bucket}/exp")
    assert keys(client, bucket) == {f"exp/{k}": v for k, v in USER_FILES.items()}


# -- 6. time bounds ----------------------------------------------------------------------------------------
class BlackHole:
    """A loopback endpoint that accepts every connection and never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.sock.settimeout(0.2)
        self._stop = threading.Event()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.accepted.append(conn)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()
        for conn in self.accepted:
            conn.close()


@pytest.fixture
def black_hole(monkeypatch: pytest.MonkeyPatch) -> Iterator[BlackHole]:
    hole = BlackHole()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", hole.url)
    yield hole
    hole.close()


def _failure(exc: BaseException) -> str:
    if isinstance(exc, CheckpointException):
        return " ".join(str(e) for e in exc.failures.values())
    return str(exc)


def test_a_black_holed_endpoint_fails_within_two_minutes_by_default(black_hole: BlackHole) -> None:
    t0 = time.monotonic()
    with pytest.raises((CheckpointException, DcpS3Error)) as info:
        save("s3://bucket/ckpt")
    elapsed = time.monotonic() - t0
    message = _failure(info.value)
    assert black_hole.url.split("//")[1] in message and "no answer in time" in message, message
    assert elapsed < 150, elapsed  # 5 attempts x 20 s read timeout + backoff: about 100-115 s
    assert len(black_hole.accepted) == 5  # one connection per attempt


@pytest.mark.parametrize("entry", ["writer", "reader", "checkpointer", "cli"])
def test_time_bounds_are_settable_everywhere(
    black_hole: BlackHole, entry: str, capsys: pytest.CaptureFixture[str]
) -> None:
    fast = ClientConfig(connect_timeout=1, read_timeout=0.5, retry_attempts=2)
    t0 = time.monotonic()
    if entry == "cli":
        code, _, err = run(
            capsys, "ls", "s3://bucket/run", "--read-timeout", "0.5", "--max-attempts", "2", "--connect-timeout", "1"
        )
        assert code == 1 and black_hole.url.split("//")[1] in err, err
    else:
        with pytest.raises((CheckpointException, DcpS3Error)) as info:
            if entry == "writer":
                dcp.save(STATE, storage_writer=S3StorageWriter("s3://bucket/c", client=fast), no_dist=True)
            elif entry == "reader":
                dcp.load(dict(STATE), storage_reader=S3StorageReader("s3://bucket/c", client=fast), no_dist=True)
            else:
                Checkpointer("s3://bucket/run", connect_timeout=1, read_timeout=0.5, retry_attempts=2).save(
                    {"model": torch.nn.Linear(2, 2)}, iteration=1
                )
        assert black_hole.url.split("//")[1] in _failure(info.value)
    assert time.monotonic() - t0 < 30
    assert len(black_hole.accepted) == 2  # retry_attempts=2 was honoured, not replaced


def test_one_client_settings_object() -> None:
    base = ClientConfig(read_timeout=7, retry_attempts=3, max_pool_connections=64)
    writer = S3StorageWriter(
        "s3://bucket/x", client=base, region="eu-west-1", max_concurrency=4, transfer=TransferConfig(part_size=8 << 20)
    )
    cfg = writer._session.client_config
    assert (cfg.read_timeout, cfg.retry_attempts, cfg.region, cfg.max_pool_connections) == (7.0, 3, "eu-west-1", 64)
    client = cfg.make_client()
    # With rate control (the default) dcp_s3's retry handler applies retry_attempts (botocore's own makes
    # one attempt: objstore.rate_hooks); without it, botocore does.
    assert client.meta.config.read_timeout == 7.0 and client.meta.config.retries["total_max_attempts"] == 1
    plain = dataclasses.replace(cfg, rate_control=False).make_client()
    assert plain.meta.config.retries["total_max_attempts"] == 3
    defaults = ClientConfig()
    assert defaults.retry_attempts * defaults.read_timeout <= 100
    with pytest.raises(ConfigError, match="client="):
        S3StorageReader("s3://bucket/x", client={"read_timeout": 1})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unknown storage option"):
        Checkpointer("s3://bucket/run", read_timeot=1)


# -- 7. secrets ----------------------------------------------------------------------------------------------
TOKEN = "IQoJb3JpZ2luX2VjEXAMPLE/TOKEN+with/slashes=="
SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"


@pytest.fixture
def botocore_debug() -> Iterator[io.StringIO]:
    """Everything botocore and urllib3 log at DEBUG, as a file handler would write it."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(name)s %(message)s"))
    loggers = [logging.getLogger(n) for n in ("botocore", "urllib3", "s3transfer")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.DEBUG)
        lg.addHandler(handler)
    yield stream
    for lg, level in zip(loggers, levels, strict=True):
        lg.removeHandler(handler)
        lg.setLevel(level)


def _drop_redaction() -> None:
    for logger in [logging.getLogger(n) for n in list(logging.root.manager.loggerDict)] + [logging.getLogger()]:
        for f in [f for f in logger.filters if isinstance(f, RedactSecrets)]:
            logger.removeFilter(f)


def test_botocore_debug_logs_never_show_the_session_token(
    moto_env: LocalS3Server, tmp_path: Path, botocore_debug: io.StringIO
) -> None:
    cred = tmp_path / "cred.json"
    cred.write_text(
        json.dumps(
            {
                "aws_access_key_id": "AKIDEXAMPLE",
                "aws_secret_access_key": SECRET,
                "aws_session_token": TOKEN,
                "endpoint_url": moto_env.endpoint_url,
                "region_name": "us-east-1",
            }
        )
    )
    cred.chmod(0o600)
    # Control: without the filter, botocore does write the token (so this test can fail).
    _drop_redaction()
    import boto3

    raw = boto3.client(
        "s3",
        endpoint_url=moto_env.endpoint_url,
        region_name="us-east-1",
        aws_access_key_id="AKIDEXAMPLE",
        aws_secret_access_key=SECRET,
        aws_session_token=TOKEN,
    )
    raw.list_buckets()
    assert TOKEN in botocore_debug.getvalue()
    botocore_debug.seek(0)
    botocore_debug.truncate()

    bucket = moto_env.create_bucket("secrets-test")
    uri = f"s3://{bucket}/ck"
    dcp.save(STATE, storage_writer=S3StorageWriter(uri, credential_path=str(cred)), no_dist=True)
    state = {k: torch.zeros_like(v) for k, v in STATE.items()}
    dcp.load(state, storage_reader=S3StorageReader(uri, credential_path=str(cred)), no_dist=True)
    raw.list_buckets()  # a client dcp_s3 did not make, once the filter is in place
    logged = botocore_debug.getvalue()
    assert "'X-Amz-Security-Token': b'<redacted>'" in logged  # each request's headers were logged, redacted
    assert "Signature=<redacted>" in logged
    if HAS_CRT:  # awscrt importable: botocore signs with the CRT signer, which logs no canonical request
        assert "CanonicalRequest" not in logged
    else:  # botocore's own signer logs the canonical request, token included
        assert "CanonicalRequest" in logged and "x-amz-security-token:<redacted>" in logged
    assert TOKEN not in logged and SECRET not in logged


@pytest.mark.parametrize(
    "content",
    [
        {"aws_session_token": TOKEN},
        {"aws_access_key_id": "AKIDEXAMPLE", "aws_secret_access_key": SECRET},
    ],
)
@pytest.mark.parametrize("mode", [0o644, 0o640])
def test_a_credential_file_readable_by_others_warns(tmp_path: Path, content: dict[str, str], mode: int) -> None:
    cred = tmp_path / "cred.json"
    cred.write_text(json.dumps(content))
    cred.chmod(mode)
    with pytest.warns(UserWarning, match="readable by other users") as record:
        S3StorageWriter("s3://bucket/x", credential_path=str(cred))._session.client_config.client_kwargs()
    assert all(TOKEN not in str(w.message) and SECRET not in str(w.message) for w in record)
    cred.chmod(0o600)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ClientConfig(credential_path=str(cred)).client_kwargs()


# -- 8. terminal and input hygiene ---------------------------------------------------------------------
EVIL = "\x1b]0;pwned\x07\x1b[2J\r\u202e"


def test_ls_and_inspect_escape_control_characters(
    bucket: str, s3_env: LocalS3Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dcp.save({f"layer{EVIL}.weight": torch.ones(2)}, storage_writer=S3StorageWriter(f"s3://{bucket}/ck"), no_dist=True)
    local = tmp_path / f"run{EVIL}dir"
    _local_checkpoint(local)
    outputs = []
    for argv in (
        ("inspect", f"s3://{bucket}/ck"),
        ("ls", f"s3://{bucket}/"),
        ("ls", str(tmp_path)),
        ("inspect", str(local)),
        ("gc", str(tmp_path), "--older-than", "0"),
        ("verify", str(tmp_path)),
        ("rm", str(local), "--dry-run"),
        ("inspect", f"s3://{bucket}/ck", "--json"),
    ):
        code, out, err = run(capsys, *argv)
        assert code == 0, (argv, err)
        outputs.append(out + err)
        assert not any(c in out + err for c in "\x1b\x07\r\u202e"), (argv, out)
    assert "layer\\x1b]0;pwned\\x07\\x1b[2J\\r\\u202e.weight" in outputs[0]
    assert "run\\x1b]0;pwned" in outputs[2]
    assert f"layer{EVIL}.weight" in [e["fqn"] for e in json.loads(outputs[-1])]
    code, _, err = run(capsys, "inspect", f"s3://{bucket}/missing{EVIL}")  # an error message quoting input
    assert code == 1 and "\x1b" not in err and "\\x1b" in err


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda: S3StorageWriter("s3://bucket/x", part_size="16777216"), "part_size"),
        (lambda: S3StorageWriter("s3://bucket/x", part_size=16.0 * 2**20), "part_size"),
        (lambda: S3StorageWriter("s3://bucket/x", max_concurrency=2.5), "max_concurrency"),
        (lambda: S3StorageWriter("s3://bucket/x", max_concurrency=True), "max_concurrency"),
        (lambda: S3StorageWriter("s3://bucket/x", files_per_rank="2"), "files_per_rank"),
        (lambda: S3StorageWriter("s3://bucket/x", compression="zstd", compression_threads="2"), "compression_threads"),
        (lambda: S3StorageWriter("s3://bucket/x", compression="zstd", compression_level=1.5), "compression_level"),
        (lambda: S3StorageReader("s3://bucket/x", max_range_size=1e6), "max_range_size"),
        (
            lambda: S3StorageReader("s3://bucket/x", max_concurrency=None, transfer=TransferConfig(coalesce_gap=None)),
            "coalesce_gap",
        ),
        (lambda: ClientConfig(read_timeout="30"), "read_timeout"),
        (lambda: ClientConfig(connect_timeout=float("nan")), "connect_timeout"),
        (lambda: ClientConfig(connect_timeout=True), "connect_timeout"),
        (lambda: ClientConfig(retry_attempts=2.0), "retry_attempts"),
        (lambda: ClientConfig(max_pool_connections="10"), "max_pool_connections"),
        (lambda: ClientConfig(endpoint_url="127.0.0.1:9000"), "endpoint_url"),
        (lambda: ClientConfig(region=5), "region"),
        (lambda: Checkpointer("s3://bucket/run", part_size="8MiB"), "part_size"),
    ],
)
def test_options_of_the_wrong_type_fail_at_construction(make: Any, name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        make()


def test_numpy_integers_are_fine() -> None:
    writer = S3StorageWriter("s3://bucket/x", part_size=np.int64(8 << 20), max_concurrency=np.int32(3))
    assert type(writer._session.transfer.part_size) is int and writer._session.transfer.max_concurrency == 3


@pytest.mark.parametrize(
    ("bucket", "problem"),
    [
        ("ab", "2 characters"),
        ("a" * 64, "64 characters"),
        ("My-Bucket", "character"),
        ("my_bucket", "character"),
        ("-bucket", "start and end"),
        ("bucket-", "start and end"),
        (".bucket", "start and end"),
        ("a..b", "'..'"),
        ("192.168.5.4", "IP address"),
        ("b\x1bucket", "character"),
    ],
)
def test_bucket_names_follow_s3_rules(bucket: str, problem: str) -> None:
    with pytest.raises(InvalidCheckpointIdError, match="not a valid bucket name") as info:
        parse_s3_uri(f"s3://{bucket}/key")
    assert problem in str(info.value) and "3-63 characters" in str(info.value)


@pytest.mark.parametrize("bucket", ["abc", "a" * 63, "my.bucket-1", "1.2.3", "999.1.1.1", "0bucket9"])
def test_valid_bucket_names_pass(bucket: str) -> None:
    assert parse_s3_uri(f"s3://{bucket}/key").bucket == bucket
