"""The model states the distributed optimizer holds on a rank (ZeRO-1, or bf16 weights stepped on fp32
main weights) measured and checked against the planner's, for the planner grids of the mHC GPT and
of Hugging Face models."""
from __future__ import annotations

from typing import Sequence

import torch


def zero1_state_row(chunks: Sequence[torch.nn.Module], layout, bucket_bytes: int,
                    shard: bool = True) -> tuple[int, int, int, int, int]:
    """This rank's stage, DP x CP index, and the bytes the runtime holds once the
    ``DistributedOptimizer`` took AdamW over (``shard``: ZeRO-1; else every rank all of it, as under
    ``bf16-true`` alone): the parameters, the buckets' fp32 gradient buffers once every parameter's
    gradient went in (each through the bucket's accumulation hook, as backward hands them), and
    ``state_bytes`` after one AdamW step on zero gradients (every piece stepped: AdamW makes its
    state on the first step)."""
    import torch.distributed as dist

    from lightning_mhc.distributed.optimizer import DistributedOptimizer

    optim = torch.optim.AdamW([p for chunk in chunks for p in chunk.parameters() if p.requires_grad])
    taken = DistributedOptimizer(optim, chunks, layout, bucket_bytes=bucket_bytes, shard=shard)
    for bucket in taken.buckets:
        for p in bucket.params:
            p.grad = torch.zeros_like(p)
            bucket.accumulate(p)
    gradients = sum(b.buffer.numel() * b.buffer.element_size() for b in taken.buckets)
    parameters = sum(p.numel() * p.element_size() for chunk in chunks for p in chunk.parameters())
    for piece in taken.pieces.values():
        piece.main.grad = torch.zeros_like(piece.main)
    optim.step()
    row = (layout.pipeline_model_parallel_rank, dist.get_rank(layout.dp_cp_group), parameters, gradients,
           taken.state_bytes())
    taken.remove()
    return row


def check_zero1_rows(planned, rows: list[tuple[int, int, int, int, int]], case) -> None:
    """Every rank's measured parameter, gradient and optimizer bytes equal the planner's for its
    stage (the optimizer's, under ZeRO-1, for its DP x CP index), and each stage's optimizer figure is
    its most loaded rank's."""
    for rank, (stage, index, parameters, gradients, state) in enumerate(rows):
        want = planned[stage]
        by_rank = want.optimizer_bytes_by_rank[index] if want.optimizer_bytes_by_rank else want.optimizer_bytes
        assert (parameters, gradients, state) == (want.parameter_bytes, want.gradient_bytes, by_rank), \
            (case, rank, (parameters, gradients, state), want)
    for stage, want in enumerate(planned):
        assert want.optimizer_bytes == max(s for st, *_, s in rows if st == stage), (case, stage, planned)
