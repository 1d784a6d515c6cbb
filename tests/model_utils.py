"""Small model configurations and independent reference math for the tests."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from lightning_mhc.model import MHCTransformerConfig


def rel_err(a: torch.Tensor, b: torch.Tensor, scale: float | None = None) -> float:
    """``max|a - b|`` over ``scale`` (default ``max|b|``), in fp32."""
    a, b = a.float(), b.float()
    denom = b.abs().max().item() if scale is None else scale
    return (a - b).abs().max().item() / denom


def tiny_config(**overrides) -> MHCTransformerConfig:
    kwargs = dict(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=128,
        vocab_size=256,
        max_sequence_length=64,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    kwargs.update(overrides)
    return MHCTransformerConfig(**kwargs)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    out = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return out if weight is None else out * weight


def plain_attention(layer, h: torch.Tensor, freqs) -> torch.Tensor:
    """Causal MHA written from the weights (no grouped-query layout: heads == groups)."""
    attn = layer.self_attention
    s, b, _ = h.shape
    d, heads = attn.head_dim, attn.heads_per_rank
    qkv = F.linear(h, attn.linear_qkv.weight, attn.linear_qkv.bias).view(s, b, heads, 3 * d)
    q, k, v = qkv.split(d, dim=-1)
    if freqs is not None:
        def rot(t):
            t1, t2 = t.chunk(2, dim=-1)
            return t * freqs.cos() + torch.cat([-t2, t1], dim=-1) * freqs.sin()
        q, k = rot(q), rot(k)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / math.sqrt(d)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    ctx = torch.einsum("bhst,tbhd->sbhd", probs, v).reshape(s, b, heads * d)
    return F.linear(ctx, attn.linear_proj.weight, attn.linear_proj.bias)


def plain_mlp(layer, h: torch.Tensor) -> torch.Tensor:
    mlp = layer.mlp
    inter = F.gelu(F.linear(h, mlp.linear_fc1.weight, mlp.linear_fc1.bias))
    return F.linear(inter, mlp.linear_fc2.weight, mlp.linear_fc2.bias)


def plain_prenorm_layer(layer, x: torch.Tensor, freqs=None) -> torch.Tensor:
    """x + attn(norm(x)), then + mlp(norm(.)), from the layer's weights."""
    eps = layer.config.layernorm_epsilon
    x = x + plain_attention(layer, rms_norm(x, layer.input_layernorm.weight, eps), freqs)
    return x + plain_mlp(layer, rms_norm(x, layer.pre_mlp_layernorm.weight, eps))


def sinkhorn_reference(logits: torch.Tensor, iterations: int, eps: float = 1e-6) -> torch.Tensor:
    """Columns, then rows; every sum clamped to >= eps (the library's rule, written again)."""
    p = torch.exp(logits - logits.amax(dim=(-2, -1), keepdim=True))
    for _ in range(iterations):
        p = p / p.sum(-2, keepdim=True).clamp_min(eps)
        p = p / p.sum(-1, keepdim=True).clamp_min(eps)
    return p


def mhc_sublayer_reference(hc, x: torch.Tensor, branch) -> torch.Tensor:
    """eq. 7-9 stream by stream: x_i' = sum_j H_res[i,j] x_j + H_post[i] * F(sum_k H_pre[k] x_k)."""
    n, C = hc.n, hc.hidden_size
    xn = rms_norm(x, None, hc.eps)
    pre = torch.sigmoid(hc.a_pre * (xn @ hc.phi_pre) + hc.b_pre)
    post = 2 * torch.sigmoid(hc.a_post * (xn @ hc.phi_post) + hc.b_post)
    res = sinkhorn_reference(
        hc.a_res * (xn @ hc.phi_res).view(*x.shape[:-1], n, n) + hc.b_res, hc.sinkhorn_iterations
    )
    streams = [x[..., i * C:(i + 1) * C] for i in range(n)]
    f = branch(sum(pre[..., k:k + 1] * streams[k] for k in range(n)))
    out = []
    for i in range(n):
        mixed = sum(res[..., i, j:j + 1] * streams[j] for j in range(n))
        out.append(mixed + post[..., i:i + 1] * f)
    return torch.cat(out, dim=-1)


def train_steps(model, steps: int = 3, batch: int = 2, seq: int = 16, lr: float = 1e-2, seed: int = 0):
    """AdamW steps on fixed random tokens; returns per-step (loss, {name: grad}) and the model."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    history = []
    for _ in range(steps):
        tokens = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)
        loss = model(tokens, labels=tokens.roll(-1, 1)).mean()
        loss.backward()
        history.append((loss.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return history


def hc_sublayer(x, phi, alpha, bias, weight, out_bias, n: int, implementation: str):
    """One hyper-connected sub-layer with a linear branch, as a layer runs it: ``(next stream,
    H_post)`` by the fused ops with Triton's kernels, or by the op-by-op reference."""
    from lightning_mhc.model.bda import h_res_h_post_bias_dropout_add
    from lightning_mhc.ops.hyper_connection import fused_pre_packed, reference_pre

    if implementation == "triton":
        from lightning_mhc.ops.triton_kernels import TritonKernels


        aggregated, h_res, h_post = fused_pre_packed(x, phi, alpha, bias, n=n, eps=1e-6, iterations=8,
                                                     kernels=TritonKernels)
    else:
        params = (*phi.split([n, n, n * n], dim=1), *alpha.unbind(), bias[:n], bias[n:2 * n], bias[2 * n:].view(n, n))
        aggregated, h_res, h_post = reference_pre(x, params, n, 1e-6, 8)
    branch = (aggregated @ weight.to(aggregated.dtype), out_bias.to(aggregated.dtype))
    return h_res_h_post_bias_dropout_add(branch, x, h_res, h_post, 0.0, True, implementation), h_post
