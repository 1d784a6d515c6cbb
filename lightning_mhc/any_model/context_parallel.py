"""Context parallelism (CP) for a Hugging Face model split by ``parallelize``: its attention routed
through :func:`~lightning_mhc.distributed.context_parallel.context_parallel_attention` by
transformers' own attention registry, without touching the model's code.

``split_over_context(model, layout)`` (one call in ``parallelize``) registers an attention function
and a mask function under one name per CP group (``AttentionInterface.register``,
``AttentionMaskInterface.register``) and switches the model to it (``set_attn_implementation``).
The model then runs on this rank's two chunks of each sequence (``shard_sequence``: chunks ``r``
and ``2·cp − 1 − r`` of ``2·cp``), with their GLOBAL position ids given explicitly (RoPE's angles
are those of the un-split sequence), and each attention all-gathers K/V over the CP group:

- **GQA.** transformers 5 hands the registry function K/V before ``repeat_kv`` (the repeat is
  the attention function's job: ``sdpa_attention_forward``), so only the model's K/V heads are
  gathered; SDPA repeats them after the gather (``enable_gqa``).
- **The padding mask.** The model's ``attention_mask`` ``[b, s]`` stays whole (the batch's, the
  same on every CP rank); the registered mask function hands it on as it is, and the attention
  applies it to the gathered keys, which are in global order. The causal mask is the CP
  attention's own (the model's ``[s/cp, s/cp]`` mask would be the wrong one).
- **Labels** are the next tokens already (``ParallelLMModule``'s batches), so they are split like
  the inputs and no label crosses a chunk boundary; the loss is a rank's part of the micro-batch's
  mean: its masked sum over the token count summed over CP (``layers.loss.token_mean_loss``, the GPT's too).

Attention the all-gather cannot reproduce exactly is refused before anything is built: sliding
windows, logit softcapping, attention sinks, and any family not checked under CP, except where the
family's record splits its own attention (``FamilyRecord.context_parallel_attention``:
DeepSeek-V4's window and compressed attention, ``deepseek_v4_context.py``; HY-V4's latent attention
and indexer, ``hy_v4_context.py``).
"""
from __future__ import annotations

import functools
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_mhc.distributed.context_parallel import context_parallel_attention
from lightning_mhc.distributed.layout import ParallelLayout
from lightning_mhc.distributed.process_state import register_for_the_run
from lightning_mhc.errors import ConfigError
from lightning_mhc.any_model.families import FAMILIES, NOT_CHECKED_UNDER_CP, context_parallel_families
from lightning_mhc.layers import sequence

SUPPORTED_FAMILIES = context_parallel_families()
"""The ``model_type``s split over CP (the records that claim it, ``families.py``): RoPE on explicit
position ids, causal attention through the registry, nothing but a padding mask beside the causal
one (Llama; Mistral, Qwen2 and Qwen3 without a sliding window), or the family's own CP attention
(DeepSeek-V4, HY-V4)."""

SPLIT_INPUTS = ("input_ids", "inputs_embeds")
"""The model's inputs cut into this rank's chunks (sequence on dim 1)."""

_NAME_PREFIX = "lightning_mhc_context_parallel"


