"""MHLA in its quadratic (parallel) form, for short sequences: one launch in place of the linear path's summaries,
mixing and output launches (and two for the backward in place of its eight).

With w_in = mix[block(i), block(n)], MHLA's output is exactly

    o_i = sum_n w_in (phi(q_i) . phi(k_n)) v_n  [/ (sum_n w_in phi(q_i) . phi(k_n) + eps)],

since S~_b = sum_c mix[b, c] sum_{n in c} phi(k_n)^T v_n. `_parallel_kernel` computes it the way FlashAttention
walks keys, with the softmax replaced by the block weights: one program per (batch-head, query tile) of raster
tokens walks all N keys in tiles, P = phi(Q) phi(K)^T * W, O += P V, den += rowsum(P). W is one small product,
G @ E: G (query tile x blocks) holds the mix rows of the tile's queries, loaded once, and E the one-hot block
columns of the key tile, so each weight is one exact product of a mix entry with 1.0 (mix rounded to the operand
type, as the linear path's mixing GEMM rounds it). Its work grows as N^2 (D + Dv), the linear path's as N D Dv plus
a fixed cost of its launches: at 256 tokens (DiT-XL/2 256 px) this form took half the time, at 576 a sixth less
without gradients, at 1,024 about as long in GPU time (eager calls, host-bound there, take it up to 1,024 for its one
launch: `CONFIG`, `uses_parallel_form`; kernels/NOTES.md). The token and block
grids are constexprs: a short sequence's few resolutions each get their kernels, whose block ids of tokens are then
multiplies and shifts instead of integer divisions.

The backward (`_parallel_grad_kernel`) recomputes A and W from q, k and mix, as FlashAttention-2 recomputes its
scores, and reads the output and 1 / den per query that the forward kept. The op takes this path for the whole grid
of a call only (not a context-parallel slice: no summaries are formed to sum over ranks), without RoPE or RMSNorms
on the way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import compiled
from .fitting import launch_within_card
from .mhla import (_await_inputs, _clear, _dot_types, _dphi, _head, _load_rows, _phi_tile, _softmax_rows, _tile,
                   head_align, step_tiles)
from .sizes import cdiv, head_tiles, pow2

# Launch settings of each kernel (a program owns `own` tokens and walks the others by `walk`) and the longest
# sequences that take this path, without and with gradients. H200, bf16, 2026-12-03 (kernels/NOTES.md, sessions 32
# and 33), us per kernel (CUDA-graph replay), the linear path's whole op for comparison:
# - forward: 64 x 64 on 8 warps at up to 256 tokens (DiT-XL/2 256 px: 13.3, against 26.7 for the linear path);
#   over that 128 queries on 8 warps ("forward_long": 576 tokens 32.4 against 53.2 at 64 x 64 and 38.8 linear;
#   1,024 tokens 53.6 against 51.0 linear). Captured and compiled calls without gradients ("max_tokens") take it
#   up to 256 tokens: at 576 the linear path, on 32-token output tiles since session 47, is ahead (H100, `bench op
#   --versus parallel.CONFIG.max_tokens=256`, 7 rounds, DiT-XL/2 384 px forward 0.0167 -> 0.0147 ms; cuDNN 0.0150).
# - dq: 64 x 64 on 8 warps (15.5 at 256 tokens); dk, dv, dmix: 32 keys walking queries by 64 on 4 warps (26.7
#   against 31.8 at 64 x 64 on 8); for heads of up to 32 features (SANA's) 64 keys (25.4 against 35.9 at SANA-1.6B
#   512 px; 37.6 against 23.2 at DiT's 72). With gradients the form wins at 256 tokens only: at 576 the key kernel alone
#   takes 142 us against the linear path's 147 for the whole forward+backward. The key kernels on one pipeline stage
#   (session 62, H100, `bench op --versus`, 7 rounds, f+b ms, 2 stages -> 1): DiT-XL/2 256 px 0.0337 -> 0.0317 (cuDNN
#   0.0330), SANA-1.6B 512 px 0.0455 -> 0.0428; 3 stages 1.08x slower at 256 px; sm_90, DiT's heads: shared memory 59
#   -> 33 KB, stack 128 -> 112 bytes. Then dq (same calls' sweeps, f+b): walking keys by 128, 0.0318 -> 0.0310 at
#   256 px but 1.03x slower at SANA's heads; 128 queries a program, 0.0434 -> 0.0405 at SANA 512 px (cuDNN 0.0383) but
#   1.05x slower at DiT's, so heads of up to 32 features take "grad_queries_narrow". Not to be used: dq on one stage
#   ("grad_queries" num_stages=1, level in time) made an illegal memory access in two of the four processes that ran
#   it, both timing it beside other settings (H100, Triton 3.6; not reproduced alone).
# Eager calls without gradients ("max_tokens_eager") are host-bound at these lengths: one launch against the linear
# path's three, and less Python. H100, torch 2.11, session 41 (`.scratch/dev41.py H`), eager `mhla_attention`, us a
# call, median of 6 rounds of 100: 1,024 tokens (DiT-XL/2 512 px) 476 -> 164, SANA-1.6B 1K 477 -> 179 (GPU time
# 0.021 -> 0.029 ms at DiT's, session 40: what CUDA graphs and torch.compile pay, so they keep "max_tokens").
# Not to be used: 64 queries walking 32 or 16 keys on 8 warps gave NaN at 1,024 tokens and 30 blocks (H100 and H200,
# Triton 3.6, every num_stages; exact in the interpreter, so a compiler fault), where 128 queries walking 16 or 32,
# 64 walking 64 on 8 warps and 64 walking 32 on 4 were exact (session 42, `.scratch/dev42.py X`). Stepping down
# (`fitting.smaller` halves WALK) starts from the settings below and reaches such settings from "forward" only.
# "split_heads": the kernels ("forward", "grad_queries", "grad_keys") whose heads take two column tiles where that
# pads less (`head_tile_args`: 72 as 64 + 16). Compiled for sm_90 on the CPU (session 43, `resources.py`'s rows "...
# heads 64 + 16" against the same without), DiT's 16 x 72 heads: the forward at 1,024 tokens, tensor-core work 18 -> 12
# units of a 64x64x16 wgmma per key tile, shared memory 139 -> 88 KB (an RTX 4090 takes it as tuned), registers 210 ->
# 202; dq at 256 tokens 173 -> 138 registers, 86 -> 55 KB; the key kernel spilled more (stack 128 -> 816 bytes), so
# it stays whole. Timed (H100, session 44, `bench op --versus`, 5 rounds, ms): DiT-XL/2 256 px forward 0.00886 ->
# 0.00817, f+b 0.0371 -> 0.0361; the 576-token forward 0.0175 -> 0.0166; exact in the interpreter (kernels_interp.py,
# "parallel form") and in `bench op --check dit-xl-256 dit-xl-384` on the GPU.
SPLIT_KERNELS = ("forward", "grad_queries", "grad_keys")  # what CONFIG["split_heads"] may name
CONFIG = {
    "forward": dict(own=64, walk=64, num_warps=8, num_stages=2),
    "forward_long": dict(own=128, walk=64, num_warps=8, num_stages=3),
    "long_over": 256,
    "grad_queries": dict(own=64, walk=128, num_warps=8, num_stages=2),
    "grad_queries_narrow": dict(own=128, walk=64, num_warps=8, num_stages=2),
    "grad_keys": dict(own=32, walk=64, num_warps=4, num_stages=1),
    "grad_keys_narrow": dict(own=64, walk=64, num_warps=4, num_stages=1),
    "narrow_up_to": 32,
    "max_tokens": 256,
    "max_tokens_eager": 1024,
    "max_tokens_with_grad": 256,
    "split_heads": ("forward", "grad_queries"),
}


@triton.jit
def _block_of(n, T, H, W, NBT, NBH, NBW):
    """Block id of raster token n: along each axis the block i with floor(i L / nb) <= x < floor((i+1) L / nb),
    i = floor(((x + 1) nb - 1) / L)."""
    hw = H * W
    t = n // hw
    rem = n - t * hw
    h = rem // W
    w = rem - h * W
    it = ((t + 1) * NBT - 1) // T
    ih = ((h + 1) * NBH - 1) // H
    iw = ((w + 1) * NBW - 1) // W
    return (it * NBH + ih) * NBW + iw


@triton.jit
def _features_of(x_ptr, n, sn, mask_n, d, mask_d, ELU: tl.constexpr):
    """phi(x) of a token tile, zero outside it."""
    return _phi_tile(_load_rows(x_ptr, n, sn, mask_n, d, mask_d), mask_n, mask_d, ELU)


@triton.jit
def _mix_rows(mix_ptr, block, mask, c, smi, smj, M, DOT: tl.constexpr, SOFTMAX: tl.constexpr):
    """G: the mix rows of a tile's tokens (their blocks' rows, columns c < M), in the operand type; with SOFTMAX,
    mix_ptr holds the matrix's logits and each row is softmaxed as it is loaded."""
    rows = _tile(mix_ptr, block, smi, mask, c, smj, c < M, 0.0, "")
    if SOFTMAX:
        rows = _softmax_rows(rows.to(tl.float32), c < M)
    return rows.to(DOT)


