"""Per-rank model-state bytes of a layout: parameters, gradients and AdamW state.

Each virtual pipeline stage's parameter tensors are counted from the config
(``lightning_mhc.planning.shapes``: no model built, no process group) with the runtime's own split
of layers over stages (``partition_layers``), and each tensor is divided as the layout divides it:
by TP where the runtime's layer splits it, by EP for a routed expert's.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from lightning_mhc.distributed.grads import DEFAULT_BUCKET_BYTES, buckets
from lightning_mhc.distributed.layout import ParallelLayout
from lightning_mhc.distributed.optimizer import owned_pieces
from lightning_mhc.errors import ConfigError
from lightning_mhc.model.sizes import GPTSizes, partition_layers
from lightning_mhc.planning.shapes import chunk_tensors

ADAM_MOMENTS = 2
"""AdamW keeps two fp32 moments per parameter element (``exp_avg``, ``exp_avg_sq``)."""
FP32 = 4

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(text: str | int | float) -> int:
    """``80GB`` (10^9), ``80GiB`` (2^30), ``1.5TB`` or a plain number of bytes."""
    if isinstance(text, (int, float)) and not isinstance(text, bool) and text > 0:
        return int(text)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not match or match.group(2).upper() not in _UNITS or float(match.group(1)) <= 0:
        raise ConfigError(f"plan.device_memory={text!r} is not a memory size: write e.g. 80GB, 80GiB or 85899345920.")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


@dataclass(frozen=True)
class HeldTensor:
    """One trainable parameter tensor as a rank holds it (after TP's and EP's split)."""

    numel: int
    expert: bool = False
    """An expert's: bucketed apart, reduced and sharded over the expert-data ranks."""
    alone: bool = False
    """The tied embedding (or its copy on the last stage): the runtime gives it a bucket of its own."""
    partial_over_tp: bool = False
    """Its gradient is a partial sum over TP (``grads.is_partial_over_tp``: a sequence-parallel norm,
    hyper-connection or row bias under SP), summed over TP after the step (the traffic counts it)."""


@dataclass(frozen=True)
class StageCount:
    """Elements of one physical pipeline stage's parameters as one of its ranks holds them."""

    stage: int
    layers: tuple[tuple[int, int], ...]
    """Global ``[start, end)`` layers of each model chunk this stage holds."""
    dense: int
    """Elements reduced over DP x CP (everything but the experts), after TP's split."""
    expert: int
    """Expert elements this rank holds (after EP's split), reduced over the expert-data ranks."""
    tensors: int
    """Parameter tensors on this rank (AdamW keeps a step counter per tensor)."""
    chunks: tuple[tuple[HeldTensor, ...], ...] = ()
    """Each model chunk's tensors in the chunk's parameter order (ZeRO-1's buckets follow it)."""

    @property
    def total(self) -> int:
        return self.dense + self.expert


def stage_counts(config: GPTSizes | Any, layout: ParallelLayout, first_stage_layers: int | None = None,
                 last_stage_layers: int | None = None) -> list[StageCount]:
    """One :class:`StageCount` per physical pipeline stage of ``layout`` (every rank of a stage holds
    the same count: TP shards and EP shards are equal in size). The asked layout's rules (sizes over
    TP, layers over stages, experts over EP) are checked first (``GPTSizes.check_layout``).
    ``config``: the model's sizes, or its config."""
    sizes = GPTSizes.of(config)
    sizes.check_layout(layout)
    tp, ep = layout.tensor_model_parallel_size, layout.expert_model_parallel_size
    p, v = layout.pipeline_model_parallel_size, layout.num_virtual_stages // layout.pipeline_model_parallel_size
    ranges = partition_layers(sizes.num_layers, p * v, first_stage_layers, last_stage_layers)
    counts = []
    tied = sizes.share_embeddings_and_output_weights
    sp = layout.sequence_parallel and tp > 1
    for stage in range(p):
        dense = expert = tensors = 0
        chunks = [c * p + stage for c in range(v)]  # megatron's interleaved assignment
        held = []
        for virtual in chunks:
            first, last = virtual == 0, virtual == p * v - 1
            held.append([])
            for tensor in chunk_tensors(sizes, ranges[virtual], first, last):
                n = tensor.numel // tp if tensor.tensor_parallel else tensor.numel
                if tensor.expert:
                    n //= ep
                    expert += n
                else:
                    dense += n
                tensors += 1
                # the GPT marks the tied embedding, and the output layer's copy of it on a last stage
                alone = tied and tensor.name in ("embedding.word_embeddings.weight", "output_layer.weight")
                # under SP the decoder's TP-replicated tensors saw this rank's part of the sequence
                partial = sp and tensor.name.startswith("decoder.") and not tensor.tensor_parallel
                held[-1].append(HeldTensor(n, tensor.expert, alone, partial))
        counts.append(StageCount(stage, tuple(ranges[c] for c in chunks), dense, expert, tensors,
                                 tuple(tuple(h) for h in held)))
    return counts


