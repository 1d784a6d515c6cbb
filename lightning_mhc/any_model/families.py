"""The model families built in: for each Hugging Face ``config.model_type``, one record
(:class:`FamilyRecord`) holding everything known of it: what tensor parallelism splits (its
:class:`~lightning_mhc.any_model.plan.TPPlan`), where the pipeline finds its blocks, embedding, final
norm and head, where the hyper-connections go (its
:class:`~lightning_mhc.any_model.hc_plan.HyperConnectionPlan`, or the config attribute of streams it
carries itself), whether context parallelism splits its attention (and why not where it does not),
its fused experts under expert parallelism, and its router's auxiliary loss. ``parallelize`` and the
check of each dimension read the record (:func:`family_of`, the lookups by name or by ``"auto"``
below); a capability a record does not claim is refused there, naming the family. A family that is
not here takes plans of the user's own (docs/bring_your_own_model.md, docs/mhc_any_model.md)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from torch import nn

from lightning_mhc.errors import ConfigError
from lightning_mhc.any_model import deepseek_v4, deepseek_v4_context, hy_v4, hy_v4_context
from lightning_mhc.any_model.experts import MIXTRAL, OLMOE, QWEN3_MOE
from lightning_mhc.any_model.hc_plan import Branch, HyperConnectionPlan, plan_from_mapping
from lightning_mhc.any_model.native_streams import carry_streams_flat, recompute_hyper_connections
from lightning_mhc.any_model.pipeline import ModelParts
from lightning_mhc.any_model.router_loss import RouterLossSpec
from lightning_mhc.layers.moe import SWITCH_LOAD_BALANCING
from lightning_mhc.any_model.plan import GPT2, GPT_NEOX, LLAMA, OPT, PHI3, QWEN3, Style, TPPlan, resolve_tp_plan


# ------------------------------------------------------------------ where the hyper-connections go
def _pre_norm(attention: str, mlp: str, attention_norm: str, mlp_norm: str, **options: Any) -> HyperConnectionPlan:
    return HyperConnectionPlan((Branch(attention_norm, attention, **options), Branch(mlp_norm, mlp, **options)))


LLAMA_BRANCHES = _pre_norm("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
"""Llama, Mistral, Qwen2, Qwen3, Gemma: norm, attention; norm, MLP."""
GEMMA2_BRANCHES = _pre_norm("post_attention_layernorm", "post_feedforward_layernorm", "input_layernorm",
                            "pre_feedforward_layernorm")
"""Gemma 2 and 3: each branch ends with its post-norm."""
PHI3_BRANCHES = _pre_norm("resid_attn_dropout", "resid_mlp_dropout", "input_layernorm", "post_attention_layernorm")
"""Phi-3: each branch ends with its residual dropout."""
GPT2_BRANCHES = _pre_norm("attn", "mlp", "ln_1", "ln_2")
"""GPT-2 (without cross-attention)."""
OPT_BRANCHES = _pre_norm("self_attn", "fc2", "self_attn_layer_norm", "final_layer_norm", dropout="dropout")
"""OPT with its norms before the branches (every OPT but the 350M): the block's dropout ends each branch."""


def _gpt_neox(config: Any) -> HyperConnectionPlan:
    parallel = bool(getattr(config, "use_parallel_residual", True))
    return HyperConnectionPlan((Branch("input_layernorm", "post_attention_dropout"),
                                Branch("post_attention_layernorm", "post_mlp_dropout", parallel=parallel)))


def _opt(config: Any) -> HyperConnectionPlan:
    if not getattr(config, "do_layer_norm_before", True):
        raise ConfigError("hyper-connections for OPT need its norms before the branches (do_layer_norm_before=True; "
                          "the 350M applies them after): a post-norm block has no stream to read.")
    return OPT_BRANCHES


def _gpt2(config: Any) -> HyperConnectionPlan:
    if getattr(config, "add_cross_attention", False):
        raise ConfigError("hyper-connections for GPT-2 with cross-attention (add_cross_attention=True) have no built-in "
                          "plan: pass a HyperConnectionPlan with a third Branch('ln_cross_attn', 'crossattention').")
    return GPT2_BRANCHES


