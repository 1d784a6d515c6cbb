""":class:`ParallelRuntime` (``strategy.runtime``): the parallel run behind either
``MHCParallelStrategy``, composed rather than inherited (as Lightning's own Trainer strategies reuse
Fabric's helpers): megatron-core's TP/PP/DP groups and the parallel randomizer, the data-parallel
split and its check on a loader, the 1F1B / interleaved schedule over a batch with the overlapped
DP reduction started in the last backward, gradient reduction, the distributed optimizer, the
reshardable checkpoint, and teardown.

Only the way a loop drives the runtime differs: the Trainer calls hooks (``lightning/strategy.py``),
a Fabric loop calls ``fabric.backward`` / ``strategy.forward_backward`` (``fabric/strategy.py``).
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import math
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.utils.data import DistributedSampler

from lightning_mhc import checkpoint as dist_checkpoint
from lightning_mhc.checkpoint.sharding import global_namer
from lightning_mhc.distributed.fail_fast import FailFast
from lightning_mhc.distributed.grad_overlap import OverlappedGradReduction
from lightning_mhc.distributed.grads import (check_placements, clip_grad_norm_, finalize_model_grads,
                                             global_grad_norm, gradient_divisor, has_replicas)
from lightning_mhc.distributed.layout import ParallelLayout, destroy_parallel
from lightning_mhc.distributed.optimizer import DistributedOptimizer, optimizer_state_bytes
from lightning_mhc.distributed.pipeline import ScheduleConfig, forward_backward_pipelining
from lightning_mhc.distributed.pipeline.protocol import (
    has_model_chunks,
    is_pipeline_module,
    split_microbatches,
)
from lightning_mhc.distributed.process_state import ProcessState
from lightning_mhc.distributed.random import model_parallel_manual_seed
from lightning_mhc.errors import ConfigError
from lightning_mhc.distributed.expert_parallel import set_aux_loss_scale, update_expert_biases
from lightning_mhc.recompute.memory import ActivationMemoryMeter
from lightning_mhc.strategies.settings import ParallelSettings

RENDEZVOUS_TIMEOUT = datetime.timedelta(minutes=5)


def destroy_default_group() -> None:
    """At exit, while the interpreter is still whole: destroy the process group this strategy made.

    Lightning leaves the default group alive after ``fit`` (so that ``save_checkpoint``, ``validate``
    … can follow). Left to interpreter finalization, gloo's worker threads may still hold tensors
    whose release needs the GIL, and the process dies with SIGABRT ("terminate called without an
    active exception") after a run that succeeded — seen on our 2-rank ``Trainer.fit``."""
    if dist.is_initialized():
        destroy_parallel()
        dist.destroy_process_group()


class ParallelRuntime:
    """The parallel run behind a strategy (``strategy.runtime``); see the module docstring."""

    def __init__(self, settings: ParallelSettings) -> None:
        self.settings = settings
        self.layout: ParallelLayout | None = None
        """The built layout (``settings.layout`` with this rank's place and process groups), once the
        processes have started."""
        self.device: torch.device | None = None
        """This process's device, once the processes have started."""
        self.backend: str | None = None
        """The process group backend (``settings.process_group_backend``, or the device's default)."""
        self.activation_bytes: int | None = None
        """With ``measure_activation_memory``: the peak activation bytes any stage retained in the
        first training step (max over ranks)."""
        self._grad_reductions: dict[int, OverlappedGradReduction] = {}
        """The overlapped DP reduction of each trained module (by ``id``)."""
        self._overlapped: set[int] = set()
        """Modules whose overlapped reduction started in this step's last backward."""
        self.fail_fast = FailFast()
        """Ends this rank within seconds when another rank's run raised while this one waits on it."""
        self.distributed_optimizer: DistributedOptimizer | None = None
        """What steps the module's optimizer with ``use_distributed_optimizer`` or bf16 weights."""
        self._distributed_module: int | None = None
        self.process_state = ProcessState()
        """What the run changes in its process outside itself (RNG, randomizer, registries, patched
        checkpoint functions), taken when the processes start and put back at teardown."""

    # ------------------------------------------------------------ processes
    def check_module(self, module: Any) -> None:
        """A module that cannot run on this layout is refused with what to change."""
        self._check_contract(module)
        self._check_chunks(module)
        self._check_context_parallel(module)

    def _check_context_parallel(self, module: Any) -> None:
        cp = self.settings.layout.context_parallel_size
        if module is not None and cp > 1 and not getattr(module, "supports_context_parallel", False):
            raise ConfigError(
                f"context_parallel_size={cp} splits each sequence over {cp} ranks, which the model must do "
                f"itself; {type(module).__name__} does not (MHCGPTModule and ParallelLMModule do): use "
                "context_parallel_size=1.")

    def _check_contract(self, module: Any) -> None:
        layout = self.settings.layout
        if module is not None and layout.model_parallel_size > 1 and not is_pipeline_module(module):
            raise ConfigError(
                f"{type(module).__name__} does not implement the pipeline contract (forward_step, "
                "loss_func, set_input_tensor, pipeline_tensor_shape; see MHCGPTModule), so it can only "
                f"run data parallel, but tensor_model_parallel_size={layout.tensor_model_parallel_size} "
                f"and pipeline_model_parallel_size={layout.pipeline_model_parallel_size}. Use "
                "MHCParallelStrategy() with TP = PP = 1, or subclass MHCGPTModule."
            )

    def _check_chunks(self, module: Any) -> None:
        vp = self.settings.layout.virtual_pipeline_model_parallel_size
        if module is not None and vp > 1 and not has_model_chunks(module):
            raise ConfigError(
                f"virtual_pipeline_model_parallel_size={vp} needs a module "
                f"with model_chunks() (see MHCGPTModule); {type(module).__name__} has none. Drop the virtual "
                "pipeline or implement the chunked contract (lightning_mhc/distributed/pipeline/protocol.py)."
            )

    def check_world(self, world_size: int) -> None:
        """The layout fits a world of ``world_size`` processes (before any process starts)."""
        self.settings.layout.with_world(world_size)

    def start(self, cluster_environment: Any, root_device: torch.device, module: Any = None) -> None:
        """In every process: the default process group, megatron's TP/PP/DP groups, the seeds
        (``module``, when known already, is checked against the layout first)."""
        s = self.settings
        self.check_module(module)  # (the world: checked at launch, check_world, and by the layout's build)
        self.device = root_device
        self.backend = s.process_group_backend or _get_default_process_group_backend_for_device(root_device)
        if not dist.is_initialized():
            # the rendezvous waits for every rank to start (imports, an oversubscribed CPU): not
            # bounded by the collective timeout; the TP/PP/DP groups below get that one
            kwargs: dict[str, Any] = {"timeout": max(s.timeout, RENDEZVOUS_TIMEOUT)}
            if root_device.type != "cpu":
                kwargs["device_id"] = root_device
            _init_dist_connection(cluster_environment, self.backend, **kwargs)
            atexit.register(destroy_default_group)
        layout = self.layout = s.layout.build(s.timeout)
        model_parallel_manual_seed(s.seed, layout)
        self.fail_fast.start(f"rank {dist.get_rank()} ({layout.place()})")

    def remove_gradient_hooks(self) -> None:
        for reduction in self._grad_reductions.values():
            reduction.remove()
        self._grad_reductions.clear()
        self._overlapped.clear()
        if self.distributed_optimizer is not None:  # kept: its pieces name the optimizer's state for a save
            self.distributed_optimizer.remove()

    def stop(self) -> None:
        """Tear the groups and the parallel randomizer down (``layout`` stays readable: degrees and
        ranks; its groups are gone)."""
        destroy_parallel()

    # ------------------------------------------------------------------ data
    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Distinct data per DP rank; TP, CP and PP peers of one DP rank see the same batches (each
        CP rank keeps its part of every sequence: the module shards the batch)."""
        if self.layout is None:
            raise RuntimeError("the data-parallel split is known once the processes have started "
                               "(Trainer.fit / Fabric.launch)")
        return dict(num_replicas=self.layout.data_parallel_size, rank=self.layout.data_parallel_rank)

    def check_data_parallel_sampler(self, dataloader: object, warn_unsplit: bool, fix: str) -> None:
        """A loader's ``DistributedSampler`` must split by DP rank (``fix``: how to build it right);
        with ``warn_unsplit``, a loader without one warns when DP > 1."""
        assert self.layout is not None
        dp, dp_rank = self.layout.data_parallel_size, self.layout.data_parallel_rank
        batch_sampler = getattr(dataloader, "batch_sampler", None)
        samplers = [getattr(dataloader, "sampler", None), getattr(batch_sampler, "sampler", None), batch_sampler]
        distributed = [s for s in samplers if isinstance(s, DistributedSampler)]
        for sampler in distributed:
            if (sampler.num_replicas, sampler.rank) != (dp, dp_rank):
                raise ConfigError(
                    f"the DataLoader's DistributedSampler has num_replicas={sampler.num_replicas}, "
                    f"rank={sampler.rank}, but this process is data-parallel rank {dp_rank} of {dp} (TP, CP and "
                    f"PP peers of a data-parallel rank must read the same samples). {fix}"
                )
        if not distributed and dp > 1 and warn_unsplit:
            rank_zero_warn(
                f"the DataLoader has no DistributedSampler although data-parallel size is {dp}: "
                "unless its dataset shards itself by strategy.distributed_sampler_kwargs, every "
                "data-parallel rank reads the same samples."
            )

    # --------------------------------------------------------------- schedule
    def run_schedule(self, module: Any, batch: Any, forward_only: bool, accumulate: int, where: str,
                      raise_on_nonfinite: bool | None = None, reduce_this_step: bool = True) -> Tensor:
        """The schedule over the microbatches of ``batch`` on this rank's stage: the mean loss
        over the microbatches and the DP replicas (the same detached scalar on every rank); with
        ``forward_only=False`` the gradients are accumulated (divided by ``accumulate``) and a
        NaN/inf loss raises or warns (``raise_on_nonfinite``, default ``raise_on_nonfinite_loss``;
        ``where`` names the step in the message).
        ``reduce_this_step=False``: the gradients are not final after this call (accumulation),
        so no overlapped reduction starts."""
        m = self.settings.microbatches
        microbatches = split_microbatches(batch, m)
        loss_func: Callable = module.loss_func
        if accumulate > 1:
            loss_func = lambda output, mb: module.loss_func(output, mb) / accumulate  # noqa: E731
        forward_only = forward_only or not torch.is_grad_enabled()
        if not forward_only:
            # the MoE layers' auxiliary losses get the main loss's factor: 1/m per microbatch,
            # 1/accumulate, and the DP average of the gradients undone (each rank's share is part
            # of one sum over the ranks), so that their total is one process's (MoEAuxLossAutoScaler)
            set_aux_loss_scale(module, gradient_divisor(self.layout) / (len(microbatches) * accumulate))
        measure = self.settings.measure_activation_memory and not forward_only and self.activation_bytes is None
        meter = ActivationMemoryMeter(module) if measure else None
        peak = 0

        def probe(held):
            nonlocal peak
            peak = max(peak, meter.live_bytes(extra=held))

        config = ScheduleConfig(
            layout=self.layout,
            tensor_shape=module.pipeline_tensor_shape(microbatches[0]),  # refuses a bad batch on every rank
            dtype=pipeline_dtype(module),
            forward_only=forward_only,
            deallocate_pipeline_outputs=self.settings.deallocate_pipeline_outputs,
            timeout=self.settings.timeout,
            probe=probe if measure else None,
            on_last_backward=self._overlap(module, forward_only or not reduce_this_step, accumulate),
        )
        with meter if measure else contextlib.nullcontext(), self.fail_fast.waiting():
            result = forward_backward_pipelining(module, microbatches, lambda mod, mb: mod.forward_step(mb), loss_func,
                                                 config)
        if measure:
            self.activation_bytes = int(self.max_over_ranks(peak, self.device))
        loss = result.loss * accumulate
        if not forward_only:
            self._check_finite(loss, where, raise_on_nonfinite)
        return loss

    def _overlap(self, module: Any, forward_only: bool, accumulate: int):
        """The schedule's hook that starts the overlapped DP reduction, or None (see
        ``overlap_grad_reduce``)."""
        if forward_only or accumulate > 1 or not self.settings.overlap_grad_reduce or not has_replicas(self.layout):
            return None
        if self.takes_over(module):
            return self.distributed_optimizer.reduction.start
        reduction = self._grad_reductions.get(id(module))
        if reduction is None:
            chunks = module.model_chunks() if has_model_chunks(module) else [module]
            reduction = self._grad_reductions[id(module)] = OverlappedGradReduction(
                chunks, self.layout, self.settings.gradient_bucket_bytes)
        self._overlapped.add(id(module))
        return reduction.start

    def _check_finite(self, loss: Tensor, where: str, raise_: bool | None = None) -> None:
        if math.isfinite(loss.item()):
            return
        message = f"non-finite training loss {loss.item()} at {where}"
        if self.settings.raise_on_nonfinite_loss if raise_ is None else raise_:
            raise FloatingPointError(message + " (raise_on_nonfinite_loss is on, or the Trainer's detect_anomaly)")
        rank_zero_warn(message)

    # -------------------------------------------------------------- gradients
    def take_over_optimizers(self, module: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
        """With ``use_distributed_optimizer``, or when ``module`` holds bf16 weights (stepped as
        fp32 main weights): the :class:`DistributedOptimizer` takes ``module``'s optimizer over."""
        low_precision = any(p.dtype != torch.float32 for p in module.parameters() if p.is_floating_point())
        if not (self.settings.use_distributed_optimizer or low_precision):
            return
        if len(optimizers) != 1:
            what = ("use_distributed_optimizer=True" if self.settings.use_distributed_optimizer
                    else "bf16 weights (stepped on fp32 main weights)")
            raise ConfigError(f"{what} takes one optimizer per module; configure_optimizers returned {len(optimizers)}.")
        if self.distributed_optimizer is not None:
            self.distributed_optimizer.remove()
        chunks = module.model_chunks() if has_model_chunks(module) else [module]
        optimizer = unwrap_optimizer(optimizers[0])
        self.distributed_optimizer = DistributedOptimizer(
            optimizer, chunks, self.layout, self.settings.gradient_bucket_bytes,
            shard=self.settings.use_distributed_optimizer)
        self._distributed_module = id(module)

    def check_parameters(self, module: torch.nn.Module) -> None:
        """At fit start: every trainable parameter's gradient reduction is known
        (``grads.check_placements``), named as the checkpoint names it."""
        name_of = getattr(module, "global_parameter_name", None)
        check_placements(((name_of(n) if callable(name_of) else n, p) for n, p in module.named_parameters()),
                         self.layout)

    def takes_over(self, module: torch.nn.Module) -> bool:
        """Whether the distributed optimizer steps ``module`` (and reduces its gradients)."""
        return self._distributed_module == id(module)

    def optimizer_pieces(self, optimizer: Any) -> list[tuple[Tensor, Tensor, slice]]:
        """``(piece, parameter, flat range)`` of what the distributed optimizer steps in place of
        ``optimizer``'s parameters (none for another optimizer): for the checkpoint."""
        taken = self.distributed_optimizer
        if taken is None or unwrap_optimizer(optimizer) is not taken.optimizer:
            return []
        return [(pc.main, pc.param, pc.flat_range) for pc in taken.pieces.values()]

    def grad_norm(self, module: torch.nn.Module, max_norm: float | None = None) -> float:
        """The global gradient norm of ``module`` (before clipping to ``max_norm`` when given)."""
        with self.fail_fast.waiting():
            if self.takes_over(module):
                taken = self.distributed_optimizer
                return taken.clip_grad_norm(max_norm) if max_norm else taken.grad_norm()
            params = with_grads(module.parameters())
            return clip_grad_norm_(params, max_norm, self.layout) if max_norm else global_grad_norm(params, self.layout)

    def drop_gradients(self, module: torch.nn.Module) -> None:
        """Skip this step's update: no gradients, which the optimizer reads as nothing to do."""
        if self.takes_over(module):
            self.distributed_optimizer.drop_gradients()
        for p in module.parameters():
            p.grad = None

    def optimizer_state_bytes(self, optimizers: Iterable[torch.optim.Optimizer]) -> int:
        """Bytes of optimizer state this rank holds (the distributed optimizer's: its pieces' and
        their fp32 main weights)."""
        taken = self.distributed_optimizer
        return sum(taken.state_bytes() if taken is not None and unwrap_optimizer(o) is taken.optimizer
                   else optimizer_state_bytes(unwrap_optimizer(o)) for o in optimizers)

    def model_loaded(self, module: torch.nn.Module) -> None:
        """``module``'s weights were just loaded: the fp32 main weights of bf16 ones follow."""
        if self.takes_over(module):
            self.distributed_optimizer.load_main_weights()

    def finish_step(self) -> None:
        """After an optimizer step: the distributed optimizer's all-gather of the updated weights."""
        if self.distributed_optimizer is not None:
            with self.fail_fast.waiting():
                self.distributed_optimizer.finish_step()

    def reduce_gradients(self, module: torch.nn.Module) -> None:
        """DP average (finishing the overlapped reduction when one ran), SP parameters summed
        over TP, the tied embedding reduced between the first and last stage; then the MoE
        layers' expert bias updated from the step's token counts (once per optimizer step, as
        megatron's ``finalize_model_grads`` does)."""
        with self.fail_fast.waiting():
            if self.takes_over(module):
                self.distributed_optimizer.reduce_gradients()
            else:
                overlapped = self._grad_reductions[id(module)] if id(module) in self._overlapped else None
                self._overlapped.discard(id(module))
                finalize_model_grads(module, self.layout, self.settings.gradient_bucket_bytes, overlapped=overlapped)
            update_expert_biases(module)

    # ------------------------------------------------------------ checkpoints
    def model_state(self, module: torch.nn.Module) -> dict[str, Any]:
        """This rank's pieces of the whole model's tensors, by global name (views: no copy)."""
        return dist_checkpoint.model_state(module, self.layout)

    def optimizer_state(self, optimizer: torch.optim.Optimizer, module: torch.nn.Module) -> dict[str, Any]:
        """The optimizer's per-parameter states as pieces of the whole model's (AdamW's moments are
        resharded like their parameters; under ZeRO-1 this rank's shard), and its param-group settings."""
        return dist_checkpoint.optimizer_state(optimizer, module, self.layout, self.optimizer_pieces(optimizer))

    def save(self, checkpoint: dict[str, Any], path: Path, module: torch.nn.Module, global_rank: int) -> None:
        """Every rank: write ``checkpoint`` (``state_dict`` / ``optimizer_states`` as pieces, see
        ``lightning_mhc.checkpoint.format``) crash-safely into the directory ``path``."""
        _, global_names = global_namer(module, self.layout)
        dist_checkpoint.save(checkpoint, Path(path), self.layout, global_rank, global_names=global_names)

    def load(self, path: Any, module: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
             global_rank: int) -> dict[str, Any]:
        """Every rank: read a checkpoint saved on any layout for this rank's ``module`` and
        ``optimizers`` (``state_dict`` in local names, ``optimizer_states`` in torch's form)."""
        path = Path(broadcast_object(str(path)))
        pieces = [piece for optimizer in optimizers if optimizer is not None for piece in self.optimizer_pieces(optimizer)]
        return dist_checkpoint.load(path, module, optimizers, self.layout, global_rank, pieces)


    def max_over_ranks(self, value: float, device: torch.device) -> float:
        tensor = torch.tensor(float(value), dtype=torch.float64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor.item()


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside Lightning's ``LightningOptimizer`` (or the optimizer itself)."""
    return getattr(optimizer, "_optimizer", optimizer)


def pipeline_dtype(module: torch.nn.Module) -> torch.dtype:
    """What crosses stages: the parameters' dtype (megatron's ``pipeline_dtype`` is its
    ``params_dtype``): fp32 for fp32 and mixed precision, bf16 for ``bf16-true``."""
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)


NO_GRADIENT_SCALER = ("the pipeline schedule runs its own backward without a gradient scaler: use "
                      "precision='bf16-mixed', 'bf16-true' or '32-true', not '16-mixed'.")


def refuse_gradient_scaler(precision_plugin: Any) -> None:
    """The pipeline schedule runs its own backward, without a precision plugin's gradient scaler:
    ``16-mixed`` on CUDA (which scales) would step on gradients the scaler never multiplied."""
    if getattr(precision_plugin, "scaler", None) is not None:
        raise ConfigError(NO_GRADIENT_SCALER)


def with_grads(parameters: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    return [p for p in parameters if p.grad is not None]


def sync_replicas(module: torch.nn.Module) -> None:
    """A plain module is initialised by each process: start every replica from rank 0's."""
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(tensor.data, src=0)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src)
    return box[0]


