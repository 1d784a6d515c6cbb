"""The contracts between rooms as types: each parameter's placement over the ranks is one record
(``ParameterPlacement``) that ``distributed/placement.py`` alone reads and writes, and the roles one
room gives a module for another to read are one record (``ModuleRoles``) that ``roles.py`` alone
reads and writes. A source scan holds every other file of the package to them (as test_rooms does
for imports); the placement reads what megatron-core's layers write, both records round-trip
through ``copy`` and ``pickle`` and stay with their parameter or module through a pipeline split.
Modules are wrapped through one mechanism (``wrapping.py``): the scan holds every other file to it
(but the sites its docstring lists as not yet moved), and it keeps its declared order, refuses a
second wrapper of one name and takes them all off again. One process, no group."""
from __future__ import annotations

import ast
import copy
import dataclasses
import pathlib
import pickle
import sys

import pytest
import torch

from lightning_mhc.errors import ConfigError
from lightning_mhc.distributed.placement import REPLICATED, ParameterPlacement, mark_replicated, place, placement_of
from lightning_mhc.roles import NO_ROLES, ModuleRoles, assign_roles, roles_of
from lightning_mhc.wrapping import DECLARED, unwrap, unwrap_tree, wrap, wrappers_of

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_mhc"
PLACEMENT_MODULE = PACKAGE / "distributed" / "placement.py"
ROLES_MODULE = PACKAGE / "roles.py"

PARAMETER_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "allreduce",
                        "partial_over_tp", "shared_embedding", "sequence_parallel")
"""The attributes a parameter's placement is kept in (megatron's and ours): only the placement
module names them."""
NOT_RECORD_FIELDS = ("tensor_model_parallel", "partition_dim", "partition_stride", "allreduce")
"""Of those, the ones no record field shares a name with: reading one as ``x.name`` is reading the
attribute itself."""
MODULE_ROLES = ("recompute_group", "is_last_layer_in_block", "hyper_connection_observer", "tensor_parallel_placement",
                "adapters_placed", "initialises_itself")
"""The names modules' roles were kept under as attributes before the record: only ``roles.py``
(which keeps the record whole) may touch a module's own attribute of that name."""
SETTINGS_OBJECTS = ("layout", "config", "cfg", "settings")
"""Objects whose own fields share a name with an attribute (``layout.sequence_parallel``)."""


def _object_text(node: ast.AST) -> str:
    return ast.unparse(node).lower()


