"""``ParallelLMModule``: the LightningModule for a causal language model split by ``parallelize``.

    class MyModule(ParallelLMModule):
        def configure_model(self):
            if self.model is None:
                with record_module_init():                       # meta device
                    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=128, n_head=4))
                self.model = self.parallelize(model, plan="gpt2")  # this rank's TP x PP part

    Trainer(strategy=MHCParallelStrategy(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
            callbacks=[MHCRecomputeCallback("full")],           # optional: "selective", "full"
            devices=8).fit(MyModule(), train_dataloaders=loader)

It implements the pipeline contract (``distributed/pipeline/protocol.py``) by handing each call to the
``ParallelModel``, so the strategy runs the 1F1B (or interleaved) schedule on the model as
written; checkpoints use the model's own parameter names.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_mhc.errors import ConfigError, Label
from lightning_mhc.lightning.modules.base import PipelinedLMModule
from lightning_mhc.model.divergence import StreamDivergenceMonitor
from lightning_mhc.any_model.hyper_connections import hyper_connection_blocks
from lightning_mhc.any_model.model import parallelize
from lightning_mhc.any_model.parallel_model import ParallelModel
from lightning_mhc.any_model.recompute import check_recompute
from lightning_mhc.recompute.policy import RecomputePolicy
from lightning_mhc.roles import assign_roles
from lightning_mhc.recompute.rng import replay_tracked_rng_in_hf_checkpointing


_CALLBACK_LABELS = {"policy": Label("MHCRecomputeCallback", lambda policy: f"MHCRecomputeCallback({policy!r})")}
"""How the recompute policy's rules name the callback's choice for a model split by parallelize()
(whether the model has hyper-connections, which ``mhc_block`` needs, ``parallelize`` checks)."""


class ParallelLMModule(PipelinedLMModule):
    """A causal LM trained with ``MHCParallelStrategy`` on any TP x PP x DP layout.

    Batches are dicts with ``input_ids`` (or ``tokens``) and ``labels`` (``[batch, seq]``; the
    label of a position is the next token, already shifted, unlike Hugging Face's
    ``labels=input_ids``; ``-100`` ignored), and optionally ``attention_mask``;
    :meth:`model_inputs` turns a microbatch into the model's keyword arguments. Override it, the
    loss (:meth:`loss_func`) or the optimizer as with any LightningModule.

    Args:
        lr, weight_decay, betas: AdamW settings.
    """

    supports_context_parallel = True
    """``parallelize`` splits the sequence over CP ranks (the Hugging Face families of
    ``any_model.context_parallel``; it refuses the others): batches stay whole, the model cuts them."""

    def __init__(self, lr: float = 1e-3, weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.95)) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.lr, self.weight_decay, self.betas = lr, weight_decay, tuple(betas)
        self.model: ParallelModel | None = None
        """This rank's part of the model: set in ``configure_model`` with ``parallelize(...)``."""

    def parallelize(self, model: torch.nn.Module, plan: Any = None, **kwargs: Any) -> ParallelModel:
        """:func:`lightning_mhc.any_model.parallelize` on this module's :attr:`layout`, with the
        recompute policy an ``MHCRecomputeCallback`` chose (``none``, ``selective``, ``full``;
        ``mhc_block`` with ``hyper_connections=n``), if one did."""
        kwargs.setdefault("layout", self.layout)
        if self.recompute_policy is not None:
            kwargs.setdefault("recompute", self.recompute_policy)
        return parallelize(model, plan, **kwargs)

    def check_recompute_policy(self, policy: RecomputePolicy) -> None:
        try:
            check_recompute(policy)
        except ConfigError as error:
            raise error.relabel(_CALLBACK_LABELS) from None

    def attach_stream_divergence(self) -> StreamDivergenceMonitor | None:
        """The retrofit's blocks report their streams to the monitor (before the last block's mean)."""
        blocks = hyper_connection_blocks(self.model) if self.model is not None else []
        if not blocks:
            return None
        monitor = StreamDivergenceMonitor(blocks[0].hyper_connection_wiring.n)
        for block in blocks:
            assign_roles(block, hyper_connection_observer=monitor.observe)
        return monitor

    def _check_built_policy(self) -> None:
        """The model was built with the recompute policy the callback chose (when one did)."""
        built = self._parallel_model().recompute
        if self.recompute_policy is not None and built != self.recompute_policy:
            raise ConfigError(
                f"MHCRecomputeCallback({self.recompute_policy.name!r}) is given, but {type(self).__name__}."
                f"configure_model built the model with recompute={built.name!r}: build it with "
                "self.parallelize(model, plan) and no recompute= of its own (or pass "
                "recompute=self.recompute_policy to parallelize()).")

    def _parallel_model(self) -> ParallelModel:
        if not isinstance(self.model, ParallelModel):
            raise ConfigError(
                f"{type(self).__name__}.configure_model must set self.model = parallelize(model, plan=...) "
                f"(a model built under record_module_init()); it is {type(self.model).__name__}.")
        return self.model

    # ------------------------------------------------------------ the contract
    def model_inputs(self, microbatch: dict) -> dict[str, Any]:
        """The model's keyword arguments for a microbatch."""
        inputs = {"input_ids": _field(microbatch, "input_ids", "tokens")}
        if "attention_mask" in microbatch:
            inputs["attention_mask"] = microbatch["attention_mask"]
        return inputs

    def set_input_tensor(self, tensor: Tensor | None, chunk: int = 0) -> None:
        self._parallel_model().set_input_tensor(tensor, chunk)

    def forward_step(self, microbatch: dict, chunk: int = 0) -> Tensor:
        return self._parallel_model().forward_step(self.model_inputs(microbatch), chunk)

    def loss_func(self, logits: Tensor, microbatch: dict) -> Tensor:
        return self._parallel_model().loss(logits, _field(microbatch, "labels"))

    def pipeline_tensor_shape(self, microbatch: dict) -> tuple[int, ...]:
        # every rank calls this before the schedule: a batch without labels fails on all of them
        # here, not on the last stage alone while the others wait for it
        if type(self).loss_func is ParallelLMModule.loss_func:
            _field(microbatch, "labels")
        return self._parallel_model().pipeline_tensor_shape(self.model_inputs(microbatch))

    def model_chunks(self) -> list[torch.nn.Module]:
        return list(self._parallel_model().chunks)

    def global_name_in_model(self, name: str) -> str:
        """The whole model's name: checkpoints load on any layout and into the model as written
        (``lightning_mhc.any_model.load_checkpoint``)."""
        return self._parallel_model().global_parameter_name(name)

    def on_fit_start(self) -> None:
        """The model was built with the recompute policy; every rank prints what it materialised
        against the whole model (about 1/(TP*PP))."""
        super().on_fit_start()
        self._check_built_policy()
        # gradient_checkpointing_enable() after self.parallelize(...): its recomputes replay the randomizer
        for chunk in self._parallel_model().chunks:
            replay_tracked_rng_in_hf_checkpointing(chunk)
        layout = getattr(self.trainer.strategy, "layout", None)
        where = (f" (tp {layout.tensor_model_parallel_rank}, pp {layout.pipeline_model_parallel_rank}, "
                 f"dp {layout.data_parallel_rank})" if layout is not None else "")
        print(f"rank {self.global_rank}{where}: {self._parallel_model().report}", flush=True)

    def uses_experts(self) -> bool:
        return isinstance(self.model, ParallelModel) and self.model.router_loss is not None

    def _log_moe_statistics(self) -> None:
        """A Hugging Face MoE family's routing, as the GPT's (``moe_step_statistics``): per router
        its tokens per expert summed over the step's microbatches and the DP x CP ranks, gathered over
        the model-parallel group (``moe/<router>/tokens_per_expert/<e>``, ``moe/<router>/balance``),
        and with the model's own router loss its mean over the microbatches and DP ranks
        (``moe/aux_loss``, before ``router_aux_loss_coef``; the loss holds coef x it). Every step
        takes the counts; the steps Lightning logs log them (collective on every rank)."""
        router_loss = self.model.router_loss if isinstance(self.model, ParallelModel) else None
        if router_loss is None:
            return super()._log_moe_statistics()
        counts, aux_loss = router_loss.take_step_statistics()
        if not self._log_step:
            return
        from lightning_mhc.model.moe_mlp import moe_step_statistics

        layout = getattr(self.trainer.strategy, "layout", None)
        built = layout is not None and layout.groups is not None
        figures = moe_step_statistics([(name, _Taken(c)) for name, c in sorted(counts.items())],
                                      layout.dp_cp_group if built else None,
                                      layout.model_parallel_group if built else None)
        if router_loss.active:
            # the last stage's ranks hold it; every rank logs the mean over them (DP, and the same
            # value on their CP and TP peers)
            held = torch.tensor([aux_loss or 0.0, 1.0 if aux_loss is not None else 0.0], dtype=torch.float64,
                                device=self.device)
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(held)
            figures["moe/aux_loss"] = (held[0] / held[1]).item()
        for name, value in figures.items():
            self.log(name, value)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, betas=self.betas, weight_decay=self.weight_decay)


class _Taken:
    """One router's counts of a step, as ``moe_step_statistics`` takes a layer's."""

    def __init__(self, counts: Tensor) -> None:
        self.counts = counts

    def take_step_statistics(self) -> tuple[Tensor, dict, int]:
        return self.counts, {}, 1


def _field(microbatch: Any, *names: str) -> Tensor:
    """The first of ``names`` in a dict microbatch; a clear error for any other batch."""
    if isinstance(microbatch, Mapping):
        for name in names:
            if name in microbatch:
                return microbatch[name]
        found = f"keys {sorted(map(str, microbatch))}"
    else:
        found = f"a {type(microbatch).__name__}"
    raise ConfigError(
        f"ParallelLMModule needs dict batches with {' or '.join(repr(n) for n in names)}; the DataLoader gave {found}. "
        "Yield {'input_ids': ..., 'labels': ...} (labels already shifted to the next token), or override "
        "model_inputs()/loss_func() for another batch format.")
