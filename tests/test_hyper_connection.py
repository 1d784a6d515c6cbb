"""The mHC math of HyperConnectionModule (the mHC paper, arXiv 2512.24880, eq. 7-9)."""
from __future__ import annotations

import math

import pytest
import torch

from lightning_mhc import HyperConnectionModule
from lightning_mhc.layers.hyper_connection import sinkhorn_knopp
from lightning_mhc.layers.init import ParamInit
from model_utils import mhc_sublayer_reference, tiny_config


def make_hc(**overrides) -> HyperConnectionModule:
    return HyperConnectionModule(tiny_config(**overrides), ParamInit(7, "hc"))


def randomize(hc: HyperConnectionModule, seed: int = 0) -> HyperConnectionModule:
    """Parameters far from init: non-trivial, non-symmetric H_res, distinct H_pre/H_post."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in hc.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        hc.a_pre.fill_(1.0), hc.a_post.fill_(1.0), hc.a_res.fill_(1.0)
    return hc


def assert_doubly_stochastic(h_res: torch.Tensor, tol: float = 1e-4) -> None:
    assert h_res.dtype == torch.float32
    assert (h_res >= 0).all()
    rows = (h_res.sum(-1) - 1).abs().max().item()
    cols = (h_res.sum(-2) - 1).abs().max().item()
    assert rows < tol and cols < tol, f"row error {rows:.2e}, column error {cols:.2e}"


@pytest.mark.parametrize("scale", [0.1, 1.0, 10.0])
def test_h_res_doubly_stochastic_fp32(scale):
    hc = make_hc()
    x = torch.randn(16, 3, hc.n * hc.hidden_size) * scale
    h_pre, h_post, h_res = hc.compute_mappings(x)
    assert h_res.shape == (16, 3, 4, 4)
    assert_doubly_stochastic(h_res)
    assert h_pre.shape == h_post.shape == (16, 3, 4)
    assert ((h_pre > 0) & (h_pre < 1)).all() and ((h_post > 0) & (h_post < 2)).all()


def test_h_res_doubly_stochastic_under_bf16_autocast():
    hc = randomize(make_hc())
    with torch.no_grad():  # logits of spread ~0.5, the regime 20 iterations converge in
        hc.phi_res.mul_(0.05)
    x = torch.randn(16, 3, hc.n * hc.hidden_size).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h_pre, h_post, h_res = hc.compute_mappings(x)
    assert h_pre.dtype == h_post.dtype == torch.float32
    assert_doubly_stochastic(h_res)
    # fp32 mappings: bf16 input and fp32 input of the same values agree exactly.
    _, _, h_res32 = hc.compute_mappings(x.float())
    torch.testing.assert_close(h_res, h_res32, rtol=0, atol=0)


def test_sinkhorn_random_logits():
    logits = torch.randn(4096, 4, 4) * 0.5
    p = sinkhorn_knopp(logits, 20)
    assert_doubly_stochastic(p)
    # more iterations keep converging on harder (wider) logits
    wide = torch.randn(1024, 4, 4) * 2
    err = lambda it: (sinkhorn_knopp(wide, it).sum(-2) - 1).abs().max().item()
    assert err(200) < err(20)


def test_sinkhorn_from_half_precision_input_is_fp32():
    logits = torch.randn(8, 4, 4).to(torch.bfloat16)
    assert sinkhorn_knopp(logits, 20).dtype == torch.float32


def test_apply_h_res_orientation():
    """Stream i becomes sum_j H[i, j] x_j (the known transposition bug would give H[j, i])."""
    hc = make_hc(hidden_size=8, num_attention_heads=2, ffn_hidden_size=16)
    n, C = hc.n, hc.hidden_size
    h = torch.rand(1, 1, n, n)
    x = torch.randn(1, 1, n * C)
    out = hc.apply_h_res(h, x).view(n, C)
    streams = x.view(n, C)
    for i in range(n):
        expected = sum(h[0, 0, i, j] * streams[j] for j in range(n))
        torch.testing.assert_close(out[i], expected)


def test_aggregate_and_h_post():
    hc = make_hc(hidden_size=8, num_attention_heads=2, ffn_hidden_size=16)
    n, C = hc.n, hc.hidden_size
    x = torch.randn(2, 1, n * C)
    h_pre = torch.rand(2, 1, n)
    agg = hc.aggregate(x, h_pre)
    torch.testing.assert_close(agg, sum(h_pre[..., k:k + 1] * x[..., k * C:(k + 1) * C] for k in range(n)))
    out, bias = torch.randn(2, 1, C), torch.randn(C)
    h_post = torch.rand(2, 1, n)
    spread, no_bias = hc.apply_h_post((out, bias), h_post)
    assert no_bias is None
    for i in range(n):
        torch.testing.assert_close(spread[..., i * C:(i + 1) * C], h_post[..., i:i + 1] * (out + bias))


def test_full_sublayer_matches_equations():
    """Module methods composed as a layer does == eq. 7-9 written stream by stream."""
    hc = randomize(make_hc())
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 2, hc.n * hc.hidden_size, generator=g)
    w = torch.randn(hc.hidden_size, hc.hidden_size, generator=g) / 8
    branch = lambda h: torch.tanh(h @ w)
    aggregated, h_res, h_post = hc(x)
    mixed = hc.apply_h_res(h_res, x)
    out, _ = hc.apply_h_post((branch(aggregated), None), h_post)
    torch.testing.assert_close(mixed + out, mhc_sublayer_reference(hc, x, branch))
    # H_res is applied: dropping it changes the result
    assert not torch.allclose(mixed, x, atol=1e-3)


def test_init():
    hc = make_hc(mhc_init_gating_factor=0.01)
    for name in ("a_pre", "a_post", "a_res"):
        assert getattr(hc, name).item() == pytest.approx(0.01)
    x = HyperConnectionModule.input_expand(torch.randn(3, 2, hc.hidden_size), hc.n)
    h_pre, h_post, h_res = hc.compute_mappings(x)
    # close to a plain residual: H_pre averages, H_post ~ 1, H_res ~ J/n
    torch.testing.assert_close(h_pre.sum(-1), torch.ones(3, 2), atol=1e-2, rtol=0)
    torch.testing.assert_close(h_post, torch.ones_like(h_post), atol=1e-2, rtol=0)
    torch.testing.assert_close(h_res, torch.full_like(h_res, 1 / hc.n), atol=1e-2, rtol=0)
    assert hc.b_pre[0].item() == pytest.approx(-math.log(hc.n - 1))


def test_expand_contract_roundtrip():
    x = torch.randn(4, 2, 16)
    wide = HyperConnectionModule.input_expand(x, 3)
    assert wide.shape == (4, 2, 48)
    for i in range(3):
        torch.testing.assert_close(wide[..., i * 16:(i + 1) * 16], x)
    torch.testing.assert_close(HyperConnectionModule.output_contract(wide, 3), x)


def test_gradients_flow_to_every_parameter():
    hc = randomize(make_hc())
    x = torch.randn(4, 2, hc.n * hc.hidden_size, requires_grad=True)
    aggregated, h_res, h_post = hc(x)
    out, _ = hc.apply_h_post((aggregated.sin(), None), h_post)
    (hc.apply_h_res(h_res, x) + out).square().sum().backward()
    for name, p in hc.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
