"""Tensor-parallel plans: which modules of a model are split across TP ranks, and how.

A plan maps glob patterns over module names (``fnmatch``, ``*`` matches dots too; the first
pattern that matches a module decides) to a style:

| style | module | what each TP rank holds | forward |
|---|---|---|---|
| ``"column"`` / ``Column(stride=s, gather_output=False)`` | ``nn.Linear``, HF ``Conv1D`` | a slice of the output features (with ``stride=s`` the output is ``s`` concatenated parts, e.g. GPT-2's ``[q; k; v]``, sliced part by part) | input copied to the TP region; output split (or gathered) |
| ``"row"`` | ``nn.Linear``, HF ``Conv1D`` | a slice of the input features; the bias whole | partial products all-reduced, then the bias |
| ``"vocab"`` | ``nn.Embedding`` | a slice of the vocabulary rows | rows outside the slice give zeros; all-reduced |
| ``"replicate"`` | any | everything | unchanged (exempts a module from a broader pattern) |
| ``"replicate_on_split"`` | any | everything | unchanged, on this rank's part of a TP-split activation (a norm over each head, as Qwen3's ``q_norm``): its gradients are summed over TP |

Besides ``layers``, a :class:`TPPlan` names module attributes the forward reads that must be
divided by the TP size (``divide``: head counts, split sizes; a dotted name such as
``config.num_attention_heads`` divides it in the module's own copy of the shared object),
attributes that must only be divisible (``divisible``: e.g. ``config.num_key_value_heads``),
attributes that must be equal (``equal``: the parts of a fused projection split with a stride
must be of one size, e.g. Phi-3's ``[q; k; v]`` needs as many key/value heads as query heads),
and the random regions (``random``): modules whose dropout acts on TP-split activations
(``"parallel"``: different masks on every TP rank) or, inside those, on replicated ones again
(``"replicated"``). Everything else draws from the stream shared by the TP ranks (see
``lightning_mhc.distributed.random``).

Every pattern must match a module, and a style must fit its module; a wrong plan is refused
before anything is built, with the module and the fix (:func:`check_plan`).
"""
from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass, field
from typing import Mapping, Union

from torch import nn

from lightning_mhc.errors import ConfigError


@dataclass(frozen=True)
class Column:
    """Split the output features. ``stride``: the output is ``stride`` equal parts side by side
    (each rank takes its slice of every part); ``gather_output``: all-gather the output."""

    stride: int = 1
    gather_output: bool = False


@dataclass(frozen=True)
class Row:
    """Split the input features (the input is the TP-split output of a column layer)."""


@dataclass(frozen=True)
class VocabEmbedding:
    """Split an embedding's rows (the vocabulary)."""


@dataclass(frozen=True)
class Replicate:
    """Keep the module whole on every TP rank."""


@dataclass(frozen=True)
class ReplicateOnSplit:
    """Keep the module whole on every TP rank, where it runs on this rank's part of a split
    activation (a per-head norm): each rank's gradient is part of the whole, so it is summed over TP."""


Style = Union[Column, Row, VocabEmbedding, Replicate, ReplicateOnSplit]
STYLE_NAMES: dict[str, Style] = {"column": Column(), "row": Row(), "vocab": VocabEmbedding(), "replicate": Replicate(),
                                 "replicate_on_split": ReplicateOnSplit()}
RANDOM_REGIONS = ("parallel", "replicated")


@dataclass(frozen=True)
class TPPlan:
    """A tensor-parallel plan (see the module docstring). ``output``: the module whose output is
    the logits (default: the head found through a weight tied to the embedding, else the linear
    layer after the block list); ``selective``: the modules the ``selective`` recompute policy
    checkpoints; ``after_blocks``: modules registered before the block list that run after it
    (the pipeline places parts by registration order otherwise)."""

    layers: Mapping[str, Style | str] = field(default_factory=dict)
    divide: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    divisible: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    equal: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    random: Mapping[str, str] = field(default_factory=dict)
    output: str | None = None
    selective: tuple[str, ...] = ()
    after_blocks: tuple[str, ...] = ()

    def style_of(self, name: str) -> Style | None:
        for pattern, style in self.layers.items():
            if fnmatch.fnmatchcase(name, pattern):
                return as_style(style, pattern)
        return None


