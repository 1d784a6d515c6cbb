"""Lightning Fabric integration: ``MHCParallelStrategy`` for hand-written training loops.

    fabric = Fabric(strategy=MHCParallelStrategy(tensor_model_parallel_size=2,
                                                 pipeline_model_parallel_size=2), devices=4)

Importing this package registers the strategy as ``"mhc_parallel"`` in Fabric's strategy
registry. ``lightning_mhc.strategies`` holds what it shares with the Trainer strategy
(``lightning_mhc.lightning``).
"""
from lightning.fabric.strategies import STRATEGY_REGISTRY

from lightning_mhc.fabric.strategy import MHCParallelStrategy

MHCParallelStrategy.register_strategies(STRATEGY_REGISTRY)

__all__ = ["MHCParallelStrategy"]
