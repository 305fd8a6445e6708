"""Run a converted transformer under diffusers' context parallelism.

`transformer.enable_parallelism(config=ContextParallelConfig(...))` is the API; MHLA processors
declare `_parallel_config`, so diffusers hands them the mesh and they attend sharded
(`ops/context_parallel.py`). `enable_context_parallel` adds what that call lacks for MHLA models: split
plans for DiT and PixArt (diffusers ships one for Wan only), a check that no self-attention
layer would silently attend over its own slice only, and CPU-only hosts (gloo). There
diffusers 0.42.1 fails twice: picking a device (`rank % torch.accelerator.device_count()`, 0),
and gathering slices of unequal length (it gathers their sizes on the accelerator unless the
backend name contains "cpu", and gloo's all_gather, unlike NCCL's, needs equal sizes).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .families import family_of, self_attentions


def cp_plan(transformer) -> dict:
    """Where diffusers splits the token sequence and gathers it back, for this model (its family says)."""
    return family_of(transformer).cp_plan(transformer)


def _check_self_attention(transformer) -> None:
    for i, attn in enumerate(self_attentions(transformer)):
        if not hasattr(attn.processor, "_parallel_config"):
            raise ValueError(
                f"self-attention layer {i} uses {type(attn.processor).__name__}, which is not context-parallel: "
                "it would attend over its own rank's tokens only. Convert every layer (layers='all') or use "
                "a context-parallel processor there"
            )


def enable_context_parallel(transformer, config) -> None:
    """Split `transformer`'s token sequence over the ranks of `config`, a diffusers ContextParallelConfig.

    Needs an initialised process group. For any token count use `ring_anything=True` (or
    `ulysses_anything=True`); plain degrees need N divisible by the number of ranks.
    """
    plan = cp_plan(transformer)
    _check_self_attention(transformer)
    if torch.accelerator.device_count() > 0:
        transformer.enable_parallelism(config=config, cp_plan=plan)
        return
    _enable_on_cpu(transformer, config, plan)


def _enable_on_cpu(transformer, config, plan) -> None:
    """`enable_parallelism`'s steps with a CPU device mesh (gloo), and gathers gloo can do."""
    from diffusers.hooks.context_parallel import apply_context_parallel
    from diffusers.models._modeling_parallel import ParallelConfig

    from .processors import MHLAProcessorBase

    for i, attn in enumerate(self_attentions(transformer)):
        if not isinstance(attn.processor, MHLAProcessorBase):
            raise ValueError(
                f"self-attention layer {i} keeps {type(attn.processor).__name__}, whose context-parallel attention "
                "needs CUDA; on a CPU-only host convert every layer (layers='all')"
            )
    if not dist.is_initialized():
        raise RuntimeError("initialise torch.distributed (e.g. launch with torchrun) before enabling context parallelism")
    if transformer._parallel_config is not None:
        raise RuntimeError(f"parallelism is already applied to this {type(transformer).__name__}")
    parallel = ParallelConfig(context_parallel_config=config)
    mesh = config.mesh or dist.device_mesh.init_device_mesh("cpu", config.mesh_shape, mesh_dim_names=config.mesh_dim_names)
    parallel.setup(dist.get_rank(), dist.get_world_size(), torch.device("cpu"), mesh=mesh)
    transformer._parallel_config = parallel
    for module in transformer.modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(processor, "_parallel_config"):
            processor._parallel_config = parallel
    apply_context_parallel(transformer, config, plan)
    _pad_gathers(transformer, config, plan)


def _pad_gathers(transformer, config, plan) -> None:
    """Swap diffusers' output gathers for ones that pad the slices to equal length first."""
    from diffusers.hooks.context_parallel import _CONTEXT_PARALLEL_OUTPUT_HOOK_TEMPLATE, ContextParallelGatherHook
    from diffusers.hooks.hooks import HookRegistry

    class PaddedGatherHook(ContextParallelGatherHook):
        def post_forward(self, module, output):
            single = torch.is_tensor(output)
            group = self.parallel_config._flattened_mesh.get_group()
            outs = [
                x if cpm is None else _GatherSlices.apply(x, cpm.gather_dim, group)
                for x, cpm in zip([output] if single else output, self.metadata, strict=True)
            ]
            return outs[0] if single else tuple(outs)

    for module_id, entry in plan.items():
        if isinstance(entry, dict):  # a split, not a gather
            continue
        registry = HookRegistry.check_if_exists_or_initialize(transformer.get_submodule(module_id))
        name = _CONTEXT_PARALLEL_OUTPUT_HOOK_TEMPLATE.format(module_id)
        metadata = registry.get_hook(name).metadata
        registry.remove_hook(name)
        registry.register_hook(PaddedGatherHook(metadata, config), name)


class _GatherSlices(torch.autograd.Function):
    """All-gather slices of unequal length along `dim`; the backward keeps this rank's slice of the grad
    (every rank computes the same loss from the gathered output, as in diffusers' own gather)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        dim = dim % x.dim()
        sizes = [torch.zeros((), dtype=torch.long) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor(x.shape[dim]), group=group)
        sizes = [int(n) for n in sizes]
        padded = F.pad(x, [0, 0] * (x.dim() - 1 - dim) + [0, max(sizes) - x.shape[dim]]).contiguous()
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded, group=group)
        ctx.dim, ctx.start, ctx.length = dim, sum(sizes[:rank]), x.shape[dim]
        return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(ctx.dim, ctx.start, ctx.length), None, None
