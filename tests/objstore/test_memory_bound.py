"""The memory bound of a save, measured: RSS growth of a real save in a fresh process, with ``awscrt``
importable and with it blocked (docs/configuration.md, "Memory").

``awscrt`` (``boto3[crt]``, many training images) changes botocore's code paths: with it, botocore signs
with its CRT signer, which copied every bytes-like part body whole; glibc kept those copies resident,
one set per upload thread (a 256 MiB save grew RSS by ~403 MiB instead of ~181 MiB). The test extra
installs ``awscrt``, so both environments are measured here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from dcp_s3._local_server import LocalS3Server
from dcp_s3._objstore.config import TransferConfig

MiB = 1 << 20
REPO_ROOT = Path(__file__).resolve().parents[2]
SAVE_MIB = 256  # 16 tensors of 16 MiB: 16 parts of the default 16 MiB, more than the pool's 9 buffers

_defaults = TransferConfig()
#: docs/configuration.md, "Memory": a save holds at most (max_concurrency + files_per_rank) x part_size of part buffers.
PART_BUFFERS = (_defaults.max_concurrency + _defaults.files_per_rank) * _defaults.part_size
#: What a save holds besides its part buffers: botocore's client and S3 service model, threads, DCP's
#: plan and metadata (measured ~40 MiB at 256 MiB and at 1 GiB), with room for a noisy machine.
ALLOWANCE = 96 * MiB
#: The two environments may differ by this much (they measured within 1 MiB of each other).
CLOSE = 64 * MiB

# Runs in a fresh interpreter: argv[1] "block" hides awscrt before boto3/botocore are imported.
_CHILD = r"""
import sys
if sys.argv[1] == "block":
    sys.modules["awscrt"] = None  # import awscrt -> ImportError, as if not installed
import gc, json, resource, threading
import botocore.compat, psutil, torch
import torch.distributed.checkpoint as dcp
from dcp_s3 import S3StorageWriter

proc = psutil.Process()
sd = {f"t{i}": torch.rand(4 << 20) for i in range(int(sys.argv[3]) // 16)}  # 16 MiB fp32 tensors
gc.collect()
maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
start = peak = proc.memory_info().rss
stop = threading.Event()

def sample():
    global peak
    while not stop.wait(0.005):
        peak = max(peak, proc.memory_info().rss)

sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
try:
    dcp.save(sd, storage_writer=S3StorageWriter(sys.argv[2]), no_dist=True)
finally:
    stop.set()
    sampler.join()
peak = max(peak, proc.memory_info().rss)
maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
if maxrss > maxrss_before:  # the lifetime peak was set during the save: exact, catches spikes between samples
    peak = max(peak, maxrss)
print("RESULT " + json.dumps({"crt": botocore.compat.HAS_CRT, "growth": peak - start}))
"""


def _save_growth(bucket: str, block_awscrt: bool) -> tuple[bool, int]:
    """(awscrt in use by botocore, peak RSS growth in bytes) of a ``SAVE_MIB`` save in a fresh process."""
    env = dict(os.environ)  # s3_env: the AWS_* variables point at SeaweedFS
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.pop("BOTO_DISABLE_CRT", None)
    uri = f"s3://{bucket}/memory/{uuid.uuid4().hex[:8]}"
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, "block" if block_awscrt else "allow", uri, str(SAVE_MIB)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("RESULT "))
    result = json.loads(line[len("RESULT ") :])
    return bool(result["crt"]), int(result["growth"])


def test_save_memory_bound_with_and_without_awscrt(bucket: str, s3_env: LocalS3Server) -> None:
    bound = PART_BUFFERS + ALLOWANCE
    crt, without = _save_growth(bucket, block_awscrt=True)
    assert not crt
    assert without <= bound, (
        f"a {SAVE_MIB} MiB save without awscrt grew RSS by {without / MiB:.0f} MiB; bound {bound / MiB:.0f} MiB "
        f"({PART_BUFFERS / MiB:.0f} MiB of part buffers + {ALLOWANCE / MiB:.0f} MiB)"
    )
    if importlib.util.find_spec("awscrt") is None:
        pytest.skip(
            f"awscrt is not installed (the test extra has it): measured only without it, {without / MiB:.0f} MiB"
        )
    crt, with_crt = _save_growth(bucket, block_awscrt=False)
    assert crt, "awscrt is installed but botocore does not use it"
    assert with_crt <= bound, (
        f"a {SAVE_MIB} MiB save with awscrt grew RSS by {with_crt / MiB:.0f} MiB; bound {bound / MiB:.0f} MiB "
        f"({PART_BUFFERS / MiB:.0f} MiB of part buffers + {ALLOWANCE / MiB:.0f} MiB); without awscrt "
        f"{without / MiB:.0f} MiB"
    )
    assert abs(with_crt - without) <= CLOSE, (
        f"RSS growth with awscrt {with_crt / MiB:.0f} MiB, without {without / MiB:.0f} MiB: more than "
        f"{CLOSE / MiB:.0f} MiB apart"
    )


def test_buffer_reader_is_a_seekable_view_of_the_buffer() -> None:
    """What botocore needs of an upload body: reads in pieces, length by seek/tell, rewind for a retry."""
    from botocore.utils import determine_content_length

    from dcp_s3._objstore.buffers import BufferReader

    buf = bytearray(b"0123456789")
    with BufferReader(buf, 7) as body:
        assert body.readable() and body.seekable() and not body.writable()
        assert determine_content_length(body) == 7 and body.tell() == 0
        assert bytes(body.read(3)) == b"012" and bytes(body.read()) == b"3456" and bytes(body.read(5)) == b""
        assert body.seek(0) == 0 and bytes(body.read(None)) == b"0123456"
        assert body.seek(-2, os.SEEK_END) == 5 and bytes(body.read()) == b"56"
        assert body.seek(-1) == 0 and body.seek(3, os.SEEK_CUR) == 3
        body.seek(1)
        out = bytearray(4)
        assert body.readinto(out) == 4 and out == b"1234"
        assert isinstance(body.read(1), memoryview)  # a view, not a copy
    assert body.closed
    buf.extend(b"x")  # close released the view: the buffer may change size again
    with pytest.raises(ValueError):
        body.read()
    assert bytes(BufferReader(b"abc").read()) == b"abc"
