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
    ffn = config.ffn_hidden_size
    n = config.num_residual_streams if config.enable_hyper_connections else 0
    sublayers = 2 * layers
    return dict(
        attention_projections=layers * (2 * c * (heads + 2 * groups) * d + 2 * heads * d * c),
        attention_scores=layers * 2 * seq_length * heads * d,  # causal: half of 2 x 2 s h d
        mlp=layers * (2 * c * ffn * (2 if config.gated_linear_unit else 1) + 2 * ffn * c),
        mhc_mappings=sublayers * 2 * n * c * (n * n + 2 * n),
        sinkhorn=sublayers * config.mhc_sinkhorn_iterations * 4 * n * n,
        mhc_residual_mix=sublayers * 2 * n * n * c,
        mhc_pre_post=sublayers * (2 * n * c + 2 * n * c),
        logits=2 * c * config.padded_vocab_size,
    )


def forward_flops_per_token(config: Any, seq_length: int) -> float:
    return float(sum(forward_flops_terms(config, seq_length).values()))


def training_flops_per_token(config: Any, seq_length: int) -> float:
    """Forward and backward: 3 x forward."""
    return 3 * forward_flops_per_token(config, seq_length)
