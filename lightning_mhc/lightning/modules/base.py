"""What the LightningModules share: the recompute policy they build their model with, the steps
that hand a batch to the strategy's schedule, the run's logs (throughput, learning rate, gradient
norm, validation history), the warm-up + cosine optimizer recipe, and the global names their
checkpoints are keyed by."""
from __future__ import annotations

import math
import resource
import time
from collections.abc import Mapping
from typing import Any, Iterable

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor

from lightning_mhc.distributed.layout import ParallelLayout, single_process_layout
from lightning_mhc.distributed.optimizer import OPTIMIZERS  # noqa: F401  (the modules import it from here)
from lightning_mhc.errors import ConfigError, term
from lightning_mhc.lightning.modules.throughput import ThroughputMeter
from lightning_mhc.model.divergence import StreamDivergenceMonitor
from lightning_mhc.model.flops import device_peak_flops
from lightning_mhc.recompute.policy import RecomputePolicy



class PipelinedLMModule(pl.LightningModule):
    """Base of ``MHCGPTModule`` and ``ParallelLMModule``: a language model whose training,
    validation and test steps run the whole pipeline schedule over the batch through
    ``MHCParallelStrategy.forward_backward`` (the loss is then the mean over its microbatches
    and the data-parallel replicas). A subclass implements the pipeline contract
    (``forward_step``, ``loss_func``, ``set_input_tensor``, ``pipeline_tensor_shape``,
    ``model_chunks``) and :meth:`global_name_in_model`.

    Logged: ``train_loss``, ``val_loss``, ``lr``, ``grad_norm``, ``tokens_per_sec``,
    ``tokens_consumed``, ``step_time_ms``, ``mfu`` (where :meth:`flops_per_token` and the device's
    peak are known), the optimizer state's bytes and memory (``max_rss_mb``, ``max_cuda_mb``), and
    with hyper-connections the streams' divergence per block (``stream_divergence/<block>``, and
    their mean ``stream_divergence``: ``lightning_mhc.model.divergence``), and with MoE layers
    their tokens per expert, balance and auxiliary losses (``moe/...``:
    ``lightning_mhc.model.moe_mlp.moe_step_statistics``)."""

    recompute_policy: RecomputePolicy | None = None
    """The recompute policy ``configure_model`` builds the model with (None: none was chosen)."""
    peak_flops: float | None = None
    """One device's peak FLOP/s for ``mfu`` (None: a known GPU's figure)."""
    handed_layout: ParallelLayout | None = None
    """The layout handed over before ``configure_model`` where the module has no Trainer (Fabric's
    ``setup_module``: Fabric attaches itself only after; a checkpoint conversion); see :attr:`layout`."""

    def __init__(self) -> None:
        super().__init__()
        self._step_started: float | None = None
        self._val_losses: list[float] = []
        self.val_history: list[tuple[int, float]] = []
        """(global step, mean validation loss); step 0 comes from the sanity check."""
        self.throughput = ThroughputMeter()
        """Whole-job tokens/s per step (warm-up excluded): ``throughput.summary()``."""
        self._divergence: StreamDivergenceMonitor | None = None
        self._log_step = False

    @property
    def layout(self) -> ParallelLayout:
        """The built layout this module's model is built on and runs over: its Trainer's strategy's
        (or the one a Fabric strategy handed over); outside any run, the one-process layout
        (``single_process_layout()``: loading a checkpoint, generating). ``configure_model`` passes
        it on: ``parallelize(model, plan, layout=self.layout)``."""
        strategy_layout = getattr(getattr(self._trainer, "strategy", None), "layout", None)
        layout = strategy_layout if strategy_layout is not None else self.handed_layout
        return layout if layout is not None else single_process_layout()

    def configure_recompute(self, policy: str | Mapping[str, Any] | RecomputePolicy | None) -> None:
        """Build the model with ``policy`` (anything :meth:`RecomputePolicy.of` takes); called
        before ``configure_model`` (by ``MHCRecomputeCallback`` in ``setup``, by ``MHCGPTModule``'s
        ``recompute_policy=``). A policy this module's model cannot run is refused here, before
        anything is built."""
        policy = RecomputePolicy.of(policy)
        self.check_recompute_policy(policy)
        self.recompute_policy = policy

    def check_recompute_policy(self, policy: RecomputePolicy) -> None:
        """Refuse a policy this module's model cannot run (each module knows its model)."""

    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        loss = self.trainer.strategy.forward_backward(self, batch)
        self.log("train_loss", loss, prog_bar=True)
        self._log_moe_statistics()  # every microbatch of the step has run
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> Tensor:
        loss = self.trainer.strategy.forward_backward(self, batch, forward_only=True)
        self.log("val_loss", loss, prog_bar=True)
        self.on_validation_loss(loss)
        return loss

    def test_step(self, batch: dict, batch_idx: int) -> Tensor:
        loss = self.trainer.strategy.forward_backward(self, batch, forward_only=True)
        self.log("test_loss", loss)
        return loss

    def on_validation_loss(self, loss: Tensor) -> None:
        """Called with each validation batch's loss (kept for ``val_history``)."""
        self._val_losses.append(loss.item())

    def on_validation_epoch_end(self) -> None:
        if self._val_losses:
            self.val_history.append((self.global_step, sum(self._val_losses) / len(self._val_losses)))
        self._val_losses = []

    # ------------------------------------------------------------ the run's logs
    def flops_per_token(self, seq_length: int) -> float | None:
        """Training FLOPs per token of this model (for ``mfu``); None: not known, no ``mfu``."""
        return None

    def attach_stream_divergence(self) -> StreamDivergenceMonitor | None:
        """A monitor of this rank's hyper-connected blocks' stream divergence, attached to them;
        None for a model without hyper-connections (the default)."""
        return None

    def on_train_start(self) -> None:
        self.throughput.start_fit()
        if self._divergence is None:  # once per model: a second fit of the module keeps its monitor
            self._divergence = self.attach_stream_divergence()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._step_started = time.perf_counter()
        # the steps Lightning logs (its rule: the step about to end)
        self._log_step = (self.trainer.global_step + 1) % self.trainer.log_every_n_steps == 0
        if self._divergence is not None:  # the steps Lightning logs (its rule: the step about to end)
            self._divergence.armed = (self.trainer.global_step + 1) % self.trainer.log_every_n_steps == 0

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        norm = getattr(self.trainer.strategy, "last_grad_norm", None)
        if norm is not None:
            self.log("grad_norm", norm)
        self.log("lr", optimizer.param_groups[0]["lr"])

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._log_throughput(batch)
        if self._divergence is not None and self._divergence.armed:
            self._log_stream_divergence(self._divergence.take())
        runtime = getattr(self.trainer.strategy, "runtime", None)
        if runtime is not None:  # this rank's (rank 0's in the logs); 1/DP with the distributed optimizer
            self.log("optimizer_state_bytes", float(runtime.optimizer_state_bytes(self.trainer.optimizers)))

    def moe_layers(self) -> list[tuple[str, Any]]:
        """This rank's MoE layers as (name in the whole model, ``MoELayer``); none by default."""
        return []

    def _log_moe_statistics(self) -> None:
        """Every step takes the MoE layers' counts (so each logged step holds its own); on the steps
        Lightning logs, their sums over the data-parallel ranks, gathered over the model-parallel
        group, are logged (every rank logs the same)."""
        layers = self.moe_layers()
        if not self._log_step:
            for _, layer in layers:
                layer.take_step_statistics()
            return
        if not self.uses_experts():
            return
        from lightning_mhc.model.moe_mlp import moe_step_statistics

        layout = getattr(self.trainer.strategy, "layout", None)
        built = layout is not None and layout.groups is not None
        figures = moe_step_statistics(layers, layout.dp_cp_group if built else None,
                                      layout.model_parallel_group if built else None)
        for name, value in figures.items():
            self.log(name, value)

    def uses_experts(self) -> bool:
        """Whether the model has MoE layers anywhere (every rank answers the same)."""
        return False

    def _log_stream_divergence(self, values: dict[str, float]) -> None:
        """``stream_divergence/<block>`` for every block of the model and ``stream_divergence``
        their mean: each rank measured its own blocks (its stage; with sequence parallelism its
        part of the tokens), gathered over the model-parallel group (every rank of it logs the
        same; the logger writes rank 0's: the first data-parallel replica's batch)."""
        layout = getattr(self.trainer.strategy, "layout", None)
        group = layout.groups.model_parallel if layout is not None and layout.groups is not None else None
        if group is not None and dist.get_world_size(group) > 1:
            gathered: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, values, group=group)
        else:
            gathered = [values]
        by_block: dict[str, list[float]] = {}
        for rank_values in gathered:
            for name, value in rank_values.items():
                by_block.setdefault(name, []).append(value)
        means = {name: sum(v) / len(v) for name, v in by_block.items()}
        for name, value in means.items():
            self.log(f"stream_divergence/{name}", value)
        if means:
            self.log("stream_divergence", sum(means.values()) / len(means))

    def _log_throughput(self, batch: Any) -> None:
        """tokens/s of the whole job for this step (see ``lightning_mhc.lightning.modules.throughput``)."""
        tokens_of_batch = _batch_tokens(batch)
        if self._step_started is None or tokens_of_batch is None:
            return
        step_end = getattr(self.trainer.strategy, "last_step_end", None)
        if step_end is None or step_end < self._step_started:  # no optimizer step timed in this batch
            step_end = time.perf_counter()
        seconds = step_end - self._step_started
        layout = getattr(self.trainer.strategy, "layout", None)
        tokens = tokens_of_batch.numel() * (layout.data_parallel_size if layout is not None else 1)
        self.log("tokens_consumed", float(self.trainer.global_step * tokens))
        if self.throughput.record(seconds, tokens):
            self.log("tokens_per_sec", tokens / seconds)
            self.log("step_time_ms", 1000 * seconds)
            peak = self.peak_flops or device_peak_flops(self.device)
            per_token = self.flops_per_token(tokens_of_batch.shape[-1]) if peak else None
            if per_token:
                self.log("mfu", per_token * tokens / seconds / (peak * self.trainer.world_size))
        self.log("max_rss_mb", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.log("max_cuda_mb", torch.cuda.max_memory_allocated() / 2**20)

    # ------------------------------------------------------------ optimizer recipe
    def warmup_cosine_optimizer(self, name: str, lr: float, weight_decay: float, betas: Iterable[float],
                                warmup_steps: int, min_lr_ratio: float, max_steps: int | None = None,
                                override_scheduler: bool = False) -> dict:
        """``OPTIMIZERS[name]`` (SGD: momentum ``betas[0]``; no weight decay on vectors and
        hyper-connections) with linear warm-up, then cosine decay to ``min_lr_ratio * lr`` at
        ``max_steps`` (default: the Trainer's; constant after warm-up without one). Lightning's dict:
        ``["optimizer"]`` and ``["lr_scheduler"]["scheduler"]`` (a :class:`WarmupCosineSchedule`,
        stepped every optimizer step: a checkpoint of another schedule is refused on resume unless
        ``override_scheduler``)."""
        betas = tuple(betas)
        decay, no_decay = [], []
        for param_name, p in self.named_parameters():
            (no_decay if p.ndim < 2 or "hyper_connection" in param_name else decay).append(p)
        groups = [dict(params=decay, weight_decay=weight_decay), dict(params=no_decay, weight_decay=0.0)]
        if name == "adamw":
            optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas)
        elif name == "sgd":
            optimizer = torch.optim.SGD(groups, lr=lr, momentum=betas[0])
        else:  # factored second moments: not element-wise, so not for the distributed optimizer
            optimizer = OPTIMIZERS[name](groups, lr=lr)
        if max_steps is None and self._trainer is not None:
            max_steps = self._trainer.max_steps
        total = max_steps if max_steps and max_steps > 0 else None
        scheduler = WarmupCosineSchedule(optimizer, lr=lr, warmup_steps=warmup_steps, max_steps=total,
                                         min_lr_ratio=min_lr_ratio, weight_decay=weight_decay,
                                         override_scheduler=override_scheduler)
        return dict(optimizer=optimizer, lr_scheduler=dict(scheduler=scheduler, interval="step"))

    def global_parameter_name(self, name: str) -> str:
        """A state-dict name of this rank's stage as the one-process module names it: the key of
        checkpoints, which therefore load under any layout."""
        prefix = "model."
        if not name.startswith(prefix) or self.model is None:
            return name
        return prefix + self.global_name_in_model(name[len(prefix):])

    def global_name_in_model(self, name: str) -> str:
        """``name`` (relative to ``self.model`` on this rank) in the whole model."""
        raise NotImplementedError


