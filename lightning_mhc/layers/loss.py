"""The language-model loss both model wings take: the mean of per-token losses over the tokens kept.

The GPT (``model/gpt.py``'s ``gpt_loss_func``) keeps the tokens of its micro-batch's ``loss_mask``,
the Hugging Face wing (``ParallelModel.loss``) the labels that are not ``-100``; under context
parallelism each rank holds two chunks of every sequence and computes its part of the micro-batch's
mean, so the parts add up to the whole sequence's mean however unevenly the kept tokens fall.
"""
from __future__ import annotations

import torch.distributed as dist
from torch import Tensor


def token_mean_loss(per_token_loss: Tensor, keep: Tensor | None = None, context_parallel_group=None) -> Tensor:
    """Mean of ``per_token_loss`` over the tokens ``keep`` marks (all of them when None); 0, not NaN,
    when none is kept.

    Under context parallelism (``context_parallel_group``; ``per_token_loss`` and ``keep`` this
    rank's chunks) it is this rank's part of that mean: its tokens' (kept) sum over the token count
    all-reduced over CP. The parts add up to the whole sequence's mean (the runtime sums losses and
    gradients over CP)."""
    if context_parallel_group is None:
        if keep is None:
            return per_token_loss.mean()
        keep = keep.to(per_token_loss.dtype)
        return (per_token_loss * keep).sum() / keep.sum().clamp(min=1)
    if keep is None:
        return per_token_loss.sum() / (per_token_loss.numel() * dist.get_world_size(context_parallel_group))
    keep = keep.to(per_token_loss.dtype)
    count = keep.sum().detach()
    dist.all_reduce(count, group=context_parallel_group)
    return (per_token_loss * keep).sum() / count.clamp(min=1)
