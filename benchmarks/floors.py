"""The floor of each stage of moving a GiB between tensor memory and an S3 server, measured here.

    python -m benchmarks.floors              # ~30 s: 1 GiB through each stage, median of 3
    python -m benchmarks.floors --size-mib 256 --reps 5

What a save or a load cannot do with less CPU, stage by stage, on this machine (client process CPU
seconds per GiB, ``getrusage``: every thread, the kernel's work on our behalf included):

* ``memcpy``: one copy of the bytes (numpy ``copyto`` in 16 MiB pieces, warm destination).
* ``page faults``: first touch of fresh memory (a buffer never written before), per GiB: plain ``mmap``
  (4 KiB pages) and ``numpy.empty`` (which asks for huge pages).
* ``crc32c``: the ``crc32c`` package (hardware CRC32C), as dcp_s3 checksums items and parts.
* ``sha256``: ``hashlib`` — what SigV4 payload signing (``x-amz-content-sha256``) would cost.
* ``tcp send`` / ``tcp recv``: the same bytes through a loopback TCP socket, in 1 MiB ``sendall``/
  ``recv_into`` calls; a child process is the other end, so only our side is counted.
* ``tls send`` / ``tls recv``: the same over TLS 1.3 (Python's ``ssl``, the AES-GCM suite OpenSSL
  negotiates), the child being a TLS server with a throw-away ``trustme`` certificate.
* ``aes-256-gcm seal`` / ``open``: the cipher alone (OpenSSL through ``cryptography``'s ``AESGCM``) on TLS's
  16 KiB records, no socket: what any TLS stack, in Python, in Rust or in the kernel, must spend per GiB
  here, give or take the few microseconds of a call per record.

The floor of a save (HTTP) is about ``tcp send`` + ``crc32c`` (+ ``memcpy`` where a byte must be copied);
of a load, ``tcp recv`` + ``crc32c``; add the TLS difference for HTTPS. ``benchmarks/README.md`` sets
dcp_s3's per-stage profile (``benchmarks.stages``) against these.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import socket
import ssl
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402

CHUNK = 1 << 20
PIECE = 16 << 20
RECORD = 16 << 10  # a TLS record's plaintext, at most


def _cpu() -> float:
    return common.cpu_seconds()


def _timed(fn: Callable[[], None]) -> tuple[float, float]:
    c0, t0 = _cpu(), time.perf_counter()
    fn()
    return _cpu() - c0, time.perf_counter() - t0


def floor_memcpy(src: Any, size: int) -> tuple[float, float]:
    import numpy as np

    dst = np.empty(PIECE, dtype=np.uint8)
    dst[:] = 1  # resident: this measures the copy, not the page faults

    def run() -> None:
        for off in range(0, size, PIECE):
            np.copyto(dst[: min(PIECE, size - off)], src[off : off + PIECE])

    return _timed(run)


def floor_page_faults(size: int, numpy_empty: bool) -> tuple[float, float]:
    """First touch of ``size`` fresh bytes, one write per 4 KiB page: the fault and the kernel zeroing the page.
    ``numpy_empty``: the memory of ``numpy.empty``, which numpy marks ``MADV_HUGEPAGE`` (2 MiB pages where the
    kernel has them, found by compaction: on this VM far dearer); else plain ``mmap`` (4 KiB pages)."""
    import mmap

    import numpy as np

    def run() -> None:
        buf = np.empty(size, dtype=np.uint8) if numpy_empty else np.frombuffer(mmap.mmap(-1, size), dtype=np.uint8)
        buf[::4096] = 1
        del buf

    return _timed(run)


def floor_crc32c(src: Any, size: int) -> tuple[float, float]:
    from crc32c import crc32c

    view = memoryview(src)

    def run() -> None:
        crc = 0
        for off in range(0, size, PIECE):
            crc = crc32c(view[off : off + PIECE], crc)

    return _timed(run)


def floor_aes_gcm(size: int, direction: str) -> tuple[float, float]:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    aead, nonce, record = AESGCM(AESGCM.generate_key(256)), os.urandom(12), os.urandom(RECORD)
    sealed = aead.encrypt(nonce, record, None)

    def run() -> None:
        for _ in range(size // RECORD):
            if direction == "seal":
                aead.encrypt(nonce, record, None)
            else:
                aead.decrypt(nonce, sealed, None)

    return _timed(run)


def floor_sha256(src: Any, size: int) -> tuple[float, float]:
    view = memoryview(src)

    def run() -> None:
        h = hashlib.sha256()
        for off in range(0, size, PIECE):
            h.update(view[off : off + PIECE])

    return _timed(run)


# -- the other end of a socket, in a child process ------------------------------------------------
def _peer(mode: str, port_q: Any, size: int, tls: tuple[str, str] | None) -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    if tls is not None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(tls[0], tls[1])
        conn = ctx.wrap_socket(conn, server_side=True)
    if mode == "sink":  # we send, the peer receives and discards
        buf = bytearray(CHUNK)
        got = 0
        while got < size:
            n = conn.recv_into(buf)
            if not n:
                break
            got += n
        conn.sendall(b"k")
    else:  # we receive, the peer sends
        data = os.urandom(CHUNK)
        sent = 0
        while sent < size:
            conn.sendall(data[: min(CHUNK, size - sent)])
            sent += min(CHUNK, size - sent)
        conn.recv(1)
    conn.close()
    srv.close()


def floor_socket(src: Any, size: int, direction: str, tls: tuple[str, str, str] | None) -> tuple[float, float]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    peer = ctx.Process(
        target=_peer, args=("sink" if direction == "send" else "source", q, size, (tls[0], tls[1]) if tls else None)
    )
    peer.start()
    port = q.get(timeout=30)
    sock = socket.create_connection(("127.0.0.1", port))
    if tls is not None:
        cctx = ssl.create_default_context(cafile=tls[2])
        sock = cctx.wrap_socket(sock, server_hostname="127.0.0.1")
        sock.do_handshake()
    view = memoryview(src)
    buf = bytearray(CHUNK)

    def send() -> None:
        for off in range(0, size, CHUNK):
            sock.sendall(view[off : off + CHUNK])
        sock.recv(1)

    def recv() -> None:
        got = 0
        out = memoryview(buf)
        while got < size:
            n = sock.recv_into(out)
            if not n:
                raise ConnectionError("peer closed early")
            got += n
        sock.sendall(b"k")

    try:
        return _timed(send if direction == "send" else recv)
    finally:
        sock.close()
        peer.join(30)


def measure(size: int, reps: int) -> dict[str, dict[str, float]]:
    import numpy as np

    src = np.frombuffer(os.urandom(size), dtype=np.uint8).copy()
    where = tempfile.mkdtemp(prefix="dcp-s3-floors-")
    from benchmarks.servers import make_tls

    tls = make_tls(where)
    stages: dict[str, Callable[[], tuple[float, float]]] = {
        "memcpy": lambda: floor_memcpy(src, size),
        "page faults (first touch, mmap)": lambda: floor_page_faults(size, False),
        "page faults (first touch, numpy.empty)": lambda: floor_page_faults(size, True),
        "crc32c": lambda: floor_crc32c(src, size),
        "sha256 (payload signing)": lambda: floor_sha256(src, size),
        "tcp send (loopback)": lambda: floor_socket(src, size, "send", None),
        "tcp recv (loopback)": lambda: floor_socket(src, size, "recv", None),
        "tls send (loopback)": lambda: floor_socket(src, size, "send", tls),
        "tls recv (loopback)": lambda: floor_socket(src, size, "recv", tls),
        "aes-256-gcm seal (16 KiB records, cipher alone)": lambda: floor_aes_gcm(size, "seal"),
        "aes-256-gcm open (16 KiB records, cipher alone)": lambda: floor_aes_gcm(size, "open"),
    }
    gib = size / (1 << 30)
    out: dict[str, dict[str, float]] = {}
    runs: dict[str, list[tuple[float, float]]] = {k: [] for k in stages}
    for _ in range(reps):
        for name, fn in stages.items():
            runs[name].append(fn())
    for name, rs in runs.items():
        cpu = common.median([r[0] for r in rs]) or 0.0
        wall = common.median([r[1] for r in rs]) or 0.0
        out[name] = {"cpu_s_per_gib": cpu / gib, "gib_per_s": gib / wall if wall else 0.0}
    return out


def render(result: dict[str, dict[str, float]]) -> str:
    rows = [[k, common.fmt(v["cpu_s_per_gib"], 3), common.fmt(v["gib_per_s"], 2)] for k, v in result.items()]
    get = {k: v["cpu_s_per_gib"] for k, v in result.items()}
    save = get["tcp send (loopback)"] + get["crc32c"]
    load = get["tcp recv (loopback)"] + get["crc32c"]
    save_tls = get["tls send (loopback)"] + get["crc32c"]
    load_tls = get["tls recv (loopback)"] + get["crc32c"]
    seal = get["aes-256-gcm seal (16 KiB records, cipher alone)"]
    open_ = get["aes-256-gcm open (16 KiB records, cipher alone)"]
    return (
        common.markdown_table(["stage", "client CPU s/GiB", "GiB/s (one thread)"], rows)
        + f"\n\nFloor of a save = tcp send + crc32c = {save:.3f} s/GiB (HTTPS: {save_tls:.3f}); "
        f"of a load = tcp recv + crc32c = {load:.3f} s/GiB (HTTPS: {load_tls:.3f}). "
        f"The cipher alone adds {seal:.3f} s/GiB to a save and {open_:.3f} to a load over any TLS stack: "
        f"an HTTPS row at 1.3x an HTTP row of 0.6 s/GiB would leave it 0.18."
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=common.RESULTS_DIR / "floors.json")
    args = ap.parse_args(argv)
    result = measure(args.size_mib << 20, args.reps)
    table = render(result)
    print(table)
    common.write_json(
        args.out,
        {
            "benchmark": "floors",
            "size_mib": args.size_mib,
            "reps": args.reps,
            "machine": common.machine_info(),
            "result": result,
            "tables_markdown": table,
        },
    )
    args.out.with_suffix(".md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
