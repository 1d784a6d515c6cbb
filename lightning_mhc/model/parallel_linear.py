"""megatron-core's tensor-parallel linears, sequence-parallel on any device.

With ``config.sequence_parallel`` megatron's own layers all-gather and
reduce-scatter through buffers on the current CUDA device. These subclasses keep
megatron's parameters, initialisation and attributes and do the sequence
communication with ``layers.sequence_parallel`` (gloo and NCCL); without sequence
parallelism they are megatron's layers unchanged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from torch import Tensor

from lightning_mhc.model.config import MHCTransformerConfig
from lightning_mhc.layers.init import ParamInit, scaled_std
from lightning_mhc.layers.sequence_parallel import (
    all_gather_sequence,
    reduce_scatter_sequence,
    reduce_scatter_to_sequence_parallel_region,
)


class _GatheredLinear(torch.autograd.Function):
    """``all_gather(x) @ W^T`` that saves the local ``x [s/TP, b, C]``, not the gathered input,
    and gathers it again in backward for the weight gradient; the input gradient is
    reduce-scattered (megatron's ``LinearWithGradAccumulationAndAsyncCommunication`` under
    sequence parallelism). A recompute that frees and refills ``x`` keeps working. Under
    autocast both directions compute in the autocast dtype, as ``F.linear`` would."""

    @staticmethod
    def forward(ctx, x, weight):
        device = x.device.type
        ctx.dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        ctx.save_for_backward(x, weight)
        with torch.autocast(device, enabled=False):
            return F.linear(all_gather_sequence(x.to(ctx.dtype)), weight.to(ctx.dtype))

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        with torch.autocast(x.device.type, enabled=False):
            grad = grad.to(ctx.dtype)
            total = all_gather_sequence(x.to(ctx.dtype))
            grad_input = reduce_scatter_sequence(grad.matmul(weight.to(ctx.dtype)))
            grad_weight = grad.reshape(-1, grad.shape[-1]).t().matmul(total.reshape(-1, total.shape[-1]))
        return grad_input.to(x.dtype), grad_weight.to(weight.dtype)


class SPColumnParallelLinear(ColumnParallelLinear):
    """``ColumnParallelLinear`` that, under sequence parallelism, takes the local input
    ``[s/TP, b, C]``, gathers the sequence and keeps only the local part for backward."""

    def __init__(self, *args, config: MHCTransformerConfig, **kwargs) -> None:
        super().__init__(*args, config=config, disable_grad_reduce=bool(config.sequence_parallel), **kwargs)
        self.gather_sequence = self.sequence_parallel
        self.sequence_parallel = False  # megatron's gather would allocate on CUDA; ours replaces it

    def forward(self, input_: Tensor, weight: Tensor | None = None, **kwargs):
        if not self.gather_sequence:
            return super().forward(input_, weight=weight, **kwargs)
        output = _GatheredLinear.apply(input_, self.weight if weight is None else weight)
        if self.skip_bias_add:
            return output, self.bias
        return (output if self.bias is None else output + self.bias), None


class SPRowParallelLinear(RowParallelLinear):
    """``RowParallelLinear`` whose partial outputs are reduce-scattered along the sequence
    under sequence parallelism (megatron marks its bias ``sequence_parallel``)."""

    def forward(self, input_: Tensor):
        if not self.sequence_parallel:
            return super().forward(input_)
        output = reduce_scatter_to_sequence_parallel_region(F.linear(input_, self.weight))
        if self.skip_bias_add:
            return output, self.bias
        return (output if self.bias is None else output + self.bias), None


def output_projection(config: MHCTransformerConfig, input_size: int, init: ParamInit, name: str) -> RowParallelLinear:
    """``input_size -> hidden_size``, input split across TP, bias returned separately for the
    bias-dropout-add, weights drawn with megatron's scaled output init."""
    return SPRowParallelLinear(
        input_size,
        config.hidden_size,
        config=config,
        init_method=init.normal(f"{name}.weight", scaled_std(config.init_method_std, config.num_layers)),
        bias=config.add_bias_linear,
        input_is_parallel=True,
        skip_bias_add=True,
    )
