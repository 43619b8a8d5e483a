"""Text in and out of the ``dcp-s3`` command line: sizes, durations, ``KEY=VALUE`` request
arguments, tables and a progress line; everything printed from a checkpoint goes through
:func:`printable` so that crafted keys and names cannot drive the terminal."""

from __future__ import annotations

import argparse
import re
import sys
import time
from typing import Any

__all__ = ["human_size", "parse_duration", "parse_request_arg", "printable", "say", "when", "table", "ProgressLine"]


def human_size(n: int | None) -> str:
    """``1536`` → ``1.5 KiB``."""
    if n is None:
        return "-"
    size = float(n)
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    i = 0
    while abs(size) >= 1024 and i < len(units) - 1:
        size /= 1024
        i += 1
    return f"{int(size)} B" if i == 0 else f"{size:.1f} {units[i]}"


def parse_duration(text: str) -> float:
    """``90s``, ``30m``, ``1h``, ``2d``, ``1w`` or a number of seconds → seconds."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([smhdw]?)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"invalid duration {text!r}; use e.g. 90s, 30m, 1h, 2d")
    scale = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[match[2]]
    return float(match[1]) * scale


def parse_request_arg(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` -> (KEY, VALUE); ``BucketKeyEnabled`` takes ``true``/``false``."""
    key, sep, value = text.partition("=")
    if not sep or not key or not value:
        raise argparse.ArgumentTypeError(
            f"invalid request argument {text!r}; use KEY=VALUE, e.g. ServerSideEncryption=aws:kms"
        )
    if key == "BucketKeyEnabled":
        if value.lower() not in ("true", "false"):
            raise argparse.ArgumentTypeError(f"BucketKeyEnabled={value!r}: expected true or false")
        return key, value.lower() == "true"
    return key, value


def printable(text: str) -> str:
    """``text`` with every non-printable character (control and format characters such as ESC,
    CR, newline, bidi overrides) escaped as ``\\xNN``/``\\uNNNN``: object keys and names read from
    a checkpoint reach the terminal as text, never as terminal commands."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def say(text: str) -> None:
    print(printable(text))


def when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def table(rows: list[list[str]], right: set[int]) -> str:
    rows = [[printable(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


class ProgressLine:
    """``label: 42% 1.2 GiB/2.9 GiB`` on stderr, rewritten in place; silent unless stderr is a terminal."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.enabled = sys.stderr.isatty()
        self._last = 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self._last < 0.2 and done < total):
            return
        self._last = now
        pct = 100 * done // total if total else 100
        sys.stderr.write(f"\r{self.label}: {pct:3d}% {human_size(done)}/{human_size(total)}\x1b[K")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
