"""A Hugging Face MoE model's own router loss (``output_router_logits=True``, ``router_aux_loss_coef``)
on a model split by ``parallelize``: the loss is cross entropy + coef x the family's router loss, as
the model's own ``forward(..., labels=...)`` returns it.

The family's loss (``Family.router_loss``: a :class:`~lightning_mhc.layers.moe.RouterLossRule`) is a
function of statistics summed over *all* layers and tokens, not a sum of per-layer losses, so its
parts are combined before the loss is taken:

- **Layers and stages.** Each router's forward hook adds its layer's statistics to the microbatch's
  sums on this rank. Under PP every stage before the last sends its sums to the last stage when its
  part of the microbatch has run (point-to-point on the PP group, fp64: exact counts), which adds them
  up and takes the loss; the sums are the whole model's. Each router's gradient needs the totals:
  the last stage sends them back, with the gradient its loss term received, when its backward of the
  microbatch begins (before any earlier stage's), and each router adds ``coef x d loss / d logits`` at
  the totals to its logits' gradient (:class:`_AttachRouterLoss`, on the router's top-k weights,
  which the experts use). No stage needs another's graph.
- **CP and sequence parallelism.** A sample's tokens are split over CP (and over TP under sequence
  parallelism): the last stage sums the statistics over those ranks, so every rank holds the whole
  sample's totals; each CP rank's loss holds ``1 / CP`` of the term (its CE is its part of the mean,
  summed over CP).
- **DP and EP: per rank, as Hugging Face under DDP.** Each data-parallel rank takes the loss over its
  own microbatch (EP ranks are DP ranks); the gradients' DP average then averages the ranks' losses.
  One process reproduces it as the mean over DP ranks and microbatches of the model's own loss on
  each microbatch. (megatron instead sums the statistics over the token group; the project GPT does.)
- **Microbatches and accumulation** as the CE: each microbatch's loss holds its own term, the
  schedule's mean over microbatches and the DP average apply to both.

The figures logged: :meth:`RouterLoss.take_step_statistics` per router (tokens per expert, as the
GPT's ``moe/<layer>/tokens_per_expert/<e>``) and the mean loss (``moe/aux_loss``, before the coef).
"""
from __future__ import annotations

import dataclasses
import datetime
import fnmatch
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_mhc.distributed.layout import ParallelLayout
from lightning_mhc.layers.moe import RouterLossRule
from lightning_mhc.wrapping import wrap

_TO_LAST, _FROM_LAST = 11, 12


@dataclasses.dataclass(frozen=True)
class RouterLossSpec:
    """Where a family's routers are and which loss they take (``Family.router_loss``). A router is
    a module whose forward returns ``(logits [T, E], top-k weights [T, k], top-k indices [T, k])``
    (transformers 5's ``*TopKRouter``)."""

    routers: str
    """The routers' module names (fnmatch pattern, e.g. ``model.layers.*.mlp.gate``)."""
    rule: RouterLossRule
    num_experts: tuple[str, ...] = ("num_local_experts", "num_experts")
    """The config keys of the expert count, first found."""
    top_k: str = "num_experts_per_tok"
    enabled: str = "output_router_logits"
    coef: str = "router_aux_loss_coef"
    router_types: tuple[str, ...] = ()
    """The class names of the modules that are routers where ``routers`` names others too (a
    family's hash routers, left out of its loss); empty: every module it names."""


def count_chosen(counts: dict[str, Tensor], name: str, chosen: Tensor, num_experts: int) -> None:
    """Add the experts a router named ``name`` chose (``chosen``, any shape) to ``counts[name]``
    (tokens per expert, long). scatter_add, not bincount: bincount reads the largest index back to
    the host (a sync per router)."""
    chosen = chosen.reshape(-1).detach().long()
    added = torch.zeros(num_experts, dtype=torch.long, device=chosen.device).scatter_add_(
        0, chosen, torch.ones_like(chosen))
    counts[name] = added if name not in counts else counts[name] + added


def in_backward() -> bool:
    """A forward re-run inside backward (recompute): its routers are not counted again."""
    return torch._C._current_graph_task_id() != -1