def as_style(style: Style | str, pattern: str = "") -> Style:
    if isinstance(style, (Column, Row, VocabEmbedding, Replicate, ReplicateOnSplit)):
        return style
    if isinstance(style, str) and style in STYLE_NAMES:
        return STYLE_NAMES[style]
    raise ConfigError(f"plan entry {pattern!r}: {style!r} is not a style; use one of {', '.join(STYLE_NAMES)} "
                      "(or Column(stride=..., gather_output=...)).")


# ------------------------------------------------------------------------ built-in plans
GPT2 = TPPlan(
    layers={
        "transformer.wte": "vocab",
        "transformer.h.*.attn.c_attn": Column(stride=3),  # [q; k; v]: each rank its heads of all three
        "transformer.h.*.attn.c_proj": "row",
        "transformer.h.*.mlp.c_fc": "column",
        "transformer.h.*.mlp.c_proj": "row",
        "lm_head": "column",  # tied to wte: the same vocabulary rows
    },
    divide={"transformer.h.*.attn": ("embed_dim", "num_heads", "split_size")},
    random={"transformer.h.*.attn": "parallel", "transformer.h.*.attn.resid_dropout": "replicated"},
    output="lm_head",
    selective=("transformer.h.*.mlp",),
)
"""Hugging Face ``GPT2LMHeadModel``."""

def _columns_then_row(module: str, columns: tuple[str, ...], row: str) -> dict[str, str]:
    """Megatron's pairing inside ``module`` (an attention or an MLP): its input projections
    ``columns`` split by their outputs (each rank its heads, its part of the hidden layer), its
    output projection ``row`` by its inputs (the partial sums reduced over TP)."""
    return {**{f"{module}.{name}": "column" for name in columns}, f"{module}.{row}": "row"}


LLAMA = TPPlan(
    layers={
        "model.embed_tokens": "vocab",
        **_columns_then_row("model.layers.*.self_attn", ("q_proj", "k_proj", "v_proj"), "o_proj"),
        **_columns_then_row("model.layers.*.mlp", ("gate_proj", "up_proj"), "down_proj"),
        "lm_head": "column",
    },
    # the attention reshapes with -1 heads and keeps num_key_value_groups: only whole heads per rank
    divisible={"model.layers.*.self_attn": ("config.num_attention_heads", "config.num_key_value_heads")},
    random={"model.layers.*.self_attn": "parallel"},
    output="lm_head",
    selective=("model.layers.*.mlp",),
)
"""Hugging Face ``LlamaForCausalLM`` (and models with its module names)."""

QWEN3 = dataclasses.replace(LLAMA, layers={
    **LLAMA.layers,
    "model.layers.*.self_attn.q_norm": "replicate_on_split",  # RMSNorm over each head, on this rank's heads
    "model.layers.*.self_attn.k_norm": "replicate_on_split",
})
"""Hugging Face ``Qwen3ForCausalLM``, and Gemma 3 (the same per-head norms): Llama's plan with the
query/key norms."""

PHI3 = TPPlan(
    layers={
        "model.embed_tokens": "vocab",
        "model.layers.*.self_attn.qkv_proj": Column(stride=3),  # [q; k; v]: each rank its heads of all three
        "model.layers.*.self_attn.o_proj": "row",
        "model.layers.*.mlp.gate_up_proj": Column(stride=2),  # [gate; up], chunked in two by the forward
        "model.layers.*.mlp.down_proj": "row",
        "lm_head": "column",
    },
    # the forward cuts [q; k; v] at config.num_attention_heads * head_dim
    divide={"model.layers.*.self_attn": ("config.num_attention_heads", "num_key_value_heads")},
    equal={"model.layers.*.self_attn": ("config.num_attention_heads", "config.num_key_value_heads")},
    random={"model.layers.*.self_attn": "parallel"},
    output="lm_head",
    selective=("model.layers.*.mlp",),
)
"""Hugging Face ``Phi3ForCausalLM`` with as many key/value heads as query heads (Phi-3 and
Phi-3.5 mini); grouped-query Phi-3 (medium) is refused: its ``[q; k; v]`` parts differ in size."""

