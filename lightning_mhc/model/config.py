"""The model configuration: megatron-core's ``TransformerConfig`` plus mHC.

Field names follow megatron-core and Megatron-LM's own mHC (seed 000,
REFERENCES.md) so that a Megatron user can read them unchanged.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from megatron.core.transformer import TransformerConfig

from lightning_mhc.errors import ConfigError
from lightning_mhc.recompute.policy import SUPPORTED_MODULES

POSITION_EMBEDDING_TYPES = ("rope", "learned_absolute", "none")


@dataclass
class MHCTransformerConfig(TransformerConfig):
    """``TransformerConfig`` for the mHC GPT model.

    Besides megatron's fields (``num_layers``, ``hidden_size``,
    ``num_attention_heads``, dropouts, ``recompute_*`` ...) it holds the GPT
    fields megatron keeps in its argument parser (vocabulary, sequence length,
    position embedding, tying) and the mHC fields of seed 000.
    """

    normalization: str = "RMSNorm"
    """Overrides megatron's default ('LayerNorm'): the model's norms are RMSNorm."""

    # --- mHC (seed 000, arXiv 2512.24880) ---
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
    per block of ``mhc_recompute_layer_num`` layers in backward (seed 000)."""
    mhc_recompute_layer_num: int | None = None
    """Layers per recompute block; None: max(1, int(sqrt(n*L/(n+2)))) with L the stage's layers."""

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
    init_seed: int = 1234
    """Seed of the parameter initialisation. Every parameter is drawn from its own generator,
    seeded by (init_seed, the parameter's global name), so a model has the same weights under
    every TP/PP layout."""

    def __post_init__(self) -> None:
        # Everything runs through megatron's CPU-master initialisation: it draws the full
        # weight and keeps this rank's shard, which makes weights independent of TP.
        self.use_cpu_initialization = True
        if self.normalization != "RMSNorm":
            raise ConfigError(
                f"normalization={self.normalization!r} is not supported: the mHC model uses "
                "RMSNorm. Set normalization='RMSNorm'."
            )
        super().__post_init__()
        self._validate_mhc()
        self._validate_gpt()

    # ------------------------------------------------------------------ checks
    def _validate_mhc(self) -> None:
        if self.num_residual_streams < 1:
            raise ConfigError(
                f"num_residual_streams={self.num_residual_streams}: need at least 1 stream "
                "(the paper uses 4)."
            )
        if self.mhc_sinkhorn_iterations < 1:
            raise ConfigError(
                f"mhc_sinkhorn_iterations={self.mhc_sinkhorn_iterations}: need at least 1 "
                "Sinkhorn-Knopp iteration (default 20)."
            )
        if not self.enable_hyper_connections and self.num_residual_streams != 1:
            raise ConfigError(
                f"enable_hyper_connections=False with num_residual_streams="
                f"{self.num_residual_streams}: without hyper-connections there is one residual "
                "stream. Set num_residual_streams=1 or enable_hyper_connections=True."
            )
        if self.mhc_recompute_layer_num is not None and self.mhc_recompute_layer_num < 1:
            raise ConfigError(
                f"mhc_recompute_layer_num={self.mhc_recompute_layer_num}: a recompute block "
                "holds at least one layer. Use a positive number or None for the paper's default."
            )
        if self.recompute_granularity == "selective":
            unsupported = sorted(set(self.recompute_modules or []) - set(SUPPORTED_MODULES))
            if unsupported:
                raise ConfigError(
                    f"recompute_modules={self.recompute_modules}: {unsupported} not supported by "
                    f"this model; choose from {', '.join(SUPPORTED_MODULES)}."
                )
        if self.recompute_hyper_connections:
            if not self.enable_hyper_connections:
                raise ConfigError(
                    "recompute_hyper_connections=True needs enable_hyper_connections=True: there "
                    "are no hyper-connection activations to recompute. Enable hyper-connections "
                    "or turn recompute_hyper_connections off."
                )
            if self.recompute_granularity != "selective":
                raise ConfigError(
                    f"recompute_hyper_connections=True needs recompute_granularity='selective' "
                    f"(got {self.recompute_granularity!r}). Set recompute_granularity='selective'."
                )
            if "mlp" in (self.recompute_modules or []):
                raise ConfigError(
                    f"recompute_hyper_connections=True cannot be combined with 'mlp' in "
                    f"recompute_modules={self.recompute_modules} (recompute_mlp): the two "
                    "checkpoint mechanisms conflict (seed 000). Remove 'mlp' from "
                    "recompute_modules."
                )

    def _validate_gpt(self) -> None:
        if self.position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ConfigError(
                f"position_embedding_type={self.position_embedding_type!r}: choose one of "
                f"{', '.join(POSITION_EMBEDDING_TYPES)}."
            )
        if self.vocab_size < 1 or self.max_sequence_length < 1:
            raise ConfigError(
                f"vocab_size={self.vocab_size}, max_sequence_length={self.max_sequence_length}: "
                "both must be positive."
            )
        if self.position_embedding_type == "rope" and self.kv_channels % 2:
            raise ConfigError(
                f"position_embedding_type='rope' needs an even head dimension, got kv_channels="
                f"{self.kv_channels} (hidden_size/num_attention_heads). Change hidden_size or "
                "num_attention_heads."
            )

    def validate_tensor_parallel(self, tp_size: int) -> None:
        """Check every dimension that tensor parallelism splits; raise naming the fix."""
        checks = [
            ("num_attention_heads", self.num_attention_heads),
            ("num_query_groups", self.num_query_groups),
            ("ffn_hidden_size", self.ffn_hidden_size),
            ("padded vocabulary (vocab_size padded to make_vocab_size_divisible_by)",
             self.padded_vocab_size),
        ]
        for name, value in checks:
            if value % tp_size:
                raise ConfigError(
                    f"{name}={value} is not divisible by tensor_model_parallel_size={tp_size}. "
                    f"Choose a tensor-parallel size that divides {value}, or change {name.split()[0]}."
                )

    # --------------------------------------------------------------- derived
    @property
    def padded_vocab_size(self) -> int:
        m = self.make_vocab_size_divisible_by
        return int(math.ceil(self.vocab_size / m) * m)

    @property
    def residual_width(self) -> int:
        """Width of the stored residual stream: n * hidden_size."""
        return self.num_residual_streams * self.hidden_size

    def recompute_layer_num(self, stage_layers: int) -> int:
        """Layers per mHC recompute block on a stage of ``stage_layers`` layers (paper eq. 20)."""
        if self.mhc_recompute_layer_num is not None:
            return min(self.mhc_recompute_layer_num, stage_layers)
        n = self.num_residual_streams
        return max(1, int(math.sqrt(n * stage_layers / (n + 2))))