class _MicroBatch:
    """One microbatch's sums on this rank and, once known, the whole model's."""

    def __init__(self) -> None:
        self.constant: Tensor | None = None
        self.differentiable: Tensor | None = None
        self.visited: set[int] = set()
        self.needs_reply = False
        self.totals: tuple[Tensor, Tensor] | None = None
        self.value: Tensor | None = None
        self.grad: float | None = None
        """The gradient the last stage's loss term received (0: the loss left the term out)."""
        self.reply_to: list[int] = []

    def add(self, constant: Tensor, differentiable: Tensor) -> None:
        constant, differentiable = constant.double(), differentiable.double()
        self.constant = constant if self.constant is None else self.constant + constant
        self.differentiable = differentiable if self.differentiable is None else self.differentiable + differentiable


class RouterLoss:
    """The router loss of this rank's chunks of a split model (see the module's doc)."""

    def __init__(self, chunks: list[nn.Module], spec: RouterLossSpec, config: Any, layout: ParallelLayout,
                 timeout: datetime.timedelta = datetime.timedelta(minutes=10)) -> None:
        self.spec, self.rule, self.layout, self.timeout = spec, spec.rule, layout, timeout
        self.active = bool(getattr(config, spec.enabled, False))
        """Whether the loss is taken (the config's ``output_router_logits``); else the routers'
        tokens per expert are only counted, for the logs."""
        self.coef = float(getattr(config, spec.coef, 0.0) or 0.0)
        self.top_k = int(getattr(config, spec.top_k))
        self.num_experts = next(int(getattr(config, k)) for k in spec.num_experts if getattr(config, k, None))
        self.num_chunks = len(chunks)
        self.is_last = layout.is_last_stage
        self.routers: list[tuple[str, nn.Module]] = []
        for chunk in chunks:
            for name, module in chunk.named_modules():
                if fnmatch.fnmatchcase(name, spec.routers) and (
                        not spec.router_types or type(module).__name__ in spec.router_types):
                    self.routers.append((name, module))
                    wrap(module, "router_loss", self._routed)
        self._router_names = {id(module): name for name, module in self.routers}
        """A router's name by the module (its forward hook is handed the module)."""
        self._counting = False
        self._open: list[_MicroBatch] = []
        self._current: _MicroBatch | None = None
        self._mask: Tensor | None = None
        self._awaiting_loss: _MicroBatch | None = None
        self._awaiting_reply: list[_MicroBatch] = []
        self._sends: list[tuple[Any, Tensor]] = []
        self._step_counts: dict[str, Tensor] = {}
        self._step_loss_sum: Tensor | None = None
        self._step_loss_count = 0

    # ------------------------------------------------------------------ around a chunk's forward
    def begin(self, chunk: int, attention_mask: Tensor | None, sequence_split: Any = None) -> None:
        """Before chunk ``chunk``'s forward of a microbatch: its record, and the mask of the tokens
        this rank's routers see (``[b, s]`` cut as the sequence is: CP chunks, then the SP part)."""
        self._counting = torch.is_grad_enabled()  # training forwards, as the GPT's counts
        if not self.active:
            return
        if chunk == 0:
            record = _MicroBatch()
            self._open.append(record)
        else:
            record = next((r for r in self._open if chunk not in r.visited), None)
            if record is None:
                raise RuntimeError(f"router loss: chunk {chunk} ran a microbatch chunk 0 did not")
        record.visited.add(chunk)
        self._current = record
        mask = attention_mask
        if mask is not None:
            if sequence_split is not None:
                mask = sequence_split.split_labels(mask)
            tp = self.layout.tensor_model_parallel_size
            if self.layout.sequence_parallel and tp > 1:
                mask = mask.chunk(tp, dim=1)[self.layout.tensor_model_parallel_rank]
            mask = mask.reshape(-1)
        self._mask = mask

    def end(self, chunk: int, output: Tensor, final: bool) -> Tensor:
        """After chunk ``chunk``'s forward: its last chunk closes the microbatch on this rank (sent
        to the last stage, or there combined); the final stage's logits come back tapped."""
        record, self._current = self._current, None
        if record is None or chunk != self.num_chunks - 1:
            return output
        self._open.remove(record)
        if not self.is_last:
            self._send_sums(record)
            return output
        self._combine(record)
        self._awaiting_loss = record
        if torch.is_grad_enabled() and output.requires_grad:
            output = _Tap.apply(output, record, self)
        return output

    def loss_term(self, logits: Tensor) -> Tensor | None:
        """The term the last stage's loss adds for the microbatch whose logits these are:
        ``coef x loss / CP`` (each CP rank's loss is its part)."""
        record, self._awaiting_loss = self._awaiting_loss, None
        if record is None or record.value is None:
            return None
        term = (self.coef / self.layout.context_parallel_size) * record.value.float()
        if torch.is_grad_enabled() and logits.requires_grad:
            term = _GradOfTerm.apply(logits, term, record)
        return term

    # ------------------------------------------------------------------ the routers
    def _routed(self, module: nn.Module, args: tuple, output: Any):
        if in_backward() or not isinstance(output, tuple) or len(output) < 3:
            return None
        if self._counting:
            count_chosen(self._step_counts, self._router_names[id(module)], output[2], self.num_experts)
        record = self._current
        if record is None:
            return None
        logits = output[0]
        mask = self._mask
        if mask is not None and mask.numel() != logits.shape[0]:
            raise RuntimeError(f"router loss: {logits.shape[0]} routed rows but {mask.numel()} mask entries")
        with torch.no_grad():
            constant, differentiable = self.rule.statistics(logits.detach(), mask, self.top_k)
        record.add(constant, differentiable)
        if not (torch.is_grad_enabled() and logits.requires_grad):
            return None
        record.needs_reply = True
        weights = _AttachRouterLoss.apply(output[1], logits, mask, record, self)
        return (logits, weights, *output[2:])

    # ------------------------------------------------------------------ combining over stages
    def _zeros(self) -> tuple[Tensor, Tensor]:
        c, d = self.rule.sizes(self.num_experts)
        return torch.zeros(c, dtype=torch.float64), torch.zeros(d, dtype=torch.float64)

    def _device(self) -> torch.device:
        return next((m.weight.device for _, m in self.routers if hasattr(m, "weight")), torch.device("cpu"))

    def _sums(self, record: _MicroBatch) -> tuple[Tensor, Tensor]:
        if record.constant is None:
            constant, differentiable = self._zeros()
            return constant.to(self._device()), differentiable.to(self._device())
        return record.constant, record.differentiable

    def _isend(self, tensor: Tensor, dst: int, tag: int) -> None:
        self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]
        self._sends.append((dist.isend(tensor, dst=dst, group=self.layout.pp_group, tag=tag), tensor))

    def _recv(self, size: int, src: int, tag: int) -> Tensor:
        buffer = torch.empty(size, dtype=torch.float64, device=self._device())
        dist.irecv(buffer, src=src, group=self.layout.pp_group, tag=tag).wait(self.timeout)
        return buffer

    def _send_sums(self, record: _MicroBatch) -> None:
        constant, differentiable = self._sums(record)
        flag = torch.tensor([1.0 if record.needs_reply else 0.0], dtype=torch.float64, device=constant.device)
        self._isend(torch.cat([constant, differentiable, flag]), self.layout.last_stage_rank, _TO_LAST)
        if record.needs_reply:
            self._awaiting_reply.append(record)

    def _combine(self, record: _MicroBatch) -> None:
        """On the last stage: the whole model's sums (every stage's, over CP and the SP ranks), and the loss."""
        constant, differentiable = self._sums(record)
        c, d = constant.numel(), differentiable.numel()
        sums = torch.cat([constant, differentiable])
        if self.layout.pipeline_model_parallel_size > 1:
            for rank in dist.get_process_group_ranks(self.layout.pp_group):
                if rank == dist.get_rank():
                    continue
                received = self._recv(c + d + 1, rank, _TO_LAST)
                sums = sums + received[:-1]
                if received[-1].item():
                    record.reply_to.append(rank)
        for group, size in ((self.layout.cp_group, self.layout.context_parallel_size),
                            (self.layout.tp_group, self.layout.tensor_model_parallel_size
                             if self.layout.sequence_parallel else 1)):
            if size > 1:
                dist.all_reduce(sums, group=group)
        record.totals = (sums[:c], sums[c:])
        record.value = self.rule.loss(sums[:c], sums[c:], self.num_experts)
        value = record.value.detach()
        self._step_loss_sum = value if self._step_loss_sum is None else self._step_loss_sum + value
        self._step_loss_count += 1

    def _reply(self, record: _MicroBatch) -> None:
        """On the last stage, when its backward of the microbatch begins: the totals and the loss
        term's gradient to every earlier stage whose routers wait for them."""
        constant, differentiable = record.totals
        grad = torch.tensor([record.grad or 0.0], dtype=torch.float64, device=constant.device)
        message = torch.cat([constant, differentiable, grad])
        for rank in record.reply_to:
            self._isend(message, rank, _FROM_LAST)

    def totals_of(self, record: _MicroBatch) -> tuple[Tensor, Tensor, float]:
        """The whole model's sums and the loss term's gradient for ``record`` (on an earlier stage:
        received from the last, in microbatch order)."""
        while record.totals is None or record.grad is None:
            if not self._awaiting_reply:
                raise RuntimeError("router loss: a router's backward ran before its microbatch's forward was sent")
            waiting = self._awaiting_reply.pop(0)
            c, d = self.rule.sizes(self.num_experts)
            received = self._recv(c + d + 1, self.layout.last_stage_rank, _FROM_LAST)
            waiting.totals, waiting.grad = (received[:c], received[c:c + d]), received[-1].item()
        return record.totals[0], record.totals[1], record.grad

    # ------------------------------------------------------------------ the logs
    def take_step_statistics(self) -> tuple[dict[str, Tensor], float | None]:
        """Per router (by its name in the whole model), its routed tokens per expert summed over the
        microbatches since the last call, and the mean of their losses (on the last stage; else
        None); reset."""
        mean = (self._step_loss_sum / self._step_loss_count).item() if self._step_loss_count else None
        taken = self._step_counts, mean
        self._step_counts, self._step_loss_sum, self._step_loss_count = {}, None, 0
        return taken