@dataclass(frozen=True)
class PipelineContract:
    """Where the pipeline finds a family's parts (module names in its ``...ForCausalLM``): the
    repeated block list it cuts into stages, the token embedding the first stage holds, the final
    norm and the head the last stage holds."""

    blocks: str
    embedding: str
    final_norm: str
    head: str


@dataclass(frozen=True)
class FusedExperts:
    """A family's routed experts as expert parallelism splits them: one module per sparse-MoE block
    at ``path`` (a module-name pattern) holding the fused tensors ``gate_up_proj [E, 2I, H]``,
    ``down_proj [E, H, I]`` and ``act_fn`` (``experts.is_fused_experts``), split by dim 0 over EP."""

    path: str


NOT_CHECKED_UNDER_CP = "its attention is not checked under CP"


@dataclass(frozen=True)
class FamilyRecord:
    """Everything known of one Hugging Face ``config.model_type``: each capability is a field, and
    a capability a record does not claim is refused by the check of its dimension, in one line
    naming the family.

    - ``tp``: its tensor-parallel plan (``plan.py``, ``experts.py``);
    - ``pipeline``: where its blocks, embedding, final norm and head are (the stage split);
    - ``hyper_connections``: where mHC goes in its blocks (a plan, or a function of the model's
      config that makes one), None where it has none built in;
    - ``native_streams``: for a family that carries hyper-connections of its own, the config
      attribute holding its number of streams (e.g. ``"hc_mult"``): ``hyper_connections=n`` is
      refused on it (its streams are the model's), and ``n * hidden`` crosses pipeline stages;
    - ``carry_streams``: for such a family, how a built chunk's blocks carry their streams
      (``carry_streams(chunk, block_path, n)``: DeepSeek-V4's and HY-V4's carry them flat,
      ``native_streams.py``);
    - ``block_recompute``: for such a family, its decoder layer's forward under
      ``recompute="mhc_block"`` (``block_recompute(layer, checkpoints, *args, **kwargs)``, its
      hyper-connections checkpointed through ``native_streams.HyperConnectionCheckpoints``); None:
      ``mhc_block`` is refused on it;
    - ``tensor_parallel``: what the family's TP needs beyond its plan's styles, on each built chunk
      (``tensor_parallel(chunk, layout)``, in its own module: DeepSeek-V4's per-head sinks and
      grouped output projection, ``deepseek_v4.py``);
    - ``check_layout``: the family's own refusals of a layout (``check_layout(model, layout)``,
      one line, before anything is built), for what its module does not run on yet;
    - ``check_stages``: the family's own refusals of a stage split (``check_stages(model, ranges)``,
      the ``[start, end)`` blocks of each (virtual) stage; HY-V4's shared-indexer layers cannot
      begin a stage);
    - ``context_parallel``: its attention is split over CP exactly (``context_parallel.py``), else
      ``context_parallel_refusal`` says why not;
    - ``context_parallel_attention``: a family whose attention the generic CP attention does not
      compute (windows, compressed entries) splits it itself, on each built chunk under CP
      (``context_parallel_attention(chunk, layout)``, in its own module: DeepSeek-V4's,
      ``deepseek_v4_context.py``, HY-V4's, ``hy_v4_context.py``);
    - ``experts``: its fused experts, split over EP (``experts.py``); None: a dense family;
    - ``router_loss``: a MoE family's own router loss (its routers, the rule that combines their
      statistics over layers, stages and the sequence's ranks, and the config attribute of its
      coefficient: ``router_loss.py``); None: no router loss;
    - ``router_bias``: the routers (fnmatch on module names) whose score-correction bias
      auxiliary-free balancing moves (``router_bias.py``); None: the family has none.
    - ``transformers``: for a family newer than the ``hf`` extra's lower bound, the transformers
      version its model is run with here: a transformers without the model is refused naming it
      (:func:`check_transformers_ships`); None: every transformers the extra allows ships it.
    """

    model_type: str
    tp: TPPlan
    pipeline: PipelineContract
    hyper_connections: HyperConnectionPlan | Callable[[Any], HyperConnectionPlan] | None = None
    native_streams: str | None = None
    carry_streams: Callable[[nn.Module, str | None, int], None] | None = None
    block_recompute: Callable[..., Any] | None = None
    tensor_parallel: Callable[[nn.Module, Any], None] | None = None
    check_layout: Callable[[nn.Module, Any], None] | None = None
    check_stages: Callable[[nn.Module, list[tuple[int, int]]], None] | None = None
    context_parallel: bool = False
    context_parallel_refusal: str | None = NOT_CHECKED_UNDER_CP
    context_parallel_attention: Callable[[nn.Module, Any], None] | None = None
    experts: FusedExperts | None = None
    router_loss: RouterLossSpec | None = None
    router_bias: str | None = None
    transformers: str | None = None

    def __post_init__(self) -> None:
        # a record is the family's one statement of a capability: no claim made two ways at once
        if self.native_streams is not None and self.hyper_connections is not None:
            raise ConfigError(f"family {self.model_type!r}: a family with streams of its own takes no hyper-connection "
                              "plan")
        if (self.native_streams is None) != (self.carry_streams is None):
            raise ConfigError(f"family {self.model_type!r}: a family with streams of its own says how its blocks carry "
                              "them (native_streams and carry_streams together)")
        if self.block_recompute is not None and self.native_streams is None:
            raise ConfigError(f"family {self.model_type!r}: block_recompute is the forward of a family's own "
                              "hyper-connections; it has none (native_streams)")
        if self.context_parallel == (self.context_parallel_refusal is not None):
            raise ConfigError(f"family {self.model_type!r}: give a CP refusal reason exactly when CP is not claimed")

    def check_parts(self, parts: ModelParts, model_name: str) -> None:
        """The pipeline contract against the parts the stage split found: the embedding on the
        first stage, the final norm and the head on the last (a record that does not fit its
        model would place them wrong; refused naming the family and the part)."""
        contract, where = self.pipeline, {**dict.fromkeys(parts.first, "first"), **dict.fromkeys(parts.last, "last")}
        for part, stage in ((contract.embedding, "first"), (contract.final_norm, "last"), (contract.head, "last")):
            found = next((where[p] for p in where if part == p or part.startswith(p + ".")), None)
            if found != stage:
                raise ConfigError(f"{model_name} (model_type {self.model_type!r}): its family's pipeline contract puts "
                                  f"{part} on the {stage} stage, but the split found it "
                                  f"{'on the ' + found + ' stage' if found else 'nowhere'} (blocks {parts.block_path}): "
                                  "pass a plan of its own (a TPPlan) and blocks=.")

    def hyper_connection_plan(self, config: Any) -> HyperConnectionPlan:
        found = self.hyper_connections
        return found(config) if callable(found) else found


