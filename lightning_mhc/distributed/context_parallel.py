"""Context parallelism (CP): the sequence split over the ranks of a group, attention exact.

mHC widens the residual stream ``n`` times, so at long sequences the activations, not the weights,
run out of memory; splitting the sequence over ``cp`` ranks divides every token-wise activation by
``cp``. megatron-core's CP needs TransformerEngine and CUDA, torch's ``context_parallel`` has no
CPU path; this one runs wherever ``scaled_dot_product_attention`` and the group's collectives do
(gloo on CPU, NCCL on GPU).

**Sharding (load-balanced).** The sequence is cut into ``2·cp`` equal chunks; rank ``r`` holds
chunks ``r`` and ``2·cp − 1 − r``, concatenated in that order (``shard_sequence``). Under a causal
mask chunk ``c`` attends to ``c + 1`` chunks of keys, so every rank's two chunks attend to
``(r + 1) + (2·cp − r) = 2·cp + 1`` chunks together: equal causal work on every rank (a plain
contiguous split would leave the last rank ``2·cp − 1`` times the first rank's work).
``chunk_positions`` gives each local token's global position (RoPE, labels);
``unshard_sequence`` / ``gather_sequence`` put the ranks' pieces back in global order.

**Attention (all-gather K/V, Llama 3's choice).** ``context_parallel_attention`` all-gathers the
local K and V over the group, stacked into one collective (forward ``all_gather_single``; backward
the gradients are reduce-scattered, summed over the ranks whose queries used them), puts them
back in global order, and each of the two local query chunks attends to its causal prefix of the
gathered K/V with one SDPA call per chunk with a lower-right causal mask (query ``i`` of chunk ``c`` is global position
``c·L + i`` and sees keys ``0 .. c·L + i``): on a GPU ``torch.nn.attention.bias.causal_lower_right``,
which SDPA runs in its flash / efficient kernels; on CPU, whose SDPA would keep a dense fp32 copy
of any boolean mask for backward, the queries run in reversed order against an additive mask that
is a strided view of one row (``_reversed_causal_bias``). With a key-padding mask the combined
boolean mask is dense (and kept so on CPU: ``4 · b · L · key_len`` bytes per chunk).
Grouped-query attention gathers only the K/V heads it has (``enable_gqa``: SDPA repeats them,
after the gather). The key-padding mask ``[b, s]`` is given for the full sequence, in global
order, on every rank (it is the batch's, and small): it is applied to the gathered keys, which
are in global order, so it needs no communication.

**What backward keeps.** By default the gathered K/V are kept: SDPA saves its key and value
inputs, and each chunk's prefix is a view of the one gathered K/V, so a rank keeps the
full-sequence K/V, ``2 · s · kv_heads · d`` elements per sample per layer, on top of its local
q, output and softmax statistics (measured at 1024 tokens, 8 / 2 heads of 64, fp32: 3169272
bytes per rank at cp=2 against 5275648 for SDPA on the whole sequence). With
``regather_in_backward=True`` the gather and the attention run under ``torch.utils.checkpoint``:
only the local q, k, v are kept (1572864 bytes) and backward gathers K/V again (one more
all-gather per layer, in the same order on every rank). The test
``tests/test_context_parallel.py::test_retained_bytes`` measures both against the un-split
attention.

**Dropout** (``dropout_p``): each chunk's SDPA call draws the mask of its own queries against its
keys from the current generator, so a rank draws only its rows of the attention matrix. The masks
are not the ones one process would draw for the whole matrix (one call, one draw); they are this
rank's stream's (the model runs it inside the parallel randomizer's fork, which differs over CP
ranks, as megatron's CP ranks draw apart), reproducible, and replayed under recompute
(``regather_in_backward`` re-runs the calls with the generator state of the forward). The model
config's ``exact_hidden_dropout``, which gives the residual stream's dropout one process's masks
(``distributed.random.whole_sequence_dropout``), cannot do so here (SDPA draws inside, per call)
and refuses attention dropout under CP.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

# torch >= 2.13 names them *_single (the *_tensor names warn)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_REDUCE_SCATTER_WORKS: dict[str, bool] = {}
"""Per backend name: False once its reduce-scatter raised (gloo before torch 2.x had none); the
gradients are then all-reduced and sliced (``cp`` times the traffic, the same sums)."""


# ----------------------------------------------------------------------------- sharding

def _check_divisible(seq_len: int, cp_size: int) -> None:
    if cp_size < 1:
        raise ValueError(f"context parallelism needs cp_size >= 1, got {cp_size}")
    if seq_len % (2 * cp_size):
        raise ValueError(f"context parallelism cuts the sequence into 2*cp = {2 * cp_size} equal chunks, "
                         f"but it has {seq_len} tokens: make the sequence length a multiple of {2 * cp_size}.")


def sequence_divisor(cp_size: int, sequence_shards: int = 1) -> int:
    """What a sequence's length must divide by: ``2·cp`` load-balanced chunks (none without CP),
    each split again over ``sequence_shards`` ranks (TP under sequence parallelism)."""
    return (2 * cp_size if cp_size > 1 else 1) * sequence_shards


def local_chunks(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two global chunk indices rank ``cp_rank`` holds, in local order."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is not in [0, {cp_size})")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def shard_sequence(x: Tensor, cp_rank: int, cp_size: int, dim: int) -> Tensor:
    """This rank's part of the full sequence along ``dim``: chunks ``r`` and ``2cp-1-r`` of ``2cp``."""
    _check_divisible(x.shape[dim], cp_size)
    chunks = x.chunk(2 * cp_size, dim=dim)
    first, second = local_chunks(cp_rank, cp_size)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def unshard_sequence(shards: Sequence[Tensor], dim: int) -> Tensor:
    """The full sequence from every rank's part (``shards[r]`` from rank ``r``), in global order."""
    cp_size = len(shards)
    halves = [shard.chunk(2, dim=dim) for shard in shards]
    # chunk j < cp is rank j's first half; chunk j >= cp is rank (2cp-1-j)'s second half
    ordered = [halves[j][0] for j in range(cp_size)] + [halves[j][1] for j in reversed(range(cp_size))]
    return torch.cat(ordered, dim=dim)


