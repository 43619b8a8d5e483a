#!/usr/bin/env bash
# The device check (benchmarks/gpu_check.py, then benchmarks/gpu_frameworks.py) on a GPU machine that cannot
# download anything.
#
#   benchmarks/gpu_check.sh download     # here, with network: for CPython 3.12 on manylinux x86-64, into
#                                        # benchmarks/gpu_wheels/ (git-ignored): the wheels dcp_s3 imports (~21 MB),
#                                        # the three frameworks (~6.5 MB) and, in gpu_wheels/moto/, moto's server
#                                        # with what it imports (~12.6 MB); prints each size and the total that
#                                        # travels (working tree + wheels), and fails above 64 MiB
#   benchmarks/gpu_check.sh run [ARGS] [-- FW_ARGS]
#                                        # on the GPU machine (Python 3.12 + torch with CUDA; no boto3, zstandard,
#                                        # crc32c): installs the wheels into private directories, runs
#                                        # python -m benchmarks.gpu_check ARGS (benchmarks/results/gpu.md), then
#                                        # python -m benchmarks.gpu_frameworks FW_ARGS (results/gpu_frameworks.md,
#                                        # its own budget: 180 s by default), unless ARGS has --skip-frameworks
#   benchmarks/gpu_check.sh frameworks [FW_ARGS]   # the framework part alone
#
# The working tree and benchmarks/gpu_wheels/ travel to the machine together (64 MiB in all). The SeaweedFS binary
# does not fit: checkpoints go to a local directory (the same staging path), and the framework checks that need
# an S3 endpoint (NeMo's S3Checkpointer routes only s3://) use moto's server, which runs from gpu_wheels/moto/.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=benchmarks/gpu_wheels
LIMIT=$((64 << 20))
# Versions tested here with dcp_s3 (pyproject: boto3/botocore >= 1.35, zstandard >= 0.22, crc32c >= 2.4).
PACKAGES=(boto3==1.43.11 botocore==1.43.11 s3transfer==0.17.0 jmespath==1.1.0 python-dateutil==2.9.0.post0
          six==1.17.0 zstandard==0.25.0 crc32c==2.9.post0 urllib3==2.7.0)
# The frameworks of issue 40 (docs/frameworks/). Megatron-core needs numpy and packaging (both on the machine);
# what NeMo AutoModel's checkpoint code imports beyond them is transformers' (on the machine: pyyaml, safetensors,
# huggingface_hub); torch-checkpointing needs numpy, safetensors and typing_extensions.
FRAMEWORKS=(megatron-core==0.16.1 nemo-automodel==0.7.0 torch-checkpointing==0.1.1)
# moto's server (the versions tested here) and what it imports that the machine lacks; installed apart, seen
# only by the server's process (benchmarks/gpu_fw_common.py: DCP_S3_GPU_MOTO_PATH).
MOTO=(moto==5.2.1 werkzeug==3.1.8 flask==3.1.3 flask-cors==6.0.2 xmltodict==1.0.4 responses==0.26.0
      requests==2.34.2 cryptography==48.0.0 cffi==2.0.0 pycparser==3.0 blinker==1.9.0 itsdangerous==2.2.0
      py-partiql-parser==0.6.3 certifi==2026.5.20 charset-normalizer==3.4.7 idna==3.20)

fetch() {  # fetch DIR PACKAGE...
    local dir=$1
    shift
    mkdir -p "$dir"
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 --platform any -d "$dir" "$@"
}

install() {  # install DIR TARGET (nothing when DIR has no wheels: that part then reports what is missing)
    mkdir -p "$2"
    if ! compgen -G "$1/*.whl" >/dev/null; then
        echo "no wheels in $1: run '$0 download' where there is network" >&2
        return 0
    fi
    python3 -m pip install --quiet --no-index --no-deps --target "$2" "$1"/*.whl
}

with_moto() {  # moto's server, installed apart ($moto_site), for the processes of both parts' servers
    install "$WHEELS/moto" "$moto_site"
    if [ -n "$(ls -A "$moto_site")" ]; then
        export DCP_S3_GPU_MOTO_PATH="$moto_site:$site"
    fi
}

frameworks() {  # the framework part, with the wheels installed ($site)
    install "$WHEELS/frameworks" "$site"
    PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}" python3 -m benchmarks.gpu_frameworks "$@"
}

case "${1:-}" in
download)
    fetch "$WHEELS" "${PACKAGES[@]}"
    fetch "$WHEELS/frameworks" "${FRAMEWORKS[@]}"
    fetch "$WHEELS/moto" "${MOTO[@]}"
    (cd "$WHEELS" && find . -name '*.whl' -printf '%s\t%P\n' | sort -k2)
    tree=$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
    wheels=$(du -sb "$WHEELS" | cut -f1)
    echo "travels: working tree $((tree >> 10)) KiB + wheels $((wheels >> 10)) KiB = $(((tree + wheels) >> 10)) KiB" \
        "(limit $((LIMIT >> 10)) KiB)"
    if [ $((tree + wheels)) -gt "$LIMIT" ]; then
        echo "over the 64 MiB that travel" >&2
        exit 1
    fi
    ;;
run | frameworks)
    command=$1
    shift
    tmp="$(mktemp -d)"
    site="$tmp/site" moto_site="$tmp/moto"
    install "$WHEELS" "$site"
    with_moto
    if [ "$command" = frameworks ]; then
        frameworks "$@"
        exit
    fi
    check_args=() fw_args=() skip=0
    while [ $# -gt 0 ]; do
        case "$1" in
        --skip-frameworks) skip=1 ;;
        --) shift; fw_args=("$@"); break ;;
        *) check_args+=("$1") ;;
        esac
        shift
    done
    status=0
    PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}" python3 -m benchmarks.gpu_check ${check_args[@]+"${check_args[@]}"} || status=$?
    if [ "$skip" = 0 ]; then
        frameworks ${fw_args[@]+"${fw_args[@]}"} || status=$?
    fi
    exit "$status"
    ;;
*)
    sed -n '2,21p' "$0"
    exit 2
    ;;
esac
