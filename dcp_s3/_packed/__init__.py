"""Plans and write results as arrays: what travels between the ranks and the coordinator of a save.

:mod:`~dcp_s3._packed.plans` (save plans, gathered to and scattered from the coordinator),
:mod:`~dcp_s3._packed.results` (a rank's write results).
"""

from dcp_s3._packed.plans import PackedItems, PackedMapping, PackedSequence
from dcp_s3._packed.results import PackedResults

__all__ = [
    "PackedItems",
    "PackedMapping",
    "PackedResults",
    "PackedSequence",
]
