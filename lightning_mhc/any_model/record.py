"""Build a model on the meta device with its constructor arguments recorded, and give parts of it
real tensors later.

``record_module_init()`` is a context in which every ``nn.Module`` is constructed on the meta
device (no weights allocated) and remembers the arguments it was constructed with
(``_init_args`` / ``_init_kwargs``). :class:`Materializer` then gives a module real tensors by
constructing it again from those arguments, on the CPU, under a generator seeded by ``(seed, the
module's name)``, and applies the model's own init function (Hugging Face's ``_init_weights``)
the same way, children before parents. A tensor's initial value therefore depends only on the
seed and its module's name: every rank of every TP/PP layout that holds it draws the same values
(megatron's CPU initialisation keeps the shard of such a "master" tensor), and so does the whole
model materialised in one process.
"""
from __future__ import annotations

import contextlib
import functools
import json
import re
from itertools import chain
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from lightning_mhc.errors import ConfigError
from lightning_mhc.layers.init import stable_seed
from lightning_mhc.roles import roles_of

InitFn = Callable[[nn.Module], None]


def _all_module_classes() -> list[type]:
    seen, stack = {nn.Module}, [nn.Module]
    while stack:
        for sub in stack.pop().__subclasses__():
            if sub not in seen:
                seen.add(sub)
                stack.append(sub)
    return list(seen)


@contextlib.contextmanager
def record_module_init() -> Iterator[None]:
    """Construct modules on the meta device and record their constructor arguments.

        with record_module_init():
            model = GPT2LMHeadModel(GPT2Config(n_layer=4))   # nothing allocated
        model = parallelize(model, plan="gpt2", layout=layout)   # each rank builds its part

    The arguments a module was called with are kept on it (the outermost constructor's, when
    constructors call their parents'); they must not be changed afterwards. Tensors a
    constructor creates on another device explicitly are moved to the meta device.

    Each module is later made again from its own arguments, so what a constructor does to its
    children's weights after building them (``nn.init.zeros_(self.head.weight)``, a scaled init
    of some projections, ``self.apply(init)``) is not replayed: put such initialisation in the
    ``init_fn`` given to ``parallelize`` (per module; Hugging Face models' ``_init_weights`` is
    the default)."""
    patched: dict[type, Any] = {}
    recorders: dict[type, Any] = {}
    recording = [True]  # False once the context ends: see the restore below

    def patch(cls: type) -> None:
        init = cls.__dict__.get("__init__")
        if init is None or cls in patched:
            return

        @functools.wraps(init)
        def recording_init(module, *args, **kwargs):
            init(module, *args, **kwargs)
            if not recording[0]:
                return
            # parents' constructors finish first: the outermost (the class called) records last
            module._init_args, module._init_kwargs = args, kwargs
            for store in (module._parameters, module._buffers):
                for name, tensor in store.items():
                    if tensor is not None and tensor.device.type != "meta":
                        store[name] = _to_meta(tensor)

        patched[cls] = init
        cls.__init__ = recording_init
        recorders[cls] = recording_init

    had_hook = "__init_subclass__" in nn.Module.__dict__
    old_hook = nn.Module.__dict__.get("__init_subclass__")

    def init_subclass(cls, **kwargs):  # classes defined inside the context record too
        super(nn.Module, cls).__init_subclass__(**kwargs)
        patch(cls)

    for cls in _all_module_classes():
        patch(cls)
    nn.Module.__init_subclass__ = classmethod(init_subclass)
    try:
        with torch.device("meta"):
            yield
    finally:
        recording[0] = False
        for cls, init in patched.items():
            # a class defined inside the context (a lazily imported model) may have had its
            # __init__ wrapped again after we patched it (transformers' @use_experts_implementation
            # wraps it to set self.config): putting the raw init back would drop that wrapper, so
            # such a class keeps its wrapper, whose recording_init now only calls the raw init
            if cls.__dict__.get("__init__") is recorders[cls]:
                cls.__init__ = init
        if had_hook:
            nn.Module.__init_subclass__ = old_hook
        else:
            del nn.Module.__init_subclass__


def _to_meta(tensor: torch.Tensor) -> torch.Tensor:
    meta = tensor.to("meta")
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(meta, requires_grad=tensor.requires_grad)
    return meta


def is_meta(module: nn.Module) -> bool:
    return any(t.device.type == "meta" for t in chain(module.parameters(), module.buffers()))


def check_recorded(model: nn.Module) -> None:
    """A model ``parallelize`` can take: recorded on the meta device."""
    if not is_meta(model):
        raise ConfigError(f"parallelize() takes a model built on the meta device with its constructor arguments "
                          f"recorded: construct {type(model).__name__} inside `with record_module_init():`.")


