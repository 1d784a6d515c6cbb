"""HY-V4's attention under context parallelism (CP): its multi-head latent attention and its
indexer's top-k picks (``full`` layers pick, ``shared`` layers reuse the previous full layer's
picks) over the load-balanced chunks, exact against one process.

Each CP rank holds chunks ``r`` and ``2·cp − 1 − r`` of ``2·cp`` at their global positions (the
pieces every family with its own CP attention shares are ``family_context.py``'s). The family
record's CP pass (:func:`split_attention_over_context`) replaces each built HY-V4 attention's
forward with :func:`context_parallel_attention_forward`, which follows transformers'
``HYV4Attention.forward`` line by line except on the sequence:

- **The queries**, the output gate and the low-rank query the indexer scores with are this
  rank's tokens only (all per token).
- **The latent** (``kv_a_proj_with_mqa``: the normed ``kv_lora_rank`` part and the one rotary key
  every head shares, rotated at the token's global position) is computed on this rank's tokens
  and all-gathered over CP, one gather of ``kv_lora_rank + qk_rope_head_dim`` per token, the
  smallest thing the keys and values are made of; ``expand_kv`` then makes the rank's heads' keys
  and values of the whole sequence from it (under TP through the split's ``expand_kv``, the
  rotary key's gradient summed over TP).
- **The indexer** runs as transformers wrote it on this rank's queries: it hands the keys it
  scores against to its cache's ``update_indexer`` (the hook through which the keys of earlier
  tokens enter in generation), and here a stand-in for that cache (:class:`_GatheredIndexerKeys`)
  all-gathers them over CP, so each query scores every key of the whole sequence with the model's
  own scoring and picks its top-k over it (global key positions). It runs without gradient, as in
  one process. A ``shared`` layer reuses the picks of the full layer before it on the same rank:
  the same queries.
- **The mask** is this rank's queries' rows of the whole sequence's causal mask with the batch's
  padding mask (``family_context.key_mask``), the keys the indexer did not pick masked after it,
  as transformers' eager path does; the attention is the model's eager attention with its sinks.

What this costs: each rank expands the whole sequence's latent into its heads' keys and values
(``cp`` times ``kv_b_proj``'s one-process work) and keeps them for backward; the indexer's scores
are the rank's queries' rows (``1/cp``), its keys gathered; the rest is split ``1/cp``.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_mhc.any_model.family_context import check_split_call, key_mask, replace_attention_forward
from lightning_mhc.distributed.context_parallel import gather_sequence
from lightning_mhc.layers.sequence import SequenceSplit


def is_hy_v4_attention(module: nn.Module) -> bool:
    """``module`` is a HY-V4 attention (its latent expanded by ``expand_kv``, its ``skip_topk``)."""
    return hasattr(module, "expand_kv") and hasattr(module, "skip_topk")


def split_attention_over_context(chunk: nn.Module, layout: Any) -> None:
    """The family's CP pass on a built ``chunk`` (CP > 1): each HY-V4 attention runs
    :func:`context_parallel_attention_forward` over ``layout``'s CP group."""
    replace_attention_forward(chunk, layout, is_hy_v4_attention, context_parallel_attention_forward)


class _GatheredIndexerKeys:
    """What the indexer sees as its cache under CP: ``update_indexer`` returns the keys ``[b,
    s/cp, d]`` it was handed all-gathered over the CP group into the whole sequence's, in global
    order (the indexer runs without gradient)."""

    def __init__(self, group) -> None:
        self.group = group

    def update_indexer(self, keys: Tensor, layer_idx: int) -> Tensor:
        return gather_sequence(keys, self.group, dim=1)


def context_parallel_attention_forward(module: nn.Module, split: SequenceSplit, hidden_states: Tensor,
                                       position_embeddings: tuple[Tensor, Tensor], attention_mask: Tensor | None,
                                       cache: Any = None, position_ids: Tensor | None = None,
                                       prev_topk_indices: Tensor | None = None, **kwargs: Any):
    """``HYV4Attention.forward`` on this rank's chunks (``hidden_states [b, s/cp, D]`` at the
    global ``position_ids``) against the whole sequence's keys (the module docstring)."""
    from transformers.models.hy_v4.modeling_hy_v4 import apply_rotary_pos_emb, eager_attention_forward

    check_split_call("HY-V4", cache, kwargs, attention_mask)
    batch, local_len = hidden_states.shape[:-1]
    seq_len = local_len * split.size
    query_shape = (batch, local_len, -1, module.qk_head_dim)

    gate_states = module.gate_proj(hidden_states).view(batch, local_len, -1, module.gate_projection_size)
    q_resid = module.q_a_layernorm(module.q_a_proj(hidden_states))
    q_states = module.q_b_proj(q_resid).view(query_shape).transpose(1, 2)
    q_pass, q_rot = torch.split(q_states, [module.qk_nope_head_dim, module.qk_rope_head_dim], dim=-1)

    compressed_kv = module.kv_a_proj_with_mqa(hidden_states)
    kv_pass, k_rot = torch.split(compressed_kv, [module.kv_lora_rank, module.qk_rope_head_dim], dim=-1)
    k_pass = module.kv_a_layernorm(kv_pass).view(batch, 1, local_len, module.kv_lora_rank)
    k_rot = k_rot.view(batch, 1, local_len, module.qk_rope_head_dim)
    cos, sin = position_embeddings
    q_rot, k_rot = apply_rotary_pos_emb(q_rot, k_rot, cos, sin)
    query_states = torch.cat((q_pass, q_rot), dim=-1)

    # the whole sequence's latent, in global order: one gather of both parts
    latent = gather_sequence(torch.cat((k_pass, k_rot), dim=-1), split.group, dim=2)
    k_pass, k_rot = torch.split(latent, [module.kv_lora_rank, module.qk_rope_head_dim], dim=-1)
    key_states, value_states = module.expand_kv(k_pass, k_rot)

    mask = key_mask(position_ids.expand(batch, -1), seq_len, attention_mask, hidden_states.dtype)
    if module.indexer is not None:
        topk_indices = module.indexer(hidden_states, q_resid, position_embeddings, mask[:, 0], position_ids,
                                      cache=_GatheredIndexerKeys(split.group))  # [b, s/cp, topk], global keys
    else:
        if prev_topk_indices is None:
            raise ValueError("Shared DSA layers require top-k indices from a previous full indexer layer.")
        topk_indices = prev_topk_indices
    # transformers' eager path from here: the keys not picked masked, the attention with the sinks
    index_mask = (topk_indices.new_ones((batch, local_len, seq_len), dtype=torch.bool)
                  .scatter(-1, topk_indices.long(), False).unsqueeze(1))
    mask = mask.masked_fill(index_mask, torch.finfo(hidden_states.dtype).min)
    attn_output, attn_weights = eager_attention_forward(
        module, query_states, key_states, value_states, mask,
        dropout=0.0 if not module.training else module.attention_dropout, scaling=module.scaling,
        s_aux=module.sinks, **kwargs)
    attn_output = attn_output * torch.sigmoid(gate_states)
    attn_output = attn_output.reshape(batch, local_len, -1).contiguous()
    return module.o_proj(attn_output), attn_weights, topk_indices


__all__ = ["context_parallel_attention_forward", "is_hy_v4_attention", "split_attention_over_context"]