GPT_NEOX = TPPlan(
    layers={
        "gpt_neox.embed_in": "vocab",
        # [q_h, k_h, v_h] head after head: a plain column split gives each rank whole heads
        "gpt_neox.layers.*.attention.query_key_value": "column",
        "gpt_neox.layers.*.attention.dense": "row",
        "gpt_neox.layers.*.mlp.dense_h_to_4h": "column",
        "gpt_neox.layers.*.mlp.dense_4h_to_h": "row",
        "lm_head": "column",
    },
    divisible={"gpt_neox.layers.*.attention": ("config.num_attention_heads",)},
    random={"gpt_neox.layers.*.attention": "parallel"},
    output="lm_head",
    selective=("gpt_neox.layers.*.mlp",),
)
"""Hugging Face ``GPTNeoXForCausalLM`` (Pythia)."""

OPT = TPPlan(
    layers={
        "model.decoder.embed_tokens": "vocab",
        **_columns_then_row("model.decoder.layers.*.self_attn", ("q_proj", "k_proj", "v_proj"), "out_proj"),
        **_columns_then_row("model.decoder.layers.*", ("fc1",), "fc2"),
        "lm_head": "column",  # tied to embed_tokens
    },
    divide={"model.decoder.layers.*.self_attn": ("num_heads",)},
    random={"model.decoder.layers.*.self_attn": "parallel"},
    output="lm_head",
    selective=("model.decoder.layers.*.fc1", "model.decoder.layers.*.fc2"),
    after_blocks=("model.decoder.final_layer_norm",),  # registered before the layers
)
"""Hugging Face ``OPTForCausalLM`` (without ``project_in``/``project_out``: ``word_embed_proj_dim``
equal to ``hidden_size``, as in every OPT but the 350M)."""

def resolve_tp_plan(plan: TPPlan | Mapping[str, Style | str] | None) -> TPPlan:
    """A :class:`TPPlan`, a plain ``{pattern: style}``, or None (nothing split); a built-in plan
    by name or ``"auto"`` is ``families.resolve_plan``'s."""
    if plan is None:
        return TPPlan()
    if isinstance(plan, TPPlan):
        return plan
    if isinstance(plan, Mapping):
        return TPPlan(layers=dict(plan))
    raise ConfigError(f"plan={plan!r}: pass a built-in plan's name, a dict of module-name patterns to styles, or a TPPlan.")


# ------------------------------------------------------------------------ checking
def is_lora_layer(module: nn.Module) -> bool:
    """A PEFT LoRA layer: its ``base_layer`` and the ``lora_A`` / ``lora_B`` of its adapters."""
    return isinstance(getattr(module, "base_layer", None), nn.Module) and \
        isinstance(module.__dict__.get("_modules", {}).get("lora_A"), nn.ModuleDict)


def base_of(module: nn.Module) -> nn.Module:
    """The module a PEFT layer adapts (itself for any other module)."""
    while is_lora_layer(module):
        module = module.base_layer
    return module


def linear_dims(module: nn.Module) -> tuple[int, int, str, str] | None:
    """``(output-feature dim of the weight, input-feature dim, output size attribute, input size
    attribute)`` of a module column/row can split: ``nn.Linear`` (weight ``[out, in]``) and Hugging
    Face's ``Conv1D`` (weight ``[in, out]``, GPT-2); None for any other module."""
    if isinstance(module, nn.Linear):
        return 0, 1, "out_features", "in_features"
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx"):
        return 1, 0, "nf", "nx"
    return None


