"""mHC for any model: hyper-connections added to a model as written, without changing its function.

    model = AutoModelForCausalLM.from_pretrained(DIR)
    add_hyper_connections(model, num_residual_streams=4)       # same logits as before
    model = parallelize(model_recorded_under_meta, plan="auto", hyper_connections=4)   # or inside

The residual stream becomes ``n`` streams of the model's hidden width, stored side by side
(``[..., n*C]``, as the project's GPT stores them). A *plan* names, per block, its *branches*: the
module that reads the residual stream (the branch's norm, its *entry*) and the module whose output
the block adds back to it (its *exit*). Around each branch the project's own
``HyperConnectionModule`` (same math, same kernels, chosen by ``implementation``) computes from the
streams ``x`` the mappings ``H_pre, H_post, H_res``; then:

- the entry's forward runs on ``H_pre x`` (``[..., C]``) instead of on the stream;
- after the exit, the streams become ``H_res x + H_post^T F`` (``F``: the exit's output, after the
  dropout the block applies to it when the plan names one), and the exit returns a zero scalar;
  the block's own code runs on a one-wide view of the streams, so its ``residual + F`` adds that
  zero to a ``[..., 1]`` tensor (cheap, and never used);
- the block's output is the new streams; before the first block the embedding output is copied
  into the ``n`` streams, after the last one the streams are contracted by their mean.

The hooks hand the streams to each other through a small per-block state, within one forward of
one block, so a block that is re-run by activation checkpointing recomputes the same values.

**Exact at step 0.** With ``init_gating_factor=0``, ``b_pre = logit(1/n)``, ``b_post = 0`` and
``b_res = 0``: ``H_pre`` averages the streams, ``H_post = 1`` and ``H_res = J/n``. Every stream then
equals ``m + F(m)`` after each branch, where ``m`` is their mean, so the model computes what the
unmodified model computes (up to the rounding of the average), whatever its weights. Training moves
the gating factors off zero. ``n = 1`` adds nothing: one stream is the plain residual.

**Block recompute.** Under ``recompute="mhc_block"`` (``parallelize``), each branch's
hyper-connection and entry run as one checkpoint and its ``H_res``/``H_post`` add as another, in one
``MHCBlockRecomputeManager`` per group of blocks, recomputed from one hook on the group's output;
the attention and MLP keep their activations (the project's GPT does the same).

Families built in (``plan="auto"`` by ``config.model_type``): Llama, Mistral, Qwen2, Qwen3, Gemma,
Gemma 2 and 3 (their post-norms end the branches), Phi-3, GPT-2, GPT-NeoX (its parallel attention
and MLP), OPT. Any other model: a :class:`HyperConnectionPlan` of :class:`Branch` entries.
"""
from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import Tensor, nn

from lightning_mhc.errors import ConfigError
from lightning_mhc.model.bda import h_res_h_post_bias_dropout_add
from lightning_mhc.model.config import MHCTransformerConfig
from lightning_mhc.model.hyper_connection import HyperConnectionModule
from lightning_mhc.model.init import ParamInit
from lightning_mhc.parallelize.pipeline import find_parts, replace_hidden_states
from lightning_mhc.parallelize.record import record_module_init
from lightning_mhc.recompute.manager import MHCBlockRecomputeManager
from lightning_mhc.recompute.without_output import CheckpointWithoutOutput


@dataclass(frozen=True)
class Branch:
    """One residual branch of a block, by module names relative to the block.

    Args:
        entry: the module that reads the residual stream (the branch's first norm).
        exit: the module whose output the block adds to the residual stream (the attention, the
            MLP, or what ends the branch: a post-norm, a dropout).
        parallel: the branch reads the block's input, not the previous branch's result (GPT-NeoX's
            parallel attention and MLP); its result still adds onto the previous branch's.
        dropout: the block's attribute holding the probability of a dropout the block applies to
            the exit's output before adding it (OPT's ``self.dropout``); None: the exit's output
            is what is added.
    """

    entry: str
    exit: str
    parallel: bool = False
    dropout: str | None = None


@dataclass(frozen=True)
class HyperConnectionPlan:
    """Where the hyper-connections go: the branches of every block of the block list ``blocks``
    (found as ``parallelize`` finds it when None)."""

    branches: tuple[Branch, ...]
    blocks: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "branches", tuple(self.branches))
        if not self.branches or not all(isinstance(b, Branch) for b in self.branches):
            raise ConfigError("a HyperConnectionPlan needs at least one Branch(entry=..., exit=...) per block.")
        if self.branches[0].parallel:
            raise ConfigError(f"the first branch ({self.branches[0].entry}) cannot be parallel: nothing runs before it.")


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


