"""One rank of the sharded Triton kernels' check, launched by tests/test_sequence_parallel.py:

    torchrun --nproc_per_node P tests/sp_kernels_worker.py OUT.json

Runs under Triton's CPU interpreter (switched on here, before triton is imported). Every rank draws the
same inputs and runs `mhla_attention(..., group=WORLD)` with backend "auto" on its slice, forward and
backward; rank 0 gathers the slices' outputs and q, k, v gradients, sums dmix over the ranks (each rank
holds its queries' share), and writes their relative errors against the unsharded call of the kernels,
with the slice starts each rank's kernels were given, how many summary launches each rank ran, and the grid and blocks.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import math  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from kernels_interp import FEW, SPLIT, configure, rel, rope_tables  # noqa: E402
from mhla_diffusion.blocks import locality_mix  # noqa: E402
from mhla_diffusion.kernels import mhla, op  # noqa: E402
from mhla_diffusion.ops import mhla_attention  # noqa: E402
from mhla_diffusion.ops.context_parallel import token_range  # noqa: E402
from ranks import finish  # noqa: E402

# 175 tokens cut (2, 3, 2): over 2 and over 3 ranks some slice starts mid-block (the test checks it). Blocks of up to 24
# tokens: with FEW's 32-token tiles the q-side grad launch makes dO's summaries of each slice (`mhla.summarizes`);
# with SPLIT's 16-token tiles, where the slice's longest block fits one.
GRID, BLOCKS = (5, 5, 7), (2, 3, 2)
# name: options, kernel launch (FEW: one program per block; SPLIT: summaries added by atomics)
CASES = {
    "relu normalized": (dict(normalize=True), FEW),
    "elu rope unnormalized split programs": (dict(normalize=False, rope=True, feature="elu"), SPLIT),
}


def check(options, launch, world, rank):
    configure(launch)
    gen = torch.Generator().manual_seed(0)
    n, m = math.prod(GRID), math.prod(BLOCKS)
    q, k = (torch.randn(1, n, 2, 16, generator=gen) for _ in range(2))
    v, do = (torch.randn(1, n, 2, 8, generator=gen) for _ in range(2))
    mix = (locality_mix(BLOCKS) + 0.1 * torch.rand(m, m, generator=gen, dtype=torch.float64)).float()
    rope = tuple(t.float() for t in rope_tables(n, 16, gen)) if options.get("rope") else None
    kw = dict(normalize=options["normalize"], feature=options.get("feature", "relu"))
    start, end = token_range(n, world, rank)

    starts, summaries = [], []
    triton_call, summary_call = op.mhla_attention_triton, mhla.block_summaries
    op.mhla_attention_triton = lambda *args, **kwargs: starts.append(kwargs["start"]) or triton_call(*args, **kwargs)
    mhla.block_summaries = lambda *args, **kwargs: summaries.append(1) or summary_call(*args, **kwargs)
    try:
        leaves = [t[:, start:end].clone().requires_grad_() for t in (q, k, v)] + [mix.clone().requires_grad_()]
        out = mhla_attention(*leaves, GRID, BLOCKS, rope=None if rope is None else tuple(t[:, start:end] for t in rope),
                             backend="auto", group=dist.group.WORLD, **kw)
        out.backward(do[:, start:end])
    finally:
        op.mhla_attention_triton, mhla.block_summaries = triton_call, summary_call
    dmix = leaves[3].grad.clone()
    dist.all_reduce(dmix)
    parts = [None] * world
    dist.all_gather_object(parts, [out.detach(), *(t.grad for t in leaves[:3]), starts, len(summaries)])
    if rank != 0:
        return None
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v, mix)]
    ref = mhla_attention(*ref_leaves, GRID, BLOCKS, rope=rope, backend="triton", **kw)
    ref.backward(do)
    errors = {name: rel(torch.cat([p[i] for p in parts], dim=1), want)
              for i, (name, want) in enumerate(zip(("o", "dq", "dk", "dv"), (ref, *(t.grad for t in ref_leaves))))}
    errors["dmix"] = rel(dmix, ref_leaves[3].grad)
    return {"errors": errors, "starts": [p[4] for p in parts], "summary launches": [p[5] for p in parts]}


def main():
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    results = {name: check(options, launch, world, rank) for name, (options, launch) in CASES.items()}
    finish({"grid": GRID, "blocks": BLOCKS, "cases": results}, sys.argv[1])


if __name__ == "__main__":
    main()
