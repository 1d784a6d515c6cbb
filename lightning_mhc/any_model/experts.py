"""Hugging Face mixture-of-experts models under expert parallelism (EP): ``parallelize`` on a layout
with ``expert_model_parallel_size > 1``.

Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE (transformers 5) share one sparse-MoE block: a router
(``mlp.gate``: softmax over the experts, top-k, renormalised where ``norm_topk_prob``), and the
routed experts as one module (``mlp.experts``) holding fused tensors ``gate_up_proj`` ``[E, 2I, H]``
and ``down_proj`` ``[E, H, I]`` and ``act_fn``, called as ``experts(tokens, top_k_index,
top_k_weights)``; Qwen2-MoE adds a shared expert with its sigmoid gate beside them. Under EP only
that experts module changes: :func:`shard_experts` replaces it by :class:`ExpertParallelExperts`,
which keeps the experts ``[r E / EP, (r + 1) E / EP)`` of EP rank ``r`` (placed as experts,
``ParameterPlacement.expert``: their gradients are reduced over the expert-data-parallel ranks, as the project GPT's
experts) and sends each (token, expert) pair to its expert's rank and back with
``distributed.expert_parallel``'s all-to-all. The router, the shared expert and its gate stay the
model's own, replicated, so the routing (the same top-k and weights) and what is added around the
experts are the model's; the experts compute what the model's do, ``act_fn(x W_gate^T) * (x
W_up^T)`` then ``W_down``, weighted by the router's weights and summed over each token's k experts.

Weights: ``save_pretrained`` writes one tensor per expert and part (transformers 5 converts the
fused tensors back to the legacy names); :func:`merged_experts` reads from transformers' own
conversions how they join, and ``weights.py`` reads each rank's experts only (:class:`PerExpertFiles`).
Files that hold the fused tensors are read as a block of dim 0 per EP rank.

The router's auxiliary loss (``output_router_logits``, ``router_aux_loss_coef``) is the model's own:
:class:`~lightning_mhc.any_model.parallel_model.ParallelModel`'s loss adds it, its statistics combined over
layers, stages and the sequence's ranks (``router_loss.py``).
"""
from __future__ import annotations

import dataclasses
import fnmatch
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_mhc.distributed.expert_parallel import (ExpertLayer, all_to_all, exchange_tokens_per_expert,
                                                      experts_on_their_ranks, group_size)
from lightning_mhc.distributed.layout import ParallelLayout
from lightning_mhc.distributed.placement import place
from lightning_mhc.errors import ConfigError, key, term
from lightning_mhc.any_model.plan import LLAMA, QWEN3, TPPlan
from lightning_mhc.layers.moe import combine_pairs, grouped_matmul, token_expert_pairs


# ------------------------------------------------------------------ the families' TP plans
def _without_mlp(plan: TPPlan) -> TPPlan:
    """``plan`` with its MLP entries left out: a sparse-MoE block's ``mlp`` holds a router and the
    fused experts, which tensor parallelism does not split (the experts are split over EP)."""
    return dataclasses.replace(plan, layers={k: v for k, v in plan.layers.items() if ".mlp." not in k})


MIXTRAL = _without_mlp(LLAMA)
"""Hugging Face ``MixtralForCausalLM`` and ``Qwen2MoeForCausalLM``: Llama's attention, vocabulary
and head split over TP; the router, experts and (Qwen2-MoE) the shared expert replicated."""
QWEN3_MOE = _without_mlp(QWEN3)
"""Hugging Face ``Qwen3MoeForCausalLM``: Qwen3's attention (per-head query/key norms)."""
OLMOE = TPPlan(layers={"model.embed_tokens": "vocab", "lm_head": "column"}, output="lm_head",
               selective=("model.layers.*.mlp",))
"""Hugging Face ``OlmoeForCausalLM``: its query/key norms span all heads (``q_norm`` is over the
hidden size), so the attention is not split by heads; the vocabulary and the head are."""


# ------------------------------------------------------------------ the experts under EP
def is_fused_experts(module: nn.Module) -> bool:
    """A Hugging Face sparse-MoE block's routed experts: ``gate_up_proj [E, 2I, H]``,
    ``down_proj [E, H, I]`` and ``act_fn``, or a SwiGLU of their own (:func:`gated_activation`)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == 3
            and down.dim() == 3 and gated_activation(module) is not None)


def gated_activation(experts: nn.Module) -> tuple[Callable[[Tensor], Tensor], float | None] | None:
    """The experts' activation of the gate and the clamp of the gate (above) and the up projection
    (both sides) before the product, as their ``_apply_gate`` does: DeepSeek-V4's ``act_fn`` and
    ``limit``; GLM-5-next's (HY-V4's), written with SiLU inline, ``swiglu_limit``; the other
    families' ``act_fn`` and no clamp. None: not a fused-experts module this knows."""
    act_fn = getattr(experts, "act_fn", None)
    limit = getattr(experts, "limit", getattr(experts, "swiglu_limit", None))
    if callable(act_fn):
        return act_fn, limit
    if callable(getattr(experts, "_apply_gate", None)) and limit is not None:
        return F.silu, limit
    return None


