"""Retained activation bytes per rank: what one micro-batch's forward keeps for its backward on each
model chunk, under each recompute policy, times the micro-batches in flight when the schedule holds
the most (1F1B or interleaved), plus the stage inputs the schedule keeps.

Each term is a tensor the runtime's modules save for backward (counted as the runtime's meter
counts them: unique storages, parameters excluded), sized from the config and divided as the layout
divides it: TP splits heads, the attention context and the MLP's hidden width; sequence parallelism
also splits the tokens of everything else (norms, residual streams, hyper-connections). Per layer,
with ``T = s b`` tokens of a micro-batch, ``e`` bytes an element, ``n`` streams of width ``h``:

- attention (every policy but ``full``): the rotary tables (4 of ``s d``), Q and K for the scores
  (``2 T a d / tp``), the scores, their softmax and its input (``3 b (a / tp) s^2``), the fused QKV
  output (``T d (a + 2g) / tp``) and the context (``T a d / tp``);
- ``none``: two norms' statistics (``2 T``), eight ``T h`` tensors (norm inputs and outputs, the
  residual adds), the MLP's two ``T F / tp`` (a gated unit's four: ``linear_fc1``'s ``2F`` wide
  output, whose halves the activation and the product keep as views, the activation's output and
  the product); with streams, per sub-layer the stream twice
  (``2 T n h``) and the mappings (``T (1 + 2n + n^2 + (n^2 + 2n))``);
- ``selective`` (norms and MLP recomputed): four ``T h``, the attention, the streams' terms;
- ``mhc_block``: two ``T h``, the attention, the MLP; the hyper-connections recomputed, so only
  each recompute block's stream (``2 T n h`` per block);
- ``full``: each layer's input stream ``T n h``.

Each in ``e`` bytes, the weights' dtype, but what the model computes in fp32 whatever the weights
(:data:`FP32`), and under bf16 the fp32 copies a forward keeps (the fused hyper-connection's
parameters, the norms' weights, the CPU math attention's Q, K and V).
Checked against the runtime's measurement (``measure_activation_memory``, the CLI's
``activation_bytes``) in tests/test_planner_activations.py, in fp32 and under ``bf16-true``. Not
covered: CP, MoE layers (refused by :func:`check_activation_plan`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_mhc.errors import ConfigError
from lightning_mhc.model.sizes import partition_layers
from lightning_mhc.recompute.groups import block_ranges
from lightning_mhc.recompute.policy import DEFAULT_MODULES, RecomputePolicy

FP32 = 4
"""What the model computes in fp32 whatever its weights' dtype: the norms' statistics and normalised
input, the hyper-connections' mappings and projection, the attention's scores, the logits of the loss."""


@dataclass(frozen=True)
class ChunkShape:
    """One model chunk as the activation count needs it."""

    layers: int
    first: bool
    """Holds the embedding (takes the tokens; a later chunk receives a stream instead)."""
    last: bool
    """Holds the output layer and the loss."""


def check_activation_plan(config: Any, layout: Any, policy: RecomputePolicy) -> None:
    """What the activation count does not cover yet, refused in one line."""
    missing = [what for what, yes in (
        ("context parallelism", layout.context_parallel_size > 1),
        ("MoE layers", bool(getattr(config, "num_moe_experts", None))),
        ("recompute_modules other than the policy's default", policy.modules is not None
         and tuple(policy.modules) != DEFAULT_MODULES.get(policy.name)),
    ) if yes]
    if missing:
        raise ConfigError(f"the planner's activation count does not cover {', '.join(missing)} yet "
                          f"(policy {policy.name}); its model-state bytes are exact.")


def layer_bytes(config: Any, policy: str, tp: int, sp: bool, seq: int, mbs: int, e: int) -> int:
    """One layer's retained bytes for one micro-batch (the recompute blocks' streams not included).
    ``e``: an activation's bytes (the weights' dtype); what the model computes in fp32 whatever the
    weights (:data:`FP32`) is counted at 4 bytes: in fp32 both are 4 and the terms merge."""
    c, a, d = config.hidden_size, config.num_attention_heads, config.kv_channels
    g, f = config.num_query_groups or a, config.ffn_hidden_size
    n = config.num_residual_streams if config.enable_hyper_connections else 1
    t, spd = seq * mbs, tp if sp else 1
    low = e < FP32  # bf16 weights: fp32 copies appear where the model computes in fp32
    if policy == "full":
        return t * n * c * e // spd
    rope = 4 * seq * d * e if config.position_embedding_type == "rope" else 0
    scores = 3 * mbs * (a // tp) * seq * seq  # the scores, their softmax and its input: fp32 in either
    if low:  # CPU's math attention runs bf16 in fp32: it keeps fp32 copies of Q, K and V, not the QKV output
        attention = FP32 * (scores + 3 * t * a * d // tp) + e * t * a * d // tp + rope
    else:
        attention = e * (2 * t * a * d // tp + scores + t * d * (a + 2 * g) // tp + t * a * d // tp) + rope
    streams = 0
    if config.enable_hyper_connections and policy != "mhc_block":
        # per sub-layer: the stream twice and H_res (as the stream's dtype) in e; 1/rms, H_pre,
        # H_post and the projection x phi in fp32; under bf16 also H_post as the stream's dtype and
        # the fp32 copies of phi, alpha and the bias the fused op takes
        streams = 2 * (t * (e * (2 * n * c + n * n) + FP32 * (1 + 2 * n + n * n + 2 * n)) // spd)
        if low:
            m = n * n + 2 * n
            streams += 2 * (e * t * n // spd + FP32 * (n * c * m + m + 3))
    mlp = e * (4 if config.gated_linear_unit else 2) * t * f // tp  # kept where the MLP is not recomputed
    if policy == "none":
        # per norm its fp32 statistics (T) and normalised input (T h) and, under bf16, its weight's
        # fp32 copy (h); six more T h in e (the norms' inputs and outputs, the residual adds)
        norms = 2 * (FP32 * (t + t * c) // spd + (FP32 * c if low else 0))
        return attention + streams + norms + e * 6 * t * c // spd + mlp
    if policy == "selective":
        return attention + streams + e * 4 * t * c // spd
    return attention + e * 2 * t * c // spd + mlp  # mhc_block


def chunk_bytes(config: Any, policy: str, layer_num: int | None, tp: int, sp: bool, seq: int, mbs: int, e: int,
                chunk: ChunkShape) -> int:
    """One micro-batch's retained bytes on one model chunk: its layers, its recompute blocks' streams,
    the embedding's and the loss's tensors where it holds them."""
    c, t, spd = config.hidden_size, seq * mbs, tp if sp else 1
    n = config.num_residual_streams if config.enable_hyper_connections else 1
    total = chunk.layers * layer_bytes(config, policy, tp, sp, seq, mbs, e)
    if policy == "mhc_block" and chunk.layers:
        total += len(block_ranges(chunk.layers, n, layer_num)) * e * 2 * t * n * c // spd
    if policy == "full" and chunk.layers and config.position_embedding_type == "rope":
        total += seq * config.kv_channels * FP32  # the rotary angles (fp32) every layer's checkpoint saves, once
    if chunk.first:  # the embedding's output (the token ids are the whole batch's: stage_extra_bytes)
        total += e * t * c // spd
    if chunk.last:
        vocab = config.padded_vocab_size
        # the final norm's input and output (e), its statistics and normalised input (fp32, and its
        # weight's fp32 copy under bf16), the logits (fp32 for the loss), the loss's mask
        total += e * 2 * t * c // spd + FP32 * ((t + t * c) // spd + t * vocab // tp) + t + vocab // tp
        total += FP32 * c if e < FP32 else 0
    else:
        total += e  # the sent output, which the schedule keeps shrunk to one element
    return total


def in_flight_peak(unit_bytes: list[int], p: int, rank: int, m: int, group: int | None = None) -> tuple[int, int]:
    """The most bytes this stage holds at once, and how many micro-batch chunks then: ``unit_bytes[c]``
    is what a micro-batch keeps on the stage's chunk ``c`` (its stage input included). 1F1B (one
    chunk): ``min(p - rank, m)`` micro-batches. Interleaved: the schedule's own order replayed (the
    warm-up's forwards, then one forward and one backward per steady step), measured where the
    runtime measures (after each warm-up forward, after each steady step)."""
    v = len(unit_bytes)
    if v == 1:
        held = min(p - rank, m)
        return held * unit_bytes[0], held
    from lightning_mhc.distributed.pipeline.interleaved import schedule_table

    table = schedule_table(m, v, group or p)
    total = m * v
    warmup = min(2 * (p - rank - 1) + (v - 1) * (group or p), total)
    held: list[int] = []
    best = (0, 0)

    def probe():
        nonlocal best
        best = max(best, (sum(unit_bytes[c] for c in held), len(held)))

    for k in range(warmup):
        held.append(table[k][1])
        probe()
    for k in range(total - warmup):
        held.append(table[k + warmup][1])
        held.remove(v - 1 - table[k][1])
        probe()
    return best


def stage_extra_bytes(config: Any, tp: int, sp: bool, seq: int, mbs: int, m: int, e: int, first: bool, last: bool,
                      interleaved: bool) -> int:
    """What a stage holds once, whatever the micro-batches in flight: the step's token ids on the
    first stage and labels on the last (int64; micro-batches are views of the step's batch, one
    storage), and under the interleaved schedule the next chunk's input, received before its forward."""
    n = config.num_residual_streams if config.enable_hyper_connections else 1
    extra = 8 * m * seq * mbs * (int(first) + int(last))
    if interleaved:
        extra += e * seq * mbs * n * config.hidden_size // (tp if sp else 1)
    return extra