@triton.jit
def _one_hot(c, block, DOT: tl.constexpr):
    """E^T: (blocks x tokens), 1 where token n lies in block c."""
    return tl.where(c[:, None] == block[None, :], 1.0, 0.0).to(DOT)


@triton.jit
def _parallel_kernel(
    q_ptr, k_ptr, v_ptr, mix_ptr, o_ptr, rden_ptr,
    sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, sob, son, soh, smi, smj,
    heads, M, eps, T: tl.constexpr, H: tl.constexpr, W: tl.constexpr, NBT: tl.constexpr, NBH: tl.constexpr,
    NBW: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, HEAD_ALIGN: tl.constexpr, OWN: tl.constexpr,
    WALK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, TAIL_D: tl.constexpr, TAIL_DV: tl.constexpr,
    BLOCK_B: tl.constexpr, ELU: tl.constexpr, NORMALIZE: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
    SOFTMAX: tl.constexpr = False, PDL: tl.constexpr = 0,
):
    """o for the OWN queries of grid axis 1, batch-head axis 0, walking the keys by WALK (and, normalized, 1 / den
    per query for the backward). A head's D (DV) features are one BLOCK_D (BLOCK_DV) column tile, or with TAIL_D
    (TAIL_DV) > 0 that tile and a second one after it (`head_tiles`: D = 72 as 64 + 16 columns, not 128). SOFTMAX:
    mix_ptr holds the matrix's logits (`_mix_rows`)."""
    _await_inputs(PDL)
    N: tl.constexpr = T * H * W
    bh, pid = tl.program_id(0), tl.program_id(1)
    b, h = bh // heads, bh % heads
    q_ptr = _head(q_ptr, b, h, sqb, sqh, HEAD_ALIGN)
    k_ptr = _head(k_ptr, b, h, skb, skh, HEAD_ALIGN)
    v_ptr = _head(v_ptr, b, h, svb, svh, HEAD_ALIGN)
    o_ptr = _head(o_ptr, b, h, sob, soh, HEAD_ALIGN)
    d = tl.arange(0, BLOCK_D)
    e = tl.arange(0, BLOCK_DV)
    c = tl.arange(0, BLOCK_B)
    i = pid * OWN + tl.arange(0, OWN)
    mask_i = i < N
    fq = _features_of(q_ptr, i, sqn, mask_i, d, d < D, ELU).to(DOT)
    if TAIL_D:
        d2 = BLOCK_D + tl.arange(0, TAIL_D)
        fq2 = _features_of(q_ptr, i, sqn, mask_i, d2, d2 < D, ELU).to(DOT)
    rows = _mix_rows(mix_ptr, _block_of(i, T, H, W, NBT, NBH, NBW), mask_i, c, smi, smj, M, DOT, SOFTMAX)
    acc = tl.zeros((OWN, BLOCK_DV), tl.float32)
    if TAIL_DV:
        e2 = BLOCK_DV + tl.arange(0, TAIL_DV)
        acc2 = tl.zeros((OWN, TAIL_DV), tl.float32)
    den = tl.zeros((OWN,), tl.float32)
    for n0 in range(0, N, WALK):
        n = n0 + tl.arange(0, WALK)
        mask_n = n < N
        fk = _features_of(k_ptr, n, skn, mask_n, d, d < D, ELU).to(DOT)
        a = tl.dot(fq, tl.trans(fk), input_precision=PRECISION)
        if TAIL_D:
            fk2 = _features_of(k_ptr, n, skn, mask_n, d2, d2 < D, ELU).to(DOT)
            a = tl.dot(fq2, tl.trans(fk2), a, input_precision=PRECISION)
        p = a * tl.dot(rows, _one_hot(c, _block_of(n, T, H, W, NBT, NBH, NBW), DOT), input_precision=PRECISION)
        if NORMALIZE:
            den += tl.sum(p, axis=1)
        p = p.to(DOT)
        acc += tl.dot(p, _load_rows(v_ptr, n, svn, mask_n, e, e < DV).to(DOT), input_precision=PRECISION)
        if TAIL_DV:
            acc2 += tl.dot(p, _load_rows(v_ptr, n, svn, mask_n, e2, e2 < DV).to(DOT), input_precision=PRECISION)
    if NORMALIZE:
        rden = 1.0 / (den + eps)
        tl.store(rden_ptr + bh.to(tl.int64) * N + i, rden, mask=mask_i)
        acc = acc * rden[:, None]
        if TAIL_DV:
            acc2 = acc2 * rden[:, None]
    _store_rows(o_ptr, i, son, mask_i, e, DV, acc)
    if TAIL_DV:
        _store_rows(o_ptr, i, son, mask_i, e2, DV, acc2)


