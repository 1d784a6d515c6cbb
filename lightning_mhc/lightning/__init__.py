"""Lightning integration: MHCParallelStrategy, MHCRecomputeCallback, MHCGPTModule, ParallelLMModule.

Importing this package registers the strategy as ``"mhc_parallel"`` in
Lightning's strategy registry.
"""
from lightning.pytorch.strategies import StrategyRegistry

from lightning_mhc.lightning.callback import MHCRecomputeCallback
from lightning_mhc.lightning.module import MHCGPTModule
from lightning_mhc.lightning.parallel_lm import ParallelLMModule
from lightning_mhc.lightning.strategy import MHCParallelStrategy
from lightning_mhc.parallel.contract import PipelineModule, is_pipeline_module

MHCParallelStrategy.register_strategies(StrategyRegistry)

__all__ = ["MHCGPTModule", "MHCParallelStrategy", "MHCRecomputeCallback", "ParallelLMModule", "PipelineModule",
           "is_pipeline_module"]