HC_PLANS: dict[str, HyperConnectionPlan | Callable[[Any], HyperConnectionPlan]] = {
    "llama": LLAMA_BRANCHES, "mistral": LLAMA_BRANCHES, "qwen2": LLAMA_BRANCHES, "qwen3": LLAMA_BRANCHES,
    "gemma": LLAMA_BRANCHES, "gemma2": GEMMA2_BRANCHES, "gemma3": GEMMA2_BRANCHES, "gemma3_text": GEMMA2_BRANCHES,
    "phi3": PHI3_BRANCHES, "gpt2": _gpt2, "gpt_neox": _gpt_neox, "opt": _opt,
}
"""Built-in hyper-connection plans by Hugging Face ``config.model_type`` (a function of the config
where the block's structure depends on it)."""


def resolve_hc_plan(plan: str | HyperConnectionPlan | Mapping[str, Any], model: nn.Module) -> HyperConnectionPlan:
    """A plan: ``"auto"`` (by ``model.config.model_type``), a family name, a plan, or a mapping of its fields."""
    if isinstance(plan, HyperConnectionPlan):
        return plan
    if isinstance(plan, Mapping):
        fields = dict(plan)
        branches = tuple(b if isinstance(b, Branch) else Branch(**b) for b in fields.pop("branches", ()))
        return HyperConnectionPlan(branches, **fields)
    config = getattr(model, "config", None)
    family = getattr(config, "model_type", None) if plan == "auto" else plan
    if family not in HC_PLANS:
        given = (f"plan={plan!r}" if plan != "auto" else f"model_type {family!r}" if family
                 else "no config.model_type")
        raise ConfigError(f"hyper-connections: {type(model).__name__} has {given}, and no built-in plan fits (built in: "
                          f"{', '.join(HC_PLANS)}); pass a HyperConnectionPlan of its branches "
                          "(docs/mhc_any_model.md#a-plan-for-your-own-model).")
    found = HC_PLANS[family]
    return found(config) if callable(found) else found


@dataclass(frozen=True)
class HyperConnectionSettings:
    """What every hyper-connection of a model is built with (checked when made).

    Args:
        num_residual_streams: ``n`` (1: no hyper-connections).
        seed: the parameters are drawn from it by name, so every layout holds the same values.
        init_gating_factor: the initial ``a_pre, a_post, a_res`` (0: the model's function exactly).
        implementation: the ops (``mhc_implementation``: ``auto``, ``reference``, ``fused``,
            ``triton``, ``compile``).
        sinkhorn_iterations: of ``H_res``'s projection.
    """

    num_residual_streams: int = 4
    seed: int = 0
    init_gating_factor: float = 0.0
    implementation: str = "auto"
    sinkhorn_iterations: int = 20

    def __post_init__(self) -> None:
        n = self.num_residual_streams
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"num_residual_streams={n!r}: the residual stream is n >= 1 streams (1: the model as it "
                              "is); use a positive integer such as 4.")
        self.config(hidden_size=8, eps=1e-5)  # the gating factor, implementation and iterations, checked once

    @property
    def enabled(self) -> bool:
        return self.num_residual_streams > 1

    def config(self, hidden_size: int, eps: float, std: float = 0.02) -> MHCTransformerConfig:
        """The ``MHCTransformerConfig`` a ``HyperConnectionModule`` reads (only its mHC fields and
        the hidden size, norm epsilon and init std matter)."""
        return MHCTransformerConfig(
            num_layers=1, hidden_size=hidden_size, num_attention_heads=1, num_residual_streams=self.num_residual_streams,
            mhc_init_gating_factor=self.init_gating_factor, mhc_implementation=self.implementation,
            mhc_sinkhorn_iterations=self.sinkhorn_iterations, layernorm_epsilon=eps, init_method_std=std)


HYPER_CONNECTIONS = "hyper_connections"
"""The attribute of a block holding its hyper-connections (``<block>.hyper_connections.<branch>``)."""


class _Streams:
    """The residual streams inside one forward of one block: set by the entries and exits, read by
    the block's output hook. ``current``: the streams after the branches that ran; ``block_input``:
    the block's input streams (what a parallel branch reads); ``pending``: a
    branch's ``(H_res, H_post)`` from its entry to its exit; ``manager``: the block recompute's,
    while a group of blocks runs; ``ran``: the exits that ran; ``sequence_parallel``: set by
    ``parallelize`` when the block runs on this rank's part of the sequence."""

    def __init__(self) -> None:
        self.current: Tensor | None = None
        self.block_input: Tensor | None = None
        self.pending: dict[int, tuple[Tensor, Tensor]] = {}
        self.manager: MHCBlockRecomputeManager | None = None
        self.last_in_group = False
        self.ran = 0
        self.sequence_parallel = False  # this rank's part of the sequence: its dropout masks are its own


