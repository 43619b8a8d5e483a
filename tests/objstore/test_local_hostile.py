"""Local directories as hostile as buckets (issue 20, items 1-3 and 8): links, FIFOs, devices,
oversized objects, unwritable directories and ``file:`` URLs, on real directories (and the local
S3 server for the size cap)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter

import dcp_s3
from dcp_s3 import S3StorageReader, S3StorageWriter, TransferConfig
from dcp_s3 import _cli as cli
from dcp_s3._checkpointer import Checkpointer
from dcp_s3._dcp import open_store
from dcp_s3._dcp.session import LocalDir, parse_location
from dcp_s3._layout import METADATA_KEY
from dcp_s3._local_server import LocalS3Server
from dcp_s3.errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    ConfigError,
    DcpS3Error,
    S3TransferError,
)

ROOT = Path(dcp_s3.__file__).resolve().parents[1]  # the children import the dcp_s3 under test
STATE = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5)}
SECRET = {"w": torch.full((3, 4), 4242.0), "b": torch.full((5,), 4242.0)}  # same layout, other bytes


def save(path: Path | str, state: dict[str, torch.Tensor] = STATE, **options: Any) -> None:
    dcp.save(state, storage_writer=S3StorageWriter(str(path), **options), no_dist=True)


def load(path: Path | str, **options: Any) -> dict[str, torch.Tensor]:
    state = {k: torch.zeros_like(v) for k, v in STATE.items()}
    dcp.load(state, storage_reader=S3StorageReader(str(path), **options), no_dist=True)
    return state


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def data_objects(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*.distcp"))


def files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def error_text(exc: BaseException) -> str:
    """Our message, also when DCP wrapped it in a CheckpointException (which keeps the original)."""
    return str(exc) + "".join(str(e) for e in getattr(exc, "failures", {}).values())


# -- 1. an overwrite-save never deletes through a link --------------------------------------------
def _plant_linked_prefix(victim: Path, other: Path) -> None:
    """``victim/.metadata`` names ``p-0/<other's object>`` and ``victim/p-0`` links to ``other/p-0``."""
    shutil.copyfile(other / METADATA_KEY, victim / METADATA_KEY)
    for p in victim.glob("*.distcp"):
        p.unlink()
    (victim / "p-0").symlink_to(other / "p-0", target_is_directory=True)


def test_overwrite_save_does_not_delete_through_a_linked_directory(tmp_path: Path) -> None:
    other, victim = tmp_path / "other", tmp_path / "victim"
    save(other, SECRET, key_prefixes=2)  # other/p-0/__0_0.<token>.distcp
    before = files(other)
    save(victim)
    _plant_linked_prefix(victim, other)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save(victim)  # replaces the crafted checkpoint; its "objects" lie behind the link
    assert files(other) == before  # nothing deleted (or written) through the link
    assert same(load(other), SECRET)  # the other checkpoint still loads, bit-exact
    assert same(load(victim), STATE)
    refused = [str(w.message) for w in caught if "could not delete" in str(w.message)]
    assert refused and "symbolic link" in refused[0] and str(victim / "p-0") in refused[0], refused


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)


def test_checkpointer_resave_does_not_delete_through_a_linked_directory(tmp_path: Path) -> None:
    other, run = tmp_path / "other", tmp_path / "run"
    save(other, SECRET, key_prefixes=2)
    before = files(other)
    torch.manual_seed(0)
    net = Net()
    ckpt = Checkpointer(str(run))
    ckpt.save({"net": net}, iteration=7)
    (part,) = run.glob("0000007.net_model.*")  # the save's generation directory
    _plant_linked_prefix(part, other)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckpt.save({"net": net}, iteration=7)  # re-save of the step: the part's writer replaces it
    assert files(other) == before
    assert same(load(other), SECRET)
    fresh = Net()
    assert ckpt.load({"net": fresh}) == 7
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), net.state_dict().values(), strict=True))


def test_writer_does_not_create_prefix_directories_through_a_link(tmp_path: Path) -> None:
    outside, ck = tmp_path / "outside", tmp_path / "ck"
    outside.mkdir()
    ck.mkdir()
    (ck / "p-0").symlink_to(outside, target_is_directory=True)
    with pytest.raises(BaseException) as info:  # DCP wraps it in a CheckpointException
        save(ck, key_prefixes=2)
    assert "symbolic link" in error_text(info.value) and str(ck / "p-0") in error_text(info.value)
    assert list(outside.iterdir()) == []  # nothing written outside the root
    assert not (ck / METADATA_KEY).exists()


