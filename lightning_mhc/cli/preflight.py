"""Checks before any process starts: ``lightning-mhc-train``'s command line, config, data, machine
and checkpoint.

Every run the command line asks for (each job of a multirun, expanded as Hydra's basic sweeper
expands them) is composed with Hydra's compose API and checked before Hydra makes a directory:
Hydra's own errors (unknown key or option, wrong type, unparsable override), the dataclass
schemas (``lightning_mhc.cli.schema``: keys, types, ranges, constraints across groups), the data
(``check_data``: sizes and first bytes only), the GPUs asked for and the checkpoint to resume
from. A problem is one line, ``lightning-mhc-train: invalid configuration: <key, value, fix>``,
and exit status 2.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lightning_mhc.cli import config_store
from lightning_mhc.cli.config_store import register_configs
from lightning_mhc.cli.schema import TrainConfig
from lightning_mhc.cli.schema import KEYS_HINT, check_known_keys, describe_type, field_type, unknown_keys
from lightning_mhc.errors import ConfigError
from lightning_mhc.ops import TRITON_NOT_HERE, triton_runs_on

CONF_DIR = str(config_store.CONF_DIR)
PREFIX = "lightning-mhc-train: invalid configuration: "
register_configs()

checked = False
"""True once ``check_command_line`` has checked this process's run(s) (data and machine included)."""


def to_train_config(cfg: DictConfig, *, sizes_only: bool = False) -> TrainConfig:
    """The validated dataclasses of a composed config (raises ConfigError / OmegaConf errors):
    keys that are no field of the schemas (``+key=value`` additions) are refused, then every
    dataclass checks its ranges, ``TrainConfig`` the constraints across groups and the model under
    the layout (``TrainConfig.check_model``; ``sizes_only``: a plan's, without megatron-core)."""
    check_known_keys(OmegaConf.to_container(cfg, resolve=False))
    train = OmegaConf.to_object(cfg)
    train.check_model(sizes_only=sizes_only)
    return train


def check_machine(cfg: TrainConfig) -> None:
    """What the config asks of this machine: data that fills the batches (``check_data``, reading
    only file sizes and first bytes) and the GPUs for ``trainer.devices``."""
    from lightning_mhc.data.megatron import check_indexed_data, parse_blend
    from lightning_mhc.data.sources import check_data
    from lightning_mhc.strategies.runtime import NO_GRADIENT_SCALER

    d, t = cfg.data, cfg.trainer
    if d.source == "megatron":
        check_indexed_data(parse_blend(d.blend)[0], d.split, cfg.num_samples)
    else:
        check_data(source=d.source, path=d.path, seq_length=d.seq_length, val_fraction=d.val_fraction,
                   max_bytes=d.max_bytes, synthetic_samples=d.synthetic_samples,
                   global_batch_size=d.global_batch_size, validate=t.limit_val_batches > 0)
    if t.precision == "16-mixed" and device_type(t.accelerator) == "cuda":  # Lightning scales only on CUDA
        raise ConfigError(f"trainer.precision=16-mixed with trainer.accelerator={t.accelerator}: {NO_GRADIENT_SCALER}")
    if cfg.model.mhc_implementation == "triton" and not triton_runs_on(device_type(t.accelerator)):
        raise ConfigError(f"model.mhc_implementation=triton with trainer.accelerator={t.accelerator}: {TRITON_NOT_HERE}")
    if t.accelerator in ("gpu", "cuda"):
        import torch

        found = torch.cuda.device_count()
        if found < t.devices:
            raise ConfigError(
                f"trainer.accelerator={t.accelerator} with trainer.devices={t.devices}, but {found} CUDA GPU(s) are "
                f"visible here (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}). Lower "
                "trainer.devices, or run on the CPU: trainer=cpu (trainer.accelerator=cpu)."
            )


