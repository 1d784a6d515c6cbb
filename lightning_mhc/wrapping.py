"""The one way a pass wraps a module: :func:`wrap` puts a declared wrapper on it, records it on
the module by name with the pass that owns it (:class:`Wrapper`), keeps the module's wrappers of
one kind in the order :data:`DECLARED` gives them (not the order of the calls), refuses a second
wrapper of one name on one module, and :func:`unwrap` (one module) or :func:`unwrap_tree` (a model,
one owner's or all) takes them off, leaving the module as it was before.

Four kinds, as the passes wrap: a ``"class"`` swap (the module's class for a subclass made from
it: hyper-connected blocks and entries), a ``"method"`` replaced on the instance (``forward``, or
``save_pretrained``: ``make(module, inner)`` returns the new one around ``inner``, the one below it
in the declared order, the class's own at the bottom), a ``"pre_hook"`` and a ``"hook"`` (torch's
forward pre-hooks and forward hooks). Hooks run outside the forward and a class's methods under an
instance's own, so the kinds never interleave; within a kind, a wrapper declared earlier runs first
(a hook) or sits inside (a method), whatever the order of the calls. A hook registered straight
with torch is not managed: a later-declared wrapper put on after it moves behind it.

The record of a module's wrappers is one entry of its ``__dict__`` holding plain values (names,
hook ids, the class before the swap, the method's ``make`` and what it wrapped), so
``copy.deepcopy``, pickling and ``state_dict`` of a wrapped model are as before (a ``make`` that
must survive a pickle is a module-level function).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from torch import nn

from lightning_mhc.errors import ConfigError

_ENTRY = "module_wrappers"
"""The one entry of a module's ``__dict__`` its wrappers are recorded in."""


@dataclasses.dataclass(frozen=True)
class Declared:
    """A wrapper a pass may put on a module: its ``name``, the pass that ``owner``s it, its
    ``kind`` (``"class"``, ``"method"``, ``"pre_hook"``, ``"hook"``) and, for a method, the
    ``attr`` it replaces."""

    name: str
    owner: str
    kind: str
    attr: str | None = None


DECLARED: tuple[Declared, ...] = (
    # hyper-connections, added to the recorded model before it is split
    Declared("hyper_connected_block", "hyper_connections", "class"),
    Declared("hyper_connected_entry", "hyper_connections", "class"),
    Declared("hyper_connection_exit", "hyper_connections", "hook"),
    Declared("hyper_connection_streams_mean", "hyper_connections", "hook"),
    Declared("save_with_hyper_connections", "hyper_connections", "method", "save_pretrained"),
    # tensor parallelism: a row linear's forward sums its partial products, a random region runs
    # around whatever forward the module has (so after it: outside)
    Declared("row_parallel_forward", "tensor_parallel", "method", "forward"),
    Declared("random_region", "tensor_parallel", "method", "forward"),
    # a family's own streams: its layers under ``mhc_block``, then the streams carried flat around that
    Declared("native_block_recompute", "native_streams", "method", "forward"),
    Declared("native_flat_streams", "native_streams", "method", "forward"),
    # a family's attention split over CP: its own forward, in place of the one it had (as before
    # the mechanism: a random region on it is not kept)
    Declared("context_parallel_attention", "context_parallel", "method", "forward"),
    # recompute (full or selective), the last pass: around all of the above
    Declared("checkpointed", "recompute", "method", "forward"),
    Declared("column_input", "tensor_parallel", "pre_hook"),
    Declared("column_output", "tensor_parallel", "hook"),
    Declared("vocab_local_ids", "tensor_parallel", "pre_hook"),
    Declared("vocab_rows_summed", "tensor_parallel", "hook"),
    Declared("sequence_gathered", "tensor_parallel", "pre_hook"),
    Declared("sequence_scattered_before_blocks", "tensor_parallel", "pre_hook"),
    Declared("sequence_gathered_after_blocks", "tensor_parallel", "hook"),
    # LoRA's adapters, placed as their base linear was
    Declared("adapter_input", "adapters", "pre_hook"),
    Declared("adapter_output", "adapters", "hook"),
    Declared("adapter_partial_summed", "adapters", "hook"),
    # DeepSeek-V4's own TP (after the plan's): the shared K/V head's attention registered, a hash
    # router's own tokens under sequence parallelism
    Declared("shared_kv_attention", "deepseek_v4", "pre_hook"),
    Declared("hash_routed_own_tokens", "deepseek_v4", "pre_hook"),
    # the pipeline contract, on the built stages: a stage's first block takes what the previous
    # stage sent (after the sequence is scattered), its last one ends it (after it is gathered)
    Declared("stage_input", "pipeline", "pre_hook"),
    Declared("stage_end", "pipeline", "hook"),
    Declared("first_stage_stub", "pipeline", "pre_hook"),
    # block recompute (the last pass): a group's first layer makes the group's manager, after the
    # stage's input is taken
    Declared("block_recompute", "block_recompute", "pre_hook"),
    # the routers' counts, read from what they return (after a hyper-connection exit's hook)
    Declared("router_loss", "router_loss", "hook"),
    Declared("router_bias", "router_bias", "hook"),
    # DeepSeek-V4's hyper-connections on our ops: the module's class for our subclass of it
    Declared("our_ops", "our_ops", "class"),
    # the GPT's stream divergence, read from each layer's output (the n streams) while training
    Declared("stream_divergence", "stream_divergence", "hook"),
)
"""Every wrapper, in the order of each kind: a hook declared earlier runs first, a method declared
earlier sits inside one declared later."""

