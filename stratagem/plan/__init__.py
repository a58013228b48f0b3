"""The vocabulary every part of stratagem speaks: the Plan, the Workload it serves, training
precisions, and how a model's pipeline stages are built.

Plain data that imports nothing of stratagem but :mod:`stratagem.errors`: the advisor produces
plans, the cost models score them, the plugins apply them and the exporters translate them.
"""

from stratagem.plan.checkpointing import SELECTIVE_POLICIES
from stratagem.plan.plan import (
    CHECKPOINTING,
    INTERLEAVED_SCHEDULES,
    OFFLOAD,
    PP_SCHEDULES,
    MeshAxis,
    Plan,
    admitted_offloads,
    even_stage_blocks,
    zero_bubble_refuses,
)
from stratagem.plan.tp_styles import TP_STYLES, VOCAB_STYLES
from stratagem.plan.workload import OPTIMIZERS, Workload

__all__ = [
    "CHECKPOINTING",
    "INTERLEAVED_SCHEDULES",
    "OFFLOAD",
    "OPTIMIZERS",
    "PP_SCHEDULES",
    "SELECTIVE_POLICIES",
    "TP_STYLES",
    "VOCAB_STYLES",
    "MeshAxis",
    "Plan",
    "Workload",
    "admitted_offloads",
    "even_stage_blocks",
    "zero_bubble_refuses",
]
