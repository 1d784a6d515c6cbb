"""``MHCParallelStrategy`` for Lightning Fabric: TP/PP/DP in a hand-written training loop.

    fabric = Fabric(accelerator="cpu", devices=4,
                    strategy=MHCParallelStrategy(tensor_model_parallel_size=2, pipeline_model_parallel_size=2))
    fabric.launch()
    model = fabric.setup_module(MHCGPTModule(config, recompute_policy="mhc_block"))  # this rank's stage
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    loader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=8, shuffle=True))
    for batch in loader:
        loss = fabric.strategy.forward_backward(model, batch)  # 1F1B over the microbatches + reduction
        fabric.clip_gradients(model, optimizer, max_norm=1.0)  # by the global norm
        optimizer.step()
        optimizer.zero_grad()
    fabric.save("ckpt", {"model": model, "optimizer": optimizer, "step": step})  # reshardable directory

A module without the pipeline contract (any ``nn.Module``) trains data parallel (TP = PP = 1):
``fabric.setup(model, optimizer)`` starts every replica from rank 0's weights, ``fabric.backward(loss)``
averages the gradients over DP (not inside ``fabric.no_backward_sync(model)``).

The parts shared with the Trainer strategy (process groups, layout, RNG, schedule, gradient
reduction, checkpoints) are ``self.runtime`` (``lightning_mhc.strategies``); like Lightning's own
``lightning.fabric.strategies.ModelParallelStrategy``, checkpoints are directories written by
every rank and restore the objects passed to ``fabric.load``.
"""
from __future__ import annotations

import datetime
import math
import weakref
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl, _validate_keys_for_strict_loading
from lightning.fabric.utilities.distributed import _all_gather_ddp_if_available, _sync_ddp_if_available
from lightning.fabric.utilities.types import _Stateful
from lightning.fabric.wrappers import _unwrap_objects
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_mhc import checkpoint as dist_checkpoint
from lightning_mhc.checkpoint.format import PARAM_GROUPS
from lightning_mhc.recompute.rng import replay_tracked_rng_in_hf_checkpointing
from lightning_mhc.errors import ConfigError
from lightning_mhc.distributed.grads import clip_grad_norm_
from lightning_mhc.distributed.pipeline.protocol import is_pipeline_module
from lightning_mhc.recompute.policy import attach_recompute
from lightning_mhc.strategies.launcher import MHCFabricLauncher
from lightning_mhc.strategies.processes import StrategyProcesses
from lightning_mhc.strategies.runtime import refuse_gradient_scaler, sync_replicas, with_grads
from lightning_mhc.strategies.settings import ParallelSettings

FABRIC_OBJECTS = "fabric_objects"
"""Checkpoint entry: which keys of ``fabric.save``'s state were the model and the optimizers."""
FABRIC_STATE = "fabric_state"
"""Checkpoint entry: the rest of ``fabric.save``'s state (``state_dict()`` of stateful objects)."""
_TRAINER_OBJECTS = ("state_dict", "optimizer_states", PARAM_GROUPS, "lightning_mhc_metadata")
"""Entries of a Trainer checkpoint that are not the user's: the model, the optimizers, our metadata."""