def chunk_positions(seq_len: int, cp_rank: int, cp_size: int, device=None) -> Tensor:
    """The global position of each local token (int64, ``[seq_len / cp]``): RoPE's and the labels'."""
    return shard_sequence(torch.arange(seq_len, device=device), cp_rank, cp_size, dim=0)


# ----------------------------------------------------------------------------- collectives

def _reduce_scatter_sum(out: Tensor, flat: Tensor, group) -> None:
    """``out`` = this rank's slice of the sum of ``flat`` over the group."""
    backend = str(dist.get_backend(group))
    if _REDUCE_SCATTER_WORKS.get(backend, True):
        try:
            _reduce_scatter_single(out, flat, group=group)
            _REDUCE_SCATTER_WORKS[backend] = True
            return
        except (RuntimeError, NotImplementedError):
            # raised before any communication (the backend lacks the op), alike on every rank
            if _REDUCE_SCATTER_WORKS.get(backend):
                raise
            _REDUCE_SCATTER_WORKS[backend] = False
    summed = flat.clone()
    dist.all_reduce(summed, group=group)
    out.copy_(summed.view(dist.get_world_size(group), -1)[dist.get_rank(group)].view_as(out))


class _AllGather(torch.autograd.Function):
    """``x`` -> ``[cp, *x.shape]`` (rank order); backward: the gradients' sum, this rank's slice."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        out = torch.empty((world, *x.shape), dtype=x.dtype, device=x.device)
        _all_gather_single(out.view(-1), x.contiguous().view(-1), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        out = torch.empty(grad.shape[1:], dtype=grad.dtype, device=grad.device)
        _reduce_scatter_sum(out.view(-1), grad.view(-1), ctx.group)
        return out, None


def all_gather_with_grad(x: Tensor, group) -> Tensor:
    """Every rank's ``x`` stacked in rank order, ``[cp, *x.shape]``; differentiable (reduce-scatter back)."""
    if dist.get_world_size(group) == 1:
        return x.unsqueeze(0)
    return _AllGather.apply(x, group)


