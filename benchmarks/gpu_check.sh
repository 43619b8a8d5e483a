#!/usr/bin/env bash
# The device check (benchmarks/gpu_check.py) on a GPU machine that cannot download anything.
#
#   benchmarks/gpu_check.sh download     # here, with network: the wheels dcp_s3 imports, for CPython 3.12
#                                        # on manylinux x86-64, into benchmarks/gpu_wheels/ (~22 MB, git-ignored)
#   benchmarks/gpu_check.sh run [ARGS]   # on the GPU machine (Python 3.12 + torch with CUDA, no boto3,
#                                        # zstandard, crc32c): installs those wheels into a private directory,
#                                        # then runs python -m benchmarks.gpu_check ARGS
#                                        # (writes benchmarks/results/gpu.md and gpu.json; under 5 min)
#
# The working tree and benchmarks/gpu_wheels/ travel to the machine together (64 MiB in all).
# moto and SeaweedFS do not travel: the check saves to a local directory, the same staging path.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=benchmarks/gpu_wheels
# Versions tested here with dcp_s3 (pyproject: boto3/botocore >= 1.35, zstandard >= 0.22, crc32c >= 2.4).
PACKAGES=(boto3==1.43.11 botocore==1.43.11 s3transfer==0.17.0 jmespath==1.1.0 python-dateutil==2.9.0.post0
          six==1.17.0 zstandard==0.25.0 crc32c==2.9.post0 urllib3==2.7.0)

case "${1:-}" in
download)
    mkdir -p "$WHEELS"
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 --platform any -d "$WHEELS" "${PACKAGES[@]}"
    du -sh "$WHEELS"
    ;;
run)
    shift
    site="$(mktemp -d)/site"
    python3 -m pip install --quiet --no-index --no-deps --target "$site" "$WHEELS"/*.whl
    PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}" python3 -m benchmarks.gpu_check "$@"
    ;;
*)
    sed -n '2,10p' "$0"
    exit 2
    ;;
esac
