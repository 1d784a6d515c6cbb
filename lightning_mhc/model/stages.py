"""Pipeline stage partitioning: which layers each stage (and each virtual-pipeline chunk) holds,
and building only the local ones."""
from __future__ import annotations

from lightning_mhc.errors import ConfigError
from lightning_mhc.model.config import MHCTransformerConfig
from lightning_mhc.model.gpt import GPTModel
from lightning_mhc.distributed.layout import ParallelLayout, stage_ranges


def partition_layers(
    num_layers: int,
    num_stages: int,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
) -> list[tuple[int, int]]:
    """Global ``[start, end)`` layer ranges per (virtual) stage.

    Even by default; ``first_stage_layers`` / ``last_stage_layers`` fix the
    outer stages (megatron's ``decoder_first/last_pipeline_num_layers``) and
    the rest is split evenly over the middle stages.
    """
    pp = num_stages
    sizes: list[int | None] = [None] * pp
    if first_stage_layers is not None:
        sizes[0] = first_stage_layers
    if last_stage_layers is not None:
        if pp == 1 and first_stage_layers is not None and first_stage_layers != last_stage_layers:
            raise ConfigError(
                f"first_stage_layers={first_stage_layers} and last_stage_layers={last_stage_layers} "
                "name the same single stage; give one of them."
            )
        sizes[-1] = last_stage_layers
    fixed = sum(s for s in sizes if s is not None)
    free = [i for i, s in enumerate(sizes) if s is None]
    remaining = num_layers - fixed
    if any(s is not None and s < 0 for s in sizes) or remaining < 0 or (free and remaining % len(free)) \
            or (not free and remaining != 0):
        raise ConfigError(
            f"num_layers={num_layers} cannot be split over {pp} pipeline stages "
            f"(first_stage_layers={first_stage_layers}, last_stage_layers={last_stage_layers}): "
            f"the {len(free)} remaining stage(s) must share {remaining} layers evenly. Change "
            "num_layers, the pipeline size, or the first/last stage sizes."
        )
    for i in free:
        sizes[i] = remaining // len(free)
    return stage_ranges(sizes)


def build_gpt_chunks(
    config: MHCTransformerConfig,
    layout: ParallelLayout,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
) -> list[GPTModel]:
    """This rank's model chunks, one per (virtual) pipeline stage it holds
    (``layout.local_virtual_stages()``: chunk ``c`` of stage ``r`` is virtual stage ``c * p + r``,
    megatron's layer assignment), and only they (like megatron's ``model_provider``: no module of
    another stage is constructed, not even on the meta device). The layers are split over the
    ``p * v`` virtual stages; the first embeds (and expands the streams), the last contracts the
    streams and computes the loss. ``first/last_stage_layers`` size the first and last one.
    """
    stages = layout.num_virtual_stages
    ranges = partition_layers(config.num_layers, stages, first_stage_layers, last_stage_layers)
    return [GPTModel(config, pre_process=stage == 0, post_process=stage == stages - 1, layer_range=ranges[stage],
                     layout=layout)
            for stage in layout.local_virtual_stages()]