def gather_sequence(x: Tensor, group, dim: int) -> Tensor:
    """The full sequence along ``dim`` from every rank's part, in global order; differentiable."""
    return unshard_sequence(all_gather_with_grad(x, group).unbind(0), dim=dim)


# ----------------------------------------------------------------------------- attention

def _chunk_mask(chunk: int, chunk_len: int, key_len: int, device) -> Tensor:
    """``[chunk_len, key_len]``: query ``i`` of ``chunk`` (global ``chunk*L + i``) sees keys ``<=`` it."""
    query_pos = chunk * chunk_len + torch.arange(chunk_len, device=device)
    return torch.arange(key_len, device=device)[None, :] <= query_pos[:, None]


def causal_work(seq_len: int, cp_rank: int, cp_size: int) -> int:
    """The score entries this rank computes unmasked under the causal mask (for the balance check)."""
    _check_divisible(seq_len, cp_size)
    chunk_len = seq_len // (2 * cp_size)
    return sum(int(_chunk_mask(c, chunk_len, (c + 1) * chunk_len, "cpu").sum())
               for c in local_chunks(cp_rank, cp_size))


def _reversed_causal_bias(chunk_len: int, key_len: int, dtype, device) -> Tensor:
    """The additive lower-right causal mask ``[chunk_len, key_len]`` for a chunk's queries in
    REVERSED order, as a strided view of one row (``key_len + chunk_len - 1`` values, not
    ``chunk_len · key_len``): row ``i'`` is the query ``chunk_len - 1 - i'``, at global position
    ``key_len - 1 - i'``, which sees key ``j`` iff ``i' + j <= key_len - 1``, a function of
    ``i' + j`` alone, hence strides ``(1, 1)`` (in query order it would need a negative stride)."""
    offset = torch.arange(chunk_len + key_len - 1, device=device)
    row = torch.zeros(offset.shape, dtype=dtype, device=device).masked_fill(offset > key_len - 1, float("-inf"))
    return row.as_strided((chunk_len, key_len), (1, 1))


def _causal_chunk_attention(query: Tensor, keys: Tensor, values: Tensor, scale: float | None, gqa: bool,
                            strided_bias: bool, dropout_p: float = 0.0) -> Tensor:
    """A chunk's queries against its causal prefix of keys (the chunk's own block last), lower-right causal."""
    chunk_len, key_len = query.shape[2], keys.shape[2]
    if not strided_bias:
        # flash / efficient kernels take the lower-right alignment without a materialized mask (its
        # module imports torch's compiler, seconds: here, so a plan of a layout does not pay them)
        from torch.nn.attention.bias import causal_lower_right

        return F.scaled_dot_product_attention(query, keys, values, attn_mask=causal_lower_right(chunk_len, key_len),
                                              dropout_p=dropout_p, scale=scale, enable_gqa=gqa)
    # CPU's SDPA materializes a boolean or CausalBias mask as a dense fp32 [chunk_len, key_len] and keeps
    # it for backward (4 bytes per score entry: quadratic in the sequence, as big as K/V at 1024
    # tokens); it keeps a strided float mask as given, so the queries run in reversed order against
    # a one-row mask (the flips are copies without saved state; the reversed query replaces the view
    # of q that SDPA would keep)
    bias = _reversed_causal_bias(chunk_len, key_len, query.dtype, query.device)
    reversed_out = F.scaled_dot_product_attention(query.flip(2), keys, values, attn_mask=bias, dropout_p=dropout_p,
                                                  scale=scale, enable_gqa=gqa)
    return reversed_out.flip(2)


