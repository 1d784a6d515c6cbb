"""Retained activation bytes per rank: what one micro-batch's forward keeps for its backward on each
model chunk, under each recompute policy, times the micro-batches in flight when the schedule holds
the most (1F1B or interleaved), plus the stage inputs the schedule keeps.

Each term is a tensor the runtime's modules save for backward (counted as the runtime's meter
counts them: unique storages, parameters excluded), sized from the config and divided as the layout
divides it: TP splits heads, the attention context and the MLP's hidden width; sequence parallelism
also splits the tokens of everything else (norms, residual streams, hyper-connections); CP gives a
rank ``1 / cp`` of every token-wise tensor. Per layer, with ``T = s b / cp`` tokens of a micro-batch
on a rank, ``e`` bytes an element, ``n`` streams of width ``h``:

- attention (every policy but ``full``, :func:`attention_bytes`), on the path SDPA takes
  (:func:`fused_attention`): without attention dropout on the CPU, and on CUDA, its fused (flash)
  kernel, keeping Q, K, V as given, its output (the context) and an fp32 log-sum-exp (``b (a / tp) s``);
  under attention dropout on the CPU its math path, keeping the rotary tables (4 of ``s d / cp``),
  the fused QKV output (``T d (a + 2g) / tp``), the context (``T a d / tp``), the scaled Q and K
  (``2 T a d / tp``) and three score tensors (``3 b (a / tp) s^2``); under CP per query chunk
  against its causal prefix of the gathered K/V, which is kept whole once;
- ``none``: two norms' statistics (``2 T``), four ``T h`` (the norms' inputs and outputs), per
  sub-layer its output (streams: ``H_post`` spreads it) or, without streams, the hidden dropout's
  noise (:func:`hidden_dropout_active`); the MLP's two ``T F / tp`` (a gated unit's four:
  ``linear_fc1``'s ``2F`` wide output, whose halves the activation and the product keep as views,
  the activation's output and the product), or an MoE layer's (:func:`moe_bytes`); with streams,
  per sub-layer the stream (``T n h``; under hidden dropout its noise too) and the mappings
  (``T (1 + 2n + n^2 + (n^2 + 2n))``);
- ``selective`` (norms and MLP recomputed, an MoE one too): two ``T h`` and the sub-layers'
  outputs or noise, the attention, the streams' terms;
- ``mhc_block``: two ``T h``, the attention, the MLP (dense or MoE); the hyper-connections
  recomputed, so only each recompute block's stream (``T n h`` per block, and under hidden dropout
  its last bias-dropout-add's noise);
- ``full``: each layer's input stream ``T n h``.

Each in ``e`` bytes, the weights' dtype, but what the model computes in fp32 whatever the weights
(:data:`FP32`), and under bf16 the fp32 copies a forward keeps (the fused hyper-connection's
parameters, the norms' weights, the CPU math attention's Q, K and V).
Checked against the runtime's measurement (``measure_activation_memory``, the CLI's
``activation_bytes``) in tests/test_planner_activations.py on the CPU, in fp32 and under
``bf16-true``, with the models' default dropout and without. On CUDA (``device="cuda"``: the CLI's
``trainer.accelerator``) the fused attention is counted whatever the dropout, unchecked (no GPU
here); the hidden dropout's masks are counted as the CPU's there (an upper bound). Not covered: an
expert capacity (which tokens it drops is the routing's; refused by :func:`check_activation_plan`);
the experts' rows are counted as if routing were balanced over the EP ranks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_mhc.errors import ConfigError
from lightning_mhc.model.sizes import is_moe_layer, partition_layers
from lightning_mhc.recompute.groups import block_ranges
from lightning_mhc.recompute.policy import DEFAULT_MODULES, RecomputePolicy

FP32 = 4
"""What the model computes in fp32 whatever its weights' dtype: the norms' statistics and normalised
input, the hyper-connections' mappings and projection, the attention's scores, the logits of the loss."""


@dataclass(frozen=True)
class ChunkShape:
    """One model chunk as the activation count needs it."""

    layers: int
    start: int
    """The global index of its first layer (which layers are MoE ones)."""
    first: bool
    """Holds the embedding (takes the tokens; a later chunk receives a stream instead)."""
    last: bool
    """Holds the output layer and the loss."""


def check_activation_plan(config: Any, layout: Any, policy: RecomputePolicy) -> None:
    """What the activation count does not cover yet, refused in one line."""
    missing = [what for what, yes in (
        ("an expert capacity (dropped tokens)", bool(getattr(config, "num_moe_experts", None))
         and getattr(config, "moe_expert_capacity_factor", None) is not None),
        ("recompute_modules other than the policy's default", policy.modules is not None
         and tuple(policy.modules) != DEFAULT_MODULES.get(policy.name)),
    ) if yes]
    if missing:
        raise ConfigError(f"the planner's activation count does not cover {', '.join(missing)} yet "
                          f"(policy {policy.name}); its model-state bytes are exact.")


@dataclass(frozen=True)
class Split:
    """How a layout divides one micro-batch's tensors on a rank: ``tokens`` (``s b / cp``, this CP
    rank's), sequence parallelism's ``spd`` (TP where it splits the tokens of norms and streams,
    else 1), ``tp`` over heads and widths, ``cp`` and ``ep``."""

    seq: int
    mbs: int
    tp: int
    sp: bool
    cp: int = 1
    ep: int = 1

    @property
    def tokens(self) -> int:
        return self.seq * self.mbs // self.cp

    @property
    def spd(self) -> int:
        return self.tp if self.sp else 1


def fused_attention(config: Any, device: str = "cpu") -> bool:
    """Whether torch's SDPA runs a fused kernel (flash or memory-efficient attention) rather than its
    math path: on CUDA always (its fused kernels draw the attention's dropout themselves, keeping
    the generator's state, not a mask), on the CPU only without attention dropout (its flash kernel
    has none; with dropout it takes the math path). ``device``: the torch device type the run
    trains on."""
    return device == "cuda" or not config.attention_dropout


def attention_bytes(config: Any, split: Split, e: int, device: str = "cpu") -> int:
    """One layer's core attention on the path SDPA takes (:func:`fused_attention`): the rotary
    tables (4 of ``s/cp d``) and what the path keeps.

    Fused (flash): Q, K and V as SDPA is given them (the rotated Q and K are new tensors; without
    rotary embeddings a view of the fused QKV output, which is then kept whole; under grouped
    queries K and V repeated over the query heads), the output (``T a d``, which the context
    projection keeps as a view) and the fp32 log-sum-exp (``b a s``). Under CP
    (``distributed.context_parallel``) each of a rank's two chunks of ``L = s / 2cp`` queries runs
    against its causal prefix of the gathered K/V (``(r + 1) L`` and ``(2cp - r) L`` keys, ``(2cp +
    1) L`` together on every rank): the queries reversed (copies), the one gathered K/V (``2 b g s
    d``), each chunk's output, log-sum-exp and one-row causal mask (``L + keys - 1`` values), then
    the context (a copy of the chunks' outputs).

    Math (the CPU's under attention dropout): the fused QKV output, the scaled Q and K, three score
    tensors (softmax, dropout's noise and its output) and the context; under CP K and the scores
    are each chunk's prefix's, and the values keep the whole gathered K/V (SDPA keeps a view of the
    one gathered tensor).

    The fused formula is measured on the CPU (fp32 and bf16, tests/test_planner_activations.py). On
    CUDA it is counted the same, unchecked (no GPU here): the flash and memory-efficient kernels
    keep the same inputs, output and log-sum-exp (the memory-efficient one's padded to 32 queries),
    plus the generator's seed and offset; under CP they take the causal mask as a bias object (no
    mask tensor, the queries a view) where the CPU keeps the one-row masks: a few hundred bytes."""
    a, d = config.num_attention_heads // split.tp, config.kv_channels
    g = (config.num_query_groups or config.num_attention_heads) // split.tp
    t, b, s, cp = split.tokens, split.mbs, split.seq, split.cp
    rope = config.position_embedding_type == "rope"
    tables = 4 * (s // cp) * d * e if rope else 0
    if fused_attention(config, device):
        lse = FP32 * b * a * s // cp
        if cp == 1:
            # Q: rotated, or a copy out of the grouped layout (a view of the QKV output without
            # either); K: rotated or repeated over the query heads; V: repeated, or a view
            new_q, new_k, new_v = rope or g != a, rope or g != a, g != a
            qkv = 0 if new_q and new_k and new_v else t * d * (a + 2 * g)
            return tables + e * (t * a * d * (new_q + new_k + new_v + 1) + qkv) + lse
        chunk = s // (2 * cp)
        keys = chunk * (2 * cp + 1)
        masks = 2 * chunk + keys - 2  # each chunk's one row of L + key_len - 1 values
        # the reversed queries, the chunks' outputs, the context; the gathered K/V
        return tables + e * (3 * t * a * d + 2 * b * g * s * d + masks) + lse
    low = e < FP32  # bf16: the CPU's math attention runs in fp32 on fp32 copies of Q, K and V
    if cp == 1:
        scores = FP32 * 3 * b * a * s * s  # the scores, their softmax and its input: fp32 in either
        if low:  # the copies of Q, K and V (not the QKV output) and the context
            return tables + scores + FP32 * 3 * t * a * d + e * t * a * d
        # V as SDPA keeps it: a view of the fused QKV output (that whole output), or its repeat
        # over the query heads under grouped queries (a new tensor; the QKV output then is not kept)
        values = t * d * (a + 2 * g) if g == a else t * a * d
        return tables + scores + e * (t * a * d + 2 * t * a * d + values)
    chunk = s // (2 * cp)
    keys = chunk * (2 * cp + 1)  # both chunks' causal prefixes together, per sample and head
    scores = FP32 * 3 * b * a * chunk * keys
    if low:  # fp32 copies of the scaled Q, each chunk's K and V prefixes; the context
        return tables + scores + FP32 * (t * a * d + 2 * b * a * keys * d) + e * t * a * d
    # V: views of the one gathered K/V (the whole sequence's), or each chunk's prefix repeated
    # over the query heads under grouped queries
    values = 2 * b * g * s * d if g == a else b * a * keys * d
    return tables + scores + e * (2 * t * a * d + b * a * keys * d + values)


def hidden_dropout_active(config: Any) -> bool:
    """Whether the residual stream's dropouts (the embedding's, each bias-dropout-add's) draw:
    ``hidden_dropout > 0``. Then each keeps a noise tensor of its input's shape and dtype (the CPU's
    dropout multiplies by it), and the hyper-connections' bias-dropout-add runs the reference's ops
    (the eager kernels draw no dropout: ``layers/bda.py``), which keep ``H_res`` (and under bf16
    ``H_post``) as copies in the stream's dtype. At 0 a dropout returns its input, keeping nothing,
    and the fused kernel runs, keeping the fp32 mappings themselves. On CUDA the dropout keeps a
    bool mask (``native_dropout``) and Triton's kernels draw inside, keeping a seed: counted as the
    CPU's, an upper bound under ``hidden_dropout > 0`` (unchecked, no GPU here)."""
    return bool(config.hidden_dropout)


ROUTER_BYTES = 4
"""The router's logits, probabilities and the weights of the experts' outputs are fp32 whatever
the model's dtype (``model/moe.py``)."""
INDEX_BYTES = 8
"""int64 token and expert indices."""


def moe_bytes(config: Any, split: Split, e: int) -> int:
    """One MoE MLP's retained bytes for one micro-batch (``model/moe.py``), with ``t`` tokens of
    this rank routed to ``k`` of ``E`` experts: the router's top-k indices and probabilities (its
    softmax over the top-k logits; over all ``E`` before the top-k with ``moe_router_pre_softmax``;
    a sigmoid over all ``E``, normalised over the top ``k > 1``), the pairs' sort and index tensors
    (four int64 of ``t k``), their fp32 weights and weighted outputs (``t k (h + 1)``); the experts'
    rows, ``t k`` on average per rank under EP (balanced routing: the count assumes it), their input
    and activations (two of width ``F``, four gated) and the grouped products' offsets; EP's two
    permutations of the received rows; the shared experts' activations; the auxiliary losses'
    probabilities and statistics where they are on."""
    t, k, n_e = split.tokens, config.moe_router_topk, config.num_moe_experts
    h, f = config.hidden_size, config.moe_ffn_hidden_size or config.ffn_hidden_size
    gated = 4 if config.gated_linear_unit else 2
    if config.moe_router_score_function == "sigmoid":
        router = ROUTER_BYTES * (t * n_e + (t * k + t if k > 1 else 0))
    elif config.moe_router_pre_softmax:
        router = ROUTER_BYTES * t * n_e
    else:
        router = ROUTER_BYTES * t * k
    router += INDEX_BYTES * t * k
    # the pairs' gather index, sort order and sorted tokens; their weights, the experts' outputs
    # (kept by the product with the weights) and the weighted outputs (kept by the index_add)
    pairs = INDEX_BYTES * 3 * t * k + ROUTER_BYTES * t * k * (2 * h + 1)
    rows = t * k  # each rank's experts receive the group's pairs for them: on average its own number
    experts = e * rows * (h + gated * f)
    experts += 4 * (n_e // split.ep) * (3 if config.gated_linear_unit else 2)  # int32 offsets per product
    if split.ep > 1:
        experts += INDEX_BYTES * 2 * rows  # the received rows' sort by expert and back
    shared = gated * t * config.moe_shared_expert_intermediate_size * e \
        if config.moe_shared_expert_intermediate_size else 0
    aux = 0
    balance = config.moe_router_load_balancing_type == "aux_loss" and config.moe_aux_loss_coeff > 0
    if balance:  # every expert's probability, the batch's counts, the scale
        aux += ROUTER_BYTES * (t * n_e + n_e + 1 + 1)
    if config.moe_z_loss_coeff:  # the logits, their logsumexp, the scale
        aux += ROUTER_BYTES * (t * n_e + t + 1)
    if aux:
        aux += ROUTER_BYTES  # the summed loss, kept for the gradient it is given
    return router + pairs + experts + shared + aux


def layer_bytes(config: Any, policy: str, split: Split, e: int, moe: bool = False, device: str = "cpu") -> int:
    """One layer's retained bytes for one micro-batch (the recompute blocks' streams not included);
    ``moe``: the layer's MLP is the MoE one."""
    c, f = config.hidden_size, config.ffn_hidden_size
    n = config.num_residual_streams if config.enable_hyper_connections else 1
    t, tp, spd = split.tokens, split.tp, split.spd
    low = e < FP32  # bf16 weights: fp32 copies appear where the model computes in fp32
    noise = hidden_dropout_active(config)  # each bias-dropout-add keeps its noise (T n h, or T h)
    if policy == "full":
        return t * n * c * e // spd
    attention = attention_bytes(config, split, e, device)
    streams = 0
    if config.enable_hyper_connections and policy != "mhc_block":
        # per sub-layer: the stream (and the dropout's noise) in e; 1/rms, H_pre, H_post and the
        # projection x phi in fp32; H_res as the stream's dtype under dropout (the reference's ops),
        # else fp32 (the fused kernel's); under bf16 the fp32 copies of phi, alpha and the bias the
        # fused op takes, and under dropout H_post as the stream's dtype
        h_res = e * n * n if noise else FP32 * n * n
        streams = 2 * (t * (e * (1 + noise) * n * c + h_res + FP32 * (1 + 2 * n + n * n + 2 * n)) // spd)
        if low:
            m = n * n + 2 * n
            streams += 2 * (e * t * n * noise // spd + FP32 * (n * c * m + m + 3))
    # kept where the MLP is not recomputed
    mlp = moe_bytes(config, split, e) if moe else e * (4 if config.gated_linear_unit else 2) * t * f // tp
    # without streams, each bias-dropout-add's noise (T h; with streams it is the stream's, above)
    plain_noise = 0 if config.enable_hyper_connections else 2 * noise
    if policy == "none":
        # per norm its fp32 statistics (T) and normalised input (T h) and, under bf16, its weight's
        # fp32 copy (h); per sub-layer two more T h in e (the norm's input and output) and the
        # sub-layer's output (which H_post spreads) with streams, the dropout's noise without
        norms = 2 * (FP32 * (t + t * c) // spd + (FP32 * c if low else 0))
        kept = 4 + (2 if config.enable_hyper_connections else plain_noise)
        return attention + streams + norms + e * kept * t * c // spd + mlp
    if policy == "selective":
        # per sub-layer the norm's input, and the sub-layer's output (streams) or the noise
        kept = 2 + (2 if config.enable_hyper_connections else plain_noise)
        return attention + streams + e * kept * t * c // spd
    return attention + e * 2 * t * c // spd + mlp  # mhc_block


def chunk_bytes(config: Any, policy: str, layer_num: int | None, split: Split, e: int, chunk: ChunkShape,
                device: str = "cpu") -> int:
    """One micro-batch's retained bytes on one model chunk: its layers, its recompute blocks' streams,
    the embedding's and the loss's tensors where it holds them."""
    c, t, spd, tp = config.hidden_size, split.tokens, split.spd, split.tp
    n = config.num_residual_streams if config.enable_hyper_connections else 1
    total = sum(layer_bytes(config, policy, split, e, is_moe_layer(config, number + 1), device)
                for number in range(chunk.start, chunk.start + chunk.layers))
    if policy == "mhc_block" and chunk.layers:
        # per recompute block its input stream and, under dropout, the noise of its last
        # bias-dropout-add (run outside the block's checkpoints: its output is the block's hook)
        streams = 1 + hidden_dropout_active(config)
        total += len(block_ranges(chunk.layers, n, layer_num)) * e * streams * t * n * c // spd
    if policy == "full" and chunk.layers and config.position_embedding_type == "rope":
        # the rotary angles (fp32) every layer's checkpoint saves, once
        total += split.seq // split.cp * config.kv_channels * FP32
    if chunk.first and hidden_dropout_active(config):
        # the embedding's dropout noise (the token ids are the whole batch's: stage_extra_bytes)
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


def in_flight_peak(unit_bytes: list[int], p: int, rank: int, m: int, group: int | None = None,
                   received: int = 0, kept: int = 0) -> tuple[int, int]:
    """The most bytes this stage holds at once, and how many micro-batch chunks then: ``unit_bytes[c]``
    is what a micro-batch keeps on the stage's chunk ``c`` (its stage input included). 1F1B (one
    chunk): ``min(p - rank, m)`` micro-batches. Interleaved: the schedule's own order replayed (the
    warm-up's forwards, then one forward and one backward per steady step), measured where the
    runtime measures (after each warm-up forward, after each steady step, before the steady step's
    received input is queued), with the chunks' inputs outside the micro-batches held: those
    received ahead of their forward (``interleaved.receives_after``), ``received`` bytes each, and
    the last input of a chunk none of whose micro-batches is held, ``kept`` bytes each (the chunk's
    model references it, ``set_input``, until its next forward; the meter counts it where the
    forward saved that tensor itself, not a detached alias of it)."""
    v = len(unit_bytes)
    if v == 1:
        held = min(p - rank, m)
        return held * unit_bytes[0], held
    from lightning_mhc.distributed.pipeline.interleaved import receives_after, schedule_table

    table = schedule_table(m, v, group or p)
    total = m * v
    warmup = min(2 * (p - rank - 1) + (v - 1) * (group or p), total)
    takes_input = [rank > 0 or c > 0 for c in range(v)]  # the first stage's first chunk embeds tokens
    held: list[int] = []
    forwarded = [0] * v
    queued = int(takes_input[0])  # a later stage receives its first input before the warm-up
    best = (0, 0)

    def forward(k: int) -> None:
        nonlocal queued
        chunk = table[k][1]
        held.append(chunk)
        forwarded[chunk] += 1
        queued -= takes_input[chunk]

    def receive(k: int) -> None:
        nonlocal queued
        queued += receives_after(table, k, True, rank == 0, p, v)[0]

    def probe() -> None:
        nonlocal best
        last_inputs = sum(takes_input[c] and forwarded[c] and c not in held for c in range(v))
        best = max(best, (sum(unit_bytes[c] for c in held) + queued * received + last_inputs * kept, len(held)))

    for k in range(warmup):
        forward(k)
        if k < total - 1:
            receive(k)
        probe()
    for k in range(total - warmup):
        forward(k + warmup)
        held.remove(v - 1 - table[k][1])
        probe()
        if k < total - warmup - 1:
            receive(k + warmup)
    return best


def saves_chunk_input(config: Any, policy: str) -> bool:
    """Whether a chunk's forward saves its input tensor itself for backward (so the meter counts it
    while the chunk's model references it, after its micro-batch's backward too: ``in_flight_peak``):
    the first hyper-connection (streams; not under ``mhc_block``), the first norm (``none``) and
    ``full``'s checkpoint do; a ``CheckpointWithoutOutput`` (``mhc_block``'s blocks, ``selective``'s
    norm without streams) saves a detached alias, which dies with its graph."""
    if policy == "mhc_block":
        return False
    return policy != "selective" or bool(config.enable_hyper_connections)


def stage_extra_bytes(split: Split, m: int, first: bool, last: bool) -> int:
    """What a stage holds once, whatever the micro-batches in flight: the step's token ids on the
    first stage and labels on the last (int64; micro-batches are views of the step's batch, one
    storage). Under CP a rank keeps each micro-batch's shard of them instead (copies): counted as
    the step's, a few hundred bytes over in the grid."""
    return 8 * m * split.seq * split.mbs * (int(first) + int(last))


def plan_activations(config: Any, layout: Any, policy: str | RecomputePolicy, *, seq_length: int,
                     micro_batch_size: int, num_microbatches: int, element_bytes: int = 4,
                     first_stage_layers: int | None = None, last_stage_layers: int | None = None,
                     device: str = "cpu") -> list[tuple[int, int]]:
    """Each pipeline stage's ``(retained activation bytes, micro-batch chunks in flight)`` at the
    schedule's peak, per rank of that stage. ``config``: the model's sizes
    (``GPTSizes``, or its config); ``device``: the torch device type the run trains on ("cuda":
    SDPA's fused kernels whatever the attention dropout, :func:`fused_attention`)."""
    policy = RecomputePolicy.of(policy)
    check_activation_plan(config, layout, policy)
    layer_num, policy = policy.layer_num, policy.name
    split = Split(seq_length, micro_batch_size, layout.tensor_model_parallel_size, layout.sequence_parallel,
                  layout.context_parallel_size, layout.expert_model_parallel_size)
    p = layout.pipeline_model_parallel_size
    v = layout.num_virtual_stages // p
    ranges = partition_layers(config.num_layers, p * v, first_stage_layers, last_stage_layers)
    out = []
    for rank in range(p):
        units = []
        for c in range(v):
            virtual = c * p + rank
            start, end = ranges[virtual]
            chunk = ChunkShape(end - start, start, virtual == 0, virtual == p * v - 1)
            units.append(chunk_bytes(config, policy, layer_num, split, element_bytes, chunk, device))
        # under the interleaved schedule: the chunks' inputs (streams) received ahead of their forward,
        # and each chunk's last one where the meter still counts it
        n = config.num_residual_streams if config.enable_hyper_connections else 1
        received = element_bytes * split.tokens * n * config.hidden_size // split.spd
        kept = received if saves_chunk_input(config, policy) else 0
        held_bytes, held = in_flight_peak(units, p, rank, num_microbatches, received=received, kept=kept)
        held_bytes += stage_extra_bytes(split, num_microbatches, rank == 0, rank == p - 1)
        out.append((held_bytes, held))
    return out
