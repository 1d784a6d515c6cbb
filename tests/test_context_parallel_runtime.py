"""The runtime and the GPT under context parallelism (4 gloo ranks, one spawned group). The
gradients of replicated parameters summed over DP x CP and divided by DP (the post-backward
reduction, the overlapped buckets and the distributed optimizer's shards over DP x CP), the loss
reduced the same way, every CP rank of a DP rank reading the same samples, and dropout streams
that differ across CP ranks (and ``whole_sequence_dropout``: each rank's rows of the mask without
CP); against one process on the whole batch (fp32, 1e-6). The GPT (mHC
with 4 streams, grouped-query attention, RoPE or learned positions) at CP 2 and CP 4: the loss
parts and the gradients summed over CP against the same model at CP 1 on every rank (1e-5); the
pipeline shape ``[s/cp, b, n*C]``; generation refused.

Each rank's loss is its part of the sample's loss: the masked sum of its tokens' losses over the
token count all-reduced over CP. The loss mask puts most of the kept tokens on one CP rank, so an
average of the CP ranks' own means would be wrong.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_mhc.distributed.context_parallel import shard_sequence
from lightning_mhc.distributed.grad_overlap import OverlappedGradReduction
from lightning_mhc.distributed.grads import finalize_model_grads
from lightning_mhc.distributed.layout import ParallelLayout, destroy_parallel
from lightning_mhc.distributed.optimizer import DistributedOptimizer
from lightning_mhc.distributed.pipeline.common import reduce_loss
from lightning_mhc.distributed.random import model_parallel_manual_seed, whole_sequence_dropout
from lightning_mhc.errors import ConfigError
from lightning_mhc.model.config import with_parallel_layout
from lightning_mhc.model.gpt import gpt_forward_step, gpt_loss_func
from lightning_mhc.model.stages import build_gpt_chunks
from lightning_mhc.recompute.rng import MultiDimParallelRandomizer, rng_fork, set_parallel_randomizer
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
    out["whole_sequence_dropout"] = whole_sequence_dropout(torch.ones(4, 3), 0.5, True, sequence_parallel=False)
    set_parallel_randomizer(None)
    destroy_parallel()
    return out


def _gpt_loss_and_grads(cp: int, position_embedding_type: str) -> tuple[float, dict, tuple, str]:
    """One micro-batch (2 x 16 tokens, the uneven loss mask) through the GPT at CP ``cp`` on this
    rank; the loss and the gradients summed over CP (the whole sample's), the pipeline shape and
    what ``generate`` says."""
    layout = ParallelLayout(context_parallel_size=cp).build()
    config = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                  vocab_size=64, max_sequence_length=16, hidden_dropout=0.0, attention_dropout=0.0,
                  mhc_sinkhorn_iterations=4, position_embedding_type=position_embedding_type)
    from lightning_mhc.model.config import MHCTransformerConfig
    (model,) = build_gpt_chunks(with_parallel_layout(MHCTransformerConfig(**config), layout), layout)
    data = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(5))
    mask = ((torch.arange(16) < 5) | (torch.arange(16) == 9)).float().expand(2, 16)
    microbatch = dict(tokens=data[:, :-1], labels=data[:, 1:], loss_mask=mask)
    loss = gpt_loss_func(gpt_forward_step(model, microbatch), model.on_this_rank(microbatch),
                         model.context_parallel_group)
    loss.backward()
    loss, grads = loss.detach(), {name: p.grad for name, p in model.named_parameters()}
    if cp > 1:
        for tensor in (loss, *grads.values()):
            dist.all_reduce(tensor, group=layout.cp_group)
    try:
        model.generate(data[:, :4], max_new_tokens=1)
        refused = ""
    except ConfigError as error:
        refused = str(error)
    shape = model.pipeline_tensor_shape(2, 16)
    if cp > 1:  # what the runtime asks every rank before the schedule: a length 2 * cp does not divide
        refusal = f"cuts it into 2 \\* {cp} chunks; use a sequence length divisible by {2 * cp}"
        with pytest.raises(ConfigError, match=refusal):
            model.pipeline_tensor_shape(2, 2 * cp + 2)
    destroy_parallel()
    return loss.item(), grads, shape, refused


def _runtime_and_gpt_under_cp(rank: int, world: int) -> dict:
    out = _runtime_under_cp(rank, world)
    for positions in ("rope", "learned_absolute"):
        for cp in (1, 2, 4):
            out[(positions, cp)] = _gpt_loss_and_grads(cp, positions)
    return out


@pytest.fixture(scope="module")
def per_rank() -> list[dict]:
    return spawn_ranks(_runtime_and_gpt_under_cp, DP * CP, timeout_s=300)


def test_gpt_under_cp_equals_one_process(per_rank):
    """Each rank's loss part and gradients, summed over CP, equal the CP 1 model's (1e-5)."""
    for r in per_rank:
        for positions in ("rope", "learned_absolute"):
            ref_loss, ref_grads, ref_shape, _ = r[(positions, 1)]
            for cp in (2, 4):
                loss, grads, shape, refused = r[(positions, cp)]
                assert abs(loss - ref_loss) < 1e-5, (positions, cp, loss, ref_loss)
                assert grads.keys() == ref_grads.keys()
                for name in grads:
                    torch.testing.assert_close(grads[name], ref_grads[name], rtol=0, atol=1e-5, msg=name)
                assert shape == (16 // cp, 2, 4 * 32) and ref_shape == (16, 2, 4 * 32)
                assert refused.startswith(f"generate runs the whole sequence in one process, but this model splits "
                                          f"it over context_parallel_size={cp} ranks")


def test_runtime_reduces_over_dp_x_cp_and_averages_over_dp(per_rank):
    ref = reference()
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


def test_whole_sequence_dropout_keeps_this_ranks_rows_of_the_mask_without_cp(per_rank):
    """``exact_hidden_dropout``'s draw: each rank's rows (its two chunks) of the mask that the DP 2
    layout without CP draws for the whole 8-row sequence in its replicated stream."""
    for r in per_rank:
        without_cp = MultiDimParallelRandomizer(11, {"tensor": 0, "data": r["dp_rank"], "pipeline": 0},
                                                {"tensor": 1, "data": DP, "pipeline": 1})
        with without_cp.get_randomizer("tensor").fork():
            whole = torch.nn.functional.dropout(torch.ones(8, 3), 0.5)
        assert torch.equal(r["whole_sequence_dropout"], shard_sequence(whole, r["cp_rank"], CP, dim=0))


def test_a_module_that_does_not_split_the_sequence_is_refused_under_cp():
    import lightning.pytorch as pl

    from lightning_mhc import MHCParallelStrategy

    with pytest.raises(ConfigError, match=r"^context_parallel_size=2 splits each sequence over 2 ranks, which the "
                                          r"model must do itself; LightningModule does not \(MHCGPTModule and "
                                          r"ParallelLMModule do\)"):
        MHCParallelStrategy(context_parallel_size=2).runtime.check_module(pl.LightningModule())
