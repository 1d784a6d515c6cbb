"""The GPT's sizes as plain numbers: what a plan of memory and traffic reads of the model, with no
megatron-core imported (its import costs seconds; a plan is arithmetic and should answer at once).

:class:`GPTSizes` holds the sizes the runtime's modules are made of, with the values megatron-core's
``TransformerConfig`` derives when they are not given (one query group per head, a head dimension
of hidden / heads, an MLP of 4 x hidden, an expert's MLP as the dense one); ``tests/test_planner.py``
checks them against the built ``MHCTransformerConfig`` of each config it plans. Also here, for the
same reason: how layers split over pipeline stages (``partition_layers``), which layers have
experts (``is_moe_layer``) and the rules a layout sets the experts (``check_experts_under``), which
``MHCTransformerConfig`` and the planner both apply.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from lightning_mhc.distributed.layout import ParallelLayout, stage_ranges
from lightning_mhc.errors import ConfigError, key, term


@dataclasses.dataclass(frozen=True)
class GPTSizes:
    """The mHC GPT's sizes (megatron's field names), the derived ones resolved."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    ffn_hidden_size: int
    gated_linear_unit: bool
    add_bias_linear: bool
    vocab_size: int
    make_vocab_size_divisible_by: int
    max_sequence_length: int
    position_embedding_type: str
    share_embeddings_and_output_weights: bool
    enable_hyper_connections: bool
    num_residual_streams: int
    num_moe_experts: int | None
    moe_router_topk: int
    moe_ffn_hidden_size: int | None
    moe_shared_expert_intermediate_size: int | None
    moe_layer_freq: Any
    # what the MoE layers keep for backward besides their sizes (the planner's activation count)
    moe_router_score_function: str
    moe_router_pre_softmax: bool
    moe_router_load_balancing_type: str
    moe_aux_loss_coeff: float
    moe_z_loss_coeff: float | None
    moe_expert_capacity_factor: float | None
    moe_router_enable_expert_bias: bool
    """(the planner's traffic count: the bias's token counts summed over DP x CP once a step)"""
    # which paths the runtime takes (what it keeps): SDPA's fused kernel or its math, the
    # hyper-connection's fused bias-dropout-add or the reference's ops, the dropouts' noise
    hidden_dropout: float
    attention_dropout: float

    @classmethod
    def of(cls, config: Any) -> GPTSizes:
        """The sizes of a model config (an ``MHCTransformerConfig``, or sizes already)."""
        return config if isinstance(config, GPTSizes) else cls(
            **{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> GPTSizes:
        """The sizes of a config's values, as ``MHCTransformerConfig(**values)`` would hold them:
        what is not given takes the model's default (``defaults``), and what megatron-core derives
        is derived as it does (the checks of the values are the schema's and the model's)."""
        v = {**MODEL_DEFAULTS, **{k: x for k, x in values.items() if x is not None}}
        ffn = v.get("ffn_hidden_size") or 4 * v["hidden_size"]
        derived = dict(num_query_groups=v.get("num_query_groups") or v["num_attention_heads"],
                       kv_channels=v.get("kv_channels") or v["hidden_size"] // v["num_attention_heads"],
                       ffn_hidden_size=ffn,
                       moe_ffn_hidden_size=v.get("moe_ffn_hidden_size") or (ffn if v["num_moe_experts"] else None))
        return cls(**{f.name: derived.get(f.name, v.get(f.name)) for f in dataclasses.fields(cls)})

    @property
    def padded_vocab_size(self) -> int:
        m = self.make_vocab_size_divisible_by
        return int(math.ceil(self.vocab_size / m) * m)

    def split_sizes(self) -> dict[str, int]:
        """The sizes tensor parallelism splits in this model (``ParallelLayout.check_model``)."""
        return {name: getattr(self, name)
                for name in ("num_attention_heads", "num_query_groups", "ffn_hidden_size", "padded_vocab_size")}

    def check_layout(self, layout: ParallelLayout) -> None:
        """What the model refuses of ``layout`` (as ``with_parallel_layout`` refuses it): layers
        over the stages, sizes over TP, experts over EP and beside sequence parallelism."""
        layout.check_model({"num_layers": self.num_layers, **self.split_sizes()})
        check_experts_under(self.num_moe_experts, layout.expert_model_parallel_size, layout.sequence_parallel)


MODEL_DEFAULTS: dict[str, Any] = dict(
    gated_linear_unit=False, add_bias_linear=True, vocab_size=256, make_vocab_size_divisible_by=128,
    max_sequence_length=2048, position_embedding_type="rope", share_embeddings_and_output_weights=True,
    enable_hyper_connections=True, num_residual_streams=4, num_moe_experts=None, moe_router_topk=2,
    moe_ffn_hidden_size=None, moe_shared_expert_intermediate_size=None, moe_layer_freq=1,
    moe_router_score_function="softmax", moe_router_pre_softmax=False, moe_router_load_balancing_type="aux_loss",
    moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None, moe_expert_capacity_factor=None,
    moe_router_enable_expert_bias=False, hidden_dropout=0.1, attention_dropout=0.1,
)
"""``MHCTransformerConfig``'s defaults of the sizes (megatron-core's for its fields), written here so
the sizes are read without importing it; ``tests/test_planner.py`` checks them against the class."""


def check_experts_under(experts: int | None, ep: int, sequence_parallel: bool) -> None:
    """The rules a layout sets a model's experts: EP only with experts, which it divides; MoE layers
    not under sequence parallelism."""
    if not experts:
        if ep > 1:
            raise ConfigError(term("expert_model_parallel_size", ep), " without experts: set ",
                              key("num_moe_experts"), f" (a multiple of {ep}) or ",
                              term("expert_model_parallel_size", 1), ".")
        return
    if experts % ep:
        raise ConfigError(term("num_moe_experts", experts), " does not split over ",
                          term("expert_model_parallel_size", ep),
                          ": the experts must divide evenly over the expert-parallel ranks.")
    if sequence_parallel:
        raise ConfigError(term("num_moe_experts", experts), " with ", term("sequence_parallel", True),
                          " is not implemented (the experts would see part of the sequence on each TP rank): "
                          "set ", term("sequence_parallel", False), ".")


def is_moe_layer(config: Any, layer_number: int) -> bool:
    """Whether the 1-based ``layer_number`` has an MoE MLP (megatron's ``moe_layer_freq``)."""
    if not config.num_moe_experts:
        return False
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return (layer_number - 1) % freq == 0
    return bool(freq[layer_number - 1])


def partition_layers(
    num_layers: int,
    num_stages: int,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
) -> list[tuple[int, int]]:
    """Global ``[start, end)`` layer ranges per (virtual) stage.

    Even by default; ``first_stage_layers`` / ``last_stage_layers`` fix the
    outer stages (megatron's ``decoder_first/last_pipeline_num_layers``) and
    the rest is split evenly over the middle stages.
    """
    pp = num_stages
    sizes: list[int | None] = [None] * pp
    if first_stage_layers is not None:
        sizes[0] = first_stage_layers
    if last_stage_layers is not None:
        if pp == 1 and first_stage_layers is not None and first_stage_layers != last_stage_layers:
            raise ConfigError(
                f"first_stage_layers={first_stage_layers} and last_stage_layers={last_stage_layers} "
                "name the same single stage; give one of them."
            )
        sizes[-1] = last_stage_layers
    fixed = sum(s for s in sizes if s is not None)
    free = [i for i, s in enumerate(sizes) if s is None]
    remaining = num_layers - fixed
    if any(s is not None and s < 0 for s in sizes) or remaining < 0 or (free and remaining % len(free)) \
            or (not free and remaining != 0):
        raise ConfigError(
            f"num_layers={num_layers} cannot be split over {pp} pipeline stages "
            f"(first_stage_layers={first_stage_layers}, last_stage_layers={last_stage_layers}): "
            f"the {len(free)} remaining stage(s) must share {remaining} layers evenly. Change "
            "num_layers, the pipeline size, or the first/last stage sizes."
        )
    for i in free:
        sizes[i] = remaining // len(free)
    return stage_ranges(sizes)