def check_experts(model: nn.Module, layout: ParallelLayout) -> None:
    """Under EP (``expert_model_parallel_size > 1``): ``model`` has fused experts, and their
    number divides by EP (ConfigError naming the module otherwise)."""
    ep = layout.expert_model_parallel_size
    if ep == 1:
        return
    # the family's record, where it has one, says where its experts are (imported here: the records
    # hold this file's TP plans)
    from lightning_mhc.any_model.families import family_of

    record = family_of(model)
    experts = [(name, module) for name, module in model.named_modules() if is_fused_experts(module)]
    size = term("expert_model_parallel_size", ep)
    if not experts or (record is not None and record.experts is None):
        family = f"; model_type {record.model_type!r} is a dense family" if record is not None else ""
        raise ConfigError(
            size, f": {type(model).__name__} has no fused experts (a module with gate_up_proj [E, 2I, H] and "
            f"down_proj [E, H, I], as Mixtral's, Qwen2/3-MoE's and OLMoE's mlp.experts{family}) to split; set it "
            "to 1.")
    if record is not None:
        stray = [name for name, _ in experts if not fnmatch.fnmatchcase(name, record.experts.path)]
        if stray:
            raise ConfigError(
                size, f": {type(model).__name__} (model_type {record.model_type!r}) has fused experts at {stray[0]}, "
                f"not where its family's record puts them ({record.experts.path}); set it to 1, or correct the "
                "record's experts path.")
    for name, module in experts:
        count = module.gate_up_proj.shape[0]
        if count % ep:
            raise ConfigError(size, f": {name} has {count} experts, which do not split evenly over {ep} ranks; "
                              "choose an ", key("expert_model_parallel_size"), " that divides them.")


def shard_experts(module: nn.Module, layout: ParallelLayout) -> None:
    """Replace every fused-experts module in ``module`` (materialised) by this EP rank's
    :class:`ExpertParallelExperts`; nothing without EP."""
    if layout.expert_model_parallel_size == 1:
        return
    found = [(name, sub) for name, sub in module.named_modules() if is_fused_experts(sub)]
    for name, experts in found:
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, attr, ExpertParallelExperts(experts, layout.ep_group, layout.expert_model_parallel_size,
                                                    layout.expert_model_parallel_rank))


