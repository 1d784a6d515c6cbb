"""The mixture-of-experts layer (lightning_mhc/model/moe.py) and its expert-parallel token exchange
(lightning_mhc/distributed/expert_parallel.py), in fp32 with no token dropped.

One process: the grouped product against the per-expert loop, the router against hand-written
top-k, the auxiliary losses against hand-computed values and their gradient through the
auto-scaler. Expert parallelism: one spawned group per world size (2 and 4 gloo ranks) runs every
case; each rank holds its slice of the batch (as data parallelism would give it) and compares
with the same layer computed in that process on the whole batch.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist

from lightning_mhc.distributed.expert_parallel import all_to_all, dispatch_tokens, combine_tokens
from lightning_mhc.layers.moe import grouped_matmul, grouped_mm_usable
from lightning_mhc.model.moe import (
    MoEConfig,
    MoELayer,
    TopKRouter,
    load_balancing_loss,
    z_loss,
)
from lightning_mhc.testing.launch import spawn_ranks

TOL = 1e-6
HIDDEN, FFN, SHARED_FFN, EXPERTS = 8, 16, 12, 8  # rows of 16-byte multiples: torch._grouped_mm takes them


# ------------------------------------------------------------------ one process
@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch has no _grouped_mm")
def test_grouped_mm_equals_per_expert_loop():
    """torch._grouped_mm and the per-expert loop agree (forward and both gradients), with an
    expert that gets no row, on this CPU in fp32."""
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 5, 1, 7])
    tokens = torch.randn(int(counts.sum()), HIDDEN, generator=gen)
    weight = torch.randn(len(counts), HIDDEN, FFN, generator=gen)
    assert grouped_mm_usable(tokens, weight)
    assert not grouped_mm_usable(tokens.double(), weight.double())  # fp64 is refused by torch._grouped_mm
    assert not grouped_mm_usable(tokens[:, :6], weight[:, :6])  # 24-byte rows: not a 16-byte multiple
    grad = torch.randn(int(counts.sum()), FFN, generator=gen)
    results = []
    for use_grouped_mm in (True, False):
        x, w = tokens.clone().requires_grad_(), weight.clone().requires_grad_()
        out = grouped_matmul(x, w, counts, use_grouped_mm)
        out.backward(grad)
        results.append((out.detach(), x.grad, w.grad))
    for grouped, loop in zip(*results):
        assert (grouped - loop).abs().max().item() <= TOL
    # a broadcast output gradient (what .sum() gives) is taken too
    w = weight.clone().requires_grad_()
    grouped_matmul(tokens, w, counts, True).sum().backward()
    assert (w.grad - torch.stack([chunk.sum(0, keepdim=True).T.expand(-1, FFN) for chunk in
                                  torch.split(tokens, counts.tolist())])).abs().max().item() <= TOL
    # the loop itself against a plain matmul per expert
    ends = counts.cumsum(0).tolist()
    expected = torch.cat([tokens[end - n:end] @ weight[e] for e, (n, end) in enumerate(zip(counts.tolist(), ends))])
    assert (results[1][0] - expected).abs().max().item() <= TOL


def _router(score_function: str, topk: int, **extra) -> TopKRouter:
    config = MoEConfig(hidden_size=4, num_moe_experts=4, moe_ffn_hidden_size=4, moe_router_topk=topk,
                       moe_router_score_function=score_function, **extra)
    router = TopKRouter(config)
    with torch.no_grad():
        router.weight.copy_(torch.eye(4))  # logits = the tokens themselves
    return router


LOGITS = torch.tensor([[0.5, -1.0, 2.0, 0.1],
                       [3.0, 2.5, -0.5, 2.9],
                       [-2.0, -1.0, -3.0, -0.5]])


def _hand_topk(row: list[float], k: int) -> list[int]:
    return sorted(range(len(row)), key=lambda e: -row[e])[:k]


@pytest.mark.parametrize("pre_softmax", [False, True])
def test_router_softmax_against_hand_reference(pre_softmax):
    """Top-2 of the logits; softmax over the two chosen logits (megatron's default) or over all
    four before the choice (moe_router_pre_softmax)."""
    router = _router("softmax", 2, moe_router_pre_softmax=pre_softmax)
    probs, experts = router.route(router.logits(LOGITS))
    for t, row in enumerate(LOGITS.tolist()):
        chosen = _hand_topk(row, 2)
        assert experts[t].tolist() == chosen
        denominator = sum(math.exp(v) for v in (row if pre_softmax else [row[e] for e in chosen]))
        for j, e in enumerate(chosen):
            assert abs(probs[t, j].item() - math.exp(row[e]) / denominator) <= TOL


def test_router_sigmoid_with_expert_bias_against_hand_reference():
    """Sigmoid scores; the expert bias moves the choice but not the weights (the unbiased
    scores of the chosen experts, normalised to sum 1 for top-k > 1)."""
    router = _router("sigmoid", 2, moe_router_enable_expert_bias=True)
    bias = [0.0, 0.0, -5.0, 0.4]  # expert 2 never chosen, expert 3 helped
    router.expert_bias.copy_(torch.tensor(bias))
    probs, experts = router.route(router.logits(LOGITS))
    sigmoid = lambda v: 1 / (1 + math.exp(-v))  # noqa: E731
    for t, row in enumerate(LOGITS.tolist()):
        scores = [sigmoid(v) for v in row]
        chosen = _hand_topk([s + b for s, b in zip(scores, bias)], 2)
        assert 2 not in chosen
        assert experts[t].tolist() == chosen
        total = sum(scores[e] for e in chosen)
        for j, e in enumerate(chosen):
            assert abs(probs[t, j].item() - scores[e] / total) <= TOL
    # without the bias: the plain top-2 of the sigmoid scores
    plain = _router("sigmoid", 2)
    _, experts = plain.route(plain.logits(LOGITS))
    assert experts.tolist() == [_hand_topk(row, 2) for row in LOGITS.tolist()]


def _tiny_aux_layer(scale: float) -> MoELayer:
    config = MoEConfig(hidden_size=4, num_moe_experts=2, moe_ffn_hidden_size=4, moe_router_topk=1,
                       moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    layer = MoELayer(config, use_grouped_mm=False)
    with torch.no_grad():
        layer.router.weight.copy_(torch.eye(2, 4))  # logits = the first two features
    layer.aux_loss_scale = scale
    return layer


def test_aux_and_z_loss_against_hand_computed_values():
    """Two tokens, two experts, top-1, logits (0, ln 3) for both: softmax (1/4, 3/4), both
    tokens to expert 1, so f = (0, 1), P = (1/4, 3/4), load balancing = 0.1 * 2 * 3/4 = 0.15;
    logsumexp = ln 4 for both, z-loss = 0.01 * (ln 4)^2."""
    layer = _tiny_aux_layer(1.0)
    tokens = torch.tensor([[0.0, math.log(3), 0.3, -0.2], [0.0, math.log(3), -1.0, 0.5]])
    layer(tokens)
    assert layer.tokens_per_expert.tolist() == [0, 2]
    assert abs(layer.aux_losses["load_balancing_loss"].item() - 0.15) <= TOL
    assert abs(layer.aux_losses["z_loss"].item() - 0.01 * math.log(4) ** 2) <= TOL
    # the free functions on the same numbers
    logits = tokens[:, :2]
    assert abs(load_balancing_loss(torch.softmax(logits, -1), torch.tensor([0.0, 2.0]), 2, 1, 0.1).item() - 0.15) <= TOL
    assert abs(z_loss(logits, 2, 0.01).item() - 0.01 * math.log(4) ** 2) <= TOL


@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_aux_losses_reach_backward_with_their_scale(scale):
    """The output's backward carries the auxiliary losses' gradient, times aux_loss_scale: with a
    zero output gradient the router's gradient is exactly scale * d(aux + z)/d(router weight)."""
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randn(6, 4, generator=gen)
    layer = _tiny_aux_layer(scale)
    (layer(tokens) * 0).sum().backward()
    weight = layer.router.weight.detach().clone().requires_grad_()
    logits = torch.nn.functional.linear(tokens, weight)
    counts = torch.bincount(logits.argmax(-1), minlength=2).float()
    expected = load_balancing_loss(torch.softmax(logits, -1), counts, 6, 1, 0.1) + z_loss(logits, 6, 0.01)
    expected.backward()
    assert (layer.router.weight.grad - scale * weight.grad).abs().max().item() <= TOL
    assert weight.grad.abs().max().item() > 1e-4  # the check is not vacuous


def test_capacity_factor_caps_each_expert():
    """With moe_expert_capacity_factor each expert takes at most ceil(factor * T k / E) of the
    rank's tokens; every token still gets the shared experts."""
    config = MoEConfig(hidden_size=HIDDEN, num_moe_experts=4, moe_ffn_hidden_size=FFN, moe_router_topk=2,
                       moe_expert_capacity_factor=0.5, moe_shared_expert_intermediate_size=SHARED_FFN)
    torch.manual_seed(0)
    layer = MoELayer(config)
    layer(torch.randn(16, HIDDEN))
    assert layer.local_tokens_per_expert.max().item() <= math.ceil(0.5 * 16 * 2 / 4)
    assert layer.tokens_per_expert.sum().item() == 32  # the router's choice, before the cap


def test_config_reads_megatron_transformer_config_and_refuses_bad_settings():
    """MoEConfig.from_transformer_config takes megatron-core's fields by name; bad values are refused."""
    from megatron.core.transformer import TransformerConfig

    megatron = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, num_moe_experts=4,
                                 moe_ffn_hidden_size=16, moe_router_topk=2, moe_aux_loss_coeff=0.01,
                                 moe_z_loss_coeff=1e-3, moe_router_score_function="sigmoid",
                                 moe_router_enable_expert_bias=True, moe_shared_expert_intermediate_size=12)
    config = MoEConfig.from_transformer_config(megatron)
    assert (config.hidden_size, config.num_moe_experts, config.moe_ffn_hidden_size, config.moe_router_topk,
            config.moe_shared_expert_intermediate_size, config.moe_router_score_function,
            config.moe_router_enable_expert_bias, config.moe_aux_loss_coeff, config.moe_z_loss_coeff) == (
        8, 4, 16, 2, 12, "sigmoid", True, 0.01, 1e-3)
    for bad in (dict(moe_router_topk=5), dict(moe_router_score_function="sinkhorn"),
                dict(moe_router_enable_expert_bias=True), dict(moe_expert_capacity_factor=0.0)):
        with pytest.raises(ValueError):
            MoEConfig(hidden_size=8, num_moe_experts=4, moe_ffn_hidden_size=16, **bad)


