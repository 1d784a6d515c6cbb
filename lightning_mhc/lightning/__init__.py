"""Lightning integration: MHCParallelStrategy, MHCRecomputeCallback, MHCGPTModule, ParallelLMModule.

Importing this package registers the strategy as ``"mhc_parallel"`` in
Lightning's strategy registry.
"""
from lightning.pytorch.strategies import StrategyRegistry

from lightning_mhc.lightning.callbacks.recompute import MHCRecomputeCallback
from lightning_mhc.lightning.modules.gpt import MHCGPTModule
from lightning_mhc.lightning.modules.parallel_lm import ParallelLMModule
from lightning_mhc.lightning.strategy import MHCParallelStrategy
from lightning_mhc.distributed.pipeline.protocol import PipelineModule, is_pipeline_module

MHCParallelStrategy.register_strategies(StrategyRegistry)

__all__ = ["MHCGPTModule", "MHCParallelStrategy", "MHCRecomputeCallback", "ParallelLMModule", "PipelineModule",
           "is_pipeline_module"]
