"""Context-parallel attention (``lightning_mhc.distributed.context_parallel``): the load-balanced
sharding, equal causal work per rank, and the attention's output and q/k/v gradients against the
un-split attention on the whole sequence, for cp 2 and 4 (one gloo group per cp size, every case
inside it), and the bytes autograd keeps for one call."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from lightning_mhc.distributed import context_parallel as cp_mod
from lightning_mhc.distributed.context_parallel import (
    _causal_chunk_attention,
    _chunk_mask,
    _reversed_causal_bias,
    causal_work,
    chunk_positions,
    context_parallel_attention,
    gather_sequence,
    local_chunks,
    shard_sequence,
    unshard_sequence,
)
from lightning_mhc.testing.launch import spawn_ranks
from model_utils import ERROR_FACTOR, ERROR_FLOOR

TOL_FP64 = 1e-12
"""fp64: the split attention within this of the one SDPA call; fp32 cases are held to an fp64
evaluation instead (``_errors``)."""
"""On ``|cp - ref| / max(1, |ref|)``, elementwise: absolute below 1, relative above (a GQA value
gradient sums over ranks and grouped heads, entries reach ~10, where 1e-6 absolute is under 1 ulp
of fp32). fp64 shows the split is exact, not merely close."""


# ----------------------------------------------------------------------------- in-process

@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_shard_round_trip_and_positions(cp_size):
    seq_len = 8 * cp_size
    full = torch.randn(2, seq_len, 3)
    shards = [shard_sequence(full, r, cp_size, dim=1) for r in range(cp_size)]
    assert all(s.shape == (2, seq_len // cp_size, 3) for s in shards)
    assert torch.equal(unshard_sequence(shards, dim=1), full)
    positions = [chunk_positions(seq_len, r, cp_size) for r in range(cp_size)]
    # every global position exactly once, and each local token's position is the one it came from
    assert torch.equal(torch.cat(positions).sort().values, torch.arange(seq_len))
    for r in range(cp_size):
        assert torch.equal(shards[r], full[:, positions[r]])


def test_positions_are_chunks_r_and_mirror():
    assert chunk_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert chunk_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    assert local_chunks(1, 4) == (1, 6)
    with pytest.raises(ValueError, match="multiple of 4"):
        shard_sequence(torch.zeros(6), 0, 2, dim=0)


@pytest.mark.parametrize("cp_size", [2, 4, 8])
def test_causal_work_is_equal_across_ranks(cp_size):
    seq_len = 16 * cp_size
    work = [causal_work(seq_len, r, cp_size) for r in range(cp_size)]
    assert len(set(work)) == 1, work
    assert sum(work) == seq_len * (seq_len + 1) // 2   # together: the whole causal triangle


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_cpu_causal_bias_is_the_chunk_mask_reversed(cp_size):
    """The one-row strided bias CPU's path attends with is, flipped back to query order, exactly the
    lower-right causal mask ``causal_work`` counts (0 where attended, -inf elsewhere)."""
    chunk_len = 4
    for chunk in range(2 * cp_size):
        key_len = (chunk + 1) * chunk_len
        bias = _reversed_causal_bias(chunk_len, key_len, torch.float32, "cpu")
        assert bias.untyped_storage().nbytes() == 4 * (chunk_len + key_len - 1)
        attended = torch.isfinite(bias.flip(0))
        assert torch.equal(attended, _chunk_mask(chunk, chunk_len, key_len, "cpu"))
        assert torch.equal(bias.flip(0)[attended], torch.zeros(int(attended.sum())))


@pytest.mark.parametrize("strided_bias", [True, False], ids=["cpu_strided_bias", "gpu_causal_lower_right"])
def test_chunk_attention_is_lower_right_causal(strided_bias):
    """Both ways a chunk attends (CPU's flipped queries with the one-row bias; the GPU's
    ``causal_lower_right``, which CPU's SDPA materializes) equal SDPA with the explicit chunk mask,
    output and gradients, in fp64."""
    gen = torch.Generator().manual_seed(2)
    chunk_len, chunk = 4, 2
    key_len = (chunk + 1) * chunk_len
    q = torch.randn(2, 4, chunk_len, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2, key_len, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    grad = torch.randn(2, 4, chunk_len, 8, generator=gen, dtype=torch.float64)
    results = []
    for explicit in (True, False):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        if explicit:
            out = F.scaled_dot_product_attention(*leaves, attn_mask=_chunk_mask(chunk, chunk_len, key_len, "cpu"),
                                                 enable_gqa=True)
        else:
            out = _causal_chunk_attention(*leaves, None, True, strided_bias=strided_bias)
        out.backward(grad)
        results.append([out, *(t.grad for t in leaves)])
    for ref, mine in zip(*results):
        assert (mine - ref).abs().max() < 1e-12


# ----------------------------------------------------------------------------- spawned

CASES = list(itertools.product([False, True], [False, True], [True, False]))
"""(gqa, key_padding_mask, causal)."""


def _reference(q, k, v, causal, key_padding_mask):
    """The un-split attention on the whole sequence, one SDPA call (its own causal path when no
    padding mask, an explicit ``[b, 1, s, s]`` mask with one)."""
    gqa = q.shape[1] != k.shape[1]
    if key_padding_mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    s = q.shape[2]
    mask = key_padding_mask[:, None, None, :]
    if causal:
        mask = mask & torch.ones(s, s, dtype=torch.bool).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def _error(mine, ref):
    return ((mine - ref).abs() / ref.abs().clamp(min=1)).max().item()


def _errors(rank, cp_size, group, gqa, padded, causal, regather=False, dtype=torch.float32, seed=0):
    """The error of the output and of q, k, v's gradients of this rank's shard, each over the error
    it is allowed (so at most 1): fp64 against the one SDPA call (``TOL_FP64``), fp32 against an fp64
    evaluation, bounded by SDPA's own fp32 error there."""
    gen = torch.Generator().manual_seed(seed)
    b, heads, seq_len, d = 2, 4, 8 * cp_size, 8
    kv_heads = 2 if gqa else heads
    q = torch.randn(b, heads, seq_len, d, generator=gen)
    k = torch.randn(b, kv_heads, seq_len, d, generator=gen)
    v = torch.randn(b, kv_heads, seq_len, d, generator=gen)
    grad_out = torch.randn(b, heads, seq_len, d, generator=gen)
    q, k, v, grad_out = (t.to(dtype) for t in (q, k, v, grad_out))
    mask = None
    if padded:
        mask = torch.rand(b, seq_len, generator=gen) > 0.3
        mask[1, seq_len // 2:] = False        # sample 1 right-padded, as a loss mask pads
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _reference(*full, causal, mask)
    ref.backward(grad_out)
    local = [shard_sequence(t, rank, cp_size, dim=2).detach().requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*local, group, causal=causal, key_padding_mask=mask,
                                     regather_in_backward=regather)
    out.backward(shard_sequence(grad_out, rank, cp_size, dim=2))
    mine = {"out": out, **{name: t.grad for name, t in zip("qkv", local)}}
    if dtype == torch.float64:
        theirs = {"out": ref, **{name: t.grad for name, t in zip("qkv", full)}}
        return dtype, {name: _error(mine[name], shard_sequence(theirs[name], rank, cp_size, dim=2)) / TOL_FP64
                       for name in mine}
    # fp32: both the split attention and the one SDPA call are measured against the un-split
    # attention evaluated in fp64; ours may be ERROR_FACTOR times as far from it as SDPA's fp32
    # result (another summation order alone moves a gradient by a few units in the last place,
    # 1.2e-6 here on one machine, which a fixed 1e-6 against fp32 SDPA failed) plus a floor
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    exact_out = _reference(*exact, causal, mask)
    exact_out.backward(grad_out.double())
    exact = {"out": exact_out, **{name: t.grad for name, t in zip("qkv", exact)}}
    theirs = {"out": ref, **{name: t.grad for name, t in zip("qkv", full)}}
    errs = {}
    for name in mine:
        anchor = shard_sequence(exact[name], rank, cp_size, dim=2)
        bound = ERROR_FACTOR * _error(shard_sequence(theirs[name], rank, cp_size, dim=2).double(), anchor) \
            + ERROR_FLOOR[torch.float32]
        errs[name] = _error(mine[name].double(), anchor) / bound
    return dtype, errs


def _all_cases(rank, world_size):
    """Every case in this one group: the plain reduce-scatter, then its all-reduce fallback, and
    gathering again in backward."""
    group = torch.distributed.group.WORLD
    results = {}
    for (gqa, padded, causal), dtype in itertools.product(CASES, [torch.float32, torch.float64]):
        results[("plain", gqa, padded, causal, dtype)] = _errors(rank, world_size, group, gqa, padded, causal,
                                                                 dtype=dtype)
    results[("regather", True, True, True)] = _errors(rank, world_size, group, True, True, True, regather=True)
    saved = dict(cp_mod._REDUCE_SCATTER_WORKS)
    cp_mod._REDUCE_SCATTER_WORKS["gloo"] = False
    try:
        results[("all_reduce_fallback", True, True, True)] = _errors(rank, world_size, group, True, True, True)
    finally:
        cp_mod._REDUCE_SCATTER_WORKS.clear()
        cp_mod._REDUCE_SCATTER_WORKS.update(saved)
    results["reduce_scatter_works"] = (None, saved.get("gloo"))
    results["gather_sequence"] = (torch.float32, _gather_errors(rank, world_size, group))
    return results, _refusals(world_size, group)


def _gather_errors(rank, cp_size, group):
    """``gather_sequence`` gives the full sequence on every rank; its backward sums the ranks'
    gradients (each rank used the whole gathered tensor: ``cp`` times this rank's part, exactly)."""
    gen = torch.Generator().manual_seed(1)
    full, grad = torch.randn(2, 8 * cp_size, 3, generator=gen), torch.randn(2, 8 * cp_size, 3, generator=gen)
    local = shard_sequence(full, rank, cp_size, dim=1).requires_grad_()
    gathered = gather_sequence(local, group, dim=1)
    gathered.backward(grad)
    bound = 1e-6   # copies and a sum of cp equal terms: exact in fact
    return {"value": (gathered - full).abs().max().item() / bound,
            "grad": (local.grad - cp_size * shard_sequence(grad, rank, cp_size, dim=1)).abs().max().item() / bound}


def _refusals(cp_size, group):
    """The one-line errors for what the attention does not take."""
    x = torch.zeros(1, 2, 4, 8)
    attend_local = torch.ones(1, 4, dtype=torch.bool)           # the local length, not the full sequence
    calls = {
        "dropout": lambda: context_parallel_attention(x, x, x, group, dropout_p=1.0),
        "mask_local": lambda: context_parallel_attention(x, x, x, group, key_padding_mask=attend_local),
        "mask_float": lambda: context_parallel_attention(x, x, x, group, key_padding_mask=torch.ones(1, 4 * cp_size)),
        "odd_local": lambda: context_parallel_attention(x[:, :, :3], x[:, :, :3], x[:, :, :3], group),
        "heads": lambda: context_parallel_attention(x, x[:, :1].expand(1, 3, 4, 8), x[:, :1].expand(1, 3, 4, 8), group),
    }
    messages = {}
    for name, call in calls.items():
        try:
            call()
            messages[name] = None
        except ValueError as err:
            messages[name] = str(err)
    return messages


@pytest.mark.parametrize("cp_size", [2, 4])
def test_attention_matches_unsplit(cp_size):
    """Output and q/k/v gradients of the un-split attention (fp64: within 1e-12 of one SDPA call; fp32:
    within ERROR_FACTOR times SDPA's own fp32 error, plus ERROR_FLOOR, of an fp64 evaluation): with and without
    GQA, a key-padding mask and the causal mask; also with the all-reduce fallback for the
    reduce-scatter and with K/V gathered again in backward."""
    per_rank, refusals = zip(*spawn_ranks(_all_cases, cp_size, timeout_s=120))
    assert per_rank[0]["reduce_scatter_works"][1] is True   # gloo on this torch has reduce_scatter
    bad = {(rank, case): errs for rank, res in enumerate(per_rank) for case, (dtype, errs) in res.items()
           if case != "reduce_scatter_works" and max(errs.values()) > 1.0}
    assert not bad, bad
    assert "dropout" in refusals[0]["dropout"]
    assert f"bool [1, {4 * cp_size}]" in refusals[0]["mask_local"] and "full sequence" in refusals[0]["mask_float"]
    assert "2*cp" in refusals[0]["odd_local"]
    assert "multiple of kv_heads" in refusals[0]["heads"]


# ----------------------------------------------------------------------------- memory

MEM_SHAPE = dict(b=1, heads=8, kv_heads=2, seq_len=1024, d=64)


def _retained(rank, world_size):
    """Bytes autograd keeps for one call (fp32, GQA): plain SDPA on the whole sequence, CP over a
    one-rank group (cp=1), CP at cp=2 (per rank) keeping the gathered K/V, and gathering again."""
    from lightning_mhc.recompute import ActivationMemoryMeter

    b, heads, kv_heads, seq_len, d = MEM_SHAPE.values()
    singles = [torch.distributed.new_group([r]) for r in range(world_size)]   # every rank makes every group
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, heads, seq_len, d, generator=gen)
    k = torch.randn(b, kv_heads, seq_len, d, generator=gen)
    v = torch.randn(b, kv_heads, seq_len, d, generator=gen)

    def measure(fn, *tensors):
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        with ActivationMemoryMeter() as meter:
            out = fn(*leaves)
        out.sum().backward()   # the graph runs (no collective left pending)
        return meter.result.retained_bytes

    local = [shard_sequence(t, rank, world_size, dim=2) for t in (q, k, v)]
    world = torch.distributed.group.WORLD
    padding = torch.ones(b, seq_len, dtype=torch.bool)
    padding[:, -seq_len // 8:] = False
    return {
        "sdpa_full": measure(lambda *t: F.scaled_dot_product_attention(*t, is_causal=True, enable_gqa=True), q, k, v),
        "cp1": measure(lambda *t: context_parallel_attention(*t, singles[rank]), q, k, v),
        "cp2_keep": measure(lambda *t: context_parallel_attention(*t, world), *local),
        "cp2_regather": measure(lambda *t: context_parallel_attention(*t, world, regather_in_backward=True), *local),
        "cp2_keep_padded": measure(lambda *t: context_parallel_attention(*t, world, key_padding_mask=padding), *local),
    }


def test_retained_bytes():
    """The bytes autograd keeps for one attention call, each term named: CP at cp=2 keeps, per
    rank, half of q, the output and the softmax statistics but the whole gathered K/V; gathering
    again in backward keeps only the local q, k, v. On CPU each chunk's causal mask is kept as one
    row of ``L + key_len - 1`` floats (a strided view), not the dense ``L x key_len``; with a
    key-padding mask the dense combined mask is kept."""
    per_rank = spawn_ranks(_retained, 2, timeout_s=120)
    b, heads, kv_heads, seq_len, d = MEM_SHAPE.values()
    f32, cp_size = 4, 2
    q_full = b * heads * seq_len * d * f32                    # = the output's size
    lse_full = b * heads * seq_len * f32                      # softmax log-sum-exp per query
    kv_full = 2 * b * kv_heads * seq_len * d * f32            # K and V of the whole sequence

    def mask_rows(rank, cp):
        chunk_len = seq_len // (2 * cp)
        return sum(f32 * (chunk_len + (c + 1) * chunk_len - 1) for c in local_chunks(rank, cp))

    for rank, got in enumerate(per_rank):
        print(f"rank {rank} retained bytes: {got}")
        assert got["sdpa_full"] == 2 * q_full + kv_full + lse_full
        assert got["cp1"] == 2 * q_full + kv_full + lse_full + mask_rows(0, 1)
        assert got["cp2_keep"] == (2 * q_full + lse_full) // cp_size + kv_full + mask_rows(rank, cp_size)
        assert got["cp2_regather"] == (q_full + kv_full) // cp_size   # the local q, k, v only
        # a key-padding mask with the causal one: SDPA keeps each chunk's dense [b, 1, L, key_len] mask, in fp32
        chunk_len = seq_len // (2 * cp_size)
        dense = f32 * b * chunk_len * sum((c + 1) * chunk_len for c in local_chunks(rank, cp_size))
        assert got["cp2_keep_padded"] == (2 * q_full + lse_full) // cp_size + kv_full + dense