def free_device_memory(cfg: TrainConfig) -> int | None:
    """The free bytes of the emptiest-to-be GPU this run uses (the least free over the visible
    devices it takes), or None when it runs on the CPU (where the planner's figure is printed, not
    enforced)."""
    if device_type(cfg.trainer.accelerator) != "cuda":
        return None
    import torch

    return min(torch.cuda.mem_get_info(i)[0] for i in range(min(cfg.trainer.devices, torch.cuda.device_count())))


def check_fits(cfg: TrainConfig) -> str | None:
    """The planner's verdict on this run's layout before launch. On a GPU a layout whose most loaded
    rank is predicted over the device's free memory is refused (ConfigError: the largest term and a
    layout of the same devices that fits); on the CPU the prediction is returned as a line to print.
    A Hugging Face model's activations are traced (where the trace stops, the line says "in model
    states alone")."""
    from lightning_mhc.cli.plan import describe, fitting_layouts, largest_term, layout_row

    try:
        row = layout_row(cfg, cfg.layout, cfg.num_microbatches)
    except ConfigError as error:  # the config is valid (checked first): what the planner cannot plan yet
        return f"lightning-mhc-train: plan: not planned ({' '.join(str(error).split())})."
    term, size = largest_term(row)
    total = row["total_bytes"]
    free = free_device_memory(cfg)
    said = (f"the planner predicts {total / 1e9:.3f} GB on the most loaded rank (stage {row['most_loaded_stage']}; "
            f"largest term {term} {size / 1e9:.3f} GB)")
    if row["activations_not_counted"]:  # (the GPT's CP or MoE layers, an op a trace cannot run)
        said += " in model states alone"
    if free is None:
        return f"lightning-mhc-train: plan: {said}; on the CPU this is not enforced."
    if total <= free:
        return None
    fits = fitting_layouts(cfg, cfg.world_size, free)
    fix = (f"a layout of the same {cfg.world_size} devices that fits: {describe(fits[0])} "
           f"({fits[0]['total_bytes'] / 1e9:.3f} GB)" if fits else
           f"no layout of {cfg.world_size} devices fits: use more devices, a recompute policy or a smaller batch")
    raise ConfigError(f"{describe(row)} does not fit: {said}, over the {free / 1e9:.3f} GB free on the GPU; {fix} "
                      "(lightning-mhc-plan lists them).")


def device_type(accelerator: str) -> str:
    """The torch device type a ``trainer.accelerator`` runs on (``auto``: CUDA when there is one)."""
    if accelerator == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if accelerator in ("gpu", "cuda") else accelerator


def warn_oversubscription(cfg: TrainConfig) -> None:
    """More CPU processes than cores: allowed (layouts can be tried on a small machine), said once."""
    t, cores = cfg.trainer, os.cpu_count() or 1
    if t.accelerator == "cpu" and t.devices > cores:
        print(f"lightning-mhc-train: warning: trainer.devices={t.devices} CPU processes on {cores} CPU cores: they "
              "share the cores, so the run is slower than it needs to be and its throughput is no measure; lower "
              "trainer.devices where the layout allows.", file=sys.stderr, flush=True)


def resolve_ckpt_path(cfg: TrainConfig, output_dir: Path) -> str | None:
    """The checkpoint to resume from, checked before any process starts.

    ``ckpt_path=last`` is the newest complete checkpoint under ``<run dir>/checkpoints`` (none:
    the run starts from scratch, said on stderr); any other value must be a complete checkpoint
    of this run's TP/PP layout (relative paths are taken from where the command was started).
    """
    from hydra.utils import to_absolute_path

    from lightning_mhc.checkpoint import commit, read_metadata

    if cfg.ckpt_path is None:
        return None
    if cfg.ckpt_path == "last":
        found = commit.latest_complete(output_dir / "checkpoints")
        if found is None:
            print(f"lightning-mhc-train: ckpt_path=last: no complete checkpoint in {output_dir / 'checkpoints'}; "
                  "starting from scratch.", file=sys.stderr)
            return None
        path = found
    else:
        path = Path(to_absolute_path(os.path.expanduser(cfg.ckpt_path)))
    try:
        read_metadata(path)  # also refuses the earlier format, naming the command that converts it
    except FileNotFoundError as error:
        raise ConfigError(f"ckpt_path={cfg.ckpt_path}: {error}") from None
    if cfg.mode == "fit":
        check_resumed_schedule(cfg, path)
    return str(path)


