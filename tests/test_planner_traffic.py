"""The planner's traffic per step against a counter of the bytes each collective moved in a real run
(``lightning_mhc.distributed.collectives``: torch.distributed's collectives and p2p ops wrapped in the
ranks, the payload read off each call's tensors): one spawned group of 4 ranks runs every layout of
the grid through the runtime's schedule, gradient reduction and optimizer step; every rank's bytes
per (dimension, collective) equal the planner's for its stage, exactly (EP's all-to-all: the mean
over each expert group, since the combine carries the tokens the router sent to the rank)."""
from __future__ import annotations

import pytest
import torch

from lightning_mhc.testing.launch import spawn_ranks

MODEL = dict(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=192, vocab_size=200,
             max_sequence_length=32, enable_hyper_connections=True, num_residual_streams=4)
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)
SEQ, MICRO_BATCH = 32, 2
# name: (TP, SP, PP, chunks per stage, CP, EP, micro-batches, ZeRO-1, MoE, recompute policy) on 4 ranks (DP the rest)
GRID = {
    "tp2": (2, False, 1, 1, 1, 1, 1, False, False, "none"),
    "pp2": (1, False, 2, 1, 1, 1, 4, False, False, "none"),
    "pp2v2": (1, False, 2, 2, 1, 1, 4, False, False, "mhc_block"),
    "tp2pp2sp": (2, True, 2, 1, 1, 1, 4, False, False, "none"),
    "tp2sp_selective": (2, True, 1, 1, 1, 1, 2, False, False, "selective"),
    "cp2": (1, False, 1, 1, 2, 1, 1, False, False, "full"),
    "ep2": (1, False, 1, 1, 1, 2, 1, False, True, "none"),
    "moe_tp2ep2_selective": (2, False, 1, 1, 1, 2, 1, False, True, "selective"),
    "zero1": (1, False, 1, 1, 1, 1, 1, True, False, "none"),
    "zero1_tp2sp": (2, True, 1, 1, 1, 1, 2, True, False, "none"),
    "bf16_tp2pp2sp": (2, True, 2, 1, 1, 1, 4, False, False, "none"),
    "bf16_dp4": (1, False, 1, 1, 1, 1, 1, False, False, "none"),
    "bf16_zero1": (1, False, 1, 1, 1, 1, 1, True, False, "none"),
    "bf16_pp2_zero1": (1, False, 2, 1, 1, 1, 4, True, False, "mhc_block"),
}
BF16 = {name for name in GRID if name.startswith("bf16_")}
"""Run in ``bf16-true``: activations sent in bf16, the weights (all bf16) stepped on fp32 main weights by
the distributed optimizer (gradients reduced in fp32 buckets, all-reduced without ZeRO-1), ZeRO-1's
all-gather in bf16."""

ROUTER_SUMS = dict(moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001, moe_router_score_function="sigmoid",
                   moe_router_enable_expert_bias=True)
OVERRIDES = {"zero1": dict(num_layers=3), "bf16_zero1": dict(num_layers=3), "zero1_tp2sp": dict(num_layers=3),
             "pp2": dict(position_embedding_type="learned_absolute"),
             "ep2": ROUTER_SUMS, "moe_tp2ep2_selective": ROUTER_SUMS}
"""ZeRO-1 on 3 layers: its dense bucket (beside the embedding's) does not divide by the 4 ranks, so
the padding of each reduce-scatter and all-gather is checked too; under TP 2 with SP (x DP 2) the cut
falls so that the two DP ranks' pieces of the SP parameters, which each sums over TP, differ in size.
ZeRO-1 across stages (``bf16_pp2_zero1``): the embedding tied, each rank summing its piece of it
between the stages. PP 2 with learned position embeddings: on the first stage only, reduced over DP with
its parameters, nothing between the stages. The MoE cases with the auxiliary losses and the expert bias
(``ROUTER_SUMS``): their token counts summed over DP x CP per MoE forward (replayed under ``selective``)
and once a step."""


def _precision(name):
    return "bf16-true" if name in BF16 else "32-true"


def _asked(world, name):
    from lightning_mhc.distributed.layout import ParallelLayout

    tp, sp, pp, vp, cp, ep, *_ = GRID[name]
    return ParallelLayout(tensor_model_parallel_size=tp, sequence_parallel=sp, pipeline_model_parallel_size=pp,
                          virtual_pipeline_model_parallel_size=vp, context_parallel_size=cp,
                          expert_model_parallel_size=ep, world_size=world)


def _model(name):
    return dict(MODEL, **(MOE if GRID[name][8] else {}), **OVERRIDES.get(name, {}))


def _measure(rank, world):
    """Per case: this rank's stage, its expert group's ranks, and the payload bytes it sent by
    (dimension, op) over one training step (schedule, gradient reduction, optimizer step)."""
    import torch.distributed as dist

    from lightning_mhc.distributed.layout import destroy_parallel
    from lightning_mhc.distributed.collectives import CollectiveCounter, dimension_of
    from planner_runtime import gpt_on_runtime, train_schedule

    out = []
    for name, (*_, m, zero1, _moe, policy) in GRID.items():
        runtime, module = gpt_on_runtime(_asked(world, name), m, _model(name), policy, _precision(name),
                                         use_distributed_optimizer=zero1)
        optimizer = torch.optim.AdamW(module.parameters())
        runtime.take_over_optimizers(module, [optimizer])
        torch.manual_seed(1 + rank)
        tokens = torch.randint(0, MODEL["vocab_size"], (MICRO_BATCH * m, SEQ + 1))
        batch = dict(tokens=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=torch.ones(MICRO_BATCH * m, SEQ))
        with CollectiveCounter(dimension_of(runtime.layout)) as counted:
            train_schedule(runtime, module, batch, _precision(name), where="traffic grid")
            runtime.reduce_gradients(module)
            optimizer.step()
            runtime.finish_step()
        out.append((runtime.layout.pipeline_model_parallel_rank,
                    tuple(dist.get_process_group_ranks(runtime.layout.ep_group)),
                    dist.get_rank(runtime.layout.dp_cp_group), dict(counted.bytes)))
        destroy_parallel()
    return out


@pytest.fixture(scope="module")
def measured():
    return spawn_ranks(_measure, 4, timeout_s=600)


def planned(name):
    from lightning_mhc.model.config import MHCTransformerConfig, with_parallel_layout
    from lightning_mhc.planning import plan_traffic

    *_, m, zero1, _moe, policy = GRID[name]
    layout = _asked(4, name)
    config = with_parallel_layout(MHCTransformerConfig(**_model(name)), layout)
    e = 2 if name in BF16 else 4  # the CLI's: activations and weights in the parameters' dtype
    return plan_traffic(config, layout, policy, seq_length=SEQ, micro_batch_size=MICRO_BATCH, num_microbatches=m,
                        element_bytes=e, param_bytes=e, distributed_optimizer=zero1)


def test_traffic_per_rank_exact(measured):
    """Every rank of every case: the bytes it sent per (dimension, collective) are the planner's for its
    stage; EP's all-to-all, which follows the routing, is the planner's on average over each expert group."""
    from lightning_mhc.testing.collectives import traffic_misses

    misses = []
    for i, name in enumerate(GRID):
        misses += traffic_misses(name, planned(name), [rows[i] for rows in measured])
    assert not misses, misses
