"""Any model as written, split and retrofitted: tensor, pipeline and data parallelism for a
model as written (a Hugging Face model, or any PyTorch transformer with a list of repeated
blocks), without rewriting it on megatron layers, and mHC added to it.

    with record_module_init():                       # meta device: nothing allocated
        model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=128, n_head=4))
    model = parallelize(model, plan="gpt2", layout=layout)   # this rank's stage and TP slices

- ``record.py``: meta construction with recorded constructor arguments; materialising a module
  from them with name-seeded generators (layout-invariant initial weights);
- ``plan.py``: TP plans by module-name patterns and their checks; ``hc_plan.py``: where
  hyper-connections go in a block; ``families.py``: one record per built-in Hugging Face family
  (16 ``model_type`` names) holding every capability (TP and hyper-connection plans, the pipeline's
  parts, CP, EP, the router's aux loss), chosen by ``model_type`` with ``plan="auto"``;
- ``experts.py``: Hugging Face mixture-of-experts models (Mixtral, Qwen2/3-MoE, OLMoE) under
  expert parallelism: each EP rank's experts, the token exchange, their per-expert weights;
- ``tensor_parallel.py``: the styles applied in place with megatron-core's TP mappings, the
  logits layer, and the tensor-parallel pass that builds this rank's chunks; ``placement.py``:
  the words TP, LoRA's adapters and the weights share (strided runs, a shard, ``Placement``);
- ``pipeline.py``: the block list, the stage split, stubs for parts on other stages, the hooks
  between stages;
- ``model.py``: :func:`parallelize`, a conductor of passes, one per dimension, each in the file of
  its dimension (``plan.py``, ``pipeline.py``, ``context_parallel.py``, ``experts.py``,
  ``tensor_parallel.py``, ``hyper_connections.py``, ``recompute.py``, ``weights.py``), its checks
  before launch (:func:`check_parallelize`), and :func:`build_recorded_module` (the whole model in
  one process, same weights); ``parallel_model.py``: :class:`ParallelModel` (the pipeline contract);
- ``weights.py``: pretrained safetensors read stage by stage and TP slice by slice;
- ``hyper_connections.py``: mHC for any model: ``add_hyper_connections`` (``parallelize(...,
  hyper_connections=n)``) rewires each block's branches around the project's hyper-connection
  module, exactly preserving the model's function at step 0;
- ``export.py``: a parallel run's checkpoint into the plain model (``load_checkpoint``) and out as
  ``save_pretrained`` safetensors (``export_pretrained``); the hyper-connections beside a base
  model (``save_hyper_connections``, which a hyper-connected model's ``save_pretrained`` calls)
  and both read back (``load_pretrained``).

No Lightning import: ``lightning_mhc.lightning.ParallelLMModule`` is the LightningModule side.
"""
from lightning_mhc.any_model.families import FAMILIES, HC_PLANS, PLANS, Family, FamilyRecord, supported_families
from lightning_mhc.any_model.hc_plan import Branch, HyperConnectionPlan
from lightning_mhc.any_model.hyper_connections import (
    HyperConnectionSettings, add_hyper_connections, hyper_connection_modules)
from lightning_mhc.any_model.export import consolidated_state_dict, export_pretrained, load_checkpoint, load_pretrained
from lightning_mhc.any_model.hc_files import save_hyper_connections
from lightning_mhc.any_model.model import build_recorded_module, check_parallelize, parallelize
from lightning_mhc.any_model.parallel_model import MaterializedReport, ParallelModel
from lightning_mhc.any_model.plan import (
    GPT2, GPT_NEOX, LLAMA, OPT, PHI3, QWEN3, Column, Replicate, ReplicateOnSplit, Row, TPPlan, VocabEmbedding,
    check_plan)
from lightning_mhc.any_model.record import record_module_init

__all__ = [
    "Branch", "FAMILIES", "Family", "FamilyRecord", "GPT2", "GPT_NEOX", "HC_PLANS", "HyperConnectionPlan", "HyperConnectionSettings",
    "add_hyper_connections", "LLAMA", "OPT", "PHI3", "PLANS", "QWEN3", "Column", "MaterializedReport", "ParallelModel",
    "Replicate", "ReplicateOnSplit", "Row", "TPPlan", "VocabEmbedding", "build_recorded_module", "check_parallelize", "check_plan",
    "consolidated_state_dict", "export_pretrained", "hyper_connection_modules",
    "load_checkpoint", "load_pretrained", "parallelize", "record_module_init", "save_hyper_connections",
    "supported_families",
]

