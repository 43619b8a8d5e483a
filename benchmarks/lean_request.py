"""What a leaner request path for data parts would save: botocore's SigV4 signer on a prepared request sent
through urllib3, against dcp_s3's botocore client path, on the same server, bytes and run (issue 39).

    python -m benchmarks.lean_request                      # ~2 min: juicefs_shm, 256 MiB, 3 reps
    python -m benchmarks.lean_request --server seaweedfs_shm   # a server that checks the CRC32C

A measurement, not a transport: the lean path here signs and sends UploadPart and ranged GET only, with the
part's CRC32C in ``x-amz-checksum-crc32c`` and an unsigned payload (as dcp_s3's client does), and none of what
dcp_s3's botocore client adds (rate control and its SlowDown figures, request deadlines, retries classified by
error code, error translation, 100-continue). It answers one question: how much client CPU is botocore's
per-request Python, measured by taking it away. Both paths, interleaved in this one process:

* **per request**: CPU (this thread's ``getrusage``) of an UploadPart and a ranged GET of 4 KiB, median over
  rounds, and the Python calls each makes (``cProfile``);
* **per GiB**: one object of ``--size-mib`` up in 16 MiB parts, 8 at a time, from one buffer, and back in 16 MiB
  ranged GETs, 8 at a time, into one buffer (then compared): CPU seconds per GiB of the process and wall seconds.
"""

from __future__ import annotations

import argparse
import base64
import cProfile
import json
import os
import pstats
import resource
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import quote

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import boto3  # noqa: E402
import urllib3  # noqa: E402
from botocore.auth import S3SigV4Auth  # noqa: E402
from botocore.awsrequest import AWSRequest  # noqa: E402
from botocore.config import Config  # noqa: E402
from crc32c import crc32c  # noqa: E402

from benchmarks import common  # noqa: E402
from dcp_s3.objstore.base import RangeRead  # noqa: E402
from dcp_s3.objstore.buffers import BufferPool, BufferReader  # noqa: E402
from dcp_s3.objstore.config import ClientConfig  # noqa: E402
from dcp_s3.objstore.s3 import S3ObjectStore  # noqa: E402
from dcp_s3.objstore.s3_reads import read_group  # noqa: E402

PART = 16 << 20
_UNSIGNED_PAYLOAD = Config(s3={"payload_signing_enabled": False})
CONCURRENCY = 8


class LeanPath:
    """UploadPart and ranged GET: a prepared request, signed by botocore's SigV4 signer, sent by urllib3."""

    def __init__(self, endpoint_url: str, bucket: str, region: str) -> None:
        credentials = boto3.session.Session().get_credentials()
        assert credentials is not None, "no credentials"
        self.signer = S3SigV4Auth(credentials.get_frozen_credentials(), "s3", region)
        self.base = f"{endpoint_url.rstrip('/')}/{bucket}/"
        self.pool = urllib3.PoolManager(maxsize=CONCURRENCY + 2, retries=False)

    def _send(self, method: str, url: str, headers: dict[str, str], body: Any = None) -> Any:
        request = AWSRequest(method=method, url=url, headers=headers)
        request.context["client_config"] = _UNSIGNED_PAYLOAD  # as dcp_s3's client: no SHA-256 of the body
        self.signer.add_auth(request)
        return self.pool.urlopen(
            method, url, body=body, headers=dict(request.headers.items()), preload_content=False, redirect=False
        )

    def upload_part(self, key: str, upload_id: str, number: int, views: list[memoryview], crc: int) -> str:
        url = f"{self.base}{quote(key, safe='/~')}?partNumber={number}&uploadId={quote(upload_id, safe='~')}"
        headers = {
            "Content-Length": str(sum(len(v) for v in views)),
            "x-amz-checksum-crc32c": base64.b64encode(crc.to_bytes(4, "big")).decode("ascii"),
        }
        resp = self._send("PUT", url, headers, views)
        try:
            answer = resp.read()
            if resp.status != 200:
                raise RuntimeError(f"UploadPart {key} #{number}: HTTP {resp.status}: {answer[:300]!r}")
            return str(resp.headers["ETag"])
        finally:
            resp.release_conn()

    def get_range(self, key: str, start: int, dest: memoryview) -> None:
        url = f"{self.base}{quote(key, safe='/~')}"
        resp = self._send("GET", url, {"Range": f"bytes={start}-{start + len(dest) - 1}"})
        try:
            if resp.status != 206:
                raise RuntimeError(f"GET {key} bytes {start}-: HTTP {resp.status}")
            pos = 0
            while pos < len(dest):
                n = resp.readinto(dest[pos : pos + (1 << 20)])
                if not n:
                    raise RuntimeError(f"GET {key}: body ended at {pos} of {len(dest)}")
                pos += n
        finally:
            resp.release_conn()


def _thread_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_THREAD)
    return r.ru_utime + r.ru_stime


