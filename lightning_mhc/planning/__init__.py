"""Planning a layout before launch: each rank's parameter, gradient and optimizer bytes for a layout
of the mHC GPT, counted on the model the runtime builds (each stage built on the meta device), not
re-derived by hand."""
from lightning_mhc.planning.memory import RankBytes, StageCount, parse_bytes, plan_gpt, stage_counts
from lightning_mhc.planning.schedule import bubble

__all__ = ["RankBytes", "StageCount", "bubble", "parse_bytes", "plan_gpt", "stage_counts"]
