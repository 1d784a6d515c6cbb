"""Autoregressive generation for a whole ``GPTModel`` (TP = PP = 1): a KV cache, greedy decoding,
temperature, top-k and top-p sampling, a length limit and a stop token.

The cache holds every attention layer's keys and values of the tokens seen so far
(``[s, b, groups, head_dim]``); a step feeds only the new tokens, at positions that continue
the cached ones (RoPE angles and learned positions alike). The mHC residual streams need no
cache: hyper-connections mix streams per token.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import Tensor


@dataclass
class LayerKVCache:
    """One attention layer's cached keys and values ``[s, b, groups, head_dim]``."""

    keys: Tensor | None = None
    values: Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[0]

    def extend(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append this step's keys and values; returns all of them."""
        self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=0)
        self.values = v if self.values is None else torch.cat([self.values, v], dim=0)
        return self.keys, self.values


@dataclass
class KVCache:
    """The KV caches of a model's attention layers, and how many positions they hold."""

    layers: list[LayerKVCache] = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0


@contextlib.contextmanager
def kv_cache(model: torch.nn.Module) -> Iterator[KVCache]:
    """Give every attention layer of ``model`` a cache for the duration of the block."""
    from lightning_mhc.model.attention import SelfAttention

    attentions = [m for m in model.modules() if isinstance(m, SelfAttention)]
    cache = KVCache([LayerKVCache() for _ in attentions])
    for attention, layer_cache in zip(attentions, cache.layers):
        attention.kv_cache = layer_cache
    try:
        yield cache
    finally:
        for attention in attentions:
            attention.kv_cache = None


def sample_next(logits: Tensor, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                generator: torch.Generator | None = None) -> Tensor:
    """The next token ``[b]`` from the last position's logits ``[b, V]``: the argmax when
    ``temperature == 0``, else a sample of ``softmax(logits / temperature)`` restricted to the
    ``top_k`` most likely tokens and to the smallest set whose probability reaches ``top_p``."""
    if temperature < 0:
        raise ValueError(f"temperature={temperature}: must be >= 0 (0 is greedy)")
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0 < top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= top_p  # keep the tokens before the mass reaches top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model, input_ids: Tensor, max_new_tokens: int = 32, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, stop_token: int | None = None,
             use_cache: bool = True, generator: torch.Generator | None = None) -> Tensor:
    """``input_ids [b, s]`` followed by up to ``max_new_tokens`` generated tokens ``[b, s + n]``;
    a sequence that produced ``stop_token`` is padded with it, and generation ends when all
    did. Positions stop at the model's ``max_sequence_length`` with learned positions."""
    config = model.config
    if not (model.pre_process and model.post_process) or config.tensor_model_parallel_size != 1:
        raise RuntimeError("generate runs the whole model in one process (TP = PP = 1): load it with "
                           "lightning_mhc.load_exported or MHCGPTModule.load_from_checkpoint")
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [batch, seq] with seq >= 1, got {tuple(input_ids.shape)}")
    was_training = model.training
    model.eval()
    tokens = input_ids
    finished = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
    try:
        with kv_cache(model) if use_cache else contextlib.nullcontext() as cache:
            step_input = tokens
            for _ in range(max_new_tokens):
                if config.position_embedding_type == "learned_absolute" and tokens.shape[1] > config.max_sequence_length:
                    break
                logits = model(step_input, start_position=cache.length if cache is not None else 0)
                logits = logits[:, -1, :config.vocab_size]  # the padded vocabulary is never produced
                next_token = sample_next(logits, temperature, top_k, top_p, generator)
                if stop_token is not None:
                    next_token = torch.where(finished, torch.full_like(next_token, stop_token), next_token)
                    finished |= next_token == stop_token
                tokens = torch.cat([tokens, next_token[:, None]], dim=1)
                step_input = next_token[:, None] if cache is not None else tokens
                if stop_token is not None and bool(finished.all()):
                    break
    finally:
        model.train(was_training)
    return tokens
