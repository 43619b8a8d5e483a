"""The ``dcp-s3`` command line (``python -m dcp_s3`` does the same)."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dcp-s3", description="Look after DCP checkpoints on S3.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "demo",
        help="save a 2-rank FSDP2 checkpoint to a local S3 server and load it on 1 rank",
        description="Starts SeaweedFS on 127.0.0.1, saves from 2 ranks, loads on 1, checks every tensor.",
    )
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import main as demo_main

        return demo_main([])
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