def check_resumed_schedule(cfg: TrainConfig, path: Path) -> None:
    """A run resumed from ``path`` follows the learning-rate schedule it was saved with: other
    settings (``optim.lr``, ``optim.warmup_steps``, ``optim.min_lr_ratio``, ``optim.weight_decay``,
    ``trainer.max_steps``) are refused unless ``optim.override_scheduler=true`` (the same rule the module's scheduler
    applies when it loads the checkpoint, here before any process starts)."""
    from lightning_mhc.checkpoint import read_trainer_state
    from lightning_mhc.cli.schema import in_config_keys
    from lightning_mhc.lightning.modules.base import SCHEDULE_KEY, schedule_mismatch

    if cfg.optim.override_scheduler:
        return
    state = read_trainer_state(path)
    saved = (state.get("lr_schedulers") or [{}])[0]
    settings = dict(lr=cfg.optim.lr, warmup_steps=cfg.optim.warmup_steps, max_steps=cfg.trainer.max_steps,
                    min_lr_ratio=cfg.optim.min_lr_ratio, weight_decay=cfg.optim.weight_decay)
    error = schedule_mismatch(saved.get(SCHEDULE_KEY), settings, saved.get("last_epoch", state.get("global_step", 0)))
    if error is not None:
        raise in_config_keys(error).within(f"ckpt_path={cfg.ckpt_path}")


def say_invalid(*messages: str) -> None:
    for message in messages:
        print(PREFIX + " ".join(str(message).split()), file=sys.stderr, flush=True)


# ------------------------------------------------------------------ before Hydra: the command line
def check_command_line(argv: list[str]) -> None:
    """Check every run the command line asks for before Hydra makes a directory: the overrides
    compose (Hydra's own errors included), the config validates, the data and the machine fit,
    a checkpoint to resume from exists. A multirun's jobs are expanded as Hydra's basic sweeper
    expands them and all of them are checked; the invalid ones are listed, one line each. Any
    problem exits 2 with ``lightning-mhc-train: invalid configuration: ...``. Commands that only
    print (``--help``, ``--cfg``, ``--info`` ...) or read other config folders are left to Hydra."""
    global checked
    from hydra import initialize_config_dir
    from hydra._internal.utils import get_args_parser
    from hydra.core.utils import filter_overrides
    from hydra.errors import HydraException

    args = get_args_parser().parse_args(argv)
    if (args.help or args.hydra_help or args.cfg or args.info or args.shell_completion or args.experimental_rerun
            or args.config_path or args.config_dir):
        return
    overrides = list(args.overrides)
    multirun = args.multirun or "hydra.mode=MULTIRUN" in overrides
    problems, planned = [], []
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3", job_name="train"):
        try:
            jobs = _sweep_jobs(overrides) if multirun else [overrides]
        except HydraException as error:
            jobs, problems = [], [hydra_error_message(error, overrides)]
        shared = set.intersection(*(set(job) for job in jobs)) if len(jobs) > 1 else set()
        for number, job in enumerate(jobs):
            message = _check_job(args.config_name or "config", job, planned)
            if message is not None:
                swept = [o for o in filter_overrides(job) if o not in shared]  # what tells the jobs apart
                problems.append(f"job {number} ({' '.join(swept) or 'no overrides'}): {message}" if multirun else message)
    if problems:
        if multirun and jobs:
            problems.append(f"{len(problems)} of the sweep's {len(jobs)} jobs are invalid; no job was started.")
        say_invalid(*problems)
        sys.exit(2)
    for line in planned:  # the planner's figures, once every job is valid
        print(line, file=sys.stderr, flush=True)
    checked = True


