"""Context-parallel MHLA: each rank holds a contiguous slice of the tokens.

Block summaries are sums over tokens, so a rank sums its own tokens into partial summaries of
the blocks its slice touches, one all-reduce of B * heads * M * (D*D [+ D]) values (independent
of N) completes them on every rank, and each rank mixes them for its own queries. The
all-reduce is differentiable (its backward all-reduces the gradients), so training works.

The slices are diffusers' context-parallel ones (`enable_parallelism`, `_cp_plan`): rank r of
P holds tokens [start, end) of `torch.tensor_split(N, P)`, which may begin or end mid-frame,
mid-row or mid-block. `mhla_attention(..., group=group)` runs either backend on them: the
reference packs the slice's blocks (`mhla_sharded`); the Triton kernels walk the slice's tokens
of each block in place into summaries of all M blocks (`mhla_sharded_triton`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..blocks import BlockLayout, block_layout, eager_cache, pack_blocks
from .naive import mhla_blocked


def token_range(num_tokens: int, world: int, rank: int) -> tuple[int, int]:
    """Rank `rank`'s slice [start, end) of `num_tokens`, as `torch.tensor_split` cuts it."""
    if num_tokens < world:
        raise ValueError(f"{num_tokens} tokens cannot be split over {world} ranks; use fewer ranks or a larger latent")
    base, extra = divmod(num_tokens, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


@eager_cache(maxsize=64)
def _local_layout(grid, blocks, start: int, end: int, device: torch.device) -> tuple[BlockLayout, torch.Tensor]:
    token_block = block_layout(grid, blocks).token_block[start:end]
    ids = torch.unique(token_block)  # sorted global ids of the blocks the slice touches
    lay = pack_blocks(torch.searchsorted(ids, token_block), ids.numel())
    return lay.to(device), ids.to(device)


def local_layout(grid, blocks, start: int, end: int, device) -> tuple[BlockLayout, torch.Tensor]:
    """The block layout of tokens [start, end) of `grid`, and the global ids of its blocks (cached per device)."""
    return _local_layout(tuple(grid), tuple(blocks), start, end, torch.device(device))


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group's ranks; the backward sums the gradients the same way.

    (torch.distributed.nn.functional.all_reduce does this too but is deprecated in torch 2.14, and
    the autograd of its replacement in _functional_collectives is newer than torch 2.4.)
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return _AllReduceSum.apply(grad, ctx.group), None


def _all_reduce_sum(parts, group):
    """Tensors summed over the group's ranks, in one (differentiable) all-reduce of their promoted dtype; a single
    tensor is not concatenated (a copy of all B * heads * M * D * Dv summaries, on top of the all-reduce's own)."""
    flat = _AllReduceSum.apply(torch.cat([p.flatten() for p in parts]) if len(parts) > 1 else parts[0].flatten(), group)
    return [x.view_as(p) for x, p in zip(flat.split([p.numel() for p in parts]), parts)]


def _sum_over_ranks(parts, ids, num_blocks, group):
    """Partial summaries of the local blocks -> complete summaries of all blocks, in one all-reduce."""
    return _all_reduce_sum([p.new_zeros(*p.shape[:2], num_blocks, *p.shape[3:]).index_copy(2, ids, p) for p in parts],
                           group)


def _rank_slice(q, k, v, geometry, group) -> tuple[int, int]:
    """This rank's slice [start, end) of the grid's raster order, checked against the tokens it was given."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    num_tokens = geometry.num_tokens
    start, end = token_range(num_tokens, world, rank)
    if any(x.shape[1] != end - start for x in (q, k, v)):
        raise ValueError(
            f"rank {rank} of {world} got {q.shape[1]}, {k.shape[1]}, {v.shape[1]} q, k, v tokens, but its slice of the "
            f"{num_tokens}-token grid {geometry.grid} is [{start}, {end}); the sequence must be split contiguously as torch.tensor_split does "
            "(diffusers' context parallelism with ring_anything or ulysses_anything for any N)"
        )
    return start, end


def mhla_sharded(q, k, v, mix, geometry, options, rope, group):
    """The op on this rank's token slice (the reference); every rank of `group` must call it together.

    q, k, v: (B, N_local, heads, D), the rank's contiguous slice of the raster order over the whole
    `geometry.grid`; rope, if given, is already sliced the same way. Returns the rank's (B, N_local, heads, D_v).
    """
    start, end = _rank_slice(q, k, v, geometry, group)
    layout, ids = local_layout(geometry.grid, geometry.blocks, start, end, q.device)
    combine = lambda parts: _sum_over_ranks(parts, ids, geometry.num_blocks, group)  # noqa: E731
    return mhla_blocked(q, k, v, mix[ids], layout, options, rope, combine=combine)


def mhla_sharded_triton(q, k, v, mix, geometry, options, rope, group):
    """`mhla_sharded` on the Triton kernels: the slice's partial summaries of all M blocks (S in fp32), summed
    over the ranks in one all-reduce whose backward sums their gradients, so dk, dv see every rank's queries."""
    from ..kernels import op  # as the dispatch imports it: on first use

    start, _ = _rank_slice(q, k, v, geometry, group)

    def reduce(s, z):  # unnormalized, z is the kernels' placeholder of zeros: not sent
        return _all_reduce_sum([s, z], group) if options.normalize else (_all_reduce_sum([s], group)[0], z)

    return op.mhla_attention_triton(q, k, v, mix, geometry, options, rope, start=start, reduce=reduce)


def context_group(parallel_config):
    """The process group over which diffusers split the sequence (its flattened ring x ulysses mesh)."""
    cp = getattr(parallel_config, "context_parallel_config", parallel_config)
    return cp._flattened_mesh.get_group()


def comm_bytes(num_tokens, heads, head_dim, num_blocks, ranks, *, normalize=False, batch=1, act_bytes=2, summary_bytes=4):
    """Bytes one rank sends per attention layer and forward pass, by scheme, for P = `ranks`.

    ulysses: all-to-all of the local q, k, v and the output (heads must divide by P);
    ring: the local k, v passed to the P - 1 other ranks (ring FlashAttention);
    mhla: ring all-reduce of B * heads * M * (D*D [+ D]) summaries, kept in their fp32
    accumulation dtype (summary_bytes=4) while activations are bf16 (act_bytes=2).
    """
    p = ranks
    local = batch * num_tokens / p * heads * head_dim  # values in one rank's q (or k, v, out)
    summaries = batch * heads * num_blocks * (head_dim * head_dim + head_dim * bool(normalize))
    return {
        "ulysses": 4 * local * (p - 1) / p * act_bytes,
        "ring": 2 * local * (p - 1) * act_bytes,
        "mhla": 2 * (p - 1) / p * summaries * summary_bytes,
    }