@dataclass(frozen=True)
class _BlockWiring:
    """What the hooks of one block need: its name, plan, width and settings."""

    name: str
    plan: HyperConnectionPlan
    hidden_size: int
    settings: HyperConnectionSettings
    first: bool
    last: bool

    @property
    def n(self) -> int:
        return self.settings.num_residual_streams


def add_hyper_connections(model: nn.Module, num_residual_streams: int = 4,
                          plan: str | HyperConnectionPlan | Mapping[str, Any] = "auto", seed: int = 0,
                          init_gating_factor: float = 0.0, implementation: str = "auto",
                          ) -> nn.Module:
    """Rewire ``model`` in place so its residual stream is ``num_residual_streams`` streams with a
    hyper-connection around every branch of every block (see the module docstring); returns it.

    Works on a materialised model (``from_pretrained``: the hyper-connections are made on its
    device) and on one built under ``record_module_init`` (they are recorded like its other
    modules, and ``parallelize`` or ``build_recorded_module`` makes them real, from ``seed`` by name).
    """
    settings = HyperConnectionSettings(num_residual_streams, seed, init_gating_factor, implementation)
    return apply_hyper_connections(model, settings, plan)


def apply_hyper_connections(model: nn.Module, settings: HyperConnectionSettings,
                            plan: str | HyperConnectionPlan | Mapping[str, Any] = "auto") -> nn.Module:
    """:func:`add_hyper_connections` with its settings as one value."""
    if getattr(model, "hyper_connection_settings", None) is not None:
        raise ConfigError(f"{type(model).__name__} has hyper-connections already "
                          f"({model.hyper_connection_settings.num_residual_streams} streams); add them once.")
    if not settings.enabled:
        return model
    plan = resolve_hc_plan(plan, model)
    parts = find_parts(model, plan.blocks)
    hidden = _hidden_size(model, parts.blocks[0], plan)
    eps, std = _norm_eps(model), _init_std(model)
    config = settings.config(hidden, eps, std)
    meta = any(p.device.type == "meta" for p in model.parameters())
    count = len(parts.blocks)
    for index, block in enumerate(parts.blocks):
        name = parts.block_name(index)
        _check_block(name, block, plan)
        wiring = _BlockWiring(name, plan, hidden, settings, first=index == 0, last=index == count - 1)
        _wire_block(block, wiring, _make_hyper_connections(block, name, plan, config, settings.seed, meta))
    model.hyper_connection_settings = settings
    model.hyper_connection_plan = plan
    return model


def _hidden_size(model: nn.Module, block: nn.Module, plan: HyperConnectionPlan) -> int:
    size = getattr(getattr(model, "config", None), "hidden_size", None)
    if isinstance(size, int):
        return size
    weight = getattr(block.get_submodule(plan.branches[0].entry), "weight", None)
    if isinstance(weight, Tensor) and weight.dim() == 1:
        return weight.shape[0]
    raise ConfigError(f"cannot tell the hidden size of {type(model).__name__}: its first branch's entry "
                      f"({plan.branches[0].entry}) has no 1-d weight and the model no config.hidden_size.")


def _norm_eps(model: nn.Module) -> float:
    config = getattr(model, "config", None)
    for attr in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon"):
        value = getattr(config, attr, None)
        if isinstance(value, float):
            return value
    return 1e-5


def _init_std(model: nn.Module) -> float:
    value = getattr(getattr(model, "config", None), "initializer_range", None)
    return value if isinstance(value, float) else 0.02


def _check_block(name: str, block: nn.Module, plan: HyperConnectionPlan) -> None:
    modules = dict(block.named_modules())
    entries = [b.entry for b in plan.branches]
    for branch in plan.branches:
        for role, module_name in (("entry", branch.entry), ("exit", branch.exit)):
            if module_name not in modules or not module_name:
                raise ConfigError(f"hyper-connection plan {role} {module_name!r} is not a module of {name} "
                                  f"({type(block).__name__}; its modules: {', '.join(n for n in modules if n)}). "
                                  "Fix the branch.")
        if branch.dropout is not None and not isinstance(getattr(block, branch.dropout, None), (int, float)):
            raise ConfigError(f"hyper-connection plan dropout {branch.dropout!r}: {name} has no such number attribute.")
    if len(set(entries)) != len(entries) or set(entries) & {b.exit for b in plan.branches}:
        raise ConfigError(f"hyper-connection plan: each branch needs its own entry and exit module (got {plan.branches}).")


