"""``MHCParallelStrategy``: 3D parallelism (TP/PP/DP) for Lightning, on CPU (gloo) and GPU (NCCL).

    Trainer(strategy=MHCParallelStrategy(tensor_model_parallel_size=2,
                                         pipeline_model_parallel_size=2),
            callbacks=[MHCRecomputeCallback("mhc_block")], devices=4)

- launches with Lightning's subprocess launcher (``devices=N``), or joins
  processes started by torchrun / SLURM;
- ``setup_environment`` creates the default process group, then megatron-core's
  TP/PP/DP groups, and seeds the parallel randomizer;
- a module implementing the pipeline contract (``contract.py``) runs the whole
  1F1B schedule inside its ``training_step`` through :meth:`forward_backward`;
  Lightning's backward and zero_grad are then skipped (gradients are zeroed
  after each optimizer step); any other module trains as data parallel;
- gradients are averaged over DP (bucket by bucket during the last backward when
  ``overlap_grad_reduce``, else after it), summed over TP for sequence-parallel
  parameters, and the tied embedding reduced across stages; ``gradient_clip_val``
  clips by the global norm;
- checkpoints are reshardable ``torch.distributed.checkpoint`` directories keyed by global
  parameter names (``lightning_mhc.checkpoint``): save on one layout, resume on any other.
"""
from __future__ import annotations

import contextlib
import datetime
import math
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from torch import Tensor
from torch.utils.data import DistributedSampler

from lightning_mhc.errors import ConfigError
from lightning_mhc import checkpoint as dist_checkpoint
from lightning_mhc.checkpoint.sharding import global_namer
from lightning_mhc.lightning.contract import ModuleChunk, has_model_chunks, is_pipeline_module, split_microbatches
from lightning_mhc.lightning.launcher import MHCSubprocessLauncher, watch_launcher
from lightning_mhc.lightning.preemption import PreemptionSignalConnector, PreemptionState, agree_to_stop, stop_preempted
from lightning_mhc.lightning.resumable_loader import ResumableLoader
from lightning_mhc.parallel.grad_overlap import OverlappedGradReduction
from lightning_mhc.parallel.grads import clip_grad_norm_, finalize_model_grads, global_grad_norm
from lightning_mhc.parallel.random import clear_parallel_seed, model_parallel_manual_seed
from lightning_mhc.parallel.schedule import forward_backward_pipelining
from lightning_mhc.parallel.state import ParallelLayout, check_layout, destroy_parallel, initialize_parallel
from lightning_mhc.recompute.memory import ActivationMemoryMeter


RENDEZVOUS_TIMEOUT = datetime.timedelta(minutes=5)


