"""The GPT with mixture-of-experts MLPs and hyper-connections in one process: the MoE MLP as a
branch under every recompute policy (losses, gradients, the expert bias and the logged
statistics equal to no recompute), which layers get experts, and bad settings refused."""
from __future__ import annotations

import pytest
import torch

from lightning_mhc import GPTModel
from lightning_mhc.errors import ConfigError
from lightning_mhc.distributed.expert_parallel import update_expert_biases
from lightning_mhc.model.moe import MoELayer
from lightning_mhc.model.moe_mlp import MoEMLP
from lightning_mhc.recompute import RecomputePolicy, attach_recompute
from model_utils import tiny_config

MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32,
           moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
           moe_router_bias_update_rate=0.01, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001,
           add_bias_linear=False, num_residual_streams=4)


def _build(policy: str, **overrides) -> GPTModel:
    block = policy == "mhc_block"
    cfg = tiny_config(hidden_dropout=0.1, attention_dropout=0.1, **{**MOE, **overrides})
    modules = ["mlp"] if policy == "selective" else None
    cfg = RecomputePolicy(policy, modules, 2 if block else None).apply(cfg)
    model = GPTModel(cfg)
    attach_recompute(model)
    return model


def _train(model: GPTModel, steps: int = 3):
    """AdamW steps with the expert bias updated after each; per step the loss, the gradients and
    every MoE layer's (tokens per expert, auxiliary losses, expert bias)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    history = []
    for _ in range(steps):
        tokens = torch.randint(0, model.config.vocab_size, (2, 16), generator=g)
        loss = model(tokens, labels=tokens.roll(-1, 1)).mean()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        update_expert_biases(model)
        layers = [m for m in model.modules() if isinstance(m, MoELayer)]
        stats = [(*m.take_step_statistics()[:2], m.router.expert_bias.clone()) for m in layers]
        history.append((loss.detach(), grads, stats))
    return history


@pytest.mark.parametrize("policy", ["mhc_block", "full", "selective"])
def test_moe_gpt_under_recompute_equals_no_recompute(model_parallel, policy):
    reference = _train(_build("none"))
    history = _train(_build(policy))
    assert any(bias.abs().sum() > 0 for *_, bias in reference[-1][2]), "the expert bias never moved"
    for step, ((loss, grads, stats), (ref_loss, ref_grads, ref_stats)) in enumerate(zip(history, reference)):
        assert torch.equal(loss, ref_loss), f"step {step}: loss {loss} != {ref_loss}"
        for name, grad in ref_grads.items():
            assert torch.equal(grads[name], grad), f"step {step}: gradient of {name} differs"
        for (counts, aux, bias), (ref_counts, ref_aux, ref_bias) in zip(stats, ref_stats):
            # a block re-run in backward must not count its tokens again
            assert torch.equal(counts, ref_counts), f"step {step}: tokens per expert {counts} != {ref_counts}"
            assert counts.sum() == 2 * 16 * MOE["moe_router_topk"]
            assert aux.keys() == ref_aux.keys() == {"load_balancing_loss", "z_loss"}
            assert all(torch.equal(aux[k], ref_aux[k]) for k in aux)
            assert torch.equal(bias, ref_bias), f"step {step}: expert bias {bias} != {ref_bias}"


def test_moe_layer_freq_places_the_experts(model_parallel):
    every_other = GPTModel(tiny_config(**{**MOE, "moe_layer_freq": 2}))
    listed = GPTModel(tiny_config(**{**MOE, "moe_layer_freq": [0, 1, 1, 0]}))
    assert [isinstance(layer.mlp, MoEMLP) for layer in every_other.decoder.layers] == [True, False, True, False]
    assert [isinstance(layer.mlp, MoEMLP) for layer in listed.decoder.layers] == [False, True, True, False]
    expert = every_other.decoder.layers[0].mlp.moe.experts.up_weight
    assert expert.allreduce is False and not hasattr(every_other.decoder.layers[0].mlp.moe.router.weight, "allreduce")


@pytest.mark.parametrize("bad, message", [
    (dict(num_moe_experts=3, expert_model_parallel_size=2), "does not split over expert_model_parallel_size=2"),
    (dict(moe_router_topk=5), "moe_router_topk=5 must be between 1 and num_moe_experts=4"),
    (dict(moe_router_topk=1, moe_router_score_function="softmax", moe_router_enable_expert_bias=False),
     "set moe_router_pre_softmax=True"),
    (dict(moe_router_load_balancing_type="sinkhorn"), "is not implemented"),
    (dict(moe_layer_freq=[1, 0]), "a list of 4 zeros and ones"),
    (dict(num_moe_experts=None, expert_model_parallel_size=2), "without experts"),
    (dict(moe_router_score_function="softmax"), "moe_router_enable_expert_bias needs"),
])
def test_bad_moe_settings_refused_in_one_line(bad, message):
    with pytest.raises(ConfigError, match=message) as error:
        tiny_config(**{**MOE, **bad})
    assert "\n" not in str(error.value)


def test_mlp_flops_of_moe_layers_equal_torch_counter(model_parallel):
    """``mfu``'s FLOPs: an MoE layer counts the router, k experts per token and the shared expert
    (torch's counter on the per-expert loop; it has no formula for ``torch._grouped_mm``)."""
    from torch.utils.flop_counter import FlopCounterMode

    from lightning_mhc.model.flops import forward_flops_terms
    from lightning_mhc.model.moe_mlp import moe_config

    cfg = tiny_config(**{**MOE, "moe_shared_expert_intermediate_size": 48, "moe_layer_freq": [1, 0, 1, 1]})
    layer = MoELayer(moe_config(cfg), use_grouped_mm=False)
    tokens = torch.randn(16, cfg.hidden_size)
    with FlopCounterMode(display=False) as counter:
        layer(tokens)
    dense = 2 * cfg.hidden_size * cfg.ffn_hidden_size * (3 if cfg.gated_linear_unit else 2)  # fc1 (gate, up), fc2
    assert forward_flops_terms(cfg, 16)["mlp"] == dense + 3 * counter.get_total_flops() / 16