def _get_path(obj, path: str):
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def check_plan(model: nn.Module, plan: TPPlan, tp: int, model_name: str | None = None) -> None:
    """Refuse a plan that cannot apply to ``model`` at TP size ``tp`` (ConfigError, one line naming
    the module and the fix): a pattern that matches no module, a style on a module it cannot split,
    a size or attribute that does not divide by ``tp``, an unknown random region. The errors name
    the TP size ``tensor_model_parallel_size`` (a door relabels it: ``ConfigError.relabel``)."""
    model_name = model_name or type(model).__name__
    names = [name for name, _ in model.named_modules() if name]
    example = next((n for n in reversed(names) if n.count(".") >= 2), names[-1] if names else "")
    for section, patterns in (("layers", plan.layers), ("divide", plan.divide), ("divisible", plan.divisible),
                              ("equal", plan.equal), ("random", plan.random),
                              ("selective", dict.fromkeys(plan.selective)),
                              ("after_blocks", dict.fromkeys(plan.after_blocks))):
        for pattern in patterns:
            if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
                raise ConfigError(
                    f"plan {section} pattern {pattern!r} matches no module of {model_name} (module names look like "
                    f"{example!r}; print(model) lists them). Fix the pattern or remove it.")
    for pattern, region in plan.random.items():
        if region not in RANDOM_REGIONS:
            raise ConfigError(f"plan random entry {pattern!r}: {region!r} is not a region; use 'parallel' (TP-split "
                              "activations: masks differ across TP) or 'replicated'.")
    modules = dict(model.named_modules())
    if plan.output is not None and plan.output not in modules:
        raise ConfigError(f"plan output {plan.output!r} is not a module of {model_name}: name the module that "
                          "produces the logits (e.g. 'lm_head'), or leave output unset.")
    for name, module in modules.items():
        style = plan.style_of(name) if name else None
        if style is not None:
            _check_style(name, base_of(module), style, tp)  # a LoRA layer: the style splits its base
        for pattern, attrs in plan.divide.items():
            if name and fnmatch.fnmatchcase(name, pattern):
                _check_divisible(name, module, attrs, tp, "divided by")
        for pattern, attrs in plan.divisible.items():
            if name and fnmatch.fnmatchcase(name, pattern):
                _check_divisible(name, module, attrs, tp, "split across")
        for pattern, attrs in plan.equal.items():
            if name and fnmatch.fnmatchcase(name, pattern):
                _check_equal(name, module, attrs, tp)
    _check_ties(model, plan)


def split_of(module: nn.Module, style: Style | None) -> tuple[int, int] | None:
    """``(weight dimension, stride)`` a style splits the module's weight along; None: whole."""
    if isinstance(style, VocabEmbedding):
        return 0, 1
    if isinstance(style, Column):
        return linear_dims(module)[0], style.stride
    if isinstance(style, Row):
        return linear_dims(module)[1], 1
    return None


def _check_ties(model: nn.Module, plan: TPPlan) -> None:
    """Every holder of a tied weight (an embedding and its head) must split it the same way."""
    holders: dict[int, list[str]] = {}
    for name, _ in model.named_parameters(remove_duplicate=False):
        if name.endswith(".weight"):
            holders.setdefault(id(model.get_parameter(name)), []).append(name[: -len(".weight")])
    for names in holders.values():
        splits = {n: split_of(model.get_submodule(n), plan.style_of(n)) for n in names}
        if len(set(splits.values())) > 1:
            shown = ", ".join(f"{n} {'whole' if v is None else f'split on dim {v[0]}'}" for n, v in splits.items())
            raise ConfigError(f"{' and '.join(names)} share one weight, but the plan splits it differently ({shown}): "
                              "give every holder a matching style (e.g. 'vocab' for the embedding and 'column' for "
                              "the head), or 'replicate' for all.")


TP_TERM = "{tensor_model_parallel_size}"
"""How a plan's refusal names the TP size: the layout's field (a door relabels it)."""


