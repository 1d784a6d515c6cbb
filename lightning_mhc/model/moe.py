"""A mixture-of-experts feed-forward layer with expert parallelism that runs on CPU (gloo) and GPU.

Why not megatron-core's ``MoELayer``: its router moves its weight to CUDA, its all-to-all
dispatcher creates a CUDA stream when it is built and its grouped MLP needs the ``grouped_gemm``
package, so none of it runs on CPU. The pieces it needs do (gloo's uneven ``all_to_all_single``,
``torch._grouped_mm`` in fp32), so this layer is built from them, as torchtitan's is. The settings
keep megatron-core's names (``MoEConfig.from_transformer_config`` reads them off a
``TransformerConfig``).

- :class:`TopKRouter`: token-choice top-k in fp32; softmax (after the top-k by default, as
  megatron's, or before it with ``moe_router_pre_softmax``) or sigmoid, optionally with
  DeepSeek-V3's expert bias (moves the choice, not the weights; updated from token counts summed
  over the data-parallel ranks, no auxiliary loss needed).
- auxiliary losses: the Switch/megatron load-balancing loss ``coeff * E * sum_e f_e * P_e`` and
  the router z-loss ``coeff * mean(logsumexp(logits)^2)``. Their statistics are taken over the
  token group (the ranks whose batches make up one process's batch), so that the ranks' losses
  add up to one process's. They reach backward through :class:`MoEAuxLossAutoScaler`, attached to
  the layer's output.
- :class:`GroupedExperts`: the routed experts (SwiGLU by default), one grouped product per
  weight (``torch._grouped_mm`` where it takes the tensors, a per-expert loop otherwise).
- expert parallelism: experts split over the EP group, tokens sent and brought back by
  ``lightning_mhc.distributed.expert_parallel``.

No token is dropped by default. ``moe_expert_capacity_factor`` caps the tokens each expert takes
from this rank's batch (the lowest-probability ones dropped): the cap is per rank, so a run with
several ranks does not drop the same tokens as one process on the whole batch.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_mhc.distributed.expert_parallel import ExpertLayer, experts_on_their_ranks, group_rank, group_size
from lightning_mhc.distributed.placement import place
from lightning_mhc.layers.moe import combine_pairs, grouped_matmul, token_expert_pairs


@dataclasses.dataclass
class MoEConfig:
    """The MoE layer's settings, under megatron-core's ``TransformerConfig`` names."""

    hidden_size: int
    num_moe_experts: int
    moe_ffn_hidden_size: int
    moe_router_topk: int = 2
    moe_shared_expert_intermediate_size: int | None = None  # None: no shared experts
    moe_router_score_function: str = "softmax"  # 'softmax' | 'sigmoid'
    moe_router_pre_softmax: bool = False  # softmax over all experts before the top-k
    moe_router_enable_expert_bias: bool = False  # DeepSeek-V3's bias (sigmoid router)
    moe_router_bias_update_rate: float = 1e-3
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float | None = None
    moe_expert_capacity_factor: float | None = None  # None: no token dropped
    gated_linear_unit: bool = True  # SwiGLU experts with activation_func = silu
    activation_func: Callable[[Tensor], Tensor] = F.silu
    init_method_std: float = 0.02
    params_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.moe_router_score_function not in ("softmax", "sigmoid"):
            raise ValueError(f"moe_router_score_function must be 'softmax' or 'sigmoid', "
                             f"not {self.moe_router_score_function!r}")
        if not 1 <= self.moe_router_topk <= self.num_moe_experts:
            raise ValueError(f"moe_router_topk={self.moe_router_topk} must be in [1, num_moe_experts="
                             f"{self.num_moe_experts}]")
        if self.moe_router_enable_expert_bias and self.moe_router_score_function != "sigmoid":
            raise ValueError("moe_router_enable_expert_bias needs moe_router_score_function='sigmoid' "
                             "(DeepSeek-V3's auxiliary-loss-free balancing)")
        if self.moe_expert_capacity_factor is not None and self.moe_expert_capacity_factor <= 0:
            raise ValueError(f"moe_expert_capacity_factor must be positive, not {self.moe_expert_capacity_factor}")

    @classmethod
    def from_transformer_config(cls, config: Any, **overrides: Any) -> "MoEConfig":
        """The fields of this class read off ``config`` (a megatron ``TransformerConfig`` or any
        object with those attributes); ``moe_ffn_hidden_size`` falls back to ``ffn_hidden_size``."""
        values = {f.name: getattr(config, f.name) for f in dataclasses.fields(cls)
                  if getattr(config, f.name, None) is not None}
        values.setdefault("moe_ffn_hidden_size", getattr(config, "ffn_hidden_size", None))
        values.update(overrides)
        return cls(**values)


# ------------------------------------------------------------------ the router
class TopKRouter(torch.nn.Module):
    """Token-choice top-k gating in fp32 (the weight is kept in fp32 whatever the model's dtype:
    the routing choice is discontinuous, a bf16 rounding of a logit changes it)."""

    def __init__(self, config: MoEConfig, token_group: ProcessGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.token_group = token_group
        self.weight = torch.nn.Parameter(torch.empty(config.num_moe_experts, config.hidden_size, dtype=torch.float32))
        torch.nn.init.normal_(self.weight, std=config.init_method_std)
        if config.moe_router_enable_expert_bias:
            # buffers, not parameters: the optimizer must not move them, update_expert_bias does
            self.register_buffer("expert_bias", torch.zeros(config.num_moe_experts, dtype=torch.float32))
            self.register_buffer("local_tokens_per_expert", torch.zeros(config.num_moe_experts, dtype=torch.float32))
        else:
            self.expert_bias = None
            self.local_tokens_per_expert = None

    def logits(self, tokens: Tensor) -> Tensor:
        # in fp32 whatever the weights: under bf16-true Lightning's plugin casts this weight to
        # bf16 with the rest of the model (the product then failed on mixed dtypes)
        return F.linear(tokens.float(), self.weight.float())

    def route(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """``(probs, experts)``, both ``[tokens, topk]``: the chosen experts and their weights."""
        k = self.config.moe_router_topk
        if self.config.moe_router_score_function == "softmax":
            if self.config.moe_router_pre_softmax:
                probs, experts = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
            else:
                top_logits, experts = torch.topk(logits, k, dim=-1)
                probs = torch.softmax(top_logits, dim=-1)
            return probs, experts
        scores = torch.sigmoid(logits)
        if self.expert_bias is not None:
            # the bias only chooses the experts; the weights stay the unbiased scores
            _, experts = torch.topk(scores + self.expert_bias, k, dim=-1)
            probs = scores.gather(-1, experts)
        else:
            probs, experts = torch.topk(scores, k, dim=-1)
        if k > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
        return probs, experts

    def scores_for_aux_loss(self, logits: Tensor) -> Tensor:
        """Every expert's probability for every token (``P`` of the load-balancing loss)."""
        if self.config.moe_router_score_function == "softmax":
            return torch.softmax(logits, dim=-1)
        scores = torch.sigmoid(logits)
        return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """DeepSeek-V3's update, once per optimizer step: the token counts accumulated since the
        last update are summed over the token group, then each expert's bias moves by
        ``moe_router_bias_update_rate`` towards the mean count (up if it got fewer tokens)."""
        if self.expert_bias is None:
            return
        counts = self.local_tokens_per_expert.clone()
        if group_size(self.token_group) > 1:
            dist.all_reduce(counts, group=self.token_group)
        offset = counts.mean() - counts
        self.expert_bias.add_(torch.sign(offset) * self.config.moe_router_bias_update_rate)
        self.local_tokens_per_expert.zero_()


