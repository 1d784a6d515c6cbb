"""Dataclass schemas of the Hydra configs (``conf/``), validated before any process starts.

Hydra composes YAML onto these structured configs (unknown keys and wrong types
are rejected); ``OmegaConf.to_object`` then builds the dataclasses, whose
``__post_init__`` checks every cross-group constraint. Each error names the
keys, their values and the fix.
"""
from __future__ import annotations

import dataclasses
import datetime
import difflib
import functools
import math
import os
import typing
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from lightning_mhc.distributed.layout import DEGREES, ParallelLayout
from lightning_mhc.errors import ConfigError, Label
from lightning_mhc.model.activations import ACTIVATIONS
from lightning_mhc.ops import MHC_IMPLEMENTATIONS
from lightning_mhc.recompute.policy import RecomputePolicy
from lightning_mhc.strategies.settings import ParallelSettings

ACCELERATORS = ("cpu", "gpu", "cuda", "auto")
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true", "transformer-engine",
              "transformer-engine-float16", "32", "16", "bf16", "64")
"""Lightning's precision names (``Trainer(precision=...)``)."""
FLOAT32_MATMUL_PRECISIONS = ("highest", "high", "medium")
"""``torch.set_float32_matmul_precision``'s settings."""
DATA_SOURCES = ("stdlib", "text", "synthetic", "megatron")
MODEL_SOURCES = ("gpt", "hf")
HF_MODEL_KEYS = ("pretrained", "config", "hyper_connections", "plan")
"""The model group's keys only a Hugging Face model (model=hf) reads."""
SHARED_MODEL_KEYS = ("source", "init_seed", "mhc_implementation", "moe_router_bias_update_rate")
"""The model group's keys both models read; every other key is the project's GPT's alone
(``moe_router_bias_update_rate``: a Hugging Face family's biased routers, as DeepSeek-V4's, too)."""
BYTE_VOCAB = 256
"""The vocabulary of the byte-level sources (stdlib, text)."""
LOGGERS = ("csv", "wandb", "none")