def _batch_tokens(batch: Any) -> Tensor | None:
    """The token ids of a batch (``tokens`` or ``input_ids``), for the throughput."""
    if isinstance(batch, dict):
        for key in ("tokens", "input_ids"):
            if isinstance(batch.get(key), Tensor):
                return batch[key]
    return None


class WarmupCosineSchedule(torch.optim.lr_scheduler.LambdaLR):
    """Linear warm-up over ``warmup_steps``, then cosine decay from ``lr`` to ``min_lr_ratio * lr``
    at ``max_steps`` (None: constant after warm-up), with the optimizer's ``weight_decay``. Its
    state carries these settings, and a state saved under other settings is refused on load, as
    Megatron-LM's ``OptimizerParamScheduler`` refuses one (its learning rates and weight decay):
    restoring it as it was would run the resumed step at the old schedule's rate (the optimizer's
    saved ``lr``) and the steps after it on the new one's, and keep the saved weight decay. With
    ``override_scheduler`` (Megatron's ``--override-opt_param-scheduler``) this schedule and weight
    decay are followed from the saved step on, that step included."""

    def __init__(self, optimizer: torch.optim.Optimizer, lr: float, warmup_steps: int, max_steps: int | None,
                 min_lr_ratio: float, weight_decay: float = 0.0, override_scheduler: bool = False) -> None:
        self.settings = dict(lr=lr, warmup_steps=warmup_steps, max_steps=max_steps, min_lr_ratio=min_lr_ratio,
                             weight_decay=weight_decay)
        self.override_scheduler = override_scheduler
        self._weight_decays = [group.get("weight_decay", 0.0) for group in optimizer.param_groups]
        """Each group's weight decay as built (0 for vectors): loading the optimizer's state replaces it."""
        super().__init__(optimizer, _warmup_cosine(warmup_steps, max_steps, min_lr_ratio))

    _OWN = ("settings", "override_scheduler", "_weight_decays")
    """This run's, never taken from a state (LRScheduler's state is its whole ``__dict__``)."""

    def state_dict(self) -> dict[str, Any]:
        state = {k: v for k, v in super().state_dict().items() if k not in self._OWN}
        return {**state, SCHEDULE_KEY: dict(self.settings)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = {k: v for k, v in state_dict.items() if k not in self._OWN}
        saved = state.pop(SCHEDULE_KEY, None)
        error = schedule_mismatch(saved, self.settings, state.get("last_epoch", 0))
        if error is not None and not self.override_scheduler:
            raise error
        base_lrs = list(self.base_lrs)
        super().load_state_dict(state)
        if error is None:
            return
        # the saved step on, at this schedule's rates: the optimizer's groups were restored with
        # the saved schedule's lr (and initial_lr), which the next step would otherwise use
        self.base_lrs = base_lrs
        for group, base, factor, decay in zip(self.optimizer.param_groups, self.base_lrs, self.lr_lambdas,
                                              self._weight_decays):
            group["initial_lr"] = base
            group["lr"] = base * factor(self.last_epoch)
            if "weight_decay" in group:
                group["weight_decay"] = decay
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]


