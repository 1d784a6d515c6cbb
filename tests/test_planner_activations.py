"""The planner's retained activation bytes against the runtime's measurement (``measure_activation_memory``,
what the CLI reports as ``activation_bytes``): one spawned group of 4 ranks runs every case of the grid
(policies x streams x TP/SP/PP/interleaved/CP/EP layouts, dense and MoE models) through the runtime's
schedule; each case's maximum over ranks is within 5 % of the planner's most loaded stage."""
from __future__ import annotations

import pytest
import torch

from lightning_mhc.testing.launch import spawn_ranks

MODEL = dict(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=192, vocab_size=200,
             max_sequence_length=32)
SEQ, MICRO_BATCH = 32, 2
LAYOUTS = {  # (TP, sequence parallel, PP, chunks per stage, micro-batches, CP, EP); DP the rest of 4 ranks
    "tp2": (2, False, 1, 1, 1, 1, 1), "tp2sp": (2, True, 1, 1, 1, 1, 1), "pp2": (1, False, 2, 1, 4, 1, 1),
    "pp2v2": (1, False, 2, 2, 4, 1, 1), "pp4": (1, False, 4, 1, 4, 1, 1), "single": (1, False, 1, 1, 2, 1, 1),
    "cp2": (1, False, 1, 1, 1, 2, 1), "cp2tp2sp": (2, True, 1, 1, 1, 2, 1), "cp2tp2": (2, False, 1, 1, 1, 2, 1),
    "cp2pp2": (1, False, 2, 1, 4, 2, 1), "ep2": (1, False, 1, 1, 1, 1, 2), "cp2ep2": (1, False, 1, 1, 1, 2, 2),
}
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=96)
NO_DROPOUT = dict(hidden_dropout=0.0, attention_dropout=0.0)
MODELS = {  # what a case changes of MODEL
    "gelu": {},
    # a gated MLP (SwiGLU) where the MLP's tensors are kept: its wider fc1 output and the product
    "swiglu": dict(activation="swiglu"),
    # grouped queries: SDPA keeps V repeated over the query heads (a chunk's prefix of it under CP)
    "gqa": dict(num_query_groups=2),
    "moe": MOE,
    # gated experts, shared experts, MoE every other layer, both auxiliary losses on
    "moe_varied": dict(MOE, activation="swiglu", moe_shared_expert_intermediate_size=48, moe_layer_freq=2,
                       moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001),
    "moe_sigmoid": dict(MOE, moe_router_score_function="sigmoid"),
    # dropout 0 (most pretraining, the at-scale configs): SDPA's fused (flash) kernel, which keeps no
    # scores (Q, K, V, its output and log-sum-exp), the hyper-connection's fused bias-dropout-add, no noise
    "nodrop": NO_DROPOUT,
    "gqa_nodrop": dict(NO_DROPOUT, num_query_groups=2),  # K and V repeated, then kept by the flash kernel
    "moe_nodrop": dict(MOE, **NO_DROPOUT),
}
# (streams, policy, layout): every policy with and without streams, each layout more than once
GRID = [(1, "none", "pp4"), (1, "none", "tp2"), (1, "selective", "pp2v2"), (1, "selective", "tp2sp"),
        (1, "full", "pp2"), (1, "full", "single"),
        (4, "none", "pp2v2"), (4, "none", "tp2sp"), (4, "selective", "pp2"), (4, "selective", "tp2"),
        (4, "mhc_block", "pp4"), (4, "mhc_block", "tp2sp"), (4, "mhc_block", "pp2v2"), (4, "mhc_block", "single"),
        (4, "full", "pp2v2"), (4, "full", "tp2sp"),
        (1, "none", "tp2", "swiglu"), (4, "mhc_block", "pp2", "swiglu"), (4, "none", "tp2sp", "swiglu"),
        # CP: a rank's chunks of the sequence, the gathered K/V, each chunk's causal prefix of scores
        (1, "none", "cp2"), (4, "selective", "cp2"), (4, "mhc_block", "cp2"), (4, "full", "cp2"),
        (4, "none", "cp2tp2sp"), (1, "selective", "cp2tp2"), (4, "mhc_block", "cp2pp2"),
        (1, "none", "cp2", "gqa"), (4, "none", "tp2", "gqa"),
        # MoE on EP 2 and without EP: the router, the pairs' dispatch, the experts' rows
        (1, "none", "ep2", "moe"), (4, "selective", "ep2", "moe"), (4, "mhc_block", "ep2", "moe"),
        (4, "full", "ep2", "moe"), (4, "none", "single", "moe_varied"), (4, "mhc_block", "single", "moe_varied"),
        (1, "none", "single", "moe_sigmoid"), (4, "none", "cp2ep2", "moe"),
        (4, "none", "tp2", "moe"),  # every TP rank runs all of its tokens through the experts
        # dropout 0: every policy, with and without streams, TP/SP, 1F1B and interleaved PP, CP, EP
        (1, "none", "pp4", "nodrop"), (4, "none", "tp2sp", "nodrop"), (1, "selective", "tp2", "nodrop"),
        (4, "selective", "pp2v2", "nodrop"), (4, "mhc_block", "pp2v2", "nodrop"), (1, "full", "single", "nodrop"),
        (4, "full", "tp2sp", "nodrop"), (1, "none", "cp2", "gqa_nodrop"), (4, "mhc_block", "cp2tp2sp", "nodrop"),
        (4, "none", "ep2", "moe_nodrop"), (1, "none", "tp2", "gqa_nodrop")]
