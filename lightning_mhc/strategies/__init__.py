"""What the Trainer's and Fabric's ``MHCParallelStrategy`` share (both are thin adapters over it):

- ``settings.py``: :class:`ParallelSettings`, the strategies' settings, one frozen dataclass
  checked when made;
- ``runtime.py``: :class:`ParallelRuntime` (``strategy.runtime``), the parallel run: process
  groups, seeds, the schedule, gradient reduction, the distributed optimizer, checkpoints;
- ``processes.py``: :class:`StrategyProcesses`, what Lightning asks of any parallel strategy
  (devices, ranks, launcher, barrier, broadcast);
- ``launcher.py``: Lightning's subprocess launchers made to work inside a Hydra multirun.

It sits above ``distributed/`` (the generic runtime, no Lightning) and ``checkpoint/``, and imports
Lightning's Fabric helpers.
"""
from lightning_mhc.strategies.settings import ParallelSettings

__all__ = ["ParallelSettings"]
