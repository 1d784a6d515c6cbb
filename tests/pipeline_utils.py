"""Training a GPT stage under a (TP, PP, DP) layout inside a spawned rank, for the tests."""
from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_mhc.model.config import with_parallel_layout
from lightning_mhc.model.gpt import gpt_forward_step, gpt_loss_func
from lightning_mhc.distributed.grad_overlap import OverlappedGradReduction
from lightning_mhc.distributed.grads import DEFAULT_BUCKET_BYTES, finalize_model_grads, global_grad_norm
from lightning_mhc.distributed.random import model_parallel_manual_seed
from lightning_mhc.distributed.pipeline import ScheduleConfig, forward_backward_pipelining
from lightning_mhc.model.stages import build_gpt_chunks
from lightning_mhc.distributed.layout import ParallelLayout, destroy_parallel
from lightning_mhc.testing.tensor_parallel import gather_tensor_parallel
from lightning_mhc.recompute import RecomputePolicy, attach_recompute
from model_utils import tiny_config

SEQ, MICRO_BATCH = 16, 2


def global_batch(step: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, 256, (rows, SEQ + 1), generator=g)


def train_layout(
    tp: int, pp: int, microbatches: int, policy: str = "none", *, steps: int = 3,
    dropout: float = 0.0, deallocate: bool = True, global_rows: int | None = None,
    reference: bool = False, probe=None, config_overrides: dict | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES, sequence_parallel: bool = False, virtual: int = 1,
    overlap: bool = False,
) -> dict:
    """3 SGD steps of the tiny model; returns per-step losses and full weights by global name
    (gathered over TP and PP, on every rank). ``reference``: a single-process run (world of
    one rank) with the whole global batch as one microbatch."""
    layout = ParallelLayout(tp, pp, virtual, sequence_parallel).build()
    model_parallel_manual_seed(1234, layout)
    # 4 Sinkhorn iterations instead of 20: the runtime under test does not depend on it, and
    # 8 ranks on 2 cores pay for every small op.
    overrides = dict(mhc_sinkhorn_iterations=4, **(config_overrides or {}))
    cfg = tiny_config(hidden_dropout=dropout, attention_dropout=dropout, **overrides)
    cfg = RecomputePolicy(policy, layer_num=2 if policy == "mhc_block" else None).apply(cfg)
    cfg = with_parallel_layout(cfg, layout)
    chunks = build_gpt_chunks(cfg, layout)
    managers = [attach_recompute(chunk, keep_managers=True) for chunk in chunks]  # filled as blocks run
    params = [p for chunk in chunks for p in chunk.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.5)
    dp, dp_rank = (1, 0) if reference else (layout.data_parallel_size, layout.data_parallel_rank)
    rows = global_rows or dp * microbatches * MICRO_BATCH
    per_rank = rows // dp
    mb_rows = per_rank if reference else MICRO_BATCH
    losses, grad_norms, overlapped = [], [], []
    reducer = OverlappedGradReduction(chunks, layout, bucket_bytes) if overlap else None
    for step in range(steps):
        data = global_batch(step, rows)[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        mbs = [
            dict(tokens=chunk[:, :-1], labels=chunk[:, 1:])
            for chunk in data.split(mb_rows)
        ]
        result = forward_backward_pipelining(chunks, mbs, gpt_forward_step, gpt_loss_func, ScheduleConfig(
            layout, chunks[0].pipeline_tensor_shape(mb_rows, SEQ), deallocate_pipeline_outputs=deallocate,
            probe=probe, on_last_backward=reducer.start if reducer is not None else None))
        if reducer is not None:
            overlapped.append(reducer.overlapped)
        if not reference:
            finalize_model_grads(chunks, layout, bucket_bytes, overlapped=reducer)
        grad_norms.append(global_grad_norm(params, layout))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(result.loss.item())
    # evaluation through the forward-only schedule on a held-out batch
    for chunk in chunks:
        chunk.eval()
    data = global_batch(99, rows)[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    eval_mbs = [dict(tokens=c[:, :-1], labels=c[:, 1:]) for c in data.split(mb_rows)]
    eval_loss = forward_backward_pipelining(chunks, eval_mbs, gpt_forward_step, gpt_loss_func, ScheduleConfig(
        layout, chunks[0].pipeline_tensor_shape(mb_rows, SEQ), forward_only=True)).loss.item()
    for chunk in chunks:
        chunk.train()
    weights = {
        chunk.global_parameter_name(name): gather_tensor_parallel(p.detach(), p).clone()
        for chunk in chunks for name, p in chunk.named_parameters()
        if not (chunk.output_layer is not None and p is chunk.output_layer.weight and not chunk.pre_process)
    }
    if reference:
        merged = weights
    else:
        if layout.tensor_model_parallel_rank != 0 or layout.data_parallel_rank != 0:
            weights = {}
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, weights)
        merged = {k: v for part in gathered for k, v in part.items()}
    recomputes = [m.recompute_count for chunk_managers in managers for m in chunk_managers]
    if reducer is not None:
        reducer.remove()
    destroy_parallel()
    return dict(losses=losses, grad_norms=grad_norms, eval_loss=eval_loss, weights=merged, recomputes=recomputes,
                layout=layout, overlapped=overlapped)
