"""What each ``dcp-s3`` sub-command does: a thin layer over :mod:`dcp_s3.admin`, one function per
sub-command that calls one admin function and prints its result.

Each returns the exit status (``verify`` returns 1 when it finds a problem); :mod:`~dcp_s3._cli.commands`
parses the arguments and turns an error into one line on stderr. :mod:`dcp_s3.admin` is imported inside
each function so that ``dcp-s3 --help`` and argument errors answer without importing torch.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import threading
from typing import Any

# The commands below use these under private names.
from dcp_s3._cli.text import ProgressLine as _ProgressLine
from dcp_s3._cli.text import human_size
from dcp_s3._cli.text import say as _say
from dcp_s3._cli.text import table as _table
from dcp_s3._cli.text import when as _when
from dcp_s3._cli.tier_table import print_local_tier as _print_local_tier
from dcp_s3._objstore.uri import s3_location
from dcp_s3.errors import ConfigError

__all__ = [
    "cmd_convert",
    "cmd_cp",
    "cmd_demo",
    "cmd_gc",
    "cmd_inspect",
    "cmd_ls",
    "cmd_rm",
    "cmd_server",
    "cmd_verify",
]


# -- commands ----------------------------------------------------------------------------------------
def _options(args: argparse.Namespace, uri: str) -> dict[str, Any]:
    """Storage options from the command line: ``--max-whole-read`` for every location, the S3 client
    options for s3:// locations only."""
    options: dict[str, Any] = {}
    if getattr(args, "max_whole_read", None) is not None:
        options["max_whole_read"] = args.max_whole_read
    if s3_location(uri) is None:
        return options
    names = (
        "credential_path",
        "endpoint_url",
        "region",
        "profile",
        "connect_timeout",
        "read_timeout",
        "retry_attempts",
        "verify",
        "client_cert",
        "addressing_style",
    )
    options.update({n: getattr(args, n) for n in names if getattr(args, n, None) is not None})
    if getattr(args, "request_args", None):
        options["request_args"] = dict(args.request_args)
    return options


def cmd_ls(args: argparse.Namespace) -> int:
    from dcp_s3.admin import is_local_tier_root, list_local_tier, list_steps, refused_rank_dirs

    if args.s3 is not None or is_local_tier_root(args.uri):
        tier_rows = list_local_tier(args.uri, args.s3, **({} if args.s3 is None else _options(args, args.s3)))
        _print_local_tier(args.uri, tier_rows, args.s3, refused_rank_dirs(args.uri))
        return 0
    steps = list_steps(args.uri, **_options(args, args.uri))
    # TENSORS and COMPRESSION count tensor items only; STORED every object (metadata, byte items, markers too)
    rows = [["STEP", "STATUS", "STORED", "TENSORS", "COMPRESSION", "OBJECTS", "TIME"]]
    for s in steps:
        status = ("UNREADABLE" if s.unreadable else "complete" if s.complete else "INCOMPLETE") + (
            " (dcp)" if s.kind == "dcp" else ""
        )
        ratio = f"{s.ratio:.2f}x" if s.ratio is not None else "-"
        rows.append(
            [
                s.name,
                status,
                human_size(s.stored_bytes),
                human_size(s.logical_bytes),
                ratio,
                str(s.objects),
                _when(s.mtime),
            ]
        )
    print(_table(rows, right={2, 3, 4, 5}))
    if steps:
        print("STORED: every object; TENSORS: the tensors' bytes; COMPRESSION: TENSORS / their items' stored bytes")
    for s in steps:
        if s.unreadable:
            _say(f"{s.name}: {s.error or 'unreadable'}")
    done = sum(s.complete and not s.unreadable for s in steps)
    print(
        f"{len(steps)} checkpoint{'' if len(steps) == 1 else 's'} ({done} complete, {len(steps) - done} incomplete), "
        f"{human_size(sum(s.stored_bytes for s in steps))} stored"
    )
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from dcp_s3.admin import inspect_checkpoint

    entries = inspect_checkpoint(args.uri, **_options(args, args.uri))
    if args.json:
        print(json.dumps([e.__dict__ for e in entries], indent=2))
        return 0
    for part in sorted({e.part for e in entries}):
        mine = [e for e in entries if e.part == part]
        if part:
            _say(f"== {part}")
        rows = [["NAME", "SHAPE", "DTYPE", "CHUNKS", "STORED"]]
        for e in mine:
            shape = "x".join(map(str, e.shape)) if e.shape else ("scalar" if e.kind == "tensor" else "-")
            rows.append(
                [
                    e.fqn,
                    shape,
                    e.dtype or "object",
                    str(len(e.chunks)) if e.kind == "tensor" else "-",
                    human_size(e.stored_bytes),
                ]
            )
        print(_table(rows, right={3, 4}))
        tensors = [e for e in mine if e.kind == "tensor"]
        logical = sum(e.logical_bytes for e in tensors)
        stored = sum(e.stored_bytes for e in tensors)
        ratio = f", ratio {logical / stored:.2f}x" if stored else ""
        print(
            f"{len(tensors)} tensors ({human_size(logical)}), {len(mine) - len(tensors)} other entries, "
            f"{human_size(stored)} stored{ratio}"
        )
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from dcp_s3.admin import verify_checkpoint

    bar = _ProgressLine("verify")
    try:
        report = verify_checkpoint(args.uri, progress=bar, **_options(args, args.uri))
    finally:
        bar.close()
    for p in report.problems:
        item = f" [{p.item}]" if p.item else ""
        _say(f"FAIL {p.url}{item}: {p.message}")
    summary = (
        f"{report.checkpoints} checkpoint{'' if report.checkpoints == 1 else 's'}, {report.objects} objects, {report.items} items, "
        f"{human_size(report.bytes_read)} read"
    )
    if report.ok:
        print(f"OK: {summary}")
        return 0
    print(f"{len(report.problems)} problems: {summary}")
    return 1