SCHEDULE_KEY = "lightning_mhc_schedule"
"""Where :class:`WarmupCosineSchedule`'s state keeps its settings (a checkpoint's
``lr_schedulers[0]``)."""

_SCHEDULE_TERMS = dict(lr="the peak learning rate", warmup_steps="the warm-up's length",
                       max_steps="the step the cosine decay ends at", min_lr_ratio="the final rate's share of lr",
                       weight_decay="the matrices' weight decay")


def schedule_mismatch(saved: Mapping[str, Any] | None, settings: Mapping[str, Any], step: int) -> ConfigError | None:
    """The error for resuming, at ``step``, a schedule saved with ``saved`` settings under other
    ``settings`` (None: the same, or a state saved before the settings were kept, which cannot be
    compared). Its message names, as fields, the settings that differ and ``override_scheduler`` (a
    door relabels them: the CLI's ``trainer.max_steps``, ``optim.lr`` ...)."""
    if saved is None:
        return None
    named = [(term(name, settings.get(name)), f" ({_SCHEDULE_TERMS[name]}; the checkpoint's {saved.get(name)!r})")
             for name in _SCHEDULE_TERMS if saved.get(name) != settings.get(name)]
    if not named:
        return None
    said = [part for i, pair in enumerate(named) for part in ((", ",) if i else ()) + pair]
    return ConfigError(
        "the checkpoint's learning-rate schedule differs from this run's: ", *said, ". Resume with the "
        "checkpoint's values, or set ", term("override_scheduler", True), " to follow this run's schedule from the "
        f"checkpoint's step {step} on.")


def _warmup_cosine(warmup: int, total: int | None, min_ratio: float):
    def factor(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        if total is None or total <= warmup:
            return 1.0
        progress = min(1.0, (step - warmup) / (total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
