"""DeepSeek-V4 (``model_type`` ``deepseek_v4``, transformers' ``DeepseekV4ForCausalLM``) in
``parallelize``: what its family record (``families.py``) calls beyond the generic steps.

V4 carries hyper-connections of its own (``hc_mult`` streams, ``[B, S, n, D]`` between its decoder
layers, collapsed by ``model.hc_head`` before the final norm): ``parallelize`` adds none
(``FamilyRecord.native_streams``) and runs its own as they are.

- :func:`~lightning_mhc.any_model.native_streams.carry_streams_flat` (shared with HY-V4): every
  decoder layer takes and returns its streams flat, ``[B, S, n*D]``, so the pipeline sends and
  receives them like any activation, and ``hc_head`` (on the last stage) takes them flat too.
- :data:`DEEPSEEK_V4` and :func:`split_attention`: tensor parallelism beyond transformers' own plan
  (which keeps the attention whole): each TP rank its heads of the low-rank query (``q_b_proj`` by
  its outputs; ``q_a_proj`` and its norm, the low rank, whole), its heads' ``sinks``, its groups of
  the grouped output projection (``o_a_proj``'s per-group blocks, local to the rank's heads, then
  ``o_b_proj`` by its inputs, reduced over TP), and the single shared K/V head whole on every rank,
  its gradient summed over the ranks' heads (:func:`shared_kv_attention`); the compressor and the
  indexer whole (they read the whole hidden state and the whole low-rank query, and feed the shared
  K/V and the top-k picks); the shared expert split as an MLP; the routed experts and routers whole.
- Expert parallelism: the routed experts are the record's fused experts (``experts.py``, with V4's
  clamp of the gate and up projections); the routers stay whole on every rank that routes, the
  hash router's ``tid2eid`` table and the score-correction bias with them (buffers of the blocks).
  Its own auxiliary loss where the config asks for it (:data:`ROUTER_LOSS`, ``router_loss.py``), and
  the bias moved by auxiliary-free balancing where ``parallelize`` is asked to (``router_bias.py``).
- :func:`recomputed_layer`: a decoder layer under ``recompute="mhc_block"`` (its ``attn_hc`` and
  ``ffn_hc`` with their branches' norms, and its two mixes, checkpointed into the layer's recompute
  group: ``native_streams.HyperConnectionCheckpoints``), the same operations as transformers' forward
  (after ``lightning_mhc.ops.deepseek_v4.use_our_ops``, as the swapped layer's: its mixes on our kernels).
- Sequence parallelism (:func:`split_for_tensor_parallel`): between the TP regions each rank holds
  its part of the sequence (the hyper-connections, the norms and the routed MoE run on it); the
  attention gathers the whole sequence once, so the low-rank query, the shared K/V head and the
  compressor and indexer, whole on every rank, read it all. Their gradients stay this rank's heads'
  part, summed over TP by the gather's reduce-scatter and the runtime's sum of the replicated
  parameters' gradients (summing them first, as without SP, would count them TP times); the hash
  router reads the token ids of the rank's part.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

from lightning_mhc.any_model.native_streams import HyperConnectionCheckpoints
from lightning_mhc.any_model.native_streams import carry_streams_flat  # noqa: F401  (moved there: shared with HY-V4)
from lightning_mhc.any_model.plan import TPPlan
from lightning_mhc.any_model.router_loss import RouterLossSpec
from lightning_mhc.distributed.process_state import register_for_the_run
from lightning_mhc.layers.moe import SWITCH_LOAD_BALANCING
from lightning_mhc.wrapping import wrap

_ATTENTION = "model.layers.*.self_attn"
DEEPSEEK_V4 = TPPlan(
    layers={
        "model.embed_tokens": "vocab",
        f"{_ATTENTION}.q_b_proj": "column",  # the rank's heads of the low-rank query
        f"{_ATTENTION}.o_b_proj": "row",  # the rank's groups' low-rank outputs, reduced over TP
        "model.layers.*.mlp.shared_experts.gate_proj": "column",
        "model.layers.*.mlp.shared_experts.up_proj": "column",
        "model.layers.*.mlp.shared_experts.down_proj": "row",
        "lm_head": "column",
    },
    # the forward reads the heads (repeat_kv's broadcast of the one K/V head) and the output groups
    # from the module and its config; o_a_proj is cut by split_attention (its input is the rank's own)
    divide={_ATTENTION: ("num_heads", "num_key_value_groups", "config.o_groups")},
    divisible={_ATTENTION: ("config.num_attention_heads", "config.o_groups")},
    output="lm_head",
    selective=("model.layers.*.mlp",),
)
"""Hugging Face ``DeepseekV4ForCausalLM`` over TP (the module docstring; :func:`split_attention`
does what a style cannot)."""

ROUTERS = "model.layers.*.mlp.gate"
"""Its routers: the top-k ones carry the score-correction bias (``router_bias.py``), the hash
routers of its first layers a fixed token table instead."""
ROUTER_LOSS = RouterLossSpec(ROUTERS, SWITCH_LOAD_BALANCING, router_types=("DeepseekV4TopKRouter",))
"""Its own auxiliary loss, where the config asks for it (``output_router_logits``): Switch's, over
its top-k routers only, as transformers records their logits (the hash routers' are not)."""

TRANSFORMERS = "5.24"
"""The transformers version ``DeepseekV4ForCausalLM`` is run with here (the record's
``transformers``; the ``hf`` extra allows older ones, without the model)."""


# ------------------------------------------------------------------ block recompute of its hyper-connections
def recomputed_layer(layer: nn.Module, checkpoints: HyperConnectionCheckpoints, hidden_states: Tensor,
                     input_ids: Tensor | None = None, **kwargs: Any) -> Tensor:
    """``DeepseekV4DecoderLayer.forward`` (transformers 5.24) operation for operation, with each
    hyper-connection and its branch's norm one checkpoint and each mix another
    (``checkpoints``): the layer's forward bit for bit, its gradients up to the order in which a
    stream's gradient contributions are summed (inside a checkpoint first), its streams'
    activations (the normalised streams, Sinkhorn's iterates, the streams between the sub-layers)
    recomputed in backward instead of kept."""
    dtype = hidden_states.dtype
    mix = _mix_of(layer)
    post, comb, normed = checkpoints.entry("attn_hc", layer.attn_hc, layer.input_layernorm, hidden_states)
    attn_output, _ = layer.self_attn(normed, **kwargs)
    hidden_states = checkpoints.mix("attn_hc", mix, hidden_states, post, comb, attn_output, dtype)
    post, comb, normed = checkpoints.entry("ffn_hc", layer.ffn_hc, layer.post_attention_layernorm, hidden_states)
    mlp_output = layer.mlp(normed, input_ids=input_ids)
    return checkpoints.mix("ffn_hc", mix, hidden_states, post, comb, mlp_output, dtype, last_of_layer=True)


def _mix_of(layer: nn.Module):
    """The layer's mix as its own forward computes it: transformers' (:func:`_mix`), or, on a
    layer ``use_our_ops`` swapped, its ``mix_streams`` (our kernels' one pass), so that the
    recomputed layer stays its forward bit for bit."""
    ours = getattr(layer, "mix_streams", None)
    if ours is None:
        return _mix
    return lambda streams, post, comb, output, dtype: ours(streams, post, comb, output)


def _mix(streams: Tensor, post: Tensor, comb: Tensor, output: Tensor, dtype: torch.dtype) -> Tensor:
    """V4's ``post ⊗ F + comb^T x``, as its decoder layer writes it (``dtype``: the layer input's)."""
    return post.to(dtype).unsqueeze(-1) * output.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2),
                                                                                streams)