class MHCParallelStrategy(StrategyProcesses, ParallelStrategy):
    """Tensor, pipeline and data parallelism with megatron-core process groups, for Fabric.

    Takes a :class:`~lightning_mhc.strategies.settings.ParallelSettings`, or its fields as keyword
    arguments (the same as the Trainer's ``MHCParallelStrategy`` without its preemption handling).

    - ``fabric.setup_module(model)`` builds this rank's stage (``model.configure_model()``, e.g.
      ``MHCGPTModule``), attaches mHC block recompute where its config asks for it (the module's
      ``recompute_policy``; the same managers the Trainer's ``MHCRecomputeCallback`` attaches) and,
      for a plain module, broadcasts rank 0's weights. Create the optimizer after it.
    - ``fabric.strategy.forward_backward(model, batch)`` runs the 1F1B schedule (interleaved with
      a virtual pipeline) over ``num_microbatches`` microbatches of ``batch`` and reduces the
      gradients; it returns the mean loss (detached, the same on every rank). The user then clips
      and steps. ``forward_only=True`` (or ``torch.no_grad()``) evaluates.
    - ``fabric.clip_gradients(model, optimizer, max_norm=...)`` clips by the global norm over
      TP, PP and DP (each replicated parameter counted once).
    - ``fabric.setup_dataloaders`` splits the data by DP rank (TP/PP peers read the same batches).
    - ``fabric.save(path, state)`` / ``fabric.load(path, state)``: the reshardable checkpoint
      directory of ``lightning_mhc.checkpoint`` (one model per checkpoint; load on any layout,
      and Trainer checkpoints load too).
    """

    launcher_class = MHCFabricLauncher

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
                 # Lightning Fabric's ParallelStrategy
                 accelerator: Accelerator | None = None,
                 parallel_devices: list[torch.device] | None = None,
                 cluster_environment: ClusterEnvironment | None = None,
                 checkpoint_io: CheckpointIO | None = None,
                 precision: Precision | None = None) -> None:
        super().__init__(ParallelSettings.from_keywords(settings, locals()), accelerator=accelerator,
                         parallel_devices=parallel_devices, cluster_environment=cluster_environment,
                         checkpoint_io=checkpoint_io, precision=precision)
        self._backward_sync_control = _GradientSyncControl()
        self._modules: weakref.WeakKeyDictionary[Module, None] = weakref.WeakKeyDictionary()
        """The set-up modules, in order (those still alive): whose gradients ``backward`` reduces."""
        self._calls = 0

    # -------------------------------------------------------- processes
    def setup_environment(self) -> None:
        super().setup_environment()
        self._start_processes()

    def teardown(self) -> None:
        """Remove the gradient hooks, destroy megatron's groups and the parallel randomizer, and put
        back what the run changed in the process (``runtime.process_state``; call it before making
        another Fabric in the same processes; the default process group stays)."""
        self.runtime.remove_gradient_hooks()
        self._modules.clear()
        super().teardown()
        self.runtime.stop()
        self.runtime.process_state.release()

    # ---------------------------------------------------------- modules
    def setup_module(self, module: Module) -> Module:
        self.runtime.check_module(module)
        replay_tracked_rng_in_hf_checkpointing(module)  # Hugging Face checkpointing turned on before the run
        if callable(getattr(module, "configure_model", None)):
            if hasattr(module, "handed_layout"):  # our modules: Fabric attaches itself only after this
                module.handed_layout = self.layout
            with self.precision.module_init_context():
                module.configure_model()  # this rank's stage, built for self.layout
            module = self.precision.convert_module(module)  # Fabric converted the module before it had a stage
        self.module_to_device(module)
        attach_recompute(module)
        self.runtime.check_parameters(module)  # every trainable parameter's reduction known, before any step
        if not is_pipeline_module(module):
            sync_replicas(module)
        self._modules[module] = None
        return module

    def setup_module_and_optimizers(self, module: Module, optimizers: list[Optimizer], scheduler: Any = None):
        module = self.setup_module(module)
        current = {id(p) for p in module.parameters()}
        if any(id(p) not in current for opt in optimizers for group in opt.param_groups for p in group["params"]):
            raise ConfigError(
                f"setting up {type(module).__name__} built its stage for this rank, so an optimizer created "
                "before it holds parameters that are not the stage's. Set up the module first, then the optimizer:\n"
                "    model = fabric.setup_module(model)\n"
                "    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))"
            )
        return module, [self.setup_optimizer(opt) for opt in optimizers], scheduler

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """With ``use_distributed_optimizer`` or bf16 weights, the distributed optimizer takes over
        the optimizer of the set-up module whose parameters it holds."""
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for module in self._modules:
            if any(id(p) in held for p in module.parameters()):
                self.runtime.take_over_optimizers(module, [optimizer])
                break
        return super().setup_optimizer(optimizer)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, **kwargs)
        self.runtime.finish_step()
        return output

    def module_to_device(self, module: Module) -> None:
        module.to(self.root_device)

    # ------------------------------------------------------------- data
    def process_dataloader(self, dataloader: Any) -> Any:
        self.runtime.check_data_parallel_sampler(
            dataloader, True,  # only a loader set up with use_distributed_sampler=False (or iterable) warns
            "Let fabric.setup_dataloaders insert the sampler (use_distributed_sampler=True, the default) or build "
            "it with **fabric.strategy.distributed_sampler_kwargs.")
        return dataloader

    # --------------------------------------------------------- training
    def forward_backward(self, module: Any, batch: Any, forward_only: bool = False, accumulate: int = 1) -> Tensor:
        """Run the schedule over the microbatches of ``batch`` on this rank's stage (a module with
        the pipeline contract, e.g. ``MHCGPTModule``; the same call as under the Trainer).

        Returns the mean loss over the microbatches and the DP replicas (the same detached scalar
        on every rank). Unless ``forward_only``, the gradients are accumulated and then reduced
        (DP average, SP parameters over TP, the tied embedding), except inside
        ``fabric.no_backward_sync(model)``, where they keep accumulating locally. ``accumulate``:
        the number of calls whose gradients make one step (all but the last inside
        ``no_backward_sync``); the loss is divided by it, as the Trainer's ``accumulate_grad_batches``.
        """
        module = _unwrap_objects(module)
        if not is_pipeline_module(module):
            raise ConfigError(
                f"forward_backward runs the pipeline schedule, which needs the pipeline contract (forward_step, "
                f"loss_func, set_input_tensor, pipeline_tensor_shape); {type(module).__name__} has none. Train a "
                "plain module with loss = model(batch); fabric.backward(loss)."
            )
        refuse_gradient_scaler(self.precision)
        if not isinstance(accumulate, int) or accumulate < 1:
            raise ConfigError(f"accumulate={accumulate!r}: must be a positive integer.")
        training = not forward_only and torch.is_grad_enabled()
        sync = self._backward_sync_control.syncs(module)
        with self.precision.forward_context():
            loss = self.runtime.run_schedule(module, batch, not training, accumulate if training else 1,
                                      f"forward_backward call {self._calls} of this process", reduce_this_step=sync)
        if training:
            if sync:
                self.runtime.reduce_gradients(module)
            self._calls += 1
        return loss

    def backward(self, tensor: Tensor, module: Optional[Module], *args: Any, **kwargs: Any) -> None:
        """The loss's backward (through the precision plugin), then the gradient reduction of the
        set-up modules (``module`` alone when given), unless inside ``fabric.no_backward_sync``."""
        modules = [module] if module is not None else list(self._modules)
        if any(is_pipeline_module(m) and self.settings.layout.model_parallel_size > 1 for m in modules):
            raise ConfigError(
                "a pipelined / tensor-parallel module runs its backward inside "
                "fabric.strategy.forward_backward(model, batch) (which also reduces the gradients): "
                "do not call fabric.backward on its loss."
            )
        super().backward(tensor, module, *args, **kwargs)
        for m in modules:
            # (under the distributed optimizer .grad stays empty: the gradients are in its fp32 buffers)
            if self._backward_sync_control.syncs(m) and (self.runtime.takes_over(m) or
                                                         any(p.grad is not None for p in m.parameters())):
                self.runtime.reduce_gradients(m)

    def clip_gradients_norm(self, module: Module, optimizer: Optimizer, max_norm: float | int,
                            norm_type: float | int = 2.0, error_if_nonfinite: bool = True) -> Tensor:
        """Clip by the global 2-norm over TP, PP and DP (each replicated parameter counted once);
        returns that norm before clipping."""
        if float(norm_type) != 2.0:
            raise ConfigError(f"MHCParallelStrategy clips by the global 2-norm; norm_type={norm_type} is not supported.")
        self.precision.unscale_gradients(optimizer)
        if self.runtime.optimizer_pieces(optimizer):
            norm = self.runtime.grad_norm(_unwrap_objects(module), float(max_norm))
        else:
            # the optimizer's parameters in the module's order: the same sums as the Trainer's clipping
            owned = {id(p): p for p in self.precision.main_params(optimizer)}
            ordered = [p for p in module.parameters() if owned.pop(id(p), None) is not None]
            norm = clip_grad_norm_(with_grads(ordered + list(owned.values())), float(max_norm), self.layout)
        self.last_grad_norm = norm
        if error_if_nonfinite and not math.isfinite(norm):
            raise RuntimeError(
                f"the global gradient norm is {norm} (a NaN/inf loss or gradient); gradients were not clipped. "
                "Pass error_if_nonfinite=False to clip anyway."
            )
        return torch.tensor(norm, device=self.root_device)

    # ------------------------------------------------------ collectives
    def all_reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        return _all_gather_ddp_if_available(tensor, group=group, sync_grads=sync_grads)

    # ------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any = None,
                        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None) -> None:
        """Every rank: ``state``'s model and optimizers as pieces of the whole model's tensors
        (reshardable), the rest (``state_dict()`` of stateful objects) on rank 0; a directory,
        written crash-safely (complete once ``metadata.json`` is in place)."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options")
        if filter is not None:
            raise NotImplementedError(f"{type(self).__name__} saves whole distributed checkpoints: no filter.")
        model_key, module = _the_model(state)
        optimizer_keys = [k for k, v in state.items() if isinstance(v, Optimizer)]
        rest = {k: (v.state_dict() if isinstance(v, _Stateful) else v) for k, v in state.items()
                if k != model_key and k not in optimizer_keys}
        step = next((rest[k] for k in ("global_step", "step") if isinstance(rest.get(k), int)), None)
        checkpoint = {
            "state_dict": self.runtime.model_state(module),
            "optimizer_states": [self.runtime.optimizer_state(state[k], module) for k in optimizer_keys],
            FABRIC_OBJECTS: dict(model=model_key, optimizers=optimizer_keys),
            FABRIC_STATE: rest,
            "global_step": step,
        }
        self.runtime.save(checkpoint, Path(path), module, self.global_rank)

    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Restore the objects in ``state`` (one model, optimizers, stateful objects; other keys
        get the saved values) from a checkpoint saved on any layout, by ``fabric.save`` or by the
        Trainer (its model and optimizers in order; its other top-level entries are the rest).
        Returns the saved entries not asked for (optimizer states not asked for are not read).
        ``strict``: every key of ``state`` must be in the checkpoint (checked before anything is
        read); the model must match the checkpoint either way. ``fabric.load_raw(path, model)``
        loads the model alone. The files are the project's own: ``weights_only`` is not applied."""
        if not state:
            raise ValueError(
                f"{type(self).__name__}.load_checkpoint needs the objects to restore, at least the model: "
                "fabric.load(path, {'model': model, 'optimizer': optimizer, ...})"
            )
        if isinstance(state, Optimizer):
            raise NotImplementedError(f"{type(self).__name__} loads an optimizer together with its model: "
                                      "fabric.load(path, {'model': model, 'optimizer': optimizer})")
        path = Path(self.broadcast(str(path)))
        if isinstance(state, Module):
            checkpoint = self.runtime.load(path, state, [], self.global_rank)
            state.load_state_dict(checkpoint["state_dict"], strict=strict)
            self.runtime.model_loaded(state)
            return {}
        model_key, module = _the_model(state)
        wanted = [k for k, v in state.items() if isinstance(v, Optimizer)]
        saved_optimizers, saved_rest = _saved_entries(path, wanted)
        _validate_keys_for_strict_loading(state.keys(), {model_key, *saved_optimizers, *saved_rest}, strict=strict)
        optimizers = [state[k] if k in wanted else None for k in saved_optimizers]
        checkpoint = self.runtime.load(path, module, optimizers, self.global_rank)
        module.load_state_dict(checkpoint["state_dict"])
        self.runtime.model_loaded(module)
        for key, loaded in zip(saved_optimizers, checkpoint["optimizer_states"]):
            if loaded is not None:
                state[key].load_state_dict(loaded)
        rest = checkpoint[FABRIC_STATE] if FABRIC_OBJECTS in checkpoint else \
            {k: v for k, v in checkpoint.items() if k not in _TRAINER_OBJECTS}
        for key, obj in list(state.items()):
            if key == model_key or key in wanted or key not in rest:
                continue
            if isinstance(obj, _Stateful):
                obj.load_state_dict(rest.pop(key))
            else:
                state[key] = rest.pop(key)
        return rest


