"""Each setting is checked in exactly one function and passed down as a value: a bad value of each
is refused by that function, with that function's message, through every door that takes it (the
CLI, the Trainer, Fabric, ``parallelize``); the rooms import only the rooms below them."""
from __future__ import annotations

import datetime
import pathlib
import re
from typing import Callable

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_mhc import (
    ConfigError,
    MHCGPTModule,
    MHCParallelStrategy,
    MHCRecomputeCallback,
    ParallelLayout,
    RecomputePolicy,
    parallelize,
    record_module_init,
)
from lightning_mhc.fabric import MHCParallelStrategy as FabricStrategy
from lightning_mhc.recompute import policy as policy_module
from lightning_mhc.strategies.settings import ParallelSettings
from train_cli import check_before_launch

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_mhc"
TINY = dict(num_layers=2, hidden_size=32, num_attention_heads=2, ffn_hidden_size=64, vocab_size=64,
            max_sequence_length=8, hidden_dropout=0.0, attention_dropout=0.0)
NO_HYPER_CONNECTIONS = dict(TINY, enable_hyper_connections=False, num_residual_streams=1)


def _meta_model() -> nn.Module:
    with record_module_init():
        return nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 64))


def _trainer_fit(strategy=None, callbacks=(), module=None) -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy or MHCParallelStrategy(), max_steps=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False, callbacks=list(callbacks))
    if module is not None:
        trainer.fit(module)


def _fabric(strategy) -> None:
    Fabric(accelerator="cpu", devices=1, strategy=strategy)


# setting: (the function that holds its rule, {door: the call a user makes there}); a CLI door
# is its overrides. A door that does not take the setting is absent.
SETTINGS: dict[str, tuple[tuple[object, str], dict[str, object]]] = {
    "tensor_model_parallel_size=0": ((ParallelLayout, "_check_degrees"), {
        "cli": ["parallel.tensor_model_parallel_size=0"],
        "trainer": lambda: MHCParallelStrategy(tensor_model_parallel_size=0),
        "fabric": lambda: FabricStrategy(tensor_model_parallel_size=0),
        "parallelize": lambda: parallelize(_meta_model(), layout=ParallelLayout(tensor_model_parallel_size=0)),
    }),
    "a virtual pipeline without PP": ((ParallelLayout, "_check_degrees"), {
        "cli": ["parallel.virtual_pipeline_model_parallel_size=2"],
        "trainer": lambda: MHCParallelStrategy(virtual_pipeline_model_parallel_size=2),
        "fabric": lambda: FabricStrategy(virtual_pipeline_model_parallel_size=2),
        "parallelize": lambda: parallelize(_meta_model(), layout=ParallelLayout(virtual_pipeline_model_parallel_size=2)),
    }),
    "sequence parallelism without TP": ((ParallelLayout, "_check_degrees"), {
        "cli": ["parallel.sequence_parallel=true"],
        "trainer": lambda: MHCParallelStrategy(sequence_parallel=True),
        "fabric": lambda: FabricStrategy(sequence_parallel=True),
        "parallelize": lambda: parallelize(_meta_model(), layout=ParallelLayout(sequence_parallel=True)),
    }),
    "TP 2 in a world of 1": ((ParallelLayout, "_check_world"), {
        "cli": ["parallel=tp2"],
        "trainer": lambda: _trainer_fit(MHCParallelStrategy(tensor_model_parallel_size=2)),
        "fabric": lambda: _fabric(FabricStrategy(tensor_model_parallel_size=2)),
        "parallelize": lambda: parallelize(_meta_model(), layout=ParallelLayout(tensor_model_parallel_size=2)),
    }),
    "3 microbatches on an interleaved PP 2": ((ParallelLayout, "check_microbatches"), {
        "cli": ["parallel=pp2v2", "trainer.devices=2", "model.num_layers=4", "data.global_batch_size=6",
                "data.micro_batch_size=2"],
        "trainer": lambda: MHCParallelStrategy(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                                               num_microbatches=3),
        "fabric": lambda: FabricStrategy(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                                         num_microbatches=3),
    }),
    "a timeout of 0": ((ParallelSettings, "__post_init__"), {
        "cli": ["parallel.timeout_s=0"],
        "trainer": lambda: MHCParallelStrategy(timeout=datetime.timedelta(0)),
        "fabric": lambda: FabricStrategy(timeout=datetime.timedelta(0)),
    }),
    "seed -1": ((ParallelSettings, "__post_init__"), {
        "cli": ["seed=-1"],
        "trainer": lambda: MHCParallelStrategy(seed=-1),
        "fabric": lambda: FabricStrategy(seed=-1),
    }),
    "an unknown recompute policy": ((RecomputePolicy, "__post_init__"), {
        "cli": ["recompute.policy=bogus"],
        "trainer": lambda: MHCRecomputeCallback("bogus"),
        "fabric": lambda: MHCGPTModule(TINY, recompute_policy="bogus"),
        "parallelize": lambda: parallelize(_meta_model(), recompute="bogus"),
    }),
    "mhc_block with recompute_mlp": ((RecomputePolicy, "__post_init__"), {
        "cli": ["recompute=mhc_block", "recompute.recompute_mlp=true"],
        "trainer": lambda: MHCRecomputeCallback("mhc_block", recompute_modules=["layernorm", "mlp"]),
        "fabric": lambda: MHCGPTModule(TINY, recompute_policy=dict(name="mhc_block", modules=["layernorm", "mlp"])),
        "parallelize": lambda: parallelize(_meta_model(), recompute=dict(name="mhc_block", modules=["layernorm", "mlp"])),
    }),
    "mhc_block without hyper-connections": ((policy_module, "_check_hyper_connections"), {
        "cli": ["recompute=mhc_block", "model.enable_hyper_connections=false", "model.num_residual_streams=1"],
        "trainer": lambda: _trainer_fit(callbacks=[MHCRecomputeCallback("mhc_block")],
                                        module=MHCGPTModule(NO_HYPER_CONNECTIONS)),
        "fabric": lambda: MHCGPTModule(NO_HYPER_CONNECTIONS, recompute_policy="mhc_block"),
        "parallelize": lambda: parallelize(_meta_model(), recompute="mhc_block"),
    }),
}


