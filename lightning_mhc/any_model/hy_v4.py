"""HY-V4 (``model_type`` ``hy_v4``, transformers' ``HYV4ForCausalLM``) in ``parallelize``: what its
family record (``families.py``) calls beyond the generic steps.

HY-V4's decoder layer is DeepSeek-V4's (its ``attn_hc`` and ``ffn_hc`` hyper-connections, ``hc_mult``
streams, collapsed by ``model.hc_head`` before the final norm; its connections have no stream
mixing, only ``pre`` and ``post``) around GLM-MoE-DSA's attention (multi-head latent attention with
a per-head output gate and per-head ``sinks``, and DeepSeek-V3.2's indexer picking each query's
top-k keys) and GLM-4-MoE-Lite's MoE (a score-correction bias on the router, a shared expert). Its
streams cross pipeline stages as V4's (``native_streams.carry_streams_flat``); the rest is here.

- :data:`HY_V4` and :func:`split_attention`: tensor parallelism as transformers' own
  ``base_model_tp_plan`` for ``hy_v4`` splits it, by heads: each TP rank its heads of the low-rank
  query (``q_b_proj`` by its outputs; ``q_a_proj`` and its norm, the low rank, whole), its heads'
  keys and values expanded from the latent (``kv_b_proj`` by its outputs), its heads' output gate
  (``gate_proj``) and ``sinks``, and ``o_proj`` by its inputs (reduced over TP). The latent
  (``kv_a_proj_with_mqa`` and its norm) is whole on every rank: the rotary half of its key is
  shared by every head, so its gradient is summed over the ranks' heads (transformers'
  ``mla_kv_a_proj``; here :func:`_shared_rotary_key`). The indexer stays whole: it reads the whole
  hidden state and the whole low-rank query and runs without gradient, so every rank picks the same
  keys. The dense MLP and the shared expert split as MLPs; the routers and routed experts whole.
- Expert parallelism: the routed experts are the record's fused experts (``experts.py``, with the
  clamp of the gate and up projections its ``_apply_gate`` does); the routers, with their
  score-correction bias, stay whole on every rank that routes.
- :func:`check_stages`: a layer whose indexer is ``"shared"`` reuses the top-k picks of the full
  indexer layer before it, which a pipeline stage does not receive: no stage may begin with one.
- :func:`recomputed_layer`: a decoder layer under ``recompute="mhc_block"`` (its ``attn_hc`` and
  ``ffn_hc`` with their branches' norms, and its two residual adds, checkpointed into the layer's
  recompute group: ``native_streams.HyperConnectionCheckpoints``), the same operations as
  transformers' forward.
- Sequence parallelism: between the TP regions each rank holds its part of the sequence (the
  hyper-connections, the norms and the MoE run on it); the attention gathers the whole sequence
  once, so the low-rank query, the latent and the indexer, whole on every rank, read it all. The
  rotary key's gradient then stays the rank's heads' part (:func:`split_attention`), summed over
  TP by the gather's reduce-scatter and the runtime's sum of the replicated parameters' gradients.
- Context parallelism: the attention and its indexer split over the sequence by the record's own
  pass (``hy_v4_context.py``).
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor, nn

from lightning_mhc.any_model.native_streams import HyperConnectionCheckpoints
from lightning_mhc.any_model.plan import TPPlan
from lightning_mhc.errors import ConfigError

_ATTENTION = "model.layers.*.self_attn"
HY_V4 = TPPlan(
    layers={
        "model.embed_tokens": "vocab",
        f"{_ATTENTION}.q_b_proj": "column",  # the rank's heads of the low-rank query
        f"{_ATTENTION}.kv_b_proj": "column",  # the rank's heads' keys and values from the latent
        f"{_ATTENTION}.gate_proj": "column",  # the rank's heads' output gate
        f"{_ATTENTION}.o_proj": "row",  # the rank's heads' outputs, reduced over TP
        "model.layers.*.mlp.gate_proj": "column",  # the dense layers' MLP
        "model.layers.*.mlp.up_proj": "column",
        "model.layers.*.mlp.down_proj": "row",
        "model.layers.*.mlp.shared_experts.gate_proj": "column",
        "model.layers.*.mlp.shared_experts.up_proj": "column",
        "model.layers.*.mlp.shared_experts.down_proj": "row",
        "lm_head": "column",
    },
    divide={_ATTENTION: ("num_heads",)},
    output="lm_head",
    selective=("model.layers.*.mlp",),
)
"""Hugging Face ``HYV4ForCausalLM`` over TP (the module docstring; :func:`split_attention` does
what a style cannot)."""

def _name(model: nn.Module) -> str:
    return f"{type(model).__name__} (model_type 'hy_v4')"


def check_stages(model: nn.Module, ranges: list[tuple[int, int]]) -> None:
    """Refuse a stage split where a stage after the first begins with a layer whose indexer is
    ``"shared"``: it reuses the top-k picks of the full-indexer layer before it, on another stage
    (the pipeline carries the streams only)."""
    kinds = list(getattr(model.config, "indexer_types", None) or [])
    for stage, (start, _end) in enumerate(ranges):
        if stage > 0 and start < len(kinds) and kinds[start] == "shared":
            full = [i for i, kind in enumerate(kinds) if kind == "full"]
            raise ConfigError(
                f"{_name(model)}: pipeline stage {stage} would begin with layer {start}, whose indexer is 'shared' "
                "(it reuses the previous layer's top-k picks, which do not cross stages); begin each stage with a "
                f"full-indexer layer ({full}) through pipeline_split.")


# ------------------------------------------------------------------ block recompute of its hyper-connections
def recomputed_layer(layer: nn.Module, checkpoints: HyperConnectionCheckpoints, hidden_states: Tensor,
                     attention_mask: Tensor | None = None, position_ids: Tensor | None = None, cache: Any = None,
                     use_cache: bool | None = False, position_embeddings: tuple[Tensor, Tensor] | None = None,
                     prev_topk_indices: Tensor | None = None, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
    """``HYV4DecoderLayer.forward`` (transformers 5.24) operation for operation, with each
    hyper-connection and its branch's norm one checkpoint and each residual add
    (``post ⊗ F + x``, no stream mixing) another (``checkpoints``): the layer's forward bit for
    bit, its gradients up to the order in which a stream's gradient contributions are summed, its
    streams' activations recomputed in backward instead of kept. Returns the streams and the
    attention's top-k picks, as the layer does."""
    dtype = hidden_states.dtype
    post, normed = checkpoints.entry("attn_hc", layer.attn_hc, layer.input_layernorm, hidden_states)
    attn_output, _, topk_indices = layer.self_attn(
        hidden_states=normed, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
        use_cache=use_cache, position_embeddings=position_embeddings, prev_topk_indices=prev_topk_indices, **kwargs)
    hidden_states = checkpoints.mix("attn_hc", _add, hidden_states, post, attn_output, dtype)
    post, normed = checkpoints.entry("ffn_hc", layer.ffn_hc, layer.post_attention_layernorm, hidden_states)
    mlp_output = layer.mlp(normed)
    return checkpoints.mix("ffn_hc", _add, hidden_states, post, mlp_output, dtype, last_of_layer=True), topk_indices


