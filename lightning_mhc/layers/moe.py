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


# ------------------------------------------------------------------ a router's auxiliary loss from summed statistics
class RouterLossRule:
    """A router's auxiliary loss written as a function of statistics that are *sums* over layers
    and tokens, so that each pipeline stage, CP rank or sequence-parallel rank takes the sums of its
    own layers and tokens, and adding them up gives exactly the statistics of the whole model on the
    whole sequence: :meth:`statistics` of one layer, :meth:`loss` of the sums.

    The statistics come in two parts: ``constant`` (no gradient: counts, rows) and
    ``differentiable`` (a function of the router logits). The loss's gradient reaches each layer
    through the chain rule at the summed statistics: ``d loss / d differentiable`` (computed once from
    the totals) times this layer's ``d differentiable / d logits`` (:meth:`logits_grad`), so no
    stage needs another's graph, only the totals."""

    name = "router_loss"

    def sizes(self, num_experts: int) -> tuple[int, int]:
        """The lengths of ``(constant, differentiable)`` (a stage without routers sends zeros)."""
        raise NotImplementedError

    def statistics(self, logits: Tensor, mask: Tensor | None, top_k: int) -> tuple[Tensor, Tensor]:
        """One layer's ``(constant, differentiable)`` sums from its router logits ``[T, E]`` and
        the tokens' mask ``[T]`` (None: every token counts)."""
        raise NotImplementedError

    def loss(self, constant: Tensor, differentiable: Tensor, num_experts: int) -> Tensor:
        """The loss from the statistics summed over every layer and token."""
        raise NotImplementedError

    def logits_grad(self, logits: Tensor, mask: Tensor | None, top_k: int, constant: Tensor, differentiable: Tensor,
                    num_experts: int, scale: float) -> Tensor:
        """``scale x d loss / d logits`` of one layer, the loss taken at the summed statistics
        ``(constant, differentiable)``."""
        with torch.enable_grad():
            totals = differentiable.detach().clone().requires_grad_(True)
            (outer,) = torch.autograd.grad(self.loss(constant, totals, num_experts), totals)
            local = logits.detach().requires_grad_(True)
            _, own = self.statistics(local, mask, top_k)
            (grad,) = torch.autograd.grad(own, local, grad_outputs=(outer * scale).to(own.dtype))
        return grad


class SwitchLoadBalancing(RouterLossRule):
    """Switch Transformer's load-balancing loss as Hugging Face's MoE families write it
    (``load_balancing_loss_func`` of Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE, transformers 5):
    every layer's logits are taken together, ``f_e = (top-k choices of e) / R`` and ``P_e = (sum of
    softmax probabilities of e) / R`` over the layers' unmasked rows ``R`` (layers x tokens), the loss
    ``E x sum_e f_e P_e`` (``f`` sums to ``k``, not 1: the top-k counts are not divided by ``k``).
    The softmax and top-k run in the logits' dtype, the sums in fp32, as theirs; a token counts where
    the attention mask is 1. Statistics: constant ``[counts_0..E-1, R]``, differentiable ``[P sums]``."""

    name = "load_balancing_loss"

    def sizes(self, num_experts: int) -> tuple[int, int]:
        return num_experts + 1, num_experts

    def statistics(self, logits: Tensor, mask: Tensor | None, top_k: int) -> tuple[Tensor, Tensor]:
        probs = torch.softmax(logits, dim=-1)
        _, chosen = torch.topk(probs, top_k, dim=-1)
        weight = (torch.ones(logits.shape[0], device=logits.device) if mask is None
                  else mask.reshape(-1).to(device=logits.device, dtype=torch.float32))
        counts = torch.zeros(logits.shape[-1], dtype=torch.float32, device=logits.device).scatter_add_(
            0, chosen.reshape(-1), weight.repeat_interleave(top_k))
        prob_sums = (probs.float() * weight.unsqueeze(-1)).sum(0)
        return torch.cat([counts, weight.sum().reshape(1)]), prob_sums

    def loss(self, constant: Tensor, differentiable: Tensor, num_experts: int) -> Tensor:
        counts, rows = constant[:-1], constant[-1]
        return (counts / rows * (differentiable / rows)).sum() * num_experts


SWITCH_LOAD_BALANCING = SwitchLoadBalancing()
"""The Hugging Face MoE families' router loss (``Family.router_loss``)."""