class SequenceSplit(sequence.SequenceSplit):
    """How this rank's model sees a sequence under CP: its two chunks, their global positions,
    and its part of the loss (the layer's split), in a Hugging Face model's keyword arguments.
    ``ParallelModel`` applies it to the whole sequence it is given."""

    def split_inputs(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """The model's keyword arguments for the whole sequence -> this rank's: ``input_ids``
        (``inputs_embeds``) cut into its chunks, ``position_ids`` their global positions,
        ``attention_mask`` kept whole (the attention applies it to the gathered keys)."""
        if inputs.get("position_ids") is not None:
            raise ConfigError("position_ids given to a model split over context parallelism: its positions are the "
                              "chunks' global ones, made here (packed sequences are not split over CP); leave "
                              "position_ids out of the batch.")
        _register(self.group, unless_registered=True)  # taken out by a run's teardown: a later run's forward
        split = self.shard_batch(inputs, SPLIT_INPUTS)
        whole = next(inputs[key] for key in SPLIT_INPUTS if inputs.get(key) is not None)
        batch, seq_len = whole.shape[:2]
        split["position_ids"] = self.positions(seq_len, device=whole.device).expand(batch, -1)
        return split

    def split_labels(self, labels: Tensor) -> Tensor:
        """This rank's chunks of ``[b, s]`` labels (already shifted to the next token)."""
        return self.shard(labels)


def split_over_context(model: nn.Module, layout: ParallelLayout) -> SequenceSplit | None:
    """Route ``model``'s attention through CP over ``layout``'s CP group (None when CP is 1)."""
    cp = layout.context_parallel_size
    if cp == 1:
        return None
    check_context_parallel(model, layout)
    group = layout.cp_group
    model.set_attn_implementation(_register(group))
    return SequenceSplit(group, layout.context_parallel_rank, cp)


def check_context_parallel(model: nn.Module, layout: ParallelLayout) -> None:
    """The context-parallel pass's check (a layout built or not): under CP, ``model``'s family is
    one whose attention CP splits exactly."""
    if layout.context_parallel_size > 1:
        check_context_parallel_family(model)


def check_context_parallel_family(model: nn.Module) -> None:
    """Refuse, in one line naming the family, a model whose attention CP cannot split exactly."""
    config = getattr(model, "config", None)
    family = getattr(config, "model_type", None)
    name = f"{type(model).__name__} (model_type {family!r})"
    record = FAMILIES.get(family)
    if record is None or not record.context_parallel:
        # what the config shows first (its values), else why the record does not claim CP
        reason = _inexact_attention(config) or (record.context_parallel_refusal if record else NOT_CHECKED_UNDER_CP)
        raise ConfigError(f"context parallelism: {name}: {reason}; the families split over CP are "
                          f"{', '.join(context_parallel_families())} (docs/context_parallel.md#hugging-face-models): use "
                          "context_parallel_size=1.")
    # a family that splits its own attention (windows, compressed entries) owns what the config shows
    reason = None if record.context_parallel_attention is not None else _inexact_attention(config)
    if reason:
        raise ConfigError(f"context parallelism: {name}: {reason}, which the all-gathered causal attention does not "
                          "compute: use context_parallel_size=1.")


def _inexact_attention(config: Any) -> str | None:
    """What in ``config`` makes the attention differ from causal softmax attention with a padding
    mask (None: nothing)."""
    layer_types = getattr(config, "layer_types", None) or ()
    window = getattr(config, "sliding_window", None)
    if "sliding_attention" in layer_types or (window is not None and getattr(config, "use_sliding_window", True)):
        return f"sliding-window attention (sliding_window={window})"
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, key, None) is not None:
            return f"softcapping ({key}={getattr(config, key)})"
    if getattr(config, "model_type", None) == "gpt_oss":
        return "attention sinks"
    return None


def _register(group, unless_registered: bool = False) -> str:
    """The registry name of CP attention over ``group`` (registered once per group's ranks: the
    name is global to transformers, a model reads it from its config). ``unless_registered``: left
    as it is when the name is registered already (each forward checks: the teardown of the run
    that registered it took it out, and the split model may go on in the next run)."""
    ranks = dist.get_process_group_ranks(group)
    name = f"{_NAME_PREFIX}_{'_'.join(map(str, ranks))}"
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if unless_registered and name in AttentionInterface._global_mapping:
        return name

    # re-registered each time: a rebuilt layout's group of the same ranks replaces the old one; the
    # run holding the process takes them out again at its teardown
    for registry, function in ((AttentionInterface, functools.partial(_attention, group=group)),
                               (AttentionMaskInterface, _padding_mask)):
        register_for_the_run(registry._global_mapping, name, function)
    return name


def _padding_mask(batch_size: int, q_length: int, kv_length: int, attention_mask: Tensor | None = None,
                  **_: Any) -> Tensor | None:
    """transformers' mask hook: the whole sequence's ``[b, s]`` padding mask, as given (the causal
    part is the CP attention's); None when every token attends, so no dense mask is built (the
    check is one host sync per forward, as transformers' own SDPA mask makes)."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    return attention_mask


def _attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
               dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None, *, group,
               **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' attention signature (``[b, heads, s/cp, d]`` q, ``[b, kv_heads, s/cp, d]`` k,
    v) over CP; returns ``[b, s/cp, heads, d]`` as ``sdpa_attention_forward`` does."""
    for unsplit in ("sliding_window", "softcap", "s_aux", "position_bias"):
        if kwargs.get(unsplit) is not None:   # the config check missed it: never silently wrong
            raise ConfigError(f"context parallelism: {type(module).__name__} passes {unsplit}=..., which the "
                              "all-gathered causal attention does not compute: use context_parallel_size=1.")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ConfigError(f"context parallelism: {type(module).__name__} got a {attention_mask.dim()}-D attention "
                          "mask; only the [batch, seq] padding mask of the whole sequence is split over CP.")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = context_parallel_attention(query, key, value, group, causal=causal,
                                     key_padding_mask=None if attention_mask is None else attention_mask.bool(),
                                     scale=scaling, dropout_p=dropout)
    return out.transpose(1, 2).contiguous(), None


__all__ = ["SUPPORTED_FAMILIES", "SequenceSplit", "check_context_parallel", "check_context_parallel_family",
           "split_over_context"]
