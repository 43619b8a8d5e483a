"""Data objects through three transports on the same bytes, server and run: dcp_s3's boto3 path, obstore, awscrt.

    python -m benchmarks.transports                       # ~2 min: 512 MiB up and down, 3 reps, juicefs_shm
    python -m benchmarks.transports --server seaweedfs_shm --https    # the same over HTTPS (trustme CA)

Each repetition, for each transport in turn (interleaved), in this one process:

* **upload**: one object of ``--size-mib`` from one buffer in 16 MiB parts, 8 at a time, each part
  carrying its CRC32C where the transport can send one;
* **download**: the same object back into a preallocated buffer (the tensor memory of a load), 16 MiB
  ranged GETs, 8 at a time, then compared with what was sent.

Transports:

* ``dcp_s3_boto3``: ``S3ObjectStore.open_writer(...).write_stable`` / ``read_ranges`` — what a dcp_s3 save
  and load do (parts sent from the caller's memory with their CRC32C, bodies ``readinto`` the destination).
* ``obstore``: ``obstore.put(..., chunk_size=16 MiB, max_concurrency=8)`` and ``get_ranges`` (Rust
  ``object_store``, GIL released); the ranges arrive as Rust buffers, copied into the destination.
  Unsigned payloads, no per-part checksum (obstore 0.12 sends none).
* ``awscrt``: ``awscrt.s3.S3Client`` meta-requests (C threads): PUT from a stream over the buffer with CRC32C
  per part (``S3ChecksumConfig``), GET with 16 MiB parts written into the destination from ``on_body``.

Client CPU per GiB is ``getrusage`` of this process over each operation (every thread, native ones too).
"""

from __future__ import annotations

import argparse
import io
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common, servers  # noqa: E402
from benchmarks.worker import _perf  # noqa: E402

PART = 16 << 20
CONCURRENCY = 8


class Transport:
    name = ""

    def upload(self, key: str, data: memoryview) -> None:
        raise NotImplementedError

    def download(self, key: str, dest: memoryview) -> None:
        raise NotImplementedError


class Boto3Path(Transport):
    name = "dcp_s3_boto3"

    def __init__(self, endpoint: common.Endpoint, bucket: str) -> None:
        from dcp_s3.objstore.buffers import BufferPool
        from dcp_s3.objstore.config import ClientConfig
        from dcp_s3.objstore.s3 import S3ObjectStore

        cfg = ClientConfig(endpoint_url=endpoint.endpoint_url, verify=endpoint.env.get("AWS_CA_BUNDLE") or True)
        self.store = S3ObjectStore(cfg.client, bucket)
        self.pool = BufferPool(CONCURRENCY + 1, PART)
        self.executor = ThreadPoolExecutor(CONCURRENCY)

    def upload(self, key: str, data: memoryview) -> None:
        writer = self.store.open_writer(key, pool=self.pool, executor=self.executor, expected_size=len(data))
        writer.write_stable(data)
        writer.close()

    def download(self, key: str, dest: memoryview) -> None:
        from dcp_s3.objstore.base import RangeRead

        reads = [
            RangeRead(key, s, min(len(dest), s + PART), (lambda s=s: dest[s : s + PART]))
            for s in range(0, len(dest), PART)
        ]
        self.store.read_ranges(reads, executor=self.executor, max_gap=0, max_size=PART)


class Obstore(Transport):
    name = "obstore"

    def __init__(self, endpoint: common.Endpoint, bucket: str) -> None:
        from obstore.store import S3Store

        env = endpoint.env
        opts: dict[str, Any] = {"allow_http": True}
        if env.get("AWS_CA_BUNDLE"):
            # obstore 0.12 takes no CA argument (only allow_invalid_certificates, never used here); its rustls
            # client loads the platform's roots, which SSL_CERT_FILE replaces.
            os.environ["SSL_CERT_FILE"] = env["AWS_CA_BUNDLE"]
        self.store = S3Store(
            bucket,
            endpoint=endpoint.endpoint_url,
            access_key_id=env["AWS_ACCESS_KEY_ID"],
            secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            region="us-east-1",
            virtual_hosted_style_request=False,
            unsigned_payload=True,
            client_options=opts,
        )

    def upload(self, key: str, data: memoryview) -> None:
        import obstore

        obstore.put(self.store, key, data, chunk_size=PART, max_concurrency=CONCURRENCY)

    def download(self, key: str, dest: memoryview) -> None:
        import obstore

        starts = list(range(0, len(dest), PART))
        ends = [min(len(dest), s + PART) for s in starts]

        def one(i: int) -> None:  # get_ranges coalesces; one range per thread keeps 8 requests in flight
            got = obstore.get_range(self.store, key, start=starts[i], end=ends[i])
            dest[starts[i] : ends[i]] = memoryview(got)

        with ThreadPoolExecutor(CONCURRENCY) as pool:
            list(pool.map(one, range(len(starts))))


