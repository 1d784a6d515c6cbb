"""The GPT's mixture-of-experts MLP: :class:`lightning_mhc.model.moe.MoELayer` in the place of a
layer's dense MLP, on the layout's expert-parallel group.

Which layers: megatron's ``moe_layer_freq`` (an int ``f``: layers ``0, f, 2f, ...`` (0-based) are
MoE layers; a list: one 0/1 per layer). Under hyper-connections the MoE MLP is a branch like the
dense one: it sees the aggregated stream and its output is spread back by ``H_post``.

The experts are not split by TP: every TP rank of a stage runs the same tokens through the same
experts (as its norms), and the EP group (megatron's) holds the ranks with the same TP rank and
stage, carved out of the data-parallel ranks. Parameters are drawn layout-invariantly (the whole
stacked expert tensor from its name's generator, this rank's experts kept).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_mhc.layers.init import ParamInit, scaled_std
from lightning_mhc.model.moe import MoEConfig, MoELayer
from lightning_mhc.model.sizes import is_moe_layer

LOAD_BALANCING_TYPES = ("aux_loss", "none")
"""megatron's ``moe_router_load_balancing_type`` values this layer runs ('none': no auxiliary
load-balancing loss whatever ``moe_aux_loss_coeff`` says, as megatron's)."""


def moe_config(config: Any) -> MoEConfig:
    """The layer's settings read off the model config (megatron's names)."""
    overrides: dict[str, Any] = {"hidden_size": config.hidden_size, "params_dtype": config.params_dtype}
    if config.moe_router_load_balancing_type == "none":
        overrides["moe_aux_loss_coeff"] = 0.0
    return MoEConfig.from_transformer_config(config, **overrides)


class MoEMLP(torch.nn.Module):
    """``MoELayer`` with the dense MLP's interface (``forward -> (output, bias=None)``) and the
    layout's groups: ``ep_group`` splits the experts, the token group (DP x CP) sums the router's
    statistics."""

    def __init__(self, config: Any, init: ParamInit, ep_group=None, token_group=None) -> None:
        super().__init__()
        layer_config = moe_config(config)
        self.moe = MoELayer(layer_config, ep_group=ep_group, token_group=token_group)
        self._initialise(layer_config, init.child("moe"), config.num_layers)

    def _initialise(self, cfg: MoEConfig, init: ParamInit, num_layers: int) -> None:
        std, out_std = cfg.init_method_std, scaled_std(cfg.init_method_std, num_layers)
        moe = self.moe
        init.normal("router.weight", std)(moe.router.weight)
        experts = moe.experts
        for name, param in (("gate_weight", experts.gate_weight), ("up_weight", experts.up_weight),
                            ("down_weight", experts.down_weight)):
            if param is not None:
                full = (cfg.num_moe_experts, *param.shape[1:])
                init.child("experts").normal_slice(name, out_std if name == "down_weight" else std, full,
                                                   moe.local_expert_start)(param)
        shared = moe.shared_experts
        if shared is not None:
            for name in ("gate_proj", "up_proj", "down_proj"):
                linear = getattr(shared, name)
                if linear is not None:
                    init.child("shared_experts").normal(f"{name}.weight", out_std if name == "down_proj" else std)(
                        linear.weight)

    def forward(self, hidden_states: Tensor) -> tuple[Tensor, None]:
        return self.moe(hidden_states), None


def moe_step_statistics(layers: Sequence[tuple[str, MoELayer]], token_group, gather_group) -> dict[str, float]:
    """The logged figures of a training step, from this rank's MoE ``layers`` (name, layer), each
    layer's counts reset (:meth:`MoELayer.take_step_statistics`): per layer the whole batch's
    tokens per expert (``moe/<layer>/tokens_per_expert/<e>``: summed over the microbatches and
    the ``token_group``), their balance (``moe/<layer>/balance``: the busiest expert's count over
    the mean, 1 when even) and each auxiliary loss (``moe/<layer>/<loss>``: one process's value on
    the whole batch, the mean over the microbatches), and each loss summed over the layers
    (``moe/<loss>``). ``gather_group``: the ranks holding the other layers (the model-parallel
    group: every rank returns the whole model's figures). Collective over both groups."""
    figures: dict[str, float] = {}
    for name, layer in layers:
        counts, losses, forwards = layer.take_step_statistics()
        if counts is None:
            continue
        names = sorted(losses)
        stats = torch.cat([counts.double(), torch.stack([losses[k].double() for k in names]) if names
                           else counts.new_zeros(0, dtype=torch.float64)])
        if token_group is not None and dist.get_world_size(token_group) > 1:
            dist.all_reduce(stats, group=token_group)
        stats = stats.cpu().tolist()
        experts = len(stats) - len(names)
        for e in range(experts):
            figures[f"moe/{name}/tokens_per_expert/{e}"] = stats[e]
        mean = sum(stats[:experts]) / experts
        figures[f"moe/{name}/balance"] = max(stats[:experts]) / mean if mean else 1.0
        for k, value in zip(names, stats[experts:]):
            figures[f"moe/{name}/{k}"] = value / forwards
    if gather_group is not None and dist.get_world_size(gather_group) > 1:
        gathered: list[Any] = [None] * dist.get_world_size(gather_group)
        dist.all_gather_object(gathered, figures, group=gather_group)
        for other in gathered:  # TP peers hold the same layers, with the same figures
            figures.update(other)
    for key in sorted(figures):
        parts = key.split("/")
        if len(parts) == 3 and parts[2] not in ("balance",):
            figures[f"moe/{parts[2]}"] = figures.get(f"moe/{parts[2]}", 0.0) + figures[key]
    return figures
