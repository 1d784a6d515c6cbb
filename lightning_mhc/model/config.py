"""The model configuration: megatron-core's ``TransformerConfig`` plus mHC.

Field names follow megatron-core and Megatron-LM's own mHC (``mhc_*``, arXiv
2512.24880) so that a Megatron user can read them unchanged.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megatron.core.transformer import TransformerConfig

from lightning_mhc.distributed.layout import DEGREES, ParallelLayout
from lightning_mhc.errors import ConfigError, Label, key, term
from lightning_mhc.layers.hyper_connection import HyperConnectionConfig, check_hyper_connection_values
from lightning_mhc.model.sizes import GPTSizes, check_experts_under
from lightning_mhc.recompute.policy import RecomputePolicy

POSITION_EMBEDDING_TYPES = ("rope", "learned_absolute", "none")
MEGATRON_NAMES = {
    "enable_mhc_connections": "enable_hyper_connections",
    "mhc_num_residual_streams": "num_residual_streams",
}
"""Megatron-LM main's name -> ours, for the mHC fields whose names differ. Its block recompute
switch, 'mhc' in ``recompute_modules``, is ours ``recompute_hyper_connections=True``."""


@dataclass
class MHCTransformerConfig(TransformerConfig):
    """``TransformerConfig`` for the mHC GPT model.

    Besides megatron's fields (``num_layers``, ``hidden_size``,
    ``num_attention_heads``, dropouts, ``recompute_*`` ...) it holds the GPT
    fields megatron keeps in its argument parser (vocabulary, sequence length,
    position embedding, tying) and the mHC fields of the block-recompute design.
    """

    normalization: str = "RMSNorm"
    """Overrides megatron's default ('LayerNorm'): the model's norms are RMSNorm."""

    # --- mHC (arXiv 2512.24880; block recompute) ---
    enable_hyper_connections: bool = True
    """Wrap each attention and MLP sub-layer in a manifold-constrained hyper-connection."""
    num_residual_streams: int = 4
    """n: the residual stream is n streams of width hidden_size, stored as [s, b, n*hidden]."""
    mhc_sinkhorn_iterations: int = 20
    """Sinkhorn-Knopp iterations that make H_res doubly stochastic (t_max in the paper)."""
    mhc_init_gating_factor: float = 0.01
    """Initial value of the learnable scalars a_pre, a_post, a_res."""
    recompute_hyper_connections: bool = False
    """Discard hyper-connection and bias-dropout-add outputs after forward and recompute them
    per block of ``mhc_recompute_layer_num`` layers in backward (block recompute: one hook per block)."""
    mhc_recompute_layer_num: int | None = None
    """Layers per recompute block; None: max(1, int(sqrt(n*L/(n+2)))) with L the stage's layers
    (paper eq. 20). Megatron-LM has a field of the same name whose None means something else: the
    whole transformer block (one pipeline stage) is one recompute block. For Megatron's None set
    mhc_recompute_layer_num=num_layers here (a block never crosses a stage)."""
    mhc_implementation: str = "auto"
    """How the hyper-connection ops run: 'fused' (two autograd nodes with analytic backwards, the
    mappings + aggregate and H_res x + H_post^T F + bias-dropout-add, O(n^2) floats saved per token
    besides the stream; C++ kernels on CPU), 'triton' (the same nodes with Triton's kernels),
    'auto' ('triton' on CUDA when Triton imports, else 'fused'), 'compile' (the op-by-op math
    through torch.compile) or 'reference' (the readable op-by-op math, autograd through every op)."""

    # --- Megatron-LM main's names for the mHC fields (d98e8a64), so its config dicts run unchanged.
    # None: not given. __post_init__ moves a given value onto our field and resets the alias to None
    # (so dataclasses.replace and model_config_to_dict see only our names). Giving both names with
    # different values is a ConfigError; our field at its default counts as not given. Megatron's
    # recompute switch, 'mhc' in recompute_modules, is taken too: it sets recompute_hyper_connections
    # and is removed from the list.
    enable_mhc_connections: bool | None = None
    """Megatron-LM's name for enable_hyper_connections. False also makes num_residual_streams 1
    (Megatron ignores mhc_num_residual_streams when mHC is off) unless num_residual_streams, our
    name, is set to something other than its default."""
    mhc_num_residual_streams: int | None = None
    """Megatron-LM's name for num_residual_streams."""

    # --- GPT fields megatron keeps outside TransformerConfig ---
    vocab_size: int = 256
    """Vocabulary size before padding."""
    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this (independent of TP, so every layout has the same
    logits); the padded size must then divide by the tensor-parallel size."""
    max_sequence_length: int = 2048
    position_embedding_type: str = "rope"
    """'rope', 'learned_absolute' or 'none'."""
    rotary_base: int = 10000
    share_embeddings_and_output_weights: bool = True
    exact_hidden_dropout: bool = False
    """Draw the residual-stream dropout masks (embedding, bias-dropout-adds) as a layout without
    TP and CP draws them: each rank draws the mask of the whole sequence and keeps its rows (its CP
    chunks, its sequence-parallel slice), so TP and CP leave training with hidden_dropout as it is
    at TP 1 and CP 1 (one process's, with DP and PP at 1). Off by default, as megatron: it costs cp
    (x tp under sequence parallelism) times the random draws and a transient whole-sequence mask
    per dropout, the memory CP is there to save. With TP or CP it refuses attention_dropout > 0
    (SDPA draws inside; it cannot keep one process's masks) and takes the reference's ops for the
    hyper-connection bias-dropout-add (the Triton kernels draw inside too)."""
    init_seed: int = 1234
    """Seed of the parameter initialisation. Every parameter is drawn from its own generator,
    seeded by (init_seed, the parameter's global name), so a model has the same weights under
    every TP/PP layout."""

    def __post_init__(self) -> None:
        megatron_names = self._take_megatron_names()  # before megatron's checks, which refuse 'mhc'
        # Everything runs through megatron's CPU-master initialisation: it draws the full
        # weight and keeps this rank's shard, which makes weights independent of TP.
        self.use_cpu_initialization = True
        if self.normalization != "RMSNorm":
            raise ConfigError(term("normalization", self.normalization), " is not supported: the mHC model uses "
                              "RMSNorm. Set ", term("normalization", "RMSNorm"), ".")
        # before megatron's own checks, which would answer some of them with an unrelated message
        check_supported_options({f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
                                who="MHCTransformerConfig")
        self._validate_moe()
        super().__post_init__()
        self._validate_mhc(megatron_names)
        self._validate_gpt()

    # ------------------------------------------------------------- Megatron-LM names
    def _take_megatron_names(self) -> dict[str, str]:
        """Move Megatron-LM's spellings onto our fields (``MEGATRON_NAMES``, 'mhc' in
        recompute_modules); return our field name -> how the user spelled it, for messages."""
        defaults = {f.name: _default(f) for f in dataclasses.fields(self)}
        spelled: dict[str, str] = {}
        for alias, ours in MEGATRON_NAMES.items():
            value = getattr(self, alias)
            if value is None:
                continue
            mine = getattr(self, ours)
            if not _same(mine, defaults[ours]) and not _same(mine, value):
                raise ConfigError(
                    f"{alias}={value!r} and {ours}={mine!r}: {alias} is Megatron-LM's name for {ours} "
                    f"and the two disagree. Give one of them (or the same value to both)."
                )
            setattr(self, ours, value)
            setattr(self, alias, None)
            spelled[ours] = alias
        if (spelled.get("enable_hyper_connections") and self.enable_hyper_connections is False
                and ("num_residual_streams" in spelled
                     or _same(self.num_residual_streams, defaults["num_residual_streams"]))):
            self.num_residual_streams = 1  # Megatron-LM ignores its stream count with mHC off
            spelled.pop("num_residual_streams", None)
        modules = self.recompute_modules
        if isinstance(modules, (list, tuple)) and "mhc" in modules:
            self.recompute_modules = [m for m in modules if m != "mhc"]
            self.recompute_hyper_connections = True
            spelled["recompute_hyper_connections"] = "'mhc' in recompute_modules"
            spelled["recompute_modules"] = repr(list(modules))
        return spelled

    # ------------------------------------------------------------------ checks
    def _validate_mhc(self, megatron_names: Mapping[str, str] | None = None) -> None:
        """Our rules and Megatron-LM's for the mHC fields. ``megatron_names``: our field -> the
        Megatron-LM spelling the user gave (``_take_megatron_names``), which the errors name."""
        try:
            self._validate_mhc_values()
            self._validate_mhc_recompute()
            self._validate_mhc_companions()
        except ConfigError as error:
            raise error.relabel(self._spelling_labels(megatron_names or {})) from None

    def _validate_mhc_values(self) -> None:
        """Each mHC field's own range (and the stream count hyper-connections off allow)."""
        if self.num_residual_streams < 1:
            raise ConfigError(term("num_residual_streams", self.num_residual_streams),
                              ": need at least 1 stream (the paper uses 4).")
        if not self.enable_hyper_connections and self.num_residual_streams != 1:
            raise ConfigError(
                term("enable_hyper_connections", False), " with ", term("num_residual_streams", self.num_residual_streams),
                ": without hyper-connections there is one residual stream. Set ", key("num_residual_streams"), "=1 or ",
                key("enable_hyper_connections"), "=True.")
        # the hyper-connection's own settings, checked as the Hugging Face wing checks them
        check_hyper_connection_values(self.mhc_sinkhorn_iterations, self.mhc_implementation,
                                      self.mhc_init_gating_factor)

    def _validate_mhc_recompute(self) -> None:
        """The recompute fields select a valid policy (``RecomputePolicy.of_config``: the policy's
        rules), and what megatron adds for block recompute."""
        RecomputePolicy.of_config(self)
        if self.recompute_hyper_connections and getattr(self, "fine_grained_activation_offloading", False):
            raise ConfigError(
                term("policy", "mhc_block"), " with ", term("fine_grained_activation_offloading", True),
                ": Megatron-LM does not support the two together (its mHC recompute hook fires before the offloading "
                "chunk exists) and this model does not offload. Set ",
                term("fine_grained_activation_offloading", False), ".")

    def _validate_mhc_companions(self) -> None:
        """Megatron features that do not combine with hyper-connections."""
        if not self.enable_hyper_connections:
            return
        if getattr(self, "mtp_num_layers", None) is not None:
            raise ConfigError(
                term("enable_hyper_connections", True), " with ", term("mtp_num_layers", self.mtp_num_layers),
                ": Multi-Token Prediction does not combine with hyper-connections (Megatron-LM refuses it too) and "
                "this model has no MTP head. Leave ", term("mtp_num_layers", None), ".")
        if getattr(self, "inference_fuse_tp_communication", False):
            raise ConfigError(
                term("enable_hyper_connections", True), " with ", term("inference_fuse_tp_communication", True),
                ": the fused inference tensor-parallel path assumes one residual stream (Megatron-LM refuses it "
                "too). Set ", term("inference_fuse_tp_communication", False), ".")

    def _spelling_labels(self, spelled: Mapping[str, str]) -> dict[str, Label]:
        """How the mHC checks' errors name this config's fields: as the user spelled them
        (``spelled``: our field -> the Megatron-LM name given), and the recompute policy as the
        fields that selected it."""
        labels = {ours: Label(alias, "{key}={value} (Megatron-LM's name for %s)" % ours)
                  for ours, alias in spelled.items() if ours in MEGATRON_NAMES.values()}
        switch = ("'mhc' in recompute_modules (Megatron-LM's switch for recompute_hyper_connections=True)"
                  if "recompute_hyper_connections" in spelled else "recompute_hyper_connections=True")
        labels["policy"] = Label("recompute_granularity", lambda policy: (
            switch if policy == "mhc_block" else f"recompute_granularity={self.recompute_granularity!r}"))
        if "recompute_modules" in spelled:  # the list as given, 'mhc' included
            given = spelled["recompute_modules"]
            labels["recompute_modules"] = Label("recompute_modules", lambda _: f"recompute_modules={given}")
        return labels

    def _validate_moe(self) -> None:
        """The mixture-of-experts fields (megatron's names), before megatron's own checks, which
        answer some of them with an assertion or an unrelated message."""
        from lightning_mhc.model.moe_mlp import LOAD_BALANCING_TYPES, moe_config

        experts = self.num_moe_experts
        check_experts_under(experts, self.expert_model_parallel_size, self.sequence_parallel)
        if not experts:
            return
        if not 1 <= self.moe_router_topk <= experts:
            raise ConfigError(term("moe_router_topk", self.moe_router_topk), " must be between 1 and ",
                              term("num_moe_experts", experts), ".")
        if (self.moe_router_topk == 1 and self.moe_router_score_function == "softmax"
                and not self.moe_router_pre_softmax):
            raise ConfigError(term("moe_router_topk", 1), " with a softmax after the top-k gives every token the "
                              "weight 1 and the router no gradient (megatron refuses it too): set ",
                              term("moe_router_pre_softmax", True), ".")
        if self.moe_router_load_balancing_type not in LOAD_BALANCING_TYPES:
            raise ConfigError(term("moe_router_load_balancing_type", self.moe_router_load_balancing_type),
                              f" is not implemented: choose one of {', '.join(LOAD_BALANCING_TYPES)}.")
        freq = self.moe_layer_freq
        if isinstance(freq, bool) or not (
                (isinstance(freq, int) and freq >= 1)
                or (isinstance(freq, (list, tuple)) and len(freq) == self.num_layers and set(freq) <= {0, 1})):
            raise ConfigError(term("moe_layer_freq", freq), ": give an int >= 1 (every that many layers, from the "
                              f"first) or a list of {self.num_layers} zeros and ones (one per layer).")
        try:
            moe_config(self)
        except ValueError as error:
            raise ConfigError(term("num_moe_experts", experts), f": {error}.") from None

    def _validate_gpt(self) -> None:
        if (self.exact_hidden_dropout and self.attention_dropout > 0
                and (self.tensor_model_parallel_size > 1 or self.context_parallel_size > 1)):
            raise ConfigError(
                term("exact_hidden_dropout", True), " with ", term("attention_dropout", self.attention_dropout),
                " under ", term("tensor_model_parallel_size", self.tensor_model_parallel_size), ", ",
                term("context_parallel_size", self.context_parallel_size), ": the attention's dropout, drawn inside "
                "SDPA on this rank's heads and queries, cannot draw one process's masks. Set ",
                term("attention_dropout", 0), " or ", term("exact_hidden_dropout", False), ".")
        if self.position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ConfigError(term("position_embedding_type", self.position_embedding_type),
                              f": choose one of {', '.join(POSITION_EMBEDDING_TYPES)}.")
        if self.vocab_size < 1 or self.max_sequence_length < 1:
            raise ConfigError(term("vocab_size", self.vocab_size), ", ",
                              term("max_sequence_length", self.max_sequence_length), ": both must be positive.")
        if self.position_embedding_type == "rope" and self.kv_channels % 2:
            raise ConfigError(
                term("position_embedding_type", "rope"), " needs an even head dimension, got ",
                term("kv_channels", self.kv_channels), " (hidden_size / num_attention_heads). Change ",
                key("hidden_size"), " or ", key("num_attention_heads"), ".")

    def split_sizes(self) -> dict[str, int]:
        """The sizes tensor parallelism splits in this model (``ParallelLayout.check_model``)."""
        return GPTSizes.of(self).split_sizes()

    # --------------------------------------------------------------- derived
    @property
    def padded_vocab_size(self) -> int:
        return GPTSizes.of(self).padded_vocab_size

    @property
    def hyper_connection(self) -> HyperConnectionConfig:
        """What each of the layers' hyper-connections is built with."""
        return HyperConnectionConfig.of(self)

    @property
    def residual_width(self) -> int:
        """Width of the stored residual stream: n * hidden_size."""
        return self.num_residual_streams * self.hidden_size


# ------------------------------------------------------------ layout and unsupported options
PARALLEL_LAYOUT_FIELDS = (
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
    "pipeline_model_parallel_layout", "sequence_parallel", "context_parallel_size",
    "hierarchical_context_parallel_sizes", "hybrid_context_parallel", "expert_model_parallel_size",
    "expert_tensor_parallel_size", "microbatch_group_size_per_vp_stage", "pipeline_dtype",
)
"""The parallel layout: the strategy's, set on the config when the model is built
(``with_parallel_layout``), never written by ``config_dict.model_config_to_dict``."""

_NOT_RUN = ("which the strategy does not run (it runs tensor, sequence, context, pipeline, virtual-pipeline, "
            "expert and data parallelism)")
_NOT_BUILT = "which the model does not implement"
_CONTEXT_PARALLEL = (_NOT_RUN, "Leave {name} at its default ({default!r}); context_parallel_size splits "
                               "the sequence over ranks with all-gathered K/V")
UNSUPPORTED_OPTIONS: dict[str, tuple[str, str]] = {
    "pipeline_model_parallel_layout": (_NOT_RUN, "Leave it None: every stage holds num_layers / "
                                                 "pipeline_model_parallel_size layers"),
    "hierarchical_context_parallel_sizes": _CONTEXT_PARALLEL,
    "hybrid_context_parallel": _CONTEXT_PARALLEL,
    "fp32_residual_connection": (_NOT_BUILT, "Leave it False (the residual streams keep params_dtype); for an "
                                             "fp32 residual train in fp32 (precision 32-true)"),
}
"""Megatron options this project does not implement: name -> (why, what to do instead). One rule
for ``MHCTransformerConfig.__post_init__`` and for the layout a module's ``model_config`` asks for
(``requested_parallel_layout`` / ``with_parallel_layout``): any value but megatron's default is refused."""

_UNSUPPORTED_PARALLELISM = tuple(name for name in UNSUPPORTED_OPTIONS if name in PARALLEL_LAYOUT_FIELDS)


def check_supported_options(values: Mapping[str, Any], who: str = "model_config") -> None:
    """Raise ConfigError for the first of ``values`` that sets an ``UNSUPPORTED_OPTIONS`` entry to
    anything but megatron's default, naming the option, its value and what to use instead."""
    defaults = _megatron_defaults()
    for name, (what, instead) in UNSUPPORTED_OPTIONS.items():
        if name in values and not _same(values[name], defaults[name]):
            raise ConfigError(f"{who} sets {name}={values[name]!r}, {what}. "
                              + instead.format(name=name, default=defaults[name]) + ".")


@functools.cache
def _megatron_defaults() -> dict[str, Any]:
    return {f.name: _default(f) for f in dataclasses.fields(TransformerConfig)}

def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, functools.partial) and isinstance(b, functools.partial):
        return a.func is b.func and a.args == b.args and a.keywords == b.keywords
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:
        return False


def requested_parallel_layout(model_config: MHCTransformerConfig | Mapping[str, Any]) -> dict[str, Any]:
    """The layout a user's model config asks for, which ``with_parallel_layout`` checks against the
    strategy's: a dict's layout keys (a ``None`` value, megatron's "not set", asks nothing), a
    config's layout fields that are not megatron's defaults."""
    names = (*DEGREES, *_UNSUPPORTED_PARALLELISM)
    if isinstance(model_config, Mapping):
        requested = {k: model_config[k] for k in names if model_config.get(k) is not None}
        check_supported_options(requested)  # refused when the module is made, not when it is built
        return requested
    defaults = {f.name: _default(f) for f in dataclasses.fields(MHCTransformerConfig)}
    return {k: getattr(model_config, k) for k in names if not _same(getattr(model_config, k), defaults[k])}


def with_parallel_layout(config: MHCTransformerConfig, layout: ParallelLayout,
                         requested: Mapping[str, Any] | None = None) -> MHCTransformerConfig:
    """A copy of ``config`` that records the layout the model is built under (the strategy's),
    checked against it (``ParallelLayout.check_model``: layers over the stages, sizes over TP).

    ``requested``: what the user's model config asked for (``requested_parallel_layout``); a
    TP / PP / virtual pipeline / sequence parallelism that differs, or parallelism the strategy
    does not run, raises ConfigError.
    """
    degrees = {name: getattr(layout, name) for name in DEGREES}
    requested = dict(requested or {})
    for name, value in requested.items():
        if name in degrees and value != degrees[name]:
            strategy = ", ".join(f"{k}={v}" for k, v in degrees.items())
            raise ConfigError(
                f"model_config sets {name}={value}, but the strategy runs {strategy}. "
                f"The parallel layout comes from the strategy (MHCParallelStrategy's {name}): drop {name} "
                f"from model_config, or make it {degrees[name]}."
            )
    check_supported_options(requested)
    layout.check_model({"num_layers": config.num_layers, **config.split_sizes()})
    tp, pp = layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size
    updates: dict[str, Any] = dict(degrees)
    if pp > 1 and config.pipeline_dtype is None:
        updates["pipeline_dtype"] = config.params_dtype  # megatron requires it with PP
    if config.expert_tensor_parallel_size == config.tensor_model_parallel_size:  # derived from TP
        # the MoE layers do not split their experts over TP (each TP rank runs them all on the same
        # tokens), which megatron spells expert_tensor_parallel_size=1; its groups still put the
        # ranks of one TP rank together in the EP group (the layout builds them with ETP = TP)
        updates["expert_tensor_parallel_size"] = 1 if config.num_moe_experts else tp
    if config.microbatch_group_size_per_vp_stage == config.pipeline_model_parallel_size:  # derived from PP
        updates["microbatch_group_size_per_vp_stage"] = pp
    return dataclasses.replace(config, **updates)
