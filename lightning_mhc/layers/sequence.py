"""This rank's part of a sequence under context parallelism, as both model wings take it.

A context-parallel rank holds two chunks of every sequence (``distributed.context_parallel``'s
load-balanced split: chunks ``r`` and ``2·cp − 1 − r`` of ``2·cp``), computes at its tokens'
global positions (RoPE's angles and learned positions are the un-split sequence's) and its part
of the loss. The GPT (``GPTModel.on_this_rank``) and the Hugging Face wing (``ParallelModel``,
through ``any_model/context_parallel.py``) cut their batches with one :class:`SequenceSplit`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from torch import Tensor

from lightning_mhc.distributed.context_parallel import chunk_positions, shard_sequence
from lightning_mhc.layers.loss import token_mean_loss


@dataclass(frozen=True)
class SequenceSplit:
    """Rank ``rank`` of a CP ``group`` of ``size`` ranks: its chunks of a sequence, their global
    positions, and its part of the loss."""

    group: Any
    rank: int
    size: int

    @classmethod
    def of(cls, layout) -> SequenceSplit | None:
        """The split of ``layout``'s CP group (None when CP is 1)."""
        cp = layout.context_parallel_size
        return None if cp == 1 else cls(layout.cp_group, layout.context_parallel_rank, cp)

    def shard(self, x: Tensor, dim: int = 1) -> Tensor:
        """This rank's chunks of the whole sequence ``x`` along ``dim``."""
        return shard_sequence(x, self.rank, self.size, dim=dim)

    def shard_batch(self, batch: Mapping[str, Any], keys: Iterable[str], dim: int = 1) -> dict[str, Any]:
        """``batch`` with its entries ``keys`` (the sequence on ``dim``) cut to this rank's chunks; the
        others, and an entry that is None, as they are."""
        keys = set(keys)
        return {key: self.shard(value, dim) if key in keys and value is not None else value
                for key, value in batch.items()}

    def positions(self, seq_len: int, device=None) -> Tensor:
        """The global position of each of this rank's tokens of a ``seq_len``-token sequence
        (int64, ``[seq_len / cp]``)."""
        return chunk_positions(seq_len, self.rank, self.size, device=device)

    def loss(self, per_token: Tensor, keep: Tensor | None) -> Tensor:
        """This rank's part of the micro-batch's mean: the kept tokens' sum over the count of kept
        tokens summed over CP (:func:`~lightning_mhc.layers.loss.token_mean_loss`)."""
        return token_mean_loss(per_token, keep, self.group)
