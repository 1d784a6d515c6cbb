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

Each hyper-connected block owns its streams: its class and its entries' are swapped for
subclasses made once per class (state-dict names, ``isinstance`` and the class name kept), whose
forwards hold one forward's streams in a state made fresh by the block's forward; the exits are
hooked by module-level functions. So whatever re-runs a block's forward (Hugging Face's gradient
checkpointing, reentrant or not, ``torch.utils.checkpoint``, ``recompute="full"``,
``torch.compile``) recomputes the same values, and ``copy.deepcopy`` and pickling give a model
with its own state. ``output_hidden_states`` reports each block's streams by their mean
(``[..., C]``, the unmodified model's shape), and a Hugging Face model's ``save_pretrained``
writes the hyper-connections beside the base model (``hc_files.save_hyper_connections``).

**Exact at step 0.** With ``init_gating_factor=0``, ``b_pre = logit(1/n)``, ``b_post = 0`` and
``b_res = 0``: ``H_pre`` averages the streams, ``H_post = 1`` and ``H_res = J/n``. Every stream then
equals ``m + F(m)`` after each branch, where ``m`` is their mean, so the model computes what the
unmodified model computes (up to the rounding of the average), whatever its weights. Training moves
the gating factors off zero. ``n = 1`` adds nothing: one stream is the plain residual.

**Block recompute.** Under ``recompute="mhc_block"`` (``parallelize``), each branch's
hyper-connection and entry run as one checkpoint and its ``H_res``/``H_post`` add as another, in one
``MHCBlockRecomputeManager`` per group of blocks, recomputed from one hook on the group's output
(the groups are ``lightning_mhc.recompute.groups``'s, as for the project's GPT); the attention and
MLP keep their activations.

Families built in (``plan="auto"`` by ``config.model_type``; ``families.py``): Llama, Mistral,
Qwen2, Qwen3, Gemma, Gemma 2 and 3 (their post-norms end the branches), Phi-3, GPT-2, GPT-NeoX (its
parallel attention and MLP), OPT. Any other model: a :class:`HyperConnectionPlan` of
:class:`Branch` entries (``hc_plan.py``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import Tensor, nn

from lightning_mhc.errors import ConfigError
from lightning_mhc.layers.bda import h_res_h_post_bias_dropout_add
from lightning_mhc.layers.hyper_connection import (
    HyperConnectionConfig,
    HyperConnectionModule,
    check_hyper_connection_values,
)
from lightning_mhc.layers.init import ParamInit
from lightning_mhc.any_model.families import resolve_hc_plan
from lightning_mhc.any_model.hc_files import SavePretrainedWithHyperConnections
from lightning_mhc.any_model.hc_plan import HYPER_CONNECTIONS, Branch, HyperConnectionPlan
from lightning_mhc.any_model.pipeline import find_parts, replace_hidden_states
from lightning_mhc.any_model.record import record_module_init
from lightning_mhc.recompute.groups import RecomputeGroup
from lightning_mhc.recompute.manager import MHCBlockRecomputeManager
from lightning_mhc.recompute.without_output import CheckpointWithoutOutput
from lightning_mhc.roles import assign_roles, roles_of
from lightning_mhc.wrapping import wrap


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
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"seed={self.seed!r}: the hyper-connections' parameters are drawn from an integer seed "
                              "by name; pass an int such as 0.")
        check_hyper_connection_values(self.sinkhorn_iterations, self.implementation, self.init_gating_factor)

    @classmethod
    def of(cls, value: int | HyperConnectionSettings | None, seed: int = 0,
           implementation: str = "auto") -> HyperConnectionSettings:
        """The settings a caller's ``hyper_connections`` stands for: None is one stream (the model as
        it is), an integer ``n`` streams with ``seed`` and ``implementation``, settings are
        themselves."""
        if isinstance(value, cls):
            return value
        return cls(1 if value is None else value, seed=seed, implementation=implementation)

    @property
    def enabled(self) -> bool:
        return self.num_residual_streams > 1

    def config(self, hidden_size: int, eps: float, std: float = 0.02) -> HyperConnectionConfig:
        """What each ``HyperConnectionModule`` of a model of width ``hidden_size`` (its norms'
        epsilon ``eps``, its init std ``std``) is built with."""
        return HyperConnectionConfig(num_residual_streams=self.num_residual_streams, hidden_size=hidden_size, eps=eps,
                                     init_std=std, init_gating_factor=self.init_gating_factor,
                                     implementation=self.implementation, sinkhorn_iterations=self.sinkhorn_iterations)


_SETTING_DEFAULTS = {f.name: f.default for f in dataclasses.fields(HyperConnectionSettings)}



@dataclass(frozen=True)
class _BlockWiring:
    """What a hyper-connected block needs to run: its name, plan, width and settings, whether it
    is the model's first or last block, and whether it runs on this rank's part of the sequence
    (set by ``parallelize``: its dropout masks are then its own)."""

    name: str
    plan: HyperConnectionPlan
    hidden_size: int
    settings: HyperConnectionSettings
    first: bool
    last: bool
    sequence_parallel: bool = False

    @property
    def n(self) -> int:
        return self.settings.num_residual_streams


class _BlockCall:
    """The residual streams inside one forward of one block, made fresh by the block's forward
    (so a block re-run by any activation checkpointing recomputes from its own input):
    ``current``: the streams after the branches that ran; ``block_input``: the block's input
    streams (what a parallel branch reads); ``pending``: a branch's ``(H_res, H_post)`` from its
    entry to its exit; ``ran``: the exits that ran; ``manager``: the block recompute's, if any."""

    def __init__(self, block: nn.Module) -> None:
        self.block = block
        self.wiring: _BlockWiring = block.hyper_connection_wiring
        roles = roles_of(block)  # given by lightning_mhc.recompute.groups.attach_block_recompute (mhc_block)
        self.group: RecomputeGroup | None = roles.recompute_group
        self.last_in_group: bool = roles.last_in_recompute_group
        self.observer = roles.hyper_connection_observer
        self.manager: MHCBlockRecomputeManager | None = self.group.manager if self.group is not None else None
        self.current: Tensor | None = None
        self.block_input: Tensor | None = None
        self.pending: dict[int, tuple[Tensor, Tensor]] = {}
        self.ran = 0


_RUNNING = threading.local()
"""Per thread, the calls of hyper-connected blocks now running (innermost last): how an entry or
an exit finds the streams of the block it belongs to. Per thread, because the autograd engine
re-runs a checkpointed block in its own thread and ``nn.DataParallel`` runs replicas in threads;
within one thread a block's entries and exits run inside its forward."""


def _running_calls() -> list[_BlockCall]:
    calls = getattr(_RUNNING, "calls", None)
    if calls is None:
        calls = _RUNNING.calls = []
    return calls


def _current_call(module: nn.Module, role: str) -> _BlockCall:
    calls = _running_calls()
    if not calls:
        raise RuntimeError(f"{type(module).__name__} is the {role} of a hyper-connection branch: it runs inside its "
                           "block's forward, on the block's residual streams, not on its own")
    return calls[-1]


class _HyperConnectedBlock:
    """What a block's class gets with hyper-connections (see :func:`_hyper_connected_class`): its
    forward takes the residual streams (the embedding output for the first block, copied into the
    ``n`` streams), runs the block's own forward on a one-wide view of them while its entries and
    exits read and write the streams, and returns the new streams (their mean after the last
    block). Everything of one forward lives in one :class:`_BlockCall`, so whatever re-runs the
    block's forward (Hugging Face's gradient checkpointing, ``torch.utils.checkpoint``,
    ``recompute="full"``, ``torch.compile``) recomputes exactly what the forward computed.

    The block's own residual adds (``x + F``) then add zeros to the one-wide view instead of
    writing ``n * C`` wide tensors no one reads (two per block)."""

    def forward(self, *args: Any, **kwargs: Any):
        call = _BlockCall(self)
        wiring = call.wiring

        def keep(x: Tensor) -> Tensor:
            if wiring.first:
                x = HyperConnectionModule.input_expand(x, wiring.n).contiguous()
            call.current = call.block_input = x
            return x[..., :1]

        args, kwargs = replace_hidden_states(self, args, kwargs, keep, "the hyper-connections need the residual stream")
        calls = _running_calls()
        calls.append(call)
        try:
            output = super().forward(*args, **kwargs)
        finally:
            calls.pop()
        return _block_output(call, output)


class _HyperConnectedEntry:
    """What an entry's class gets with hyper-connections: its forward runs on ``H_pre x`` (``x``:
    the streams its branch reads) and keeps ``H_res, H_post`` for the exit; under block recompute
    the hyper-connection and the entry are one checkpoint."""

    def forward(self, x: Tensor, *args: Any, **kwargs: Any):
        call = _current_call(self, "entry")
        index: int = self.hyper_connection_branch
        wiring = call.wiring
        branch = wiring.plan.branches[index]
        if index != call.ran:  # the exits' order decides which one ends a block recompute group
            raise RuntimeError(f"{wiring.name}.{branch.entry} ran as branch {call.ran + 1} of the block, but the "
                               f"hyper-connection plan names it branch {index + 1}: the plan's branches must name "
                               "the modules in the order the block runs them")
        source = call.block_input if branch.parallel else call.current
        if source.shape[-1] != wiring.n * wiring.hidden_size:
            raise RuntimeError(f"{wiring.name}.{branch.entry}: expected the {wiring.n} residual streams "
                               f"(width {wiring.n * wiring.hidden_size}), got {tuple(source.shape)}")
        hc = call.block.get_submodule(HYPER_CONNECTIONS)[index]
        entry_forward = super().forward
        lead = x.shape[:-1]

        def hyper_connection_and_entry(streams_in: Tensor):
            aggregated, h_res, h_post = hc(streams_in)
            return entry_forward(aggregated.reshape(*lead, wiring.hidden_size), *args, **kwargs), h_res, h_post

        if call.manager is not None:
            out, h_res, h_post = call.manager.checkpoint(hyper_connection_and_entry, source,
                                                         name=f"{wiring.name}.{branch.entry}+hyper_connection")
        else:
            out, h_res, h_post = hyper_connection_and_entry(source)
        call.pending[index] = (h_res, h_post)
        return out


_ROLES = {"block": _HyperConnectedBlock, "entry": _HyperConnectedEntry}
_CLASSES: dict[tuple[type, str], type] = {}
"""The class made for each ``(base class, role)``, made once per process."""


def _hyper_connected_class(base: type, role: str) -> type:
    """``base`` with the hyper-connected forward of ``role`` (``"block"`` or ``"entry"``), made
    once per class. A module's class is swapped for it in place, so its state-dict names, its
    ``isinstance`` and its class name (Hugging Face's ``_no_split_modules``, wrap policies by
    name) stay; a Hugging Face block keeps its ``GradientCheckpointingLayer`` path, which then
    checkpoints this forward as a whole. Copies and pickles rebuild the class by its base and
    role (:func:`_rebuild_hyper_connected`), so a copy has its own state and a pickled model
    loads in a fresh process."""
    if issubclass(base, _ROLES[role]):
        return base
    cls = _CLASSES.get((base, role))
    if cls is None:
        cls = type(base.__name__, (_ROLES[role], base), {
            "__module__": __name__, "__qualname__": base.__qualname__,
            "hyper_connection_role": role, "hyper_connection_base": base, "__reduce_ex__": _reduce_ex})
        _CLASSES[(base, role)] = cls
    return cls


def _reduce_ex(self: nn.Module, protocol: int):
    return _rebuild_hyper_connected, (type(self).hyper_connection_base, type(self).hyper_connection_role), \
        self.__getstate__()


def _rebuild_hyper_connected(base: type, role: str) -> nn.Module:
    """An empty instance of the hyper-connected class of ``base`` (pickle and ``copy`` then set
    its state)."""
    cls = _hyper_connected_class(base, role)
    return cls.__new__(cls)


def add_hyper_connections(model: nn.Module, num_residual_streams: int | HyperConnectionSettings = 4,
                          plan: str | HyperConnectionPlan | Mapping[str, Any] = "auto", seed: int = 0,
                          init_gating_factor: float = 0.0, implementation: str = "auto",
                          ) -> nn.Module:
    """Rewire ``model`` in place so its residual stream is ``num_residual_streams`` streams with a
    hyper-connection around every branch of every block (see the module docstring); returns it.
    The one entry point: ``num_residual_streams`` may instead be a whole
    :class:`HyperConnectionSettings` (then ``seed``, ``init_gating_factor`` and ``implementation``
    are its own, not given here).

    Works on a materialised model (``from_pretrained``: the hyper-connections are made on its
    device) and on one built under ``record_module_init`` (they are recorded like its other
    modules, and ``parallelize`` or ``build_recorded_module`` makes them real, from ``seed`` by name).
    A Hugging Face model's ``save_pretrained`` then writes the hyper-connections beside the base
    model (``lightning_mhc.load_pretrained`` reads both).
    """
    if isinstance(num_residual_streams, HyperConnectionSettings):
        given = {k: v for k, v in dict(seed=seed, init_gating_factor=init_gating_factor,
                                       implementation=implementation).items() if v != _SETTING_DEFAULTS[k]}
        if given:
            raise ConfigError(f"add_hyper_connections(..., {', '.join(f'{k}={v!r}' for k, v in given.items())}) with "
                              "a HyperConnectionSettings: give them in the settings instead.")
        settings = num_residual_streams
    else:
        settings = HyperConnectionSettings(num_residual_streams, seed, init_gating_factor, implementation)
    if getattr(model, "hyper_connection_settings", None) is not None:
        raise ConfigError(f"{type(model).__name__} has hyper-connections already "
                          f"({model.hyper_connection_settings.num_residual_streams} streams); add them once.")
    if not settings.enabled:
        if not (isinstance(plan, str) and plan == "auto"):  # a plan given is checked even where it adds nothing
            plan = resolve_hc_plan(plan, model)
            parts = find_parts(model, plan.blocks)
            for index, block in enumerate(parts.blocks):
                _check_block(parts.block_name(index), block, plan)
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
    for index, block in enumerate(parts.blocks):
        name = parts.block_name(index)
        wiring = _BlockWiring(name, plan, hidden, settings, first=index == 0, last=index == count - 1)
        _wire_block(block, wiring, _make_hyper_connections(block, name, plan, config, settings.seed, meta))
    holder = model.get_submodule(parts.block_path.rpartition(".")[0])
    wrap(holder, "hyper_connection_streams_mean",
         functools.partial(_streams_mean_in_hidden_states, settings.num_residual_streams, hidden))
    model.hyper_connection_settings = settings
    model.hyper_connection_plan = plan
    if callable(getattr(model, "save_pretrained", None)):
        wrap(model, "save_with_hyper_connections", _save_with_hyper_connections)
    return model


def apply_hyper_connections(model: nn.Module, hyper_connections: int | HyperConnectionSettings | None,
                            plan: str | HyperConnectionPlan | Mapping[str, Any], seed: int) -> int:
    """The hyper-connection pass of ``parallelize``: ``hyper_connections`` added to the recorded
    model before it is split (None: as the model is; a model ``add_hyper_connections`` rewired
    already keeps its own). Returns the model's residual streams (1 without hyper-connections)."""
    if hyper_connections is not None:
        add_hyper_connections(model, HyperConnectionSettings.of(hyper_connections, seed), plan)
    return hyper_connection_streams(model)


def hyper_connection_streams(model: nn.Module) -> int:
    """The residual streams of ``model``: ``n`` with hyper-connections, else 1."""
    settings = getattr(model, "hyper_connection_settings", None)
    return settings.num_residual_streams if settings is not None else 1


def check_stream_count(hyper_connections: int | HyperConnectionSettings | None) -> None:
    """``parallelize(hyper_connections=...)`` named as the caller wrote it (checked before anything
    else, a layout included)."""
    n = hyper_connections
    if n is None or isinstance(n, HyperConnectionSettings):
        return
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"parallelize(hyper_connections={n!r}): the number of residual streams, n >= 1 (1 or None: "
                          "no hyper-connections); use a positive integer such as 4.")


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