Family = FamilyRecord
"""The former name of :class:`FamilyRecord`."""

LLAMA_PIPELINE = PipelineContract("model.layers", "model.embed_tokens", "model.norm", "lm_head")
"""Llama's module names, which most decoder-only families share."""
MOE_EXPERTS = FusedExperts("model.layers.*.mlp.experts")
"""transformers 5's sparse-MoE block (Mixtral, Qwen2/3-MoE, OLMoE)."""
HF_MOE_ROUTER_LOSS = RouterLossSpec("model.layers.*.mlp.gate", SWITCH_LOAD_BALANCING)
"""Mixtral's, Qwen2-MoE's, Qwen3-MoE's and OLMoE's ``load_balancing_loss_func`` (transformers 5):
their routers ``mlp.gate`` and Switch's loss over all their layers together (``router_loss.py``),
its coefficient the config's ``router_aux_loss_coef``."""
CP_EXACT = dict(context_parallel=True, context_parallel_refusal=None)
"""RoPE on explicit position ids, causal attention through transformers' registry, nothing but a
padding mask beside the causal one (a sliding window is refused by the model's config)."""
MOE_NOT_UNDER_CP = "a sparse-MoE family is not checked under CP"


def _family(model_type: str, tp: TPPlan, hyper_connections, pipeline: PipelineContract = LLAMA_PIPELINE,
            **capabilities: Any) -> FamilyRecord:
    return FamilyRecord(model_type, tp, pipeline, hyper_connections, **capabilities)


def _moe(model_type: str, tp: TPPlan) -> FamilyRecord:
    return _family(model_type, tp, LLAMA_BRANCHES, experts=MOE_EXPERTS, router_loss=HF_MOE_ROUTER_LOSS,
                   context_parallel_refusal=MOE_NOT_UNDER_CP)


SOFTCAPPED_WINDOWS = "sliding-window layers and softcapped attention logits"