def plan_activations(config: Any, layout: Any, policy: str | RecomputePolicy, *, seq_length: int,
                     micro_batch_size: int, num_microbatches: int, element_bytes: int = 4,
                     first_stage_layers: int | None = None, last_stage_layers: int | None = None) -> list[tuple[int, int]]:
    """Each pipeline stage's ``(retained activation bytes, micro-batch chunks in flight)`` at the
    schedule's peak, per rank of that stage. ``config``: the model's sizes
    (``GPTSizes``, or its config)."""
    policy = RecomputePolicy.of(policy)
    check_activation_plan(config, layout, policy)
    layer_num, policy = policy.layer_num, policy.name
    tp, sp = layout.tensor_model_parallel_size, layout.sequence_parallel
    p = layout.pipeline_model_parallel_size
    v = layout.num_virtual_stages // p
    ranges = partition_layers(config.num_layers, p * v, first_stage_layers, last_stage_layers)
    out = []
    for rank in range(p):
        units = []
        for c in range(v):
            virtual = c * p + rank
            chunk = ChunkShape(ranges[virtual][1] - ranges[virtual][0], virtual == 0, virtual == p * v - 1)
            units.append(chunk_bytes(config, policy, layer_num, tp, sp, seq_length, micro_batch_size, element_bytes,
                                     chunk))
        held_bytes, held = in_flight_peak(units, p, rank, num_microbatches)
        held_bytes += stage_extra_bytes(config, tp, sp, seq_length, micro_batch_size, num_microbatches, element_bytes,
                                        rank == 0, rank == p - 1, v > 1)
        out.append((held_bytes, held))
    return out
