"""``HFCausalLMModule``: a Hugging Face causal LM from its directory, split by ``parallelize``, with
hyper-connections added when asked (``lightning-mhc-train model=hf``).

    module = HFCausalLMModule("path/to/llama", pretrained=True, hyper_connections=4)
    Trainer(strategy=MHCParallelStrategy(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
            callbacks=[MHCRecomputeCallback("mhc_block")], devices=4).fit(module, datamodule=data)

Every rank builds the model from the directory's ``config.json`` on the meta device and
materialises only its part: with ``pretrained=True`` from the directory's safetensors (read slice
by slice), else drawn from ``seed``. The hyperparameters (saved in checkpoints) are the directory
and these settings, so ``HFCausalLMModule.whole_model(hparams)`` rebuilds the model in one process.
"""
from __future__ import annotations

import json
from typing import Any

from torch import nn

from lightning_mhc.errors import ConfigError
from lightning_mhc.lightning.modules.base import OPTIMIZERS
from lightning_mhc.lightning.modules.parallel_lm import ParallelLMModule
from lightning_mhc.any_model.hyper_connections import HyperConnectionSettings, add_hyper_connections
from lightning_mhc.any_model.record import hf_config, recorded_hf_model


class HFCausalLMModule(ParallelLMModule):
    """A Hugging Face causal LM of any built-in family (``parallelize``'s plans), on any TP x PP x DP,
    and CP for the families ``parallelize`` splits over it (Llama, Mistral, Qwen2, Qwen3 without a
    sliding window; the others refused when the model is built).

    Args:
        model_dir: a ``save_pretrained`` directory (its ``config.json``; with ``pretrained`` its
            safetensors too).
        pretrained: start from the directory's weights; False: fresh weights drawn from ``seed``.
        hyper_connections: ``n`` residual streams with hyper-connections added (exact at step 0:
            ``lightning_mhc.any_model.hyper_connections``); None or 1: the model as it is.
        plan: the tensor-parallel plan (``"auto"``: by the config's ``model_type``).
        seed: the initialisation seed (fresh weights, and the hyper-connections' parameters).
        optimizer, lr, weight_decay, betas, warmup_steps, min_lr_ratio: the optimizer recipe
            (``warmup_cosine_optimizer``).
        override_scheduler: resuming from a checkpoint of another schedule follows this one from the
            checkpoint's step (without it, refused: ``WarmupCosineSchedule``).
        implementation: the hyper-connections' ops (``mhc_implementation``).
        router_bias_update_rate: auxiliary-free balancing of a family whose routers carry a
            score-correction bias (DeepSeek-V4's; ``parallelize``'s argument); 0: the bias stays.
        peak_flops: one device's peak FLOP/s, for the logged ``mfu``; None: the figure of a known
            GPU (``lightning_mhc.model.flops``), and no ``mfu`` on CPU or an unknown device.
    """

    def __init__(self, model_dir: str, pretrained: bool = False, hyper_connections: int | None = None,
                 plan: str = "auto", seed: int = 0, optimizer: str = "adamw", lr: float = 3e-4,
                 weight_decay: float = 0.1, betas: tuple[float, float] = (0.9, 0.95), warmup_steps: int = 0,
                 min_lr_ratio: float = 0.1, implementation: str = "auto", peak_flops: float | None = None,
                 override_scheduler: bool = False, router_bias_update_rate: float = 0.0) -> None:
        super().__init__(lr=lr, weight_decay=weight_decay, betas=betas)
        self.peak_flops = peak_flops
        self._forward_flops: tuple[float, float] | None = None
        """The whole model's forward FLOPs per token, ``(fixed, per position)``, read in ``configure_model``."""
        if optimizer not in OPTIMIZERS:
            raise ConfigError(f"optimizer={optimizer!r}: choose one of {', '.join(OPTIMIZERS)}.")
        self.save_hyperparameters()
        self.model_dir, self.pretrained, self.plan, self.seed = str(model_dir), pretrained, plan, seed
        self.hyper_connection_settings = HyperConnectionSettings.of(hyper_connections, seed, implementation)
        self.optimizer_name, self.warmup_steps, self.min_lr_ratio = optimizer, warmup_steps, min_lr_ratio
        self.override_scheduler = override_scheduler
        self.router_bias_update_rate = router_bias_update_rate

    def configure_model(self) -> None:
        if self.model is None:
            recorded = recorded_hf_model(self.model_dir)
            self._forward_flops = _forward_flops_of(recorded, self.hyper_connection_settings)
            self.model = self.parallelize(recorded, self.plan, seed=self.seed,
                                          weights=self.model_dir if self.pretrained else None,
                                          hyper_connections=self.hyper_connection_settings,
                                          router_bias_update_rate=self.router_bias_update_rate)

    def flops_per_token(self, seq_length: int) -> float | None:
        """Training FLOPs per token of the whole model (3 x forward: ``module_forward_flops_terms``
        read off the model before it was split), for ``mfu``."""
        if self._forward_flops is None:
            return None
        fixed, per_position = self._forward_flops
        return 3 * (fixed + per_position * seq_length)

    def configure_optimizers(self, max_steps: int | None = None):
        return self.warmup_cosine_optimizer(self.optimizer_name, self.lr, self.weight_decay, self.betas,
                                            self.warmup_steps, self.min_lr_ratio, max_steps,
                                            override_scheduler=self.override_scheduler)

    @staticmethod
    def whole_model(hparams: dict[str, Any]) -> nn.Module:
        """The whole model of a run with these hyperparameters, in this process, materialised
        (its base weights as the directory's config builds them; load a checkpoint into it with
        ``lightning_mhc.any_model.load_checkpoint``), its hyper-connections added."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(hf_config(hparams["model_dir"]), dtype="float32")
        settings = HyperConnectionSettings.of(hparams.get("hyper_connections"), hparams.get("seed", 0),
                                              hparams.get("implementation", "auto"))
        return add_hyper_connections(model, settings)


def _forward_flops_of(model: nn.Module, settings: HyperConnectionSettings) -> tuple[float, float]:
    """A whole Hugging Face model's forward FLOPs per token as ``(fixed, per position)``: the forward
    at sequence length ``s`` is ``fixed + s x per position`` (``module_forward_flops_terms``; its
    shapes are read before ``parallelize`` splits it)."""
    from lightning_mhc.model.flops import module_forward_flops_terms

    config = model.config
    heads, hidden = config.num_attention_heads, config.hidden_size
    width = heads * (getattr(config, "head_dim", None) or hidden // heads)
    terms = module_forward_flops_terms(model, 1, config.num_hidden_layers, width, settings.num_residual_streams,
                                       settings.sinkhorn_iterations, hidden)
    per_position = terms.pop("attention_scores")
    return float(sum(terms.values())), float(per_position)
