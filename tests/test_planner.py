"""The planner's per-rank counts against the same counts measured on models the runtime builds on
forked ranks (one group per world size, every case in it)."""
from __future__ import annotations

import pytest
import torch

from lightning_mhc.testing.launch import spawn_ranks

TINY = dict(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, vocab_size=250,
            max_sequence_length=64, enable_hyper_connections=True, num_residual_streams=4)
MOE = dict(TINY, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)
# (model, TP, PP, VP, EP): each divides the 4 ranks; the vocabulary 250 is padded per TP
CASES = [(TINY, 1, 1, 1, 1), (TINY, 2, 1, 1, 1), (TINY, 2, 2, 1, 1), (TINY, 1, 4, 1, 1),
         (TINY, 1, 2, 2, 1), (dict(TINY, num_residual_streams=1, enable_hyper_connections=False), 4, 1, 1, 1),
         (MOE, 1, 1, 1, 4), (MOE, 1, 2, 1, 2)]


def _layout(world, tp, pp, vp, ep):
    from lightning_mhc.distributed.layout import ParallelLayout

    return ParallelLayout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                          virtual_pipeline_model_parallel_size=vp, expert_model_parallel_size=ep, world_size=world)


def _measure(rank, world):
    """Per case: this rank's stage, parameter bytes and AdamW state bytes after one step."""
    from megatron.core import parallel_state

    from lightning_mhc.distributed.optimizer import optimizer_state_bytes
    from lightning_mhc.model.config import MHCTransformerConfig, with_parallel_layout
    from lightning_mhc.model.stages import build_gpt_chunks

    out = []
    for model, tp, pp, vp, ep in CASES:
        layout = _layout(world, tp, pp, vp, ep).build()
        config = with_parallel_layout(MHCTransformerConfig(**model), layout)
        chunks = build_gpt_chunks(config, layout)
        params = [p for c in chunks for p in c.parameters()]
        for p in params:
            p.grad = torch.zeros_like(p)
        optim = torch.optim.AdamW(params)
        optim.step()
        out.append((layout.pipeline_model_parallel_rank,
                    sum(p.numel() * p.element_size() for p in params),
                    sum(p.grad.numel() * p.grad.element_size() for p in params),
                    optimizer_state_bytes(optim)))
        parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def measured():
    return spawn_ranks(_measure, 4, timeout_s=300)


def test_model_state_bytes_per_rank_exact(measured):
    """Parameter, gradient and AdamW bytes of every rank equal the planner's for its stage."""
    from lightning_mhc.model.config import MHCTransformerConfig
    from lightning_mhc.planning import plan_gpt

    for i, (model, tp, pp, vp, ep) in enumerate(CASES):
        planned = plan_gpt(MHCTransformerConfig(**model), _layout(4, tp, pp, vp, ep))
        for rank, rows in enumerate(measured):
            stage, params, grads, optim = rows[i]
            want = planned[stage]
            got = (params, grads, optim)
            assert got == (want.parameter_bytes, want.gradient_bytes, want.optimizer_bytes), \
                (CASES[i][1:], rank, got, want)
