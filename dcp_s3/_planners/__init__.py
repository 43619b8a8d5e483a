"""DCP planners: trainable-only saves and loads, meta-rank loads, and the planners for thousands of ranks.

:mod:`~dcp_s3._planners.trainable` (trainable-only and meta-rank planners),
:mod:`~dcp_s3._planners.scale` (:class:`ScalableSavePlanner`; the coordinator's step in
:mod:`~dcp_s3._planners.save` and, on packed plans, :mod:`~dcp_s3._planners.vector`),
:mod:`~dcp_s3._planners.load` (:class:`ScalableLoadPlanner`), :mod:`~dcp_s3._planners.optim_match`
(does an optimizer fit a stored one), :mod:`~dcp_s3._planners.sharing` (sharing what one rank read
with the others of a group).
"""

from dcp_s3._planners.load import ScalableLoadPlanner
from dcp_s3._planners.scale import ScalableSavePlanner
from dcp_s3._planners.trainable import (
    MetaRankLoadPlanner,
    TrainableOnlyLoadPlanner,
    TrainableOnlySavePlanner,
    frozen_parameter_fqns,
)

__all__ = [
    "MetaRankLoadPlanner",
    "ScalableLoadPlanner",
    "ScalableSavePlanner",
    "TrainableOnlyLoadPlanner",
    "TrainableOnlySavePlanner",
    "frozen_parameter_fqns",
]
