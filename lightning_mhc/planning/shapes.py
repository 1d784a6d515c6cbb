"""The GPT's parameter tensors of a range of layers, counted from its config by arithmetic.

No model is built (no memory, no process group, no megatron layer): each tensor's size and how the
layout divides it follow the modules the runtime builds (``lightning_mhc.model``), and
tests/test_planner.py checks the counts against models built on forked ranks. Each tensor says
whether TP splits it (megatron's ``tensor_model_parallel`` marker: the column-parallel QKV and fc1
weights and biases, the row-parallel proj and fc2 weights, the vocabulary rows) and whether it is
an expert's (split by EP, reduced over the expert-data ranks).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from lightning_mhc.model.sizes import is_moe_layer


@dataclass(frozen=True)
class ParameterTensor:
    name: str
    numel: int
    tensor_parallel: bool = False
    """TP splits it (its elements per rank: numel / TP)."""
    expert: bool = False
    """A routed expert's (its elements per rank: numel / EP)."""


def _linear(name: str, fan_in: int, fan_out: int, bias: bool, split_bias: bool) -> Iterator[ParameterTensor]:
    yield ParameterTensor(f"{name}.weight", fan_in * fan_out, tensor_parallel=True)
    if bias:  # a column-parallel layer's bias is split with its rows; a row-parallel one's is whole
        yield ParameterTensor(f"{name}.bias", fan_out, tensor_parallel=split_bias)


def _hyper_connection(name: str, config: Any) -> Iterator[ParameterTensor]:
    """phi ``[n C, n^2 + 2n]``, the gates ``alpha`` (3) and the bias (n^2 + 2n), all fp32, whole."""
    if not config.enable_hyper_connections:
        return
    n = config.num_residual_streams
    m = n * n + 2 * n
    yield ParameterTensor(f"{name}.phi", n * config.hidden_size * m)
    yield ParameterTensor(f"{name}.alpha", 3)
    yield ParameterTensor(f"{name}.bias", m)


def _mlp(prefix: str, config: Any, layer_number: int) -> Iterator[ParameterTensor]:
    c, gated = config.hidden_size, config.gated_linear_unit
    if not is_moe_layer(config, layer_number):
        yield from _linear(f"{prefix}.linear_fc1", c, config.ffn_hidden_size * (2 if gated else 1),
                           config.add_bias_linear, split_bias=True)
        yield from _linear(f"{prefix}.linear_fc2", config.ffn_hidden_size, c, config.add_bias_linear, split_bias=False)
        return
    experts, ffn = config.num_moe_experts, config.moe_ffn_hidden_size or config.ffn_hidden_size
    yield ParameterTensor(f"{prefix}.moe.router.weight", experts * c)  # fp32, whole on every rank
    for weight in ("gate", "up", "down") if gated else ("up", "down"):
        yield ParameterTensor(f"{prefix}.moe.experts.{weight}_weight", experts * c * ffn, expert=True)
    shared = config.moe_shared_expert_intermediate_size
    if shared:  # plain nn.Linear without bias, neither split by TP nor by EP
        for proj in ("gate_proj", "up_proj", "down_proj") if gated else ("up_proj", "down_proj"):
            yield ParameterTensor(f"{prefix}.moe.shared_experts.{proj}.weight", c * shared)


def layer_tensors(config: Any, layer_number: int) -> Iterator[ParameterTensor]:
    """Layer ``layer_number`` (1-based, as megatron numbers them)."""
    c, prefix = config.hidden_size, f"decoder.layers.{layer_number}"
    heads, groups = config.num_attention_heads, config.num_query_groups or config.num_attention_heads
    yield from _hyper_connection(f"{prefix}.self_attention_hyper_connection", config)
    yield ParameterTensor(f"{prefix}.input_layernorm.weight", c)
    yield from _linear(f"{prefix}.self_attention.linear_qkv", c, config.kv_channels * (heads + 2 * groups),
                       config.add_bias_linear, split_bias=True)
    yield from _linear(f"{prefix}.self_attention.linear_proj", config.kv_channels * heads, c,
                       config.add_bias_linear, split_bias=False)
    yield from _hyper_connection(f"{prefix}.mlp_hyper_connection", config)
    yield ParameterTensor(f"{prefix}.pre_mlp_layernorm.weight", c)
    yield from _mlp(f"{prefix}.mlp", config, layer_number)


def chunk_tensors(config: Any, layer_range: tuple[int, int], pre_process: bool,
                  post_process: bool) -> Iterator[ParameterTensor]:
    """The parameters of the model chunk holding global layers ``[start, end)``: the embedding on
    the first chunk, the final norm and the output layer on the last (a tied output layer is the
    embedding's weight where both are on one chunk, a copy on a last stage without it)."""
    c, vocab = config.hidden_size, config.padded_vocab_size
    if pre_process:
        yield ParameterTensor("embedding.word_embeddings.weight", vocab * c, tensor_parallel=True)
        if config.position_embedding_type == "learned_absolute":
            yield ParameterTensor("embedding.position_embeddings.weight", config.max_sequence_length * c)
    for number in range(layer_range[0] + 1, layer_range[1] + 1):
        yield from layer_tensors(config, number)
    if post_process:
        yield ParameterTensor("decoder.final_layernorm.weight", c)
        if not (config.share_embeddings_and_output_weights and pre_process):
            yield ParameterTensor("output_layer.weight", vocab * c, tensor_parallel=True)
