"""DeepSeek-V4's attention under context parallelism (CP): its sliding window, its compressed
sparse attention (CSA: the indexer's top-k over the compressed sequence) and its heavily
compressed attention (HCA) over the load-balanced chunks, exact against one process.

Each CP rank holds chunks ``r`` and ``2·cp − 1 − r`` of ``2·cp`` (``distributed.context_parallel``)
at their global positions (``any_model.context_parallel.SequenceSplit`` gives the model explicit
``position_ids``, so the queries' and the sliding K/V's rotary angles are the un-split sequence's).
The family record's CP pass (:func:`split_attention_over_context`) replaces each built V4
attention's forward with :func:`context_parallel_attention_forward`, which follows transformers'
``DeepseekV4Attention.forward`` line by line except on the sequence:

- **The queries** (the low-rank query, its heads, their rotary) are this rank's tokens only.
- **The sliding K/V** (one shared head, normed and rotated per token) is computed on this rank's
  tokens and all-gathered over CP into global order (``gather_sequence``: its backward
  reduce-scatters the gradient, summed over the ranks whose queries read it).
- **The compressed entries** are made from the whole sequence: the attention's input (and, for
  CSA, the low-rank query the indexer scores with) is all-gathered the same way and the layer's
  own compressor runs on it as in one process (its windows of ``compress_rate`` tokens, CSA's
  overlapping pairs, the entries' rotary at ``window · compress_rate``, the indexer's top-k for
  every query with its causal threshold), so no window is cut by a chunk border. Each rank keeps
  its own queries' rows of the compressor's per-query bias (causality and the indexer's picks).
- **The mask** over the gathered keys is the sliding window's at the global positions (key ``j``
  seen by query ``p`` iff ``0 <= p − j < sliding_window``) and the batch's padding mask
  (``family_context.key_mask``, shared with HY-V4's), the compressor's bias after it; the
  attention itself is the model's (the sinks; under TP the shared K/V head's gradient summed over
  TP, ``deepseek_v4.shared_kv_attention``).

What this costs: every rank computes the compressed entries (and the indexer's scores) of the
whole sequence, ``cp`` times the one-process work of the compressor, and keeps the gathered input
of each compressed layer and the whole sequence's K/V for backward; the queries, the output
projections, the hyper-connections and the experts are split ``1/cp``.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_mhc.any_model.family_context import check_split_call, key_mask, replace_attention_forward
from lightning_mhc.distributed.context_parallel import gather_sequence
from lightning_mhc.layers.sequence import SequenceSplit


def is_v4_attention(module: nn.Module) -> bool:
    """``module`` is a V4 attention (its per-head sinks and its grouped output projection)."""
    return hasattr(module, "sinks") and hasattr(module, "o_a_proj")


def split_attention_over_context(chunk: nn.Module, layout: Any) -> None:
    """The family's CP pass on a built ``chunk`` (CP > 1): each V4 attention runs
    :func:`context_parallel_attention_forward` over ``layout``'s CP group."""
    replace_attention_forward(chunk, layout, is_v4_attention, context_parallel_attention_forward)


def context_parallel_attention_forward(module: nn.Module, split: SequenceSplit, hidden_states: Tensor,
                                       position_embeddings: dict[str, tuple[Tensor, Tensor]], position_ids: Tensor,
                                       attention_mask: Tensor | None, cache: Any = None, **kwargs: Any):
    """``DeepseekV4Attention.forward`` on this rank's chunks (``hidden_states [b, s/cp, D]`` at
    the global ``position_ids``) against the whole sequence's keys (the module docstring)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb, eager_attention_forward

    from lightning_mhc.any_model.deepseek_v4 import shared_kv_attention

    check_split_call("DeepSeek-V4", cache, kwargs, attention_mask)
    group = split.group
    batch, local_len = hidden_states.shape[:2]
    seq_len = local_len * split.size
    hidden_shape = (batch, local_len, -1, module.head_dim)
    cos, sin = position_embeddings[module.rope_layer_type]

    q_residual = module.q_a_norm(module.q_a_proj(hidden_states))
    q = module.q_b_proj(q_residual).view(*hidden_shape).transpose(1, 2)
    q = module.q_b_norm(q)
    q = apply_rotary_pos_emb(q, cos, sin)

    kv = module.kv_norm(module.kv_proj(hidden_states)).view(*hidden_shape).transpose(1, 2)
    kv = gather_sequence(apply_rotary_pos_emb(kv, cos, sin), group, dim=2)  # [b, 1, s, head_dim], global order

    mask = key_mask(position_ids.expand(batch, -1), seq_len, attention_mask, hidden_states.dtype,
                    window=module.sliding_window)
    if module.compressor is not None:
        whole = gather_sequence(hidden_states, group, dim=1)
        # the indexer scores every query's low-rank query against the compressed keys (CSA only)
        whole_q_residual = gather_sequence(q_residual, group, dim=1) if hasattr(module.compressor, "indexer") else None
        positions = torch.arange(seq_len, device=hidden_states.device).expand(batch, -1)
        compressed_kv, block_bias = module.compressor(whole, whole_q_residual, positions, None, module.layer_idx)
        kv = torch.cat([kv, compressed_kv], dim=2)
        if block_bias is not None:  # None: no window is complete yet
            own_rows = block_bias.index_select(2, split.positions(seq_len, device=block_bias.device))
            mask = torch.cat([mask, own_rows.to(mask.dtype)], dim=-1)

    attention = shared_kv_attention if hasattr(module, "shared_kv_group") else eager_attention_forward
    attn_output, attn_weights = attention(module, q, kv, kv, mask,
                                          dropout=0.0 if not module.training else module.attention_dropout,
                                          scaling=module.scaling, sliding_window=module.sliding_window,
                                          s_aux=module.sinks, **kwargs)
    # transformers' lines from here: the rope undone on the output, the grouped output projection
    attn_output = apply_rotary_pos_emb(attn_output.transpose(1, 2), cos, -sin).transpose(1, 2)
    grouped = attn_output.reshape(batch, local_len, module.config.o_groups, -1)
    grouped = module.o_a_proj(grouped).flatten(2)
    return module.o_b_proj(grouped), attn_weights


__all__ = ["context_parallel_attention_forward", "is_v4_attention", "split_attention_over_context"]