def _make_hyper_connections(block: nn.Module, name: str, plan: HyperConnectionPlan, config: HyperConnectionConfig,
                            seed: int, meta: bool) -> nn.ModuleList:
    """One ``HyperConnectionModule`` per branch, as ``<block>.hyper_connections.<i>``: on a recorded
    (meta) model, recorded like its modules (``parallelize`` makes them real by name); else real,
    on the block's device."""
    init = ParamInit(seed, f"{name}.{HYPER_CONNECTIONS}")
    with record_module_init() if meta else contextlib.nullcontext():
        modules = nn.ModuleList(HyperConnectionModule(config, init.child(str(i))) for i in range(len(plan.branches)))
    for module in modules:
        assign_roles(module, initialises_itself=True)  # by name: a model's own init function must not redraw them
    return modules if meta else modules.to(next(block.parameters()).device)


def _wire_block(block: nn.Module, wiring: _BlockWiring, hyper_connections: nn.ModuleList) -> None:
    """The block's and its entries' classes swapped for their hyper-connected ones, its exits
    hooked; every hook is a module-level function of plain values, so copies and pickles of the
    model carry them and find their own block's streams."""
    setattr(block, HYPER_CONNECTIONS, hyper_connections)
    block.hyper_connection_wiring = wiring
    for index, branch in enumerate(wiring.plan.branches):
        entry = block.get_submodule(branch.entry)
        wrap(entry, "hyper_connected_entry", _hyper_connected_class(type(entry), "entry"))
        entry.hyper_connection_branch = index
        wrap(block.get_submodule(branch.exit), "hyper_connection_exit", functools.partial(_exit_hook, index))
    wrap(block, "hyper_connected_block", _hyper_connected_class(type(block), "block"))