def _tp_error(message: str, tp: int) -> ConfigError:
    """A refusal whose ``message`` names the TP size as ``TP_TERM``."""
    return ConfigError(message, values=dict(tensor_model_parallel_size=tp))


def _check_style(name: str, module: nn.Module, style: Style, tp: int) -> None:
    kind = type(module).__name__
    if isinstance(style, (Column, Row)):
        dims = linear_dims(module)
        what = "column" if isinstance(style, Column) else "row"
        if dims is None:
            raise ConfigError(
                f"plan maps {name} ({kind}) to {what!r}, but only nn.Linear and Hugging Face Conv1D can be split by "
                f"column or row (and nn.Embedding by 'vocab'): map {name} to 'replicate' or narrow the pattern.")
        out_dim, in_dim, out_attr, in_attr = dims
        if isinstance(style, Column):
            size, parts = getattr(module, out_attr), style.stride
            if style.stride > 1 and style.gather_output and tp > 1:
                raise ConfigError(f"{name}: Column(stride={style.stride}, gather_output=True) would gather the parts "
                                  "rank by rank, out of order; keep gather_output=False for a strided output.")
            if style.stride < 1 or size % (parts * tp):
                raise _tp_error(
                    f"{name} ({kind}) has {size} output features: {parts} part(s) of {size // max(parts, 1)} cannot be "
                    f"split across {TP_TERM} ranks. Use a TP size that divides "
                    f"{size // max(parts, 1)}, or map {name} to 'replicate'.", tp)
        elif getattr(module, in_attr) % tp:
            raise _tp_error(
                f"{name} ({kind}) has {getattr(module, in_attr)} input features, not divisible by "
                f"{TP_TERM}. Use a TP size that divides it, or map {name} to 'replicate'.", tp)
    elif isinstance(style, VocabEmbedding):
        if not isinstance(module, nn.Embedding):
            raise ConfigError(f"plan maps {name} ({kind}) to 'vocab', which splits nn.Embedding rows only: map it to "
                              "'column'/'row' (linear layers) or 'replicate'.")
        if module.num_embeddings % tp:
            raise _tp_error(
                f"{name} (nn.Embedding) has {module.num_embeddings} rows, not divisible by {TP_TERM}. Pad the "
                f"vocabulary to a multiple of {tp} (e.g. "
                f"vocab_size={module.num_embeddings + (-module.num_embeddings) % tp}) "
                f"or map {name} to 'replicate'.", tp)
        if module.max_norm is not None or module.sparse or module.scale_grad_by_freq:
            raise ConfigError(f"{name}: nn.Embedding with max_norm, sparse=True or scale_grad_by_freq=True cannot be "
                              "split by 'vocab'; map it to 'replicate'.")


def _check_divisible(name: str, module: nn.Module, attrs: tuple[str, ...], tp: int, verb: str) -> None:
    for attr in attrs:
        value = _attribute(name, module, attr)
        if not isinstance(value, int) or value % tp:
            raise _tp_error(f"{name}.{attr}={value} cannot be {verb} {TP_TERM}: each TP rank must hold whole "
                            f"attention heads. Use a TP size that divides {value}.", tp)


def _check_equal(name: str, module: nn.Module, attrs: tuple[str, ...], tp: int) -> None:
    values = {attr: _attribute(name, module, attr) for attr in attrs}
    if tp > 1 and len(set(values.values())) > 1:
        shown = ", ".join(f"{a}={v}" for a, v in values.items())
        raise ConfigError(
            f"{name}: {shown} differ, but the plan splits a fused projection of these sizes into equal parts "
            f"(Column(stride=...)), which would give each TP rank the wrong heads. Run it with "
            "tensor_model_parallel_size=1 (pipeline and data parallel still apply).")


def _attribute(name: str, module: nn.Module, attr: str):
    try:
        return _get_path(module, attr)
    except AttributeError:
        raise ConfigError(f"plan names attribute {attr!r} of {name} ({type(module).__name__}), which it does not "
                          "have. Fix the attribute name in the plan.") from None
