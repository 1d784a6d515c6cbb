"""``MHCParallelStrategy``: 3D parallelism (TP/PP/DP) for Lightning, on CPU (gloo) and GPU (NCCL).

    Trainer(strategy=MHCParallelStrategy(tensor_model_parallel_size=2,
                                         pipeline_model_parallel_size=2),
            callbacks=[MHCRecomputeCallback("mhc_block")], devices=4)

- launches with Lightning's subprocess launcher (``devices=N``), or joins
  processes started by torchrun / SLURM;
- ``setup_environment`` creates the default process group, then megatron-core's
  TP/PP/DP groups, and seeds the parallel randomizer;
- a module implementing the pipeline contract (``distributed/pipeline/protocol.py``) runs
  the whole 1F1B schedule inside its ``training_step`` through :meth:`forward_backward`;
  Lightning's backward and zero_grad are then skipped (gradients are zeroed
  after each optimizer step); any other module trains as data parallel;
- gradients are averaged over DP (bucket by bucket during the last backward when
  ``overlap_grad_reduce``, else after it), summed over TP for sequence-parallel
  parameters, and the tied embedding reduced across stages; ``gradient_clip_val``
  clips by the global norm;
- checkpoints are reshardable ``torch.distributed.checkpoint`` directories keyed by global
  parameter names (``lightning_mhc.checkpoint``): save on one layout, resume on any other.

Launch, process groups, layout, RNG, the schedule, gradient reduction and checkpoints are
``lightning_mhc.strategies`` (``self.runtime``), shared with the Fabric strategy; this class maps
the Trainer's hooks onto them.
"""
from __future__ import annotations

import datetime
import math
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_mhc import checkpoint as dist_checkpoint
from lightning_mhc.errors import ConfigError
from lightning_mhc.data.resumable_loader import ResumableLoader
from lightning_mhc.distributed.pipeline.protocol import is_pipeline_module
from lightning_mhc.lightning.fit_position import continue_where_fit_stopped
from lightning_mhc.lightning.launcher import MHCSubprocessLauncher
from lightning_mhc.recompute.rng import replay_tracked_rng_in_hf_checkpointing
from lightning_mhc.lightning.preemption import PreemptionSignalConnector, PreemptionState, agree_to_stop, stop_preempted
from lightning_mhc.strategies.processes import StrategyProcesses
from lightning_mhc.strategies.runtime import refuse_gradient_scaler, sync_replicas, unwrap_optimizer
from lightning_mhc.any_model.parallel_model import ParallelModel
from lightning_mhc.strategies.settings import ParallelSettings