@contextlib.contextmanager
def seeded(seed: int, key: str) -> Iterator[None]:
    """The default CPU generator seeded by ``(seed, key)`` for a block, then put back."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(stable_seed(seed, key))
        yield


PEFT_WRAPPERS = re.compile(r"\.(base_layer|original_module|modules_to_save\.[^.]+)(?=\.|$)")
"""The names PEFT inserts between a module and its parent (a LoRA layer's ``base_layer``, the
frozen ``original_module`` and the trained copies of ``modules_to_save``)."""


def drawn_name(name: str) -> str:
    """The name a module's tensors are drawn by: its name in the model as written, without PEFT's
    wrappers (:data:`PEFT_WRAPPERS`), so that PEFT injected into a recorded model leaves the base
    weights as they were, and a ``modules_to_save`` copy starts equal to its original."""
    return PEFT_WRAPPERS.sub("", name)


def post_order(module: nn.Module, name: str) -> Iterator[tuple[str, nn.Module]]:
    """``(name, module)`` children before parents (``Module.apply``'s order)."""
    for child_name, child in module.named_children():
        yield from post_order(child, f"{name}.{child_name}" if name else child_name)
    yield name, module


class Materializer:
    """Gives the modules of a recorded meta model real tensors, one subtree at a time.

    ``init_fn`` is the model's own init function applied per module (default: the root's
    ``_init_weights``, as Hugging Face models have); without one, a module's weights are what its
    constructor draws. A tensor shared by several modules (tied embeddings) belongs to the first
    module that holds it in ``named_modules`` order (its *owner*); every holder gets the owner's
    values, and an ``init_fn`` call on another holder does not change them.
    """

    def __init__(self, root: nn.Module, seed: int, init_fn: InitFn | None = None,
                 loaded: set[int] | None = None) -> None:
        self.seed = seed
        self.init_fn = init_fn if init_fn is not None else getattr(root, "_init_weights", None)
        self.loaded = loaded or set()
        """``id`` of the meta tensors pretrained weights fill afterwards: allocated, never drawn, so
        that a tensor split over TP never has its whole pages touched (only its slice is copied)."""
        self.owners: dict[int, tuple[str, nn.Module, str]] = {}
        """``id(meta tensor) -> (owner module's name, owner, attribute)``."""
        for name, module in root.named_modules(remove_duplicate=False):
            for attr, tensor in chain(module._parameters.items(), module._buffers.items()):
                if tensor is not None and id(tensor) not in self.owners:
                    self.owners[id(tensor)] = (name, module, attr)
        self.real: dict[int, torch.Tensor] = {}
        """``id(meta tensor) -> the real tensor that replaced it`` (see :meth:`replace`)."""
        self._meta_of: dict[int, int] = {}

    def replace(self, meta_id: int, real: torch.Tensor) -> None:
        """``real`` now stands for the meta tensor ``meta_id`` (every holder materialised later gets it)."""
        old = self.real.get(meta_id)
        if old is not None:
            self._meta_of.pop(id(old), None)
        self.real[meta_id] = real
        self._meta_of[id(real)] = meta_id

    def meta_id(self, real: torch.Tensor) -> int | None:
        """The meta tensor a real one replaced (None for a tensor not made here)."""
        return self._meta_of.get(id(real))

    def owner_name(self, tensor: torch.Tensor) -> str:
        """The tensor's name in the whole model: its owner's (one name for tied tensors)."""
        name, _, attr = self.owners[id(tensor)]
        return f"{name}.{attr}" if name else attr

    def aliases(self, model: nn.Module) -> dict[str, str]:
        """State-dict name -> its tensor's owner's name, for the names of ``model``'s tensors owned
        under another name (tied): ``ParallelModel.global_parameter_name``."""
        return {name: self.owner_name(t)
                for name, t in list(model.named_parameters(remove_duplicate=False))
                + list(model.named_buffers(remove_duplicate=False))
                if self.owner_name(t) != name}

    def materialize(self, name: str, module: nn.Module) -> None:
        """Real tensors for ``module`` (named ``name`` in the root) and its whole subtree, each
        drawn by the module's name in the model as written (:func:`drawn_name`)."""
        for sub_name, sub in module.named_modules(prefix=name):
            self._fill(drawn_name(sub_name), sub)
        if self.init_fn is not None:
            for sub_name, sub in post_order(module, name):
                if self._only_loaded(sub) or roles_of(sub).initialises_itself:
                    continue  # (a module whose constructor draws its tensors by name: hyper-connections)
                with seeded(self.seed, drawn_name(sub_name) + "#init"), self._holding_only_own(sub):
                    self.init_fn(sub)

    # ------------------------------------------------------------------ internals
    def _fill(self, name: str, module: nn.Module) -> None:
        fresh: nn.Module | None = None
        for store in (module._parameters, module._buffers):
            for attr, tensor in list(store.items()):
                if tensor is None or tensor.device.type != "meta":
                    continue
                key = id(tensor)
                if key in self.real:
                    store[attr] = self.real[key]
                    continue
                owner_name, owner, owner_attr = self.owners[key]
                if key in self.loaded:  # pretrained weights will fill it
                    value = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
                elif owner is module:
                    fresh = fresh if fresh is not None else self._rebuild(name, module)
                    value = _own_tensor(fresh, attr, name)
                else:  # held here, owned elsewhere (a tied weight whose owner is not on this rank)
                    value = self._detached_value(owner_name, owner, owner_attr)
                real = _like(tensor, value)
                self.replace(key, real)
                store[attr] = real
        plain = [attr for attr, value in vars(module).items()
                 if isinstance(value, torch.Tensor) and value.device.type == "meta"]
        if plain:  # tensors the constructor stored as plain attributes (not parameters or buffers)
            fresh = fresh if fresh is not None else self._rebuild(name, module)
            for attr in plain:
                value = vars(fresh).get(attr)
                if not isinstance(value, torch.Tensor) or value.device.type == "meta":
                    raise ConfigError(
                        f"{name}.{attr} is a tensor attribute that is not a parameter or buffer and cannot be made "
                        f"again from {type(module).__name__}'s recorded arguments: register it in the constructor "
                        f"with self.register_buffer({attr!r}, ..., persistent=False).")
                module.__dict__[attr] = value

    def _rebuild(self, name: str, module: nn.Module) -> nn.Module:
        """``module`` constructed again from its recorded arguments, on the CPU, seeded by name."""
        if not hasattr(module, "_init_args"):
            raise ConfigError(
                f"{name or 'the model'} ({type(module).__name__}) was not constructed under record_module_init(): "
                "construct the whole model inside `with record_module_init():` and pass it to parallelize().")
        args, kwargs = module._init_args, module._init_kwargs
        leaves, _ = tree_flatten((args, kwargs))
        with seeded(self.seed, name + "#build"), torch.device("cpu"):
            if not any(isinstance(x, (nn.Module, torch.Tensor)) for x in leaves):
                return type(module)(*args, **kwargs)
            # constructed from modules or tensors: its own reset instead of a second construction
            if not callable(getattr(module, "reset_parameters", None)):
                raise ConfigError(
                    f"{name} ({type(module).__name__}) was constructed from modules or tensors, so it cannot be "
                    "constructed again to materialise it, and it has no reset_parameters(): give it one, or "
                    "construct it from plain arguments.")
            fresh = module.to_empty(device="cpu", recurse=False)
            fresh.reset_parameters()
            return fresh

    def _detached_value(self, name: str, owner: nn.Module, attr: str) -> torch.Tensor:
        """The value an owner's tensor gets, without keeping the owner (not on this rank)."""
        fresh = self._rebuild(name, owner)
        if self.init_fn is not None:
            for sub_name, sub in post_order(fresh, name):
                with seeded(self.seed, sub_name + "#init"):
                    self.init_fn(sub)
        return _own_tensor(fresh, attr, name)

    def _only_loaded(self, module: nn.Module) -> bool:
        """Every tensor ``module`` holds itself will be filled by pretrained weights (then its
        init is skipped; the weights are loaded after the build, so nothing is lost either way)."""
        held = [t for store in (module._parameters, module._buffers) for t in store.values() if t is not None]
        return bool(self.loaded) and all(self.meta_id(t) in self.loaded for t in held)

    @contextlib.contextmanager
    def _holding_only_own(self, module: nn.Module) -> Iterator[None]:
        """Hide the tied tensors ``module`` holds but does not own from ``init_fn``."""
        hidden = []
        for store in (module._parameters, module._buffers):
            for attr, tensor in store.items():
                owner = self.owners.get(self.meta_id(tensor)) if tensor is not None else None
                if owner is not None and owner[1] is not module:
                    hidden.append((store, attr, tensor))
                    store[attr] = _like(tensor, torch.empty_like(tensor))
        try:
            yield
        finally:
            for store, attr, tensor in hidden:
                store[attr] = tensor


def _own_tensor(module: nn.Module, attr: str, name: str) -> torch.Tensor:
    value = module._parameters.get(attr, module._buffers.get(attr))
    if value is None:
        raise ConfigError(
            f"{name}.{attr} is not created by {type(module).__name__}'s constructor (another module assigned "
            "it), so it cannot be materialised from the recorded arguments: create it in the constructor.")
    return value


def _like(meta: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` as a tensor of ``meta``'s kind: a Parameter (same requires_grad) or a buffer, in
    ``meta``'s dtype."""
    value = value.detach().to(meta.dtype)
    if isinstance(meta, nn.Parameter):
        return nn.Parameter(value, requires_grad=meta.requires_grad)
    return value


def hf_config(model_dir: str | Path):
    """The ``transformers`` config of a directory (or of its ``config.json``), refused in one line
    when there is none."""
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ConfigError("a Hugging Face model needs transformers: pip install 'lightning-mhc[hf]'.") from None
    path = Path(model_dir)
    directory = path.parent if path.name == "config.json" else path
    if not (directory / "config.json").is_file():
        raise ConfigError(f"{model_dir}: no config.json there (a directory written by save_pretrained holds one).")
    from lightning_mhc.any_model.families import check_transformers_ships  # (the families' room imports this one)

    check_transformers_ships(json.loads((directory / "config.json").read_text()).get("model_type"))
    return AutoConfig.from_pretrained(directory)


def recorded_hf_model(model_dir: str | Path) -> nn.Module:
    """The model of ``model_dir``'s config on the meta device (``record_module_init``), in fp32."""
    from transformers import AutoModelForCausalLM

    config = hf_config(model_dir)
    with record_module_init():
        return AutoModelForCausalLM.from_config(config, dtype="float32")
