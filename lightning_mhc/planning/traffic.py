"""The bytes each rank sends in one training step, per parallel dimension and collective, counted
from the config by arithmetic (as ``shapes`` counts the parameters): what the runtime's modules,
schedule and gradient reduction hand to torch.distributed for the layout.

The convention (one for every collective, the one ``lightning_mhc.distributed.collectives`` counts in a
real run): a rank's *payload*, the bytes of the tensor(s) it hands in as its contribution, whatever
algorithm the backend runs:

- all-reduce: its tensor ``S`` (a ring moves ``2 (p - 1) / p S`` of it on the wire);
- all-gather: its own shard (a ring moves ``(p - 1)`` shards);
- reduce-scatter: its whole input, ``p`` shards (a ring moves ``(p - 1) / p`` of it);
- all-to-all: its whole input, the share it keeps included (so the count does not depend on the
  routing; a rank keeps ``1 / p`` of balanced tokens);
- send: the tensor (a receive sends nothing); broadcast: the tensor, on the source rank only;
- nothing over a group of one rank.

Per micro-batch, with ``T`` tokens on a rank (``micro_batch_size x seq_length / CP``), hidden size
``h``, ``n`` residual streams, activations of ``e`` bytes:

- TP (> 1): the embedding's all-reduce ``T h e``; per sub-layer (attention, MLP) without sequence
  parallelism an all-reduce ``T h e`` forward (the row-parallel output) and one backward (the
  column-parallel input's gradient); with it an all-gather ``T h e / tp`` and a reduce-scatter
  ``T h e`` forward (and the embedding's scatter gathered back in backward), two all-gathers (the gradient, the input again for the weight's gradient) and a
  reduce-scatter backward; the output layer likewise (backward only without SP); the vocabulary-
  parallel loss's three all-reduces of ``T`` fp32 values; ``full`` recompute replays each layer's
  forward collectives, ``selective`` under SP the MLP input's all-gather (``REPLAYS_LAYER``). An MoE
  layer's MLP sends nothing over TP (its experts run whole on every TP rank; MoE takes no SP). After
  the step, with SP, the TP sum of the gradients of the decoder's TP-replicated parameters (under
  ZeRO-1 of this rank's pieces of them).
- PP (> 1): each chunk sends its output stream ``T n h e (/ tp with SP)`` forward unless it is the
  model's last, and its input's gradient backward unless it is the first; the tied embedding's
  gradient summed between the first and the last stage; the loss broadcast from the last stage.
- DP (x CP, > 1): the gradients all-reduced (the experts' over the expert-data ranks), the loss
  all-reduced on the last stage; ZeRO-1 (or bf16 weights): per bucket of the runtime's (25 MiB of
  parameters, the tied embedding alone, padded to a multiple of the ranks: ``memory.held_buckets``)
  a reduce-scatter of the fp32 gradients and an all-gather of this rank's range of the updated
  weights (in their dtype: bf16 under ``bf16-true``), plus one int32 flag
  per parameter tensor all-reduced (which got a gradient); under ZeRO-1 the TP sum and the tied
  embedding's sum between stages run on each rank's own pieces, so a stage's DP x CP ranks may
  send different bytes (:class:`StageTraffic` ``by_data_rank``). Learned position embeddings
  (first stage only) are reduced with the rest, nothing between stages. An MoE layer with
  auxiliary losses sums its token counts and total (``E + 1`` fp32) over DP x CP per forward
  (replays included); with the expert bias, its counts (``E`` fp32) once a step.
- CP (> 1): per layer the stacked K and V all-gathered forward (``2 T g d e / tp``) and their
  gradient reduce-scattered backward (``cp`` times that); the loss's token count all-reduced.
- EP (> 1): per MoE layer the token counts (``E`` int64) and, forward and backward, the dispatch
  (``T k h e``) and the combine (the tokens this rank's experts received: ``T k h e`` when the
  router balances them, which the mean over an EP group's ranks is exactly); ``full`` and
  ``selective`` (whose MLP checkpoint replays the MoE MLP whole) replay the counts, dispatch and
  combine once more.

What is not counted yet (``recompute_modules`` other than a policy's default) is refused in one line
(:func:`check_traffic_plan`).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from lightning_mhc.distributed.grads import DEFAULT_BUCKET_BYTES as BUCKET_BYTES
from lightning_mhc.errors import ConfigError
from lightning_mhc.model.sizes import is_moe_layer, partition_layers
from lightning_mhc.distributed.optimizer import owned_pieces
from lightning_mhc.planning.memory import StageCount, bucket_parts, bucket_tensors, stage_counts
from lightning_mhc.recompute.policy import DEFAULT_MODULES, RecomputePolicy

DIMENSIONS = ("tensor", "context", "expert", "pipeline", "data")
FP32, INT32, INT64 = 4, 4, 8
REPLAYS_LAYER = "full"
"""The policy whose backward replays each layer's whole forward, collectives included (megatron's
reentrant checkpoint). ``selective`` replays the MLP under torch's non-reentrant checkpoint, which
stops once the tensors backward needs are back: under SP the fc1 input's all-gather, not the fc2
output's reduce-scatter (without SP nothing the MLP sends); ``layernorm`` and the hyper-connections
(``mhc_block``) recompute without communicating."""


@dataclass(frozen=True)
class StageTraffic:
    """The payload bytes one rank of a pipeline stage sends in a step, by ``(dimension, op)``."""

    stage: int
    bytes: dict[tuple[str, str], int]
    """Every rank's of the stage, or where they differ (``by_data_rank``) its most sending rank's."""
    by_data_rank: tuple[dict[tuple[str, str], int], ...] = ()
    """Where the stage's ranks differ: each one's bytes by its index in the DP x CP group (under
    ZeRO-1 a rank sums over TP and between the stages the gradients of its own pieces, whose sizes
    differ where a bucket's padding or a cut falls); empty where every rank sends ``bytes``."""

    def of_data_rank(self, index: int) -> dict[tuple[str, str], int]:
        """The bytes the stage's rank of DP x CP index ``index`` sends."""
        return self.by_data_rank[index] if self.by_data_rank else self.bytes

    def per_dimension(self) -> dict[str, int]:
        return {d: sum(b for (dim, _), b in self.bytes.items() if dim == d) for d in DIMENSIONS}


def check_traffic_plan(policy: Any) -> None:
    """What the traffic count does not cover yet, refused in one line: ``recompute_modules`` other
    than the policy's default (which collectives a checkpoint replays depends on what it holds)."""
    if policy.modules is not None and tuple(policy.modules) != DEFAULT_MODULES.get(policy.name):
        raise ConfigError("the planner's traffic count does not cover recompute_modules other than the policy's "
                          "default yet.")


def plan_traffic(config: Any, layout: Any, policy: Any, *, seq_length: int, micro_batch_size: int,
                 num_microbatches: int, element_bytes: int = FP32, param_bytes: int = FP32,
                 distributed_optimizer: bool = False, first_stage_layers: int | None = None,
                 last_stage_layers: int | None = None) -> list[StageTraffic]:
    """Each pipeline stage's :class:`StageTraffic` for one rank of it. ``config``: the model's sizes
    (``GPTSizes``, or its config)."""
    policy = RecomputePolicy.of(policy)
    check_traffic_plan(policy)
    tp, sp, cp = layout.tensor_model_parallel_size, layout.sequence_parallel and layout.tensor_model_parallel_size > 1, \
        layout.context_parallel_size
    ep, p = layout.expert_model_parallel_size, layout.pipeline_model_parallel_size
    v, m, e = layout.num_virtual_stages // p, num_microbatches, element_bytes
    h = config.hidden_size
    n = config.num_residual_streams if config.enable_hyper_connections else 1
    t = micro_batch_size * seq_length // cp
    activation = t * h * e                     # one sub-layer's output, all tokens of the rank
    shard = activation // tp if sp else activation
    full = policy.name == REPLAYS_LAYER
    replays_moe = full or policy.name == "selective"  # the selective MLP checkpoint replays an MoE MLP whole
    dp_cp = layout.data_parallel_size * cp
    aux_losses = bool(getattr(config, "num_moe_experts", None)) and (bool(config.moe_z_loss_coeff) or (
        config.moe_aux_loss_coeff > 0 and config.moe_router_load_balancing_type != "none"))  # moe_mlp.moe_config
    ranges = partition_layers(config.num_layers, p * v, first_stage_layers, last_stage_layers)
    counts = stage_counts(config, layout, first_stage_layers, last_stage_layers)
    out = []
    for stage in range(p):
        sent: Counter = Counter()

        def tensor_sublayer(forwards: int, regathered: bool = False) -> None:
            """A TP sub-layer: ``forwards`` forward passes (2 when the layer is recomputed), one backward
            (and, ``regathered``, the input's all-gather replayed by the selective MLP recompute)."""
            if sp:
                sent["tensor", "all_gather"] += (forwards + 2 + regathered) * shard
                sent["tensor", "reduce_scatter"] += (forwards + 1) * activation
            else:
                sent["tensor", "all_reduce"] += (forwards + 1) * activation

        for c in range(v):
            virtual = c * p + stage
            first, last = virtual == 0, virtual == p * v - 1
            layers = range(ranges[virtual][0] + 1, ranges[virtual][1] + 1)
            if dp_cp > 1 and getattr(config, "moe_router_enable_expert_bias", False):  # once a step per MoE
                # layer: the expert bias's token counts summed over DP x CP (E fp32, TopKRouter.update_expert_bias)
                sent["data", "all_reduce"] += sum(config.num_moe_experts * FP32 for number in layers
                                                  if is_moe_layer(config, number))
            for _ in range(m):  # every micro-batch passes every chunk of the stage once each way
                if tp > 1:
                    if first:  # the embedding's sum (then under SP its scatter, gathered back in backward)
                        sent["tensor", "all_reduce"] += activation
                        if sp:
                            sent["tensor", "all_gather"] += shard
                    for number in layers:
                        tensor_sublayer(1 + full)
                        if not is_moe_layer(config, number):  # an MoE MLP: its experts whole on each TP rank
                            tensor_sublayer(1 + full, regathered=policy.name == "selective")
                    if last:  # the output layer (column-parallel; its forward gathers only under SP)
                        if sp:
                            sent["tensor", "all_gather"] += 2 * shard
                            sent["tensor", "reduce_scatter"] += activation
                        else:
                            sent["tensor", "all_reduce"] += activation
                        sent["tensor", "all_reduce"] += 3 * t * FP32  # the loss's max, sum and target logit
                if cp > 1:
                    groups = (config.num_query_groups or config.num_attention_heads) // tp
                    kv = 2 * t * groups * config.kv_channels * e
                    sent["context", "all_gather"] += len(layers) * (1 + full) * kv
                    sent["context", "reduce_scatter"] += len(layers) * cp * kv
                    if last:
                        sent["context", "all_reduce"] += FP32  # the loss mask's token count
                if dp_cp > 1 and aux_losses:  # per MoE forward (replays too) the token counts and
                    # token total summed over DP x CP for the auxiliary losses (E + 1 fp32, MoELayer._aux_loss)
                    sent["data", "all_reduce"] += sum((1 + replays_moe) * (config.num_moe_experts + 1) * FP32
                                                      for number in layers if is_moe_layer(config, number))
                if ep > 1:  # (MoE layers take no SP: each TP rank routes all its tokens)
                    routed = t * config.moe_router_topk * h * e
                    for number in layers:
                        if is_moe_layer(config, number):
                            sent["expert", "all_to_all"] += (1 + replays_moe) * (
                                config.num_moe_experts * INT64 + 2 * routed) + 2 * routed
                if p > 1:
                    stream = t * n * h * e // (tp if sp else 1)
                    if not last:
                        sent["pipeline", "send"] += stream
                    if not first:
                        sent["pipeline", "send"] += stream
        out.append(finish_stage(sent, counts[stage], layout, stage, param_bytes=param_bytes,
                                distributed_optimizer=distributed_optimizer))
    return out


def finish_stage(sent: Counter, count: StageCount, layout: Any, stage: int, *, param_bytes: int,
                 distributed_optimizer: bool, bucket_bytes: int = BUCKET_BYTES) -> StageTraffic:
    """The stage's :class:`StageTraffic`: ``sent`` (its micro-batches' collectives and sends) with
    what a rank sends once a step after them, from ``count``'s tensors (the GPT's from its config, a
    Hugging Face stage's traced), by the runtime's rules: with the distributed optimizer (ZeRO-1, or
    bf16 weights: ``takes_over``) per bucket of the runtime's (``memory.bucket_tensors``) a
    reduce-scatter of the fp32 gradients padded to a multiple of the bucket's ranks and an
    all-gather of this rank's range in the weights' dtype (ZeRO-1), or an fp32 all-reduce (bf16
    weights alone), and one int32 flag per tensor all-reduced per group (which got a gradient);
    then :func:`add_step_end`, whose TP sum of the partial gradients and tied embedding's sum
    between stages run under ZeRO-1 on each rank's pieces of them (``optimizer.owned_pieces``:
    ``DistributedOptimizer.reduce_gradients``), so the stage's DP x CP ranks may differ."""
    takes_over = distributed_optimizer or param_bytes != FP32  # the runtime's DistributedOptimizer
    dp_cp = layout.data_parallel_size * layout.context_parallel_size
    ep = layout.expert_model_parallel_size
    held = [t for chunk in count.chunks for t in chunk]
    # the elements each DP x CP rank sums over TP and between the stages: whole tensors, or its pieces
    partial = [sum(t.numel for t in held if t.partial_over_tp)] * dp_cp
    tied = [sum(t.numel for t in held if t.alone)] * dp_cp
    if takes_over:
        flags = Counter()
        if distributed_optimizer:
            partial, tied = [0] * dp_cp, [0] * dp_cp
        for expert, tensors in bucket_tensors(count, bucket_bytes, param_bytes):
            group, numels = bucket_parts(expert, layout), [t.numel for t in tensors]
            if distributed_optimizer:  # each rank's pieces (an expert bucket's index: the DP x CP one over EP)
                for rank in range(dp_cp):
                    for i, flat, _ in owned_pieces(numels, group, rank // ep if expert else rank):
                        partial[rank] += (flat.stop - flat.start) * tensors[i].partial_over_tp
                        tied[rank] += (flat.stop - flat.start) * tensors[i].alone
            if group == 1:
                continue
            flags[expert] += len(numels)
            if distributed_optimizer:
                padded = -(-sum(numels) // group)
                sent["data", "reduce_scatter"] += padded * group * FP32
                sent["data", "all_gather"] += padded * param_bytes
            else:
                sent["data", "all_reduce"] += sum(numels) * FP32
        # which tensors got a gradient: one all-reduce per group, an int32 per tensor
        sent["data", "all_reduce"] += sum(flags.values()) * INT32
    by_rank = []
    for rank in range(dp_cp):
        mine = Counter(sent)
        add_step_end(mine, layout, stage, dense=count.dense, expert=count.expert, partial_over_tp=partial[rank],
                     tied=tied[rank], grad_bytes=FP32 if takes_over else param_bytes, reduced_by_optimizer=takes_over)
        by_rank.append({k: b for k, b in mine.items() if b})
    most = max(by_rank, key=lambda b: sum(b.values()))
    return StageTraffic(stage, most, tuple(by_rank) if any(b != most for b in by_rank) else ())


def add_step_end(sent: Counter, layout: Any, stage: int, *, dense: int, expert: int, partial_over_tp: int, tied: int,
                 grad_bytes: int, reduced_by_optimizer: bool) -> None:
    """What one rank of ``stage`` sends once a step, after its backward passes (``finalize_model_grads``,
    the schedule's loss), added to ``sent``: its gradients all-reduced, ``dense`` elements over DP x
    CP and ``expert`` over the expert-data ranks (unless ``reduced_by_optimizer``: the distributed
    optimizer's buckets, counted apart); ``partial_over_tp`` elements (sequence-parallel ones,
    per-head norms) summed over TP; ``tied`` elements of an embedding tied across stages summed
    between the first and the last (0 where a count has them already); the step's loss averaged
    over DP x CP on the last stage, then sent to every stage."""
    p = layout.pipeline_model_parallel_size
    dp_cp = layout.data_parallel_size * layout.context_parallel_size
    if not reduced_by_optimizer:
        if dp_cp > 1 and dense:
            sent["data", "all_reduce"] += dense * grad_bytes
        if dp_cp // layout.expert_model_parallel_size > 1 and expert:
            sent["data", "all_reduce"] += expert * grad_bytes
    if partial_over_tp and layout.tensor_model_parallel_size > 1:
        sent["tensor", "all_reduce"] += partial_over_tp * grad_bytes
    if tied and p > 1:
        sent["pipeline", "all_reduce"] += tied * grad_bytes
    if stage == p - 1:
        if dp_cp > 1:
            sent["data", "all_reduce"] += FP32
        if p > 1:
            sent["pipeline", "broadcast"] += FP32
