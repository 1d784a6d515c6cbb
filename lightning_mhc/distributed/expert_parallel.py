"""Expert parallelism's token exchange: uneven all-to-all with autograd, over any process group.

An expert-parallel (EP) group of size ``ep`` splits ``num_experts`` experts into contiguous
blocks: rank ``r`` of the group holds experts ``[r * E / ep, (r + 1) * E / ep)``. Each rank routes
its own tokens; :func:`dispatch_tokens` sends every token to the rank holding its expert and
:func:`combine_tokens` brings the experts' outputs back, in the order they left;
:func:`experts_on_their_ranks` does both around a rank's experts, for (token, expert) pairs.

Why our own and not megatron-core's ``MoEAlltoAllTokenDispatcher``: that one creates a CUDA stream
when it is built and so cannot run on CPU, where gloo's ``all_to_all_single`` with uneven splits
(and empty ones) works. Nothing here knows about the model: the MoE layer
(``lightning_mhc.model.moe``) uses it, and is an :class:`ExpertLayer`, what the training runtime
asks of any MoE layer once per step.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup


def group_size(group: ProcessGroup | None) -> int:
    """The size of ``group``; 1 for no group (one process, or none initialised)."""
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    """This process's rank in ``group``; 0 for no group."""
    if group is None or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` whose backward is the reverse exchange: the gradient of a row goes
    back to the rank the row came from (input and output splits swapped)."""

    @staticmethod
    def forward(ctx, tokens: Tensor, output_splits: list[int], input_splits: list[int],
                group: ProcessGroup) -> Tensor:
        ctx.group = group
        ctx.output_splits = output_splits
        ctx.input_splits = input_splits
        return _all_to_all(tokens, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        grad_input = _all_to_all(grad_output, ctx.input_splits, ctx.output_splits, ctx.group)
        return grad_input, None, None, None


def _all_to_all(tokens: Tensor, output_splits: list[int], input_splits: list[int],
                group: ProcessGroup) -> Tensor:
    tokens = tokens.contiguous()
    out = tokens.new_empty((sum(output_splits), *tokens.shape[1:]))
    dist.all_to_all_single(out, tokens, output_split_sizes=output_splits,
                           input_split_sizes=input_splits, group=group)
    return out


def all_to_all(tokens: Tensor, output_splits: list[int], input_splits: list[int],
               group: ProcessGroup | None) -> Tensor:
    """Send rows ``tokens[sum(input_splits[:r]) : sum(input_splits[:r + 1])]`` to rank ``r`` of
    ``group`` and receive ``output_splits[r]`` rows from it, differentiably (backward runs the
    reverse exchange). With no group, or one of size 1, ``tokens`` is returned as is."""
    if group_size(group) == 1:
        return tokens
    return _AllToAll.apply(tokens, list(output_splits), list(input_splits), group)


def exchange_tokens_per_expert(tokens_per_expert: Tensor, group: ProcessGroup | None) -> Tensor:
    """The split sizes, exchanged before the tokens: ``tokens_per_expert`` holds, for each of the
    ``E`` experts, how many rows this rank sends it. Returns ``[ep, E / ep]``: row ``r`` is how many
    rows rank ``r`` sends to each of this rank's experts."""
    ep = group_size(group)
    num_experts = tokens_per_expert.numel()
    if num_experts % ep:
        raise ValueError(f"{num_experts} experts do not split evenly over an expert-parallel group of {ep}")
    counts = tokens_per_expert.to(torch.int64)
    if ep == 1:
        return counts.view(1, num_experts)
    received = torch.empty_like(counts)
    # equal splits of E / ep counts each: block r of ours goes to rank r, block r of theirs is rank r's
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    return received.view(ep, num_experts // ep)


@dataclasses.dataclass
class DispatchState:
    """What :func:`combine_tokens` needs to undo :func:`dispatch_tokens`."""

    group: ProcessGroup | None
    input_splits: list[int]  # rows sent to each rank of the group
    output_splits: list[int]  # rows received from each rank of the group
    by_expert: Tensor | None  # permutation (source rank, expert) order -> (expert, source rank) order


def dispatch_tokens(tokens: Tensor, tokens_per_expert: Tensor, group: ProcessGroup | None
                    ) -> tuple[Tensor, Tensor, DispatchState]:
    """Send ``tokens`` (rows sorted by expert, ``tokens_per_expert[e]`` rows for expert ``e`` of
    all ``E``) to the ranks holding their experts.

    Returns ``(local_tokens, local_tokens_per_expert, state)``: the rows this rank's experts
    receive from every rank, sorted by local expert (rank order within an expert), how many each
    local expert got, and the state :func:`combine_tokens` takes back.
    """
    ep = group_size(group)
    if ep == 1:
        rows = [tokens.shape[0]]
        return tokens, tokens_per_expert.to(torch.int64), DispatchState(group, rows, rows, None)
    received_counts = exchange_tokens_per_expert(tokens_per_expert, group)  # [ep, E_local]
    input_splits = tokens_per_expert.to(torch.int64).view(ep, -1).sum(1).tolist()
    output_splits = received_counts.sum(1).tolist()
    received = all_to_all(tokens, output_splits, input_splits, group)
    # received rows are in (source rank, local expert) order; the grouped product wants them
    # contiguous per expert, so sort the chunks by (local expert, source rank)
    ep_, local_experts = received_counts.shape
    chunk = torch.repeat_interleave(torch.arange(ep_ * local_experts, device=tokens.device),
                                    received_counts.flatten().to(tokens.device))
    key = (chunk % local_experts) * ep_ + chunk // local_experts
    by_expert = torch.argsort(key, stable=True)
    local_tokens = received.index_select(0, by_expert)
    return local_tokens, received_counts.sum(0), DispatchState(group, input_splits, output_splits, by_expert)


def combine_tokens(expert_output: Tensor, state: DispatchState) -> Tensor:
    """Send the experts' outputs (rows in the order :func:`dispatch_tokens` returned them) back
    to the ranks their tokens came from; rows come back in the order they were sent."""
    if state.by_expert is None:
        return expert_output
    by_source = torch.empty_like(state.by_expert)
    by_source[state.by_expert] = torch.arange(state.by_expert.numel(), device=state.by_expert.device)
    back_in_source_order = expert_output.index_select(0, by_source)
    return all_to_all(back_in_source_order, state.input_splits, state.output_splits, state.group)


def experts_on_their_ranks(tokens: Tensor, pair_token: Tensor, pair_expert: Tensor, tokens_per_expert: Tensor,
                           group: ProcessGroup | None, experts: Callable[[Tensor, Tensor], Tensor],
                           ) -> tuple[Tensor, Tensor, Tensor]:
    """Each (token, chosen expert) pair's expert output, computed on the rank holding the expert:
    the pairs sorted by expert (stable), each pair's row of ``tokens`` sent there
    (:func:`dispatch_tokens`), ``experts(local_tokens, local_tokens_per_expert)`` run on them, the
    outputs brought back (:func:`combine_tokens`). ``tokens_per_expert``: the pairs per expert.

    Returns the outputs in sorted-pair order, the sort ``order`` (``pair_token[order]`` and the
    pairs' weights ``[order]`` line up with the outputs), and how many rows each of this rank's
    experts received."""
    order = torch.argsort(pair_expert, stable=True)
    routed = tokens.index_select(0, pair_token[order])
    local_tokens, local_counts, state = dispatch_tokens(routed, tokens_per_expert, group)
    return combine_tokens(experts(local_tokens, local_counts), state), order, local_counts


class ExpertLayer(torch.nn.Module):
    """What the training runtime (``strategies``) asks of an MoE layer, without knowing the model:
    the factor its auxiliary losses' gradient gets (``aux_loss_scale``, set before each step's
    schedule) and the expert-bias update after each optimizer step."""

    aux_loss_scale: float = 1.0

    def update_expert_bias(self) -> None:
        """Move the experts' routing bias by this step's token counts (nothing without one)."""


def set_aux_loss_scale(module: torch.nn.Module, scale: float) -> None:
    """Set ``aux_loss_scale`` on every :class:`ExpertLayer` in ``module``."""
    for sub in module.modules():
        if isinstance(sub, ExpertLayer):
            sub.aux_loss_scale = scale


def update_expert_biases(module: torch.nn.Module) -> None:
    """Update the expert bias of every :class:`ExpertLayer` in ``module`` (once per optimizer step)."""
    for sub in module.modules():
        if isinstance(sub, ExpertLayer):
            sub.update_expert_bias()
