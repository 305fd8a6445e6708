"""Fine-tuning with the token sequence split over processes (`context_parallel: P`).

All P processes form one context-parallel group (no data parallelism on top). They must
compute the same loss: the same batch (the loader is not sharded), and the same noise and
timesteps (the step seeds use the data-parallel rank, 0 for all). The cp plan gathers the
model output, so every rank computes the whole loss, but each rank's parameter gradients come
from its own tokens only: the true gradient is their sum over ranks. DDP averages, so the
loop scales the loss by P before backward.
"""

from __future__ import annotations


def group_size(config) -> int:
    """Ranks that split each sample's tokens (1 when context parallelism is off)."""
    return max(config.context_parallel, 1)


def check(config, num_processes: int, fsdp: bool) -> None:
    """Refuse what this first version does not do, before any model loads."""
    size = group_size(config)
    if size == 1:
        return
    refused = [(fsdp, "FSDP"), (config.validation_steps, "validation samples (validation_steps)"),
               (config.distill_layers, "per-layer distillation (distill_layers)"),
               (config.mhla_layers != "all", "partly converted models (mhla_layers must be 'all')")]
    for on, what in refused:
        if on:
            raise ValueError(f"context_parallel does not support {what}; turn it off or train without context_parallel")
    if size != num_processes:
        raise ValueError(f"context_parallel {size} needs exactly {size} processes, got {num_processes}: all processes "
                         "form one context-parallel group (no data parallelism on top); launch with --num_processes "
                         f"{size}")


def enable(transformer, config) -> None:
    """Split the converted `transformer`'s tokens over the group (any token count)."""
    from diffusers import ContextParallelConfig

    from ..context_parallel import enable_context_parallel

    enable_context_parallel(transformer, ContextParallelConfig(ring_degree=group_size(config), ring_anything=True))


def prepare_loader(accelerator, loader, config):
    """The loader sharded over data-parallel ranks only: every rank of the group reads the same batches."""
    if group_size(config) == 1:
        return accelerator.prepare(loader)
    from accelerate.data_loader import prepare_data_loader

    return prepare_data_loader(loader, accelerator.device, num_processes=1, process_index=0, put_on_device=True,
                               use_seedable_sampler=True, data_seed=config.seed)
