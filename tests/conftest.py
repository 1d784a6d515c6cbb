"""Shared fixtures: a one-rank gloo group with megatron-core's model-parallel state."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from lightning_mhc.testing.launch import free_port


@pytest.fixture(scope="session")
def single_rank_group():
    """A world of one gloo rank (megatron's layers need an initialised TP group)."""
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def model_parallel(single_rank_group):
    """TP = PP = 1 model-parallel state, torn down after the test; yields its ParallelLayout."""
    from lightning_mhc.distributed.layout import current_layout

    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    yield current_layout()
    parallel_state.destroy_model_parallel()
