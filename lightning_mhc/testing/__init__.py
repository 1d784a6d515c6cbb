"""Helpers for tests and benchmarks: N ranks in one process group (``launch.spawn_ranks``) and the
full tensor of a tensor-parallel shard (``tensor_parallel.gather_tensor_parallel``)."""