def test_bf16_layer_routes_in_fp32():
    """In bf16 the router's weight and logits stay fp32 and the experts run torch._grouped_mm in
    bf16 on this CPU; the output is the fp32 layer's within bf16's rounding."""
    torch.manual_seed(0)
    config = MoEConfig(hidden_size=HIDDEN, num_moe_experts=4, moe_ffn_hidden_size=FFN, init_method_std=0.5,
                       moe_shared_expert_intermediate_size=FFN)
    layer = MoELayer(config)
    tokens = torch.randn(16, HIDDEN).bfloat16().float()  # representable in bf16: the same logits on both sides
    reference = layer(tokens)
    half = MoELayer(dataclasses.replace(config, params_dtype=torch.bfloat16))
    with torch.no_grad():
        for name, tensor in layer.state_dict().items():
            half.state_dict()[name].copy_(tensor)
    assert half.router.weight.dtype == torch.float32 and half.experts.up_weight.dtype == torch.bfloat16
    assert grouped_mm_usable(tokens.bfloat16(), half.experts.up_weight)
    out = half(tokens.bfloat16())
    assert out.dtype == torch.bfloat16
    assert torch.equal(half.tokens_per_expert, layer.tokens_per_expert)  # the fp32 router chose the same
    assert (out.float() - reference).abs().max().item() <= 0.05 * reference.abs().max().item()