@pytest.fixture
def refusals(monkeypatch):
    """Every rule function of ``SETTINGS`` wrapped: the ConfigErrors it raises are recorded as
    ``(function, error)``."""
    raised: list[tuple[str, ConfigError]] = []

    def spy(owner, name: str) -> None:
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            try:
                return original(*args, **kwargs)
            except ConfigError as error:
                raised.append((name, error))
                raise

        monkeypatch.setattr(owner, name, wrapper)

    for owner, name in {rule for rule, _ in SETTINGS.values()}:
        spy(owner, name)
    return raised


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_a_bad_setting_is_refused_by_its_one_function_through_every_door(setting, refusals, single_rank_group,
                                                                         tmp_path, monkeypatch, capsys):
    from lightning_mhc.cli.preflight import PREFIX
    from lightning_mhc.cli.schema import in_config_keys
    from lightning_mhc.distributed.layout import destroy_parallel

    (_, function), doors = SETTINGS[setting]
    messages = {}
    for door, call in doors.items():
        refusals.clear()
        if door == "cli":
            status, err = check_before_launch(call, tmp_path, monkeypatch, capsys)
            assert status == 2, (door, err)
            printed = err.strip()
        else:
            with pytest.raises(ConfigError) as error:
                call()
            printed = str(error.value)
        destroy_parallel()
        assert refusals, f"{setting} through the {door}: refused by no rule function ({printed})"
        raised_by, raised = refusals[0]  # the innermost: a caller's re-raise is recorded after it
        assert raised_by == function, f"{setting} through the {door}: refused by {raised_by}, not {function}"
        # the door passes the rule's error on, its words and values, only its fields relabelled: the
        # CLI by its table, on one line after its prefix; parallelize and the callback by their
        # arguments (a recompute policy's fields); the other doors as the rule wrote it
        if door == "cli":
            expected = PREFIX + " ".join(str(in_config_keys(raised)).split())
        else:
            caught = error.value
            assert caught.parts == raised.parts, door
            expected = str(raised.relabel(caught.labels))
        assert printed == expected, (door, printed, expected)
        messages[door] = printed
    # the same words wherever Python arguments name the values (parallelize names the model's side
    # of "mhc_block needs hyper-connections" its own way: a model it splits has none)
    python_doors = {messages[d] for d in ("trainer", "fabric", "parallelize")
                    if d in messages and (d, setting) != ("parallelize", "mhc_block without hyper-connections")}
    assert len(python_doors) == 1, messages