def _save_with_hyper_connections(model: nn.Module, _inner) -> SavePretrainedWithHyperConnections:
    """The model's ``save_pretrained`` once hyper-connected (a module-level function: a pickled
    model's wrapper record names it)."""
    return SavePretrainedWithHyperConnections(model)


def _exit_hook(index: int, module: nn.Module, args: tuple, output: Any):
    """After the exit: the streams become ``H_res x + H_post^T F``; the exit returns a zero, which
    the block's own residual add adds to its one-wide view (a result nothing reads)."""
    call = _current_call(module, "exit")
    wiring = call.wiring
    branch = wiring.plan.branches[index]
    if index not in call.pending:
        raise RuntimeError(f"{wiring.name}.{branch.exit} ran before its entry {branch.entry}: the plan's branches "
                           "must name the modules in the order the block runs them")
    h_res, h_post = call.pending.pop(index)
    block = call.block
    out = output if isinstance(output, Tensor) else output[0]
    current = call.current
    out = out.reshape(*current.shape[:-1], wiring.hidden_size)
    prob = float(getattr(block, branch.dropout)) if branch.dropout is not None else 0.0
    implementation = block.get_submodule(HYPER_CONNECTIONS)[index].config.implementation
    add = functools.partial(h_res_h_post_bias_dropout_add, prob=prob, training=block.training,
                            implementation=implementation, sequence_parallel=wiring.sequence_parallel)
    last = index == len(wiring.plan.branches) - 1
    if call.manager is not None and not (last and call.last_in_group):
        ckpt = CheckpointWithoutOutput(ckpt_manager=call.manager, name=f"{wiring.name}.{branch.exit}+h_res_h_post")
        call.current = ckpt.checkpoint(lambda o, x, r, p: add((o, None), x, r, p), out, current, h_res, h_post)
    else:  # no block recompute, or the group's last output: the manager's hook tensor
        call.current = add((out, None), current, h_res, h_post)
    call.ran += 1
    zero = out.new_zeros(())
    return zero if isinstance(output, Tensor) else (zero, *output[1:])