# the same under bf16-true (the model cast whole by Lightning's plugin, each step in its bf16 default dtype):
# what the model computes in fp32 whatever the weights (norms, hyper-connection mappings, the loss) stays 4 bytes;
# CP's fp32 copies of each chunk's K and V prefixes, and an MoE layer's experts in bf16 beside its fp32 router
BF16_GRID = [(4, "none", "tp2sp"), (4, "mhc_block", "pp2v2"), (1, "selective", "pp2"), (4, "full", "tp2"),
             (4, "none", "cp2"), (1, "none", "ep2", "moe"),
             # dropout 0: the flash kernel keeps Q, K and V in bf16 (the math path's fp32 copies gone)
             (4, "none", "tp2sp", "nodrop"), (1, "selective", "cp2", "nodrop")]
TOLERANCE = 0.05


def _model(streams, variant="gelu"):
    return dict(MODEL, enable_hyper_connections=streams > 1, num_residual_streams=streams, **MODELS[variant])


def _asked(world, layout):
    from lightning_mhc.distributed.layout import ParallelLayout

    tp, sp, pp, vp, _, cp, ep = LAYOUTS[layout]
    return ParallelLayout(tensor_model_parallel_size=tp, sequence_parallel=sp, pipeline_model_parallel_size=pp,
                          virtual_pipeline_model_parallel_size=vp, context_parallel_size=cp,
                          expert_model_parallel_size=ep, world_size=world)


def _measure(rank, world):
    """Per case: the runtime's ``activation_bytes`` of one training step (max over ranks)."""
    from lightning_mhc.distributed.layout import destroy_parallel
    from planner_runtime import gpt_on_runtime, train_schedule

    out = []
    for precision, (streams, policy, name, *variant) in _cases():
        asked, m = _asked(world, name), LAYOUTS[name][4]
        runtime, module = gpt_on_runtime(asked, m, _model(streams, *variant), policy, precision,
                                         measure_activation_memory=True)
        tokens = torch.randint(0, MODEL["vocab_size"], (MICRO_BATCH * m, SEQ + 1))
        batch = dict(tokens=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=torch.ones(MICRO_BATCH * m, SEQ))
        train_schedule(runtime, module, batch, precision)
        out.append(runtime.activation_bytes)
        destroy_parallel()
    return out


def _cases():
    return [("32-true", case) for case in GRID] + [("bf16-true", case) for case in BF16_GRID]


@pytest.fixture(scope="module")
def measured():
    return spawn_ranks(_measure, 4, timeout_s=600)[0]


def planned(precision, streams, policy, name, *variant):
    from lightning_mhc.model.config import with_parallel_layout
    from lightning_mhc.model.config_dict import model_config_from_dict
    from lightning_mhc.planning import plan_activations

    layout = _asked(4, name)
    config = with_parallel_layout(model_config_from_dict(_model(streams, *variant)), layout)
    stages = plan_activations(config, layout, policy, seq_length=SEQ, micro_batch_size=MICRO_BATCH,
                              num_microbatches=LAYOUTS[name][4], element_bytes=2 if precision == "bf16-true" else 4)
    return max(bytes_ for bytes_, _ in stages)


