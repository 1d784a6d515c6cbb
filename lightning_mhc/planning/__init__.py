"""Planning a layout before launch: each rank's parameter, gradient and optimizer bytes for a layout
of the mHC GPT, counted from its config by arithmetic (``shapes``: the tensors the runtime's modules
make; no model built, no process group started), the retained activations (``activations``) and
the bytes each rank sends per step (``traffic``); a Hugging Face model's model states (``hf``:
counted by ``parallelize``'s own passes on the meta device) and its retained activations
and traffic (``hf_activations``: its stages' forward and backward traced on the meta device)."""
from lightning_mhc.planning.memory import RankBytes, StageCount, parse_bytes, plan_gpt, rank_bytes, stage_counts
from lightning_mhc.planning.hf import hf_stage_counts, plan_hf
from lightning_mhc.planning.activations import plan_activations
from lightning_mhc.planning.hf_activations import plan_hf_activations, plan_hf_traffic
from lightning_mhc.planning.schedule import bubble
from lightning_mhc.planning.traffic import StageTraffic, plan_traffic

__all__ = ["RankBytes", "StageCount", "StageTraffic", "bubble", "hf_stage_counts", "parse_bytes", "plan_activations",
           "plan_gpt", "plan_hf", "plan_hf_activations", "plan_hf_traffic", "plan_traffic", "rank_bytes", "stage_counts"]
