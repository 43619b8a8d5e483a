"""Benchmarks of dcp_s3 against the usual ways of putting DCP checkpoints on S3.

Entry points (run from the repository root):

    python -m benchmarks.memory   # peak RSS growth of a 1 GiB save and load: dcp_s3 vs the naive BytesIO approach
    python -m benchmarks.run      # the comparison suite: speed, memory, CPU, partial-load bytes of six contestants
    python -m benchmarks.scale    # simulation of objects, request rates, metadata size and cost at 8..16,384 ranks

No benchmark is run by the test suite.
"""