def _add(streams: Tensor, post: Tensor, output: Tensor, dtype: torch.dtype) -> Tensor:
    """HY-V4's ``post ⊗ F + x`` in fp32, as its decoder layer writes it (``dtype``: the layer input's)."""
    return (post.float().unsqueeze(-1) * output.float().unsqueeze(-2) + streams.float()).to(dtype)


# ------------------------------------------------------------------ tensor parallelism beyond the plan
def split_attention(chunk: nn.Module, layout: Any) -> None:
    """What the plan's styles cannot express, on each built attention of ``chunk`` under TP: its
    ``sinks`` cut to the rank's heads, and, without sequence parallelism, the rotary key shared
    by every head taken through :func:`_shared_rotary_key` (whole on every rank, its gradient
    summed over TP). Under sequence parallelism its gradient stays the rank's heads' part: the
    attention's gathered input reduce-scatters it, and the latent's parameters (replicated, on the
    sequence-parallel region) are summed over TP by the runtime; summed here too, it would count
    TP times."""
    if layout.tensor_model_parallel_size == 1:
        return
    from lightning_mhc.any_model.tensor_parallel import split_parameter

    for module in chunk.modules():
        if not (hasattr(module, "sinks") and hasattr(module, "expand_kv")):
            continue
        split_parameter(module, "sinks", 0, layout)
        if not layout.sequence_parallel:
            module.expand_kv = _shared_rotary_key(module.expand_kv, layout.tp_group)


def _shared_rotary_key(expand_kv, group):
    """The attention's ``expand_kv(kv_latent, k_rot)`` (the latent through the rank's heads of
    ``kv_b_proj``, the one rotary key broadcast to them) with ``k_rot`` taken through megatron's
    copy to the TP region: the identity forward, its gradient summed over the ranks' heads, so that
    ``kv_a_proj_with_mqa`` and the hidden state get the gradient of all heads, as in one process.
    (The latent's gradient is summed by ``kv_b_proj``'s column split already.)"""
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    @functools.wraps(expand_kv)
    def run(kv_latent: Tensor, k_rot: Tensor):
        return expand_kv(kv_latent, copy_to_tensor_model_parallel_region(k_rot, group=group))

    return run