# -- 2. a load never reads through a link ----------------------------------------------------------
def _torch_checkpoint(path: Path, state: dict[str, torch.Tensor]) -> Path:
    """A checkpoint by torch's FileSystemWriter: its .metadata holds no CRC for the items."""
    dcp.save(state, storage_writer=FileSystemWriter(str(path)), no_dist=True)
    (obj,) = data_objects(path)
    return obj


def test_load_refuses_a_data_object_linked_out_of_the_checkpoint(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    obj = _torch_checkpoint(ck, STATE)
    secret = _torch_checkpoint(tmp_path / "private", SECRET)  # stands for ~/.aws/credentials
    obj.unlink()
    obj.symlink_to(secret)
    state = {k: torch.zeros_like(v) for k, v in STATE.items()}
    with pytest.raises(BaseException) as info:
        dcp.load(state, storage_reader=S3StorageReader(str(ck)), no_dist=True)
    assert "symbolic link" in error_text(info.value) and str(obj) in error_text(info.value)
    assert all(not (t == 4242.0).any() for t in state.values())  # the linked bytes never reached a tensor


# -- 3. non-regular files: FIFOs and devices --------------------------------------------------------
CHILD = textwrap.dedent(
    r"""
    import contextlib, io, json, os, resource, sys, time
    import torch
    import torch.distributed.checkpoint as dcp
    import dcp_s3
    from dcp_s3 import S3StorageReader, S3StorageWriter, _cli as cli
    import dcp_s3.admin, dcp_s3._dcp.store_local, dcp_s3._dcp.store_s3, dcp_s3._checkpointer  # noqa: F401  (before setuid)

    what, target = sys.argv[1], sys.argv[2]
    state = {"w": torch.zeros(3, 4), "b": torch.zeros(5)}
    if os.environ.get("CHILD_HEADROOM"):  # the address space: what is mapped now plus the headroom
        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        limit = vm + int(os.environ["CHILD_HEADROOM"])
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    if os.environ.get("CHILD_FSIZE"):  # files may not grow past this: writes fail with EFBIG, as a full disk would
        import signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(os.environ["CHILD_FSIZE"]),) * 2)
        state = {"w": torch.zeros(4096), "b": torch.zeros(5)}
    if os.environ.get("CHILD_UID"):  # root ignores permissions: drop to nobody once everything is imported
        os.setgid(int(os.environ["CHILD_UID"]))
        os.setuid(int(os.environ["CHILD_UID"]))
    out = io.StringIO()
    result = {"error": None, "types": [], "message": ""}
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            if what == "load":
                dcp.load(state, storage_reader=S3StorageReader(target), no_dist=True)
            elif what == "save":
                dcp.save(state, storage_writer=S3StorageWriter(target), no_dist=True)
            elif what == "cp":
                result["code"] = cli.main(["cp", target, os.environ["CHILD_CP_TO"]])
            elif what == "store-write":
                dcp_s3._dcp.store_local.LocalStore(target).write("x.pth", b"data")
            else:
                result["code"] = cli.main([what, target] + (["--yes", "--older-than", "0s"] if what == "gc" else []))
    except BaseException as exc:  # MemoryError and DCP's CheckpointException included
        failures = getattr(exc, "failures", {})
        inner = next(iter(failures.values()), exc) if isinstance(failures, dict) else exc
        inner = inner[0] if isinstance(inner, tuple) else inner  # DCP keeps (exception, traceback)
        result.update(error=type(exc).__name__, types=[c.__name__ for c in type(inner).__mro__],
                      message=str(inner), errno=getattr(inner, "errno", None))
    result.update(seconds=time.perf_counter() - t0, output=out.getvalue(),
                  maxrss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    print(json.dumps(result))
    """
)


def child(
    what: str,
    target: Path | str,
    *,
    headroom: int | None = int(1.5 * 2**30),
    uid: int | None = None,
    fsize: int | None = None,
    timeout: float = 120,
) -> dict[str, Any]:
    """Run ``what`` on ``target`` in a fresh interpreter (under a memory limit), under a hang guard."""
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), MALLOC_ARENA_MAX="2"
    )
    if headroom is not None:
        env["CHILD_HEADROOM"] = str(headroom)
    if uid is not None:
        env["CHILD_UID"] = str(uid)
    if fsize is not None:
        env["CHILD_FSIZE"] = str(fsize)
    try:
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, what, str(target)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=tempfile.gettempdir(),
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what} {target}: still running after {timeout}s (blocked)")
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines, f"child died ({proc.returncode}): {proc.stderr[-2000:]}"
    return json.loads(lines[-1])  # type: ignore[no-any-return]


