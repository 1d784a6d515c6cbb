"""Model FLOPs per token and the devices' peak FLOP/s: what model FLOPs utilisation (MFU) needs.

MFU = (training FLOPs per token x tokens/s) / (peak FLOP/s per device x devices), counting the
model's arithmetic once (forward + backward = 3 x forward; recomputation is not counted: it is
hardware work, not model work, as in Megatron-LM's and PaLM's MFU). A matrix product of
``[m, k] x [k, n]`` is ``2 m k n`` FLOPs. Per token and layer, forward:

- attention: QKV ``2 C (h + 2 g) d``, scores and weighted values ``2 x 2 s h d / 2`` (causal:
  half the ``s x s`` square, as Megatron-LM's formula and torch's FLOP counter count it), output
  projection ``2 h d C``;
- MLP: ``2 C F`` up (twice with a gated unit) and ``2 F C`` down;
- hyper-connections, for each of the two sub-layers: the mapping projection of the flattened
  stream ``2 nC (n^2 + 2n)``, Sinkhorn's ``iterations x 4 n^2``, the aggregation ``H_pre x``
  ``2 nC``, the mix ``H_res x`` ``2 n^2 C`` and the merge ``H_post^T F`` ``2 nC``;

and the logits ``2 C V`` (V padded). Norms, softmax and element-wise work are left out.
"""
from __future__ import annotations

from typing import Any

import torch

from lightning_mhc.model.sizes import is_moe_layer

PEAK_BF16_TFLOPS = (  # dense bf16 (fp16 for V100) tensor-core peaks from NVIDIA's data sheets; first match wins
    ("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("H800", 989.0), ("A100", 312.0), ("A800", 312.0),
    ("L40S", 362.0), ("L4", 121.0), ("V100", 125.0),
)


def device_peak_flops(device: torch.device | None = None) -> float | None:
    """The peak FLOP/s of this CUDA device when it is one we know; None on CPU or an unknown GPU."""
    if not torch.cuda.is_available() or (device is not None and torch.device(device).type != "cuda"):
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops * 1e12 for key, tflops in PEAK_BF16_TFLOPS if key in name), None)


def forward_flops_terms(config: Any, seq_length: int) -> dict[str, float]:
    """Forward model FLOPs per token of an ``MHCTransformerConfig``, term by term (see the module
    docstring); their sum is ``forward_flops_per_token``."""
    c, heads, d, layers = config.hidden_size, config.num_attention_heads, config.kv_channels, config.num_layers
    groups = config.num_query_groups or heads
    n = config.num_residual_streams if config.enable_hyper_connections else 0

    def mlp(width: int) -> int:
        return 2 * c * width * (2 if config.gated_linear_unit else 1) + 2 * width * c

    # an MoE layer: the router, each token's top-k experts and the shared experts (megatron's count)
    experts = getattr(config, "num_moe_experts", None) or 0
    moe_layers = sum(is_moe_layer(config, number) for number in range(1, layers + 1)) if experts else 0
    moe = (2 * c * experts + config.moe_router_topk * mlp(config.moe_ffn_hidden_size or config.ffn_hidden_size)
           + mlp(config.moe_shared_expert_intermediate_size or 0)) if experts else 0
    return dict(
        attention_projections=layers * (2 * c * (heads + 2 * groups) * d + 2 * heads * d * c),
        attention_scores=layers * 2 * seq_length * heads * d,  # causal: half of 2 x 2 s h d
        mlp=(layers - moe_layers) * mlp(config.ffn_hidden_size) + moe_layers * moe,
        **hyper_connection_flops_terms(n, c, 2 * layers, config.mhc_sinkhorn_iterations),
        logits=2 * c * config.padded_vocab_size,
    )


def hyper_connection_flops_terms(n: int, c: int, sublayers: int, iterations: int) -> dict[str, float]:
    """Forward FLOPs per token of ``sublayers`` hyper-connected sub-layers of ``n`` streams of width
    ``c`` (0 when ``n`` is 0: none)."""
    return dict(mhc_mappings=sublayers * 2 * n * c * (n * n + 2 * n),
                sinkhorn=sublayers * iterations * 4 * n * n,
                mhc_residual_mix=sublayers * 2 * n * n * c,
                mhc_pre_post=sublayers * (2 * n * c + 2 * n * c))


def module_forward_flops_terms(model: torch.nn.Module, seq_length: int, num_layers: int, attention_width: int,
                               num_residual_streams: int = 0, sinkhorn_iterations: int = 20,
                               hidden_size: int | None = None) -> dict[str, float]:
    """Forward model FLOPs per token of any transformer given as modules (a Hugging Face model,
    whole, on any device, the meta device included): ``2 x in x out`` for every linear layer
    (``nn.Linear``, and GPT-2's ``Conv1D`` by its ``nf`` / ``nx``), the logits included; causal
    attention scores ``2 s x attention_width`` per layer (heads x head dimension); and the
    hyper-connections' terms of two sub-layers a layer when ``num_residual_streams`` > 1."""
    linear = 0.0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            linear += 2 * module.in_features * module.out_features
        elif type(module).__name__ == "Conv1D" and hasattr(module, "nf"):  # transformers' GPT-2 layers
            linear += 2 * module.weight.shape[0] * module.nf
    n = num_residual_streams if num_residual_streams > 1 else 0
    return dict(linear=linear, attention_scores=num_layers * 2 * seq_length * attention_width,
                **hyper_connection_flops_terms(n, hidden_size or 0, 2 * num_layers, sinkhorn_iterations))


def forward_flops_per_token(config: Any, seq_length: int) -> float:
    return float(sum(forward_flops_terms(config, seq_length).values()))


def training_flops_per_token(config: Any, seq_length: int) -> float:
    """Forward and backward: 3 x forward."""
    return 3 * forward_flops_per_token(config, seq_length)