# ------------------------------------------------------------------ tensor parallelism beyond the plan
SHARED_KV_ATTENTION = "lightning_mhc_deepseek_v4_shared_kv"
"""The name :func:`shared_kv_attention` is registered under in transformers' attention registry
(read from the attention's own copy of the config, so the model's masks are built as before)."""


def _register_shared_kv_attention(*_: Any) -> None:
    """:func:`shared_kv_attention` in transformers' registry, for the run holding the process (its
    teardown takes it out: ``register_for_the_run``); checked before each attention's forward, as
    the split model may go on in a later run."""
    from transformers import AttentionInterface

    if AttentionInterface._global_mapping.get(SHARED_KV_ATTENTION) is not shared_kv_attention:
        register_for_the_run(AttentionInterface._global_mapping, SHARED_KV_ATTENTION, shared_kv_attention)


def split_for_tensor_parallel(chunk: nn.Module, layout: Any) -> None:
    """The record's TP step on a built ``chunk``: :func:`split_attention`, and under sequence
    parallelism :func:`route_own_tokens`."""
    split_attention(chunk, layout)
    if layout.sequence_parallel and layout.tensor_model_parallel_size > 1:
        route_own_tokens(chunk, layout)


def split_attention(chunk: nn.Module, layout: Any) -> None:
    """What the plan's styles cannot express, on each built attention of ``chunk`` under TP: its
    ``sinks`` and its ``o_a_proj`` blocks cut to the rank's heads and groups (dim 0, as a column
    layer's weight, but without the column's all-reduce of the input gradient: the input is the
    rank's own heads' output), and, without sequence parallelism, its attention through
    :func:`shared_kv_attention`. Under sequence parallelism the shared K/V head's gradient stays
    the rank's heads' part: the attention's gathered input reduce-scatters it, and its parameters
    (replicated, on the sequence-parallel region) are summed over TP by the runtime."""
    tp = layout.tensor_model_parallel_size
    if tp == 1:
        return
    from lightning_mhc.any_model.tensor_parallel import split_parameter

    sequence_parallel = layout.sequence_parallel
    if not sequence_parallel:
        _register_shared_kv_attention()
    for module in chunk.modules():
        if not (hasattr(module, "sinks") and hasattr(module, "o_a_proj")):
            continue
        split_parameter(module, "sinks", 0, layout)
        grouped = module.o_a_proj
        split_parameter(grouped, "weight", 0, layout)
        grouped.out_features //= tp
        grouped.n_groups //= tp
        if sequence_parallel:
            continue
        module.config = copy.copy(module.config)  # (its own already: the plan divided its o_groups)
        module.config._attn_implementation = SHARED_KV_ATTENTION
        module.shared_kv_group = layout.tp_group
        wrap(module, "shared_kv_attention", _register_shared_kv_attention)


