"""Helpers for tests and benchmarks: N ranks in one process group (``launch.spawn_ranks``), the
full tensor of a tensor-parallel shard (``tensor_parallel.gather_tensor_parallel``) and torch's
fp32 matmul precision set for a block (``precision.float32_matmul_precision``)."""