def _block_output(call: _BlockCall, output: Any):
    """The block's output: the streams after its branches (contracted by their mean after the
    last block); the end of a recompute group hands its output to the manager."""
    wiring = call.wiring
    if call.ran != len(wiring.plan.branches) or call.pending:
        raise RuntimeError(f"{wiring.name} ran {call.ran} of the {len(wiring.plan.branches)} branches of its "
                           "hyper-connection plan: each branch's entry and exit must run once per forward")
    result = call.current
    if call.observer is not None:  # a StreamDivergenceMonitor's: the streams before the last block's mean
        call.observer(wiring.name, result)
    if call.group is not None and call.last_in_group:
        call.group.finish(result)
    if wiring.last:
        result = HyperConnectionModule.output_contract(result, wiring.n)
    return result if isinstance(output, Tensor) else (result, *output[1:])


def _streams_mean_in_hidden_states(n: int, hidden_size: int, module: nn.Module, args: tuple, output: Any):
    """``output_hidden_states=True``: Hugging Face collects each block's output, here the ``n``
    streams (``[..., n*C]``); the user gets their mean (``[..., C]``, what the last block hands to
    the final norm), the unmodified model's shape and, at step 0, its value. In a ModelOutput by
    its key; in the tuple of ``return_dict=False`` (the base model called on its own) the one
    tuple holding tensors of both widths (the embedding's ``C`` and the streams' ``n*C``: no
    other output holds both)."""
    wide = n * hidden_size

    def widths(states: Any) -> set[int] | None:
        if not isinstance(states, tuple) or not all(h is None or isinstance(h, Tensor) for h in states):
            return None
        return {h.shape[-1] for h in states if h is not None}

    def contracted(states: tuple) -> tuple:
        return tuple(HyperConnectionModule.output_contract(h, n) if h is not None and h.shape[-1] == wide else h
                     for h in states)

    if isinstance(output, Tensor):
        return None
    if isinstance(output, Mapping):
        if wide in (widths(output.get("hidden_states")) or ()):
            output["hidden_states"] = contracted(output["hidden_states"])
            return output
        return None
    if isinstance(output, tuple) and any(widths(item) == {hidden_size, wide} for item in output):
        return tuple(contracted(item) if widths(item) == {hidden_size, wide} else item for item in output)
    return None


