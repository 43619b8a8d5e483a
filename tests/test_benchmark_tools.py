"""The benchmark tools of issue 39: stage attribution of perf samples, client/server CPU sampled by PID, and the
shaped link the compressed-load benchmark loads through."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest

from benchmarks import common, link, run, stages


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


def _tc_qdiscs() -> str:
    return subprocess.run(["tc", "qdisc", "show", "dev", link.DEVICE], capture_output=True, text=True).stdout


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("tc") is None, reason="shaping loopback needs root and tc")
def test_a_shaped_link_limits_what_the_server_port_sends_and_is_removed_on_exit() -> None:
    """16 MiB sent from a port shaped to 0.2 Gbit/s cannot arrive in less than 0.67 s (a lower bound: a slow
    machine only adds to it); unshaped again, and once the context is left, the qdisc is gone."""
    assert link.port_of("http://127.0.0.1:8333") == 8333
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    size = 16 << 20

    def serve() -> None:
        for _ in range(2):
            conn, _ = server.accept()
            with conn:
                conn.sendall(bytes(size))

    threading.Thread(target=serve, daemon=True).start()

    def fetch() -> float:
        t0, got = time.perf_counter(), 0
        with socket.create_connection(("127.0.0.1", port)) as conn:
            while chunk := conn.recv(1 << 20):
                got += len(chunk)
        assert got == size
        return time.perf_counter() - t0

    try:
        with link.shaped(port) as set_rate:
            assert "htb" in _tc_qdiscs()
            set_rate(0.2)
            assert fetch() >= 0.5
            set_rate(None)
            fetch()  # unshaped: through the same class, at the loopback's speed
    except subprocess.CalledProcessError as exc:  # a kernel without htb or u32: nothing to test here
        pytest.skip(f"tc refused: {exc.stderr.strip()}")
    finally:
        server.close()
    assert "htb" not in _tc_qdiscs()
