"""DeepSeek-V4's hyper-connections as transformers builds them, for the tests and benchmarks that
hold this project's ops to them (tests/test_deepseek_v4_ops.py, tests/test_gpu.py,
benchmarks/v4_hyper_connection.py).

A sub-layer: the streams ``x [B, S, n, D]`` through ``attn_hc``, a ``Linear(D, D)`` branch on the
collapsed input, and the layer's ``post ⊗ F + comb^T x`` (transformers' decoder layer's lines),
then the hyper head on the result; forward results and the gradients of ``x`` and of every
parameter. "transformers" runs the modules as transformers wrote them; "fp64" runs the same code
of transformers in fp64 (its ``.float()`` casts made no-ops), the exact evaluation every fp32 run
is measured against; our implementations run the same modules after ``use_our_ops``.
"""
from __future__ import annotations

import contextlib
import copy

import torch

RESULTS = ("next stream", "head out", "post", "comb", "dx", "d fn", "d base", "d scale", "d branch weight",
           "d hc_fn", "d hc_base", "d hc_scale")


def v4_config(hidden: int = 16, n: int = 4, iterations: int = 20):
    from transformers import DeepseekV4Config

    return DeepseekV4Config(hidden_size=hidden, hc_mult=n, hc_sinkhorn_iters=iterations, num_hidden_layers=1)


def v4_modules(hidden: int = 16, n: int = 4, iterations: int = 20, sharp: bool = False, seed: int = 0,
               device="cpu"):
    """``(hyper-connection, hyper head, branch)`` with their parameters moved away from init:
    logits of about unit size at init scale (``fn`` at std 0.02 as transformers draws it, ``base``
    and ``scale`` drawn around theirs), or ``|logit| ~ 25`` when ``sharp``."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection, DeepseekV4HyperHead

    cfg = v4_config(hidden, n, iterations)
    g = torch.Generator().manual_seed(seed)
    hc, head = DeepseekV4HyperConnection(cfg), DeepseekV4HyperHead(cfg)
    width = n * hidden
    with torch.no_grad():
        # an RMS-normalised stream has unit entries: a column of fn at std s gives logits of
        # about s sqrt(n D) before the scale
        std = 1.0 / width ** 0.5 if sharp else 0.02
        for fn in (hc.fn, head.hc_fn):
            fn.copy_(torch.randn(fn.shape, generator=g) * std)
        hc.base.copy_(torch.randn(hc.base.shape, generator=g) * (5.0 if sharp else 0.5))
        head.hc_base.copy_(torch.randn(head.hc_base.shape, generator=g) * (5.0 if sharp else 0.5))
        hc.scale.copy_(torch.tensor([25.0, 20.0, 25.0]) if sharp else 1.0 + 0.1 * torch.randn(3, generator=g))
        head.hc_scale.fill_(25.0 if sharp else 1.0)
    branch = torch.nn.Linear(hidden, hidden, bias=False)
    with torch.no_grad():
        branch.weight.copy_(torch.randn(branch.weight.shape, generator=g) / hidden ** 0.5)
    return tuple(m.to(device) for m in (hc, head, branch))


def v4_inputs(tokens: int, hidden: int = 16, n: int = 4, seed: int = 1, device="cpu", dtype=torch.float32):
    """The streams ``[1, tokens, n, D]`` and the upstream gradients of the sub-layer's outputs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, tokens, n, hidden, generator=g)
    upstream = [torch.randn(1, tokens, n, hidden, generator=g), torch.randn(1, tokens, hidden, generator=g),
                torch.randn(1, tokens, n, generator=g), torch.randn(1, tokens, n, n, generator=g)]
    return x.to(device, dtype), [u.to(device) for u in upstream]


def transformers_sublayer(hc, head, branch, x):
    """transformers' lines: ``attn_hc``, the branch, the decoder layer's mix, ``hc_head``."""
    post, comb, collapsed = hc(x)
    out = branch(collapsed)
    dtype = x.dtype
    y = post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), x)
    return y, head(y), post, comb


def our_sublayer(hc, head, branch, x):
    """The same on our ops: ``hc`` and ``head`` after ``use_our_ops``, the mix by our kernels."""
    from lightning_mhc.ops.deepseek_v4 import deepseek_v4_res_post

    post, comb, collapsed = hc(x)
    y = deepseek_v4_res_post(x, post, comb, branch(collapsed), hc.mhc_implementation)
    return y, head(y), post, comb


@contextlib.contextmanager
def float_is_identity():
    """transformers' V4 code casts to fp32 with ``.float()``; inside, ``.float()`` keeps fp64, so
    its own lines evaluate in fp64."""
    original = torch.Tensor.float
    torch.Tensor.float = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.float = original