@dataclass(frozen=True)
class RankBytes:
    """Model-state bytes of a stage's most loaded rank (its ranks differ only in ZeRO-1's shares)."""

    stage: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    optimizer_bytes_by_rank: tuple[int, ...] = ()
    """Under ZeRO-1: the optimizer bytes of each of the stage's DP x CP ranks, by its index in the
    DP x CP group (``optimizer_bytes`` is their largest); empty otherwise (every rank the same)."""

    @property
    def total(self) -> int:
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes


def held_buckets(count: StageCount, bucket_bytes: int = DEFAULT_BUCKET_BYTES, param_bytes: int = FP32
                 ) -> list[tuple[bool, list[int]]]:
    """``(expert, the elements of each of its tensors)`` of each of the runtime's gradient buckets
    on a rank of the stage (:func:`bucket_tensors`)."""
    return [(expert, [t.numel for t in held]) for expert, held in bucket_tensors(count, bucket_bytes, param_bytes)]


def bucket_tensors(count: StageCount, bucket_bytes: int = DEFAULT_BUCKET_BYTES, param_bytes: int = FP32
                   ) -> list[tuple[bool, list[HeldTensor]]]:
    """``(expert, its tensors)`` of each of the runtime's gradient buckets
    on a rank of the stage (the distributed optimizer's, also what ZeRO-1's traffic moves): its
    own ``buckets`` rule run on meta tensors of the held sizes, in its order (each chunk's
    parameters reversed, the dense ones then the experts', the tied embedding alone). One dtype
    (``param_bytes``) for every tensor: the runtime's parameters are all fp32, or all bf16 under
    ``bf16-true``, whose precision plugin (``HalfPrecision.convert_module``: ``module.to(bfloat16)``)
    casts the hyper-connections' and the router's, built fp32, too; so no bucket is cut by dtype."""
    if not count.chunks and count.tensors:
        raise ConfigError("the stage's tensors were not listed in order: its buckets cannot be counted.")
    dtype = torch.float32 if param_bytes == FP32 else torch.bfloat16
    out = []
    for chunk in count.chunks:
        for expert in (False, True):  # grads.by_reduction_group's order
            held = [t for t in reversed(chunk) if t.expert == expert]
            metas = [torch.empty(t.numel, dtype=dtype, device="meta") for t in held]
            alone = {id(m) for m, t in zip(metas, held) if t.alone}
            of = {id(m): t for m, t in zip(metas, held)}
            out += [(expert, [of[id(m)] for m in bucket])
                    for bucket in buckets(metas, bucket_bytes, alone=lambda m: id(m) in alone)]
    return out


def bucket_parts(expert: bool, layout: ParallelLayout) -> int:
    """The ranks ZeRO-1 cuts a bucket over: DP x CP, an expert's the expert-data ranks (DP x CP / EP)."""
    dp_cp = layout.data_parallel_size * layout.context_parallel_size
    return dp_cp // layout.expert_model_parallel_size if expert else dp_cp