RECORDS: tuple[FamilyRecord, ...] = (
    _family("gpt2", GPT2, _gpt2, PipelineContract("transformer.h", "transformer.wte", "transformer.ln_f", "lm_head")),
    _family("llama", LLAMA, LLAMA_BRANCHES, **CP_EXACT),
    _family("phi3", PHI3, PHI3_BRANCHES),
    _family("gpt_neox", GPT_NEOX, _gpt_neox,
            PipelineContract("gpt_neox.layers", "gpt_neox.embed_in", "gpt_neox.final_layer_norm", "lm_head")),
    _family("opt", OPT, _opt, PipelineContract("model.decoder.layers", "model.decoder.embed_tokens",
                                               "model.decoder.final_layer_norm", "lm_head")),
    # Llama's module names, and forwards that read the head counts from the config
    _family("mistral", LLAMA, LLAMA_BRANCHES, **CP_EXACT), _family("qwen2", LLAMA, LLAMA_BRANCHES, **CP_EXACT),
    _family("gemma", LLAMA, LLAMA_BRANCHES), _family("gemma2", LLAMA, GEMMA2_BRANCHES,
                                                     context_parallel_refusal=SOFTCAPPED_WINDOWS),
    # the query/key norms of Qwen3 and Gemma 3
    _family("qwen3", QWEN3, LLAMA_BRANCHES, **CP_EXACT),
    _family("gemma3", QWEN3, GEMMA2_BRANCHES, context_parallel_refusal=SOFTCAPPED_WINDOWS),
    _family("gemma3_text", QWEN3, GEMMA2_BRANCHES, context_parallel_refusal=SOFTCAPPED_WINDOWS),
    # sparse-MoE blocks (experts.py): the routed experts split over EP, not TP
    _moe("mixtral", MIXTRAL), _moe("qwen2_moe", MIXTRAL), _moe("qwen3_moe", QWEN3_MOE), _moe("olmoe", OLMOE),
    # hyper-connections of its own (deepseek_v4.py): its streams carried as they are; its window and
    # compressed attention split over CP by its own pass (deepseek_v4_context.py)
    _family("deepseek_v4", deepseek_v4.DEEPSEEK_V4, None, native_streams="hc_mult",
            carry_streams=carry_streams_flat, block_recompute=deepseek_v4.recomputed_layer,
            tensor_parallel=deepseek_v4.split_for_tensor_parallel, experts=MOE_EXPERTS, **CP_EXACT,
            context_parallel_attention=deepseek_v4_context.split_attention_over_context,
            router_loss=deepseek_v4.ROUTER_LOSS, router_bias=deepseek_v4.ROUTERS,
            transformers=deepseek_v4.TRANSFORMERS),
    # HY-V4 (hy_v4.py): the same streams; its latent attention and indexer split over CP by its own
    # pass (hy_v4_context.py)
    _family("hy_v4", hy_v4.HY_V4, None, native_streams="hc_mult", carry_streams=carry_streams_flat,
            block_recompute=hy_v4.recomputed_layer,
            tensor_parallel=hy_v4.split_attention, check_stages=hy_v4.check_stages,
            experts=MOE_EXPERTS, **CP_EXACT, context_parallel_attention=hy_v4_context.split_attention_over_context,
            transformers=deepseek_v4.TRANSFORMERS),
)

_GLM5_NEXT = ("GLM-5-next: its text decoder carries DeepSeek-V4's hyper-connections, but its layers mix linear "
              "attention with DSA attention, its hc_head is a parameter-free mean and a vision tower comes first; it "
              "has no record yet (DeepSeek-V4 and HY-V4 have)")
_HY_V4_VL = ("HY-V4-VL: HY-V4's decoder behind a vision tower, with multimodal rotary positions; it has no record yet "
             "(the text-only HYV4ForCausalLM, model_type 'hy_v4', has)")
NOT_BUILT_IN: dict[str, str] = {"glm5_next": _GLM5_NEXT, "glm5_next_text": _GLM5_NEXT, "hy_v4_vl": _HY_V4_VL,
                                "hy_v4_vl_text": _HY_V4_VL}
"""Families that share a built-in family's design but are not built in, by ``model_type``: why
not, named by ``plan='auto'`` in its refusal."""

FAMILIES: dict[str, FamilyRecord] = {record.model_type: record for record in RECORDS}
"""The built-in families by Hugging Face ``config.model_type``: the one place a family's
capabilities are written; every other table is a view of it."""