def test_activation_bytes_within_5_percent(measured):
    """Every case of the grid, in fp32 and in bf16: |planned - measured| <= 5 % of the measured bytes."""
    misses = []
    for (precision, case), got in zip(_cases(), measured):
        want = planned(precision, *case)
        print(f"{precision} {case}: measured {got}, planned {want} ({(want - got) / got:+.2%})")
        if abs(want - got) > TOLERANCE * got:
            misses.append((precision, case, got, want, f"{(want - got) / got:+.1%}"))
    assert not misses, misses


def test_activation_plan_refuses_what_it_does_not_count():
    """An expert capacity drops tokens by the routing (data-dependent rows): one line, not a wrong figure."""
    from lightning_mhc.distributed.layout import ParallelLayout
    from lightning_mhc.errors import ConfigError
    from lightning_mhc.model.config import with_parallel_layout
    from lightning_mhc.model.config_dict import model_config_from_dict
    from lightning_mhc.planning import plan_activations

    layout = ParallelLayout(expert_model_parallel_size=2, world_size=2)
    config = with_parallel_layout(model_config_from_dict(dict(_model(4, "moe"), moe_expert_capacity_factor=1.0)),
                                  layout)
    with pytest.raises(ConfigError, match="does not cover an expert capacity"):
        plan_activations(config, layout, "none", seq_length=SEQ, micro_batch_size=MICRO_BATCH, num_microbatches=1)


@pytest.mark.parametrize("name", ["tp2sp", "pp2v2", "cp2"])
def test_a_plan_for_cuda_counts_the_fused_attention_checked_on_the_cpu(name):
    """On CUDA SDPA runs its fused kernels with or without attention dropout: a plan for it counts,
    under dropout, the fused formula the grid checks on the CPU without attention dropout (the
    hidden dropout's terms as they are), less than the CPU's math path there."""
    from lightning_mhc.model.config import with_parallel_layout
    from lightning_mhc.model.config_dict import model_config_from_dict
    from lightning_mhc.planning import plan_activations

    layout = _asked(4, name)

    def plan(device, **dropout):
        config = with_parallel_layout(model_config_from_dict(dict(_model(4), **dropout)), layout)
        return plan_activations(config, layout, "none", seq_length=SEQ, micro_batch_size=MICRO_BATCH,
                                num_microbatches=LAYOUTS[name][4], device=device)

    on_cuda = plan("cuda")
    assert on_cuda == plan("cpu", attention_dropout=0.0)
    assert all(gpu < cpu for (gpu, _), (cpu, _) in zip(on_cuda, plan("cpu")))


def test_the_plan_command_counts_the_device_it_trains_on():
    """``lightning-mhc-plan`` (and the pre-launch check) plans for ``trainer.accelerator``: a GPU's row
    is the planner's count for CUDA, below the CPU's for a model with attention dropout."""
    from hydra import compose, initialize_config_dir

    from lightning_mhc.cli import preflight
    from lightning_mhc.cli.plan import layout_row
    from lightning_mhc.planning import plan_activations

    rows = {}
    for accelerator in ("cpu", "gpu"):
        argv = ["model=small", "trainer.devices=4", "data.global_batch_size=16", f"trainer.accelerator={accelerator}"]
        with initialize_config_dir(config_dir=preflight.CONF_DIR, version_base="1.3", job_name="test"):
            cfg = preflight.to_train_config(compose(config_name="config", overrides=argv))
        rows[accelerator] = layout_row(cfg, cfg.layout, cfg.num_microbatches)["activation_bytes"]
        assert cfg.gpt_sizes().attention_dropout > 0
    want = plan_activations(cfg.gpt_sizes(), cfg.layout, cfg.recompute_policy, seq_length=cfg.data.seq_length,
                            micro_batch_size=cfg.data.micro_batch_size, num_microbatches=cfg.num_microbatches,
                            device="cuda")
    assert rows["gpu"] == max(a for a, _ in want) < rows["cpu"]