def attribute_uses(source: str, label: str, names=PARAMETER_ATTRIBUTES, not_fields=NOT_RECORD_FIELDS) -> list[str]:
    """Where ``path`` reads or writes a placement attribute itself: ``getattr``/``hasattr``/
    ``setattr``/``delattr`` or ``.get``/``[...]`` with the name as a string (not on a settings object),
    ``x.name = ...`` on anything but ``self`` (a class's own field), and ``x.name`` read where no
    record field has the name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        where = f"{label}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            if isinstance(func, ast.Name) and func.id in ("getattr", "hasattr", "setattr", "delattr") \
                    and len(node.args) > 1:
                target, name = node.args[0], node.args[1]
            elif isinstance(func, ast.Attribute) and func.attr in ("get", "pop", "setdefault"):
                target, name = func.value, node.args[0]
            else:
                continue
            if isinstance(name, ast.Constant) and name.value in names \
                    and not any(word in _object_text(target) for word in SETTINGS_OBJECTS):
                found.append(f"{where}: {ast.unparse(node)}")
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) \
                and node.slice.value in names and "__dict__" in _object_text(node.value):
            found.append(f"{where}: {ast.unparse(node)}")
        elif isinstance(node, ast.Attribute) and node.attr in names:
            owner = _object_text(node.value)
            if isinstance(node.ctx, ast.Store) and owner != "self":
                found.append(f"{where}: {ast.unparse(node)} = ...")
            elif isinstance(node.ctx, ast.Load) and node.attr in not_fields \
                    and not any(word in owner for word in SETTINGS_OBJECTS):
                found.append(f"{where}: {ast.unparse(node)}")
    return found


def uses_outside(kept_in: pathlib.Path, scan) -> list[str]:
    """What ``scan(source, label)`` finds in every file of the package but ``kept_in``, the one
    module a rule is kept in."""
    return [use for path in sorted(PACKAGE.rglob("*.py")) if path != kept_in
            for use in scan(path.read_text(), str(path.relative_to(ROOT)))]


def test_only_the_placement_module_names_the_placement_attributes():
    found = uses_outside(PLACEMENT_MODULE, attribute_uses)
    assert not found, "read or write a parameter's placement through distributed/placement.py " \
                      "(placement_of, place):\n" + "\n".join(found)


def test_only_the_roles_module_keeps_a_modules_roles():
    found = uses_outside(ROLES_MODULE, lambda source, label: attribute_uses(source, label, MODULE_ROLES, ()))
    assert not found, "read or write a module's roles through lightning_mhc/roles.py (roles_of, assign_roles):\n" \
                      + "\n".join(found)



@pytest.mark.parametrize("line", [
    'x = getattr(param, "allreduce", True)',
    'param.partial_over_tp = True',
    'x = param.partition_dim',
    'x = p.__dict__.get("shared_embedding")',
    'x = hasattr(p, "tensor_model_parallel")',
    'p.sequence_parallel = True',
])
def test_the_scan_finds_a_direct_use(line):
    """What the scan is for: each way of touching an attribute directly is caught."""
    assert len(attribute_uses(line, "probe")) == 1


@pytest.mark.parametrize("line", [
    'block.hyper_connection_observer = f',
    'g = block.__dict__.get("recompute_group")',
    'x = getattr(base, "tensor_parallel_placement", None)',
])
def test_the_scan_finds_a_role_kept_as_an_attribute(line):
    assert len(attribute_uses(line, "probe", MODULE_ROLES, ())) == 1


def test_settings_fields_of_the_same_name_are_not_placements():
    assert attribute_uses('x = getattr(layout, "sequence_parallel", False)\nself.sequence_parallel = True\n'
                          'y = placement.shared_embedding\nz = config.sequence_parallel\n', "probe") == []


# ---------------------------------------------------------------- the record
PLACEMENTS = [
    ParameterPlacement(),
    REPLICATED,
    ParameterPlacement(placed=True, split_dim=0, stride=3),
    ParameterPlacement(placed=True, split_dim=1),
    ParameterPlacement(placed=True, partial_over_tp=True),
    ParameterPlacement(placed=True, sequence_parallel=True, shared_embedding=True),
    ParameterPlacement(expert=True),
    ParameterPlacement(placed=True, split_dim=0, expert=True),
]


@pytest.mark.parametrize("placement", PLACEMENTS, ids=repr)
def test_a_placement_written_is_the_one_read(placement):
    param = torch.nn.Parameter(torch.zeros(6, 4))
    assert placement_of(param) == ParameterPlacement()
    assert place(param, placement) == placement
    assert placement_of(param) == placement
    assert copy.deepcopy(placement) == placement and pickle.loads(pickle.dumps(placement)) == placement
    # torch's deepcopy of a Parameter keeps none of its attributes: a copier places the copy again
    twin = copy.deepcopy(param)
    assert placement_of(twin) == ParameterPlacement()
    place(twin, placement_of(param))
    assert placement_of(twin) == placement


def test_a_flag_taken_back_is_read_back():
    param = torch.nn.Parameter(torch.zeros(2))
    place(param, expert=True, shared_embedding=True)
    place(param, expert=False, shared_embedding=False)
    assert placement_of(param) == ParameterPlacement()
    place(param, placed=True, split_dim=0)
    place(param, placed=False, split_dim=None)
    assert placement_of(param) == ParameterPlacement()


def test_the_record_reads_megatrons_layers_and_megatron_reads_ours():
    """megatron-core writes its attributes (its layers call these) and reads them (the gradient
    norm's ``param_is_not_tensor_parallel_duplicate``, the DDP's expert test): the same words."""
    from megatron.core.tensor_parallel.layers import (
        param_is_not_tensor_parallel_duplicate,
        set_defaults_if_not_set_tensor_model_parallel_attributes,
        set_tensor_model_parallel_attributes,
    )

    theirs, whole = torch.nn.Parameter(torch.zeros(4, 4)), torch.nn.Parameter(torch.zeros(4))
    set_tensor_model_parallel_attributes(theirs, True, 1, 2)
    set_defaults_if_not_set_tensor_model_parallel_attributes(whole)
    assert placement_of(theirs) == ParameterPlacement(placed=True, split_dim=1, stride=2)
    assert placement_of(whole) == REPLICATED
    ours = torch.nn.Parameter(torch.zeros(4, 4))
    place(ours, placed=True, split_dim=0, stride=1, expert=True)
    assert param_is_not_tensor_parallel_duplicate(ours)
    assert ours.allreduce is False  # megatron's DistributedDataParallel: an expert's parameter


def test_mark_replicated_marks_only_what_no_builder_placed():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    place(model[0].weight, placed=True, split_dim=0)
    place(model[1].weight, partial_over_tp=True)
    mark_replicated(model)
    assert placement_of(model[0].weight) == ParameterPlacement(placed=True, split_dim=0)
    assert placement_of(model[0].bias) == REPLICATED
    assert placement_of(model[1].weight) == ParameterPlacement(placed=True, partial_over_tp=True)


def test_placements_and_roles_stay_with_their_owners_through_a_pipeline_split():
    """``split_stages`` cuts a recorded model into this rank's chunks: each chunk's parameters are
    the whole model's, with the placement each had, and its modules keep their roles (the passes
    after it read them there)."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(ROOT / "tests" / "scripts"))
    from lm_models import gpt2

    from lightning_mhc.any_model import record_module_init
    from lightning_mhc.any_model.pipeline import plan_stages, split_stages
    from lightning_mhc.distributed.layout import ParallelLayout

    for rank in range(2):
        with record_module_init():
            model = gpt2()
        given = {}
        for index, param in enumerate(model.parameters()):
            given[id(param)] = place(param, PLACEMENTS[index % len(PLACEMENTS)])
        roles = {}
        for index, module in enumerate(model.modules()):
            roles[id(module)] = assign_roles(module, last_in_recompute_group=index % 2 == 0,
                                             initialises_itself=index % 3 == 0)
        layout = ParallelLayout(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                                pipeline_model_parallel_rank=rank)
        split = split_stages(model, plan_stages(model, layout, None, None, (), False), layout, None, 1)
        params = [p for chunk in split.chunks for p in chunk.module.parameters()]
        assert len(split.chunks) == 2 and params
        for param in params:
            assert placement_of(param) == given[id(param)]
        for chunk in split.chunks:
            kept = [m for m in chunk.module.modules() if id(m) in roles]  # skeletons and stubs: the split's
            assert all(roles_of(m) == roles[id(m)] for m in kept)
            assert set(map(id, chunk.blocks.values())) <= set(map(id, kept))


