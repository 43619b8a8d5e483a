"""How small can the exponent plane of a float tensor get? Entropy bounds vs what zstd does.

    python benchmarks/compression/exponent_entropy.py [--kind "adam exp_avg_sq"] [--steps 20]

For each 1 MiB plane of exponents (4 MiB frames of fp32, as the codec cuts them),
prints the order-0/1/2 empirical entropies (bits per bit, model cost ignored) and
the stored/raw of zstd level 1, of the codec's literal-heavy setting, of the best of
the two per plane (what the codec does), of delta-coded exponents, and of zstd 19.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import zstandard

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

from model_data import make_data  # noqa: E402

from dcp_s3._codec.v1 import LITERAL_PARAMS as _LITERAL_PARAMS  # noqa: E402

PLANE = 1 << 20  # exponents of one 4 MiB fp32 frame


def _entropy(keys: np.ndarray) -> float:
    counts = np.unique(keys, return_counts=True)[1].astype(float)
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", default="adam exp_avg_sq")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    data = make_data(steps=args.steps)[args.kind]
    words = data.view(np.uint32)
    exps = (((words << 1) | (words >> 31)) >> 24).astype(np.uint8)  # the codec's rotated top byte
    level1 = zstandard.ZstdCompressor(level=1)
    literal = zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters(**_LITERAL_PARAMS))
    level19 = zstandard.ZstdCompressor(level=19)
    totals: dict[str, float] = {}
    for pos in range(0, len(exps), PLANE):
        e = exps[pos : pos + PLANE]
        k = e.astype(np.int64)
        delta = np.diff(e, prepend=np.uint8(0)).astype(np.uint8)
        z1, lit = len(level1.compress(e.tobytes())), len(literal.compress(e.tobytes()))
        dz = min(len(level1.compress(delta.tobytes())), len(literal.compress(delta.tobytes())))
        row = {
            "order 0": _entropy(k) * len(e) / 8,
            "order 1": (_entropy(k[1:] * 256 + k[:-1]) - _entropy(k[:-1])) * len(e) / 8,
            "order 2": (_entropy(k[2:] * 65536 + k[1:-1] * 256 + k[:-2]) - _entropy(k[1:-1] * 256 + k[:-2]))
            * len(e)
            / 8,
            "zstd 1": z1,
            "literal-heavy": lit,
            "best of both (codec)": min(z1, lit),
            "delta, best of both": dz,
            "zstd 19": len(level19.compress(e.tobytes())),
        }
        for name, v in row.items():
            totals[name] = totals.get(name, 0.0) + v
    print(f"| {args.kind}, {args.steps} steps: exponent plane model | bits/bit |\n|---|---|")
    for name, v in totals.items():
        print(f"| {name} | {v / len(exps):.3f} |")


if __name__ == "__main__":
    main()
