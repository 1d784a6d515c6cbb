"""``ParallelModel``: this rank's chunks of a model split by ``parallelize`` (``model.py``), and
their side of the pipeline contract: the stage's forward, the hand-over between stages, the
causal-LM loss (vocab-parallel when the head is split, this rank's part under CP, plus a MoE
family's router loss) and the whole model's names for checkpoints.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_mhc.errors import ConfigError
from lightning_mhc.distributed.layout import ParallelLayout
from lightning_mhc.distributed.placement import place
from lightning_mhc.any_model.adapters import place_injected_adapters
from lightning_mhc.any_model.context_parallel import SequenceSplit
from lightning_mhc.any_model.families import family_of
from lightning_mhc.any_model.pipeline import FirstStageStub, replace_hidden_states
from lightning_mhc.any_model.router_bias import RouterBias, biased_routers
from lightning_mhc.any_model.router_loss import RouterLoss, router_loss_for
from lightning_mhc.layers.loss import token_mean_loss
from lightning_mhc.recompute.policy import RecomputePolicy
from lightning_mhc.recompute.rng import hf_checkpointing_modules, replay_tracked_rng_in_hf_checkpointing, rng_fork
from lightning_mhc.wrapping import wrap

if TYPE_CHECKING:
    from lightning_mhc.any_model.pipeline import StageSplit
    from lightning_mhc.any_model.record import Materializer

IGNORE_INDEX = -100


class _StageExit(Exception):
    """Raised after a non-last stage's last block: carries what goes to the next stage."""

    def __init__(self, hidden: Tensor) -> None:
        super().__init__()
        self.hidden = hidden


@dataclass(frozen=True)
class MaterializedReport:
    """Parameters this rank holds against the whole model (tied tensors counted once)."""

    rank_parameters: int
    whole_parameters: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int

    @property
    def fraction(self) -> float:
        return self.rank_parameters / self.whole_parameters

    def __str__(self) -> str:
        ideal = 1 / (self.tensor_model_parallel_size * self.pipeline_model_parallel_size)
        return (f"{self.rank_parameters:,} of {self.whole_parameters:,} parameters materialised "
                f"({self.fraction:.3f}; 1/(TP*PP) = {ideal:.3f})")