def test_the_values_are_made_once_and_handed_down(tmp_path, monkeypatch):
    """What the CLI builds is what the strategy and the callback run with (the same objects, not
    rebuilt); a strategy's layout is its settings' layout until the processes start."""
    from hydra import compose, initialize_config_dir

    from lightning_mhc.cli import train
    from lightning_mhc.cli.preflight import CONF_DIR, to_train_config

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = to_train_config(compose("config", overrides=["parallel=pp2v2", "trainer.devices=2", "model.num_layers=4",
                                                           "recompute=mhc_block"]))
    strategy = train._build_strategy(cfg)
    assert strategy.settings is cfg.settings and strategy.settings.layout is cfg.layout
    assert cfg.layout.virtual_pipeline_model_parallel_size == 2 and cfg.layout.world_size == 2
    trainer, _ = train._build_trainer(cfg, strategy, tmp_path, None, None)
    callback = next(c for c in trainer.callbacks if isinstance(c, MHCRecomputeCallback))
    assert callback.policy is cfg.recompute_policy and callback.policy.name == "mhc_block"
    with pytest.raises(TypeError, match="not both"):
        MHCParallelStrategy(cfg.settings, seed=3)
    assert MHCParallelStrategy(pipeline_model_parallel_size=2).settings.layout == ParallelLayout(1, 2)


def test_the_virtual_size_is_an_int_everywhere():
    """No ``None``-or-1 conversion of the virtual pipeline size is left in the package."""
    conversions = re.compile(r"virtual\w*(?:\s+or\s+1\b|\s+if\s+\w+\s*>\s*1\s+else\s+None|\s+is\s+(?:not\s+)?None)")
    found = [f"{path.relative_to(ROOT)}:{n}" for path in PACKAGE.rglob("*.py")
             for n, line in enumerate(path.read_text().splitlines(), 1) if conversions.search(line)]
    assert not found, found
    assert ParallelLayout().virtual_pipeline_model_parallel_size == 1
    with pytest.raises(ConfigError, match="virtual_pipeline_model_parallel_size=None: must be a positive integer"):
        MHCParallelStrategy(virtual_pipeline_model_parallel_size=None)


# ------------------------------------------------ the strategies' explicit keywords
def _keywords_problems(strategy: type) -> list[str]:
    """How a strategy's ``__init__`` differs from ``settings``, then the settings' fields (the layout's
    degrees first) with the dataclasses' defaults and types, then its own, then its Lightning base's."""
    import dataclasses
    import inspect
    import typing

    from lightning_mhc.strategies.settings import SETTING_NAMES

    fields = {f.name: f for cls in (ParallelLayout, ParallelSettings) for f in dataclasses.fields(cls)}
    hints = {**typing.get_type_hints(ParallelLayout), **typing.get_type_hints(ParallelSettings)}
    own_hints = typing.get_type_hints(strategy.__init__)
    params = list(inspect.signature(strategy.__init__).parameters.values())[1:]
    problems = []
    if params[0].name != "settings":
        problems.append(f"first argument {params[0].name!r}, not 'settings'")
    taken = [p.name for p in params[1:len(SETTING_NAMES) + 1]]
    if taken != list(SETTING_NAMES):
        problems.append(f"settings keywords {taken} != {list(SETTING_NAMES)}")
    for p in params[1:len(SETTING_NAMES) + 1]:
        if p.name in fields and (p.kind is not p.KEYWORD_ONLY or p.default != fields[p.name].default
                                 or own_hints[p.name] != hints[p.name]):
            problems.append(f"{p.name}: {p.kind.name}, default {p.default!r}, type {own_hints[p.name]} != "
                            f"the field's {fields[p.name].default!r}, {hints[p.name]}")
    lightning_base = next(cls for cls in strategy.__mro__ if cls.__module__.startswith("lightning."))
    theirs = [(p.name, p.default) for p in list(inspect.signature(lightning_base.__init__).parameters.values())[1:]]
    ends = [(p.name, p.default) for p in params[len(params) - len(theirs):]]
    if ends != theirs:
        problems.append(f"last arguments {ends} != {lightning_base.__qualname__}'s {theirs}")
    return problems


