"""Pipeline parallelism, device-agnostic (gloo on CPU, NCCL on GPU):

- ``p2p.py``: point-to-point between neighbouring stages (``isend``/``irecv`` with deadlines);
- ``one_f_one_b.py`` and ``interleaved.py``: megatron-core's 1F1B and interleaved schedules;
- ``schedules.py``: :func:`forward_backward_pipelining`, the one entry that picks between them,
  configured by one :class:`ScheduleConfig` (``common.py``);
- ``protocol.py``: what a module implements to be pipelined (the strategy-module protocol).
"""
from lightning_mhc.distributed.pipeline.common import ScheduleConfig
from lightning_mhc.distributed.pipeline.schedules import forward_backward_pipelining

__all__ = ["ScheduleConfig", "forward_backward_pipelining"]