def zero1_shares(count: StageCount, layout: ParallelLayout, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 param_bytes: int = FP32) -> list[tuple[int, int]]:
    """``(elements, pieces)`` each DP x CP rank of a stage steps under ZeRO-1, by its index in the
    DP x CP group: each of the runtime's buckets (:func:`held_buckets`) cut over the ranks holding
    it (``optimizer.owned_pieces``). An expert bucket's rank is the DP x CP index over EP (megatron
    orders EP inside expert-DP)."""
    dp_cp = layout.data_parallel_size * layout.context_parallel_size
    ep = layout.expert_model_parallel_size
    shares = [[0, 0] for _ in range(dp_cp)]
    for expert, numels in held_buckets(count, bucket_bytes, param_bytes):
        for rank in range(dp_cp):
            for _, flat, _ in owned_pieces(numels, bucket_parts(expert, layout), rank // ep if expert else rank):
                shares[rank][0] += flat.stop - flat.start
                shares[rank][1] += 1
    return [tuple(share) for share in shares]


def zero1_gradient_elements(count: StageCount, layout: ParallelLayout, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                            param_bytes: int = FP32) -> int:
    """The elements of a rank's fp32 gradient buffers under ZeRO-1: each bucket's whole, padded to a
    multiple of its ranks (``ShardBucket``'s buffer, reduce-scattered whole)."""
    return sum(-(-sum(numels) // parts) * parts for expert, numels in held_buckets(count, bucket_bytes, param_bytes)
               for parts in [bucket_parts(expert, layout)])


def plan_gpt(config: GPTSizes | Any, layout: ParallelLayout, *, param_bytes: int = FP32,
             distributed_optimizer: bool = False, first_stage_layers: int | None = None,
             last_stage_layers: int | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[RankBytes]:
    """Each stage's per-rank bytes of the mHC GPT (:func:`rank_bytes` of :func:`stage_counts`)."""
    return rank_bytes(stage_counts(config, layout, first_stage_layers, last_stage_layers), layout,
                      param_bytes=param_bytes, distributed_optimizer=distributed_optimizer, bucket_bytes=bucket_bytes)


def rank_bytes(counts: list[StageCount], layout: ParallelLayout, *, param_bytes: int = FP32,
               distributed_optimizer: bool = False, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[RankBytes]:
    """Each stage's per-rank bytes from its element counts (the mHC GPT's or a Hugging Face
    model's: the runtime keeps both in the same buffers and optimizer).

    Parameters at ``param_bytes`` each (4: fp32 and bf16-mixed; 2: bf16-true, every parameter:
    :func:`held_buckets`). Gradients: the runtime accumulates in fp32 ``main_grad`` buffers when it
    shards or holds bf16 weights (one per bucket; under ZeRO-1 each padded to a multiple of its
    ranks: :func:`zero1_gradient_elements`), else in the parameter's dtype (fp32). AdamW: two fp32
    moments per element; with ZeRO-1 each rank keeps
    its range of each bucket (1/(DP x CP) of it, experts' 1/(expert-data); :func:`zero1_shares`),
    plus fp32 main weights of that range under bf16 weights. torch's AdamW also keeps a 0-d fp32
    step per tensor it steps: per parameter tensor, under ZeRO-1 per piece of one a rank holds.
    """
    out = []
    for count in counts:
        params = count.total * param_bytes
        if distributed_optimizer:
            grads = zero1_gradient_elements(count, layout, bucket_bytes, param_bytes) * FP32
        else:  # bf16 weights: the fp32 buffers, unpadded (one part each); fp32 weights: their .grad
            grads = count.total * FP32
        main = FP32 * ADAM_MOMENTS + (FP32 if param_bytes != FP32 else 0)  # + fp32 main weights under bf16
        if distributed_optimizer:
            # AdamW's 0-d step tensor per piece
            by_rank = tuple(held * main + pieces * FP32
                            for held, pieces in zero1_shares(count, layout, bucket_bytes, param_bytes))
            out.append(RankBytes(count.stage, params, grads, max(by_rank), by_rank))
        else:
            out.append(RankBytes(count.stage, params, grads, count.total * main + count.tensors * FP32))
    return out
