"""The benchmark tools of issue 39: stage attribution of perf samples, and client/server CPU sampled by PID."""

from __future__ import annotations

import subprocess
import sys
import time

from benchmarks import common, run, stages


def test_perf_samples_land_in_their_stage() -> None:
    cases = {
        ("_crc32c.cpython-311-x86_64-linux-gnu.so", "_crc32c_hw_adler"): "checksums",
        ("[kernel.kallsyms]", "_copy_from_iter"): "socket (kernel copies, TCP/IP on loopback)",
        ("[kernel.kallsyms]", "tcp_sendmsg_locked"): "socket (kernel copies, TCP/IP on loopback)",
        ("[kernel.kallsyms]", "clear_page_erms"): "page faults",
        ("[kernel.kallsyms]", "futex_wait"): "thread hand-offs (futex, scheduling)",
        ("libc.so.6", "__memmove_evex_unaligned_erms"): "tensor → bytes, copies (memcpy)",
        ("libcrypto.so.3", "aes_gcm_enc_512_kernel"): "TLS (encrypt, decrypt, records)",
        ("libcrypto.so.3", "sha256_block_data_order_shaext"): "signing (SHA-256, HMAC)",
        (
            "libpython3.11.so.1.0",
            "_PyEval_EvalFrameDefault",
        ): "Python per request/item (interpreter, botocore, urllib3, DCP)",
        ("libtorch_cpu.so", "at::native::copy_"): "torch (headers, planning)",
        ("libfoo.so", "bar"): "other",
    }
    got = {k: stages.classify(*k) for k in cases}
    assert got == cases


def test_cpu_of_client_and_server_sampled_by_pid_says_which_side_was_busy() -> None:
    """A busy 'server' process and an idle 'client' process: the sampler sees the server near one core, the
    client near zero, and the table's column names the server as the busier side."""
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<3: pass"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"])
    try:
        sampler = common.CPUSampler(idle.pid, busy.pid, interval=0.05)
        start = time.time()
        time.sleep(1.5)
        end = time.time()
        sampler.stop()
    finally:
        busy.kill()
        idle.kill()
        busy.wait()
        idle.wait()
    shares = sampler.shares(start, end)
    assert shares["client_cpu_pct"] is not None and shares["server_cpu_pct"] is not None
    # One core spinning against one sleeping, on a shared machine (other jobs take their share of the cores).
    assert shares["client_cpu_pct"] < 5
    assert shares["server_cpu_pct"] > 10
    assert run.saturation({"x": {"save": shares}}, "x", "save").split(": ")[1].startswith("server")
    assert run.saturation({"x": {"save": {}}}, "x", "save") == "—"