def cmd_gc(args: argparse.Namespace) -> int:
    from dcp_s3.admin import collect_garbage, find_garbage

    garbage = find_garbage(args.uri, older_than=args.older_than, **_options(args, args.uri))
    url = garbage.store.url
    verb = "removing" if args.yes else "would remove"
    removed = {o.name for o in garbage.objects}
    for step in garbage.steps:
        mine = [o for o in step.objects if o.name in removed]
        _say(
            f"{verb} incomplete {'step' if step.kind == 'step' else 'checkpoint'} {url(step.name)} "
            f"({len(mine)} objects, {human_size(sum(o.size for o in mine))})"
        )
    for entry in garbage.objects:
        _say(f"{verb} {url(entry.name)} ({human_size(entry.size)})")
    for upload in garbage.uploads:
        _say(f"{verb} unfinished upload {url(upload.name)} (started {_when(upload.initiated)})")
    for entry in garbage.kept:
        _say(f"keeping {url(entry.name)} (not a checkpoint object)")
    for where, why in garbage.skipped:
        _say(f"skipping {where}: {why}")
    if not garbage.objects and not garbage.uploads:
        _say(f"nothing to remove under {args.uri} (older than {args.older_than:g}s)")
        return 0
    if not args.yes:
        print(
            f"dry run: {len(garbage.objects)} objects ({human_size(garbage.bytes)}) of "
            f"{len(garbage.steps)} incomplete checkpoints and unreferenced data, {len(garbage.uploads)} uploads; "
            "pass --yes to remove them"
        )
        return 0
    objects, uploads = collect_garbage(garbage)
    print(f"removed {objects} objects ({human_size(garbage.bytes)}) and aborted {uploads} uploads")
    return 0


def cmd_cp(args: argparse.Namespace) -> int:
    from dcp_s3.admin import copy_checkpoint

    bar = _ProgressLine("cp")
    try:
        report = copy_checkpoint(
            args.src,
            args.dst,
            workers=args.workers,
            overwrite=args.overwrite,
            follow_symlinks=args.follow_symlinks,
            progress=bar,
            src_options=_options(args, args.src),
            dst_options=_options(args, args.dst),
        )
    finally:
        bar.close()
    rate = report.bytes / report.seconds if report.seconds > 0 else 0
    _say(
        f"copied {report.objects} objects ({human_size(report.bytes)}) from {report.source} to "
        f"{report.destination} in {report.seconds:.1f}s ({human_size(int(rate))}/s); sizes verified"
    )
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    from dcp_s3.admin import remove_checkpoint

    removal = remove_checkpoint(args.uri, recursive=args.recursive, dry_run=args.dry_run, **_options(args, args.uri))
    verb = "would remove" if args.dry_run else "removed"
    for url in removal.urls:
        _say(f"{verb} {url}")
    for upload in removal.uploads:
        _say(f"{'would abort' if args.dry_run else 'aborted'} unfinished upload {removal.store.url(upload.name)}")
    for name in removal.kept:
        _say(f"kept {removal.store.url(name)} (not a checkpoint object)")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from dcp_s3.admin import convert_checkpoint

    src_options = _options(args, args.uri)
    if args.allow_unsafe_byte_items:
        if s3_location(args.uri) is None:
            raise ConfigError(
                "--allow-unsafe-byte-items applies to s3:// sources; for a local checkpoint register "
                "its classes with torch.serialization.add_safe_globals instead"
            )
        src_options["allow_unsafe_byte_items"] = True
    bar = _ProgressLine("convert")
    try:
        report = convert_checkpoint(
            args.uri,
            args.out,
            fmt=args.format,
            overwrite=args.force,
            src_options=src_options,
            dst_options=_options(args, args.out),
            progress=bar,
        )
    finally:
        bar.close()
    _say(
        f"wrote {report.destination} ({report.format}): {report.tensors} tensors, {human_size(report.bytes)} "
        f"from {report.source}"
    )
    if report.skipped:
        _say(
            f"left out {len(report.skipped)} non-tensor entries (safetensors holds tensors only), "
            f"e.g. {report.skipped[0]}"
        )
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from dcp_s3._demo import main as demo_main

    return demo_main([])


def cmd_server(args: argparse.Namespace) -> int:
    from dcp_s3._local_server import LocalS3Server

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    kind = args.kind or ("seaweedfs" if shutil.which("weed") else "moto")
    # Ctrl-C and a kill stop the server; SIGINT explicitly too: a process started in the background by a
    # non-interactive shell inherits SIGINT ignored, and Python then installs no KeyboardInterrupt for it.
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with LocalS3Server.start(kind) as server:
            server.create_bucket(args.bucket)
            for name, value in server.env().items():
                print(f"export {name}={value}")
            print(f"# {kind} on 127.0.0.1, bucket s3://{args.bucket}/; Ctrl-C stops it and removes what it stored")
            sys.stdout.flush()
            try:
                threading.Event().wait()
            except KeyboardInterrupt:
                print("dcp-s3: server stopped", file=sys.stderr)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