def shared_kv_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, *args: Any, **kwargs: Any):
    """transformers' V4 attention (``eager_attention_forward``: the sinks, the compressed entries'
    bias) on this rank's heads, with the one K/V head every head reads (``key is value``, the
    sliding window's and the compressed entries') whole on every rank: the identity forward, and its
    gradient summed over TP (megatron's copy to the TP region), so that ``kv_proj``, the compressor
    and the hidden state get the whole gradient of all heads, as in one process."""
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import eager_attention_forward

    shared = copy_to_tensor_model_parallel_region(key, group=module.shared_kv_group)
    return eager_attention_forward(module, query, shared, shared if value is key else value, *args, **kwargs)


def route_own_tokens(chunk: nn.Module, layout: Any) -> None:
    """Under sequence parallelism each MoE block of ``chunk`` whose router is a hash router (its
    ``tid2eid`` token table) takes the token ids of this rank's part of the sequence, as its
    hidden states are (the model hands every layer the ids of the whole sequence)."""
    tp, rank = layout.tensor_model_parallel_size, layout.tensor_model_parallel_rank

    def own_ids(_block: nn.Module, args: tuple, kwargs: dict):
        ids = kwargs.get("input_ids")
        if ids is not None:
            kwargs["input_ids"] = ids.chunk(tp, dim=1)[rank]  # the sequence's contiguous parts, in TP rank order
        return args, kwargs

    for module in chunk.modules():
        if hasattr(getattr(module, "gate", None), "tid2eid"):
            wrap(module, "hash_routed_own_tokens", own_ids, with_kwargs=True)
