"""Auxiliary-loss-free load balancing for a Hugging Face MoE family whose top-k routers carry a
score-correction bias (DeepSeek-V4's ``e_score_correction_bias``: added to the scores that choose
the experts, not to the weights that mix them), as DeepSeek trained it and megatron does with
``moe_router_bias_update_rate``: once per optimizer step, each expert's bias moves by ``rate``
towards the mean load, up when it got fewer tokens than the mean, down when more.

transformers trains without it (the bias stays as loaded), so it is off unless
``parallelize(router_bias_update_rate=...)`` asks. The counts are the experts each router chose in
the step's training forwards (a forward re-run inside backward, under recompute, not counted),
summed over the ranks that see different tokens through the same routers: data parallel (the EP
ranks among them), context parallel, and TP under sequence parallelism. The ranks so add up to one
process on the whole batch, and every replica of a router moves its bias alike.

:class:`RouterBias` is an ``ExpertLayer``: the training runtime updates it with the GPT's MoE
layers, between the last backward and the optimizer step (``update_expert_biases``).
"""
from __future__ import annotations

import fnmatch
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_mhc.any_model.router_loss import count_chosen, in_backward
from lightning_mhc.distributed.expert_parallel import ExpertLayer
from lightning_mhc.errors import ConfigError, term
from lightning_mhc.wrapping import wrap

BIAS = "e_score_correction_bias"


def biased_routers(chunks: list[nn.Module], pattern: str) -> list[tuple[str, nn.Module]]:
    """The modules of ``chunks`` named by ``pattern`` (fnmatch) that carry a score-correction bias
    (a family's hash routers, named alike, carry none)."""
    return [(name, module) for chunk in chunks for name, module in chunk.named_modules()
            if fnmatch.fnmatchcase(name, pattern) and isinstance(getattr(module, BIAS, None), Tensor)]


def check_router_bias(rate: Any, family: Any, model: nn.Module) -> None:
    """``router_bias_update_rate`` refused in one line where it cannot apply: not a number >= 0, or
    > 0 on a model whose family has no routers with a score-correction bias."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate >= 0:
        raise ConfigError(term("router_bias_update_rate", rate), ": a number >= 0 (0: the bias stays as loaded).")
    if rate and (family is None or family.router_bias is None
                 or not biased_routers([model], family.router_bias)):
        model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise ConfigError(term("router_bias_update_rate", rate), f": {model_type} has no routers with a "
                          f"score-correction bias ({BIAS}, as DeepSeek-V4's) to move. Leave it at 0.")


class RouterBias(ExpertLayer):
    """The score-correction biases of this rank's routers, moved once per optimizer step by the
    step's token counts (see the module's doc)."""

    def __init__(self, routers: list[tuple[str, nn.Module]], rate: float, layout: Any) -> None:
        super().__init__()
        self.rate = float(rate)
        self.layout = layout
        self._routers = routers  # a plain list: the modules are the model's, not this one's
        self._names = {id(module): name for name, module in routers}
        self._counts: dict[str, Tensor] = {}
        for _, module in routers:
            wrap(module, "router_bias", self._routed)

    def _routed(self, module: nn.Module, args: tuple, output: Any) -> None:
        """A router's forward: ``(logits, weights, indices)``; its chosen experts counted."""
        if in_backward() or not torch.is_grad_enabled():
            return
        count_chosen(self._counts, self._names[id(module)], output[2], getattr(module, BIAS).numel())

    def _token_groups(self) -> list[Any]:
        """The groups whose ranks route different tokens through the same routers."""
        layout = self.layout
        if layout is None or layout.groups is None:
            return []
        groups = [layout.dp_cp_group]
        if layout.sequence_parallel and layout.tensor_model_parallel_size > 1:
            groups.append(layout.tp_group)
        return [g for g in groups if dist.get_world_size(g) > 1]

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """Each router's bias += ``rate`` x sign(mean count - count), the counts of the step summed
        over the token groups; the counts then start again."""
        if not self._routers:
            return
        counts = torch.stack([self._counts.get(name, torch.zeros_like(getattr(module, BIAS), dtype=torch.long))
                              for name, module in self._routers]).double()
        for group in self._token_groups():
            dist.all_reduce(counts, group=group)
        offset = counts.mean(dim=1, keepdim=True) - counts
        for (_, module), row in zip(self._routers, offset):
            bias = getattr(module, BIAS)
            bias.add_((torch.sign(row) * self.rate).to(bias.dtype))
        self._counts = {}