# ------------------------------------------------------------------ range checks
def show(value: Any) -> str:
    """A value as it is written in an override: ``true``, ``null``, ``'text'`` quoted, numbers plain."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return repr(value)
    return str(value)


def _require(ok: bool, key: str, value: Any, rule: str, fix: str) -> None:
    """Raise ``ConfigError('<key>=<value>: must be <rule>. <fix>')`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{key}={show(value)}: must be {rule}. {fix}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _at_least(key: str, value: Any, low: int, fix: str | None = None) -> None:
    _require(_is_number(value) and value >= low, key, value, f">= {low}",
             fix or f"Set {key} to an integer >= {low}.")


def _positive(key: str, value: Any, fix: str | None = None) -> None:
    _require(_is_number(value) and value > 0, key, value, "> 0 (and finite)", fix or f"Set {key} to a positive number.")


def _one_of(key: str, value: Any, choices: tuple[str, ...], fix: str | None = None) -> None:
    _require(value in choices, key, value, "one of " + ", ".join(choices),
             fix or f"Set {key} to one of {', '.join(choices)}.")


@dataclass
class ModelConfig:
    """The model group: the project's mHC GPT (``source: gpt``, the MHCTransformerConfig fields a run
    chooses), or a Hugging Face causal LM (``source: hf``: ``pretrained`` or ``config``,
    ``hyper_connections``, ``plan``; and the shared ``init_seed``, ``mhc_implementation``,
    ``moe_router_bias_update_rate``).

    A key the chosen model does not read is null here and refused when given, whatever its value
    (``model=hf model.num_residual_streams=4`` would otherwise be silently ignored); the defaults
    are filled in for the chosen model when the config is checked: ``GPT_DEFAULTS`` and then
    ``MHCTransformerConfig``'s own for the GPT, ``HF_DEFAULTS`` for a Hugging Face model."""

    source: str = "gpt"
    """'gpt': the project's mHC GPT; 'hf': a Hugging Face causal LM (model=hf)."""
    pretrained: Optional[str] = None
    """model=hf: a save_pretrained directory to continue training (its config, safetensors and tokenizer)."""
    config: Optional[str] = None
    """model=hf: a directory (or its config.json) to train from fresh weights (drawn from init_seed)."""
    hyper_connections: Optional[int] = None
    """model=hf: n residual streams with hyper-connections added, exact at step 0 (null or 1: the model as it is)."""
    plan: Optional[str] = None
    """model=hf: the tensor-parallel plan (default 'auto': by the config's model_type)."""
    num_layers: Optional[int] = None
    hidden_size: Optional[int] = None
    num_attention_heads: Optional[int] = None
    num_query_groups: Optional[int] = None
    """null: one per head."""
    ffn_hidden_size: Optional[int] = None
    """null: 4 x hidden_size."""
    vocab_size: Optional[int] = None
    """null: from the data (256 for bytes, the tokenizer's for data=megatron)."""
    make_vocab_size_divisible_by: Optional[int] = None
    """The embedding and output layer are padded to a multiple of this; the padding never gets probability."""
    max_sequence_length: Optional[int] = None
    hidden_dropout: Optional[float] = None
    attention_dropout: Optional[float] = None
    exact_hidden_dropout: Optional[bool] = None
    """true: hidden dropout masks independent of TP and CP (docs/context_parallel.md); refuses attention dropout there."""
    activation: Optional[str] = None
    add_bias_linear: Optional[bool] = None
    share_embeddings_and_output_weights: Optional[bool] = None
    position_embedding_type: Optional[str] = None
    init_method_std: Optional[float] = None
    init_seed: Optional[int] = None
    """The initialisation seed: the GPT's weights and hyper-connections (default 1234); model=hf's
    fresh weights and hyper-connection parameters (default 0, as in ``HFCausalLMModule``,
    ``parallelize`` and ``add_hyper_connections``)."""
    enable_hyper_connections: Optional[bool] = None
    num_residual_streams: Optional[int] = None
    mhc_sinkhorn_iterations: Optional[int] = None
    mhc_init_gating_factor: Optional[float] = None
    mhc_implementation: str = "auto"
    # --- mixture of experts (megatron's names; docs/moe.md): null, megatron's default
    num_moe_experts: Optional[int] = None
    """Routed experts per MoE layer; null: dense MLPs."""
    moe_router_topk: Optional[int] = None
    moe_ffn_hidden_size: Optional[int] = None
    """Each routed expert's intermediate size; null: ffn_hidden_size."""
    moe_shared_expert_intermediate_size: Optional[int] = None
    moe_layer_freq: Any = None
    """An int f: layers 0, f, 2f, ... have experts; or a list of one 0/1 per layer."""
    moe_router_score_function: Optional[str] = None
    moe_router_pre_softmax: Optional[bool] = None
    moe_router_enable_expert_bias: Optional[bool] = None
    moe_router_bias_update_rate: Optional[float] = None
    moe_router_load_balancing_type: Optional[str] = None
    moe_aux_loss_coeff: Optional[float] = None
    moe_z_loss_coeff: Optional[float] = None
    moe_expert_capacity_factor: Optional[float] = None

    def __post_init__(self) -> None:
        _one_of("model.source", self.source, MODEL_SOURCES, "Choose model=<a GPT: tiny, small, gpt_125m> or model=hf.")
        self._refuse_keys_of_the_other_model()

    def take_defaults(self) -> None:
        """Fills the chosen model's defaults and checks the group (``TrainConfig`` calls it first:
        not ``__post_init__``, which also runs when Hydra reads the schema's defaults, so they
        would stop being null)."""
        for name, value in (HF_DEFAULTS if self.is_hf else _gpt_defaults()).items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        _one_of("model.mhc_implementation", self.mhc_implementation, MHC_IMPLEMENTATIONS,
                "Use 'auto' (the fused ops), 'fused', 'triton' (Triton's kernels), 'compile' (torch.compile) "
                "or 'reference' (the op-by-op math).")
        _require(isinstance(self.init_seed, int) and not isinstance(self.init_seed, bool) and self.init_seed >= 0,
                 "model.init_seed", self.init_seed, "an integer >= 0", "Set model.init_seed to e.g. 0.")
        if self.is_hf:
            self._check_hf()
        else:
            self._check_gpt()

    def _refuse_keys_of_the_other_model(self) -> None:
        other = [k for k in _fields(ModelConfig) if k not in (*SHARED_MODEL_KEYS, *self.own_keys)]
        given = [k for k in other if getattr(self, k) is not None]
        if not given:
            return
        key = given[0]
        value = f"model.{key}={show(getattr(self, key))}"
        if self.is_hf:
            hint = (" For n residual streams on a Hugging Face model give model.hyper_connections=<n>."
                    if key in ("enable_hyper_connections", "num_residual_streams") else "")
            raise ConfigError(f"{value}: the project's GPT reads it, not model=hf, whose config.json sets its sizes and "
                              f"model.hyper_connections its streams. Remove model.{key}.{hint}")
        raise ConfigError(f"{value}: model.{key} is for a Hugging Face model (model=hf); the project's GPT sets its "
                          f"streams with model.num_residual_streams. Remove model.{key}, or choose model=hf.")

    @property
    def own_keys(self) -> tuple[str, ...]:
        """The keys only the chosen model reads."""
        if self.is_hf:
            return HF_MODEL_KEYS
        return tuple(k for k in _fields(ModelConfig) if k not in (*SHARED_MODEL_KEYS, *HF_MODEL_KEYS))

    def _check_gpt(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ConfigError(f"model.activation={self.activation!r}: choose one of {', '.join(ACTIVATIONS)}.")
        for name in ("num_layers", "hidden_size", "num_attention_heads", "max_sequence_length",
                     "make_vocab_size_divisible_by"):
            _at_least(f"model.{name}", getattr(self, name), 1)
        for name in ("num_query_groups", "ffn_hidden_size", "vocab_size"):
            if getattr(self, name) is not None:
                _at_least(f"model.{name}", getattr(self, name), 1,
                          f"Set model.{name} to a positive integer, or null for the default.")
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            _require(_is_number(value) and 0 <= value < 1, f"model.{name}", value, "in [0, 1)",
                     f"Set model.{name} to a dropout probability, e.g. 0.1 (0 turns dropout off).")
        _positive("model.init_method_std", self.init_method_std, "Set model.init_method_std to e.g. 0.02.")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model.hidden_size={self.hidden_size} is not divisible by model.num_attention_heads="
                f"{self.num_attention_heads}. Pick sizes whose ratio (the head dimension) is an integer."
            )

    @property
    def is_hf(self) -> bool:
        return self.source == "hf"

    @property
    def hf_dir(self) -> str:
        """model=hf: the directory the model comes from (``pretrained``, or ``config`` or its folder)."""
        path = Path(self.pretrained or self.config)
        return str(path.parent if path.name == "config.json" else path)

    @property
    def hf_key(self) -> str:
        """model=hf: ``model.pretrained=<dir>`` or ``model.config=<dir>``, as errors name it."""
        return f"model.pretrained={self.pretrained}" if self.pretrained else f"model.config={self.config}"

    def _check_hf(self) -> None:
        from hydra.utils import to_absolute_path

        if bool(self.pretrained) == bool(self.config):
            raise ConfigError("model=hf needs one of model.pretrained=<save_pretrained dir> (continue its weights) or "
                              "model.config=<dir or config.json> (fresh weights), not "
                              + ("both." if self.pretrained else "neither."))
        if self.pretrained:
            self.pretrained = to_absolute_path(os.path.expanduser(self.pretrained))
        else:
            self.config = to_absolute_path(os.path.expanduser(self.config))
        from lightning_mhc.any_model.hyper_connections import HyperConnectionSettings

        try:
            self.hyper_connection_settings = HyperConnectionSettings.of(self.hyper_connections, self.init_seed,
                                                                        self.mhc_implementation)
            """model=hf: the hyper-connections, checked once (1 stream: none)."""
        except ConfigError as error:
            raise ConfigError(f"model.hyper_connections={show(self.hyper_connections)}: "
                              + str(error).split(": ", 1)[-1]) from None

    def transformer_kwargs(self) -> dict[str, Any]:
        kwargs = {k: getattr(self, k) for k in self.own_keys if k != "activation"}
        kwargs.update(init_seed=self.init_seed, mhc_implementation=self.mhc_implementation,
                      moe_router_bias_update_rate=self.moe_router_bias_update_rate)
        kwargs["activation_func"], kwargs["gated_linear_unit"] = ACTIVATIONS[self.activation]
        return {k: v for k, v in kwargs.items() if v is not None}


def _check_built_in_plan(model: Any, plan: str) -> None:
    """model=hf: the command line takes a built-in plan by name (a plan of one's own is a Python
    object: ``parallelize`` from a script)."""
    from lightning_mhc.any_model.families import PLANS

    family = getattr(model.config, "model_type", None) if plan == "auto" else plan
    if family not in PLANS:
        found = f"has model_type {family!r}" if plan == "auto" else "names no built-in plan"
        raise ConfigError(f"model.plan={plan}: {type(model).__name__} {found}; the command line takes the built-in "
                          f"plans ({', '.join(PLANS)}, or auto). For another family call parallelize() from Python "
                          "with a plan of its own (docs/bring_your_own_model.md#writing-a-plan).")


GPT_SIZES = dict(num_layers=4, hidden_size=64, num_attention_heads=4, max_sequence_length=128, activation="gelu")
"""The GPT's defaults the schema sets itself (a small model for a CPU run; ``model=tiny`` spells
them out); its other keys default to ``MHCTransformerConfig``'s."""
NULL_IS_A_CHOICE = ("num_query_groups", "ffn_hidden_size", "vocab_size")
"""GPT keys whose null the model resolves itself (one group per head, 4 x hidden, the data's)."""
HF_DEFAULTS = dict(plan="auto", init_seed=0, moe_router_bias_update_rate=0.0)
"""model=hf's defaults (the routers' bias stays as loaded, as transformers trains)."""


TRAINING_DEFAULTS = dict(
    hidden_dropout=0.1, attention_dropout=0.1, exact_hidden_dropout=False, init_method_std=0.02, init_seed=1234,
    mhc_sinkhorn_iterations=20, mhc_init_gating_factor=0.01, moe_router_score_function="softmax",
    moe_router_pre_softmax=False, moe_router_enable_expert_bias=False, moe_router_bias_update_rate=0.001,
    moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None,
    moe_expert_capacity_factor=None,
)
"""``MHCTransformerConfig``'s defaults (megatron-core's for its fields) of the GPT keys that are no
size (the sizes': ``model.sizes.MODEL_DEFAULTS``), written here so that the command line and the
planner read them without importing megatron-core, which takes seconds; ``tests/test_hydra.py``
checks every GPT key's default against the class."""


@functools.cache
def _gpt_defaults() -> dict[str, Any]:
    """Every GPT key's default: ``GPT_SIZES``, else the model's (``MODEL_DEFAULTS``, ``TRAINING_DEFAULTS``)."""
    from lightning_mhc.model.sizes import MODEL_DEFAULTS

    model = {**MODEL_DEFAULTS, **TRAINING_DEFAULTS}
    keys = [k for k in _fields(ModelConfig) if k not in (*HF_MODEL_KEYS, "source", "mhc_implementation")]
    return {k: GPT_SIZES[k] if k in GPT_SIZES else model[k] for k in keys if k not in NULL_IS_A_CHOICE}


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    sequence_parallel: bool = False
    """With TP > 1: the residual stream, norms and hyper-connections on seq_length / TP tokens per rank."""
    virtual_pipeline_model_parallel_size: int = 1
    """Model chunks per pipeline stage (interleaved 1F1B); 1: one chunk."""
    context_parallel_size: int = 1
    """Ranks that split each sequence (CP); DP = devices / (TP x CP x PP)."""
    expert_model_parallel_size: int = 1
    """Ranks that split the experts of MoE layers (EP), carved out of DP x CP."""
    num_microbatches: Optional[int] = None
    """null: data.global_batch_size / (data.micro_batch_size x DP); given, it must be that number."""
    deallocate_pipeline_outputs: bool = True
    timeout_s: float = 600.0
    """The seconds a collective may wait."""


@dataclass
class RecomputeConfig:
    policy: str = "none"
    recompute_modules: Optional[list[str]] = None
    recompute_mlp: bool = False
    """Megatron's flag; equivalent to 'mlp' in recompute_modules."""
    mhc_recompute_layer_num: Optional[int] = None

    def modules(self) -> Optional[list[str]]:
        modules = list(self.recompute_modules) if self.recompute_modules is not None else None
        if self.recompute_mlp:
            modules = (modules or []) + (["mlp"] if "mlp" not in (modules or []) else [])
        return modules

    def to_policy(self) -> RecomputePolicy:
        """The policy this group selects (checked)."""
        return RecomputePolicy(self.policy, self.modules(), self.mhc_recompute_layer_num)


MEGATRON_NEEDS = ("data=megatron reads indexed datasets: give data.blend=<prefix> (or [0.7,PATH_A,0.3,PATH_B]) and "
                  "data.tokenizer=<tokenizer.json> (lightning-mhc-preprocess writes the prefix "
                  "<output-prefix>_text_document).")


@dataclass
class DataConfig:
    source: str = "stdlib"
    """'stdlib' (bytes of the Python standard library's sources), 'text' (data.path), 'synthetic', or
    'megatron' (indexed datasets: data.blend, data.tokenizer, data.split)."""
    path: Optional[str] = None
    blend: Any = None
    """data=megatron: a prefix, or weights and prefixes as Megatron's --data-path: [0.7,PATH_A,0.3,PATH_B]."""
    tokenizer: Optional[str] = None
    """data=megatron: the tokenizer.json the data was preprocessed with (or its directory, 'byte', 'sample')."""
    split: Any = "969,30,1"
    """data=megatron: train, validation, test shares of each prefix's documents ('969,30,1' or [90,10,0])."""
    cache_dir: Optional[str] = None
    """data=megatron: where megatron writes its index caches (null: <run directory>/data_cache)."""
    seq_length: int = 64
    micro_batch_size: int = 4
    global_batch_size: int = 8
    val_fraction: float = 0.05
    max_bytes: int = 2_000_000
    synthetic_samples: int = 512
    num_workers: int = 0

    def __post_init__(self) -> None:
        _one_of("data.source", self.source, DATA_SOURCES, "Choose data=stdlib|text|synthetic|megatron.")
        for name in ("seq_length", "micro_batch_size", "global_batch_size", "max_bytes", "synthetic_samples"):
            _at_least(f"data.{name}", getattr(self, name), 1)
        _at_least("data.num_workers", self.num_workers, 0, "Set data.num_workers=0 (load in the main process) or more.")
        _require(_is_number(self.val_fraction) and 0 < self.val_fraction < 1, "data.val_fraction", self.val_fraction,
                 "in (0, 1)", "Set data.val_fraction to the share of the data held out for validation, e.g. 0.05.")
        if self.source == "megatron":
            self._check_megatron()
        self._absolute_paths()

    def _check_megatron(self) -> None:
        from lightning_mhc.data.megatron import check_split, parse_blend

        if self.blend is None:  # (data.tokenizer: the run's check, where model=hf gives a default)
            raise ConfigError(MEGATRON_NEEDS)
        prefixes, weights = parse_blend(self.blend)
        self.blend = prefixes if weights is None else [x for pair in zip(weights, prefixes) for x in pair]
        if isinstance(self.split, (list, tuple)):  # data.split=[90,10,0]: Hydra reads 90,10,0 unquoted as a sweep
            self.split = ",".join(str(share) for share in self.split)
        check_split(self.split)

    def _absolute_paths(self) -> None:
        """Paths from the directory the command was started in (Hydra changes into the run
        directory), ``~`` expanded: the run reads these absolute paths."""
        from hydra.utils import to_absolute_path

        from lightning_mhc.data.preprocess import sample_prefix
        from lightning_mhc.data.sample import SAMPLE
        from lightning_mhc.data.tokenizers import is_named

        def absolute(path: str) -> str:
            return to_absolute_path(os.path.expanduser(path))

        if self.path:
            self.path = absolute(self.path)
        if self.cache_dir:
            self.cache_dir = absolute(self.cache_dir)
        if self.tokenizer and not is_named(self.tokenizer):
            self.tokenizer = absolute(self.tokenizer)
        if self.source == "megatron":  # data.blend=sample: the shipped corpus, indexed once into the user's cache
            self.blend = [item if isinstance(item, float) else sample_prefix() if item == SAMPLE
                          else absolute(item) for item in self.blend]

    def tokenizer_vocab_size(self) -> int:
        """The vocabulary the data needs: the tokenizer's (data=megatron) or the bytes'."""
        if self.source != "megatron":
            return BYTE_VOCAB
        from lightning_mhc.data.tokenizers import load_tokenizer

        return load_tokenizer(self.tokenizer).vocab_size


@dataclass
class TrainerConfig:
    accelerator: str = "cpu"
    devices: int = 1
    """Processes per node."""
    num_nodes: int = 1
    """Nodes (machines); the world size is devices x num_nodes."""
    max_steps: int = 100
    precision: str = "32-true"
    gradient_clip_val: float = 1.0
    val_check_interval: int = 50
    limit_val_batches: int = 8
    log_every_n_steps: Optional[int] = None
    """Log the training metrics every N steps; null: every 10 steps, and in a run of fewer than 100
    steps every ``max_steps // 10`` (every step under 20), so that a short run logs its training loss
    too (Lightning's default of 50 would log none of a 5-step run): ``log_interval``."""
    checkpoint_every_n_steps: int = 50
    enable_progress_bar: bool = True
    raise_on_nonfinite_loss: bool = True
    """Stop the run at a NaN/inf loss (MHCParallelStrategy(raise_on_nonfinite_loss=...)); false: skip that step."""
    detect_anomaly: bool = False
    """Lightning's Trainer(detect_anomaly=...): torch's autograd anomaly detection (slow)."""
    peak_tflops: Optional[float] = None
    """One device's peak TFLOP/s for the logged mfu; null: the figure of a known GPU, none on CPU."""
    float32_matmul_precision: str = "highest"
    """torch.set_float32_matmul_precision in every process: 'highest' (fp32), 'high' (cuBLAS tf32;
    the mHC projection kernel tf32x3), 'medium' (tf32). trainer=gpu sets 'high'."""

    @property
    def log_interval(self) -> int:
        """The Trainer's ``log_every_n_steps``: ``log_every_n_steps``, or where null 10 steps, fewer
        in a short run (about 10 rows of training metrics, at least every step's under 20 steps)."""
        if self.log_every_n_steps is not None:
            return self.log_every_n_steps
        return max(1, min(10, self.max_steps // 10))

    def __post_init__(self) -> None:
        _one_of("trainer.accelerator", self.accelerator, ACCELERATORS)
        _one_of("trainer.precision", self.precision, PRECISIONS)
        _one_of("trainer.float32_matmul_precision", self.float32_matmul_precision, FLOAT32_MATMUL_PRECISIONS)
        _at_least("trainer.devices", self.devices, 1, "Set trainer.devices to the number of processes per node, >= 1.")
        _at_least("trainer.num_nodes", self.num_nodes, 1, "Set trainer.num_nodes to the number of nodes, >= 1.")
        _at_least("trainer.max_steps", self.max_steps, 1, "Set trainer.max_steps to the optimizer steps to train, >= 1.")
        for name in ("val_check_interval", "log_every_n_steps", "checkpoint_every_n_steps"):
            if getattr(self, name) is not None:
                _at_least(f"trainer.{name}", getattr(self, name), 1, f"Set trainer.{name} to a number of steps, >= 1.")
        if self.peak_tflops is not None:
            _positive("trainer.peak_tflops", self.peak_tflops, "Set trainer.peak_tflops to one device's peak "
                      "TFLOP/s (e.g. 989 for an H100's bf16), or null for the known GPUs' figures.")
        _at_least("trainer.limit_val_batches", self.limit_val_batches, 0,
                  "Set trainer.limit_val_batches to the validation batches per check (0: no validation).")
        _require(_is_number(self.gradient_clip_val) and self.gradient_clip_val >= 0, "trainer.gradient_clip_val",
                 self.gradient_clip_val, ">= 0", "Set trainer.gradient_clip_val to the gradient-norm limit (0: no clipping).")


GPT_RECIPE = dict(lr=3e-3, warmup_steps=20)
"""The project's GPT's learning rate and warm-up on the command line (small models from scratch)."""
HF_RECIPE = dict(lr=3e-4, warmup_steps=0)
"""A Hugging Face model's, ``HFCausalLMModule``'s defaults (written here: the command line and the
planner read them without importing Lightning; ``tests/test_cli_hf.py`` checks them against it)."""


@dataclass
class OptimConfig:
    name: str = "adamw"
    """'adamw', 'sgd' (momentum 0.9) or 'adafactor' (MHCGPTModule(optimizer=...))."""
    lr: Optional[float] = None
    """null: the model's default (``GPT_RECIPE`` for the GPT; ``HFCausalLMModule``'s for model=hf)."""
    weight_decay: float = 0.1
    warmup_steps: Optional[int] = None
    """null: the model's default, as ``lr``."""
    min_lr_ratio: float = 0.1
    override_scheduler: bool = False
    """Resuming (``ckpt_path=``) from a checkpoint whose learning-rate schedule had other settings
    (optim.lr, optim.warmup_steps, optim.min_lr_ratio, optim.weight_decay, trainer.max_steps): follow
    this run's from the checkpoint's step (Megatron-LM's --override-opt_param-scheduler); false: refused."""
    use_distributed_optimizer: bool = False
    """ZeRO-1: each data-parallel rank keeps the optimizer state of 1/DP of the parameters
    (MHCParallelStrategy(use_distributed_optimizer=...))."""

    def __post_init__(self) -> None:
        from lightning_mhc.distributed.optimizer import OPTIMIZERS, check_shardable

        _one_of("optim.name", self.name, tuple(OPTIMIZERS))
        if self.use_distributed_optimizer:
            check_shardable(OPTIMIZERS[self.name], f"optim.use_distributed_optimizer=false (optim.name={self.name})")
        _require(_is_number(self.weight_decay) and self.weight_decay >= 0, "optim.weight_decay", self.weight_decay,
                 ">= 0", "Set optim.weight_decay to e.g. 0.1 (0: none).")
        _require(_is_number(self.min_lr_ratio) and 0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio",
                 self.min_lr_ratio, "in [0, 1]", "Set optim.min_lr_ratio to the final learning rate's share of "
                 "optim.lr, e.g. 0.1.")

    def take_model_defaults(self, model: ModelConfig) -> None:
        """The learning rate and warm-up left null take the model's: the GPT's recipe for a small
        model trained from scratch, or a Hugging Face model's as ``HFCausalLMModule`` defaults them
        (so the command line and the Python API train it alike)."""
        defaults = HF_RECIPE if model.is_hf else GPT_RECIPE
        for name, value in defaults.items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        _positive("optim.lr", self.lr, "Set optim.lr to a positive learning rate, e.g. optim.lr=3e-3.")
        _at_least("optim.warmup_steps", self.warmup_steps, 0, "Set optim.warmup_steps to 0 (no warm-up) or more.")


@dataclass
class LoggerConfig:
    name: str = "csv"
    """'csv', 'wandb' or 'none'."""
    project: str = "lightning_mhc"
    offline: bool = True

    def __post_init__(self) -> None:
        _one_of("logger.name", self.name, LOGGERS, "Choose logger=csv|wandb|none.")


MODES = ("fit", "validate", "test")


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    seed: int = 1234
    name: str = "mhc"
    ckpt_path: Optional[str] = None
    """Resume from this checkpoint directory, or 'last': the newest complete one of the run directory."""
    mode: str = "fit"
    """fit (train, or resume from ckpt_path), or validate / test: evaluate ckpt_path on the held-out split."""

    def __post_init__(self) -> None:
        """Every check across the groups; the values it makes (layout, settings, policy, model
        config) refuse in their own terms, relabelled here, the CLI's one boundary, to config keys."""
        try:
            self._check()
        except ConfigError as error:
            raise in_config_keys(error) from None

    def _check(self) -> None:
        _one_of("mode", self.mode, MODES, "Choose mode=fit|validate|test.")
        self.model.take_defaults()
        self.optim.take_model_defaults(self.model)
        if self.mode != "fit" and self.ckpt_path is None:
            raise ConfigError(f"mode={self.mode} evaluates a checkpoint: give ckpt_path=<checkpoint directory> "
                              "(or ckpt_path=last with hydra.run.dir=<the run>).")
        self.recompute_policy = self.recompute.to_policy()
        """The run's recompute policy, checked (handed to ``MHCRecomputeCallback``)."""
        if not self.model.is_hf:  # model=hf: against its own streams too, once its config is read (_check_hf_model)
            self.recompute_policy.check_model(self.model.enable_hyper_connections)
        if self.trainer.precision == "bf16-true" and not self.optim.use_distributed_optimizer:
            from lightning_mhc.distributed.optimizer import BF16_WEIGHTS, OPTIMIZERS, check_shardable

            check_shardable(OPTIMIZERS[self.optim.name], f"trainer.precision=bf16-mixed (optim.name={self.optim.name})",
                            f"trainer.precision=bf16-true: {BF16_WEIGHTS}")
        self.layout = ParallelLayout(**{name: getattr(self.parallel, name) for name in DEGREES},
                                     world_size=self.world_size)
        """The run's layout, checked (its degrees in this world)."""
        self._take_tokenizer()
        self._check_batches()
        self.settings = self._strategy_settings()
        """The strategy's settings, checked (``MHCParallelStrategy(settings)``)."""
        if self.model.is_hf:
            self._check_hf_model()

    def check_model(self, *, sizes_only: bool = False) -> None:
        """The GPT under the run's layout (``preflight.to_train_config`` calls it; a Hugging Face
        model is checked with the rest): megatron-core's config built, with its checks and the
        model's and their messages; or, ``sizes_only`` (a plan), the sizes alone under the layout
        (``GPTSizes.check_layout``), which import no megatron-core (seconds)."""
        if self.model.is_hf:
            return
        try:
            if sizes_only:
                self.gpt_sizes().check_layout(self.layout)
            else:
                self._check_model_config()
            self.layout.check_model({}, self.data.seq_length)  # (layers and sizes: checked above)
        except ConfigError as error:
            raise in_config_keys(error) from None

    def _check_model_config(self) -> None:
        from lightning_mhc.model.config import with_parallel_layout

        # megatron's warnings on the model alone (e.g. "moe_ffn_hidden_size is not set") are said
        # only of a model this layout takes: a refused one gets its one line, nothing before it
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("default")
            config = self.transformer_config()  # megatron's and the model's own checks, with their messages
            # the model under this layout: experts over EP, MoE without sequence parallelism
            with_parallel_layout(config, self.layout)
        for warning in said:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)

    # --------------------------------------------------------------- checks
    @property
    def world_size(self) -> int:
        return self.trainer.devices * self.trainer.num_nodes

    @property
    def data_parallel_size(self) -> int:
        return self.layout.data_parallel_size

    @property
    def vocab_size(self) -> int:
        """``model.vocab_size``, or the data's when it is null (padded by the model); model=hf: its
        config.json's (synthetic tokens are drawn below it: a tiny model's vocabulary is under 256)."""
        if self.model.is_hf and self.data.source == "synthetic":
            import json

            return int(json.loads((Path(self.model.hf_dir) / "config.json").read_text())["vocab_size"])
        return self.model.vocab_size or self.data.tokenizer_vocab_size()

    @property
    def num_samples(self) -> list[int | None]:
        """data=megatron: the samples to build per split (``megatron_num_samples``: the run's steps,
        and the batches one evaluation reads of the split this mode evaluates), as the blend needs
        them; preflight checks these numbers and the data module builds them."""
        from lightning_mhc.data.megatron import blend_num_samples, megatron_num_samples, parse_blend

        d = self.data
        sizes = megatron_num_samples(d.global_batch_size, self.trainer.max_steps, self.trainer.limit_val_batches,
                                     evaluated=("test",) if self.mode == "test" else ("validation",))
        return blend_num_samples(sizes, parse_blend(d.blend)[1] is not None, d.split, d.global_batch_size)

    @property
    def num_microbatches(self) -> int:
        d = self.data
        return d.global_batch_size // (d.micro_batch_size * self.data_parallel_size)

    def _take_tokenizer(self) -> None:
        """data=megatron: the tokenizer the data was made with; for model=hf by default the model's
        directory's (its tokenizer.json)."""
        d = self.data
        if d.source != "megatron" or d.tokenizer:
            return
        if not self.model.is_hf:
            raise ConfigError(MEGATRON_NEEDS)
        if not (Path(self.model.hf_dir) / "tokenizer.json").is_file():
            raise ConfigError(f"data.tokenizer=null: {self.model.hf_key} has no tokenizer.json to read the data with; "
                              "give data.tokenizer=<the tokenizer.json the data was preprocessed with>.")
        d.tokenizer = self.model.hf_dir

    def _check_hf_model(self) -> None:
        """model=hf: the model's config against the data, and everything ``parallelize`` refuses on
        this layout (a family without a plan, sizes TP does not divide, too few layers for the
        stages, the hyper-connection plan against the model, a family context parallelism cannot
        split, the pretrained files' tensors), on the model recorded on the meta device: nothing is
        allocated."""
        from lightning_mhc.any_model.record import hf_config, recorded_hf_model
        from lightning_mhc.any_model.families import native_stream_count
        from lightning_mhc.any_model.model import check_parallelize
        from lightning_mhc.any_model.weights import check_weights

        m, d = self.model, self.data
        self.layout.check_model({}, d.seq_length)  # the sequence, where sequence parallelism splits it
        try:
            config = hf_config(m.hf_dir)
            vocab = getattr(config, "vocab_size", None)
            needed = d.tokenizer_vocab_size()
            if d.source != "synthetic" and isinstance(vocab, int) and vocab < needed:
                raise ConfigError(f"its vocab_size={vocab} is smaller than the data's vocabulary ({needed} tokens, "
                                  f"data.source={d.source}); use the tokenizer the model was trained with.")
            positions = getattr(config, "max_position_embeddings", getattr(config, "n_positions", None))
            if isinstance(positions, int) and d.seq_length > positions:
                raise ConfigError(f"data.seq_length={d.seq_length} exceeds its max_position_embeddings={positions}; "
                                  "shorten the sequences.")
            model = recorded_hf_model(m.hf_dir)
            # hyper-connections added, or the family's own (whether mhc_block runs on those: check_parallelize)
            self.recompute_policy.check_model(m.hyper_connection_settings.enabled or native_stream_count(model) > 1,
                                              model_field="hyper_connections")
            _check_built_in_plan(model, m.plan)
            check_parallelize(model, m.plan, layout=self.layout, recompute=self.recompute_policy,
                              hyper_connections=m.hyper_connection_settings,
                              router_bias_update_rate=m.moe_router_bias_update_rate)
            if m.pretrained:
                check_weights(model, m.pretrained)
        except ConfigError as error:
            raise error.within(m.hf_key) from None

    def _check_batches(self) -> None:
        d, dp = self.data, self.data_parallel_size
        per_step = d.micro_batch_size * dp
        if d.global_batch_size % per_step or d.global_batch_size < per_step:
            raise ConfigError(
                f"data.global_batch_size={d.global_batch_size} must be a positive multiple of "
                f"data.micro_batch_size={d.micro_batch_size} x data-parallel size {dp} (trainer.devices x "
                "trainer.num_nodes / (TP * PP)). Change data.global_batch_size or data.micro_batch_size."
            )
        explicit = self.parallel.num_microbatches
        if explicit is not None and explicit != self.num_microbatches:
            raise ConfigError(
                f"parallel.num_microbatches={show(explicit)} disagrees with data.global_batch_size="
                f"{d.global_batch_size} / (data.micro_batch_size={d.micro_batch_size} x DP={dp}) = "
                f"{self.num_microbatches}. Leave parallel.num_microbatches=null or make them agree."
            )
        if d.source == "text" and not d.path:
            raise ConfigError("data.source=text needs data.path (a text file or a folder): add data.path=/path/to/text.")
        if self.model.is_hf:  # its config's vocabulary and positions: _check_hf_model
            return
        needed, given = d.tokenizer_vocab_size(), self.model.vocab_size
        if d.source != "synthetic" and given is not None and given < needed:
            what = f"its tokenizer {d.tokenizer!r} has {needed} tokens" if d.source == "megatron" else "bytes need 256"
            raise ConfigError(
                f"model.vocab_size={given} is smaller than the data's vocabulary (data.source={d.source}: {what}). "
                "Leave model.vocab_size=null to take the data's, or raise it."
            )
        if d.seq_length > self.model.max_sequence_length:
            raise ConfigError(
                f"data.seq_length={d.seq_length} exceeds model.max_sequence_length="
                f"{self.model.max_sequence_length}. Shorten the sequences or raise the model's maximum."
            )

    def _strategy_settings(self) -> ParallelSettings:
        p = self.parallel
        try:
            timeout = datetime.timedelta(seconds=p.timeout_s)
        except (OverflowError, ValueError):
            raise ConfigError(f"parallel.timeout_s={show(p.timeout_s)}: must be a finite number of seconds, e.g. "
                              "600.") from None
        return ParallelSettings(
            self.layout, num_microbatches=self.num_microbatches,
            deallocate_pipeline_outputs=p.deallocate_pipeline_outputs, timeout=timeout, seed=self.seed,
            raise_on_nonfinite_loss=self.trainer.raise_on_nonfinite_loss, measure_activation_memory=True,
            use_distributed_optimizer=self.optim.use_distributed_optimizer)

    # ------------------------------------------------------------- builders
    def gpt_sizes(self):
        """The GPT's sizes (``GPTSizes``: what a plan reads), as ``transformer_config`` would hold them."""
        from lightning_mhc.model.sizes import GPTSizes

        return GPTSizes.from_values(self._model_values())

    def transformer_config(self):
        """The model's config (``MHCGPTModule`` sets the layout and the recompute policy on it when it
        builds the model)."""
        from lightning_mhc.model.config import MHCTransformerConfig

        return MHCTransformerConfig(**self._model_values())

    def _model_values(self) -> dict[str, Any]:
        kwargs = self.model.transformer_kwargs()
        kwargs["vocab_size"] = self.vocab_size
        kwargs["max_sequence_length"] = max(kwargs["max_sequence_length"], self.data.seq_length)
        return kwargs


# ------------------------------------------------------------------ unknown keys
@functools.cache
def _fields(schema: type) -> dict[str, Any]:
    """A schema's field names and their types (a nested schema's type is its dataclass)."""
    hints = typing.get_type_hints(schema)
    return {f.name: hints[f.name] for f in dataclasses.fields(schema)}


def unknown_keys(values: Mapping[str, Any]) -> list[str]:
    """One line per key of ``values`` (a composed config as a plain container, ``hydra`` left out)
    that is not a field of the schema dataclasses: ``<key>=<value>: the <group> group has no key ...``."""
    problems = []
    for key, value, fields, where in _unknown(values, TrainConfig, ""):
        close = difflib.get_close_matches(str(key), list(fields), n=1)
        hint = f" (did you mean {where}{close[0]}?)" if close else ""
        group = f"the {where[:-1]} group" if where else "the top level"
        problems.append(f"{where}{key}={show(value)}: {group} has no key {key!r}{hint}")
    return problems


KEYS_HINT = ("every key is a field of lightning_mhc.cli.schema.TrainConfig or of its groups "
             "(lightning-mhc-train --cfg job prints them)")


def check_known_keys(values: Mapping[str, Any]) -> None:
    """Refuse every key of a composed config (``hydra`` left out) that is not a field of the schema
    dataclasses: Hydra accepts ``+key=value`` additions, which nothing would read. ``values``: the
    config as a plain container (``OmegaConf.to_container(cfg, resolve=False)``)."""
    problems = unknown_keys(values)
    if problems:
        raise ConfigError("; ".join(problems) + f", so nothing would read it. Remove the addition (+key=value) or "
                          f"fix the key's name: {KEYS_HINT}.")


def field_type(key: str) -> Any:
    """The schema's type of a dotted key (``model.num_layers`` -> int), None if it is not a field."""
    schema: Any = TrainConfig
    for part in key.split("."):
        if not dataclasses.is_dataclass(schema) or part not in _fields(schema):
            return None
        schema = _fields(schema)[part]
    return schema


def describe_type(hint: Any) -> str:
    """``int`` -> 'an integer', ``Optional[float]`` -> 'a number or null', ..."""
    args = typing.get_args(hint)
    if type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return describe_type(rest[0] if len(rest) == 1 else Any) + " or null"
    if typing.get_origin(hint) is list:
        return "a list, e.g. [a,b]"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(hint, "a value of its type")


def _unknown(values: Mapping[str, Any], schema: type, prefix: str):
    fields = _fields(schema)
    for key, value in values.items():
        if not prefix and key == "hydra":
            continue
        if key not in fields:
            yield key, value, fields, prefix
        elif dataclasses.is_dataclass(fields[key]) and isinstance(value, Mapping):
            yield from _unknown(value, fields[key], f"{prefix}{key}.")


# ------------------------------------------------------------------ relabelling errors
def _override(value: Any) -> str:
    """A value as an override writes it: ``show``'s, with strings bare (``recompute.policy=mhc_block``)."""
    return value if isinstance(value, str) else show(value)


def _recompute_modules(modules: list[str]) -> str:
    """The policy's modules, where ``recompute.recompute_mlp=true`` may have added ``'mlp'``."""
    return f"recompute.recompute_modules={modules}" + (" / recompute.recompute_mlp=true" if "mlp" in modules else "")


CONFIG_LABELS: dict[str, Label] = {
    **{name: Label(f"model.{name}") for name in _fields(ModelConfig)},
    **{name: Label(f"parallel.{name}") for name in (*DEGREES, "deallocate_pipeline_outputs")},
    "padded_vocab_size": Label("model.vocab_size", "the padded vocabulary {value} (model.vocab_size rounded up to "
                                                   "model.make_vocab_size_divisible_by)"),
    "kv_channels": Label("model.hidden_size", "the head dimension {value} (model.hidden_size / "
                                              "model.num_attention_heads)"),
    "world_size": Label("trainer.devices", "trainer.devices x trainer.num_nodes = {value}"),
    "seq_length": Label("data.seq_length"),
    "num_microbatches": Label("data.global_batch_size", "data.global_batch_size / (data.micro_batch_size x DP) = "
                                                        "{value}"),
    "timeout": Label("parallel.timeout_s", convert=lambda timeout: timeout.total_seconds()),
    "seed": Label("seed"),
    "raise_on_nonfinite_loss": Label("trainer.raise_on_nonfinite_loss"),
    "use_distributed_optimizer": Label("optim.use_distributed_optimizer"),
    **{name: Label(f"optim.{name}") for name in ("lr", "warmup_steps", "min_lr_ratio", "weight_decay",
                                                  "override_scheduler")},
    "max_steps": Label("trainer.max_steps"),
    "policy": Label("recompute.policy"),
    "recompute_modules": Label("recompute.recompute_modules (and set recompute.recompute_mlp=false)",
                               _recompute_modules),
    "mhc_recompute_layer_num": Label("recompute.mhc_recompute_layer_num"),
    "hyper_connections": Label("model.hyper_connections", lambda _: "model.hyper_connections=<n >= 2> (model=hf)"),
    "router_bias_update_rate": Label("model.moe_router_bias_update_rate"),
}
"""The one table from field names of the values the CLI builds (layout, strategy settings, recompute
policy, model config) to its config keys: their errors are relabelled by it (``in_config_keys``)."""

NOT_SET_BY_THE_CLI = ("process_group_backend", "gradient_bucket_bytes", "recompute_granularity",
                      "fine_grained_activation_offloading", "mtp_num_layers", "inference_fuse_tp_communication",
                      "normalization", "overlap_grad_reduce", "measure_activation_memory")
"""Fields a value's error can name that no config key sets (the CLI leaves them at their defaults,
which pass): their errors cannot come through the CLI, so they need no row."""


def in_config_keys(error: ConfigError) -> ConfigError:
    """``error`` (a value's, in its own terms) with its fields named by the config keys."""
    return error.relabel(CONFIG_LABELS, show=_override)
