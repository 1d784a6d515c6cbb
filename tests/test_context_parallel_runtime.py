"""The runtime under context parallelism (CP 2 x DP 2 on 4 gloo ranks, one spawned group): the
gradients of replicated parameters summed over DP x CP and divided by DP (the post-backward
reduction, the overlapped buckets and the distributed optimizer's shards over DP x CP), the loss
reduced the same way, every CP rank of a DP rank reading the same samples, and dropout streams
that differ across CP ranks; against one process on the whole batch (fp32, 1e-6).

Each rank's loss is its part of the sample's loss: the masked sum of its tokens' losses over the
token count all-reduced over CP. The loss mask puts most of the kept tokens on one CP rank, so an
average of the CP ranks' own means would be wrong.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_mhc.distributed.context_parallel import shard_sequence
from lightning_mhc.distributed.grad_overlap import OverlappedGradReduction
from lightning_mhc.distributed.grads import finalize_model_grads
from lightning_mhc.distributed.layout import ParallelLayout, destroy_parallel
from lightning_mhc.distributed.optimizer import DistributedOptimizer
from lightning_mhc.distributed.pipeline.common import reduce_loss
from lightning_mhc.distributed.random import model_parallel_manual_seed
from lightning_mhc.recompute.rng import rng_fork, set_parallel_randomizer
from lightning_mhc.testing.launch import spawn_ranks

DP, CP, BATCH, SEQ, WIDTH = 2, 2, 2, 8, 3


def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``DP * BATCH`` samples of ``SEQ`` tokens: inputs, targets and a loss mask that keeps the
    first 5 positions (4 of them on CP rank 0, which holds positions 0, 1, 6, 7... at CP 2:
    chunks 0 and 3) and one more per sample."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(DP * BATCH, SEQ, WIDTH, generator=g)
    y = torch.randn(DP * BATCH, SEQ, WIDTH, generator=g)
    mask = torch.arange(SEQ)[None, :] < 5
    mask = mask | (torch.arange(SEQ)[None, :] == torch.arange(DP * BATCH)[:, None] + 3)
    return x, y, mask.float()


def _model() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(WIDTH, WIDTH)


def _sample_loss(model, x, y, mask, count) -> torch.Tensor:
    return (((model(x) - y) ** 2).sum(-1) * mask).sum() / count


def reference() -> dict:
    """One process: the mean over DP ranks of each DP batch's masked mean loss, and one SGD step."""
    x, y, mask = _data()
    model = _model()
    losses = [_sample_loss(model, x[d * BATCH:(d + 1) * BATCH], y[d * BATCH:(d + 1) * BATCH],
                           mask[d * BATCH:(d + 1) * BATCH], mask[d * BATCH:(d + 1) * BATCH].sum()) for d in range(DP)]
    loss = sum(losses) / DP
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.5 * p.grad
    return dict(loss=loss.item(), grads=grads, stepped=[p.detach().clone() for p in model.parameters()])


def _local_loss(model, layout: ParallelLayout) -> torch.Tensor:
    """This rank's part: its DP batch, its CP chunks; the kept-token count summed over CP."""
    x, y, mask = _data()
    rows = slice(layout.data_parallel_rank * BATCH, (layout.data_parallel_rank + 1) * BATCH)
    cp_rank = layout.context_parallel_rank
    x, y, mask = (shard_sequence(t[rows], cp_rank, CP, dim=1) for t in (x, y, mask))
    count = mask.sum()
    dist.all_reduce(count, group=layout.cp_group)
    return _sample_loss(model, x, y, mask, count)


def _runtime_under_cp(rank: int, world: int) -> dict:
    layout = ParallelLayout(context_parallel_size=CP).build()
    out = dict(dp_rank=layout.data_parallel_rank, cp_rank=layout.context_parallel_rank)
    for way in ("after_backward", "overlapped", "distributed_optimizer"):
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        taken = DistributedOptimizer(optimizer, [model], layout) if way == "distributed_optimizer" else None
        overlapped = OverlappedGradReduction([model], layout) if way == "overlapped" else None
        if overlapped is not None:
            overlapped.start(0)
        loss = _local_loss(model, layout)
        loss.backward()
        if taken is not None:
            taken.reduce_gradients()
            out["shard_parts"] = taken.buckets[0].parts
            optimizer.step()
            taken.finish_step()
            taken.remove()
        else:
            if overlapped is not None:  # started during backward, as the schedule's last backward does
                out["overlapped_buckets"] = overlapped.overlapped
            finalize_model_grads(model, layout, overlapped=overlapped)
            out[f"{way}_grads"] = [p.grad.clone() for p in model.parameters()]
            if overlapped is not None:
                overlapped.remove()
            optimizer.step()
        out[f"{way}_stepped"] = [p.detach().clone() for p in model.parameters()]
        out["loss"] = reduce_loss(loss.detach(), 1, torch.device("cpu"), layout).item()
    model_parallel_manual_seed(11, layout)
    with rng_fork("tensor"):  # replicated over TP: still one stream per CP rank
        out["dropout"] = torch.nn.functional.dropout(torch.ones(64), 0.5).tolist()
    set_parallel_randomizer(None)
    destroy_parallel()
    return out


def test_runtime_reduces_over_dp_x_cp_and_averages_over_dp():
    ref = reference()
    per_rank = spawn_ranks(_runtime_under_cp, DP * CP, timeout_s=120)
    assert [(r["cp_rank"], r["dp_rank"]) for r in per_rank] == [(0, 0), (1, 0), (0, 1), (1, 1)]  # CP before DP
    for r in per_rank:
        assert abs(r["loss"] - ref["loss"]) < 1e-6
        for way in ("after_backward", "overlapped"):
            for got, want in zip(r[f"{way}_grads"], ref["grads"]):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        for way in ("after_backward", "overlapped", "distributed_optimizer"):
            for got, want in zip(r[f"{way}_stepped"], ref["stepped"]):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        assert r["overlapped_buckets"] == 1 and r["shard_parts"] == DP * CP  # ZeRO-1 over DP x CP
    # CP ranks draw their own dropout masks (megatron's streams); DP ranks too
    assert len({tuple(r["dropout"]) for r in per_rank}) == DP * CP
