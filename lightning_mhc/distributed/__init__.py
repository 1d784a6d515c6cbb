"""The parallel runtime, importing no model and nothing of Lightning, Hydra or the checkpoints
(torchtitan's ``distributed/``, megatron-core's ``parallel_state`` and ``pipeline_parallel/`` are
its models):

- ``layout.py``: :class:`~lightning_mhc.distributed.layout.ParallelLayout`, the TP x PP x DP layout,
  the one place its rules are checked, and megatron-core's process groups behind it;
- ``random.py``: the parallel randomizer's seeds per TP / PP / DP rank;
- ``grads.py``, ``grad_overlap.py``: gradient reduction (bucketed DP all-reduce, overlapped with
  the last backward) and global-norm clipping;
- ``optimizer.py``: the distributed optimizer (ZeRO-1) and fp32 main weights;
- ``pipeline/``: point-to-point, the 1F1B and interleaved schedules, the strategy-module protocol;
- ``context_parallel.py``: the sequence split over a context-parallel group (load-balanced chunks)
  and the exact attention over it (all-gathered K/V);
- ``expert_parallel.py``: expert parallelism's token exchange (uneven all-to-all with autograd);
- ``fail_fast.py``, ``launcher_watch.py``: a failing rank ends its peers; a launched rank ends with
  its launcher.

What the Trainer and Fabric strategies add on top is ``lightning_mhc.strategies``.
"""
