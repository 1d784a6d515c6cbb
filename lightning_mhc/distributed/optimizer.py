"""The distributed optimizer (ZeRO-1, megatron's ``use_distributed_optimizer``) and fp32 main weights.

megatron-core's ``DistributedOptimizer`` allocates its buffers on CUDA, so the suite (gloo, CPU)
could not run it; torch's ``ZeroRedundancyOptimizer`` gives whole parameters to ranks, so one
large embedding leaves the state far from ``1/DP`` per rank. This is megatron's algorithm on any
device, around the torch optimizer the user built (nothing of the update is written here):

- the rank's trainable parameters (reverse order: the order backward finishes them) are cut into
  buckets, the tied embedding alone in its own, so that its shard is the same on the first and
  the last stage; a bucket is padded to a multiple of the ranks that hold replicas of its
  parameters (``grads.reduction_group``: DP x CP under context parallelism, which replicates the
  parameters over CP too), and rank ``r`` of them owns its ``r``-th equal range: *pieces* of
  parameters, cut wherever the range ends. Under expert parallelism the experts' parameters get
  buckets of their own, cut over the expert-data-parallel ranks (those holding the same experts):
  each rank's state is then ``1/(DP x CP)`` of the dense parameters and ``1/(DP x CP/EP)`` of its
  ``E/EP`` experts;
- the user's optimizer is pointed at fp32 *main* pieces instead of the parameters, group by group
  (its settings and learning-rate scheduler unchanged): views of the parameters when they are
  fp32, fp32 copies when the model holds bf16 weights (``bf16-true``). Its state (AdamW's
  moments) exists for ``1/DP`` of the parameters;
- each bucket's gradients live in one contiguous fp32 buffer whose views are the parameters'
  ``main_grad`` (megatron's grad buffer): each backward adds a parameter's gradient into it as
  autograd produces it and drops ``.grad``, so no second copy of the gradients is made; the
  buffers are reduce-scattered over DP bucket by bucket into the owned range (during the last
  backward when the reduction overlaps). A buffer is made at its bucket's first gradient of a
  step and freed after the step (megatron keeps its buffers): it does not live through the
  forward passes before the first backward, where the activations peak;
- the sequence-parallel TP sum, the tied embedding's sum between stages, the global norm and
  clipping run on the pieces; a parameter no DP rank got a gradient for in a step is not stepped
  (as torch's optimizers skip a ``.grad`` of None: no weight decay, no momentum);
- after the step the pieces are written back into the parameters and every bucket is
  all-gathered over DP.

Without ``use_distributed_optimizer`` a bf16 model still trains on fp32 main weights: the same
class with one part per bucket (each rank holds all of them) and an all-reduce.

Only an element-wise update can be cut anywhere (SGD, Adam, AdamW, ...); another optimizer
(Adafactor's factored moments, LBFGS's line search, Muon's orthogonalisation) is refused, with
bf16 weights too (the pieces are flat there as well).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from lightning_mhc.distributed.grad_overlap import OverlappedGradReduction
from lightning_mhc.distributed.grads import (
    DEFAULT_BUCKET_BYTES,
    buckets,
    by_reduction_group,
    norm_of,
    scale_to_norm_,
    sum_embedding_grads,
    sum_partial_grads_over_tp,
)
from lightning_mhc.distributed.layout import ParallelLayout
from lightning_mhc.distributed.placement import placement_of
from lightning_mhc.errors import ConfigError

OPTIMIZERS = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD, "adafactor": torch.optim.Adafactor}
"""The optimizers of :meth:`PipelinedLMModule.warmup_cosine_optimizer` (``optimizer=...``), kept here
(beside the check of which ones shard) so that validating a config does not import Lightning."""

ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
               torch.optim.RAdam, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.RMSprop,
               torch.optim.ASGD, torch.optim.Rprop)
"""Torch optimizers whose update of an element reads only that element's gradient and state."""