class ExpertParallelExperts(ExpertLayer):
    """This EP rank's block of a Hugging Face fused-experts module, called as the module was:
    ``(tokens [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``, every rank's tokens
    computed by the ranks holding their experts."""

    def __init__(self, experts: nn.Module, ep_group, ep: int, ep_rank: int) -> None:
        super().__init__()
        self.num_experts = experts.gate_up_proj.shape[0]
        """All the experts (the router's choices index them)."""
        self.num_local_experts = self.num_experts // ep
        self.local_expert_start = ep_rank * self.num_local_experts
        self.ep_group = ep_group
        self.act_fn, self.swiglu_limit = gated_activation(experts)
        """The experts' activation, and their clamp of the gate and up projections (DeepSeek-V4's,
        HY-V4's; None for the families without one)."""
        self.gate_up_proj = self._local(experts.gate_up_proj)
        self.down_proj = self._local(experts.down_proj)

    def _local(self, whole: nn.Parameter) -> nn.Parameter:
        local = nn.Parameter(whole.detach()[self.local_expert_start:self.local_expert_start + self.num_local_experts]
                             .clone(), requires_grad=whole.requires_grad)
        # megatron's marker of an expert parameter: its gradient is reduced over the ranks holding
        # the same experts (expert-DP), and checkpoints store it as this EP rank's block of dim 0
        place(local, expert=True)
        return local

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        if hidden_states.is_meta:
            return self._evenly_routed(hidden_states, top_k_index, top_k_weights)
        pair_token, pair_expert = token_expert_pairs(top_k_index)
        tokens_per_expert = torch.bincount(pair_expert, minlength=self.num_experts)
        expert_output, order, _ = experts_on_their_ranks(hidden_states, pair_token, pair_expert, tokens_per_expert,
                                                         self.ep_group, self._local_experts)
        pair_token, pair_weight = pair_token[order], top_k_weights.reshape(-1)[order]
        # as the model's experts: weighted in the activations' dtype, summed over each token's k experts
        return combine_pairs(expert_output, pair_token, pair_weight, hidden_states.shape[0], hidden_states.dtype)

    def _evenly_routed(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """The forward on meta tensors (the planner's trace), which hold no routing (the counts and
        splits are read off the router's choices): every rank's pairs spread evenly over the experts,
        through the same steps (pairs sorted by expert, the counts exchanged, the rows dispatched, this
        rank's experts' products, the rows combined back), so the same tensors are kept and the same
        collectives run with a balanced router's shapes."""
        pair_token, pair_expert = token_expert_pairs(top_k_index)
        order = torch.argsort(pair_expert, stable=True)
        routed = hidden_states.index_select(0, pair_token[order])
        exchange_tokens_per_expert(torch.empty(self.num_experts, dtype=torch.int64, device="meta"), self.ep_group)
        splits = _even(routed.shape[0], group_size(self.ep_group))  # as many rows come as go
        received = all_to_all(routed, splits, splits, self.ep_group)
        by_expert = torch.empty(received.shape[0], dtype=torch.int64, device="meta")  # the sort to the experts
        counts = torch.tensor(_even(received.shape[0], self.num_local_experts))  # read by the per-expert loop
        output = self._local_experts(received.index_select(0, by_expert), counts)
        back = all_to_all(output.index_select(0, by_expert), splits, splits, self.ep_group)
        return combine_pairs(back, pair_token[order], top_k_weights.reshape(-1)[order], hidden_states.shape[0],
                             hidden_states.dtype)

    def _local_experts(self, tokens: Tensor, tokens_per_expert: Tensor) -> Tensor:
        """This rank's experts on their tokens (rows sorted by local expert): the fused tensors are
        ``[E, out, in]`` (``F.linear``'s), the grouped product takes ``[E, in, out]``."""
        gate_up = grouped_matmul(tokens, self.gate_up_proj.transpose(1, 2), tokens_per_expert)
        gate, up = gate_up.chunk(2, dim=-1)
        if self.swiglu_limit is not None:
            gate, up = gate.clamp(max=self.swiglu_limit), up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
        return grouped_matmul(self.act_fn(gate) * up, self.down_proj.transpose(1, 2), tokens_per_expert)

    def extra_repr(self) -> str:
        return (f"experts {self.local_expert_start}..{self.local_expert_start + self.num_local_experts - 1} of "
                f"{self.num_experts}")


def _even(total: int, parts: int) -> list[int]:
    """``total`` rows over ``parts`` as evenly as whole rows go."""
    return [total // parts + (i < total % parts) for i in range(parts)]


# ------------------------------------------------------------------ the experts in save_pretrained files
@dataclasses.dataclass(frozen=True)
class PerExpertFiles:
    """A fused expert tensor ``[E, out, in]`` as ``save_pretrained`` writes it (transformers 5
    writes the legacy layout back): per expert, the files' tensors of its parts, concatenated along
    the expert's dim 0 (Mixtral's ``w1`` then ``w3`` make ``gate_up_proj[e]``)."""

    names: tuple[tuple[str, ...], ...]
    """``names[e]``: expert ``e``'s parts' names in the files, in order."""


def conversion_mapping(model: nn.Module) -> list:
    """transformers' own conversions of ``model``'s tensors between its files and its modules
    (renamings, experts stacked into fused tensors); [] for another model, or a transformers
    without them."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping

        return list(get_model_conversion_mapping(model) or [])
    except Exception:  # not a transformers model, or a transformers without these
        return []


def merged_experts(model: nn.Module) -> list[tuple[str, tuple[str, ...]]]:
    """``(fused name suffix, per-expert source patterns with '*' for the expert)``: transformers'
    own conversions of ``model`` that stack one tensor per expert (``MergeModulelist(dim=0)``),
    then join the parts along the expert's dim 0 (``Concatenate(dim=1)`` of the stacked tensors),
    e.g. ``(".experts.gate_up_proj", (".experts.*.w1.weight", ".experts.*.w3.weight"))``. None for
    another model, or a transformers without them."""
    conversions = conversion_mapping(model)
    if not conversions:
        return []
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

    merged = []
    for conversion in conversions:
        if not isinstance(conversion, WeightConverter) or len(conversion.target_patterns) != 1:
            continue
        ops = [(type(op), getattr(op, "dim", None)) for op in conversion.operations]
        stacks = ops[:1] == [(MergeModulelist, 0)] and ops[1:] in ([], [(Concatenate, 1)])
        # their patterns are regular expressions; those of names, dots and the expert's '*' read literally
        # (DeepSeek-V4 escapes its dots: r"\.experts.*.w1.weight")
        sources = tuple(source.replace("\\.", ".") for source in conversion.source_patterns)
        if stacks and all(source.count("*") == 1 for source in sources) and (len(sources) == 1 or len(ops) == 2):
            merged.append((conversion.target_patterns[0].replace("\\.", "."), sources))
    return merged


def per_expert_files(name: str, shape: tuple[int, ...], merged: list[tuple[str, tuple[str, ...]]],
                     in_files) -> PerExpertFiles | None:
    """The files' per-expert tensors of the model's fused ``name`` (``shape`` ``[E, ...]``), found
    by ``in_files(candidate) -> the name in the files or None``; None where they are not all there."""
    for target, sources in merged:
        if len(shape) != 3 or not name.endswith(target):
            continue
        stem = name[:len(name) - len(target)]
        names = tuple(tuple(in_files(stem + source.replace("*", str(e))) for source in sources)
                      for e in range(shape[0]))
        if all(all(parts) for parts in names):
            return PerExpertFiles(names)
    return None
