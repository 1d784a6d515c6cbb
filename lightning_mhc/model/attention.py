"""Causal self-attention on megatron-core tensor-parallel linears and SDPA.

``linear_qkv`` (column-parallel) uses megatron's grouped layout: per query
group ``[q_1..q_k, k, v]``, so each TP rank holds whole groups.
``linear_proj`` (row-parallel) returns its bias separately for the
bias-dropout-add that follows.

Under context parallelism (``context_parallel_group`` set by ``GPTModel``) a rank holds two chunks
of the sequence; the core attention all-gathers K and V over the CP group
(``distributed.context_parallel``: only the K/V heads it has, before any GQA repeat) and each local
query attends to its causal prefix in global positions. A recompute that re-runs the core
attention (``core_attn``, ``full``) re-runs the gather too: the same collective, in the same
order on every CP rank, since the ranks run the same backward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.parallel_state import get_tensor_model_parallel_world_size
from torch import Tensor

from lightning_mhc.distributed.context_parallel import context_parallel_attention
from lightning_mhc.model.config import MHCTransformerConfig
from lightning_mhc.layers.init import ParamInit
from lightning_mhc.model.parallel_linear import SPColumnParallelLinear, output_projection
from lightning_mhc.model.rope import apply_rotary
from lightning_mhc.recompute.without_output import checkpoint
from lightning_mhc.recompute.rng import rng_fork


class SelfAttention(torch.nn.Module):
    def __init__(self, config: MHCTransformerConfig, init: ParamInit) -> None:
        super().__init__()
        self.config = config
        tp = get_tensor_model_parallel_world_size()
        self.head_dim = config.kv_channels
        self.heads_per_rank = config.num_attention_heads // tp
        self.groups_per_rank = config.num_query_groups // tp
        self.heads_per_group = config.num_attention_heads // config.num_query_groups
        self.recompute_core_attention = False  # "core_attn" in recompute_modules
        self.kv_cache = None
        """A ``generation.LayerKVCache`` while generating: keys and values of earlier positions."""
        self.context_parallel_group = None
        """The CP group (set by ``GPTModel`` under context parallelism): attention over the whole
        sequence from this rank's chunks."""
        qkv_size = self.head_dim * (config.num_attention_heads + 2 * config.num_query_groups)
        self.linear_qkv = SPColumnParallelLinear(
            config.hidden_size,
            qkv_size,
            config=config,
            init_method=init.normal("linear_qkv.weight", config.init_method_std),
            bias=config.add_bias_linear,
            gather_output=False,
        )
        self.linear_proj = output_projection(config, config.num_attention_heads * self.head_dim, init, "linear_proj")

    def forward(
        self, hidden_states: Tensor, rotary_freqs: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        qkv, _ = self.linear_qkv(hidden_states)  # the whole sequence, also under sequence parallelism
        s, b, _ = qkv.shape
        qkv = qkv.view(s, b, self.groups_per_rank, (self.heads_per_group + 2) * self.head_dim)
        q, k, v = qkv.split(
            [self.heads_per_group * self.head_dim, self.head_dim, self.head_dim], dim=-1
        )
        q = q.reshape(s, b, self.heads_per_rank, self.head_dim)
        if rotary_freqs is not None:
            q, k = apply_rotary(q, rotary_freqs), apply_rotary(k, rotary_freqs)
        past = 0
        if self.kv_cache is not None:
            past = self.kv_cache.length
            k, v = self.kv_cache.extend(k, v)
        if self.recompute_core_attention and self.training and torch.is_grad_enabled():
            context = checkpoint(self.core_attention, q, k, v)
        else:
            context = self.core_attention(q, k, v, past)
        return self.linear_proj(context)

    def core_attention(self, q: Tensor, k: Tensor, v: Tensor, past: int = 0) -> Tensor:
        """``q [s,b,heads,d]``, ``k, v [past + s,b,groups,d]`` -> context ``[s, b, heads*d]``
        (query ``i`` sees keys ``0 .. past + i``)."""
        s, b = q.shape[:2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
        dropout = self.config.attention_dropout if self.training else 0.0
        if self.context_parallel_group is not None:  # this rank's chunks against the gathered K/V
            with rng_fork():  # heads split over TP, queries over CP: masks differ on every rank
                out = context_parallel_attention(q, k, v, self.context_parallel_group, dropout_p=dropout)
            return out.permute(2, 0, 1, 3).reshape(s, b, self.heads_per_rank * self.head_dim)
        if self.heads_per_group > 1:
            k = k.repeat_interleave(self.heads_per_group, dim=1)
            v = v.repeat_interleave(self.heads_per_group, dim=1)
        mask = None
        if past:  # causal over the cached positions too
            mask = torch.ones(s, past + s, dtype=torch.bool, device=q.device).tril(diagonal=past)
        with rng_fork():  # heads are split across TP: masks differ on every rank
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None)
        return out.permute(2, 0, 1, 3).reshape(s, b, self.heads_per_rank * self.head_dim)