SHARDED = "the distributed optimizer cuts parameters into pieces"
BF16_WEIGHTS = "bf16 weights are stepped as flat fp32 main pieces"


def check_shardable(optimizer: torch.optim.Optimizer | type, switch: str = "use_distributed_optimizer=False",
                    why: str = SHARDED) -> None:
    """Refuse an optimizer (or optimizer class) whose update is not element-wise: it cannot run
    on flat pieces (it would run, as another optimizer: Adafactor unfactored). ``switch``: how the
    message says to avoid the pieces; ``why``: what cuts them (``SHARDED`` or ``BF16_WEIGHTS``)."""
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    if not issubclass(cls, ELEMENTWISE):
        names = ", ".join(c.__name__ for c in ELEMENTWISE)
        raise ConfigError(f"{why}, which only an element-wise update allows; {cls.__name__} is not one of {names}. "
                          f"Use one of them, or {switch}.")


MAIN_PARAM = "main_param"
"""The optimizer state under which the fp32 main weights of bf16 parameters are checkpointed."""


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, also: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the tensors in ``optimizer.state`` (AdamW: two moments and a step per tensor) and
    ``also``, each tensor counted once."""
    tensors = {id(v): v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)}
    tensors.update((id(t), t) for t in also)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def got_gradient(param: torch.nn.Parameter) -> bool:
    """Whether backward gave ``param`` a gradient since the last step (the accumulation hook marks
    it; its ``main_grad`` may be a view of zeros when another parameter of its bucket got one)."""
    return getattr(param, "main_grad_fresh", False)


def owned_pieces(numels: Sequence[int], parts: int, index: int) -> Iterable[tuple[int, slice, slice]]:
    """``(i, tensor i's flat range, that range's place in the shard)`` for each tensor of a bucket
    (their sizes ``numels``, concatenated, padded to a multiple of ``parts``) overlapping the
    ``index``-th of its ``parts`` equal ranges: the pieces a ZeRO-1 rank steps (the planner counts
    them too, AdamW keeping a step per piece)."""
    shard = -(-sum(numels) // parts)
    start, end, offset = index * shard, (index + 1) * shard, 0
    for i, numel in enumerate(numels):
        lo, hi = max(offset, start), min(offset + numel, end)
        if lo < hi:
            yield i, slice(lo - offset, hi - offset), slice(lo - start, hi - start)
        offset += numel


class ShardBucket:
    """Parameters of one dtype whose gradients accumulate in one fp32 buffer (each parameter's
    ``main_grad`` a view of its range), summed over ``group`` (the parameters' replicas) and
    reduce-scattered into ``parts`` ranges (``parts`` its size, this rank's the ``index``-th), or
    all-reduced in place when ``parts == 1``."""

    def __init__(self, params: list[torch.nn.Parameter], chunk: int, group, parts: int, index: int) -> None:
        self.params, self.chunk, self.group, self.parts, self.index = params, chunk, group, parts, index
        self.offsets = [0]
        for p in params:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.shard_numel = -(-self.offsets[-1] // parts)
        self.start = index * self.shard_numel
        self.buffer: torch.Tensor | None = None
        """The bucket's gradients in fp32, padded to a multiple of ``parts``: from the step's first
        gradient (:meth:`accumulate`) to the end of the step (:meth:`zero_grad`)."""
        for p in params:
            p.main_grad, p.main_grad_fresh = None, False
        self.grad: torch.Tensor | None = None
        """This rank's range of the DP-averaged gradient (fp32), once :meth:`complete` ran."""
        self.got_gradients: list[bool] = [False] * len(params)
        """Which parameters had a gradient on this rank when the bucket was reduced."""
        self.ready: set[int] = set()
        self.work = None

    def _allocate(self) -> None:
        """The zeroed buffer, and each parameter's ``main_grad`` a view of its range."""
        self.buffer = torch.zeros(self.shard_numel * self.parts, dtype=torch.float32, device=self.params[0].device)
        for p, offset in zip(self.params, self.offsets):
            p.main_grad = self.buffer[offset:offset + p.numel()].view_as(p)

    def accumulate(self, param: torch.nn.Parameter) -> None:
        """A post-accumulate hook: the gradient autograd just accumulated is added into the
        buffer (megatron's ``main_grad``), then dropped: the buffer is the only copy kept between
        backwards."""
        if self.buffer is None:
            self._allocate()
        param.main_grad.add_(param.grad)
        param.main_grad_fresh = True
        param.grad = None

    def pieces(self) -> Iterable[tuple[torch.nn.Parameter, slice, slice]]:
        """``(parameter, its flat range, that range's place in this rank's shard)`` for every
        parameter overlapping this rank's range."""
        for i, flat_range, shard_range in owned_pieces([p.numel() for p in self.params], self.parts, self.index):
            yield self.params[i], flat_range, shard_range

    def has_grads(self) -> bool:
        return True  # every rank reduces every bucket (zeros where a parameter got no gradient)

    def launch(self) -> None:
        group = self.group
        self.got_gradients = [got_gradient(p) for p in self.params]
        if self.buffer is None:  # no gradient on this rank: it still takes part, with zeros
            self._allocate()
        if self.parts > 1:  # into a range of its own (1/DP of the buffer): not every backend reduces in place
            self.grad = torch.empty(self.shard_numel, dtype=torch.float32, device=self.buffer.device)
            self.work = dist.reduce_scatter_tensor(self.grad, self.buffer, group=group, async_op=True)
        else:
            self.grad = self.buffer
            self.work = dist.all_reduce(self.buffer, group=group, async_op=True) if dist.get_world_size(group) > 1 \
                else None

    def complete(self, divisor: int) -> None:
        if self.work is not None:
            self.work.wait()
        if divisor > 1:
            self.grad /= divisor

    def reset(self) -> None:
        self.ready, self.work = set(), None

    def zero_grad(self) -> None:
        """After the step: the buffer freed (the next step's first gradient makes a new one)."""
        self.grad = self.buffer = None
        for p in self.params:
            p.grad, p.main_grad, p.main_grad_fresh = None, None, False

    def all_gather(self) -> None:
        """Every rank's updated range into every rank's parameters."""
        group = self.group
        if self.parts == 1:
            return
        group = self.group
        device, dtype = self.params[0].device, self.params[0].dtype
        own = torch.zeros(self.shard_numel, dtype=dtype, device=device)
        for p, flat_range, shard_range in self.pieces():
            own[shard_range].copy_(p.detach().reshape(-1)[flat_range])
        full = torch.empty(self.shard_numel * self.parts, dtype=dtype, device=device)
        dist.all_gather_into_tensor(full, own, group=group)
        with torch.no_grad():
            for p, offset in zip(self.params, self.offsets):
                p.view(-1).copy_(full[offset:offset + p.numel()])


@dataclass
class Piece:
    """This rank's range of one parameter: what the optimizer updates."""

    param: torch.nn.Parameter
    bucket: ShardBucket
    flat_range: slice
    """Its range in ``param.view(-1)``."""
    shard_range: slice
    """That range's place in the bucket's shard."""
    main: torch.Tensor
    """The fp32 weights the optimizer steps: a view of ``param`` when fp32, else a copy."""


class DistributedOptimizer:
    """Points ``optimizer`` (built by the user on the module's parameters) at this rank's fp32
    pieces, and runs the gradient reduction and the parameter gather around its step.

    Args:
        optimizer: a torch optimizer over parameters of ``chunks``, not stepped yet.
        chunks: this rank's model chunks (its stage, or the virtual-pipeline chunks).
        layout: the parallel layout.
        shard: cut each bucket over the ranks that hold its parameters (ZeRO-1: DP x CP); False:
            every rank holds all of it (fp32 main weights for a bf16 model, gradients all-reduced).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, chunks: Sequence[torch.nn.Module], layout: ParallelLayout,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, shard: bool = True) -> None:
        if shard:
            check_shardable(optimizer)
        else:
            check_shardable(optimizer, "precision='bf16-mixed' (fp32 weights)", BF16_WEIGHTS)
        if optimizer.state:
            raise ConfigError(f"{type(optimizer).__name__} has stepped already: the distributed optimizer takes it "
                              "over before the first step.")
        self.optimizer, self.layout = optimizer, layout
        trained = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]

        def place(group) -> tuple[int, int]:  # (parts, this rank's index) of a bucket reduced over group
            return (dist.get_world_size(group), dist.get_rank(group)) if shard else (1, 0)

        self.buckets = [
            ShardBucket(params, i, group, *place(group))
            for i, chunk in enumerate(chunks)
            for group, group_params in by_reduction_group(
                [p for p in reversed(list(chunk.parameters())) if p.requires_grad], layout)
            for params in buckets(group_params, bucket_bytes,
                                  alone=lambda p: placement_of(p).shared_embedding)
        ]
        self.pieces: dict[int, Piece] = {}
        """This rank's piece of each parameter it holds one of, by ``id(parameter)``."""
        for bucket in self.buckets:
            for p, flat_range, shard_range in bucket.pieces():
                view = p.detach().view(-1)[flat_range]
                main = view if p.dtype == torch.float32 else view.float()
                self.pieces[id(p)] = Piece(p, bucket, flat_range, shard_range, main)
        known = {id(p) for bucket in self.buckets for p in bucket.params}
        strangers = [p for p in trained if id(p) not in known]
        if strangers:
            raise ConfigError(f"the optimizer holds {len(strangers)} parameter(s) that are not the model's trainable "
                              "ones: build it on the set-up module's parameters.")
        # before the reduction's hooks (registered below), which may launch a bucket once its
        # parameters' gradients are in the buffer
        self._hooks = [p.register_post_accumulate_grad_hook(bucket.accumulate)
                       for bucket in self.buckets for p in bucket.params]
        for group in optimizer.param_groups:
            group["params"] = [self.pieces[id(p)].main for p in group["params"] if id(p) in self.pieces]
        self.reduction = OverlappedGradReduction(chunks, layout, bucket_list=self.buckets)
        self.overlapped_buckets = 0
        """Buckets whose reduce-scatter started during the last step's backward."""

    # ------------------------------------------------------------- gradients
    def reduce_gradients(self) -> None:
        """The DP average into this rank's pieces (finishing the overlapped reduction), then the
        TP sum of the pieces that saw part of the activations and the tied embedding's sum between
        stages (the same functions as without it, on the pieces' gradients)."""
        self._adopt_loaded_main_weights()
        self.overlapped_buckets = self.reduction.finish()
        for piece in self.pieces.values():
            piece.main.grad = piece.bucket.grad[piece.shard_range]
        sum_partial_grads_over_tp([(pc.param, pc.main.grad) for pc in self.pieces.values()], self.layout)
        shared = [pc.main.grad for pc in self.pieces.values() if placement_of(pc.param).shared_embedding]
        sum_embedding_grads(shared, self.layout)
        unused = self._without_gradients()
        for pc in self.pieces.values():
            if id(pc.param) in unused:  # as torch's optimizers skip a parameter whose .grad is None:
                pc.main.grad = None    # no weight decay, no momentum step, no state made for it

    def _without_gradients(self) -> set[int]:
        """The parameters no rank of their reduction group gave a gradient to in this step (one
        small all-reduce of the buckets' flags per group): reduced as zeros, but not to be stepped."""
        unused: set[int] = set()
        for expert in (False, True):  # the dense buckets' group, then the experts'
            chosen = [b for b in self.buckets if placement_of(b.params[0]).expert == expert]
            if not chosen:
                continue
            got = torch.tensor([g for bucket in chosen for g in bucket.got_gradients], dtype=torch.int32)
            group = chosen[0].group
            if dist.get_world_size(group) > 1:
                got = got.to(chosen[0].params[0].device)
                dist.all_reduce(got, op=dist.ReduceOp.MAX, group=group)
                got = got.cpu()
            params = [p for bucket in chosen for p in bucket.params]
            unused.update(id(p) for p, g in zip(params, got.tolist()) if not g)
        return unused

    def grad_norm(self) -> float:
        """The whole model's gradient L2 norm (each element counted once over TP, PP and DP)."""
        device = self.buckets[0].params[0].device if self.buckets else None
        # over the world (TP x PP x DP): the pieces of every DP rank make up the model once
        return norm_of([(pc.param, pc.main.grad) for pc in self.pieces.values() if pc.main.grad is not None],
                       self.layout, device=device)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Scale the gradients so the global norm is at most ``max_norm``; the norm before."""
        norm = self.grad_norm()
        scale_to_norm_([pc.main.grad for pc in self.pieces.values() if pc.main.grad is not None], max_norm, norm)
        return norm

    def drop_gradients(self) -> None:
        """Skip this step: the optimizer leaves pieces without gradients untouched."""
        for pc in self.pieces.values():
            pc.main.grad = None

    # ----------------------------------------------------------------- step
    def finish_step(self) -> None:
        """After ``optimizer.step()``: the pieces into the parameters, every bucket all-gathered
        over DP, the gradients cleared for the next step."""
        with torch.no_grad():
            for pc in self._copies():  # an fp32 piece is a view: updated in place
                pc.param.view(-1)[pc.flat_range].copy_(pc.main)
        self._keep_main_weights_in_state()
        for bucket in self.buckets:
            bucket.all_gather()
            bucket.zero_grad()
        for pc in self.pieces.values():
            pc.main.grad = None

    def state_bytes(self) -> int:
        """Bytes of this rank's optimizer state, fp32 main copies of bf16 weights included."""
        return optimizer_state_bytes(self.optimizer, (pc.main for pc in self._copies()))

    def _copies(self) -> list[Piece]:
        """The pieces whose fp32 main weights are a copy (of bf16 parameters)."""
        return [pc for pc in self.pieces.values() if pc.param.dtype != torch.float32]

    def load_main_weights(self) -> None:
        """The parameters (just loaded from a checkpoint) into the fp32 copies; a checkpoint that
        holds the main weights replaces them at the next step (:meth:`_adopt_loaded_main_weights`)."""
        with torch.no_grad():
            for pc in self._copies():
                pc.main.copy_(pc.param.detach().view(-1)[pc.flat_range])

    def _keep_main_weights_in_state(self) -> None:
        """The fp32 copies are optimizer state (checkpointed with it): the same tensors, no copy.
        Added after a step, so that the optimizer has initialised its own state first."""
        for pc in self._copies():
            state = self.optimizer.state.get(pc.main)
            if state is not None:
                state[MAIN_PARAM] = pc.main

    def _adopt_loaded_main_weights(self) -> None:
        """After ``optimizer.load_state_dict``, the state holds loaded main weights: into the copies."""
        with torch.no_grad():
            for pc in self._copies():
                state = self.optimizer.state.get(pc.main)
                loaded = state.get(MAIN_PARAM) if state is not None else None
                if loaded is not None and loaded is not pc.main:
                    pc.main.copy_(loaded)
                    state[MAIN_PARAM] = pc.main

    def remove(self) -> None:
        """The hooks and the fp32 gradient buffers go (training is over); the pieces stay, so
        that the optimizer's state can still be saved under its parameters' names."""
        self.reduction.remove()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for bucket in self.buckets:
            bucket.buffer = bucket.grad = None
            for p in bucket.params:
                for attribute in ("main_grad", "main_grad_fresh"):
                    if hasattr(p, attribute):
                        delattr(p, attribute)
