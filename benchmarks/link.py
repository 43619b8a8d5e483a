"""A link of a chosen rate between the benchmark server and the client, on this machine's loopback device.

What the server sends from its port goes through an HTB class (Linux ``tc``: the ``htb`` qdisc and the
``u32`` filter) whose rate :func:`shaped` lets the caller change between loads; everything else on the
loopback device goes through a class of 1,000 Gbit/s. Requests to the server are not shaped: a load's
bytes flow from the server. Needs root; the qdisc is removed on exit, whatever happened.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

DEVICE = "lo"
#: The rate "unshaped" stands for: far above what loopback moves on this machine.
UNSHAPED_GBIT = 1000


def _tc(*args: str) -> None:
    subprocess.run(["tc", *args], check=True, capture_output=True, text=True)


def port_of(endpoint_url: str) -> int:
    port = urlsplit(endpoint_url).port
    if port is None:
        raise ValueError(f"{endpoint_url}: no port to shape")
    return port


def _shaped_class(verb: str, gbit: float) -> None:
    _tc("class", verb, "dev", DEVICE, "parent", "1:", "classid", "1:20", "htb", "rate", f"{gbit:g}gbit", "burst", "4mb")


@contextmanager
def shaped(port: int) -> Iterator[Callable[[float | None], None]]:
    """Shape what the server sends from ``port``; yields ``set_rate(gbit)`` (``None``: unshaped)."""
    _tc("qdisc", "add", "dev", DEVICE, "root", "handle", "1:", "htb", "default", "10")
    try:
        _tc("class", "add", "dev", DEVICE, "parent", "1:", "classid", "1:10", "htb", "rate", f"{UNSHAPED_GBIT}gbit")
        _shaped_class("add", UNSHAPED_GBIT)
        match = ("u32", "match", "ip", "sport", str(port), "0xffff", "flowid", "1:20")
        _tc("filter", "add", "dev", DEVICE, "parent", "1:", "protocol", "ip", "prio", "1", *match)
        yield lambda gbit: _shaped_class("change", UNSHAPED_GBIT if gbit is None else gbit)
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", DEVICE, "root"], capture_output=True)