class MHCParallelStrategy(ParallelStrategy):
    """Tensor, pipeline and data parallelism with megatron-core process groups.

    Args:
        tensor_model_parallel_size: TP size.
        pipeline_model_parallel_size: PP size; DP is ``world_size / (TP * PP)``.
        sequence_parallel: with TP > 1, run the residual stream, norms, hyper-connections and
            bias-dropout-add on ``s / TP`` tokens per TP rank (the stream-shaped activations
            divide by TP); the sequence length must divide by TP.
        virtual_pipeline_model_parallel_size: ``v`` model chunks per pipeline stage, run by the
            interleaved 1F1B schedule (bubble ``(p - 1) / (v m)`` instead of ``(p - 1) / m``); needs
            PP >= 2, layers divisible by ``PP * v`` and a number of microbatches that is a multiple
            of PP (megatron's rule). The module implements ``model_chunks`` (``MHCGPTModule`` does).
        num_microbatches: microbatches per training step of a pipelined module
            (default: the PP size); the per-rank batch must divide by it.
        deallocate_pipeline_outputs: shrink sent stage outputs to one element (seed 004).
        process_group_backend: ``"gloo"`` or ``"nccl"``; default by device.
        timeout: deadline of every collective and point-to-point wait.
        seed: base seed of the parallel randomizer (dropout streams per dimension).
        gradient_bucket_bytes: size of a DP all-reduce bucket.
        overlap_grad_reduce: with DP > 1, start each bucket's DP all-reduce during the last
            microbatch's backward, as soon as its gradients are final (megatron's
            ``overlap_grad_reduce``; the same numbers as reducing after backward). Pipelined
            modules without gradient accumulation; otherwise the reduction follows backward.
        raise_on_nonfinite_loss: stop at a NaN/inf loss or gradient norm with ``FloatingPointError``
            naming the step (the default; also when ``Trainer(detect_anomaly=True)``); False: warn and
            skip that optimizer step, so the weights (and checkpoints) never become NaN.
        save_on_preemption: on SIGTERM / SIGINT, all ranks stop at the next step boundary and save
            a step checkpoint there before leaving with 128 + signal (``preemption.py``).
        preemption_grace_s: a rank that has not stopped this long after the signal exits anyway.
        measure_activation_memory: on the first training step, record the peak activation
            bytes any stage retains (saved tensors plus the schedule's in-flight tensors) in
            ``activation_bytes`` (max over ranks).
    """

    strategy_name = "mhc_parallel"

    def __init__(
        self,
        tensor_model_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
        sequence_parallel: bool = False,
        virtual_pipeline_model_parallel_size: int | None = None,
        num_microbatches: int | None = None,
        deallocate_pipeline_outputs: bool = True,
        process_group_backend: str | None = None,
        timeout: datetime.timedelta = datetime.timedelta(minutes=10),
        seed: int = 1234,
        gradient_bucket_bytes: int = 25 * 2**20,
        overlap_grad_reduce: bool = True,
        raise_on_nonfinite_loss: bool = True,
        save_on_preemption: bool = True,
        preemption_grace_s: float = 25.0,
        measure_activation_memory: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        for name, value in (("tensor_model_parallel_size", tensor_model_parallel_size),
                            ("pipeline_model_parallel_size", pipeline_model_parallel_size)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r}: must be a positive integer.")
        if num_microbatches is not None and num_microbatches < 1:
            raise ConfigError(f"num_microbatches={num_microbatches}: must be at least 1 (or None for the PP size).")
        self.tensor_model_parallel_size = tensor_model_parallel_size
        self.pipeline_model_parallel_size = pipeline_model_parallel_size
        self.sequence_parallel = bool(sequence_parallel)
        vp = virtual_pipeline_model_parallel_size
        if vp is not None and (isinstance(vp, bool) or not isinstance(vp, int) or vp < 1):
            raise ConfigError(f"virtual_pipeline_model_parallel_size={vp!r}: must be a positive integer (or None).")
        self.virtual_pipeline_model_parallel_size = vp if vp and vp > 1 else None
        self._num_microbatches = num_microbatches
        self.deallocate_pipeline_outputs = deallocate_pipeline_outputs
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self.seed = seed
        self.gradient_bucket_bytes = gradient_bucket_bytes
        self.overlap_grad_reduce = overlap_grad_reduce
        self._grad_reduction: OverlappedGradReduction | None = None
        self._overlapped_this_step = False
        self.raise_on_nonfinite_loss = raise_on_nonfinite_loss
        self.save_on_preemption = save_on_preemption
        self.preemption = PreemptionState(preemption_grace_s)
        self.measure_activation_memory = measure_activation_memory
        self.activation_bytes: int | None = None
        self.num_nodes = 1
        self.layout: ParallelLayout | None = None
        self.last_grad_norm: float | None = None
        self.last_step_end: float | None = None
        """``time.perf_counter()`` when the last optimizer step (gradient reduction included) ended."""

    # ------------------------------------------------------------ registry
    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="Tensor/pipeline/data parallelism for mHC transformers"
        )

    # ----------------------------------------------------------- topology
    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def num_microbatches(self) -> int:
        return self._num_microbatches or self.pipeline_model_parallel_size

    @property
    def is_distributed(self) -> bool:
        """Tells Lightning to insert a ``DistributedSampler`` built from
        :attr:`distributed_sampler_kwargs` (also with one DP rank: its shuffle is seeded per
        epoch, which exact resume relies on)."""
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Distinct data per DP rank; TP and PP peers of one DP rank see the same batches."""
        assert self.layout is not None
        return dict(num_replicas=self.layout.data_parallel_size, rank=self.layout.data_parallel_rank)

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the stage is built in configure_model before its shard is loaded

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = MHCSubprocessLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        module = self.lightning_module
        model_parallel = self.tensor_model_parallel_size * self.pipeline_model_parallel_size > 1
        if module is not None and model_parallel and not is_pipeline_module(module):
            raise ConfigError(
                f"{type(module).__name__} does not implement the pipeline contract (forward_step, "
                "loss_func, set_input_tensor, pipeline_tensor_shape; see MHCGPTModule), so it can only "
                f"run data parallel, but tensor_model_parallel_size={self.tensor_model_parallel_size} "
                f"and pipeline_model_parallel_size={self.pipeline_model_parallel_size}. Use "
                "MHCParallelStrategy() with TP = PP = 1, or subclass MHCGPTModule."
            )
        check_layout(self.world_size, self.tensor_model_parallel_size, self.pipeline_model_parallel_size,
                     self.virtual_pipeline_model_parallel_size, self.sequence_parallel)
        if self.virtual_pipeline_model_parallel_size and module is not None and not has_model_chunks(module):
            raise ConfigError(
                f"virtual_pipeline_model_parallel_size={self.virtual_pipeline_model_parallel_size} needs a module "
                f"with model_chunks() (see MHCGPTModule); {type(module).__name__} has none. Drop the virtual "
                "pipeline or implement the chunked contract (lightning_mhc/lightning/contract.py)."
            )
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        watch_launcher()
        if not dist.is_initialized():
            # the rendezvous waits for every rank to start (imports, an oversubscribed CPU): not
            # bounded by the collective timeout; the TP/PP/DP groups below get that one
            kwargs: dict[str, Any] = {"timeout": max(self._timeout, RENDEZVOUS_TIMEOUT)}
            if self.root_device.type != "cpu":
                kwargs["device_id"] = self.root_device
            _init_dist_connection(self.cluster_environment, backend, **kwargs)
        self.layout = initialize_parallel(
            self.tensor_model_parallel_size, self.pipeline_model_parallel_size, timeout=self._timeout,
            sequence_parallel=self.sequence_parallel,
            virtual_pipeline_model_parallel_size=self.virtual_pipeline_model_parallel_size,
        )
        model_parallel_manual_seed(self.seed, self.layout)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        # registered by the Trainer right after this: handlers that record signals, no collective
        trainer._signal_connector = PreemptionSignalConnector(trainer, self.preemption)
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        pipelined = is_pipeline_module(self.lightning_module)
        if not pipelined:
            self._sync_replicas()
        if trainer.state.fn == TrainerFn.FITTING:
            if pipelined:
                self._skip_lightning_backward(trainer)
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    @staticmethod
    def _skip_lightning_backward(trainer: pl.Trainer) -> None:
        """The schedule runs every backward inside training_step; Lightning must neither
        zero the gradients between training_step and backward nor run a backward itself.
        Gradients are zeroed after each optimizer step instead (``optimizer_step``)."""
        automatic = trainer.fit_loop.epoch_loop.automatic_optimization
        if not hasattr(automatic, "_skip_backward"):
            raise RuntimeError(
                "this Lightning version's automatic optimization has no _skip_backward switch; "
                "MHCParallelStrategy needs lightning 2.x (tested with 2.6)."
            )
        if not trainer.lightning_module.automatic_optimization:
            raise ConfigError(
                "a pipelined module must use automatic optimization (automatic_optimization=True): "
                "the strategy runs the backward inside training_step and steps the optimizer."
            )
        automatic._skip_backward = True

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def _sync_replicas(self) -> None:
        """A plain module is initialised by each process: start every replica from rank 0's."""
        with torch.no_grad():
            for tensor in list(self.model.parameters()) + list(self.model.buffers()):
                dist.broadcast(tensor.data, src=0)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """The step boundary where all ranks agree on a preemption signal (one all-reduce)."""
        if agree_to_stop(self.preemption, self.root_device):
            stop_preempted(self.lightning_module.trainer, self.preemption, self.save_on_preemption)

    # --------------------------------------------------------------- data
    def process_dataloader(self, dataloader: object) -> object:
        """Check the data-parallel split of a loader; make a training loader resumable mid-epoch."""
        self._check_data_parallel_sampler(dataloader)
        trainer = self.lightning_module.trainer
        if trainer.training and not isinstance(dataloader, _Stateful):
            return ResumableLoader(
                dataloader,
                lambda: (trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_progress.current.completed),
                self.layout.data_parallel_size,
            )
        return dataloader

    def _check_data_parallel_sampler(self, dataloader: object) -> None:
        assert self.layout is not None
        dp, dp_rank = self.layout.data_parallel_size, self.layout.data_parallel_rank
        batch_sampler = getattr(dataloader, "batch_sampler", None)
        samplers = [getattr(dataloader, "sampler", None), getattr(batch_sampler, "sampler", None), batch_sampler]
        distributed = [s for s in samplers if isinstance(s, DistributedSampler)]
        for sampler in distributed:
            if (sampler.num_replicas, sampler.rank) != (dp, dp_rank):
                raise ConfigError(
                    f"the DataLoader's DistributedSampler has num_replicas={sampler.num_replicas}, "
                    f"rank={sampler.rank}, but this process is data-parallel rank {dp_rank} of {dp} (TP and PP "
                    "peers of a data-parallel rank must read the same samples). Leave the sampler to Lightning "
                    "(use_distributed_sampler=True, the default) or build it with "
                    "**trainer.strategy.distributed_sampler_kwargs."
                )
        if not distributed and dp > 1 and self.lightning_module.trainer.training:
            rank_zero_warn(
                f"the training DataLoader has no DistributedSampler although data-parallel size is {dp}: "
                "unless its dataset shards itself by trainer.strategy.distributed_sampler_kwargs, every "
                "data-parallel rank trains on the same samples."
            )

    # ------------------------------------------------------- collectives
    def barrier(self, name: str | None = None) -> None:
        if dist.is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Mean (or sum) over the data-parallel group: the ranks that hold different data."""
        if not isinstance(tensor, Tensor) or not dist.is_initialized():
            return tensor
        group = group or self.layout.dp_group
        tensor = tensor.detach().clone().float()
        dist.all_reduce(tensor, group=group)
        if reduce_op in ("mean", "avg", None) or str(reduce_op).lower().endswith("avg"):
            tensor /= dist.get_world_size(group)
        return tensor

    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, tensor.contiguous(), group=group)
        return torch.stack(gathered)

    # ------------------------------------------------------------ training
    def forward_backward(self, module: pl.LightningModule, batch: Any, forward_only: bool = False) -> Tensor:
        """Run the schedule over the microbatches of ``batch`` on this rank's stage.

        Returns the mean loss over the microbatches and the DP replicas (the same
        scalar on every rank, detached). With ``forward_only=False`` the gradients
        are accumulated and Lightning's own backward is skipped for this step.
        """
        m = self.num_microbatches
        microbatches = split_microbatches(batch, m)
        accumulate = module.trainer.accumulate_grad_batches if not forward_only else 1
        loss_func: Callable = module.loss_func
        if accumulate > 1:
            loss_func = lambda output, mb: module.loss_func(output, mb) / accumulate  # noqa: E731
        forward_only = forward_only or not torch.is_grad_enabled()
        measure = self.measure_activation_memory and not forward_only and self.activation_bytes is None
        meter = ActivationMemoryMeter(module) if measure else None
        peak = 0

        def probe(held):
            nonlocal peak
            peak = max(peak, meter.live_bytes(extra=held))

        with meter if measure else contextlib.nullcontext():
            chunked = self.layout.virtual_pipeline_model_parallel_size > 1
            result = forward_backward_pipelining(
                [ModuleChunk(module, i) for i in range(len(module.model_chunks()))] if chunked else module,
                microbatches,
                lambda mod, mb: mod.forward_step(mb),
                loss_func,
                layout=self.layout,
                tensor_shape=module.pipeline_tensor_shape(microbatches[0]),
                deallocate_pipeline_outputs=self.deallocate_pipeline_outputs,
                forward_only=forward_only,
                timeout=self._timeout,
                probe=probe if measure else None,
                on_last_backward=self._overlap(module, forward_only, accumulate),
            )
        if measure:
            self.activation_bytes = int(self._max_over_ranks(peak))
        loss = result.loss * accumulate
        if not forward_only:
            self._check_finite(loss, module)
        return loss

    def _overlap(self, module: pl.LightningModule, forward_only: bool, accumulate: int):
        """The schedule's hook that starts the overlapped DP reduction, or None (see
        ``overlap_grad_reduce``)."""
        if forward_only or accumulate > 1 or not self.overlap_grad_reduce or self.layout.data_parallel_size == 1:
            return None
        if self._grad_reduction is None:
            chunks = module.model_chunks() if has_model_chunks(module) else [module]
            self._grad_reduction = OverlappedGradReduction(chunks, self.layout, self.gradient_bucket_bytes)
        self._overlapped_this_step = True
        return self._grad_reduction.start

    def _max_over_ranks(self, value: float) -> float:
        tensor = torch.tensor(float(value), dtype=torch.float64, device=self.root_device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor.item()

    def _check_finite(self, loss: Tensor, module: pl.LightningModule) -> None:
        if math.isfinite(loss.item()):
            return
        message = f"non-finite training loss {loss.item()} at global step {module.trainer.global_step}"
        if self._raise_on_nonfinite(module.trainer):
            raise FloatingPointError(message + " (raise_on_nonfinite_loss / detect_anomaly is on)")
        rank_zero_warn(message)

    def _raise_on_nonfinite(self, trainer: pl.Trainer) -> bool:
        return self.raise_on_nonfinite_loss or getattr(trainer, "_detect_anomaly", False)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        def closure_then_reduce():
            result = closure()
            self._finalize_gradients()
            return result

        output = super().optimizer_step(optimizer, closure_then_reduce, model, **kwargs)
        if is_pipeline_module(self.lightning_module):
            optimizer.zero_grad(set_to_none=True)  # Lightning's zero_grad is skipped for pipelined modules
        self.last_step_end = time.perf_counter()
        return output

    def _finalize_gradients(self) -> None:
        """DP average + tied-embedding reduction; global-norm clipping (Lightning's own clipping
        that follows sees a local norm no larger than the clipped global one and does nothing)."""
        module = self.lightning_module
        overlapped = self._grad_reduction if self._overlapped_this_step else None
        self._overlapped_this_step = False
        finalize_model_grads(module, self.layout, self.gradient_bucket_bytes, overlapped=overlapped)
        params = [p for p in module.parameters() if p.grad is not None]
        trainer = module.trainer
        clip = trainer.gradient_clip_val
        if clip is not None and clip > 0:
            if trainer.gradient_clip_algorithm not in (None, "norm"):
                raise ConfigError(
                    f"gradient_clip_algorithm={trainer.gradient_clip_algorithm!r} is not supported by "
                    "MHCParallelStrategy: it clips by the global norm. Use gradient_clip_algorithm='norm'."
                )
            self.last_grad_norm = clip_grad_norm_(params, clip, self.layout)
        else:
            self.last_grad_norm = global_grad_norm(params, self.layout)
        if not math.isfinite(self.last_grad_norm):  # the same global norm on every rank: all stop or skip
            message = (f"non-finite gradient norm {self.last_grad_norm} at global step {trainer.global_step} "
                       "(a NaN/inf loss or gradient)")
            if self._raise_on_nonfinite(trainer):
                raise FloatingPointError(message + "; raise_on_nonfinite_loss=False only warns and skips the step")
            rank_zero_warn(message + ": optimizer step skipped")
            for p in params:
                p.grad = None  # the optimizer leaves parameters without gradients untouched

    # ---------------------------------------------------------- checkpoints
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's pieces of the whole model's tensors, by global name (views: no copy)."""
        return dist_checkpoint.model_state(self.lightning_module, self.layout)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer's per-parameter states as pieces of the whole model's (AdamW's moments
        are resharded like their parameters), and its param-group settings."""
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # Lightning's wrapper
        return dist_checkpoint.optimizer_state(optimizer, self.lightning_module, self.layout)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Crash-safe (``lightning_mhc.checkpoint.commit``): every rank writes its pieces into a
        staging directory; rank 0 writes ``metadata.json`` last and renames it into place."""
        if storage_options is not None:
            raise TypeError("MHCParallelStrategy.save_checkpoint does not take storage_options")
        _, global_names = global_namer(self.lightning_module, self.layout)
        dist_checkpoint.save(checkpoint, Path(filepath), self.layout, self.global_rank, global_names=global_names)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Read a checkpoint saved on any layout into this rank's stage (and, when fitting, its
        optimizers' states)."""
        path = Path(self.broadcast(str(checkpoint_path)))
        trainer = self.lightning_module.trainer
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers] if trainer.state.fn == TrainerFn.FITTING else []
        return dist_checkpoint.load(path, self.lightning_module, optimizers, self.layout, self.global_rank)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self.lightning_module.load_state_dict(checkpoint["state_dict"], strict=strict)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            dist_checkpoint.remove(Path(filepath))

    # ------------------------------------------------------------ teardown
    def teardown(self) -> None:
        if self._grad_reduction is not None:
            self._grad_reduction.remove()
            self._grad_reduction = None
        super().teardown()
        destroy_parallel()
        clear_parallel_seed()
        if self.preemption.signum is not None and self.launcher is not None:
            self.preemption.wait_for(getattr(self.launcher, "procs", []))  # like torchrun: the launcher goes last
        self.preemption.cancel()  # stopped cleanly: nothing left for the watchdog