def in_backward() -> bool:
    """Whether this forward is a re-run inside backward (``full`` / selective recompute under
    ``torch.utils.checkpoint``, or a block re-run by ``CheckpointWithoutOutput``): the autograd
    engine then has a graph task running. Counts taken for the expert bias and for logging must
    skip such a re-run, or a recomputed block would count its tokens twice."""
    return torch._C._current_graph_task_id() != -1


def load_balancing_loss(scores: Tensor, tokens_per_expert: Tensor, total_tokens: int | Tensor,
                        topk: int, coeff: float) -> Tensor:
    """Switch/megatron's ``coeff * E * sum_e f_e * P_e`` with ``f_e = tokens_per_expert[e] / (T k)``
    and ``P_e = sum_t scores[t, e] / T``. ``scores`` may be one rank's rows and ``tokens_per_expert``,
    ``total_tokens`` the whole batch's: the ranks' values then add up to the whole batch's loss."""
    num_experts = scores.shape[-1]
    return (scores.sum(0) * tokens_per_expert).sum() * (num_experts * coeff / (topk * total_tokens * total_tokens))


def z_loss(logits: Tensor, total_tokens: int | Tensor, coeff: float) -> Tensor:
    """ST-MoE's router z-loss ``coeff * sum_t logsumexp(logits_t)^2 / T``; with ``T`` the whole
    batch's token count the ranks' values add up to the whole batch's ``coeff * mean(...)``."""
    return torch.logsumexp(logits, dim=-1).square().sum() * (coeff / total_tokens)


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Returns ``output`` unchanged; in backward gives ``aux_loss`` the gradient ``scale``.

    The auxiliary losses are not part of the layer's output, so nothing downstream would
    differentiate them; attached this way they reach backward whenever the output does
    (megatron-core's class of the same name). ``scale`` is the factor the training loop applies
    to the main loss's gradient relative to summing the ranks' losses: 1 when the ranks' losses
    are summed, the data-parallel size when gradients are averaged over it, divided by the number
    of micro-batches when their losses are averaged.
    """

    @staticmethod
    def forward(ctx, output: Tensor, aux_loss: Tensor, scale: float) -> Tensor:
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, ctx.scale), None


# ------------------------------------------------------------------ the experts
class GroupedExperts(torch.nn.Module):
    """``num_local_experts`` MLPs as stacked weights ``[E, in, out]``: gate/up/down (SwiGLU) or
    up/down with ``gated_linear_unit=False``."""

    def __init__(self, config: MoEConfig, num_local_experts: int, use_grouped_mm: bool | None = None) -> None:
        super().__init__()
        self.config = config
        self.use_grouped_mm = use_grouped_mm
        hidden, ffn, dtype = config.hidden_size, config.moe_ffn_hidden_size, config.params_dtype

        def weight(fan_in: int, fan_out: int) -> torch.nn.Parameter:
            w = torch.empty(num_local_experts, fan_in, fan_out, dtype=dtype)
            torch.nn.init.normal_(w, std=config.init_method_std)
            return torch.nn.Parameter(w)

        self.gate_weight = weight(hidden, ffn) if config.gated_linear_unit else None
        self.up_weight = weight(hidden, ffn)
        self.down_weight = weight(ffn, hidden)
        for param in self.parameters():
            # megatron's marker of an expert parameter: its gradient is reduced over the
            # expert-data-parallel ranks only (the ranks holding the same experts)
            place(param, expert=True)

    def forward(self, tokens: Tensor, tokens_per_expert: Tensor) -> Tensor:
        def mm(x: Tensor, w: Tensor) -> Tensor:
            return grouped_matmul(x, w, tokens_per_expert, self.use_grouped_mm)

        act = self.config.activation_func
        up = mm(tokens, self.up_weight)
        hidden = act(mm(tokens, self.gate_weight)) * up if self.gate_weight is not None else act(up)
        return mm(hidden, self.down_weight)


class SharedExperts(torch.nn.Module):
    """The experts every token goes through (one MLP of ``moe_shared_expert_intermediate_size``)."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        hidden, ffn, dtype = config.hidden_size, config.moe_shared_expert_intermediate_size, config.params_dtype
        linear = lambda fan_in, fan_out: torch.nn.Linear(fan_in, fan_out, bias=False, dtype=dtype)  # noqa: E731
        self.gate_proj = linear(hidden, ffn) if config.gated_linear_unit else None
        self.up_proj = linear(hidden, ffn)
        self.down_proj = linear(ffn, hidden)
        for module in (self.gate_proj, self.up_proj, self.down_proj):
            if module is not None:
                torch.nn.init.normal_(module.weight, std=config.init_method_std)

    def forward(self, tokens: Tensor) -> Tensor:
        act = self.config.activation_func
        up = self.up_proj(tokens)
        hidden = act(self.gate_proj(tokens)) * up if self.gate_proj is not None else act(up)
        return self.down_proj(hidden)


# ------------------------------------------------------------------ the layer
class MoELayer(ExpertLayer):
    """Router, routed experts (this rank's share of them) and shared experts.

    ``ep_group``: the expert-parallel group; rank ``r`` of ``ep`` holds experts
    ``[r E / ep, (r + 1) E / ep)`` and each rank sends its tokens to the experts' ranks.
    ``token_group``: the ranks whose batches together make the batch (data parallelism, EP
    included); the auxiliary losses' statistics and the expert-bias counts are summed over it,
    so that the ranks add up to one process on the whole batch. ``None`` for either: this
    process alone.

    After each forward, for logging: ``tokens_per_expert`` (this rank's tokens routed to each of
    the ``E`` experts, before any capacity drop), ``local_tokens_per_expert`` (tokens each of this
    rank's experts received from the whole EP group, after any drop) and ``aux_losses`` (name ->
    this rank's share of each auxiliary loss, detached; the shares over the token group add up
    to one process's value). ``aux_loss_scale``: see :class:`MoEAuxLossAutoScaler`.
    """

    def __init__(self, config: MoEConfig, ep_group: ProcessGroup | None = None,
                 token_group: ProcessGroup | None = None, use_grouped_mm: bool | None = None) -> None:
        super().__init__()
        self.config = config
        self.ep_group = ep_group
        self.token_group = token_group
        ep = group_size(ep_group)
        if config.num_moe_experts % ep:
            raise ValueError(f"num_moe_experts={config.num_moe_experts} does not split over an "
                             f"expert-parallel group of {ep}")
        self.num_local_experts = config.num_moe_experts // ep
        self.local_expert_start = group_rank(ep_group) * self.num_local_experts
        self.router = TopKRouter(config, token_group)
        self.experts = GroupedExperts(config, self.num_local_experts, use_grouped_mm)
        self.shared_experts = SharedExperts(config) if config.moe_shared_expert_intermediate_size else None
        self.aux_loss_scale = 1.0
        self.tokens_per_expert: Tensor | None = None
        self.local_tokens_per_expert: Tensor | None = None
        self.aux_losses: dict[str, Tensor] = {}
        self.step_tokens_per_expert: Tensor | None = None
        """This rank's tokens routed to each expert, summed over the training forwards since
        :meth:`take_step_statistics` (a re-run under recompute not counted); None: none yet."""
        self.step_aux_losses: dict[str, Tensor] = {}
        """This rank's shares of the auxiliary losses, summed the same way."""
        self.step_forwards = 0
        """The training forwards (microbatches) counted since :meth:`take_step_statistics`."""

    def forward(self, hidden_states: Tensor) -> Tensor:
        config = self.config
        shape = hidden_states.shape
        tokens = hidden_states.reshape(-1, config.hidden_size)
        num_tokens = tokens.shape[0]

        logits = self.router.logits(tokens)
        probs, experts = self.router.route(logits)
        pair_token, pair_expert = token_expert_pairs(experts)
        pair_prob = probs.reshape(-1)
        tokens_per_expert = torch.bincount(pair_expert, minlength=config.num_moe_experts)
        self.tokens_per_expert = tokens_per_expert.detach()
        counted = self.training and not in_backward()  # once per token, not again when re-run
        if counted and self.router.local_tokens_per_expert is not None:
            self.router.local_tokens_per_expert += tokens_per_expert.to(torch.float32)
        aux_loss = self._aux_loss(logits, tokens_per_expert, num_tokens)
        if counted:
            self.step_forwards += 1
            # on the device, no synchronisation per forward: read once per logged step
            counts = tokens_per_expert.detach()
            self.step_tokens_per_expert = counts if self.step_tokens_per_expert is None \
                else self.step_tokens_per_expert + counts
            for name, value in self.aux_losses.items():
                self.step_aux_losses[name] = self.step_aux_losses.get(name, 0) + value

        if config.moe_expert_capacity_factor is not None:
            kept = self._within_capacity(probs, experts, num_tokens)
            pair_expert, pair_prob, pair_token = pair_expert[kept], pair_prob[kept], pair_token[kept]
            routed_per_expert = torch.bincount(pair_expert, minlength=config.num_moe_experts)
        else:
            routed_per_expert = tokens_per_expert

        expert_output, order, local_counts = experts_on_their_ranks(tokens, pair_token, pair_expert, routed_per_expert,
                                                                    self.ep_group, self.experts)
        self.local_tokens_per_expert = local_counts.detach()
        pair_token, pair_prob = pair_token[order], pair_prob[order]

        # weighted by the router's probabilities in fp32, summed over each token's k experts
        output = combine_pairs(expert_output.float(), pair_token, pair_prob, num_tokens, torch.float32).to(tokens.dtype)
        if self.shared_experts is not None:
            output = output + self.shared_experts(tokens)
        if aux_loss is not None and torch.is_grad_enabled():
            output = MoEAuxLossAutoScaler.apply(output, aux_loss, self.aux_loss_scale)
        return output.view(shape)

    def _aux_loss(self, logits: Tensor, tokens_per_expert: Tensor, num_tokens: int) -> Tensor | None:
        config = self.config
        self.aux_losses = {}
        want_balance = config.moe_aux_loss_coeff > 0
        want_z = bool(config.moe_z_loss_coeff)
        if not (want_balance or want_z):
            return None
        # the whole batch's counts, so that each rank's share adds up to one process's loss
        stats = torch.cat([tokens_per_expert.to(torch.float32),
                           torch.tensor([num_tokens], dtype=torch.float32, device=logits.device)])
        if group_size(self.token_group) > 1:
            dist.all_reduce(stats, group=self.token_group)
        batch_tokens_per_expert, batch_tokens = stats[:-1], stats[-1]
        total = logits.new_zeros(())
        if want_balance:
            balance = load_balancing_loss(self.router.scores_for_aux_loss(logits), batch_tokens_per_expert,
                                          batch_tokens, config.moe_router_topk, config.moe_aux_loss_coeff)
            self.aux_losses["load_balancing_loss"] = balance.detach()
            total = total + balance
        if want_z:
            z = z_loss(logits, batch_tokens, config.moe_z_loss_coeff)
            self.aux_losses["z_loss"] = z.detach()
            total = total + z
        return total

    def _within_capacity(self, probs: Tensor, experts: Tensor, num_tokens: int) -> Tensor:
        """Which (token, expert) pairs each expert keeps: at most ``ceil(factor * T k / E)`` of
        this rank's ``T`` tokens, those with the highest probability."""
        config = self.config
        capacity = math.ceil(config.moe_expert_capacity_factor * num_tokens * config.moe_router_topk
                             / config.num_moe_experts)
        routed = torch.zeros(num_tokens, config.num_moe_experts, dtype=torch.bool, device=probs.device)
        routed.scatter_(1, experts, True)
        routed_probs = torch.full(routed.shape, -1.0, device=probs.device).scatter(1, experts, probs.detach())
        top = torch.topk(routed_probs, min(capacity, num_tokens), dim=0).indices
        kept = torch.zeros_like(routed).scatter_(0, top, True) & routed
        return kept.gather(1, experts).reshape(-1)

    def update_expert_bias(self) -> None:
        """See :meth:`TopKRouter.update_expert_bias`; call once per optimizer step."""
        self.router.update_expert_bias()

    def take_step_statistics(self) -> tuple[Tensor | None, dict[str, Tensor], int]:
        """``(tokens per expert, auxiliary losses, forwards)`` of this rank since the last call
        (None, {}, 0: no training forward), and reset."""
        taken = self.step_tokens_per_expert, self.step_aux_losses, self.step_forwards
        self.step_tokens_per_expert, self.step_aux_losses, self.step_forwards = None, {}, 0
        return taken