def _attend(q: Tensor, k: Tensor, v: Tensor, group, causal: bool, key_padding_mask: Tensor | None,
            scale: float | None, dropout_p: float = 0.0) -> Tensor:
    cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
    # one all-gather (and one reduce-scatter back) for K and V together: half the collectives' latency
    keys, values = gather_sequence(torch.stack((k, v)), group, dim=3).unbind(0)   # [b, kv_heads, s, d] each

    seq_len = keys.shape[2]
    chunk_len = q.shape[2] // 2
    gqa = q.shape[1] != k.shape[1]
    outputs = []
    for half, chunk in enumerate(local_chunks(cp_rank, cp_size)):
        query = q[:, :, half * chunk_len:(half + 1) * chunk_len]
        key_len = (chunk + 1) * chunk_len if causal else seq_len   # the causal prefix only
        prefix_keys, prefix_values = keys[:, :, :key_len], values[:, :, :key_len]
        if causal and key_padding_mask is None:
            outputs.append(_causal_chunk_attention(query, prefix_keys, prefix_values, scale, gqa,
                                                   strided_bias=q.device.type == "cpu", dropout_p=dropout_p))
            continue
        mask = None
        if key_padding_mask is not None:
            mask = key_padding_mask[:, None, None, :key_len]        # [b, 1, 1, key_len]
            if causal:   # dense [b, 1, chunk_len, key_len], kept by SDPA for backward
                mask = mask & _chunk_mask(chunk, chunk_len, key_len, q.device)
        outputs.append(F.scaled_dot_product_attention(query, prefix_keys, prefix_values, attn_mask=mask,
                                                      dropout_p=dropout_p, scale=scale, enable_gqa=gqa))
    return torch.cat(outputs, dim=2)


def context_parallel_attention(q: Tensor, k: Tensor, v: Tensor, group, *, causal: bool = True,
                               key_padding_mask: Tensor | None = None, scale: float | None = None,
                               dropout_p: float = 0.0, regather_in_backward: bool = False) -> Tensor:
    """Exact attention of this rank's queries over the whole sequence split across ``group``.

    ``q``: ``[b, heads, s/cp, d]``, ``k``, ``v``: ``[b, kv_heads, s/cp, d]`` (SDPA's layout), this
    rank's two chunks as ``shard_sequence(x, r, cp, dim=2)`` makes them; ``heads`` a multiple of
    ``kv_heads`` (grouped-query attention). ``key_padding_mask``: ``[b, s]`` bool for the FULL
    sequence in global order (True = attend), the same on every rank. Returns this rank's output,
    ``[b, heads, s/cp, d]``, in the local order of ``q``. A query row whose keys are all masked
    gets SDPA's answer for it (zeros on CPU), as the un-split attention would.
    ``regather_in_backward``: keep only the local q, k, v for backward and gather K/V again there.
    ``dropout_p``: attention dropout, each rank drawing the masks of its own query rows from the
    current generator (see the module docstring: not one process's masks).
    """
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"expected q [b, heads, s, d] and k, v [b, kv_heads, s, d] alike; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:] or q.shape[1] % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch, local sequence and "
                         f"head size, with heads a multiple of kv_heads")
    cp_size = dist.get_world_size(group)
    _check_divisible(q.shape[2] * cp_size, cp_size)
    if key_padding_mask is not None:
        expected = (q.shape[0], q.shape[2] * cp_size)
        if tuple(key_padding_mask.shape) != expected or key_padding_mask.dtype != torch.bool:
            raise ValueError(f"key_padding_mask must be bool {list(expected)} (the full sequence); "
                             f"got {key_padding_mask.dtype} {list(key_padding_mask.shape)}")
    if regather_in_backward:
        return checkpoint(_attend, q, k, v, group, causal, key_padding_mask, scale, dropout_p, use_reentrant=False)
    return _attend(q, k, v, group, causal, key_padding_mask, scale, dropout_p)