# ---------------------------------------------------------------- module roles
def _observe(name, streams):  # module level: a copy or pickle of a module refers to it by name
    return None


def test_roles_given_are_the_ones_read_and_copies_keep_them():
    layer = torch.nn.Linear(2, 2)
    assert roles_of(layer) == NO_ROLES
    roles = assign_roles(layer, last_in_recompute_group=True, hyper_connection_observer=_observe)
    assert roles == ModuleRoles(last_in_recompute_group=True, hyper_connection_observer=_observe)
    assign_roles(layer, initialises_itself=True)  # the others kept
    expected = dataclasses.replace(roles, initialises_itself=True)
    assert roles_of(layer) == expected
    assert roles_of(copy.deepcopy(layer)) == expected
    assert roles_of(pickle.loads(pickle.dumps(layer))) == expected
    assert dict(layer.named_children()) == {} and "module_roles" not in dict(layer.state_dict())
    assert roles_of(torch.nn.Linear(2, 2)) == NO_ROLES  # given to one module, not to its class


def test_recompute_groups_are_given_and_taken_back_as_roles():
    from lightning_mhc.recompute.groups import attach_block_recompute, detach_block_recompute

    layers = [torch.nn.Linear(2, 2) for _ in range(5)]
    attach_block_recompute(layers, [(0, 2), (2, 5)], lambda first, last: "g")
    groups = [roles_of(layer).recompute_group for layer in layers]
    assert groups[0] is groups[1] and groups[2] is groups[3] is groups[4] and groups[1] is not groups[2]
    assert [roles_of(layer).last_in_recompute_group for layer in layers] == [False, True, False, False, True]
    assert [[w.name for w in wrappers_of(layer)] for layer in layers] == [["block_recompute"], [], ["block_recompute"], [], []]
    detach_block_recompute(layers)
    assert all(roles_of(layer) == NO_ROLES and not wrappers_of(layer) and not layer._forward_pre_hooks
               for layer in layers)