_RANK = {declared.name: rank for rank, declared in enumerate(DECLARED)}
_BY_NAME = {declared.name: declared for declared in DECLARED}


@dataclasses.dataclass(frozen=True)
class Wrapper:
    """One wrapper on a module, as :func:`wrap` put it: its declaration, and what undoing it
    needs: the hook's id in torch's hook table, the class before the swap, or the method's
    ``make`` and what the module had before the first wrapper of that method (``before``: ``()``
    for the class's own, else ``(value,)``)."""

    declared: Declared
    hook_id: int | None = None
    class_before: type | None = None
    make: Callable | None = None
    before: tuple = ()

    @property
    def name(self) -> str:
        return self.declared.name

    @property
    def owner(self) -> str:
        return self.declared.owner


def wrappers_of(module: nn.Module) -> tuple[Wrapper, ...]:
    """``module``'s wrappers, in the order they were put on."""
    return module.__dict__.get(_ENTRY, ())


def _record(module: nn.Module, wrappers: tuple[Wrapper, ...]) -> None:
    if wrappers:
        module.__dict__[_ENTRY] = wrappers  # not setattr: nn.Module's would look for submodules first
    else:
        module.__dict__.pop(_ENTRY, None)


def wrap(module: nn.Module, name: str, how: Any, *, with_kwargs: bool = False) -> Wrapper:
    """Put the declared wrapper ``name`` on ``module``: ``how`` is the class to swap in, the
    method's ``make(module, inner)``, or the hook (``with_kwargs`` as torch's)."""
    declared = _BY_NAME.get(name)
    if declared is None:
        raise ConfigError(f"wrapper {name!r} is not declared in lightning_mhc.wrapping.DECLARED "
                          f"(declared: {', '.join(_BY_NAME)}).")
    present = wrappers_of(module)
    if any(w.name == name for w in present):
        raise ConfigError(f"{type(module).__name__} already has the wrapper {name!r} (from {declared.owner}): "
                          "a module is wrapped once by each pass; unwrap it first.")
    if declared.kind == "class":
        wrapper = Wrapper(declared, class_before=type(module))
        module.__class__ = how
    elif declared.kind == "method":
        same = [w for w in present if w.declared.attr == declared.attr]
        before = same[0].before if same else \
            ((module.__dict__[declared.attr],) if declared.attr in module.__dict__ else ())
        wrapper = Wrapper(declared, make=how, before=before)
        _compose(module, declared.attr, before, [*same, wrapper])
    else:
        table = _hook_table(module, declared.kind)
        if declared.kind == "pre_hook":
            handle = module.register_forward_pre_hook(how, with_kwargs=with_kwargs)
        else:
            handle = module.register_forward_hook(how, with_kwargs=with_kwargs)
        wrapper = Wrapper(declared, hook_id=handle.id)
        later = sorted((w for w in present if w.declared.kind == declared.kind and _RANK[w.name] > _RANK[name]),
                       key=lambda w: _RANK[w.name])
        for w in later:  # torch runs a table's hooks in its order: the later-declared ones go behind
            table.move_to_end(w.hook_id)
    _record(module, (*present, wrapper))
    return wrapper


def _hook_table(module: nn.Module, kind: str) -> dict:
    return module._forward_pre_hooks if kind == "pre_hook" else module._forward_hooks


def _compose(module: nn.Module, attr: str, before: tuple, wrappers: list[Wrapper]) -> None:
    """``module.<attr>``: ``before`` (or the class's own) inside the ``wrappers``, the first
    declared innermost; with no wrappers, as it was."""
    module.__dict__.pop(attr, None)
    if before:
        module.__dict__[attr] = before[0]
    if not wrappers:
        return
    method = getattr(module, attr)
    for wrapper in sorted(wrappers, key=lambda w: _RANK[w.name]):
        method = wrapper.make(module, method)
    module.__dict__[attr] = method


def unwrap(module: nn.Module, owner: str | None = None) -> None:
    """Take ``owner``'s wrappers (all, with None) off ``module``, last put on first; what remains
    keeps its declared order."""
    present = wrappers_of(module)
    going = [w for w in present if owner is None or w.owner == owner]
    staying = tuple(w for w in present if w not in going)
    for wrapper in reversed(going):
        kind = wrapper.declared.kind
        if kind == "class":
            module.__class__ = wrapper.class_before
        elif kind in ("pre_hook", "hook"):
            _hook_table(module, kind).pop(wrapper.hook_id, None)
            for extra in ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
                          "_forward_hooks_always_called"):  # what torch's handle removes with it
                getattr(module, extra).pop(wrapper.hook_id, None)
    for attr in {w.declared.attr for w in going if w.declared.kind == "method"}:
        same = [w for w in present if w.declared.attr == attr]
        _compose(module, attr, same[0].before, [w for w in staying if w.declared.attr == attr])
    _record(module, staying)


def unwrap_tree(root: nn.Module, owner: str | None = None) -> None:
    """:func:`unwrap` every module of ``root`` (``root`` included)."""
    for module in root.modules():
        unwrap(module, owner)


__all__ = ["DECLARED", "Declared", "Wrapper", "unwrap", "unwrap_tree", "wrap", "wrappers_of"]