class _GradientSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: that model's gradients accumulate locally, not reduced."""

    def __init__(self) -> None:
        self._paused: weakref.WeakKeyDictionary[Module, int] = weakref.WeakKeyDictionary()

    def syncs(self, module: Module) -> bool:
        return not self._paused.get(module)

    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        return _NoSync(self._paused, module) if enabled else nullcontext()


class _NoSync(AbstractContextManager):
    def __init__(self, paused: weakref.WeakKeyDictionary, module: Module) -> None:
        self._paused, self._module = paused, module

    def __enter__(self) -> None:
        self._paused[self._module] = self._paused.get(self._module, 0) + 1

    def __exit__(self, *exc: Any) -> None:
        self._paused[self._module] -= 1


def _the_model(state: dict[str, Any]) -> tuple[str, Module]:
    modules = [(k, v) for k, v in state.items() if isinstance(v, Module)]
    if len(modules) != 1:
        raise ValueError(
            f"MHCParallelStrategy saves and loads one model per checkpoint; the state has {len(modules)} "
            f"({[k for k, _ in modules]}). Save several models to several paths."
        )
    return modules[0]


def _saved_entries(path: Path, wanted: list[str]) -> tuple[list[str], list[str]]:
    """The keys of the saved optimizers (in their saved order) and of the other saved entries:
    recorded by ``fabric.save``; for a Trainer checkpoint, its optimizers in order named by the
    optimizer keys asked for, and its top-level entries."""
    dist_checkpoint.read_metadata(path)  # a clear error for a missing or incomplete checkpoint
    saved = dist_checkpoint.read_trainer_state(path)
    if FABRIC_OBJECTS in saved:
        return list(saved[FABRIC_OBJECTS]["optimizers"]), list(saved[FABRIC_STATE])
    count = len(saved.get(PARAM_GROUPS, []))
    return wanted[:count], [k for k in saved if k not in _TRAINER_OBJECTS]
