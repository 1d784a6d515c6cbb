"""The strategies' settings: one frozen dataclass, checked when made, passed down as the value.

Both ``MHCParallelStrategy`` classes (the Trainer's and Fabric's) take its fields (the layout as
its degrees) as keyword arguments, written out in their ``__init__`` (what ``help()``, IDEs and
LightningCLI read; tests/test_settings.py keeps them equal to :data:`SETTING_NAMES` and these
defaults), or a whole ``ParallelSettings`` (the CLI builds one from its config).
"""
from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass, field
from typing import Any, Mapping

from lightning_mhc.distributed.layout import DEGREES, ParallelLayout
from lightning_mhc.errors import ConfigError, term


@dataclass(frozen=True)
class ParallelSettings:
    """Tensor, pipeline and data parallelism with megatron-core process groups: the settings.

    The layout (a :class:`~lightning_mhc.distributed.layout.ParallelLayout`, checked when made) is
    given to the strategies as its degrees:

    - ``tensor_model_parallel_size``: TP size.
    - ``pipeline_model_parallel_size``: PP size; DP is ``world_size / (TP * PP)``.
    - ``sequence_parallel``: with TP > 1, run the residual stream, norms, hyper-connections and
      bias-dropout-add on ``s / TP`` tokens per TP rank (the stream-shaped activations divide by
      TP); the sequence length must divide by TP.
    - ``virtual_pipeline_model_parallel_size``: ``v`` model chunks per pipeline stage, run by the
      interleaved 1F1B schedule (bubble ``(p - 1) / (v m)`` instead of ``(p - 1) / m``); needs
      PP >= 2, layers divisible by ``PP * v`` and a number of microbatches that is a multiple of
      PP (megatron's rule). The module implements ``model_chunks`` (``MHCGPTModule`` does).

    Args:
        layout: the layout (default: one process, TP = PP = 1).
        num_microbatches: microbatches per training step of a pipelined module
            (default: the PP size); the per-rank batch must divide by it.
        deallocate_pipeline_outputs: shrink sent stage outputs to one element (megatron's
            ``deallocate_output_tensor``; the backward goes through ``custom_backward``).
        process_group_backend: ``"gloo"`` or ``"nccl"``; default by device.
        timeout: deadline of every collective and point-to-point wait.
        seed: base seed of the parallel randomizer (dropout streams per dimension).
        gradient_bucket_bytes: size of a DP all-reduce bucket.
        overlap_grad_reduce: with DP > 1, start each bucket's DP all-reduce during the last
            microbatch's backward, as soon as its gradients are final (megatron's
            ``overlap_grad_reduce``; the same numbers as reducing after backward). Pipelined
            modules without gradient accumulation; otherwise the reduction follows backward.
        raise_on_nonfinite_loss: stop at a NaN/inf loss (and, under the Trainer, gradient norm)
            with ``FloatingPointError`` naming the step (the default); False: warn (the Trainer
            also skips that optimizer step, so the weights and checkpoints never become NaN).
        measure_activation_memory: on the first training step, record the peak activation
            bytes any stage retains (saved tensors plus the schedule's in-flight tensors) in
            ``activation_bytes`` (max over ranks).
        use_distributed_optimizer: ZeRO-1 (megatron's name): each DP rank keeps and updates the
            optimizer state of ``1/DP`` of the parameters; gradients are reduce-scattered and the
            updated weights all-gathered (``lightning_mhc/distributed/optimizer.py``). Any
            element-wise torch optimizer (SGD, Adam, AdamW, ...); one optimizer per module.

    Errors name the values by these fields (the CLI relabels them: ``ConfigError.relabel``).
    """

    layout: ParallelLayout = field(default_factory=ParallelLayout)
    num_microbatches: int | None = None
    deallocate_pipeline_outputs: bool = True
    process_group_backend: str | None = None
    timeout: datetime.timedelta = datetime.timedelta(minutes=10)
    seed: int = 1234
    gradient_bucket_bytes: int = 25 * 2**20
    overlap_grad_reduce: bool = True
    raise_on_nonfinite_loss: bool = True
    measure_activation_memory: bool = False
    use_distributed_optimizer: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.layout, ParallelLayout):
            raise ConfigError(f"layout={self.layout!r}: give a ParallelLayout.")
        for name in ("deallocate_pipeline_outputs", "overlap_grad_reduce", "raise_on_nonfinite_loss",
                     "measure_activation_memory", "use_distributed_optimizer"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(term(name, getattr(self, name)), ": must be true or false.")
        self.layout.check_microbatches(self.microbatches)
        if self.process_group_backend is not None and not isinstance(self.process_group_backend, str):
            raise ConfigError(term("process_group_backend", self.process_group_backend),
                              ": name a backend ('gloo', 'nccl'), or leave it None for the device's default.")
        if not isinstance(self.timeout, datetime.timedelta) or self.timeout.total_seconds() <= 0:
            raise ConfigError(term("timeout", self.timeout),
                              ": must be positive: the longest a collective may wait (default 10 minutes).")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**32:
            raise ConfigError(term("seed", self.seed), ": must be an integer in [0, 2**32).")
        bucket = self.gradient_bucket_bytes
        if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 1:
            raise ConfigError(term("gradient_bucket_bytes", bucket), ": must be a positive number of bytes.")

    @property
    def microbatches(self) -> int:
        """Microbatches per training step of a pipelined module (default: the PP size)."""
        return self.layout.pipeline_model_parallel_size if self.num_microbatches is None else self.num_microbatches

    @classmethod
    def of(cls, settings: ParallelSettings | None = None, **options: Any) -> ParallelSettings:
        """``settings``, or the settings made from ``options``: the layout's degrees
        (``layout.DEGREES``) and the other fields (not both)."""
        if settings is None:
            degrees = {name: options.pop(name) for name in DEGREES if name in options}
            return cls(ParallelLayout(**degrees), **options)
        if not isinstance(settings, ParallelSettings):
            raise TypeError(f"settings={settings!r}: give a ParallelSettings, or its fields as keyword arguments.")
        if options:
            raise TypeError(f"settings= and {', '.join(options)}: give a ParallelSettings or its fields as keyword "
                            "arguments, not both (dataclasses.replace(settings, ...) changes some).")
        return settings

    @classmethod
    def from_keywords(cls, settings: ParallelSettings | None, keywords: Mapping[str, Any]) -> ParallelSettings:
        """What a strategy's ``__init__`` was given: ``settings``, or the settings made of its
        keyword arguments (``keywords``: its ``locals()``, of which the :data:`SETTING_NAMES` are
        read). A keyword left at its default counts as not given, so ``settings`` with a keyword
        that changes something is refused (``of``)."""
        given = {name: keywords[name] for name in SETTING_NAMES
                 if not _is_default(keywords[name], SETTING_DEFAULTS[name])}
        return cls.of(settings, **given)


def _is_default(value: Any, default: Any) -> bool:
    # the type too: ``sequence_parallel=0`` is not the default False but a value to refuse
    return type(value) is type(default) and value == default


SETTING_NAMES = (*DEGREES, *(f.name for f in dataclasses.fields(ParallelSettings)
                             if f.init and not f.kw_only and f.name != "layout"))
"""What a strategy takes as keyword arguments: the layout's degrees, then the other settings."""

SETTING_DEFAULTS = {f.name: f.default for cls in (ParallelLayout, ParallelSettings) for f in dataclasses.fields(cls)
                    if f.name in SETTING_NAMES}
"""Their defaults (the dataclasses'), which the strategies' ``__init__`` repeat."""