PLANS: dict[str, TPPlan] = {name: family.tp for name, family in FAMILIES.items()}
"""The built-in TP plans by ``model_type`` (a view of :data:`FAMILIES`)."""
HC_PLANS: dict[str, HyperConnectionPlan | Callable[[Any], HyperConnectionPlan]] = {
    name: family.hyper_connections for name, family in FAMILIES.items() if family.hyper_connections is not None}
"""The built-in hyper-connection plans by ``model_type`` (a view of :data:`FAMILIES`)."""


def supported_families() -> tuple[str, ...]:
    """The ``model_type`` names built in (``plan="auto"`` and the command line's ``model.plan``)."""
    return tuple(FAMILIES)


def context_parallel_families() -> tuple[str, ...]:
    """The ``model_type`` names whose records claim context parallelism (read when asked: a test
    may change a record)."""
    return tuple(name for name, record in FAMILIES.items() if record.context_parallel)


def family_of(model: nn.Module | None) -> FamilyRecord | None:
    """The record of ``model``'s ``config.model_type``; None for a model of another family."""
    return FAMILIES.get(_model_type(model))


def plan_family(plan: Any, model: nn.Module | None) -> FamilyRecord | None:
    """The record whose TP plan ``plan`` names (``"auto"``: the model's family); None for a plan
    of the user's own, which brings its own pipeline contract (``blocks=``, ``TPPlan.output``)."""
    if not isinstance(plan, str):
        return None
    return FAMILIES.get(_model_type(model) if plan == "auto" else plan)


def _model_type(model: nn.Module | None) -> str | None:
    return getattr(getattr(model, "config", None), "model_type", None)


def resolve_plan(plan: str | TPPlan | Mapping[str, Style | str] | None, model: nn.Module | None = None) -> TPPlan:
    """A TP plan: a family's by name (a key of :data:`FAMILIES`; ``"auto"``: the one for
    ``model.config.model_type``), a :class:`TPPlan`, a plain ``{pattern: style}``, or None."""
    if plan == "auto":
        model_type = _model_type(model)
        if model_type in NOT_BUILT_IN:
            raise ConfigError(f"plan='auto': {type(model).__name__} (model_type {model_type!r}) is not built in: "
                              f"{NOT_BUILT_IN[model_type]}.")
        if model_type not in FAMILIES:
            found = f"model_type {model_type!r}" if model_type else "no config.model_type"
            raise ConfigError(f"plan='auto': {type(model).__name__} has {found}, which has no built-in plan "
                              f"(built in: {', '.join(FAMILIES)}); pass a dict of module-name patterns to styles or a "
                              "TPPlan (docs/bring_your_own_model.md#writing-a-plan).")
        return FAMILIES[model_type].tp
    if isinstance(plan, str):
        if plan not in FAMILIES:
            raise ConfigError(f"plan={plan!r}: no such built-in plan; choose {', '.join(FAMILIES)} or 'auto', or pass a "
                              "dict {module-name pattern: style} or a TPPlan.")
        return FAMILIES[plan].tp
    return resolve_tp_plan(plan)


def resolve_hc_plan(plan: str | HyperConnectionPlan | Mapping[str, Any], model: nn.Module) -> HyperConnectionPlan:
    """A hyper-connection plan: ``"auto"`` (by ``model.config.model_type``), a family's name, a
    plan, or a mapping of its fields. Refused for a model whose family carries streams of its own
    (whatever the plan: they would be streams on streams)."""
    refuse_native_streams(model)
    if isinstance(plan, HyperConnectionPlan):
        return plan
    if isinstance(plan, Mapping):
        return plan_from_mapping(plan)
    family = _model_type(model) if plan == "auto" else plan
    if family not in FAMILIES:
        given = (f"plan={plan!r}" if plan != "auto" else f"model_type {family!r}" if family
                 else "no config.model_type")
        raise ConfigError(f"hyper-connections: {type(model).__name__} has {given}, and no built-in plan fits (built in: "
                          f"{', '.join(FAMILIES)}); pass a HyperConnectionPlan of its branches "
                          "(docs/mhc_any_model.md#a-plan-for-your-own-model).")
    record = FAMILIES[family]
    if record.hyper_connections is None:
        raise ConfigError(f"hyper-connections: {type(model).__name__} (model_type {record.model_type!r}): its family "
                          "has no built-in plan; pass a HyperConnectionPlan of its branches "
                          "(docs/mhc_any_model.md#a-plan-for-your-own-model).")
    return record.hyper_connection_plan(getattr(model, "config", None))