# ------------------------------------------------------------------ expert parallelism
CASES = {
    # name: (config overrides, expert bias to set (forces experts out), grouped product)
    "softmax_top2_shared_aux_z": (dict(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01,
                                       moe_shared_expert_intermediate_size=SHARED_FFN), None, None),
    "softmax_pre_top1_loop": (dict(moe_router_topk=1, moe_router_pre_softmax=True, moe_aux_loss_coeff=0.01),
                              None, False),
    # expert 5 gets no token at all (its bias is far below any other score)
    "sigmoid_bias_expert5_empty": (dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                                        moe_aux_loss_coeff=0.01, moe_shared_expert_intermediate_size=SHARED_FFN),
                                   {5: -10.0}, None),
    # experts 0-3 get nothing: under EP 2 rank 0's experts are all idle (empty splits both ways)
    "sigmoid_bias_first_half_empty": (dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True),
                                      {0: -10.0, 1: -10.0, 2: -10.0, 3: -10.0}, True),
}
SEQ, BATCH = 8, 4


def _config(**overrides) -> MoEConfig:
    # weights of std 0.5: outputs and gradients of order 1, so that an absolute 1e-6 means something
    values = dict(hidden_size=HIDDEN, num_moe_experts=EXPERTS, moe_ffn_hidden_size=FFN, moe_router_topk=2,
                  init_method_std=0.5)
    values.update(overrides)
    return MoEConfig(**values)


