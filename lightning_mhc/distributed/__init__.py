"""The parallel runtime, importing no model (torchtitan's ``distributed/``, megatron-core's
``parallel_state`` and ``pipeline_parallel/`` are its models):

- ``layout.py``: the TP x PP x DP layout, the one place its rules are checked, and megatron-core's
  process groups behind it;
- ``random.py``: the parallel randomizer's seeds per TP / PP / DP rank;
- ``grads.py``, ``grad_overlap.py``: gradient reduction (bucketed DP all-reduce, overlapped with
  the last backward) and global-norm clipping;
- ``pipeline/``: point-to-point, the 1F1B and interleaved schedules, the strategy-module protocol;
- ``runtime.py``, ``launcher.py``: what the Trainer and the Fabric strategy share (they are its
  thin adapters); the only modules here that import Lightning (its Fabric helpers).
"""
