"""One-launch linear MHLA forward for short sequences (docs/MHLA.md, section 1), no autograd.

At 1,024 tokens the linear path (`op.mhla_linear`: summary kernel, mixing GEMMs, output kernel) is
four launches of tiny latency-bound programs. Here one program per (batch*head, query block i, Dv tile)
(several query blocks where heads are narrow) walks all N tokens of k and v in raster order, which sit in L2
at these sizes, and accumulates the mixed summary directly, each token weighted by its block's mixing weight
(`token_weights`, one small gather before the launch):

    S~_i = sum_j Mc[i, b(j)] rope(phi(k_j))^T v_j ,   z~_i = sum_j Mc[i, b(j)] phi(k_j)

then writes the outputs of block i's queries through the output kernel's loop (`mhla._block_outputs`). The
work is M x N x D x Dv per head (M times the summaries' N x D x Dv) and every program reads all of k and v:
it pays only while launches, not arithmetic, bound the linear path, hence `op.SHORT_MAX_TOKENS`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..blocks import block_layout
from . import mhla
from .mhla import _block_outputs, _block_tokens, _features, _head, _load_rows, _spread


@triton.jit
def _short_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, wt_ptr, o_ptr,
    sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, scb, scn, sch, scd, sob, son, soh,
    heads, N, M, T, H, W, NBT, NBH, NBW, D, DV, TOK, eps,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, DV_TILES: tl.constexpr,
    QUERY_BLOCKS: tl.constexpr,
    ELU: tl.constexpr, ROPE: tl.constexpr, NORMALIZE: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
):
    """Query blocks i0 .. i0 + QUERY_BLOCKS - 1 share each k, v tile: the k features times each block's weights,
    side by side, are one (BLOCK_N, QUERY_BLOCKS * BLOCK_D) operand, so narrow heads make one wide product per
    tile, and the blocks' summaries lie stacked along D in one accumulator."""
    bh, pid_t = tl.program_id(0), tl.program_id(1)
    i0, vt = (pid_t // DV_TILES) * QUERY_BLOCKS, pid_t % DV_TILES
    b, h = bh // heads, bh % heads
    q_ptr = _head(q_ptr, b, h, sqb, sqh)
    k_ptr = _head(k_ptr, b, h, skb, skh)
    v_ptr = _head(v_ptr, b, h, svb, svh)
    o_ptr = _head(o_ptr, b, h, sob, soh)
    cos_ptr = _head(cos_ptr, b, h, scb, sch)
    sin_ptr = _head(sin_ptr, b, h, scb, sch)
    d = tl.arange(0, BLOCK_D)
    e = vt * BLOCK_DV + tl.arange(0, BLOCK_DV)
    mask_d, mask_e = d < D, e < DV
    blocks = i0 + tl.arange(0, QUERY_BLOCKS)
    rows = blocks.to(tl.int64) * N  # the query blocks' rows of the per-token weights
    acc = tl.zeros((QUERY_BLOCKS * BLOCK_D, BLOCK_DV), tl.float32)
    zacc = tl.zeros((BLOCK_N, QUERY_BLOCKS * BLOCK_D), tl.float32)  # z~ per token row, summed once after the walk
    for j0 in range(0, N, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        mask_j = j < N
        w = tl.load(wt_ptr + rows[None, :] + j[:, None], mask=mask_j[:, None] & (blocks < M)[None, :],
                    other=0.0)  # (BLOCK_N, QUERY_BLOCKS)
        fk, rk = _features(k_ptr, skn, cos_ptr, sin_ptr, scn, scd, j.to(tl.int64), mask_j, d, mask_d,
                           BLOCK_N, BLOCK_D, ELU, ROPE)
        y = _load_rows(v_ptr, j.to(tl.int64), svn, mask_j, e, mask_e)
        rk = _spread(rk, w, BLOCK_N, BLOCK_D, QUERY_BLOCKS)
        acc += tl.dot(tl.trans(rk.to(DOT)), y.to(DOT), input_precision=PRECISION)
        if NORMALIZE:
            zacc += _spread(fk, w, BLOCK_N, BLOCK_D, QUERY_BLOCKS)
    mat = acc.to(DOT)
    zt = tl.sum(zacc, axis=0)
    for slot in tl.static_range(QUERY_BLOCKS):
        if i0 + slot < M:
            _, t0, h0, w0, lh, lw, r0, r1 = _block_tokens(i0 + slot, 0, TOK, N, T, H, W, NBT, NBH, NBW, 0, 0)
            _block_outputs(q_ptr, o_ptr, cos_ptr, sin_ptr, sqn, scn, scd, son, mat, zt, eps, t0, h0, w0, lh, lw,
                           r0, r1, H, W, 0, d, mask_d, e, mask_e, slot, BLOCK_N, BLOCK_D, QUERY_BLOCKS, ELU, ROPE,
                           NORMALIZE, DOT, PRECISION)


def token_weights(mix: torch.Tensor, g: mhla.Geometry) -> torch.Tensor:
    """(M, N) fp32: Mc[i, b(j)], query block i's weight of token j, which the kernel's walk reads as one
    contiguous row per query block. Finding b(j) in the walk instead (integer divisions by run-time grid
    extents) made the loop 450 instead of 313 SASS instructions per 32-token tile (sm_90, bf16, 128 x 128), and
    by instruction count the loop is issue-bound (8 warps x 313 instructions against 128 x 32 x 128 MACs per
    tile), so this small gather before the launch should pay; not measured on a GPU."""
    return mix.float().index_select(1, block_layout(g.grid, g.blocks, mix.device).token_block)


def short_output(q, k, v, mix, rope, g: mhla.Geometry, *, elu: bool, normalize: bool, eps: float):
    """The whole forward in one kernel: each query block's mixed summary from a weighted walk over all tokens."""
    block_d, block_dv, dv_tiles = mhla._full_d_tiles(g)
    # the summary kernel's settings (a register cap of two programs per SM where tiles are 128 wide): each program
    # walks all N tokens as a summary program walks a block (sm_90, bf16, 128 x 128: 128 registers, no spill,
    # 53 KB shared memory, 90 KB with RoPE; 64-token tiles uncapped took 200 registers, one program per SM)
    cfg = mhla._config("short", q.dtype, block_d, g.N, rope is not None)
    o = torch.empty((g.B, g.N, g.heads, g.DV), device=q.device, dtype=v.dtype)
    cos, sin, cs = mhla._rope_args(rope, g, q)
    dot, precision = mhla._dot_types(q.dtype)
    # query blocks per program: as many as keep their stacked summaries within one 128-row, 128 x 128 tile
    query_blocks = max(1, min(mhla.MAX_TILE // block_d, mhla.MAX_TILE_AREA // (block_d * block_dv), mhla._pow2(g.M)))
    _short_kernel[(g.BH, triton.cdiv(g.M, query_blocks) * dv_tiles)](
        q, k, v, cos, sin, token_weights(mix, g), o,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), *cs, o.stride(0), o.stride(1), o.stride(2),
        g.heads, g.N, g.M, *g.args, g.D, g.DV, g.max_len, eps,
        BLOCK_N=cfg["block_n"], BLOCK_D=block_d, BLOCK_DV=block_dv, DV_TILES=dv_tiles, QUERY_BLOCKS=query_blocks,
        ELU=elu, ROPE=rope is not None, NORMALIZE=normalize, DOT=dot, PRECISION=precision,
        **mhla._launch(cfg),
    )
    return o
