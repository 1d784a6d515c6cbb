"""ZeRO-1's optimizer state measured on a rank and checked against the planner's, for the planner
grids of the mHC GPT and of Hugging Face models."""
from __future__ import annotations

from typing import Sequence

import torch


def zero1_state_row(chunks: Sequence[torch.nn.Module], layout, bucket_bytes: int) -> tuple[int, int, int]:
    """This rank's stage, DP x CP index and ``DistributedOptimizer.state_bytes`` after one AdamW step
    on zero gradients (every piece stepped: AdamW makes its state on the first step)."""
    import torch.distributed as dist

    from lightning_mhc.distributed.optimizer import DistributedOptimizer

    optim = torch.optim.AdamW([p for chunk in chunks for p in chunk.parameters() if p.requires_grad])
    zero1 = DistributedOptimizer(optim, chunks, layout, bucket_bytes=bucket_bytes)
    for piece in zero1.pieces.values():
        piece.main.grad = torch.zeros_like(piece.main)
    optim.step()
    row = (layout.pipeline_model_parallel_rank, dist.get_rank(layout.dp_cp_group), zero1.state_bytes())
    zero1.remove()
    return row


def check_zero1_rows(planned, rows: list[tuple[int, int, int]], case) -> None:
    """Every rank's measured state equals the planner's for its stage and DP x CP index, and each
    stage's figure is its most loaded rank's."""
    for rank, (stage, index, state) in enumerate(rows):
        assert state == planned[stage].optimizer_bytes_by_rank[index], (case, rank, state, planned)
    for stage, want in enumerate(planned):
        assert want.optimizer_bytes == max(s for st, _, s in rows if st == stage), (case, stage, planned)