# ---------------------------------------------------------------- one wrapping mechanism
WRAPPING_MODULE = PACKAGE / "wrapping.py"
HOOK_REGISTRATIONS = ("register_forward_pre_hook", "register_forward_hook")
REPLACED_ON_INSTANCES = ("forward", "__class__", "save_pretrained")


def wrapping_by_hand(source: str, label: str) -> list[str]:
    """Where ``source`` wraps a module itself: torch's forward (pre-)hook registration called,
    or a forward, class or ``save_pretrained`` assigned on anything but ``self``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        where = f"{label}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in HOOK_REGISTRATIONS:
            found.append(f"{where}: {ast.unparse(node.func)}(...)")
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and node.attr in REPLACED_ON_INSTANCES and _object_text(node.value) != "self":
            found.append(f"{where}: {ast.unparse(node)} = ...")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) \
                and node.args[1].value in REPLACED_ON_INSTANCES:
            found.append(f"{where}: {ast.unparse(node)}")
    return found


def test_modules_are_wrapped_through_the_wrapping_module_alone():
    new = uses_outside(WRAPPING_MODULE, wrapping_by_hand)
    assert not new, "wrap a module through lightning_mhc/wrapping.py (wrap, a name declared in DECLARED):\n" \
                    + "\n".join(new)


@pytest.mark.parametrize("line", [
    "layer.forward = f",
    "block.__class__ = Other",
    "model.save_pretrained = Saver(model)",
    "m.register_forward_pre_hook(h, with_kwargs=True)",
    "m.register_forward_hook(h)",
    "setattr(m, 'forward', f)",
])
def test_the_scan_finds_a_wrapping_by_hand(line):
    assert len(wrapping_by_hand(line, "probe")) == 1


def test_the_scan_leaves_a_class_its_own_forward():
    assert wrapping_by_hand("self.forward = self._forward\nx = m.forward(y)\n", "probe") == []


def _doubled(_module, args):
    return (args[0] * 2,)


def _plus_one(_module, args):
    return (args[0] + 1,)


def _minus_three(_module, _args, out):
    return out - 3


def _halved(_module, _args, out):
    return out / 2


def _tripled_forward(_module, inner):
    return lambda x: inner(x) * 3


def _plus_one_forward(_module, inner):
    return lambda x: inner(x) + 1


def _declared(kind):
    return [d.name for d in DECLARED if d.kind == kind]


def test_wrappers_run_in_their_declared_order_not_the_order_of_the_calls():
    pre, post = _declared("pre_hook"), _declared("hook")
    method = [d.name for d in DECLARED if d.attr == "forward"]
    x = torch.tensor([[1.0, 2.0]])
    results = []
    for calls in (0, 1):  # the same wrappers put on in the declared order, then in the reverse one
        torch.manual_seed(0)
        layer = torch.nn.Linear(2, 2)
        plain = layer(x)
        puts = [(pre[0], _doubled), (pre[1], _plus_one), (post[0], _minus_three), (post[1], _halved),
                (method[0], _tripled_forward), (method[1], _plus_one_forward)]
        for name, how in (puts if calls == 0 else puts[::-1]):
            wrap(layer, name, how)
        # pre-hooks: double, then add one; the methods: the first declared inside; hooks: -3, then /2
        expected = ((torch.nn.functional.linear(x * 2 + 1, layer.weight, layer.bias) * 3 + 1) - 3) / 2
        torch.testing.assert_close(layer(x), expected, rtol=0, atol=0)
        assert [w.name for w in wrappers_of(layer)] == [name for name, _ in (puts if calls == 0 else puts[::-1])]
        unwrap(layer)
        torch.testing.assert_close(layer(x), plain, rtol=0, atol=0)
        results.append(expected)
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)


def test_a_second_wrapper_of_one_name_is_refused_in_one_line():
    layer = torch.nn.Linear(2, 2)
    wrap(layer, _declared("pre_hook")[0], _doubled)
    with pytest.raises(ConfigError, match="already has the wrapper") as caught:
        wrap(layer, _declared("pre_hook")[0], _plus_one)
    assert "\n" not in str(caught.value) and len(layer._forward_pre_hooks) == 1
    with pytest.raises(ConfigError, match="not declared"):
        wrap(layer, "no_such_wrapper", _doubled)


def _state(module):
    """A module's class and ``__dict__``, its tables (hooks, parameters) copied as they are now."""
    return type(module), {k: dict(v) if isinstance(v, dict) else v for k, v in module.__dict__.items()}