def _make_hyper_connections(block: nn.Module, name: str, plan: HyperConnectionPlan, config: MHCTransformerConfig,
                            seed: int, meta: bool) -> nn.ModuleList:
    """One ``HyperConnectionModule`` per branch, as ``<block>.hyper_connections.<i>``: on a recorded
    (meta) model, recorded like its modules (``parallelize`` makes them real by name); else real,
    on the block's device."""
    init = ParamInit(seed, f"{name}.{HYPER_CONNECTIONS}")
    with record_module_init() if meta else contextlib.nullcontext():
        modules = nn.ModuleList(HyperConnectionModule(config, init.child(str(i))) for i in range(len(plan.branches)))
    for module in modules:
        module.initialises_itself = True  # by name: a model's own init function must not redraw them
    return modules if meta else modules.to(next(block.parameters()).device)


def drawn_from_seed(name: str) -> bool:
    """A state-dict name of a hyper-connection tensor: pretrained weights of the base model lack
    them, and the build draws them from the seed."""
    return f".{HYPER_CONNECTIONS}." in f".{name}"


def _wire_block(block: nn.Module, wiring: _BlockWiring, hyper_connections: nn.ModuleList) -> None:
    setattr(block, HYPER_CONNECTIONS, hyper_connections)
    block.hyper_connection_streams = streams = _Streams()
    block.hyper_connection_wiring = wiring
    for index, branch in enumerate(wiring.plan.branches):
        entry = block.get_submodule(branch.entry)
        entry.forward = _entry_forward(entry.forward, hyper_connections[index], streams, index, branch, wiring)
        block.get_submodule(branch.exit).register_forward_hook(
            functools.partial(_exit_hook, block, hyper_connections[index], streams, index, branch, wiring))
    if wiring.first:
        block.register_forward_pre_hook(functools.partial(_expand, wiring.n), with_kwargs=True)
    block.forward = _block_forward(block, block.forward, streams)
    block.register_forward_hook(functools.partial(_block_output, streams, wiring))


def _block_forward(block: nn.Module, forward: Callable, streams: _Streams) -> Callable:
    """The block's own forward on a one-wide view of its input streams, the streams kept for the
    entries: the block's residual adds (``x + F``, whose results the block's output hook replaces
    by the streams) then add zeros to that view instead of writing ``n * C`` wide tensors no one
    reads (two per block)."""

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any):
        def keep(x: Tensor) -> Tensor:  # a new forward (one that failed midway left nothing behind)
            streams.current = streams.block_input = x
            streams.ran = 0
            streams.pending.clear()
            return x[..., :1]

        args, kwargs = replace_hidden_states(block, args, kwargs, keep, "the hyper-connections need the streams")
        return forward(*args, **kwargs)

    return run


def _expand(n: int, module: nn.Module, args: tuple, kwargs: dict):
    """Before the first block: the embedding output copied into the ``n`` streams."""
    return replace_hidden_states(module, args, kwargs,
                                 lambda x: HyperConnectionModule.input_expand(x, n).contiguous(),
                                 "the hyper-connections cannot find the residual stream")


def _entry_forward(forward: Callable, hc: HyperConnectionModule, streams: _Streams, index: int, branch: Branch,
                   wiring: _BlockWiring) -> Callable:
    """The entry's forward on ``H_pre x`` (``x``: the streams this branch reads), with the
    mappings kept for the exit; under block recompute one checkpoint with the hyper-connection."""

    @functools.wraps(forward)
    def entry(x: Tensor, *args: Any, **kwargs: Any):
        if index != streams.ran:  # the exits' order decides which one ends a block recompute group
            raise RuntimeError(f"{wiring.name}.{branch.entry} ran as branch {streams.ran + 1} of the block, but the "
                               f"hyper-connection plan names it branch {index + 1}: the plan's branches must name "
                               "the modules in the order the block runs them")
        source = streams.block_input if branch.parallel else streams.current
        if source.shape[-1] != wiring.n * wiring.hidden_size:  # the block's forward set it
            raise RuntimeError(f"{wiring.name}.{branch.entry}: expected the {wiring.n} residual streams "
                               f"(width {wiring.n * wiring.hidden_size}), got {tuple(source.shape)}")
        lead = x.shape[:-1]

        def hyper_connection_and_entry(streams_in: Tensor):
            aggregated, h_res, h_post = hc(streams_in)
            return forward(aggregated.reshape(*lead, wiring.hidden_size), *args, **kwargs), h_res, h_post

        if streams.manager is not None:
            out, h_res, h_post = streams.manager.checkpoint(hyper_connection_and_entry, source,
                                                            name=f"{wiring.name}.{branch.entry}+hyper_connection")
        else:
            out, h_res, h_post = hyper_connection_and_entry(source)
        streams.pending[index] = (h_res, h_post)
        return out

    return entry