def _copy_slice(ep_layer: MoELayer, full: MoELayer) -> None:
    """ep_layer's weights are full's: the router and shared experts whole, the experts' slice."""
    start, n = ep_layer.local_expert_start, ep_layer.num_local_experts
    with torch.no_grad():
        for name, tensor in full.state_dict().items():
            target = ep_layer.state_dict()[name]
            target.copy_(tensor[start:start + n] if name.startswith("experts.") else tensor)


def _whole_expert_grad(ep_layer: MoELayer, name: str) -> torch.Tensor:
    """The gradient of all E experts' weight ``name``: this rank's slice placed in a zero tensor,
    summed over the world (ranks holding the same experts add up, as DP's all-reduce would)."""
    local = getattr(ep_layer.experts, name).grad
    whole = local.new_zeros(EXPERTS, *local.shape[1:])
    whole[ep_layer.local_expert_start:ep_layer.local_expert_start + ep_layer.num_local_experts] = local
    dist.all_reduce(whole)
    return whole


def _summed_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.clone()
    dist.all_reduce(tensor)
    return tensor


def _max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference, in units of the reference's largest magnitude where that exceeds
    1: weight gradients sum 32 tokens' contributions of order 1 in another order on each side,
    a few fp32 ulps of a value of order 10 are several 1e-6 (measured up to 7.6e-6 absolute)."""
    if not a.numel():
        return 0.0
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1.0)).item()


def _compare_case(rank: int, world: int, name: str, ep: int, ep_group, averaged: bool = False) -> dict[str, float]:
    """``averaged``: each rank's loss is a mean over its sequences and the gradients are averaged
    over the ranks (the usual data parallelism) against the mean over the whole batch, with
    ``aux_loss_scale`` = the number of ranks; otherwise the ranks' summed losses against the sum."""
    overrides, bias, use_grouped_mm = CASES[name]
    config = _config(**overrides)
    torch.manual_seed(1234 + list(CASES).index(name))  # the same full layer and batch on every rank
    full = MoELayer(config, use_grouped_mm=use_grouped_mm)
    if bias is not None:
        for expert, value in bias.items():
            full.router.expert_bias[expert] = value
    batch = torch.randn(SEQ, BATCH, HIDDEN)
    out_grad = torch.randn(SEQ, BATCH, HIDDEN)
    ep_layer = MoELayer(config, ep_group=ep_group, token_group=dist.group.WORLD, use_grouped_mm=use_grouped_mm)
    _copy_slice(ep_layer, full)

    whole = batch.clone().requires_grad_()
    full_out = full(whole)
    ((full_out * out_grad).sum() / (BATCH if averaged else 1)).backward()

    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)  # this rank's sequences
    mine = batch[:, rows].clone().requires_grad_()
    ep_layer.aux_loss_scale = world if averaged else 1.0
    out = ep_layer(mine)
    ((out * out_grad[:, rows]).sum() / (BATCH // world if averaged else 1)).backward()
    # averaged: the ranks' weight gradients are averaged, and each rank's input gradient is its
    # own loss's, world times the whole batch's mean's
    per_rank = world if averaged else 1

    def _summed(tensor: torch.Tensor) -> torch.Tensor:
        return _summed_over_ranks(tensor) / per_rank

    errors = {
        "output": _max_error(out, full_out[:, rows]),
        "input_grad": _max_error(mine.grad / per_rank, whole.grad[:, rows]),
        "router_grad": _max_error(_summed(ep_layer.router.weight.grad), full.router.weight.grad),
        "tokens_per_expert": _max_error(_summed_over_ranks(ep_layer.tokens_per_expert), full.tokens_per_expert),
    }
    for weight in ("gate_weight", "up_weight", "down_weight"):
        errors[f"experts.{weight}_grad"] = _max_error(_whole_expert_grad(ep_layer, weight) / per_rank,
                                                     getattr(full.experts, weight).grad)
    if full.shared_experts is not None:
        for param_name, param in ep_layer.shared_experts.named_parameters():
            reference = dict(full.shared_experts.named_parameters())[param_name].grad
            errors[f"shared_experts.{param_name}_grad"] = _max_error(_summed(param.grad), reference)
    for loss_name, value in full.aux_losses.items():
        errors[f"aux:{loss_name}"] = _max_error(_summed_over_ranks(ep_layer.aux_losses[loss_name]), value)
    if bias is not None:
        # the forced experts got no token, here (received from any rank) and in the whole batch
        idle = sorted(bias)
        assert full.tokens_per_expert[idle].sum().item() == 0
        assert all(e < 0 or e >= ep_layer.num_local_experts or ep_layer.local_tokens_per_expert[e] == 0
                   for e in (i - ep_layer.local_expert_start for i in idle))
    # not vacuous: every expert not forced out got tokens from the whole batch
    assert all(full.tokens_per_expert[e] > 0 for e in range(EXPERTS) if e not in (bias or {})), (
        name, full.tokens_per_expert.tolist())
    return errors


def _bias_updates(rank: int, world: int, ep_group, steps: int = 3) -> dict[str, float]:
    """Three forward/update rounds of a sigmoid router with expert bias, EP layer vs one process:
    the bias (from token counts summed over the ranks) and the outputs stay equal."""
    config = _config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                     moe_router_bias_update_rate=0.05)
    torch.manual_seed(99)
    full = MoELayer(config)
    ep_layer = MoELayer(config, ep_group=ep_group, token_group=dist.group.WORLD)
    _copy_slice(ep_layer, full)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    errors = {"bias": 0.0, "output": 0.0}
    with torch.no_grad():
        for _ in range(steps):
            batch = torch.randn(SEQ, BATCH, HIDDEN)
            full_out = full(batch)
            out = ep_layer(batch[:, rows])
            errors["output"] = max(errors["output"], _max_error(out, full_out[:, rows]))
            full.update_expert_bias()
            ep_layer.update_expert_bias()
            errors["bias"] = max(errors["bias"], _max_error(ep_layer.router.expert_bias, full.router.expert_bias))
    errors["_bias_moved"] = full.router.expert_bias.abs().max().item()
    return errors


def _ep_cases(rank: int, world: int) -> dict[str, dict[str, float]]:
    """Every case on this world: EP over the whole world and, on 4 ranks, EP 2 inside it (two EP
    groups, each expert held by two ranks whose gradients add up as data parallelism's would)."""
    torch.set_num_threads(1)
    layouts = {f"ep{world}": (world, dist.group.WORLD)}
    if world == 4:
        halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group
        layouts["ep2_in_world4"] = (2, halves[rank // 2])
    results = {}
    for layout, (ep, group) in layouts.items():
        for name in CASES:
            results[f"{layout}/{name}"] = _compare_case(rank, world, name, ep, group)
        # the auxiliary losses' scale under averaged gradients
        results[f"{layout}/softmax_top2_shared_aux_z/averaged"] = _compare_case(
            rank, world, "softmax_top2_shared_aux_z", ep, group, averaged=True)
        results[f"{layout}/bias_updates"] = _bias_updates(rank, world, group)
    return results


def _check(results: list[dict[str, dict[str, float]]]) -> None:
    for rank, by_case in enumerate(results):
        for case, errors in by_case.items():
            if case.endswith("bias_updates"):
                assert errors["_bias_moved"] > 0.0, (rank, case)
            for key, error in errors.items():
                if not key.startswith("_"):
                    assert error <= TOL, f"rank {rank} {case} {key}: {error:.3g}"


@pytest.fixture(scope="module")
def ep2_results():
    return spawn_ranks(_ep_cases, 2, timeout_s=240)


@pytest.fixture(scope="module")
def ep4_results():
    return spawn_ranks(_ep_cases, 4, timeout_s=240)


def test_ep2_equals_one_process(ep2_results):
    """EP 2 (2 ranks, 4 experts each): outputs, input/router/expert/shared-expert gradients, token
    counts and auxiliary losses equal one process on the whole batch, for every case (an expert
    with no token; a rank whose experts all get none); the expert bias equal after 3 updates."""
    _check(ep2_results)


def test_ep4_equals_one_process(ep4_results):
    """EP 4 (4 ranks, 2 experts each) and EP 2 inside a world of 4: as for EP 2."""
    _check(ep4_results)


def _exchange_round_trip(rank: int, world: int) -> list[float]:
    """Uneven splits (rank r sends r + e + 1 rows to expert e; some zero): dispatch then combine
    returns every row to its place, and the backward of the pair is the identity."""
    counts = torch.tensor([(rank + e + 1) % 3 for e in range(EXPERTS)])
    tokens = (torch.arange(int(counts.sum()) * 4, dtype=torch.float32).view(-1, 4) + 1000 * rank).requires_grad_()
    local, local_counts, state = dispatch_tokens(tokens, counts, dist.group.WORLD)
    assert local.shape[0] == int(local_counts.sum())
    back = combine_tokens(local * 2, state)
    grad = torch.randn_like(back)
    back.backward(grad)
    # a plain all_to_all's backward is the reverse exchange: row i of rank r's output came from
    # row 2r + i % 2 of rank i // 2, and its gradient (100 r + i) must return there
    x = torch.ones(world * 2, 1, requires_grad=True)
    y = all_to_all(x * (rank + 1), [2] * world, [2] * world, dist.group.WORLD)
    y.backward(100.0 * rank + torch.arange(world * 2.0).view(-1, 1))
    expected = torch.tensor([[(rank + 1) * (100.0 * (i // 2) + 2 * rank + i % 2)] for i in range(world * 2)])
    return [_max_error(back, tokens * 2), _max_error(tokens.grad, grad * 2), _max_error(x.grad, expected)]


def test_dispatch_combine_round_trip_on_two_ranks():
    results = spawn_ranks(_exchange_round_trip, 2, timeout_s=120)
    for errors in results:
        assert max(errors) == 0.0, errors