def _process_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default="juicefs_shm")
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=10, help="rounds of 4 KiB requests")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "lean_request.json")
    args = parser.parse_args(argv)

    endpoint = common.open_endpoint(args.server, None)
    try:
        os.environ.update(endpoint.env)
        bucket = endpoint.create_bucket(common.new_bucket_name("lean"))
        store = S3ObjectStore(ClientConfig(endpoint_url=endpoint.endpoint_url).client, bucket)
        lean = LeanPath(endpoint.endpoint_url, bucket, endpoint.env.get("AWS_DEFAULT_REGION", "us-east-1"))
        small = memoryview(bytearray(os.urandom(4096)))
        small_crc = crc32c(small)
        upload_id = store.call("create_multipart_upload", "small", Key="small")["UploadId"]
        store.put("small-get", bytes(small))
        dest_small = memoryview(bytearray(4096))

        def boto_up() -> None:
            with BufferReader.of([small], send_block=True) as body:
                store.call(
                    "upload_part",
                    "small",
                    Key="small",
                    UploadId=upload_id,
                    PartNumber=1,
                    Body=body,
                    **store.upload_checksum([small], small_crc),
                )

        def boto_down() -> None:
            read_group(store, [RangeRead("small-get", 0, 4096, lambda: dest_small)])

        def lean_up() -> None:
            lean.upload_part("small", upload_id, 1, [small], small_crc)

        def lean_down() -> None:
            lean.get_range("small-get", 0, dest_small)

        small_ops = {
            ("botocore", "UploadPart"): boto_up,
            ("botocore", "GET"): boto_down,
            ("lean", "UploadPart"): lean_up,
            ("lean", "GET"): lean_down,
        }
        calls: dict[str, float] = {}
        for (path, op), fn in small_ops.items():
            fn()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(20):
                fn()
            prof.disable()
            calls[f"{path} {op}"] = pstats.Stats(prof).total_calls / 20  # type: ignore[attr-defined]
        per_request: dict[str, list[float]] = {f"{p} {o}": [] for p, o in small_ops}
        for _ in range(args.rounds):
            for (path, op), fn in small_ops.items():
                start = _thread_cpu()
                for _ in range(50):
                    fn()
                per_request[f"{path} {op}"].append((_thread_cpu() - start) / 50 * 1e3)
        for name, ms in per_request.items():
            print(f"{name:>22}: {statistics.median(ms):.2f} ms CPU per 4 KiB request, {calls[name]:.0f} Python calls")

        size = args.size_mib << 20
        data = memoryview(bytearray(os.urandom(1 << 20) * args.size_mib))
        dest = memoryview(bytearray(size))
        executor = ThreadPoolExecutor(CONCURRENCY)
        pool = BufferPool(CONCURRENCY + 1, PART)

        def boto_upload(key: str) -> None:
            writer = store.open_writer(key, pool=pool, executor=executor, expected_size=size)
            writer.write_stable(data)
            writer.close()

        def lean_upload(key: str) -> None:
            uid = store.call("create_multipart_upload", key, Key=key)["UploadId"]
            starts = range(0, size, PART)
            futures = [
                executor.submit(lean.upload_part, key, uid, i + 1, [data[s : s + PART]], crc32c(data[s : s + PART]))
                for i, s in enumerate(starts)
            ]
            parts = [{"PartNumber": i + 1, "ETag": f.result()} for i, f in enumerate(futures)]
            store.call("complete_multipart_upload", key, Key=key, UploadId=uid, MultipartUpload={"Parts": parts})

        def boto_download(key: str) -> None:
            reads = [
                RangeRead(key, s, min(size, s + PART), (lambda s=s: dest[s : s + PART])) for s in range(0, size, PART)
            ]
            store.read_ranges(reads, executor=executor, max_gap=0, max_size=PART)

        def lean_download(key: str) -> None:
            futures = [executor.submit(lean.get_range, key, s, dest[s : s + PART]) for s in range(0, size, PART)]
            for f in futures:
                f.result()

        big_ops = {
            ("botocore", "upload"): boto_upload,
            ("lean", "upload"): lean_upload,
            ("botocore", "download"): boto_download,
            ("lean", "download"): lean_download,
        }
        per_gib: dict[str, list[tuple[float, float]]] = {f"{p} {o}": [] for p, o in big_ops}
        boto_upload("warm")
        lean_upload("warm-lean")
        for rep in range(args.reps):
            order = (
                list(big_ops.items())
                if rep % 2 == 0
                else [*reversed(list(big_ops.items())[:2]), *reversed(list(big_ops.items())[2:])]
            )
            for (path, op), fn in order:
                key = f"{path}-{rep}" if op == "upload" else f"{path}-0"
                if op == "download":
                    dest[:] = bytes(size)  # what is compared afterwards must come from this download
                start_cpu, start = _process_cpu(), time.perf_counter()
                fn(key)
                per_gib[f"{path} {op}"].append(
                    ((_process_cpu() - start_cpu) / (size / 2**30), time.perf_counter() - start)
                )
                if op == "download":
                    assert dest == data, f"{path} download differs"
        summary: dict[str, Any] = {"server": args.server, "size_mib": args.size_mib, "reps": args.reps}
        for name, runs in per_gib.items():
            cpu = statistics.median(r[0] for r in runs)
            wall = statistics.median(r[1] for r in runs)
            summary[name] = {"cpu_s_per_gib": round(cpu, 3), "seconds": round(wall, 3)}
            print(f"{name:>22}: {cpu:.3f} CPU s/GiB, {wall:.2f} s (median of {len(runs)})")
        for name, ms in per_request.items():
            summary[f"{name} 4KiB"] = {"cpu_ms": round(statistics.median(ms), 3), "python_calls": round(calls[name])}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
        print(f"wrote {args.out}")
    finally:
        endpoint.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
