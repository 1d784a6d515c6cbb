"""The model-agnostic pieces of a mixture-of-experts layer, which both model wings' MoE layers take.

A layer routes each token to ``k`` experts, makes one (token, expert) *pair* per choice
(:func:`token_expert_pairs`), sends the pairs to their experts' ranks and back
(``distributed.expert_parallel.experts_on_their_ranks``), runs each expert on its rows with one
grouped product (:func:`grouped_matmul`), and sums each token's experts' outputs weighted by the
router (:func:`combine_pairs`). The GPT's ``MoELayer`` (``model/moe.py``) routes with its own
router; the Hugging Face wing's ``ExpertParallelExperts`` (``any_model/experts.py``) takes the
model's routing as given.
"""
from __future__ import annotations

import torch
from torch import Tensor


def token_expert_pairs(top_k_experts: Tensor) -> tuple[Tensor, Tensor]:
    """``top_k_experts [T, k]`` (each token's chosen experts) -> ``(pair_token, pair_expert)``,
    one row per (token, chosen expert) pair, token-major: ``[T*k]`` each."""
    num_tokens, k = top_k_experts.shape
    pair_token = torch.arange(num_tokens, device=top_k_experts.device).repeat_interleave(k)
    return pair_token, top_k_experts.reshape(-1)


def combine_pairs(expert_output: Tensor, pair_token: Tensor, pair_weight: Tensor, num_tokens: int,
                  dtype: torch.dtype) -> Tensor:
    """Each token's experts' outputs weighted and summed: ``expert_output [P, H]`` (one row per
    pair) times ``pair_weight [P]``, cast to ``dtype`` and added into token ``pair_token`` of a
    ``[num_tokens, H]`` of zeros in ``dtype`` (the GPT: fp32; the Hugging Face wing: the
    activations' dtype, as its model's experts)."""
    weighted = (expert_output * pair_weight.unsqueeze(-1)).to(dtype)
    output = torch.zeros(num_tokens, expert_output.shape[-1], dtype=dtype, device=expert_output.device)
    return output.index_add(0, pair_token, weighted)


def grouped_mm_usable(tokens: Tensor, weight: Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes ``tokens [M, K] @ weight [E, K, N]``.

    Measured on torch 2.13's CPU build: fp32, bf16 and fp16 are taken, fp64 is refused; the rows of
    both operands must be multiples of 16 bytes ("strides should be multiple of 16 bytes");
    offsets must be int32. On CUDA only bf16 on compute capability 9.0 or newer is assumed (not
    checked here); everything else takes the per-expert loop.
    """
    if not hasattr(torch, "_grouped_mm") or tokens.dtype != weight.dtype:
        return False
    if tokens.device.type == "cpu":
        if tokens.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return False
    elif tokens.device.type == "cuda":
        if tokens.dtype != torch.bfloat16 or torch.cuda.get_device_capability(tokens.device) < (9, 0):
            return False
    else:
        return False
    size = tokens.element_size()
    return (weight.shape[-2] * size) % 16 == 0 and (weight.shape[-1] * size) % 16 == 0


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: torch._grouped_mm's
    backward refuses a broadcast gradient ("Invalid strides/sizes, got [0, 0] for strides", seen
    on CPU with ``out.sum().backward()``)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.contiguous()


def grouped_matmul(tokens: Tensor, weight: Tensor, tokens_per_expert: Tensor, use_grouped_mm: bool | None = None
                   ) -> Tensor:
    """``tokens [M, K]`` (rows sorted by expert, ``tokens_per_expert[e]`` rows for expert ``e``)
    times ``weight[e] [K, N]``, per expert: one ``torch._grouped_mm`` where usable (``None``:
    decided by :func:`grouped_mm_usable`), a loop over the experts otherwise."""
    if use_grouped_mm is None:
        use_grouped_mm = grouped_mm_usable(tokens, weight)
    if use_grouped_mm:
        # offsets are the groups' ends and must reach M: rows past the last offset come back
        # uninitialised (seen on CPU), which the counts' sum rules out
        offsets = torch.cumsum(tokens_per_expert, 0).to(device=tokens.device, dtype=torch.int32)
        return _ContiguousGrad.apply(torch._grouped_mm(tokens.contiguous(), weight, offs=offsets))
    chunks = torch.split(tokens, tokens_per_expert.tolist())
    return torch.cat([chunk @ weight[e] for e, chunk in enumerate(chunks)]
                     + [tokens.new_empty(0, weight.shape[-1])])
