"""What the families that split their own attention over context parallelism (CP) share
(``FamilyRecord.context_parallel_attention``: DeepSeek-V4's window and compressed attention,
``deepseek_v4_context.py``; HY-V4's latent attention and indexer, ``hy_v4_context.py``).

Such a family's attention is not the causal softmax the generic CP attention computes (a window,
compressed entries, an indexer's top-k picks, sinks), so its CP pass replaces each built
attention's forward with one that follows transformers' lines on this rank's chunks of the
sequence (``any_model.context_parallel.SequenceSplit``: chunks ``r`` and ``2·cp − 1 − r`` of
``2·cp``, at their global ``position_ids``) and all-gathers what its queries read from the whole
sequence (``distributed.context_parallel.gather_sequence``: global order; its backward
reduce-scatters the gradient, summed over the ranks whose queries read it). What they share:

- :func:`replace_attention_forward`: the pass itself, on the attentions a predicate picks;
- :func:`check_split_call`: what such a forward cannot split, refused in one line naming the
  family (a key/value cache, a mask other than the batch's ``[b, s]`` padding mask);
- :func:`key_mask`: the mask of this rank's queries over the whole sequence's keys, as
  transformers' eager mask makes it (causal, within a window where the family has one, and the
  padding mask the CP mask function keeps whole on every rank).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import Tensor, nn

from lightning_mhc.errors import ConfigError
from lightning_mhc.layers.sequence import SequenceSplit
from lightning_mhc.wrapping import wrap


def replace_attention_forward(chunk: nn.Module, layout: Any, is_attention: Callable[[nn.Module], bool],
                              forward: Callable[..., Any]) -> None:
    """A family's CP pass on a built ``chunk`` (CP > 1): each module ``is_attention`` picks runs
    ``forward(module, split, *args, **kwargs)`` over ``layout``'s CP group."""
    split = SequenceSplit.of(layout)
    if split is None:
        return
    for module in chunk.modules():
        if is_attention(module):
            wrap(module, "context_parallel_attention", lambda mod, _inner: functools.partial(forward, mod, split))


def check_split_call(family: str, cache: Any, kwargs: dict[str, Any], attention_mask: Tensor | None) -> None:
    """Refuse, in one line naming ``family``, a call its CP attention does not split: a key/value
    cache (generation) or a mask other than the whole sequence's ``[batch, seq]`` padding mask."""
    if cache is not None or kwargs.get("past_key_values") is not None:
        raise ConfigError(f"{family} under context parallelism: a key/value cache (generation) is not split over the "
                          "sequence; generate with context_parallel_size=1.")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ConfigError(f"{family} under context parallelism: got a {attention_mask.dim()}-D attention mask; only "
                          "the [batch, seq] padding mask of the whole sequence is split over CP.")


def key_mask(query_positions: Tensor, seq_len: int, padding: Tensor | None, dtype: torch.dtype,
             window: int | None = None) -> Tensor:
    """``[b, 1, q, seq_len]`` additive mask of queries at ``query_positions`` (``[b, q]``, global)
    over the whole sequence's keys: causal (within ``window`` tokens when given) and the key
    ``padding`` (``[b, seq_len]``, True or 1 = a token), 0 where seen and ``dtype``'s minimum
    elsewhere (transformers' eager mask; a row with no key seen stays all minimum, as there)."""
    keys = torch.arange(seq_len, device=query_positions.device)
    distance = query_positions[..., None] - keys
    seen = distance >= 0
    if window is not None:
        seen = seen & (distance < window)
    if padding is not None:
        seen = seen & padding.bool()[:, None, :]
    zero = torch.zeros((), dtype=dtype, device=seen.device)
    return torch.where(seen, zero, torch.finfo(dtype).min)[:, None]


__all__ = ["check_split_call", "key_mask", "replace_attention_forward"]