class MHCParallelStrategy(StrategyProcesses, ParallelStrategy):
    """Tensor, pipeline and data parallelism with megatron-core process groups, for the Trainer.

    Takes a :class:`~lightning_mhc.strategies.settings.ParallelSettings`, or its fields as keyword
    arguments (the layout: ``tensor_model_parallel_size``, ``pipeline_model_parallel_size``,
    ``sequence_parallel``, ``virtual_pipeline_model_parallel_size``, ``num_microbatches``; ``seed``,
    ``timeout``, ``overlap_grad_reduce``, ``gradient_bucket_bytes``, ``raise_on_nonfinite_loss``,
    ``measure_activation_memory``, ``use_distributed_optimizer``, ...), and:

    Args:
        save_on_preemption: on SIGTERM / SIGINT, all ranks stop at the next step boundary and save
            a step checkpoint there before leaving with 128 + signal (``preemption.py``).
        preemption_grace_s: a rank that has not stopped this long after the signal exits anyway.

    ``gradient_clip_val`` clips by the global norm; a NaN/inf gradient norm stops the run
    (``raise_on_nonfinite_loss``, or ``Trainer(detect_anomaly=True)``) or skips that step.
    """

    launcher_class = MHCSubprocessLauncher

    def __init__(self, settings: ParallelSettings | None = None, *,
                 # ParallelSettings' fields, the layout as its degrees (tests/test_settings.py keeps
                 # this list and its defaults equal to the settings')
                 tensor_model_parallel_size: int = 1,
                 pipeline_model_parallel_size: int = 1,
                 virtual_pipeline_model_parallel_size: int = 1,
                 sequence_parallel: bool = False,
                 context_parallel_size: int = 1,
                 expert_model_parallel_size: int = 1,
                 num_microbatches: int | None = None,
                 deallocate_pipeline_outputs: bool = True,
                 process_group_backend: str | None = None,
                 timeout: datetime.timedelta = datetime.timedelta(minutes=10),
                 seed: int = 1234,
                 gradient_bucket_bytes: int = 25 * 2**20,
                 overlap_grad_reduce: bool = True,
                 raise_on_nonfinite_loss: bool = True,
                 measure_activation_memory: bool = False,
                 use_distributed_optimizer: bool = False,
                 save_on_preemption: bool = True,
                 preemption_grace_s: float = 25.0,
                 # Lightning's ParallelStrategy
                 accelerator: Accelerator | None = None,
                 parallel_devices: list[torch.device] | None = None,
                 cluster_environment: ClusterEnvironment | None = None,
                 checkpoint_io: CheckpointIO | None = None,
                 precision_plugin: Precision | None = None) -> None:
        super().__init__(ParallelSettings.from_keywords(settings, locals()), accelerator=accelerator,
                         parallel_devices=parallel_devices, cluster_environment=cluster_environment,
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self.save_on_preemption = save_on_preemption
        self.preemption = PreemptionState(preemption_grace_s)
        self.last_step_end: float | None = None
        """``time.perf_counter()`` when the last optimizer step (gradient reduction included) ended."""

    @property
    def is_distributed(self) -> bool:
        """Tells Lightning to insert a ``DistributedSampler`` built from
        :attr:`distributed_sampler_kwargs` (also with one DP rank: its shuffle is seeded per
        epoch, which exact resume relies on)."""
        return True

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the stage is built in configure_model before its shard is loaded

    def setup_environment(self) -> None:
        super().setup_environment()
        self._start_processes(self.lightning_module)

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        # registered by the Trainer right after this: handlers that record signals, no collective
        trainer._signal_connector = PreemptionSignalConnector(trainer, self.preemption)
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        replay_tracked_rng_in_hf_checkpointing(self.lightning_module)  # Hugging Face checkpointing on already
        pipelined = is_pipeline_module(self.lightning_module)
        if not pipelined:
            sync_replicas(self.model)
        for part in self.lightning_module.modules():  # get_peft_model(parallelize(...)): placed here,
            if isinstance(part, ParallelModel):       # before a checkpoint is restored
                part.place_injected_adapters(self.layout)
        if trainer.state.fn == TrainerFn.FITTING:
            if pipelined:
                refuse_gradient_scaler(self.precision_plugin)
                self._skip_lightning_backward(trainer)
            self.runtime.check_parameters(self.lightning_module)  # before any step, on every rank
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """Lightning's ``configure_optimizers``; then, with ``use_distributed_optimizer`` or bf16
        weights, the distributed optimizer takes the optimizer over (``runtime.take_over_optimizers``)."""
        super().setup_optimizers(trainer)
        self.runtime.take_over_optimizers(self.lightning_module, self.optimizers)

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

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """The step boundary where all ranks agree on a preemption signal (one all-reduce)."""
        if agree_to_stop(self.preemption, self.root_device):
            stop_preempted(self.lightning_module.trainer, self.preemption, self.save_on_preemption)

    # --------------------------------------------------------------- data
    def process_dataloader(self, dataloader: object) -> object:
        """Check the data-parallel split of a loader; make a training loader resumable mid-epoch."""
        trainer = self.lightning_module.trainer
        self.runtime.check_data_parallel_sampler(
            dataloader, trainer.training,
            "Leave the sampler to Lightning (use_distributed_sampler=True, the default) or build it with "
            "**trainer.strategy.distributed_sampler_kwargs.")
        if trainer.training and not isinstance(dataloader, _Stateful):
            return ResumableLoader(
                dataloader,
                lambda: (trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_progress.current.completed),
                self.layout.data_parallel_size,
            )
        return dataloader

    # ------------------------------------------------------- collectives
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Mean (or sum) over the data-parallel group: the ranks that hold different data."""
        if not isinstance(tensor, Tensor) or not dist.is_initialized():
            return tensor
        group = group or self.layout.dp_group
        tensor = tensor.detach().clone().float()
        with self.runtime.fail_fast.waiting():
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
        trainer = module.trainer
        accumulate = trainer.accumulate_grad_batches if not forward_only else 1
        return self.runtime.run_schedule(module, batch, forward_only, accumulate, f"global step {trainer.global_step}",
                                  raise_on_nonfinite=self._raise_on_nonfinite(trainer))

    def _raise_on_nonfinite(self, trainer: pl.Trainer) -> bool:
        return self.settings.raise_on_nonfinite_loss or getattr(trainer, "_detect_anomaly", False)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        def closure_then_reduce():
            result = closure()
            self._finalize_gradients()
            return result

        output = super().optimizer_step(optimizer, closure_then_reduce, model, **kwargs)
        self.runtime.finish_step()
        if is_pipeline_module(self.lightning_module):
            optimizer.zero_grad(set_to_none=True)  # Lightning's zero_grad is skipped for pipelined modules
        self.last_step_end = time.perf_counter()
        return output

    def _finalize_gradients(self) -> None:
        """Gradient reduction; global-norm clipping (Lightning's own clipping that follows sees a
        local norm no larger than the clipped global one and does nothing)."""
        module = self.lightning_module
        self.runtime.reduce_gradients(module)
        trainer = module.trainer
        clip = trainer.gradient_clip_val
        if clip is not None and clip > 0 and trainer.gradient_clip_algorithm not in (None, "norm"):
            raise ConfigError(
                f"gradient_clip_algorithm={trainer.gradient_clip_algorithm!r} is not supported by "
                "MHCParallelStrategy: it clips by the global norm. Use gradient_clip_algorithm='norm'."
            )
        self.last_grad_norm = self.runtime.grad_norm(module, clip if clip is not None and clip > 0 else None)
        if not math.isfinite(self.last_grad_norm):  # the same global norm on every rank: all stop or skip
            message = (f"non-finite gradient norm {self.last_grad_norm} at global step {trainer.global_step} "
                       "(a NaN/inf loss or gradient)")
            if self._raise_on_nonfinite(trainer):
                raise FloatingPointError(message + "; raise_on_nonfinite_loss=False only warns and skips the step")
            rank_zero_warn(message + ": optimizer step skipped")
            self.runtime.drop_gradients(module)  # the optimizer leaves parameters without gradients untouched

    # ---------------------------------------------------------- checkpoints
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's pieces of the whole model's tensors, by global name (views: no copy)."""
        return self.runtime.model_state(self.lightning_module)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer's per-parameter states as pieces of the whole model's (AdamW's moments
        are resharded like their parameters), and its param-group settings."""
        return self.runtime.optimizer_state(unwrap_optimizer(optimizer), self.lightning_module)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Crash-safe (``lightning_mhc.checkpoint.commit``): every rank writes its pieces into a
        staging directory; rank 0 writes ``metadata.json`` last and renames it into place."""
        if storage_options is not None:
            raise TypeError("MHCParallelStrategy.save_checkpoint does not take storage_options")
        self.runtime.save(checkpoint, Path(filepath), self.lightning_module, self.global_rank)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Read a checkpoint saved on any layout into this rank's stage (and, when fitting, its
        optimizers' states). One saved after training ended resumes where that run stopped
        (``fit_position``), as one saved during it does."""
        trainer = self.lightning_module.trainer
        optimizers = [unwrap_optimizer(o) for o in self.optimizers] if trainer.state.fn == TrainerFn.FITTING else []
        checkpoint = self.runtime.load(checkpoint_path, self.lightning_module, optimizers, self.global_rank)
        continue_where_fit_stopped(checkpoint)
        return checkpoint

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self.lightning_module.load_state_dict(checkpoint["state_dict"], strict=strict)
        self.runtime.model_loaded(self.lightning_module)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            dist_checkpoint.remove(Path(filepath))

    # ------------------------------------------------------------ teardown
    def on_exception(self, exception: BaseException) -> None:
        """This rank's run raised: the other ranks stop within seconds (``fail_fast.py``)."""
        self.runtime.fail_fast.publish(exception)
        super().on_exception(exception)

    def teardown(self) -> None:
        """The end of ``fit`` / ``validate`` / ``test`` / ``predict``: the gradient hooks go; the
        process groups stay (as Lightning's DDP leaves its group), so that ``trainer.save_checkpoint``
        and the next entry point of this Trainer run on them. They go at exit, or when another
        layout is built. What else the run changed in the process (the RNG and the randomizer,
        transformers' registries, the patched checkpoint functions) is put back
        (``runtime.process_state``)."""
        self.runtime.remove_gradient_hooks()
        super().teardown()
        self.runtime.process_state.release()
        if self.preemption.signum is not None and self.launcher is not None:
            self.preemption.wait_for(getattr(self.launcher, "procs", []))  # like torchrun: the launcher goes last
        self.preemption.cancel()  # stopped cleanly: nothing left for the watchdog
