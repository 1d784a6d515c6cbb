"""Recompute: CheckpointWithoutOutput, MHCBlockRecomputeManager, policies, activation memory.

Imports only torch (and the package's errors); the model imports from here.
"""
from lightning_mhc.recompute.without_output import CheckpointWithoutOutput
from lightning_mhc.recompute.manager import MHCBlockRecomputeManager, PlanEntry
from lightning_mhc.recompute.memory import ActivationMemory, ActivationMemoryMeter
from lightning_mhc.recompute.policy import POLICIES, RecomputePolicy, attach_recompute, detach_recompute
from lightning_mhc.recompute.rng import register_rng_state_source

__all__ = [
    "ActivationMemory",
    "ActivationMemoryMeter",
    "CheckpointWithoutOutput",
    "MHCBlockRecomputeManager",
    "POLICIES",
    "PlanEntry",
    "RecomputePolicy",
    "attach_recompute",
    "detach_recompute",
    "register_rng_state_source",
]
