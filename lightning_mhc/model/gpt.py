"""The mHC GPT model, built as one pipeline stage like megatron's ``model_provider``.

First stage (``pre_process``): vocab-parallel embedding (+ learned positions),
dropout, stream expansion. Last stage (``post_process``): stream contraction,
final norm, column-parallel output layer and vocab-parallel cross-entropy.
A middle stage receives its input through :meth:`set_input_tensor`.

Context parallelism (``context_parallel_size = cp > 1``): every CP rank of a data-parallel rank
receives the same micro-batch and keeps its two chunks of the sequence (:meth:`GPTModel.on_this_rank`,
megatron's ``get_batch_on_this_cp_rank``; the labels are the next tokens already, shifted before
the split); RoPE and learned positions take each token's global position (``chunk_positions``);
the attention gathers K/V over the CP group; what crosses stages is ``[s/cp, b, n*C]``; the loss of
a rank is its tokens' sum over the whole sequence's token count (:func:`gpt_loss_func`).
"""
from __future__ import annotations

import torch
from megatron.core.parallel_state import get_tensor_model_parallel_rank
from megatron.core.tensor_parallel import VocabParallelEmbedding, vocab_parallel_cross_entropy
from torch import Tensor

from lightning_mhc.distributed.context_parallel import sequence_divisor
from lightning_mhc.distributed.layout import ParallelLayout, single_process_layout
from lightning_mhc.errors import ConfigError
from lightning_mhc.model.config import MHCTransformerConfig
from lightning_mhc.layers.init import ParamInit
from lightning_mhc.layers.loss import token_mean_loss
from lightning_mhc.layers.sequence import SequenceSplit
from lightning_mhc.model.parallel_linear import SPColumnParallelLinear
from lightning_mhc.model.attention import SelfAttention
from lightning_mhc.layers.bda import residual_dropout
from lightning_mhc.model.rope import rotary_freqs_at
from lightning_mhc.layers.sequence_parallel import mark_sequence_parallel_parameters, scatter_to_sequence_parallel_region
from lightning_mhc.distributed.placement import mark_replicated, place
from lightning_mhc.model.transformer_block import TransformerBlock

WORD_EMBEDDINGS_KEY = "embedding.word_embeddings.weight"


class Embedding(torch.nn.Module):
    """Token (and optionally learned position) embedding, output ``[s, b, C]``."""

    def __init__(self, config: MHCTransformerConfig, init: ParamInit) -> None:
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(
            config.padded_vocab_size,
            config.hidden_size,
            init_method=init.normal("word_embeddings.weight", config.init_method_std),
            config=config,
        )
        self.position_embeddings = None
        if config.position_embedding_type == "learned_absolute":
            self.position_embeddings = torch.nn.Embedding(config.max_sequence_length, config.hidden_size)
            init.normal("position_embeddings.weight", config.init_method_std)(
                self.position_embeddings.weight
            )
        self.dropout = torch.nn.Dropout(config.hidden_dropout)
        self.sequence_parallel = config.sequence_parallel
        self.exact_dropout = config.exact_hidden_dropout

    def forward(self, input_ids: Tensor, position_ids: Tensor | None) -> Tensor:
        emb = self.word_embeddings(input_ids)  # [b, s, C]
        if self.position_embeddings is not None:
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
            emb = emb + self.position_embeddings(position_ids)
        emb = emb.transpose(0, 1).contiguous()  # [s, b, C]
        if self.sequence_parallel:  # this rank's tokens
            emb = scatter_to_sequence_parallel_region(emb)
        # the bias-dropout-adds' stream and mask (replicated across TP, or this rank's under SP)
        return residual_dropout(emb, self.dropout.p, self.training, self.sequence_parallel, self.exact_dropout)