def hyper_connection_modules(model: nn.Module) -> list[str]:
    """The name endings of ``model``'s hyper-connection modules, ``hyper_connections.<branch>``
    (one per branch of its plan): what PEFT's ``modules_to_save`` takes, which matches module
    names by their ending, so that the hyper-connections train beside the adapters and are saved
    with them (``LoraConfig(..., modules_to_save=hyper_connection_modules(model))``). PEFT wraps
    each hyper-connection; the block's own container, a ``ModuleList``, it refuses to wrap."""
    plan = getattr(model, "hyper_connection_plan", None)
    if getattr(model, "hyper_connection_settings", None) is None or plan is None:
        raise ConfigError(f"{type(model).__name__} has no hyper-connections: call add_hyper_connections(model, n) "
                          "first (n >= 2), then hyper_connection_modules(model).")
    return [f"{HYPER_CONNECTIONS}.{index}" for index in range(len(plan.branches))]


def hyper_connection_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of ``model`` that carry hyper-connections, in order."""
    return [m for m in model.modules() if hasattr(m, "hyper_connection_wiring")]


__all__ = ["Branch", "HyperConnectionPlan", "HyperConnectionSettings", "add_hyper_connections",
           "hyper_connection_blocks", "hyper_connection_modules"]


def wire_sequence_parallel(block: nn.Module) -> None:
    """A hyper-connected ``block`` run on this rank's part of the sequence (sequence parallelism):
    its wiring says so (the tensor-parallel pass calls it on every block it splits so)."""
    wiring = getattr(block, "hyper_connection_wiring", None)
    if wiring is not None:
        block.hyper_connection_wiring = dataclasses.replace(wiring, sequence_parallel=True)