class ParallelModel(nn.Module):
    """This rank's chunks of a model split by :func:`parallelize` (one chunk, or ``v`` with a
    virtual pipeline), and the pipeline contract over them: ``set_input_tensor``,
    ``forward_step`` (the model's own forward on the stage), ``loss`` (causal-LM cross entropy,
    vocab-parallel when the head is split), ``pipeline_tensor_shape`` and
    ``global_parameter_name`` (the whole model's names: checkpoints reshard).

    With PP = 1, ``model(input_ids=...)`` is the model's forward (logits; split over the
    vocabulary when ``vocab_parallel_logits``). Under context parallelism it takes the whole
    sequence and returns this rank's chunks' logits (``any_model/context_parallel.py``)."""

    def __init__(self, chunks: list[nn.Module], num_virtual_stages: int, hidden_size: int,
                 vocab_parallel_logits: bool, aliases: dict[str, str], report: MaterializedReport,
                 forward_kwargs: dict[str, Any], recompute: RecomputePolicy = RecomputePolicy(),
                 sequence_shards: int = 1, sequence_split: SequenceSplit | None = None) -> None:
        super().__init__()
        self.sequence_split = sequence_split
        """Under context parallelism: the whole sequence given is cut to this rank's chunks (inputs, labels)."""
        self.sequence_shards = sequence_shards
        """TP under sequence parallelism (each rank's blocks hold ``seq / sequence_shards`` tokens), else 1."""
        self.recompute = recompute
        """The recompute policy the blocks were built with (``parallelize(recompute=...)``)."""
        self.chunks = nn.ModuleList(chunks)
        self._checkpointing_modules = [hf_checkpointing_modules(chunk) for chunk in chunks]
        """Per chunk, the modules ``gradient_checkpointing_enable()`` may give a checkpointing function."""
        self.num_virtual_stages = num_virtual_stages
        self.hidden_size = hidden_size
        self.vocab_parallel_logits = vocab_parallel_logits
        self.aliases = aliases
        self.report = report
        self.forward_kwargs = forward_kwargs
        self._inputs: list[Tensor | None] = [None] * len(chunks)
        self.router_bias: RouterBias | None = None
        """Auxiliary-free balancing of the family's biased routers, where asked (``router_bias.py``)."""
        self.router_loss: RouterLoss | None = None
        """A Hugging Face MoE family's own router loss, where its config asks for it
        (``output_router_logits``): added to :meth:`loss` (``router_loss.py``)."""
        self._running: int | None = None
        self._blocks_ran = False

    # ------------------------------------------------------------------ contract
    def set_input_tensor(self, tensor: Tensor | None, chunk: int = 0) -> None:
        self._inputs[chunk] = tensor

    def forward_step(self, inputs: Mapping[str, Any], chunk: int = 0) -> Tensor:
        """The stage's part of the model's forward on ``inputs`` (the model's keyword arguments):
        the activations for the next stage, or the logits on the last."""
        if self.training and torch.is_grad_enabled():  # HF checkpointing may be turned on at any time
            replay_tracked_rng_in_hf_checkpointing(self.chunks[chunk], self._checkpointing_modules[chunk])
        if self.sequence_split is not None:
            inputs = self.sequence_split.split_inputs(inputs)
        self._running, self._blocks_ran = chunk, False
        router_loss = self.router_loss
        if router_loss is not None:
            router_loss.begin(chunk, inputs.get("attention_mask"), self.sequence_split)
        final = chunk == len(self.chunks) - 1
        try:
            with rng_fork("tensor"):  # replicated across TP, distinct per DP and PP rank
                try:
                    output = self.chunks[chunk](**inputs, **self.forward_kwargs)
                except _StageExit as stop:
                    output, final = stop.hidden, False
        finally:
            self._running = None
        if not final:
            return output if router_loss is None else router_loss.end(chunk, output, False)
        logits = _logits(output)
        return logits if router_loss is None else router_loss.end(chunk, logits, True)

    def forward(self, **inputs: Any) -> Tensor:
        if len(self.chunks) != 1 or self.num_virtual_stages != 1:
            raise RuntimeError("a pipelined model runs through the strategy's schedule (forward_backward), not "
                               "model(...): call it directly only with pipeline_model_parallel_size=1")
        return self.forward_step(inputs)

    def loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        """Mean next-token cross entropy over the labels that are not ``-100`` (``labels[b, s]``
        is the target of position ``s``); fp32; over the vocabulary slices when split. Under context
        parallelism ``labels`` are the whole sequence's, the logits this rank's chunks', and the
        result is this rank's part of the mean (``SequenceSplit.loss``)."""
        if self.sequence_split is not None:
            labels = self.sequence_split.split_labels(labels)
        keep = labels != IGNORE_INDEX
        if self.vocab_parallel_logits:
            from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

            per_token = vocab_parallel_cross_entropy(logits.float(), labels.masked_fill(~keep, 0)) * keep
        else:
            per_token = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=IGNORE_INDEX,
                                        reduction="none").view_as(labels)
        if self.sequence_split is not None:
            loss = self.sequence_split.loss(per_token, keep)
        else:
            loss = token_mean_loss(per_token, keep)  # 0, not NaN, when every label is ignored
        term = self.router_loss.loss_term(logits) if self.router_loss is not None else None
        return loss if term is None else loss + term  # as the model's own loss: CE + coef x its router loss

    def pipeline_tensor_shape(self, inputs: Mapping[str, Any]) -> tuple[int, ...]:
        """What crosses stages: the hidden states ``[batch, seq, hidden]`` (``seq / TP`` under
        sequence parallelism, ``/ CP`` under context parallelism; ``hidden``: ``n * C`` with ``n``
        hyper-connection streams)."""
        first = next(v for v in inputs.values() if isinstance(v, Tensor))
        cp = self.sequence_split.size if self.sequence_split is not None else 1
        return (first.shape[0], first.shape[1] // (self.sequence_shards * cp), self.hidden_size)

    def global_parameter_name(self, name: str) -> str:
        """A state-dict name of this module as the whole model names it: no chunk prefix, and a
        tied tensor under its owner's name (one entry in checkpoints)."""
        if name.startswith("chunks."):
            name = name.split(".", 2)[2]
        return self.aliases.get(name, name)

    def place_injected_adapters(self, layout: ParallelLayout) -> list[str]:
        """PEFT's adapters injected into this split model (``get_peft_model(parallelize(...))``),
        drawn from the model's seed by their whole-model names and placed like the layers they
        adapt (``adapters.place_injected_adapters``); the strategy calls it at fit start."""
        return place_injected_adapters(self, layout, getattr(self, "seed", 0), self.global_parameter_name)

    def connect_stages(self, split: StageSplit, materializer: Materializer, layout: ParallelLayout) -> None:
        """This model's side of the pipeline contract hooked onto its built chunks (``split``): a
        stage's first block takes the previous stage's activations, its last block ends the
        forward before the last stage, and a first-stage part run after the blocks is refused
        (``FirstStageStub``); the tied tensors this rank holds of those tied across stages are
        marked: their gradient is summed between the first and the last stage."""
        last_stage = layout.num_virtual_stages - 1
        for index, chunk in enumerate(split.chunks):
            if not chunk.blocks:  # no block list: the whole model is the one stage
                continue
            first_block, last_block = chunk.blocks[min(chunk.blocks)], chunk.blocks[max(chunk.blocks)]
            if chunk.stage > 0:  # takes the previous stage's activations
                wrap(first_block, "stage_input", functools.partial(self._take_input, index), with_kwargs=True)
            if chunk.stage < last_stage:  # the stage ends here
                wrap(last_block, "stage_end", functools.partial(self._stop, index))
        for chunk in self.chunks:
            for stub in chunk.modules():
                if isinstance(stub, FirstStageStub):
                    wrap(stub, "first_stage_stub", self._stub_called)
        for meta_id in split.tied_across_stages:
            held = materializer.real.get(meta_id)
            if held is not None and any(p is held for p in self.parameters()):
                place(held, shared_embedding=True)

    def attach_router_loss(self, model: nn.Module, layout: ParallelLayout) -> None:
        """The family's own router loss (``Family.router_loss``) where the model's config asks for it:
        the model's forward then leaves its own out (each stage would take it over its layers only)."""
        family = family_of(model)
        router_loss = router_loss_for(list(self.chunks), family.router_loss if family else None,
                                      getattr(model, "config", None), layout)
        if router_loss is not None:
            self.router_loss = router_loss
            if router_loss.active:
                self.forward_kwargs = {**self.forward_kwargs, "output_router_logits": False}

    def attach_router_bias(self, model: nn.Module, rate: float, layout: ParallelLayout) -> None:
        """Auxiliary-free balancing of the family's biased routers on this rank, at ``rate`` (0: none):
        a submodule the runtime updates once per optimizer step (``router_bias.py``)."""
        family = family_of(model)
        if rate and family is not None and family.router_bias is not None:
            self.router_bias = RouterBias(biased_routers(list(self.chunks), family.router_bias), rate, layout)

    # ------------------------------------------------------------------ hooks
    def _take_input(self, chunk: int, module: nn.Module, args: tuple, kwargs: dict):
        if self._running != chunk:
            return None
        self._blocks_ran = True
        received = self._inputs[chunk]
        if received is None:
            raise RuntimeError("no input tensor was set for a stage after the first (set_input_tensor)")
        return replace_hidden_states(module, args, kwargs, lambda _: received,
                                     "the pipeline cannot hand it the previous stage's activations")

    def _stub_called(self, stub: FirstStageStub, args: tuple) -> None:
        if self._blocks_ran:
            raise ConfigError(
                f"{stub.part_name} is registered before the block list, so it was placed on the first pipeline stage, "
                "but the model's forward runs it after its blocks: name it in the plan's after_blocks "
                f"(TPPlan(after_blocks=('{stub.part_name}',))).")

    def _stop(self, chunk: int, module: nn.Module, args: tuple, output: Any) -> None:
        if self._running == chunk:
            hidden = output if isinstance(output, Tensor) else output[0]
            # the schedule frees a sent output's storage once sent; a view (OPT's blocks end with
            # .view()) shares its base's, which the graph still needs
            raise _StageExit(hidden.clone() if hidden._base is not None else hidden)


def _logits(output: Any) -> Tensor:
    if isinstance(output, Tensor):
        return output
    logits = getattr(output, "logits", None)
    return logits if isinstance(logits, Tensor) else output[0]


def stage_forward_kwargs(model: nn.Module) -> dict[str, Any]:
    """Keyword arguments every stage forward gets: no KV cache for a model that would make one."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {"use_cache": False} if "use_cache" in parameters else {}

