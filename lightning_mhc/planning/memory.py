"""Per-rank model-state bytes of a layout: parameters, gradients and AdamW state.

Each virtual pipeline stage's parameter tensors are counted from the config
(``lightning_mhc.planning.shapes``: no model built, no process group) with the runtime's own split
of layers over stages (``partition_layers``), and each tensor is divided as the layout divides it:
by TP where the runtime's layer splits it, by EP for a routed expert's.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from lightning_mhc.distributed.layout import ParallelLayout
from lightning_mhc.errors import ConfigError
from lightning_mhc.model.config import MHCTransformerConfig, with_parallel_layout
from lightning_mhc.model.stages import partition_layers
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

    @property
    def total(self) -> int:
        return self.dense + self.expert


def stage_counts(config: MHCTransformerConfig, layout: ParallelLayout, first_stage_layers: int | None = None,
                 last_stage_layers: int | None = None) -> list[StageCount]:
    """One :class:`StageCount` per physical pipeline stage of ``layout`` (every rank of a stage holds
    the same count: TP shards and EP shards are equal in size). The asked layout's rules (sizes over
    TP, layers over stages, the padded vocabulary) are checked first, by the config itself."""
    asked = with_parallel_layout(config, layout)
    tp, ep = layout.tensor_model_parallel_size, layout.expert_model_parallel_size
    p, v = layout.pipeline_model_parallel_size, layout.num_virtual_stages // layout.pipeline_model_parallel_size
    ranges = partition_layers(config.num_layers, p * v, first_stage_layers, last_stage_layers)
    counts = []
    for stage in range(p):
        dense = expert = tensors = 0
        chunks = [c * p + stage for c in range(v)]  # megatron's interleaved assignment
        for virtual in chunks:
            for tensor in chunk_tensors(asked, ranges[virtual], virtual == 0, virtual == p * v - 1):
                n = tensor.numel // tp if tensor.tensor_parallel else tensor.numel
                if tensor.expert:
                    expert += n // ep
                else:
                    dense += n
                tensors += 1
        counts.append(StageCount(stage, tuple(ranges[c] for c in chunks), dense, expert, tensors))
    return counts


@dataclass(frozen=True)
class RankBytes:
    """Model-state bytes of one rank of a stage."""

    stage: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int

    @property
    def total(self) -> int:
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes


def _shard(numel: int, parts: int) -> int:
    """A ZeRO-1 rank's elements of ``numel`` split in ``parts`` (padded up, as the runtime pads)."""
    return -(-numel // parts)


def plan_gpt(config: MHCTransformerConfig, layout: ParallelLayout, *, param_bytes: int = FP32,
             distributed_optimizer: bool = False, first_stage_layers: int | None = None,
             last_stage_layers: int | None = None) -> list[RankBytes]:
    """Each stage's per-rank bytes of the mHC GPT (:func:`rank_bytes` of :func:`stage_counts`)."""
    return rank_bytes(stage_counts(config, layout, first_stage_layers, last_stage_layers), layout,
                      param_bytes=param_bytes, distributed_optimizer=distributed_optimizer)


def rank_bytes(counts: list[StageCount], layout: ParallelLayout, *, param_bytes: int = FP32,
               distributed_optimizer: bool = False) -> list[RankBytes]:
    """Each stage's per-rank bytes from its element counts (the mHC GPT's or a Hugging Face
    model's: the runtime keeps both in the same buffers and optimizer).

    Parameters at ``param_bytes`` each (4: fp32 and bf16-mixed; 2: bf16-true). Gradients: the
    runtime accumulates in fp32 ``main_grad`` buffers when it shards or holds bf16 weights, else
    in the parameter's dtype. AdamW: two fp32 moments per element; with ZeRO-1 each rank keeps
    its 1/(DP x CP) range (experts: 1/(expert-data)), plus fp32 main weights of that range under
    bf16 weights. Without ZeRO-1, torch's AdamW also keeps a 0-d fp32 step per parameter tensor.
    """
    dp_cp = layout.data_parallel_size * layout.context_parallel_size
    expert_dp = dp_cp // layout.expert_model_parallel_size
    out = []
    for count in counts:
        params = count.total * param_bytes
        fp32_grads = distributed_optimizer or param_bytes != FP32
        grads = count.total * (FP32 if fp32_grads else param_bytes)
        if distributed_optimizer:
            held = _shard(count.dense, dp_cp) + (_shard(count.expert, expert_dp) if count.expert else 0)
        else:
            held = count.total
        optim = held * FP32 * ADAM_MOMENTS
        if not distributed_optimizer:
            optim += count.tensors * FP32  # AdamW's 0-d step tensor per parameter
        if param_bytes != FP32:
            optim += held * FP32  # the fp32 main weights the step updates
        out.append(RankBytes(count.stage, params, grads, optim))
    return out
