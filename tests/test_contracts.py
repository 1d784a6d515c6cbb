"""The contracts between rooms as types: each parameter's placement over the ranks is one record
(``ParameterPlacement``) that ``distributed/placement.py`` alone reads and writes, and the roles one
room gives a module for another to read are one record (``ModuleRoles``) that ``roles.py`` alone
reads and writes. A source scan holds every other file of the package to them (as test_rooms does
for imports); the placement reads what megatron-core's layers write, both records round-trip
through ``copy`` and ``pickle`` and stay with their parameter or module through a pipeline split.
One process, no group."""
from __future__ import annotations

import ast
import copy
import dataclasses
import pathlib
import pickle
import sys

import pytest
import torch

from lightning_mhc.distributed.placement import REPLICATED, ParameterPlacement, mark_replicated, place, placement_of
from lightning_mhc.roles import NO_ROLES, ModuleRoles, assign_roles, roles_of

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


def test_only_the_placement_module_names_the_placement_attributes():
    files = [p for p in sorted(PACKAGE.rglob("*.py")) if p != PLACEMENT_MODULE]
    found = [use for path in files for use in attribute_uses(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, "read or write a parameter's placement through distributed/placement.py " \
                      "(placement_of, place):\n" + "\n".join(found)


def test_only_the_roles_module_keeps_a_modules_roles():
    files = [p for p in sorted(PACKAGE.rglob("*.py")) if p != ROLES_MODULE]
    found = [use for path in files
             for use in attribute_uses(path.read_text(), str(path.relative_to(ROOT)), MODULE_ROLES, ())]
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
    handles = attach_block_recompute(layers, [(0, 2), (2, 5)], lambda first, last: "g")
    groups = [roles_of(layer).recompute_group for layer in layers]
    assert groups[0] is groups[1] and groups[2] is groups[3] is groups[4] and groups[1] is not groups[2]
    assert [roles_of(layer).last_in_recompute_group for layer in layers] == [False, True, False, False, True]
    detach_block_recompute(layers, handles)
    assert all(roles_of(layer) == NO_ROLES for layer in layers)