class AwsCrt(Transport):
    name = "awscrt"

    def __init__(self, endpoint: common.Endpoint, bucket: str) -> None:
        from urllib.parse import urlsplit

        from awscrt import auth, s3
        from awscrt import io as crt_io

        env = endpoint.env
        self.bucket = bucket
        url = urlsplit(endpoint.endpoint_url)
        self.host = url.netloc
        self.https = url.scheme == "https"
        elg = crt_io.EventLoopGroup(CONCURRENCY)
        bootstrap = crt_io.ClientBootstrap(elg, crt_io.DefaultHostResolver(elg))
        creds = auth.AwsCredentialsProvider.new_static(env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"])
        tls = None
        if self.https:
            opts = crt_io.TlsContextOptions()
            if env.get("AWS_CA_BUNDLE"):
                opts.override_default_trust_store_from_path(None, env["AWS_CA_BUNDLE"])
            tls = crt_io.ClientTlsContext(opts).new_connection_options()
            tls.set_server_name(url.hostname)
        self.client = s3.S3Client(
            bootstrap=bootstrap,
            region="us-east-1",
            part_size=PART,
            throughput_target_gbps=10.0,
            tls_mode=s3.S3RequestTlsMode.ENABLED if self.https else s3.S3RequestTlsMode.DISABLED,
            tls_connection_options=tls,
            signing_config=auth.AwsSigningConfig(
                algorithm=auth.AwsSigningAlgorithm.V4,
                signature_type=auth.AwsSignatureType.HTTP_REQUEST_HEADERS,
                service="s3",
                region="us-east-1",
                credentials_provider=creds,
                signed_body_value=auth.AwsSignedBodyValue.UNSIGNED_PAYLOAD,
            ),
        )
        self._s3 = s3

    def _request(self, method: str, key: str, size: int | None, **kw: Any) -> None:
        from awscrt import http

        headers = http.HttpHeaders([("Host", self.host)])
        if size is not None:
            headers.add("Content-Length", str(size))
        req = http.HttpRequest(method, f"/{self.bucket}/{key}", headers, kw.pop("body_stream", None))
        done = threading.Event()
        err: list[BaseException] = []

        def on_done(error: BaseException | None = None, status_code: int | None = None, **_: Any) -> None:
            if error is not None:
                err.append(error)
            done.set()

        t = self._s3.S3RequestType.PUT_OBJECT if method == "PUT" else self._s3.S3RequestType.GET_OBJECT
        mr = self.client.make_request(type=t, request=req, on_done=on_done, **kw)
        if not done.wait(300):
            mr.cancel()
            raise TimeoutError(f"awscrt {method} {key}: no answer in 300 s")
        if err:
            raise RuntimeError(f"awscrt {method} {key}: {err[0]}")

    def upload(self, key: str, data: memoryview) -> None:
        cfg = self._s3.S3ChecksumConfig(
            algorithm=self._s3.S3ChecksumAlgorithm.CRC32C, location=self._s3.S3ChecksumLocation.HEADER
        )
        self._request("PUT", key, len(data), body_stream=_ViewStream(data), checksum_config=cfg)

    def download(self, key: str, dest: memoryview) -> None:
        def on_body(chunk: Any, offset: int, **_: Any) -> None:
            dest[offset : offset + len(chunk)] = chunk

        self._request("GET", key, None, on_body=on_body)


class _ViewStream(io.RawIOBase):
    """A readable stream over a buffer (copies into the CRT's buffers, as any CRT upload from memory does)."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view, self._pos = view, 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = min(len(b), len(self._view) - self._pos)
        memoryview(b)[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = {0: 0, 1: self._pos, 2: len(self._view)}[whence] + offset
        return self._pos


TRANSPORTS: dict[str, Callable[[common.Endpoint, str], Transport]] = {
    "dcp_s3_boto3": Boto3Path,
    "obstore": Obstore,
    "awscrt": AwsCrt,
}


def main(argv: list[str] | None = None) -> int:
    import numpy as np

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--server", choices=list(servers.KINDS), default="juicefs_shm")
    ap.add_argument("--https", action="store_true", help="over HTTPS (the server must serve TLS: seaweedfs_shm)")
    ap.add_argument("--transports", default=",".join(TRANSPORTS))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--perf", default="", help="upload,download: sample these under a perf record --control (stages)")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    size = args.size_mib << 20
    data = np.frombuffer(os.urandom(size), dtype=np.uint8).copy()
    dest = np.zeros(size, dtype=np.uint8)
    endpoint = common.open_endpoint(args.server, https=args.https)
    runs: dict[str, list[dict[str, float]]] = {}
    try:
        ep = endpoint.https() if args.https else endpoint
        assert ep is not None
        os.environ.update(ep.env)
        bucket = ep.create_bucket(common.new_bucket_name("tr"))
        made = {n: TRANSPORTS[n](ep, bucket) for n in args.transports.split(",")}
        for rep in range(args.reps):
            for name, tr in made.items():
                key = f"tr/{name}/{rep}"
                dest[:] = 0
                r: dict[str, float] = {}
                for op, fn in (
                    ("upload", lambda: tr.upload(key, memoryview(data))),
                    ("download", lambda: tr.download(key, memoryview(dest))),
                ):
                    c0, t0 = common.cpu_seconds(), time.perf_counter()
                    if op in args.perf:
                        _perf("enable")
                    fn()
                    if op in args.perf:
                        _perf("disable")
                    wall, cpu = time.perf_counter() - t0, common.cpu_seconds() - c0
                    r[f"{op}_cpu_s_per_gib"] = cpu / (size / common.GiB)
                    r[f"{op}_mib_s"] = args.size_mib / wall
                if not np.array_equal(data, dest):
                    raise SystemExit(f"{name}: the bytes read back differ from those sent")
                runs.setdefault(name, []).append(r)
                print(
                    f"  rep {rep} {name:>13}: up {r['upload_mib_s']:5.0f} MiB/s {r['upload_cpu_s_per_gib']:.2f} "
                    f"CPU s/GiB; down {r['download_mib_s']:5.0f} MiB/s {r['download_cpu_s_per_gib']:.2f} CPU s/GiB",
                    flush=True,
                )
                ep.delete_prefix(bucket, key)
    finally:
        endpoint.stop()
    base = (
        {f: common.median([r[f] for r in runs["dcp_s3_boto3"]]) for f in runs["dcp_s3_boto3"][0]}
        if "dcp_s3_boto3" in runs
        else None
    )
    rows = []
    for name, rs in runs.items():
        m = {f: common.median([r[f] for r in rs]) or 0.0 for f in rs[0]}
        rel = (lambda f, inv=False: f"{(base[f] / m[f]) if inv else (m[f] / base[f]):.2f}x") if base else None
        rows.append(
            [
                name,
                common.fmt(m["upload_cpu_s_per_gib"]),
                common.fmt(m["download_cpu_s_per_gib"]),
                common.fmt(m["upload_mib_s"], 0),
                common.fmt(m["download_mib_s"], 0),
                rel("upload_cpu_s_per_gib", True) if rel else "—",
                rel("download_cpu_s_per_gib", True) if rel else "—",
                rel("upload_mib_s") if rel else "—",
                rel("download_mib_s") if rel else "—",
            ]
        )
    table = common.markdown_table(
        [
            "transport",
            "upload CPU s/GiB",
            "download CPU s/GiB",
            "upload MiB/s",
            "download MiB/s",
            "upload: less CPU than boto3 path",
            "download: less CPU",
            "upload: throughput vs boto3 path",
            "download: throughput",
        ],
        rows,
    )
    print()
    print(table)
    out = args.out or common.RESULTS_DIR / f"transports_{'https' if args.https else 'http'}.json"
    common.write_json(
        out,
        {
            "benchmark": "transports",
            "server": args.server,
            "https": args.https,
            "size_mib": args.size_mib,
            "reps": args.reps,
            "machine": common.machine_info(),
            "runs": runs,
            "tables_markdown": table,
        },
    )
    out.with_suffix(".md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    tempfile.tempdir = None
    sys.exit(main())