@triton.jit
def _parallel_grad_kernel(
    q_ptr, k_ptr, v_ptr, mix_ptr, do_ptr, o_ptr, rden_ptr, c_ptr, dx_ptr, dv_ptr, dmix_ptr,
    sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, sdb, sdn, sdh, sob, son, soh, sxb, sxn, sxh, sgb, sgn, sgh, smi, smj,
    heads, M, T: tl.constexpr, H: tl.constexpr, W: tl.constexpr, NBT: tl.constexpr, NBH: tl.constexpr,
    NBW: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, HEAD_ALIGN: tl.constexpr, OWN: tl.constexpr,
    WALK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, TAIL_D: tl.constexpr, TAIL_DV: tl.constexpr,
    BLOCK_B: tl.constexpr, ELU: tl.constexpr, NORMALIZE: tl.constexpr, KEYS: tl.constexpr, DOT: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    """Gradients of the quadratic form, split as FlashAttention-2 splits them. With A = phi(Q) phi(K)^T, P = A * W,
    g = dO / den and c = -(dO . o) / den per query (unnormalized: g = dO, c = 0): dP = g V^T + c, dA = dP * W,
    dV = P^T g, dphi(Q) = dA phi(K), dphi(K) = dA^T phi(Q), and dmix[b, b'] sums dP * A over the query-key pairs
    of blocks (b, b').

    Not KEYS: a program owns OWN queries and walks all keys in WALK-token tiles: dq, and c, stored for the KEYS
    launch after it, and (its first program) zeroes dmix. KEYS: a program owns OWN keys and walks all queries: dk,
    dv and its share of dmix (the queries' one-hot sums E_q^T (dP * A) kept per key, multiplied by the keys' one-hot
    once, one atomic add of the (blocks x blocks) tile). Head tiles as in `_parallel_kernel` (TAIL_D, TAIL_DV: a
    second column tile)."""
    _await_inputs(PDL)
    N: tl.constexpr = T * H * W
    bh, pid = tl.program_id(0), tl.program_id(1)
    if not KEYS:  # dmix, which the KEYS launch after this one adds into: no fill launch (H100: f+b 4 % lower at 256 px)
        _clear(dmix_ptr, M * M, (bh == 0) & (pid == 0))
    b, h = bh // heads, bh % heads
    q_ptr = _head(q_ptr, b, h, sqb, sqh, HEAD_ALIGN)
    k_ptr = _head(k_ptr, b, h, skb, skh, HEAD_ALIGN)
    v_ptr = _head(v_ptr, b, h, svb, svh, HEAD_ALIGN)
    do_ptr = _head(do_ptr, b, h, sdb, sdh, HEAD_ALIGN)
    o_ptr = _head(o_ptr, b, h, sob, soh, HEAD_ALIGN)
    dx_ptr = _head(dx_ptr, b, h, sxb, sxh, HEAD_ALIGN)
    dv_ptr = _head(dv_ptr, b, h, sgb, sgh, HEAD_ALIGN)
    stats = bh.to(tl.int64) * N
    d = tl.arange(0, BLOCK_D)
    e = tl.arange(0, BLOCK_DV)
    if TAIL_D:
        d2 = BLOCK_D + tl.arange(0, TAIL_D)
    if TAIL_DV:
        e2 = BLOCK_DV + tl.arange(0, TAIL_DV)
    c = tl.arange(0, BLOCK_B)
    if KEYS:
        x_ptr, sx, y_ptr, sy = k_ptr, skn, q_ptr, sqn
    else:
        x_ptr, sx, y_ptr, sy = q_ptr, sqn, k_ptr, skn
    j = pid * OWN + tl.arange(0, OWN)
    mask_j = j < N
    block_j = _block_of(j, T, H, W, NBT, NBH, NBW)
    fx = _features_of(x_ptr, j, sx, mask_j, d, d < D, ELU).to(DOT)
    dphi = tl.zeros((OWN, BLOCK_D), tl.float32)
    if TAIL_D:
        fx2 = _features_of(x_ptr, j, sx, mask_j, d2, d2 < D, ELU).to(DOT)
        dphi2 = tl.zeros((OWN, TAIL_D), tl.float32)
    if KEYS:
        vj = _load_rows(v_ptr, j, svn, mask_j, e, e < DV).to(DOT)
        dv = tl.zeros((OWN, BLOCK_DV), tl.float32)
        if TAIL_DV:
            vj2 = _load_rows(v_ptr, j, svn, mask_j, e2, e2 < DV).to(DOT)
            dv2 = tl.zeros((OWN, TAIL_DV), tl.float32)
        key_hot = _one_hot(c, block_j, DOT)
        pair_sums = tl.zeros((BLOCK_B, OWN), tl.float32)  # per key: sum of dP * A over the queries of block b
    else:
        rows = _mix_rows(mix_ptr, block_j, mask_j, c, smi, smj, M, DOT, False)
        g = _load_rows(do_ptr, j, sdn, mask_j, e, e < DV)
        if TAIL_DV:
            g2 = _load_rows(do_ptr, j, sdn, mask_j, e2, e2 < DV)
        if NORMALIZE:
            rden = tl.load(rden_ptr + stats + j, mask=mask_j, other=0.0)
            go = tl.sum(g * _load_rows(o_ptr, j, son, mask_j, e, e < DV), axis=1)
            if TAIL_DV:
                go += tl.sum(g2 * _load_rows(o_ptr, j, son, mask_j, e2, e2 < DV), axis=1)
            cj = -go * rden
            tl.store(c_ptr + stats + j, cj, mask=mask_j)
            g = g * rden[:, None]
            if TAIL_DV:
                g2 = g2 * rden[:, None]
        g = g.to(DOT)
        if TAIL_DV:
            g2 = g2.to(DOT)
    for w0 in range(0, N, WALK):
        n = w0 + tl.arange(0, WALK)
        mask_n = n < N
        block_n = _block_of(n, T, H, W, NBT, NBH, NBW)
        fy = _features_of(y_ptr, n, sy, mask_n, d, d < D, ELU).to(DOT)
        if TAIL_D:
            fy2 = _features_of(y_ptr, n, sy, mask_n, d2, d2 < D, ELU).to(DOT)
        if KEYS:  # n: queries; tiles are (queries, keys)
            w = tl.dot(_mix_rows(mix_ptr, block_n, mask_n, c, smi, smj, M, DOT, False), key_hot,
                       input_precision=PRECISION)
            a = tl.dot(fy, tl.trans(fx), input_precision=PRECISION)
            if TAIL_D:
                a = tl.dot(fy2, tl.trans(fx2), a, input_precision=PRECISION)
            gn = _load_rows(do_ptr, n, sdn, mask_n, e, e < DV)
            if TAIL_DV:
                gn2 = _load_rows(do_ptr, n, sdn, mask_n, e2, e2 < DV)
            if NORMALIZE:
                rn = tl.load(rden_ptr + stats + n, mask=mask_n, other=0.0)
                gn = gn * rn[:, None]
                if TAIL_DV:
                    gn2 = gn2 * rn[:, None]
            gn = gn.to(DOT)
            dp = tl.dot(gn, tl.trans(vj), input_precision=PRECISION)
            if TAIL_DV:
                gn2 = gn2.to(DOT)
                dp = tl.dot(gn2, tl.trans(vj2), dp, input_precision=PRECISION)
            if NORMALIZE:
                dp += tl.load(c_ptr + stats + n, mask=mask_n, other=0.0)[:, None]
            p_t = tl.trans((a * w).to(DOT))
            dv += tl.dot(p_t, gn, input_precision=PRECISION)
            if TAIL_DV:
                dv2 += tl.dot(p_t, gn2, input_precision=PRECISION)
            da_t = tl.trans((dp * w).to(DOT))
            pair_sums += tl.dot(_one_hot(c, block_n, DOT), (dp * a).to(DOT), input_precision=PRECISION)
        else:  # n: keys; tiles are (queries, keys)
            w = tl.dot(rows, _one_hot(c, block_n, DOT), input_precision=PRECISION)
            dp = tl.dot(g, tl.trans(_load_rows(v_ptr, n, svn, mask_n, e, e < DV).to(DOT)), input_precision=PRECISION)
            if TAIL_DV:
                vn2 = _load_rows(v_ptr, n, svn, mask_n, e2, e2 < DV).to(DOT)
                dp = tl.dot(g2, tl.trans(vn2), dp, input_precision=PRECISION)
            if NORMALIZE:
                dp += cj[:, None]
            da_t = (dp * w).to(DOT)  # (owned queries, keys)
        dphi += tl.dot(da_t, fy, input_precision=PRECISION)
        if TAIL_D:
            dphi2 += tl.dot(da_t, fy2, input_precision=PRECISION)
    _store_rows(dx_ptr, j, sxn, mask_j, d, D, dphi * _dphi(_features_of(x_ptr, j, sx, mask_j, d, d < D, ELU), ELU))
    if TAIL_D:
        _store_rows(dx_ptr, j, sxn, mask_j, d2, D,
                    dphi2 * _dphi(_features_of(x_ptr, j, sx, mask_j, d2, d2 < D, ELU), ELU))
    if KEYS:
        _store_rows(dv_ptr, j, sgn, mask_j, e, DV, dv)
        if TAIL_DV:
            _store_rows(dv_ptr, j, sgn, mask_j, e2, DV, dv2)
        share = tl.dot(pair_sums, tl.trans(key_hot.to(tl.float32)), input_precision="ieee")  # (blocks, blocks)
        tl.atomic_add(dmix_ptr + c[:, None] * M + c[None, :], share, mask=(c[:, None] < M) & (c[None, :] < M))


@triton.jit
def _store_rows(o_ptr, i, son, mask_i, e, DV: tl.constexpr, x):
    tl.store(o_ptr + i.to(tl.int64)[:, None] * son + e[None, :], x.to(o_ptr.dtype.element_ty),
             mask=mask_i[:, None] & (e < DV)[None, :])


def uses_parallel_form(n: int, dtype: torch.dtype, wants_grad: bool, eager: bool) -> bool:
    """Whether a whole-grid call of n tokens takes the quadratic form: bf16 (where it was measured) and n up to
    CONFIG["max_tokens_with_grad"] with gradients; without, CONFIG["max_tokens_eager"] for an `eager` call (one run as
    it is called, neither captured in a CUDA graph nor compiled) and CONFIG["max_tokens"] otherwise."""
    if wants_grad:
        limit = CONFIG["max_tokens_with_grad"]
    else:
        limit = CONFIG["max_tokens_eager" if eager else "max_tokens"]
    return dtype == torch.bfloat16 and n <= limit


def _launch_args(q, v, mix, grid, blocks, elu: bool, normalize: bool, strided):
    """Run-time sizes and the constexprs every launch shares: head dims, the alignment of the head strides of the
    `strided` tensors (`mhla.head_align`), and the token and block grids, so that a token's block id costs
    multiplies, not divisions (a kernel per resolution; this path serves short sequences of few resolutions). The
    tensors may be meta tensors: only their shapes, strides and q's type are read. Each launch adds its head tiles
    (`head_tile_args`)."""
    (t, h, w), (bt, bh, bw), m = grid, blocks, mix.shape[0]
    dot, precision = _dot_types(q.dtype)
    return (q.shape[2], m), {"T": t, "H": h, "W": w, "NBT": bt, "NBH": bh, "NBW": bw, "D": q.shape[-1],
                             "DV": v.shape[-1], "HEAD_ALIGN": head_align(*strided), "BLOCK_B": max(16, pow2(m)),
                             "ELU": elu, "NORMALIZE": normalize, "DOT": dot, "PRECISION": precision}


def head_tile_args(d: int, dv: int, split: bool) -> dict:
    """The column tiles of q, k (D) and v (DV): with `split` (the kernel is in CONFIG["split_heads"]), two per head
    where that pads less (`sizes.head_tiles`: 72 as 64 + 16); otherwise one power of two of at least 16."""
    if not split:
        return dict(BLOCK_D=max(16, pow2(d)), TAIL_D=0, BLOCK_DV=max(16, pow2(dv)), TAIL_DV=0)
    (block_d, tail_d), (block_dv, tail_dv) = head_tiles(d), head_tiles(dv)
    return dict(BLOCK_D=block_d, TAIL_D=tail_d, BLOCK_DV=block_dv, TAIL_DV=tail_dv)


def launch_settings(kernel: str, n: int, d: int) -> dict:
    """OWN, WALK and launch options of `kernel` ("forward", "grad_queries" or "grad_keys") for n tokens of heads of
    d features (`CONFIG`)."""
    if kernel == "forward" and n > CONFIG["long_over"]:
        kernel = "forward_long"
    if kernel in ("grad_queries", "grad_keys") and d <= CONFIG["narrow_up_to"]:
        kernel += "_narrow"
    cfg = CONFIG[kernel]
    return dict(OWN=cfg["own"], WALK=cfg["walk"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def _strides(*tensors):
    return [st for t in tensors for st in t.stride()[:3]]


def parallel_output(q, k, v, mix, grid, blocks, *, elu: bool, normalize: bool, eps: float, logits: bool = False):
    """(o, rden): o (B, N, heads, Dv) of MHLA over the whole (T, H, W) grid of tokens cut into `blocks`, in q's type
    (fp32 accumulate; products in the operand type of `mhla._dot_types`), and normalized, 1 / den per query
    (B*heads, N) fp32 for `parallel_grad` (unnormalized: an empty tensor). `logits`: mix holds the matrix's logits,
    softmaxed row by row where the kernel loads them."""
    batch, n, heads, _ = q.shape
    o = torch.empty((batch, n, heads, v.shape[-1]), device=q.device, dtype=q.dtype)
    rden = torch.empty((batch * heads, n) if normalize else (0,), device=q.device, dtype=torch.float32)
    sizes, meta = _launch_args(q, v, mix, grid, blocks, elu, normalize, (q, k, v, o))
    meta.update(head_tile_args(q.shape[-1], v.shape[-1], "forward" in CONFIG["split_heads"]), SOFTMAX=logits)

    def launch(tiles):
        compiled.launch(_parallel_kernel, (batch * heads, cdiv(n, tiles["OWN"])),
            q, k, v, mix, o, rden, *_strides(q, k, v, o), mix.stride(0), mix.stride(1), *sizes, eps, name="parallel",
            **meta, **tiles)

    launch_within_card(_parallel_kernel, q.device, launch_settings("forward", n, q.shape[-1]), step_tiles("parallel"),
                       meta, launch)
    return o, rden


def parallel_grad(do, q, k, v, mix, o, rden, grid, blocks, *, elu: bool, normalize: bool):
    """(dq, dk, dv, dmix) of `parallel_output` from its output o and rden: the query launch (dq, and c per query),
    then the key launch (dk, dv, dmix summed over programs in fp32, into the buffer the query launch zeroed)."""
    batch, n, heads, _ = q.shape
    dq, dk = torch.empty(q.shape, device=q.device, dtype=q.dtype), torch.empty(k.shape, device=q.device, dtype=k.dtype)
    dv = torch.empty(v.shape, device=q.device, dtype=v.dtype)
    dmix = torch.empty(mix.shape, device=q.device, dtype=torch.float32)  # zeroed by the query launch
    c = torch.empty_like(rden)
    sizes, meta = _launch_args(q, v, mix, grid, blocks, elu, normalize, (q, k, v, do, o, dq, dk, dv))
    for keys, dx in ((False, dq), (True, dk)):
        kernel = "grad_keys" if keys else "grad_queries"
        split = kernel in CONFIG["split_heads"]
        constexprs = {**meta, **head_tile_args(q.shape[-1], v.shape[-1], split), "KEYS": keys}

        def launch(tiles, dx=dx, constexprs=constexprs):
            compiled.launch(_parallel_grad_kernel, (batch * heads, cdiv(n, tiles["OWN"])),
                q, k, v, mix, do, o, rden, c, dx, dv, dmix, *_strides(q, k, v, do, o, dx, dv), mix.stride(0),
                mix.stride(1), *sizes, name=f"parallel_{kernel}", **constexprs, **tiles)

        launch_within_card(_parallel_grad_kernel, q.device, launch_settings(kernel, n, q.shape[-1]),
                           step_tiles("parallel"), constexprs, launch)
    return dq, dk, dv, dmix
