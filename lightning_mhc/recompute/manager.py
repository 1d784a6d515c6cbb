"""``MHCBlockRecomputeManager`` (block recompute): one per recompute block.

Every checkpoint made with ``CheckpointWithoutOutput(ckpt_manager=manager)``
registers here. After the block's forward, the manager frees all their
outputs and registers ONE gradient hook on the block's last output, which is
not checkpointed. The hook recomputes every checkpoint in forward order, so
each recompute finds its inputs already restored in place by the previous
ones (checkpoint i's output storage is checkpoint i+1's saved input).

The plan (a readable, validated recompute plan, without its refill machinery)
lists the checkpoints in order with the shapes and bytes each frees.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from lightning_mhc.recompute.memory import storage_key
from lightning_mhc.recompute.without_output import CheckpointWithoutOutput


@dataclass(frozen=True)
class PlanEntry:
    index: int
    name: str
    shapes: tuple[tuple[int, ...], ...]
    bytes_freed: int


class MHCBlockRecomputeManager:
    """Discards a block's checkpointed outputs and recomputes them from one hook."""

    def __init__(self, name: str = "block") -> None:
        self.name = name
        self.checkpoints: list[CheckpointWithoutOutput] = []
        self.hook_registered = False
        self.recompute_count = 0
        self.last_plan: list[PlanEntry] | None = None  # the plan as it was when outputs were freed

    def add_checkpoint(self, ckpt: CheckpointWithoutOutput) -> None:
        if self.hook_registered:
            raise RuntimeError(
                f"recompute manager {self.name!r}: checkpoint {ckpt.name!r} added after the block's "
                "outputs were discarded; a manager serves one forward of one block."
            )
        self.checkpoints.append(ckpt)

    def checkpoint(self, run_function, *args, name: str | None = None):
        """Shorthand for ``CheckpointWithoutOutput(ckpt_manager=self).checkpoint(...)``."""
        return CheckpointWithoutOutput(ckpt_manager=self, name=name).checkpoint(run_function, *args)

    # ---------------------------------------------------------------- plan
    def plan(self) -> list[PlanEntry]:
        """The checkpoints in recompute (= forward) order with what each frees.

        Bytes count each output storage once, also across checkpoints.
        """
        seen: set[int] = set()
        entries = []
        for i, ckpt in enumerate(self.checkpoints):
            freed = 0
            for out in ckpt.output_tensors:
                storage, key = out.untyped_storage(), storage_key(out)
                if key not in seen and storage.nbytes() > 0:
                    seen.add(key)
                    freed += storage.nbytes()
            entries.append(
                PlanEntry(i, ckpt.name or "?", tuple(tuple(o.shape) for o in ckpt.output_tensors), freed)
            )
        return entries

    def describe(self) -> str:
        entries = self.last_plan if self.last_plan is not None else self.plan()
        width = max([len(e.name) for e in entries] + [10])
        lines = [f"recompute plan of {self.name!r}: {len(entries)} checkpoints"]
        lines += [
            f"  {e.index:3d}  {e.name:<{width}}  {' '.join(str(list(s)) for s in e.shapes):<28} {e.bytes_freed:>12,d} B"
            for e in entries
        ]
        lines.append(f"  total freed: {sum(e.bytes_freed for e in entries):,d} B")
        return "\n".join(lines)

    def validate(self, hook_tensor: Tensor) -> None:
        """Refuse a plan that would lose data: a hook tensor or checkpoint input that is
        one of the outputs about to be freed, or a checkpoint that already ran."""
        hook_ptr = storage_key(hook_tensor)
        for ckpt in self.checkpoints:
            if ckpt.ctx is None or ckpt.recomputed:
                raise RuntimeError(f"recompute manager {self.name!r}: checkpoint {ckpt.name!r} is not pending")
            out_ptrs = {storage_key(o) for o in ckpt.output_tensors}
            if hook_ptr in out_ptrs:
                raise ValueError(
                    f"recompute manager {self.name!r}: the hook tensor is an output of checkpoint "
                    f"{ckpt.name!r}, whose storage is about to be freed. Use the block's last, "
                    "non-checkpointed output (is_last_layer_in_block=True keeps the last "
                    "layer's MLP bias-dropout-add outside the manager)."
                )
            for t in ckpt.ctx.saved_tensors:
                if t is not None and storage_key(t) in out_ptrs:
                    raise ValueError(
                        f"recompute manager {self.name!r}: checkpoint {ckpt.name!r} returns a view "
                        "of its own input; freeing it would destroy the input. Return a new tensor."
                    )

    # ------------------------------------------------------ discard + hook
    def discard_all_outputs_and_register_unified_recompute(self, hook_tensor: Tensor) -> None:
        """Free every registered output; recompute all of them when ``hook_tensor``'s
        gradient arrives. Does nothing when ``hook_tensor`` does not require grad."""
        if not hook_tensor.requires_grad:
            return
        if self.hook_registered:
            raise RuntimeError(f"recompute manager {self.name!r}: outputs already discarded")
        self.validate(hook_tensor)
        self.last_plan = self.plan()
        for ckpt in self.checkpoints:
            ckpt.discard_output()
        hook_tensor.register_hook(self._unified_recompute_hook)
        self.hook_registered = True

    def _unified_recompute_hook(self, grad_output: Tensor) -> None:
        if self.recompute_count:
            raise RuntimeError(
                f"recompute manager {self.name!r}: the unified recompute ran already; backward "
                "twice through a recomputed block (retain_graph=True) is not supported."
            )
        self.recompute_count += 1
        for ckpt in self.checkpoints:
            ckpt._recompute(None)
