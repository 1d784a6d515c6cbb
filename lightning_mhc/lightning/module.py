"""``MHCGPTModule``: the LightningModule to subclass for mHC GPT training."""
from __future__ import annotations

import math
import resource
from collections import deque
import time
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_mhc.model.config import MHCTransformerConfig
from lightning_mhc.model.gpt import GPTModel, gpt_forward_step, gpt_loss_func
from lightning_mhc.parallel.stages import build_gpt_stage
from lightning_mhc.recompute.policy import configure_recompute


class MHCGPTModule(pl.LightningModule):
    """An mHC GPT trained with ``MHCParallelStrategy`` (any TP/PP/DP layout).

    Batches are dicts with ``tokens`` and ``labels`` (``[batch, seq]``, long) and
    optionally ``loss_mask``. ``configure_model`` builds only this rank's
    pipeline stage; the strategy runs the 1F1B schedule over the microbatches
    of each batch. Logged: ``train_loss``, ``val_loss``, ``lr``, ``grad_norm``,
    ``tokens_per_sec`` and memory (``max_rss_mb``, ``max_cuda_mb`` on GPU).

    Subclass it to change the loss, the optimizer or the data::

        class MaskedLM(MHCGPTModule):
            def loss_func(self, per_token_loss, microbatch):      # own loss (last stage)
                w = microbatch["weights"]
                return (per_token_loss * w).sum() / w.sum()

            def configure_optimizers(self):                      # own optimizer
                return torch.optim.SGD(self.parameters(), lr=0.1)

            def train_dataloader(self):                          # own data
                return DataLoader(MyTokens(), batch_size=8)

    Args:
        model_config: an ``MHCTransformerConfig`` or a dict of its fields.
        lr, weight_decay, betas: AdamW settings.
        warmup_steps: linear warm-up steps, then cosine decay to ``min_lr_ratio * lr``
            at ``trainer.max_steps`` (constant after warm-up when max_steps is unset).
        recompute_policy / recompute_kwargs: set by ``MHCRecomputeCallback``.
    """

    def __init__(
        self,
        model_config: MHCTransformerConfig | dict,
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 100,
        min_lr_ratio: float = 0.1,
        recompute_policy: str = "none",
    ) -> None:
        super().__init__()
        if isinstance(model_config, dict):
            model_config = MHCTransformerConfig(**model_config)
        self.model_config = model_config
        self.lr, self.weight_decay, self.betas = lr, weight_decay, tuple(betas)
        self.warmup_steps, self.min_lr_ratio = warmup_steps, min_lr_ratio
        self.recompute_policy = recompute_policy
        self.recompute_kwargs: dict[str, Any] = {}
        self.model: GPTModel | None = None
        self._step_started: float | None = None
        self._val_losses: list[float] = []
        self.val_history: list[tuple[int, float]] = []
        """(global step, mean validation loss); step 0 comes from the sanity check."""
        self.throughput: deque[float] = deque(maxlen=100)
        """tokens/s of the last 100 steps (the first, warm-up step excluded)."""

    # ---------------------------------------------------------- the stage
    def configure_model(self) -> None:
        if self.model is not None:
            return
        config = configure_recompute(self.model_config, self.recompute_policy, **self.recompute_kwargs)
        self.model = build_gpt_stage(config)

    # ------------------------------------------------- pipeline contract
    def set_input_tensor(self, tensor: Tensor | None) -> None:
        self.model.set_input_tensor(tensor)

    def forward_step(self, microbatch: dict) -> Tensor:
        return gpt_forward_step(self.model, microbatch)

    def loss_func(self, per_token_loss: Tensor, microbatch: dict) -> Tensor:
        return gpt_loss_func(per_token_loss, microbatch)

    def pipeline_tensor_shape(self, microbatch: dict) -> tuple[int, ...]:
        batch, seq = microbatch["tokens"].shape
        return self.model.pipeline_tensor_shape(batch, seq)

    # ------------------------------------------------------------- steps
    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        loss = self.trainer.strategy.forward_backward(self, batch)
        self.log("train_loss", loss, prog_bar=True)
        self._log_throughput(batch)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> Tensor:
        loss = self.trainer.strategy.forward_backward(self, batch, forward_only=True)
        self.log("val_loss", loss, prog_bar=True)
        self._val_losses.append(loss.item())
        return loss

    def on_validation_epoch_end(self) -> None:
        if self._val_losses:
            self.val_history.append((self.global_step, sum(self._val_losses) / len(self._val_losses)))
        self._val_losses = []

    def test_step(self, batch: dict, batch_idx: int) -> Tensor:
        loss = self.trainer.strategy.forward_backward(self, batch, forward_only=True)
        self.log("test_loss", loss)
        return loss

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._step_started = time.perf_counter()

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        norm = getattr(self.trainer.strategy, "last_grad_norm", None)
        if norm is not None:
            self.log("grad_norm", norm)
        self.log("lr", optimizer.param_groups[0]["lr"])

    def _log_throughput(self, batch: dict) -> None:
        if self._step_started is None:
            return
        layout = getattr(self.trainer.strategy, "layout", None)
        dp = layout.data_parallel_size if layout is not None else 1
        tokens = batch["tokens"].numel() * dp
        rate = tokens / max(time.perf_counter() - self._step_started, 1e-9)
        if self.global_step > 0:
            self.throughput.append(rate)
        self.log("tokens_per_sec", rate)
        self.log("max_rss_mb", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.log("max_cuda_mb", torch.cuda.max_memory_allocated() / 2**20)

    # -------------------------------------------------------- optimizer
    def configure_optimizers(self):
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            (no_decay if p.ndim < 2 or "hyper_connection" in name else decay).append(p)
        optimizer = torch.optim.AdamW(
            [dict(params=decay, weight_decay=self.weight_decay), dict(params=no_decay, weight_decay=0.0)],
            lr=self.lr, betas=self.betas,
        )
        total = self.trainer.max_steps if self.trainer.max_steps and self.trainer.max_steps > 0 else None
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup_cosine(self.warmup_steps, total, self.min_lr_ratio))
        return dict(optimizer=optimizer, lr_scheduler=dict(scheduler=scheduler, interval="step"))


def _warmup_cosine(warmup: int, total: int | None, min_ratio: float):
    def factor(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        if total is None or total <= warmup:
            return 1.0
        progress = min(1.0, (step - warmup) / (total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