def check_transformers_ships(model_type: str | None) -> None:
    """A built-in family's model that the installed transformers does not ship (an older one than
    its record's ``transformers``): refused in one line naming the version, before transformers'
    own error (which names no version) is reached."""
    record = FAMILIES.get(model_type)
    if record is None or record.transformers is None:
        return
    import transformers
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise ConfigError(f"model_type {model_type!r} is not in transformers {transformers.__version__}: its family runs "
                          f"on transformers>={record.transformers}; pip install 'transformers>={record.transformers}'.")


def native_stream_count(model: nn.Module) -> int:
    """The residual streams ``model``'s family carries itself (1 for a family without)."""
    record = family_of(model)
    if record is None or record.native_streams is None:
        return 1
    return int(getattr(model.config, record.native_streams))


def recomputes_own_streams(model: nn.Module) -> bool:
    """Whether ``recompute="mhc_block"`` runs on the hyper-connections ``model``'s family carries
    itself (``FamilyRecord.block_recompute``)."""
    record = family_of(model)
    return record is not None and record.block_recompute is not None


def check_family_layout(model: nn.Module, layout: Any) -> None:
    """The family's own refusals of ``layout`` (``FamilyRecord.check_layout``), before anything is built."""
    record = family_of(model)
    if record is not None and record.check_layout is not None:
        record.check_layout(model, layout)


def check_family_stages(model: nn.Module, ranges: list[tuple[int, int]]) -> None:
    """The family's own refusals of the stage split ``ranges`` (``FamilyRecord.check_stages``),
    before anything is built."""
    record = family_of(model)
    if record is not None and record.check_stages is not None:
        record.check_stages(model, ranges)


def finish_family_chunks(model: nn.Module, chunks: list[nn.Module], block_path: str | None, layout: Any,
                         block_recompute: bool = False) -> None:
    """The family's own steps on its built chunks (before the weights are read into them): its TP
    beyond the plan's styles (``FamilyRecord.tensor_parallel``), for a family with streams of
    its own its layers' forward under ``mhc_block`` where ``block_recompute`` asks for it
    (``FamilyRecord.block_recompute``, ``native_streams.recompute_hyper_connections``) and how
    its blocks carry the streams (``FamilyRecord.carry_streams``, around that forward), and under
    CP its own split of its attention (``FamilyRecord.context_parallel_attention``)."""
    record = family_of(model)
    if record is None:
        return
    for chunk in chunks:
        if record.tensor_parallel is not None:
            record.tensor_parallel(chunk, layout)
        if block_recompute and record.block_recompute is not None:
            recompute_hyper_connections(chunk, block_path, record.block_recompute)
        if record.carry_streams is not None:
            record.carry_streams(chunk, block_path, native_stream_count(model))
        if record.context_parallel_attention is not None and layout.context_parallel_size > 1:
            record.context_parallel_attention(chunk, layout)


def refuse_native_streams(model: nn.Module) -> None:
    """A model whose family carries its own hyper-connections (``FamilyRecord.native_streams``)
    takes none of ours: refused in one line naming the family and its streams."""
    record = family_of(model)
    if record is not None and record.native_streams is not None:
        streams = getattr(getattr(model, "config", None), record.native_streams, None)
        raise ConfigError(f"hyper-connections: {type(model).__name__} (model_type {record.model_type!r}) carries its "
                          f"own ({record.native_streams}={streams} streams), which run as the model's: leave "
                          "hyper_connections unset (model.hyper_connections=null on the command line).")


__all__ = ["Branch", "FAMILIES", "Family", "FamilyRecord", "FusedExperts", "HC_PLANS", "PLANS", "PipelineContract",
           "NOT_BUILT_IN", "RECORDS", "check_family_layout", "check_family_stages", "check_transformers_ships",
           "family_of", "finish_family_chunks", "native_stream_count", "plan_family",
           "recomputes_own_streams", "refuse_native_streams", "resolve_hc_plan", "resolve_plan",
           "supported_families"]
