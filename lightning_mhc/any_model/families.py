"""The model families built in: for each Hugging Face ``config.model_type``, one entry holding both
what tensor parallelism splits (its :class:`~lightning_mhc.any_model.plan.TPPlan`) and where the
hyper-connections go (its :class:`~lightning_mhc.any_model.hc_plan.HyperConnectionPlan`), and
the two lookups by name or by ``"auto"`` (the model's ``model_type``) that ``parallelize`` and
``add_hyper_connections`` make. A family that is not here takes plans of the user's own
(docs/bring_your_own_model.md, docs/mhc_any_model.md)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from torch import nn

from lightning_mhc.errors import ConfigError
from lightning_mhc.any_model.experts import MIXTRAL, OLMOE, QWEN3_MOE
from lightning_mhc.any_model.hc_plan import Branch, HyperConnectionPlan, plan_from_mapping
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
class Family:
    """One built-in family: its TP plan, and its hyper-connection plan (or a function of the
    model's config that makes it, where the block's structure depends on the config)."""

    tp: TPPlan
    hyper_connections: HyperConnectionPlan | Callable[[Any], HyperConnectionPlan]
    router_loss: RouterLossSpec | None = None
    """A MoE family's own router loss (its routers and the rule that combines their statistics
    over layers, stages and the sequence's ranks): ``router_loss.py``."""

    def hyper_connection_plan(self, config: Any) -> HyperConnectionPlan:
        found = self.hyper_connections
        return found(config) if callable(found) else found


HF_MOE_ROUTER_LOSS = RouterLossSpec("model.layers.*.mlp.gate", SWITCH_LOAD_BALANCING)
"""Mixtral's, Qwen2-MoE's, Qwen3-MoE's and OLMoE's ``load_balancing_loss_func`` (transformers 5):
their routers ``mlp.gate`` and Switch's loss over all their layers together."""

FAMILIES: dict[str, Family] = {
    "gpt2": Family(GPT2, _gpt2), "llama": Family(LLAMA, LLAMA_BRANCHES), "phi3": Family(PHI3, PHI3_BRANCHES),
    "gpt_neox": Family(GPT_NEOX, _gpt_neox), "opt": Family(OPT, _opt),
    # Llama's module names, and forwards that read the head counts from the config
    "mistral": Family(LLAMA, LLAMA_BRANCHES), "qwen2": Family(LLAMA, LLAMA_BRANCHES),
    "gemma": Family(LLAMA, LLAMA_BRANCHES), "gemma2": Family(LLAMA, GEMMA2_BRANCHES),
    # the query/key norms of Qwen3 and Gemma 3
    "qwen3": Family(QWEN3, LLAMA_BRANCHES), "gemma3": Family(QWEN3, GEMMA2_BRANCHES),
    "gemma3_text": Family(QWEN3, GEMMA2_BRANCHES),
    # sparse-MoE blocks (experts.py): the routed experts split over EP, not TP
    "mixtral": Family(MIXTRAL, LLAMA_BRANCHES, HF_MOE_ROUTER_LOSS),
    "qwen2_moe": Family(MIXTRAL, LLAMA_BRANCHES, HF_MOE_ROUTER_LOSS),
    "qwen3_moe": Family(QWEN3_MOE, LLAMA_BRANCHES, HF_MOE_ROUTER_LOSS),
    "olmoe": Family(OLMOE, LLAMA_BRANCHES, HF_MOE_ROUTER_LOSS),
}
"""The built-in families by Hugging Face ``config.model_type``."""

PLANS: dict[str, TPPlan] = {name: family.tp for name, family in FAMILIES.items()}
"""The built-in TP plans by ``model_type`` (a view of :data:`FAMILIES`)."""
HC_PLANS: dict[str, HyperConnectionPlan | Callable[[Any], HyperConnectionPlan]] = {
    name: family.hyper_connections for name, family in FAMILIES.items()}
"""The built-in hyper-connection plans by ``model_type`` (a view of :data:`FAMILIES`)."""


def _model_type(model: nn.Module | None) -> str | None:
    return getattr(getattr(model, "config", None), "model_type", None)


def resolve_plan(plan: str | TPPlan | Mapping[str, Style | str] | None, model: nn.Module | None = None) -> TPPlan:
    """A TP plan: a family's by name (a key of :data:`FAMILIES`; ``"auto"``: the one for
    ``model.config.model_type``), a :class:`TPPlan`, a plain ``{pattern: style}``, or None."""
    if plan == "auto":
        model_type = _model_type(model)
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
    plan, or a mapping of its fields."""
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
    return FAMILIES[family].hyper_connection_plan(getattr(model, "config", None))


__all__ = ["Branch", "FAMILIES", "Family", "HC_PLANS", "PLANS", "resolve_hc_plan", "resolve_plan"]