def sublayer_results(modules, x, upstream, ours: bool = False) -> list[torch.Tensor]:
    """``RESULTS``: the sub-layer's outputs and gradients (the loss summed in the stream's
    precision, or fp64 for an fp64 run)."""
    hc, head, branch = modules
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    leaf = x.clone().requires_grad_(True)
    outs = (our_sublayer if ours else transformers_sublayer)(hc, head, branch, leaf)
    loss = sum((o.to(wide) * u.to(wide)).sum() for o, u in zip(outs, upstream))
    params = [hc.fn, hc.base, hc.scale, branch.weight, head.hc_fn, head.hc_base, head.hc_scale]
    grads = torch.autograd.grad(loss, [leaf, *params])
    return [*(o.detach() for o in outs), *grads]


def fp64_results(modules, x, upstream) -> list[torch.Tensor]:
    """transformers' own code in fp64 on the same values."""
    doubled = [copy.deepcopy(m).double() for m in modules]
    with float_is_identity():
        return sublayer_results(doubled, x.double(), [u.double() for u in upstream])


def ours_of(modules, implementation: str):
    """Copies of ``(hc, head, branch)`` with the hyper-connection and head on our ops."""
    from lightning_mhc.ops.deepseek_v4 import use_our_ops

    hc, head, branch = (copy.deepcopy(m) for m in modules)
    return use_our_ops(hc, implementation), use_our_ops(head, implementation), branch


def error(a: torch.Tensor, exact: torch.Tensor) -> float:
    return ((a.double() - exact.double()).abs().max() / exact.double().abs().max()).item()


def errors(implementation: str, modules, x, upstream, exact=None) -> dict:
    """``{result: (ours against fp64, transformers' fp32 against fp64, ours against transformers')}``."""
    exact = exact if exact is not None else fp64_results(modules, x, upstream)
    theirs = sublayer_results(modules, x, upstream)
    ours = sublayer_results(ours_of(modules, implementation), x, upstream, ours=True)
    return {name: (error(o, e), error(t, e), error(o, t)) for name, o, t, e in zip(RESULTS, ours, theirs, exact)}


# ------------------------------------------------------------------ a whole tiny model (parallelize's tests)
V4_VOCAB, V4_EXPERTS = 64, 4


def tiny_v4_config(layers: int = 4):
    """A tiny ``DeepseekV4Config`` with every kind of V4 layer: compressed sparse attention (the
    indexer's top 2 of the compressed entries, compression 4), heavily compressed attention
    (compression 8), a sliding window of 8 alone; the first layer hash-routed, the rest by
    top-2 of 4 experts with the score-correction bias; 4 streams; 4 heads in 2 output groups; the
    experts' SwiGLU clamp at 0.2, which the tiny activations reach (V4's 10 would never bite here)."""
    from transformers import DeepseekV4Config

    kinds = ["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"]
    return DeepseekV4Config(
        vocab_size=V4_VOCAB, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=layers,
        num_attention_heads=4, head_dim=16, partial_rotary_factor=0.5, q_lora_rank=16, o_groups=2, o_lora_rank=8,
        n_routed_experts=V4_EXPERTS, num_experts_per_tok=2, layer_types=[kinds[i % 3] for i in range(layers)],
        mlp_layer_types=["hash_moe"] + ["moe"] * (layers - 1),
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}, sliding_window=8,
        index_n_heads=2, index_head_dim=8, index_topk=2, hc_mult=4, hc_sinkhorn_iters=5, max_position_embeddings=64,
        swiglu_limit=0.2, pad_token_id=None)


def moved_from_init(model, seed: int = 0):
    """``model`` (a ``DeepseekV4ForCausalLM``) with every parameter moved off its init (the maps,
    sinks, position biases and zero-initialised parts too), the hash router's ``tid2eid`` filled with
    two distinct experts per token (all zeros would send every token to expert 0) and the
    score-correction biases moved, so that a layout that drops or misplaces any of them differs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=g) * 0.05)
        for name, buffer in model.named_buffers():
            if name.endswith("tid2eid"):
                buffer.copy_(torch.stack([torch.randperm(V4_EXPERTS, generator=g)[:buffer.shape[1]]
                                          for _ in range(buffer.shape[0])]))
            elif name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=g) * 0.1)
    return model


HY_V4_EXPERTS = 4


def tiny_hy_v4_config(layers: int = 4, **changes):
    """A tiny HY-V4 (transformers' ``HYV4Config``): a dense layer then MoE layers, 4 heads of
    multi-head latent attention, 4 streams; the indexer's top 4 keys, its layers full and shared in
    turn (with 4 layers each of two pipeline stages begins with a full one); 4 experts, 2 per token,
    and a shared expert; the experts' clamp of their gate and up projections at 0.1, where it cuts
    (at its default of 10 it would not at these sizes)."""
    from transformers import HYV4Config

    return HYV4Config(**{
        **dict(vocab_size=V4_VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
               num_hidden_layers=layers, num_attention_heads=4, n_routed_experts=HY_V4_EXPERTS,
               num_experts_per_tok=2, n_shared_experts=1, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
               qk_rope_head_dim=8, v_head_dim=8, index_topk=4, index_head_dim=16, index_n_heads=2,
               indexer_types=["full" if i % 2 == 0 else "shared" for i in range(layers)], hc_mult=4,
               swiglu_limit=0.1, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        **changes})
