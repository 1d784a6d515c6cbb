"""``MHCGPTModule``: the LightningModule to subclass for mHC GPT training."""
from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_mhc.errors import ConfigError
from lightning_mhc.lightning.modules.base import OPTIMIZERS, PipelinedLMModule
from lightning_mhc.model.moe import MoELayer
from lightning_mhc.model.config import (
    PARALLEL_LAYOUT_FIELDS,
    MHCTransformerConfig,
    requested_parallel_layout,
    with_parallel_layout,
)
from lightning_mhc.model.config_dict import is_plain, model_config_from_dict, model_config_to_dict
from lightning_mhc.model.divergence import StreamDivergenceMonitor
from lightning_mhc.model.flops import training_flops_per_token
from lightning_mhc.model.gpt import GPTModel, gpt_forward_step, gpt_loss_func
from lightning_mhc.model.stages import build_gpt_chunks
from lightning_mhc.recompute.policy import RecomputePolicy
from lightning_mhc.wrapping import wrap

class MHCGPTModule(PipelinedLMModule):
    """An mHC GPT trained with ``MHCParallelStrategy`` (any TP/CP/PP/DP layout).

    Batches are dicts with ``tokens`` and ``labels`` (``[batch, seq]``, long) and
    optionally ``loss_mask``. ``configure_model`` builds only this rank's
    pipeline stage; the strategy runs the 1F1B schedule over the microbatches
    of each batch. Logged: ``train_loss``, ``val_loss``, ``lr``, ``grad_norm``,
    ``tokens_per_sec``, ``tokens_consumed``, ``mfu`` (model FLOPs utilisation, where the device's
    peak is known) and memory (``max_rss_mb``, ``max_cuda_mb`` on GPU).

    Subclass it to change the loss, the optimizer or the data::

        class MaskedLM(MHCGPTModule):
            def loss_func(self, per_token_loss, microbatch):      # own loss (last stage)
                w = microbatch["weights"]
                return (per_token_loss * w).sum() / w.sum()

            def configure_optimizers(self):                      # own optimizer
                return torch.optim.SGD(self.parameters(), lr=0.1)

            def train_dataloader(self):                          # own data
                return DataLoader(MyTokens(), batch_size=8)

    The hyperparameters are saved (``self.hparams``: loggers, checkpoints, LightningCLI's
    config): ``model_config`` as a plain dict, the user's own when a plain dict was given, else
    ``model_config_to_dict(config)`` (the fields that differ from the defaults), so that
    ``MHCGPTModule(**module.hparams)`` rebuilds the module. The parallel layout is the
    strategy's: ``configure_model`` sets TP/PP on the built config and raises ConfigError when
    ``model_config`` asks for another.

    Args:
        model_config: a dict of ``MHCTransformerConfig`` fields (``activation: swiglu`` names the
            activation; see ``model_config_from_dict``) or an ``MHCTransformerConfig``.
        lr, weight_decay, betas: AdamW settings.
        optimizer: ``"adamw"``, ``"sgd"`` (momentum ``betas[0]``) or ``"adafactor"`` (not element-wise:
            refused by the distributed optimizer).
        warmup_steps: linear warm-up steps, then cosine decay to ``min_lr_ratio * lr``
            at ``trainer.max_steps`` (constant after warm-up when max_steps is unset).
        override_scheduler: resuming from a checkpoint whose schedule had other settings (``lr``,
            ``warmup_steps``, ``min_lr_ratio``, ``max_steps``, ``weight_decay``) follows this module's
            schedule from the checkpoint's step; without it that resume is refused (``WarmupCosineSchedule``).
        recompute_policy: ``none``, ``selective``, ``mhc_block`` or ``full``, or a
            :class:`RecomputePolicy` with options; ``MHCRecomputeCallback`` sets it too
            (``configure_recompute``).
        peak_flops: one device's peak FLOP/s, for the logged ``mfu``; None: the figure of a known
            GPU (``lightning_mhc.model.flops``), and no ``mfu`` on CPU or an unknown device.
    """

    supports_context_parallel = True
    """Its model splits the sequence over CP ranks (``GPTModel.on_this_rank``)."""

    def __init__(
        self,
        model_config: dict[str, Any] | MHCTransformerConfig,
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 100,
        min_lr_ratio: float = 0.1,
        recompute_policy: str | Mapping[str, Any] | RecomputePolicy = "none",
        peak_flops: float | None = None,
        optimizer: str = "adamw",
        override_scheduler: bool = False,
    ) -> None:
        super().__init__()
        if optimizer not in OPTIMIZERS:
            raise ConfigError(f"optimizer={optimizer!r}: choose one of {', '.join(OPTIMIZERS)}.")
        self._requested_layout = requested_parallel_layout(model_config)
        if isinstance(model_config, Mapping):  # the layout is set (and checked) in configure_model
            config = model_config_from_dict(
                {k: v for k, v in model_config.items() if k not in PARALLEL_LAYOUT_FIELDS})
            recorded = (copy.deepcopy(dict(model_config)) if is_plain(model_config)
                        else model_config_to_dict(config, strict=False))
        else:
            config, recorded = model_config, model_config_to_dict(model_config, strict=False)
        self.model_config = config
        """The model's config; ``configure_model`` builds the model from it under the strategy's layout."""
        self.configure_recompute(recompute_policy)
        model_config = recorded  # noqa: F841 -- what save_hyperparameters() reads from this frame
        recompute_policy = self.recompute_policy.to_plain()  # noqa: F841 -- likewise
        self.save_hyperparameters()
        if not is_plain(self.hparams.get("model_config")):  # a subclass passed its config object on
            self.save_hyperparameters({**self.hparams, "model_config": recorded})
        self.lr, self.weight_decay, self.betas = lr, weight_decay, tuple(betas)
        self.warmup_steps, self.min_lr_ratio = warmup_steps, min_lr_ratio
        self.peak_flops = peak_flops
        self.optimizer_name = optimizer
        self.override_scheduler = override_scheduler
        self.model: GPTModel | torch.nn.ModuleList | None = None
        """This rank's stage (a ModuleList of its chunks with a virtual pipeline; see model_chunks)."""
        self.generation_kwargs: dict[str, Any] = dict(max_new_tokens=32)
        """What ``predict_step`` passes to ``GPTModel.generate``."""

    # ---------------------------------------------------------- the stage
    def configure_model(self) -> None:
        if self.model is not None:
            return
        layout = self.layout
        config = with_parallel_layout(self.recompute_policy.apply(self.model_config), layout, self._requested_layout)
        chunks = build_gpt_chunks(config, layout)
        self.model = chunks[0] if len(chunks) == 1 else torch.nn.ModuleList(chunks)

    def attach_stream_divergence(self) -> StreamDivergenceMonitor | None:
        """A forward hook on each of this rank's layers: their outputs are the ``n`` streams."""
        config = self.model_config
        if not config.enable_hyper_connections or config.num_residual_streams < 2:
            return None
        monitor = StreamDivergenceMonitor(config.num_residual_streams)
        for chunk in self.model_chunks():
            for layer in chunk.decoder.layers:
                wrap(layer, "stream_divergence", monitor.output_hook(f"decoder.layers.{layer.layer_number - 1}"))
        return monitor

    def moe_layers(self) -> list[tuple[str, Any]]:
        """``(decoder.layers.<i>, MoELayer)`` of this rank's chunks, ``i`` the global layer index."""
        if self.model is None:
            return []
        found = []
        for chunk in self.model_chunks():
            for name, module in chunk.named_modules():
                if isinstance(module, MoELayer):
                    found.append((chunk.global_parameter_name(name).removesuffix(".mlp.moe"), module))
        return found

    def uses_experts(self) -> bool:
        return bool(self.model_config.num_moe_experts)

    def model_chunks(self) -> list[GPTModel]:
        """This rank's model chunks: its stage, or its virtual-pipeline chunks in order."""
        return list(self.model) if isinstance(self.model, torch.nn.ModuleList) else [self.model]

    def global_name_in_model(self, name: str) -> str:
        """``<chunk>.decoder.layers.<i>`` becomes ``decoder.layers.<i + the chunk's first layer>``."""
        if isinstance(self.model, torch.nn.ModuleList):
            index, rest = name.split(".", 1)
            return self.model[int(index)].global_parameter_name(rest)
        return self.model.global_parameter_name(name)

    def check_recompute_policy(self, policy: RecomputePolicy) -> None:
        policy.check_model(self.model_config.enable_hyper_connections)

    # ------------------------------------------------- pipeline contract
    def set_input_tensor(self, tensor: Tensor | None, chunk: int = 0) -> None:
        self.model_chunks()[chunk].set_input_tensor(tensor)

    def forward_step(self, microbatch: dict, chunk: int = 0) -> Tensor:
        return gpt_forward_step(self.model_chunks()[chunk], microbatch)

    def loss_func(self, per_token_loss: Tensor, microbatch: dict) -> Tensor:
        """The micro-batch's mean loss; under context parallelism this rank's part of it (see
        ``gpt_loss_func``: a subclass's own loss must be a part too, summing to the mean over CP)."""
        last = self.model_chunks()[-1]
        return gpt_loss_func(per_token_loss, last.on_this_rank(microbatch), last.context_parallel_group)

    def pipeline_tensor_shape(self, microbatch: dict) -> tuple[int, ...]:
        batch, seq = microbatch["tokens"].shape
        return self.model_chunks()[0].pipeline_tensor_shape(batch, seq)

    # ------------------------------------------------------------- steps
    def predict_step(self, batch: dict, batch_idx: int = 0) -> Tensor:
        """Continue ``batch["tokens"]`` (``[b, s]``) by ``generation_kwargs`` (``GPTModel.generate``:
        ``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``, ``stop_token``); the whole model
        is needed (TP = PP = 1; any DP size, each rank continues its own batch)."""
        chunks = self.model_chunks()
        if len(chunks) != 1 or not (chunks[0].pre_process and chunks[0].post_process) \
                or chunks[0].config.tensor_model_parallel_size != 1 or chunks[0].config.context_parallel_size != 1:
            raise ConfigError("predict_step generates with the whole model in each process: run predict with "
                              "MHCParallelStrategy(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, "
                              "context_parallel_size=1), "
                              "or load the checkpoint with MHCGPTModule.load_from_checkpoint(dir).")
        tokens = batch["tokens"] if isinstance(batch, Mapping) else batch
        return chunks[0].generate(tokens, **self.generation_kwargs)

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path, map_location=None, hparams_file=None, strict=None, **kwargs):
        """The whole module in this process (TP = PP = 1, eval mode) from a checkpoint directory
        saved on any layout; ``kwargs`` override the saved hyperparameters. A file goes to
        Lightning's own ``load_from_checkpoint``."""
        from pathlib import Path

        from lightning_mhc.checkpoint.format import load_whole, read_metadata, read_trainer_state

        path = Path(checkpoint_path)
        if path.is_file():
            return super().load_from_checkpoint(checkpoint_path, map_location, hparams_file, strict, **kwargs)
        read_metadata(path)  # a clear error for a missing, incomplete or earlier-format checkpoint, before anything is built
        state = read_trainer_state(path)
        hparams = {**(state.get("hyper_parameters") or {}), **kwargs}
        if "model_config" not in hparams:
            raise ConfigError(
                f"checkpoint {path} records no model_config hyperparameter (it was not saved from an MHCGPTModule): "
                "build the model yourself and load it with lightning_mhc.checkpoint.format.load_whole(path, model).")
        module = cls(**hparams)
        module.configure_model()  # outside any run: on the one-process layout (PipelinedLMModule.layout)
        load_whole(path, module)
        module.on_load_checkpoint(state)
        if map_location is not None:
            module.to(map_location)
        return module.eval()

    # -------------------------------------------------------- optimizer
    def configure_optimizers(self, max_steps: int | None = None):
        """AdamW (or ``optimizer``: SGD with momentum ``betas[0]``, Adafactor; no weight decay on vectors
        and hyper-connections) with linear warm-up, then cosine decay to ``min_lr_ratio * lr`` at
        ``max_steps`` (default: the Trainer's ``max_steps``; in a Fabric loop, pass it). Returns
        Lightning's dict: ``["optimizer"]`` and ``["lr_scheduler"]["scheduler"]`` (stepped every
        optimizer step)."""
        return self.warmup_cosine_optimizer(self.optimizer_name, self.lr, self.weight_decay, self.betas,
                                            self.warmup_steps, self.min_lr_ratio, max_steps,
                                            override_scheduler=self.override_scheduler)

    def flops_per_token(self, seq_length: int) -> float | None:
        return training_flops_per_token(self.model_config, seq_length)