def _sweep_jobs(overrides: list[str]) -> list[list[str]]:
    """The overrides of each job of a multirun, as Hydra's BasicSweeper expands them."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
    batches = BasicSweeper.split_arguments(parser.parse_overrides(overrides), None)
    return [list(job) for batch in batches for job in batch]


def _check_job(config_name: str, overrides: list[str], planned: list[str]) -> str | None:
    """The problem of one run's overrides, or None (the planner's line for it, on the CPU, added to
    ``planned``)."""
    from hydra import compose
    from hydra.errors import HydraException

    try:
        cfg = compose(config_name=config_name, overrides=overrides)
    except (HydraException, OmegaConfBaseException) as error:
        return hydra_error_message(error, overrides)
    try:
        train_cfg = to_train_config(cfg)
        check_machine(train_cfg)
        if train_cfg.ckpt_path not in (None, "last"):  # 'last' needs the run directory: checked in the run
            resolve_ckpt_path(train_cfg, Path.cwd())
        line = check_fits(train_cfg)
        if line is not None:
            planned.append(line)
    except (ConfigError, OmegaConfBaseException, ValueError) as error:
        return str(error)
    return None


def hydra_error_message(error: BaseException, overrides: list[str]) -> str:
    """Hydra's composition and override-parsing errors as one line naming the override, its value
    and the fix (Hydra's own text where there is no better one)."""
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    cause, text = error.__cause__, str(error)
    if isinstance(error, OverrideParseException):
        bad = next((o for o in overrides if not _parses(o)), None)
        reason = next((line for line in text.splitlines()
                       if line and not line.startswith(("Error parsing", "See https"))), text)
        return (f"cannot parse the override {bad or ' '.join(overrides)!r} ({reason}). Overrides are key=value "
                "(trainer.max_steps=10), group=option (model=small), +key=value or ~key; quote values holding "
                "spaces, commas, '=' or '${'. See https://hydra.cc/docs/advanced/override_grammar/basic/.")
    if isinstance(error, MissingConfigException) and error.missing_cfg_file and error.options:
        group, _, option = error.missing_cfg_file.rpartition("/")
        return (f"{group}={option}: the {group} group has no option {option!r}. Choose one of "
                f"{', '.join(sorted(error.options))} (the files in conf/{group}/ of the package, and of ./conf where the command runs).")
    overridden = re.match(r"Could not override '([^']+)'", text)
    if overridden and isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
        key = overridden.group(1)
        value = _override_value(key, overrides)
        nested: Any = value
        for part in reversed(key.split(".")):
            nested = {part: nested}
        problems = unknown_keys(nested)
        if problems:
            return "; ".join(problems) + f". Fix the key's name: {KEYS_HINT}."
    merging = re.match(r"Error merging override (.+)", text)
    if merging and isinstance(cause, ValidationError):
        full_key = getattr(cause, "full_key", None) or ""
        expected = field_type(full_key)
        reason = str(cause).splitlines()[0]
        wanted = f"; {full_key} takes {describe_type(expected)}. Give it such a value" if expected else ""
        return f"{merging.group(1)}: {reason}{wanted}."
    return " ".join(f"{text} {cause or ''}".split())


def _parses(override: str) -> bool:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        OverridesParser.create().parse_override(override)
        return True
    except HydraException:
        return False


class _AsWritten:
    """An override's value as the user wrote it (``show`` prints it unquoted)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __str__(self) -> str:
        return self.text


def _override_value(key: str, overrides: list[str]) -> _AsWritten:
    for override in overrides:
        name, sep, value = override.lstrip("+~").partition("=")
        if sep and name == key:
            return _AsWritten(value)
    return _AsWritten("?")