def test_unwrap_leaves_the_module_as_it_was_and_copies_carry_the_wrappers(tmp_path):
    """Every kind on a small Hugging Face model (an attention's class, the model's ``forward``
    and ``save_pretrained``, hooks on a linear and an MLP): a deepcopy and a pickle wrap as it does;
    unwrapped (one owner, then all), its ``__dict__``, hook tables, class, ``state_dict``, logits
    and ``save_pretrained``'s files are the unwrapped model's."""
    from transformers import GPT2Config, GPT2LMHeadModel

    def fresh():
        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8)).eval()

    ids = torch.tensor([[1, 2, 3, 4]])
    plain, model = fresh(), fresh()
    plain.save_pretrained(tmp_path / "plain")
    before = {m: _state(m) for m in model.modules()}
    attn = model.transformer.h[0].attn.c_attn
    swapped = type("MarkedGPT2Attention", (type(model.transformer.h[0].attn),), {})
    wrap(model.transformer.h[0].attn, "hyper_connected_entry", swapped)
    wrap(attn, "column_input", lambda _m, args, kwargs: ((args[0] * 2,), kwargs), with_kwargs=True)
    wrap(model.transformer.h[0].mlp, "sequence_gathered_after_blocks", _halved)
    wrap(model, "random_region", lambda _m, inner: inner)
    wrap(model, "save_with_hyper_connections", lambda m, _inner: (lambda path: "saved elsewhere"))
    wrapped = model(ids).logits
    assert not torch.equal(wrapped, plain(ids).logits)
    torch.testing.assert_close(copy.deepcopy(model)(ids).logits, wrapped, rtol=0, atol=0)
    assert model.save_pretrained(tmp_path / "x") == "saved elsewhere"
    assert [w.owner for w in wrappers_of(model)] == ["tensor_parallel", "hyper_connections"]
    unwrap_tree(model, "hyper_connections")  # one owner's: the class swap and save_pretrained go
    assert type(model.transformer.h[0].attn) is type(plain.transformer.h[0].attn)
    assert "save_pretrained" not in model.__dict__ and [w.owner for w in wrappers_of(model)] == ["tensor_parallel"]
    unwrap_tree(model)
    after = {m: _state(m) for m in model.modules()}
    assert after == before
    torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=0, atol=0)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), plain.state_dict().values()))
    assert list(model.state_dict()) == list(plain.state_dict())
    model.save_pretrained(tmp_path / "unwrapped")
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "unwrapped" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes()