def test_the_strategies_keywords_are_the_settings_fields():
    """Both strategies write their keywords out (``help()``, IDEs, LightningCLI read them): the
    same names, order, defaults and types as ParallelSettings' fields and the layout's DEGREES."""
    from lightning_mhc.lightning import MHCParallelStrategy as TrainerStrategy

    problems = {cls.__module__: _keywords_problems(cls) for cls in (TrainerStrategy, FabricStrategy)}
    assert not any(problems.values()), problems
    for cls in (TrainerStrategy, FabricStrategy):  # a keyword reaches the settings, and the settings whole
        strategy = cls(expert_model_parallel_size=2, timeout=datetime.timedelta(seconds=5), seed=7)
        assert strategy.settings == ParallelSettings(ParallelLayout(expert_model_parallel_size=2),
                                                     timeout=datetime.timedelta(seconds=5), seed=7)
        assert cls(strategy.settings).settings is strategy.settings


def test_the_public_name_parallelize_is_the_function():
    """``from lightning_mhc import parallelize`` gives the function itself, before and after its room
    (``lightning_mhc.any_model``) is imported: no room shares the function's name."""
    import lightning_mhc
    import lightning_mhc.any_model

    from lightning_mhc import parallelize as public

    assert public is lightning_mhc.any_model.parallelize is lightning_mhc.parallelize

    with pytest.raises(ConfigError, match="policy='bogus' is not a recompute policy"):
        public(_meta_model(), recompute="bogus")


# ------------------------------------------------------------------ the CLI's relabel table
def _error_fields(path: pathlib.Path) -> set[str]:
    """The fields the ConfigErrors of one module can name: the names given to ``term(...)`` and
    ``key(...)``, read from the source. A name held in a variable is followed to what it can hold: a
    loop over a tuple (written out or a module constant), a parameter (its default and every
    ``<parameter>="..."`` keyword in the package)."""
    import ast
    import importlib

    tree = ast.parse(path.read_text())
    fields: set[str] = set()

    def constants(node: ast.AST) -> list[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [node.value]
        if isinstance(node, (ast.Tuple, ast.List)):
            return [c for element in node.elts for c in constants(element)]
        if isinstance(node, ast.Name):  # a module constant
            module = importlib.import_module(".".join(path.relative_to(ROOT).with_suffix("").parts))
            held = getattr(module, node.id, None)
            return list(held) if isinstance(held, (tuple, dict)) else []
        return []

    def name_values(name: str, function: ast.AST) -> list[str]:
        found = [c for loop in ast.walk(function) if isinstance(loop, (ast.For, ast.comprehension))
                 and isinstance(loop.target, ast.Name) and loop.target.id == name for c in constants(loop.iter)]
        args = function.args if isinstance(function, ast.FunctionDef) else None
        if args is not None and name in [a.arg for a in args.args + args.kwonlyargs]:
            defaults = dict(zip([a.arg for a in args.args][::-1], args.defaults[::-1]))
            found += constants(defaults[name]) if name in defaults else []
            found += [c for source in PACKAGE.rglob("*.py") for call in ast.walk(ast.parse(source.read_text()))
                      if isinstance(call, ast.Call) for k in call.keywords if k.arg == name for c in constants(k.value)]
        assert found, f"{path.name}: what the field name {name!r} of an error holds is not found"
        return found

    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef):
            continue
        for call in ast.walk(function):
            if (isinstance(call, ast.Call) and getattr(call.func, "id", None) in ("term", "key") and call.args
                    and call is not function):
                name = call.args[0]
                if isinstance(name, ast.Constant):
                    fields.add(name.value)
                elif isinstance(name, ast.Name):
                    fields.update(name_values(name.id, function))
                else:
                    raise AssertionError(f"{path.name}:{call.lineno}: an error's field name the test cannot read")
    return fields