def test_fifo_data_object_is_refused_promptly(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    save(ck)
    (obj,) = data_objects(ck)
    obj.unlink()
    os.mkfifo(obj)  # opened for reading without a writer, it blocks forever
    result = child("load", ck, timeout=60)
    assert "CheckpointFormatError" in result["types"], result
    assert "not a regular file" in result["message"] and str(obj) in result["message"], result


def test_fifo_metadata_is_refused_promptly(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    save(ck)
    (ck / METADATA_KEY).unlink()
    os.mkfifo(ck / METADATA_KEY)
    for what in ("load", "inspect"):
        result = child(what, ck, timeout=60)
        text = result["message"] + result["output"]
        assert "not a regular file" in text and str(ck / METADATA_KEY) in text, (what, result)


def test_cp_of_a_fifo_data_object_to_s3_is_refused_promptly(
    tmp_path: Path, bucket: str, s3_env: LocalS3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``dcp-s3 cp`` reads a local source through the local object store, whatever the destination: a
    FIFO never blocks the copy, and nothing of the copy is committed (no ``.metadata`` in the bucket)."""
    ck = tmp_path / "ck"
    save(ck)
    (obj,) = data_objects(ck)
    obj.unlink()
    os.mkfifo(obj)
    monkeypatch.setenv("CHILD_CP_TO", f"s3://{bucket}/copy")
    result = child("cp", ck, timeout=60)
    assert result.get("code") not in (0, None), result
    assert "not a regular file" in result["output"] and str(obj) in result["output"], result
    assert "Contents" not in s3_env.client().list_objects_v2(Bucket=bucket, Prefix=f"copy/{METADATA_KEY}")


@pytest.fixture
def metadata_to_dev_zero(tmp_path: Path) -> Path:
    ck = tmp_path / "ck"
    save(ck)
    (ck / METADATA_KEY).unlink()
    (ck / METADATA_KEY).symlink_to("/dev/zero")
    return ck


@pytest.mark.parametrize("what", ["load", "ls", "inspect", "verify", "gc", "save"])
def test_metadata_linked_to_dev_zero_is_refused_with_bounded_memory(metadata_to_dev_zero: Path, what: str) -> None:
    ck = metadata_to_dev_zero
    result = child(what, ck)
    print(f"{what}: {result['seconds']:.2f}s, peak RSS {result['maxrss'] / 2**20:.0f} MiB")
    text = (result["message"] + result["output"]).strip()
    assert result["error"] != "MemoryError" and "MemoryError" not in result["types"], result
    assert "symbolic link" in text and str(ck / METADATA_KEY) in text, result  # never an empty message
    if what == "load" or what == "save":
        assert "CheckpointFormatError" in result["types"], result
    else:
        # ls lists it UNREADABLE and gc skips it (both exit 0, naming the cause); inspect and verify fail
        assert result.get("code") == (0 if what in ("ls", "gc") else 1), result
    assert os.path.islink(ck / METADATA_KEY)  # nothing replaced it through the tools


# -- size cap of objects read whole ---------------------------------------------------------------
def test_max_whole_read_caps_metadata_reads_local(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    save(ck)
    size = (ck / METADATA_KEY).stat().st_size
    assert same(load(ck, max_whole_read=size), STATE)  # exactly the limit is fine
    with pytest.raises(BaseException) as info:
        load(ck, max_whole_read=size - 1)
    text = error_text(info.value)
    assert str(ck / METADATA_KEY) in text and f"{size:,} bytes" in text and "max_whole_read" in text, text
    with pytest.raises(BaseException) as info:
        load(ck, transfer=TransferConfig(max_whole_read=100))
    assert "max_whole_read=100" in error_text(info.value)
    store = open_store(str(tmp_path), max_whole_read=100)  # a storage option of stores, tools, Checkpointer
    with pytest.raises(CheckpointFormatError, match="max_whole_read=100"):
        store.read(f"ck/{METADATA_KEY}")
    with pytest.raises(ConfigError, match="max_whole_read"):
        TransferConfig(max_whole_read=0)


def test_max_whole_read_reaches_the_checkpointer_and_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    Checkpointer(str(run)).save({"net": Net()}, iteration=3)
    marker = run / "0000003.pth"
    with pytest.raises(CheckpointFormatError) as info:
        Checkpointer(str(run), max_whole_read=100).load({"net": Net()}, path=str(run / "0000003"))
    assert str(marker) in str(info.value) and "max_whole_read=100" in str(info.value)
    with pytest.warns(RuntimeWarning, match="max_whole_read=100"):  # the newest step: not resumed from, and why
        assert Checkpointer(str(run), max_whole_read=100).load({"net": Net()}) == 0
    assert Checkpointer(str(run)).load({"net": Net()}) == 3
    (part,) = run.glob("0000003.net_model.*")  # the save's generation directory
    assert cli.main(["inspect", str(part), "--max-whole-read", "100"]) == 1
    err = capsys.readouterr().err
    assert str(part / METADATA_KEY) in err and "max_whole_read=100" in err, err
    assert cli.main(["inspect", str(part)]) == 0


def test_max_whole_read_caps_metadata_reads_s3(bucket: str, s3_env: LocalS3Server) -> None:
    uri = f"s3://{bucket}/ck"
    save(uri)
    size = len(s3_env.client().get_object(Bucket=bucket, Key=f"ck/{METADATA_KEY}")["Body"].read())
    assert same(load(uri, max_whole_read=size), STATE)
    with pytest.raises(BaseException) as info:
        load(uri, max_whole_read=size - 1)
    text = error_text(info.value)
    assert f"{uri}/{METADATA_KEY}" in text and f"{size:,} bytes" in text and "max_whole_read" in text, text
    store = open_store(f"s3://{bucket}", max_whole_read=100)
    with pytest.raises(CheckpointFormatError, match="max_whole_read=100"):
        store.read(f"ck/{METADATA_KEY}")


# -- OSErrors of local directories ------------------------------------------------------------------
@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A directory another user can reach (pytest's tmp_path is private to its user)."""
    path = Path(tempfile.mkdtemp(prefix="dcp_s3-ro-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_read_only_directory_raises_a_wrapped_permission_error(shared_tmp: Path) -> None:
    ck = shared_tmp / "ck"
    ck.mkdir()
    ck.chmod(0o555)
    uid = 65534 if os.geteuid() == 0 else None  # root ignores the mode: the child drops to nobody
    for what in ("store-write", "save"):
        result = child(what, ck, headroom=None, uid=uid)
        assert {"DcpS3Error", "PermissionError"} <= set(result["types"]), (what, result)
        assert str(ck) in result["message"] and "ermission denied" in result["message"], (what, result)
        assert result["errno"] == errno.EACCES
    assert list(ck.iterdir()) == []


def test_a_failed_file_write_is_a_wrapped_os_error(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    result = child("save", ck, headroom=None, fsize=4096)  # a 16 KiB tensor in a 4 KiB world
    assert {"S3TransferError", "OSError"} <= set(result["types"]), result
    assert result["errno"] == errno.EFBIG and str(ck) in result["message"] and "EFBIG" in result["message"], result
    assert not (ck / METADATA_KEY).exists() and not [p for p in ck.rglob("*") if p.is_file()]  # nothing left


def test_os_errors_keep_their_builtin_and_name_the_path(tmp_path: Path) -> None:
    from dcp_s3._objstore.local_fs import wrap_os_error

    err = wrap_os_error(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), "write", "/ckpt/.metadata")
    assert isinstance(err, S3TransferError) and isinstance(err, OSError) and err.errno == errno.ENOSPC
    assert str(err) == "write /ckpt/.metadata failed: No space left on device (ENOSPC)"
    err = wrap_os_error(PermissionError(), "write", "/ckpt/x")  # no strerror: still a message
    assert isinstance(err, PermissionError) and isinstance(err, DcpS3Error) and str(err).strip()
    (tmp_path / "file").write_bytes(b"x")
    store = open_store(str(tmp_path / "file"))  # a root that is a file
    with pytest.raises(DcpS3Error) as info:
        store.write("a", b"b")
    assert str(tmp_path / "file") in str(info.value)
    with pytest.raises(CheckpointNotFoundError):
        open_store(str(tmp_path / "missing")).read("x")


# -- file: URLs ----------------------------------------------------------------------------------
def test_file_urls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert parse_location("file:///abs/path") == LocalDir("/abs/path")
    assert parse_location("file://localhost/tmp/x") == LocalDir("/tmp/x")
    assert parse_location("file:/tmp/y") == LocalDir("/tmp/y")
    for url in (
        "file://",
        "file:",
        "file:relative/dir",
        "file://host/tmp/x",
        "file://localhost",
        "file://127.0.0.1/tmp/x",
    ):
        with pytest.raises(ConfigError) as info:
            parse_location(url)
        assert repr(url) in str(info.value), url
    assert not S3StorageReader.validate_checkpoint_id("file://host/tmp/x")
    with pytest.raises(ConfigError):
        S3StorageWriter("file://localhost")
    ck = tmp_path / "ck"
    save(f"file://localhost{ck}")
    assert same(load(f"file://{ck}"), STATE)
    assert not (tmp_path / "localhost").exists()


def test_whole_reads_stop_at_the_limit_whatever_the_size_said() -> None:
    from dcp_s3._objstore.local import LocalObjectStore

    # /proc files are regular files that report 0 bytes and hold more: as a file growing while read
    status = LocalObjectStore("/proc/self").get("status")
    assert b"VmSize" in status and len(status) > 100
    with pytest.raises(CheckpointFormatError, match=r"/proc/self/status is 101 bytes \(or more\).*max_whole_read=100"):
        LocalObjectStore("/proc/self", max_whole_read=100).get("status")


def test_follow_symlinks_is_for_reads_and_listings_only(tmp_path: Path) -> None:
    from dcp_s3._objstore.local import LocalObjectStore

    outside, root = tmp_path / "outside", tmp_path / "root"
    (outside / "d").mkdir(parents=True)
    (outside / "d" / "obj").write_bytes(b"outside")
    (outside / "file").write_bytes(b"target")
    root.mkdir()
    (root / "d").symlink_to(outside / "d", target_is_directory=True)
    (root / "link").symlink_to(outside / "file")
    strict, trusting = LocalObjectStore(root), LocalObjectStore(root, follow_symlinks=True)
    for key in ("d/obj", "link"):
        with pytest.raises(CheckpointFormatError, match="symbolic link"):
            strict.get(key)
        with pytest.raises(CheckpointFormatError, match="symbolic link"):
            strict.head(key)
    assert trusting.get("d/obj") == b"outside" and trusting.get("link") == b"target"
    assert sorted(o.key for o in trusting.list_objects("")) == ["d/obj", "link"]
    assert [o.key for o in strict.list_objects("")] == ["link"]  # a linked directory is not walked
    assert list(strict.list_objects("d/")) == [] and strict.list_dir("d/") == ([], [])  # nor listed by prefix
    assert [o.key for o in trusting.list_dir("d/")[0]] == ["d/obj"]
    for store in (strict, trusting):  # writes never go through a link, whatever the option
        with pytest.raises(CheckpointFormatError, match="symbolic link"):
            store.put("d/new", b"x")
        with pytest.raises(CheckpointFormatError, match="symbolic link"):
            store.put("link", b"x")
        with pytest.raises(CheckpointFormatError, match="symbolic link"):
            store.delete(["d/obj"])
    assert sorted(p.name for p in (outside / "d").iterdir()) == ["obj"]
    strict.put("real", b"r")
    strict.delete(["link", "real"])  # a key that is a link: the link goes, its target stays
    assert not os.path.lexists(root / "link") and not (root / "real").exists()
    assert (outside / "file").read_bytes() == b"target"


def test_checkpointer_does_not_follow_a_linked_part_directory(tmp_path: Path) -> None:
    """The part directories of a step lie below the run directory the user chose: untrusted too. A load
    of a step whose part is a link, and a first save into a planted link, are refused; a re-save (into a
    new generation directory) commits without touching what the link points to."""
    other, run = tmp_path / "other", tmp_path / "run"
    save(other, SECRET)
    before = files(other)
    net = Net()
    ckpt = Checkpointer(str(run))
    ckpt.save({"net": net}, iteration=7)
    (part,) = run.glob("0000007.net_model.*")  # the save's generation directory
    shutil.rmtree(part)
    part.symlink_to(other, target_is_directory=True)
    with pytest.raises(BaseException) as info:
        Checkpointer(str(run)).load({"net": Net()})  # not read through it
    assert "symbolic link" in error_text(info.value)

    planted = run / "0000008.net_model"  # where first saves of earlier versions wrote
    planted.symlink_to(other, target_is_directory=True)
    ckpt.save({"net": net}, iteration=8)  # into its own generation directory: never through the link
    assert files(other) == before

    with torch.no_grad():
        net.lin.weight.add_(1)
    ckpt.save({"net": net}, iteration=7)  # the re-save: a generation directory, then the marker
    assert files(other) == before  # neither replaced nor deleted through the link
    assert same(load(other), SECRET)
    fresh = Net()
    assert Checkpointer(str(run)).load({"net": fresh}, path=str(run / "0000007")) == 7
    assert same(fresh.state_dict(), net.state_dict())