class GPTModel(torch.nn.Module):
    """One pipeline stage of the GPT model.

    Args:
        config: the model configuration.
        pre_process: this stage embeds tokens (first stage).
        post_process: this stage computes logits and the loss (last stage).
        layer_range: ``(start, end)`` global 0-based layers built here;
            default: all ``config.num_layers`` layers.
        layout: the built layout the model runs on (its TP, CP and EP groups); default: a model
            built outside any run, on the one-process layout (``single_process_layout()``).

    ``forward`` returns the per-token loss ``[b, s]`` when ``labels`` are given
    and this is the last stage, the vocab-parallel logits ``[b, s, V/tp]`` when
    not, and the hidden state ``[s, b, n*C]`` on any other stage.
    """

    def __init__(
        self,
        config: MHCTransformerConfig,
        pre_process: bool = True,
        post_process: bool = True,
        layer_range: tuple[int, int] | None = None,
        layout: ParallelLayout | None = None,
    ) -> None:
        super().__init__()
        layout = layout if layout is not None else single_process_layout()
        if config.tensor_model_parallel_size != layout.tensor_model_parallel_size:
            # a config not made for this layout (with_parallel_layout checked the one it made): the
            # sizes its layers split over the layout's TP group
            layout.check_model(config.split_sizes())
        cp = config.context_parallel_size
        if cp > 1 and cp != layout.context_parallel_size:  # (CP 1: a whole-sequence model, in any process)
            raise ConfigError(f"the model config has context_parallel_size={cp}, but the layout it is built on has "
                              f"{layout.context_parallel_size}: build the config with "
                              "with_parallel_layout(config, layout).")
        start, end = layer_range if layer_range is not None else (0, config.num_layers)
        if not 0 <= start <= end <= config.num_layers:
            raise ConfigError(
                f"layer_range={layer_range} is outside the model's num_layers={config.num_layers} "
                "layers. Give 0 <= start <= end <= num_layers."
            )
        self.config = config
        self.pre_process = pre_process
        self.post_process = post_process
        self.layer_range = (start, end)
        self.share_embeddings_and_output_weights = config.share_embeddings_and_output_weights
        self.input_tensor: Tensor | None = None
        init = ParamInit(config.init_seed)

        self.embedding = Embedding(config, init.child("embedding")) if pre_process else None
        self.decoder = TransformerBlock(
            config,
            range(start + 1, end + 1),
            init.child("decoder"),
            pre_process=pre_process,
            post_process=post_process,
            layout=layout,
        )
        self.output_layer = None
        if post_process:
            tied_here = self.share_embeddings_and_output_weights and pre_process
            # A tied copy on a last stage without the embedding draws from the embedding's
            # generator, so both copies start equal.
            key = WORD_EMBEDDINGS_KEY if self.share_embeddings_and_output_weights else "output_layer.weight"
            self.output_layer = SPColumnParallelLinear(
                config.hidden_size,
                config.padded_vocab_size,
                config=config,
                init_method=ParamInit(config.init_seed).normal(key, config.init_method_std),
                bias=False,
                gather_output=False,
                skip_weight_param_allocation=tied_here,
            )
            if self.share_embeddings_and_output_weights and not tied_here:
                # Marks the copy whose gradient is all-reduced with the first stage's embedding.
                place(self.output_layer.weight, shared_embedding=True)
        if pre_process and self.share_embeddings_and_output_weights:
            place(self.embedding.word_embeddings.weight, shared_embedding=True)
        if config.sequence_parallel:
            mark_sequence_parallel_parameters(self.decoder)
        self.sequence_split = SequenceSplit.of(layout) if cp > 1 else None
        """This rank's chunks of every sequence (None without context parallelism)."""
        self.context_parallel_group = layout.cp_group if cp > 1 else None
        """The CP group (None without context parallelism), handed to every attention."""
        self.context_parallel_rank = layout.context_parallel_rank if cp > 1 else 0
        for module in self.modules():
            if isinstance(module, SelfAttention):
                module.context_parallel_group = self.context_parallel_group
        mark_replicated(self)  # what megatron's layers did not split is whole on every TP rank

    def on_this_rank(self, microbatch: dict) -> dict:
        """The part of a micro-batch this rank computes: under context parallelism its two chunks
        of every ``[b, s]`` entry (``tokens``, ``labels``, ``loss_mask``, ``position_ids``); the
        micro-batch itself otherwise."""
        if self.sequence_split is None:
            return microbatch
        return self.sequence_split.shard_batch(microbatch, SEQUENCE_KEYS)

    def global_parameter_name(self, local_name: str) -> str:
        """The parameter's name in the whole (unpartitioned) model: local layer indices
        shifted by this stage's first layer; a last stage's copy of the tied embedding is the
        embedding."""
        if local_name == "output_layer.weight" and self.share_embeddings_and_output_weights:
            return WORD_EMBEDDINGS_KEY
        prefix = "decoder.layers."
        if local_name.startswith(prefix):
            index, rest = local_name[len(prefix):].split(".", 1)
            return f"{prefix}{int(index) + self.layer_range[0]}.{rest}"
        return local_name

    def generate(self, input_ids: Tensor, max_new_tokens: int = 32, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, stop_token: int | None = None,
                 use_cache: bool = True, generator: torch.Generator | None = None) -> Tensor:
        """``input_ids [b, s]`` followed by up to ``max_new_tokens`` tokens: greedy when
        ``temperature == 0``, else sampled (``top_k`` / ``top_p``); see ``generation.generate``."""
        from lightning_mhc.model.generation import generate

        if self.config.context_parallel_size > 1:
            raise ConfigError(f"generate runs the whole sequence in one process, but this model splits it over "
                              f"context_parallel_size={self.config.context_parallel_size} ranks: load the checkpoint "
                              "with MHCGPTModule.load_from_checkpoint(dir) and generate there.")
        return generate(self, input_ids, max_new_tokens, temperature, top_k, top_p, stop_token, use_cache, generator)

    def pipeline_tensor_shape(self, micro_batch_size: int, seq_length: int) -> tuple[int, int, int]:
        """What crosses stages: the residual stream ``[s/cp, b, n*C]`` (``[s/(cp*TP), b, n*C]`` under
        sequence parallelism) for a micro-batch of ``seq_length`` tokens per sample."""
        cp, sp = self.config.context_parallel_size, self._sequence_shards()
        split = sequence_divisor(cp, sp)
        if cp > 1 and seq_length % split:  # the runtime asks on every rank before the schedule: refused there
            over_tp = f", each over {sp} TP ranks" if sp > 1 else ""
            raise ConfigError(f"a micro-batch of {seq_length} tokens per sample cannot be split: "
                              f"context_parallel_size={cp} cuts it into 2 * {cp} chunks{over_tp}; use a sequence "
                              f"length divisible by {split}.")
        return (seq_length // (sp * cp), micro_batch_size, self.config.residual_width)

    def _global_positions(self, local: int, start_position: int, device: torch.device) -> Tensor:
        """The global position of each of this rank's ``local`` tokens (before sequence parallelism)."""
        if self.sequence_split is not None:
            return self.sequence_split.positions(local * self.sequence_split.size, device=device)
        return torch.arange(start_position, start_position + local, device=device)

    def _sequence_shards(self) -> int:
        return self.config.tensor_model_parallel_size if self.config.sequence_parallel else 1

    def set_input_tensor(self, input_tensor: Tensor | None) -> None:
        """The hidden state received from the previous stage (megatron's contract)."""
        self.input_tensor = input_tensor

    def output_weight(self) -> Tensor:
        if self.share_embeddings_and_output_weights and self.pre_process:
            return self.embedding.word_embeddings.weight
        return self.output_layer.weight

    def forward(
        self,
        input_ids: Tensor | None,
        position_ids: Tensor | None = None,
        labels: Tensor | None = None,
        start_position: int = 0,
    ) -> Tensor:
        """``start_position``: the position of the first token (a KV-cached generation step).
        Under context parallelism ``input_ids`` and ``labels`` are this rank's chunks
        (:meth:`on_this_rank`)."""
        if not self.pre_process and self.input_tensor is None:
            raise RuntimeError(
                "this stage has no embedding: call set_input_tensor() with the previous "
                "stage's output before forward"
            )
        local = (input_ids.shape[1] if self.pre_process  # this rank's tokens (all of its CP chunks)
                 else self.input_tensor.shape[0] * self._sequence_shards())
        device = input_ids.device if self.pre_process else self.input_tensor.device
        positions = self._global_positions(local, start_position, device)
        if self.pre_process:
            if position_ids is None and (start_position or self.config.context_parallel_size > 1):
                position_ids = positions
            hidden_states = self.embedding(input_ids, position_ids)
        else:
            hidden_states = self.input_tensor
        freqs = None
        if self.config.position_embedding_type == "rope":  # the tokens' global positions: attention sees all of them
            freqs = rotary_freqs_at(positions, self.config.kv_channels, self.config.rotary_base)
        hidden_states = self.decoder(hidden_states, freqs)
        if not self.post_process:
            return hidden_states

        logits, _ = self.output_layer(hidden_states, weight=self.output_weight())  # [s, b, V/tp]
        logits = mask_vocab_padding(logits, self.config.vocab_size)
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        loss = vocab_parallel_cross_entropy(logits.float(), labels.transpose(0, 1).contiguous())
        return loss.transpose(0, 1).contiguous()


def mask_vocab_padding(logits: Tensor, vocab_size: int) -> Tensor:
    """Vocab-parallel logits ``[..., V/tp]`` with the padding columns (global index >= ``vocab_size``)
    at -inf: the padded rows of the output layer never receive probability, in the loss or in
    sampling. The softmax's maximum is taken over all TP ranks, so a rank holding only padding
    is safe."""
    local = logits.shape[-1]
    start = get_tensor_model_parallel_rank() * local
    if start + local <= vocab_size:
        return logits
    padding = torch.arange(start, start + local, device=logits.device) >= vocab_size
    return logits.masked_fill(padding, float("-inf"))


SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "position_ids")
"""The ``[b, s]`` entries of a GPT micro-batch: split over the CP ranks (``GPTModel.on_this_rank``)."""


def gpt_forward_step(model: GPTModel, microbatch: dict) -> Tensor:
    """The pipeline schedule's per-microbatch forward: tokens on the first stage, labels on
    the last (this rank's chunks of them under context parallelism); returns the hidden state or
    the per-token loss ``[b, s]`` (``[b, s/cp]``)."""
    microbatch = model.on_this_rank(microbatch)
    return model(
        microbatch["tokens"] if model.pre_process else None,
        labels=microbatch["labels"] if model.post_process else None,
    )


def gpt_loss_func(per_token_loss: Tensor, microbatch: dict, context_parallel_group=None) -> Tensor:
    """Mean loss over the microbatch's tokens, honouring an optional ``loss_mask``
    (:func:`~lightning_mhc.layers.loss.token_mean_loss`: under context parallelism, with
    ``context_parallel_group``, this rank's part of that mean)."""
    return token_mean_loss(per_token_loss, microbatch.get("loss_mask"), context_parallel_group)