def test_the_clis_relabel_table_names_every_field_a_value_can_name():
    """Every field the values the CLI builds can name in a ConfigError has a row in the CLI's one
    table (``schema.CONFIG_LABELS``), or is listed as a field no config key sets; a value that
    learns to name a new field fails here until the table names it."""
    from lightning_mhc.cli.schema import CONFIG_LABELS, NOT_SET_BY_THE_CLI

    values = [path for path in PACKAGE.rglob("*.py") if path.parent.name != "cli" and path.name != "errors.py"]
    named = {field for path in values for field in _error_fields(path)}
    assert {"tensor_model_parallel_size", "num_attention_heads", "world_size", "num_microbatches", "timeout",
            "policy", "recompute_modules", "enable_hyper_connections", "hyper_connections",
            "mhc_init_gating_factor"} <= named, "the scan misses fields it should find"
    assert not set(NOT_SET_BY_THE_CLI) & set(CONFIG_LABELS)
    missing = sorted(named - set(CONFIG_LABELS) - set(NOT_SET_BY_THE_CLI))
    assert not missing, f"fields a value's error can name, without a row in schema.CONFIG_LABELS: {missing}"


def test_a_config_error_carries_its_fields_and_a_door_relabels_them():
    """A value's error: plain text and its fields as data, its message in its own terms; a door's
    labels rename a field (its key, its term, its value converted), the last door's label winning;
    ``within`` keeps them relabellable; braces are text; an error sent from another process keeps
    its fields (their names, values and the text its doors gave them) and can be relabelled again."""
    import pickle

    from lightning_mhc.errors import Label, key, term

    error = ConfigError(term("timeout", datetime.timedelta(seconds=0)), " with ", term("sequence_parallel", True),
                        ": set ", term("sequence_parallel", False), " or raise ", key("seed"), " {not a template}.")
    assert error.fields == ("timeout", "sequence_parallel", "seed")
    assert str(error) == ("timeout=datetime.timedelta(0) with sequence_parallel=True: set sequence_parallel=False "
                          "or raise seed {not a template}.")
    door = error.relabel({"timeout": Label("t_s", convert=lambda t: t.total_seconds()), "seed": "run.seed",
                          "other": "never.named"}, show=lambda value: str(value).lower())
    assert str(door) == ("t_s=0.0 with sequence_parallel=true: set sequence_parallel=false or raise run.seed "
                         "{not a template}.")
    outer = door.within("model={x}").relabel({"seed": Label("s", lambda value: f"the seed {value}")})
    assert str(outer) == ("model={x}: t_s=0.0 with sequence_parallel=true: set sequence_parallel=false or raise s "
                          "{not a template}.")
    assert outer.parts == ("model={x}: ", *error.parts) and outer.fields == error.fields
    assert str(ConfigError("a {finished} message")) == "a {finished} message"
    sent = pickle.loads(pickle.dumps(door))  # a spawned rank sends it back (labels: functions)
    assert str(sent) == str(door) and sent.fields == error.fields
    assert [p.value for p in sent.parts if not isinstance(p, str)][:2] == [datetime.timedelta(seconds=0), True]
    assert str(sent.relabel({"seed": "again.seed"})).endswith("or raise again.seed {not a template}.")