class _AttachRouterLoss(torch.autograd.Function):
    """Returns a router's top-k weights unchanged; in backward adds ``g x coef x d loss / d logits``
    to its logits' gradient, the loss at the whole model's sums (``g``: the gradient the last
    stage's loss term received). Nothing is saved through autograd's saved tensors, so a
    checkpointed block recomputes as it ran."""

    @staticmethod
    def forward(ctx, weights: Tensor, logits: Tensor, mask: Tensor | None, record: _MicroBatch,
                owner: RouterLoss) -> Tensor:
        ctx.logits, ctx.mask, ctx.record, ctx.owner = logits.detach(), mask, record, owner
        return weights.view_as(weights)

    @staticmethod
    def backward(ctx, grad_weights: Tensor):
        owner = ctx.owner
        constant, differentiable, grad = owner.totals_of(ctx.record)
        if not grad or not owner.coef:
            return grad_weights, None, None, None, None
        logits_grad = owner.rule.logits_grad(ctx.logits, ctx.mask, owner.top_k, constant, differentiable,
                                             owner.num_experts, grad * owner.coef)
        return grad_weights, logits_grad.to(ctx.logits.dtype), None, None, None


class _GradOfTerm(torch.autograd.Function):
    """The loss term, unchanged; its backward keeps the gradient it received (``record.grad``) for
    the routers. Takes the logits so that it runs before the logits' tap."""

    @staticmethod
    def forward(ctx, logits: Tensor, term: Tensor, record: _MicroBatch) -> Tensor:
        ctx.record = record
        return term.detach().clone()

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.record.grad = float(grad)
        return None, None, None


class _Tap(torch.autograd.Function):
    """The last stage's logits, unchanged; in backward (after the loss and its term) the totals and
    the term's gradient go to the earlier stages, before any router's backward."""

    @staticmethod
    def forward(ctx, logits: Tensor, record: _MicroBatch, owner: RouterLoss) -> Tensor:
        ctx.record, ctx.owner = record, owner
        return logits.view_as(logits)

    @staticmethod
    def backward(ctx, grad: Tensor):
        if ctx.record.grad is None:
            ctx.record.grad = 0.0  # the loss left the term out: no gradient from it
        ctx.owner._reply(ctx.record)
        return grad, None, None


def router_loss_for(chunks: list[nn.Module], spec: RouterLossSpec | None, config: Any,
                    layout: ParallelLayout) -> RouterLoss | None:
    """The routers of a MoE family's model (None for another): their loss taken where the config
    asks for it (``output_router_logits``), their tokens per expert counted for the logs always."""
    if spec is None or config is None:
        return None
    return RouterLoss(chunks, spec, config, layout)