def _exit_hook(block: nn.Module, hc: HyperConnectionModule, streams: _Streams, index: int, branch: Branch,
               wiring: _BlockWiring, module: nn.Module, args: tuple, output: Any):
    """After the exit: the streams become ``H_res x + H_post^T F``; the exit returns a zero, which
    the block's own residual add adds to its one-wide view (a result nothing reads)."""
    if index not in streams.pending:
        raise RuntimeError(f"{wiring.name}.{branch.exit} ran before its entry {branch.entry}: the plan's branches "
                           "must name the modules in the order the block runs them")
    h_res, h_post = streams.pending.pop(index)
    out = output if isinstance(output, Tensor) else output[0]
    current = streams.current
    out = out.reshape(*current.shape[:-1], wiring.hidden_size)
    prob = float(getattr(block, branch.dropout)) if branch.dropout is not None else 0.0
    add = functools.partial(h_res_h_post_bias_dropout_add, prob=prob, training=block.training,
                            implementation=hc.config.mhc_implementation,
                            sequence_parallel=streams.sequence_parallel)
    last = index == len(wiring.plan.branches) - 1
    if streams.manager is not None and not (last and streams.last_in_group):
        ckpt = CheckpointWithoutOutput(ckpt_manager=streams.manager, name=f"{wiring.name}.{branch.exit}+h_res_h_post")
        streams.current = ckpt.checkpoint(lambda o, x, r, p: add((o, None), x, r, p), out, current, h_res, h_post)
    else:  # no block recompute, or the group's last output: the manager's hook tensor
        streams.current = add((out, None), current, h_res, h_post)
    streams.ran += 1
    zero = out.new_zeros(())
    return zero if isinstance(output, Tensor) else (zero, *output[1:])


def _block_output(streams: _Streams, wiring: _BlockWiring, module: nn.Module, args: tuple, output: Any):
    """The block's output is the streams after its branches (contracted by their mean after the
    last block); the end of a recompute group hands its output to the manager."""
    if streams.ran != len(wiring.plan.branches) or streams.pending:
        raise RuntimeError(f"{wiring.name} ran {streams.ran} of the {len(wiring.plan.branches)} branches of its "
                           "hyper-connection plan: each branch's entry and exit must run once per forward")
    result, streams.current, streams.block_input = streams.current, None, None
    manager = streams.manager
    if manager is not None and streams.last_in_group:
        manager.discard_all_outputs_and_register_unified_recompute(result)
    if wiring.last:
        result = HyperConnectionModule.output_contract(result, wiring.n)
    return result if isinstance(output, Tensor) else (result, *output[1:])


# ------------------------------------------------------------------ block recompute
def attach_block_recompute(blocks: list[nn.Module], layer_num: int | None) -> None:
    """Block recompute over consecutive ``blocks`` (one stage's): groups of ``layer_num`` blocks
    (None: the paper's ``max(1, int(sqrt(n L / (n + 2))))``), one manager per group per training
    forward, made by a pre-hook on the group's first block."""
    if not blocks:
        return
    n = blocks[0].hyper_connection_wiring.n
    size = layer_num if layer_num is not None else max(1, int(math.sqrt(n * len(blocks) / (n + 2))))
    for start in range(0, len(blocks), size):
        group = blocks[start:start + size]
        for block in group:
            block.hyper_connection_streams.last_in_group = block is group[-1]
        group[0].register_forward_pre_hook(functools.partial(_start_group, group))


def _start_group(group: list[nn.Module], module: nn.Module, args: tuple) -> None:
    training = module.training and torch.is_grad_enabled()
    first, last = group[0].hyper_connection_wiring.name, group[-1].hyper_connection_wiring.name
    manager = MHCBlockRecomputeManager(name=f"{first}..{last}") if training else None
    for block in group:
        block.hyper_connection_streams.manager = manager


def hyper_connection_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of ``model`` that carry hyper-connections, in order."""
    return [m for m in model.modules() if hasattr(m, "hyper_connection_wiring")]


__all__ = ["Branch", "HC_PLANS", "HyperConnectionPlan", "HyperConnectionSettings", "add_hyper_connections",
           "apply_hyper_connections", "attach_block_recompute", "hyper_connection_blocks", "resolve_hc_plan"]
