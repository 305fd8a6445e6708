"""Triton kernels for MHLA (docs/MHLA.md, section 1) on (B, N, heads, D) raster-layout tensors.

Three token kernels, each reading the tokens of one block straight from the raster layout (block
bounds and raster indices are computed in the kernel; nothing is permuted or copied). A call may hold
a slice [start, start + N) of the raster order only (a context-parallel rank's, `Geometry`): the kernels
then walk each block's tokens inside the slice, and summaries of the blocks it misses are zero.

- `_summary_kernel`: S_b = sum_j rope(phi(x_j))^T (y_j * ys_j), z_b = sum_j phi(x_j) * zw_j.
  Forward: x = k, y = v. Backward: x = q, y = dO, ys = 1/den, zw = c gives dS~, dz~. Where Dv pads its tile
  (DiT's 72 in 128) and z is a plain sum of unrotated features, z comes out of the product itself (Z_IN_DOT).
- `_output_kernel`: o_n = rope(phi(q_n)) S~_b / (phi(q_n) . z~_b + eps).
- `_rstd_kernel`: 1 / RMS of each token across all heads, for an RMSNorm across heads (Wan's q/k norms) that the
  summary and output kernels apply as they load k and q (`_features`, NORM); the output kernel can also RMSNorm
  each head's output row before it stores it (OUT_NORM). Inference only (`ops.norms`).
- `_grad_kernel`: P_n = y_n Mat_b^T; dx_n = phi'(x_n) * (rope^T(P_n * ps_n) + zs_n * vec_b),
  optionally dy_n = rope(phi(x_n)) Mat_b. Backward for q (y = dO, Mat = S~, vec = z~; the
  per-token 1/den and c = -(rope(phi(q)) . P)/den^2 are computed and stored on the way) and for
  k, v (y = v, Mat = dS, vec = dz, dy = dv).

Summaries are laid out block-major, (M, B*heads, D, Dv), so that mixing across blocks (S~ = mix @ S,
dS = mix^T dS~) is one plain GEMM, (M x M) @ (M x B*heads*D*Dv), `_mix_kernel` or cuBLAS; dmix, the Gram matrix of
two such (M x B*heads*D*Dv) operands, is another, `_gram_kernel`.

Head dims D, Dv are constexprs: a run-time integer that is no multiple of 16 (DiT's and PixArt's 72) leaves the
compiler unable to prove the `d < D` masks constant over 8 lanes, and every token load became a scalar 2-byte
load without async copies (H200, DiT-XL/2 512 px: fwd 0.067 -> 0.057 ms, f+b 0.335 -> 0.293; kernels/NOTES.md).
Summaries are stored in the type the token kernels multiply them in (`state_dtype`:
bf16 for bf16 inputs, fp32 otherwise); normalizer sums z are fp32; every accumulation is fp32.
`mhla_diffusion.ops.naive` holds the plain PyTorch meaning of each launcher (`reference_*`), for tests.
"""

from __future__ import annotations

import contextlib
import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..blocks import BlockGeometry
from ..mixing import mixing_matrix
from . import compiled
from .fitting import launch_within_card
from .sizes import cdiv, pow2

# Largest tile edge for a summary accumulator, and largest D x Dv tile a program keeps.
MAX_TILE = 128
MAX_TILE_AREA = 128 * 128


# ----------------------------------------------------------------------------- helpers


@triton.jit
def _await_inputs(PDL: tl.constexpr):
    """With PDL (the kernel launched as a programmatic dependent launch, `compiled.launch`): wait here, before any
    store and any load of what the kernel before it in the stream may write, until that kernel has finished and its
    writes are visible. The launch then starts while that kernel's last programs run, instead of after it completes.
    PDL 2: then let the next launch start once every program of this one has got here, rather than once they have
    exited (its programs wait in turn; `compiled.CONFIG`). None of these kernels lets the next start before its own
    wait, and a launch that is not programmatic (PyTorch's, cuBLAS', a copy, an event) starts only once the one ahead
    has finished, so when a launch starts, every launch before the one just ahead of it has finished: what they wrote
    (and what was written before them) a kernel may load before it waits (the EARLY flags, the output launch's first q
    tile). A foreign programmatic kernel that let the next start before its own wait would break this; none runs
    between the op's launches."""
    if PDL:
        gdc_wait()
    if PDL > 1:
        gdc_launch_dependents()


@triton.jit
def _phi(x, ELU: tl.constexpr):
    if ELU:
        return tl.where(x > 0, x + 1.0, tl.exp(x))
    return tl.maximum(x, 0.0)


@triton.jit
def _phi_tile(x, mask_n, mask_d, ELU: tl.constexpr):
    """phi of a masked-loaded (rows x cols) tile, zero outside the masks: relu of the loads' zeros is zero already;
    elu + 1 of them is one."""
    fx = _phi(x, ELU)
    if ELU:
        fx = tl.where(mask_n[:, None] & mask_d[None, :], fx, 0.0)
    return fx


@triton.jit
def _dphi(fx, ELU: tl.constexpr):
    """phi'(x) from phi(x): relu' = [phi > 0]; for elu + 1, phi' = min(phi, 1) (exp(x) for x <= 0)."""
    if ELU:
        return tl.minimum(fx, 1.0)
    return tl.where(fx > 0, 1.0, 0.0)


@triton.jit
def _swap_pairs(x, BN: tl.constexpr, BD: tl.constexpr):
    """(x[2i], x[2i+1]) -> (x[2i+1], x[2i]) along the last axis, in registers."""
    a, b = tl.split(tl.reshape(x, (BN, BD // 2, 2)))
    return tl.reshape(tl.join(b, a), (BN, BD))


@triton.jit
def _ranks_before(n, t0, h0, w0, lt, lh, lw, H, W):
    """How many tokens of the block at (t0, h0, w0) of extents (lt, lh, lw) come before raster token n
    (raster order is lexicographic in (t, h, w): whole frames, then whole rows of n's frame, then columns)."""
    t, h, w = n // (H * W), (n // W) % H, n % W
    in_t = (t >= t0) & (t < t0 + lt)
    in_h = in_t & (h >= h0) & (h < h0 + lh)
    return (tl.minimum(tl.maximum(t - t0, 0), lt) * lh * lw
            + tl.where(in_t, tl.minimum(tl.maximum(h - h0, 0), lh) * lw, 0)
            + tl.where(in_h, tl.minimum(tl.maximum(w - w0, 0), lw), 0))


@triton.jit
def _block_tokens(pid_m, pid_s, TOK, N, T, H, W, NBT, NBH, NBW, START, M0):
    """Block m = M0 + pid_m: its start (t0, h0, w0) and row extents (lh, lw), from floor(i*L/n) bounds per axis,
    and the ranks [r0, r1) (raster order inside the block) that program pid_s covers of the block's tokens in the
    call's raster slice [START, START + N) (context parallel; the whole grid is [0, T*H*W))."""
    m = M0 + pid_m
    it = m // (NBH * NBW)
    ih = (m // NBW) % NBH
    iw = m % NBW
    t0 = it * T // NBT
    h0 = ih * H // NBH
    w0 = iw * W // NBW
    lt = (it + 1) * T // NBT - t0
    lh = (ih + 1) * H // NBH - h0
    lw = (iw + 1) * W // NBW - w0
    r0 = _ranks_before(START, t0, h0, w0, lt, lh, lw, H, W) + pid_s * TOK
    r1 = tl.minimum(r0 + TOK, _ranks_before(START + N, t0, h0, w0, lt, lh, lw, H, W))
    return m, t0, h0, w0, lh, lw, r0, r1


@triton.jit
def _head(ptr, b, h, sb, sh, ALIGN: tl.constexpr):
    """`ptr` moved to batch b, head h (int64 batch offset: large B*N*heads*D tensors), the head offset marked a
    multiple of ALIGN (`head_align`): the JIT marks only strides divisible by 16, and unmarked, a head stride of 72
    (DiT's and PixArt's heads) leaves every token load a scalar 2-byte load."""
    return ptr + b.to(tl.int64) * sb + tl.multiple_of(h * sh, ALIGN)


@triton.jit
def _raster(r, t0, h0, w0, lh, lw, H, W, START):
    """Row of the r-th token (raster order) inside a block in the call's tensors: its raster index less START.

    The two divisions by run-time extents are done in fp32 with the row's +0.5 offset (exact for
    r < `capabilities.MAX_BLOCK_TOKENS`, which the dispatch checks): integer division by a run-time divisor costs ~20
    instructions per row.
    """
    lhw = lh * lw
    t = ((r.to(tl.float32) + 0.5) * (1.0 / lhw.to(tl.float32))).to(tl.int32)
    rem = r - t * lhw
    h = ((rem.to(tl.float32) + 0.5) * (1.0 / lw.to(tl.float32))).to(tl.int32)
    w = rem - h * lw
    return (((t0 + t) * H + h0 + h) * W + w0 + w - START).to(tl.int64)


@triton.jit
def _state_row(m, bh):
    """Row of block m, batch-head bh in the block-major (M, B*heads, ...) summaries; grid axis 0 is B*heads."""
    return (m * tl.num_programs(0) + bh).to(tl.int64)


@triton.jit
def _tile(ptr, rows, s_rows, mask_rows, cols, s_cols, mask_cols, other, EVICT: tl.constexpr):
    """A masked (rows x cols) tile in the pointer's own type (`other` outside); EVICT: its L2 eviction priority ("",
    "evict_first", "evict_last": plain loads only; an async copy into a pipeline stage drops it)."""
    return tl.load(ptr + rows[:, None] * s_rows + cols[None, :] * s_cols, mask=mask_rows[:, None] & mask_cols[None, :],
                   other=other, eviction_policy=EVICT)


@triton.jit
def _ranks_tile(ptr, rr, r1, t0, h0, w0, lh, lw, H, W, START, sn, d, mask_d, EVICT: tl.constexpr):
    """The rows n of a block's tokens of ranks rr (raster order inside the block, `_raster`) and their tile, those from
    r1 on masked (`_tile`)."""
    n = _raster(rr, t0, h0, w0, lh, lw, H, W, START)
    return n, _tile(ptr, n, sn, rr < r1, d, 1, mask_d, 0.0, EVICT)


@triton.jit
def _load_rows(ptr, n, sn, mask_n, d, mask_d, sd=1, other=0.0):
    return _tile(ptr, n, sn, mask_n, d, sd, mask_d, other, "").to(tl.float32)


@triton.jit
def _norm_weight(w_ptr, d, mask_d, NORM: tl.constexpr):
    """The head's RMSNorm weights over the tile's columns in fp32 (zeros without NORM), loaded once per program
    before its token loop: loaded inside `_features`, the output kernel kept them live in 33 more registers."""
    if NORM:
        w = tl.load(w_ptr + d, mask=mask_d, other=0.0).to(tl.float32)
    else:
        w = tl.zeros(d.shape, tl.float32)
    return w


@triton.jit
def _features(x_ptr, sxn, cos_ptr, sin_ptr, scn, scd, xs_ptr, xw, n, mask_n, d, mask_d,
              BN: tl.constexpr, BD: tl.constexpr, ELU: tl.constexpr, ROPE: tl.constexpr, NORM: tl.constexpr):
    """`_tile_features` of x's rows n, loaded here."""
    x = _tile(x_ptr, n, sxn, mask_n, d, 1, mask_d, 0.0, "")
    return _tile_features(x, cos_ptr, sin_ptr, scn, scd, xs_ptr, xw, n, mask_n, d, mask_d, BN, BD, ELU, ROPE, NORM)


@triton.jit
def _tile_features(x, cos_ptr, sin_ptr, scn, scd, xs_ptr, xw, n, mask_n, d, mask_d,
                   BN: tl.constexpr, BD: tl.constexpr, ELU: tl.constexpr, ROPE: tl.constexpr, NORM: tl.constexpr):
    """phi(x) of a loaded tile x of rows n (zero outside the tile), and the rotated features used in numerators. With
    NORM, x is first RMSNormed across heads: x * rstd[n] * xw[d] (the per-token rstd from `_rstd_kernel`, the head's
    weights from `_norm_weight`)."""
    x = x.to(tl.float32)
    if NORM:
        x = x * tl.load(xs_ptr + n, mask=mask_n, other=0.0)[:, None] * xw[None, :]
    fx = _phi_tile(x, mask_n, mask_d, ELU)
    rx = fx
    if ROPE:
        cos, sin = _rope_tables(cos_ptr, sin_ptr, scn, scd, n, mask_n, d, mask_d)
        rx = _rotate(fx, cos, sin, d, BN, BD)
    return fx, rx


@triton.jit
def _rope_tables(cos_ptr, sin_ptr, scn, scd, n, mask_n, d, mask_d):
    return _load_rows(cos_ptr, n, scn, mask_n, d, mask_d, scd), _load_rows(sin_ptr, n, scn, mask_n, d, mask_d, scd)


@triton.jit
def _rotate(x, cos, sin, d, BN: tl.constexpr, BD: tl.constexpr):
    """The RoPE rotation of a feature tile, from its (BN, BD) cos and sin tiles."""
    sign = tl.where(d % 2 == 0, -1.0, 1.0)[None, :]
    return x * cos + sign * _swap_pairs(x, BN, BD) * sin


@triton.jit
def _rotate_t(g, cos, sin, d, BN: tl.constexpr, BD: tl.constexpr):
    """Transpose of the RoPE rotation, applied to a gradient tile."""
    sign = tl.where(d % 2 == 0, -1.0, 1.0)[None, :]
    return g * cos - sign * _swap_pairs(g * sin, BN, BD)


@triton.jit
def _rope_t(g, cos_ptr, sin_ptr, scn, scd, n, mask_n, d, mask_d, BN: tl.constexpr, BD: tl.constexpr):
    """`_rotate_t` with the tables loaded here."""
    cos, sin = _rope_tables(cos_ptr, sin_ptr, scn, scd, n, mask_n, d, mask_d)
    return _rotate_t(g, cos, sin, d, BN, BD)


@triton.jit
def _block_outputs(q_ptr, o_ptr, cos_ptr, sin_ptr, s_ptr, z_ptr, base, qs_ptr, qw_ptr, gain_ptr, sqn, scn, scd, son,
                   eps, out_eps, t0, h0, w0, lh, lw, r0, r1, H, W, START, d, mask_d, e, mask_e, D: tl.constexpr,
                   DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ELU: tl.constexpr,
                   ROPE: tl.constexpr, NORMALIZE: tl.constexpr, NORM_Q: tl.constexpr, OUT_NORM: tl.constexpr,
                   DOT: tl.constexpr, PRECISION: tl.constexpr, STREAM: tl.constexpr, PREFETCH: tl.constexpr,
                   PDL: tl.constexpr):
    """o = rope(phi(q)) mat [/ (phi(q) . zt + eps)] for the tokens [r0, r1) (raster order inside the block) of one
    block, mat and zt its mixed summary at row `base` of S~ and z~: `_output_kernel`'s token loop. With OUT_NORM (the
    program holds the head's whole Dv), each row is then RMSNormed and scaled by the head's gain. With PREFETCH, the
    loads of the next q tile are issued before this tile's product, into registers (the launch runs unpipelined: its
    pipeline stages cost more than they hide, and without it each program waited on every tile's loads), and the first
    tile's, with the norm weights, before the program waits for S~ (`_await_inputs`): they overlap the mixing launch.
    The caller wrote them before that launch started (`block_output`)."""
    qw = _norm_weight(qw_ptr, d, mask_d, NORM_Q)
    if OUT_NORM:
        gain = tl.load(gain_ptr + e, mask=mask_e, other=0.0).to(tl.float32)
    if PREFETCH:  # the next tile's rows and loads, carried over the loop
        n_next, x_next = _ranks_tile(q_ptr, r0 + tl.arange(0, BLOCK_N), r1, t0, h0, w0, lh, lw, H, W, START, sqn, d,
                                     mask_d, STREAM)
        _await_inputs(PDL)
    mat = tl.load(s_ptr + (base * D + d[:, None]) * DV + e[None, :], mask=mask_d[:, None] & mask_e[None, :], other=0.0)
    mat = mat.to(DOT)
    zt = tl.load(z_ptr + base * D + d, mask=mask_d, other=0.0)
    for r in range(r0, r1, BLOCK_N):
        rr = r + tl.arange(0, BLOCK_N)
        mask_n = rr < r1
        if PREFETCH:
            n, x = n_next, x_next
            n_next, x_next = _ranks_tile(q_ptr, rr + BLOCK_N, r1, t0, h0, w0, lh, lw, H, W, START, sqn, d, mask_d,
                                         STREAM)
        else:
            n, x = _ranks_tile(q_ptr, rr, r1, t0, h0, w0, lh, lw, H, W, START, sqn, d, mask_d, STREAM)
        fx, rx = _tile_features(x, cos_ptr, sin_ptr, scn, scd, qs_ptr, qw, n, mask_n, d, mask_d, BLOCK_N, BLOCK_D,
                                ELU, ROPE, NORM_Q)
        out = tl.dot(rx.to(DOT), mat, input_precision=PRECISION)
        if NORMALIZE:
            out = out / (tl.sum(fx * zt[None, :], axis=1) + eps)[:, None]
        if OUT_NORM:  # columns past Dv are zeros: the sum of squares is the row's
            out = out * tl.rsqrt(tl.sum(out * out, axis=1) / DV + out_eps)[:, None] * gain[None, :]
        tl.store(o_ptr + n[:, None] * son + e[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=mask_n[:, None] & mask_e[None, :], eviction_policy=STREAM)


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _summary_kernel(
    x_ptr, y_ptr, cos_ptr, sin_ptr, ys_ptr, zw_ptr, xs_ptr, xw_ptr, s_ptr, z_ptr,
    sxb, sxn, sxh, syb, syn, syh, scb, scn, sch, scd,
    heads, N, M, T, H, W, NBT, NBH, NBW, START, M0, D: tl.constexpr, DV: tl.constexpr, TOK,
    HEAD_ALIGN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    D_TILES: tl.constexpr, DV_TILES: tl.constexpr,
    ELU: tl.constexpr, ROPE: tl.constexpr, SCALE_Y: tl.constexpr, WEIGHT_Z: tl.constexpr,
    WITH_Z: tl.constexpr, Z_IN_DOT: tl.constexpr, ATOMIC: tl.constexpr, NORM_X: tl.constexpr, DOT: tl.constexpr,
    PRECISION: tl.constexpr, KEEP: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    _await_inputs(PDL)
    bh, pid_t, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    dt = (pid_t // DV_TILES) % D_TILES
    vt = pid_t % DV_TILES
    b, h = bh // heads, bh % heads
    m, t0, h0, w0, lh, lw, r0, r1 = _block_tokens(pid_t // (D_TILES * DV_TILES), pid_s, TOK, N, T, H, W, NBT, NBH,
                                                  NBW, START, M0)
    x_ptr = _head(x_ptr, b, h, sxb, sxh, HEAD_ALIGN)
    y_ptr = _head(y_ptr, b, h, syb, syh, HEAD_ALIGN)
    cos_ptr = _head(cos_ptr, b, h, scb, sch, HEAD_ALIGN)
    sin_ptr = _head(sin_ptr, b, h, scb, sch, HEAD_ALIGN)
    xs_ptr = xs_ptr + b * N
    d = dt * BLOCK_D + tl.arange(0, BLOCK_D)
    e = vt * BLOCK_DV + tl.arange(0, BLOCK_DV)
    mask_d, mask_e = d < D, e < DV
    xw = _norm_weight(xw_ptr + h * D, d, mask_d, NORM_X)
    acc = tl.zeros((BLOCK_D, BLOCK_DV), tl.float32)
    if not Z_IN_DOT:
        zacc = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)  # z per token row, summed once at the end
    for r in range(r0, r1, BLOCK_N):
        rr = r + tl.arange(0, BLOCK_N)
        mask_n = rr < r1
        n = _raster(rr, t0, h0, w0, lh, lw, H, W, START)
        fx, rx = _features(x_ptr, sxn, cos_ptr, sin_ptr, scn, scd, xs_ptr, xw, n, mask_n, d, mask_d, BLOCK_N,
                           BLOCK_D, ELU, ROPE, NORM_X)
        # with Z_IN_DOT, ones past Dv (and in rows past the block, where rx is zero): the product's column DV is z
        y = _load_rows(y_ptr, n, syn, mask_n, e, mask_e, 1, 1.0 if Z_IN_DOT else 0.0)
        if SCALE_Y:
            y = y * tl.load(ys_ptr + bh * N + n, mask=mask_n, other=0.0)[:, None]
        acc += tl.dot(tl.trans(rx.to(DOT)), y.to(DOT), input_precision=PRECISION)
        if WITH_Z and not Z_IN_DOT:  # elementwise in fx's layout: no fp32 product or layout change, no per-tile sum
            if WEIGHT_Z:
                zacc += fx * tl.load(zw_ptr + bh * N + n, mask=mask_n, other=0.0)[:, None]
            else:
                zacc += fx  # zero outside the block's tokens already
    base = _state_row(m, bh)
    s_off = (base * D + d[:, None]) * DV + e[None, :]
    written = (r0 < r1) | (pid_s == 0)  # a block's first program also stores the zeros of a block the slice misses
    s_mask = mask_d[:, None] & mask_e[None, :] & written
    z_mask = mask_d & written & (vt == 0)
    if Z_IN_DOT:
        zsum = tl.sum(tl.where(e[None, :] == DV, acc, 0.0), axis=1)
    else:
        zsum = tl.sum(zacc, axis=0)
    if ATOMIC:
        tl.atomic_add(s_ptr + s_off, acc, mask=s_mask)
        if WITH_Z:
            tl.atomic_add(z_ptr + base * D + d, zsum, mask=z_mask)
    else:
        tl.store(s_ptr + s_off, acc.to(s_ptr.dtype.element_ty), mask=s_mask, eviction_policy=KEEP)
        if WITH_Z:
            tl.store(z_ptr + base * D + d, zsum, mask=z_mask)


@triton.jit
def _output_kernel(
    q_ptr, cos_ptr, sin_ptr, s_ptr, z_ptr, qs_ptr, qw_ptr, gain_ptr, o_ptr,
    sqb, sqn, sqh, scb, scn, sch, scd, sob, son, soh,
    heads, N, M, T, H, W, NBT, NBH, NBW, START, M0, D: tl.constexpr, DV: tl.constexpr, TOK, eps, out_eps,
    HEAD_ALIGN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    DV_TILES: tl.constexpr, ELU: tl.constexpr, ROPE: tl.constexpr, NORMALIZE: tl.constexpr, NORM_Q: tl.constexpr,
    OUT_NORM: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr, STREAM: tl.constexpr, PREFETCH: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    if not PREFETCH:  # with it, the program waits once its first q tile's loads are issued (`_block_outputs`)
        _await_inputs(PDL)
    bh, pid_t, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    vt = pid_t % DV_TILES
    b, h = bh // heads, bh % heads
    m, t0, h0, w0, lh, lw, r0, r1 = _block_tokens(pid_t // DV_TILES, pid_s, TOK, N, T, H, W, NBT, NBH, NBW, START, M0)
    q_ptr = _head(q_ptr, b, h, sqb, sqh, HEAD_ALIGN)
    o_ptr = _head(o_ptr, b, h, sob, soh, HEAD_ALIGN)
    cos_ptr = _head(cos_ptr, b, h, scb, sch, HEAD_ALIGN)
    sin_ptr = _head(sin_ptr, b, h, scb, sch, HEAD_ALIGN)
    d = tl.arange(0, BLOCK_D)
    e = vt * BLOCK_DV + tl.arange(0, BLOCK_DV)
    mask_d, mask_e = d < D, e < DV
    _block_outputs(q_ptr, o_ptr, cos_ptr, sin_ptr, s_ptr, z_ptr, _state_row(m, bh), qs_ptr + b * N, qw_ptr + h * D,
                   gain_ptr + h * DV, sqn, scn, scd, son, eps, out_eps, t0, h0, w0, lh, lw, r0, r1, H, W, START, d,
                   mask_d, e, mask_e, D, DV, BLOCK_N, BLOCK_D, ELU, ROPE, NORMALIZE, NORM_Q, OUT_NORM, DOT, PRECISION,
                   STREAM, PREFETCH, PDL)


@triton.jit
def _clear(ptr, count, first):
    """Zeroes `count` fp32 values from ptr in the one program where `first` holds: a buffer the next launch adds
    into, cleared by the launch before it (which that launch waits for anyway) instead of by a fill launch of its
    own. Called after `_await_inputs`: under PDL, a launch still running before it may hold the memory."""
    if first:
        for i in range(0, count, 1024):
            o = i + tl.arange(0, 1024)
            tl.store(ptr + o, tl.zeros((1024,), tl.float32), mask=o < count)


@triton.jit
def _grad_summary(mat_rows, vec_ptr, d, mask_d, e0, DV: tl.constexpr, DOT: tl.constexpr):
    """The grad kernel's first (D x Dv-tile) tile of its block's summary, as the dot operand, and the block's vector."""
    mat0 = tl.load(mat_rows + e0[None, :], mask=mask_d[:, None] & (e0 < DV)[None, :], other=0.0).to(DOT)
    return mat0, tl.load(vec_ptr + d, mask=mask_d, other=0.0)


@triton.jit
def _grad_kernel(
    x_ptr, y_ptr, cos_ptr, sin_ptr, mat_ptr, vec_ptr, dx_ptr, dy_ptr, rden_ptr, c_ptr, ds_ptr, dz_ptr, clear_ptr,
    sxb, sxn, sxh, syb, syn, syh, scb, scn, sch, scd, sdxb, sdxn, sdxh, sdyb, sdyn, sdyh,
    heads, N, M, T, H, W, NBT, NBH, NBW, START, M0, D: tl.constexpr, DV: tl.constexpr, TOK, eps, clear_count,
    HEAD_ALIGN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    DV_TILES: tl.constexpr, ELU: tl.constexpr, ROPE: tl.constexpr, STATS: tl.constexpr, USE_VEC: tl.constexpr,
    WITH_DY: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr, SUMMARIZE: tl.constexpr = False,
    CLEAR: tl.constexpr = False, EARLY_X: tl.constexpr = False, EARLY_Y: tl.constexpr = False,
    EARLY_MAT: tl.constexpr = False, PDL: tl.constexpr = 0,
):
    """With CLEAR, the first program also zeroes the clear_count fp32 values at clear_ptr (`_clear`): the backward's
    dmix, which the mixing launch after this one adds into (`output_backward`).
    EARLY_X, EARLY_Y, EARLY_MAT (only where each program walks one token tile): the program loads its x tile, its
    first y tile, or mat's first tile and vec before it waits for the launch ahead (`_await_inputs`), so they overlap
    that launch: the launcher says which were complete before that launch started (`block_grad(early=)`)."""
    bh, pid_m, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = bh // heads, bh % heads
    m, t0, h0, w0, lh, lw, r0, r1 = _block_tokens(pid_m, pid_s, TOK, N, T, H, W, NBT, NBH, NBW, START, M0)
    x_ptr = _head(x_ptr, b, h, sxb, sxh, HEAD_ALIGN)
    y_ptr = _head(y_ptr, b, h, syb, syh, HEAD_ALIGN)
    dx_ptr = _head(dx_ptr, b, h, sdxb, sdxh, HEAD_ALIGN)
    dy_ptr = _head(dy_ptr, b, h, sdyb, sdyh, HEAD_ALIGN)
    cos_ptr = _head(cos_ptr, b, h, scb, sch, HEAD_ALIGN)
    sin_ptr = _head(sin_ptr, b, h, scb, sch, HEAD_ALIGN)
    d = tl.arange(0, BLOCK_D)
    mask_d = d < D
    base = _state_row(m, bh)
    mat_rows = mat_ptr + (base * D + d[:, None]) * DV
    e0 = tl.arange(0, BLOCK_DV)
    n0 = _raster(r0 + tl.arange(0, BLOCK_N), t0, h0, w0, lh, lw, H, W, START)  # the first tile's rows
    mask_n0 = r0 + tl.arange(0, BLOCK_N) < r1
    if EARLY_X:
        x0 = _tile(x_ptr, n0, sxn, mask_n0, d, 1, mask_d, 0.0, "")
    if EARLY_Y:
        y0 = _load_rows(y_ptr, n0, syn, mask_n0, e0, e0 < DV)
    if EARLY_MAT:
        mat0, vec = _grad_summary(mat_rows, vec_ptr + base * D, d, mask_d, e0, DV, DOT)
    _await_inputs(PDL)
    if CLEAR:
        _clear(clear_ptr, clear_count, (bh == 0) & (pid_m == 0) & (pid_s == 0))
    if not EARLY_MAT:
        mat0, vec = _grad_summary(mat_rows, vec_ptr + base * D, d, mask_d, e0, DV, DOT)
    for r in range(r0, r1, BLOCK_N):
        rr = r + tl.arange(0, BLOCK_N)
        mask_n = rr < r1
        n = _raster(rr, t0, h0, w0, lh, lw, H, W, START)
        if EARLY_X:  # the program's one tile
            x = x0
        else:
            x = _tile(x_ptr, n, sxn, mask_n, d, 1, mask_d, 0.0, "")
        fx, rx = _tile_features(x, cos_ptr, sin_ptr, scn, scd, x_ptr, vec, n, mask_n, d, mask_d, BLOCK_N, BLOCK_D,
                                ELU, ROPE, False)  # no norm: the x_ptr and vec stand-ins go unused
        p = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
        if STATS:
            rden = 1.0 / (tl.sum(fx * vec[None, :], axis=1) + eps)
        for j in tl.static_range(DV_TILES):
            e = j * BLOCK_DV + e0
            mask_e = e < DV
            if j == 0:
                mat = mat0
            else:
                mat = tl.load(mat_rows + e[None, :], mask=mask_d[:, None] & mask_e[None, :], other=0.0).to(DOT)
            if EARLY_Y and j == 0:
                y = y0
            else:
                y = _load_rows(y_ptr, n, syn, mask_n, e, mask_e)
            p += tl.dot(y.to(DOT), tl.trans(mat), input_precision=PRECISION)
            if WITH_DY:
                dy = tl.dot(rx.to(DOT), mat, input_precision=PRECISION)
                tl.store(dy_ptr + n[:, None] * sdyn + e[None, :], dy.to(dy_ptr.dtype.element_ty),
                         mask=mask_n[:, None] & mask_e[None, :])
            if SUMMARIZE:  # the block in this one tile: dS~ = rope(phi(q))^T (dO / den)
                if STATS:
                    y = y * rden[:, None]
                ds = tl.dot(tl.trans(rx.to(DOT)), y.to(DOT), input_precision=PRECISION)
                tl.store(ds_ptr + (base * D + d[:, None]) * DV + e[None, :], ds.to(ds_ptr.dtype.element_ty),
                         mask=mask_d[:, None] & mask_e[None, :])
        if STATS:  # q side, normalized: P = dO S~^T; den, 1/den and c = -(rq . P) / den^2 per token
            c = -tl.sum(rx * p, axis=1) * rden * rden
            tl.store(rden_ptr + bh * N + n, rden, mask=mask_n)
            tl.store(c_ptr + bh * N + n, c, mask=mask_n)
            if SUMMARIZE:  # dz~ = sum of phi(q) c
                tl.store(dz_ptr + base * D + d, tl.sum(fx * c[:, None], axis=0), mask=mask_d)
            p = p * rden[:, None]
        if ROPE:  # the tables are loaded again here: loading them once per tile measured 1-2 % slower (NOTES)
            p = _rope_t(p, cos_ptr, sin_ptr, scn, scd, n, mask_n, d, mask_d, BLOCK_N, BLOCK_D)
        if USE_VEC:
            if STATS:
                p += c[:, None] * vec[None, :]
            else:
                p += vec[None, :]
        dx = p * _dphi(fx, ELU)
        tl.store(dx_ptr + n[:, None] * sdxn + d[None, :], dx.to(dx_ptr.dtype.element_ty),
                 mask=mask_n[:, None] & mask_d[None, :])


@triton.jit
def _rstd_kernel(x_ptr, out_ptr, sxb, sxn, sxh, N, heads, eps, D: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, PDL: tl.constexpr = 0):
    """out[b, n] = 1 / sqrt(mean of x[b, n]**2 over all heads and features + eps): an RMSNorm across heads, of
    which the token kernels apply the rest (x * out[n] * weight) as they load x (`_features`)."""
    _await_inputs(PDL)
    pid_b, pid_n = tl.program_id(0), tl.program_id(1)
    n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # n * sxn: past 2^31 for long fused-qkv videos
    d = tl.arange(0, BLOCK_D)
    mask_n, mask_d = n < N, d < D
    x_ptr = x_ptr + pid_b.to(tl.int64) * sxb
    acc = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    for h in range(heads):
        x = _load_rows(x_ptr + h * sxh, n, sxn, mask_n, d, mask_d)
        acc += x * x
    rstd = tl.rsqrt(tl.sum(acc, axis=1) / (heads * D) + eps)
    tl.store(out_ptr + pid_b * N + n, rstd, mask=mask_n)


@triton.jit
def _gram_kernel(a_ptr, b_ptr, out_ptr, M, F, F_PER,
                 BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr = 0):
    """out[i, j] += sum over f of a[i, f] b[j, f] ((M, F) operands), f split over programs.

    cuBLAS runs this shape (M x M outputs, K = B*heads*D*Dv) on a handful of CTAs; here the
    K range is cut into programs whose partial M x M tiles meet in fp32 atomics. Each program adds
    M*M atomics on the same addresses, so the split stays coarse (CONFIG "programs": 256; 1024
    measured 0.161 vs 0.068 ms at Wan 480p, H200).
    """
    _await_inputs(PDL)
    pid_f, pid_ij = tl.program_id(0), tl.program_id(1)
    n_j = tl.cdiv(M, BLOCK_M)
    i = (pid_ij // n_j) * BLOCK_M + tl.arange(0, BLOCK_M)
    j = (pid_ij % n_j) * BLOCK_M + tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_M), tl.float32)
    f0 = pid_f.to(tl.int64) * F_PER
    for f in range(f0, tl.minimum(f0 + F_PER, F), BLOCK_K):
        kk = f + tl.arange(0, BLOCK_K)
        mk = kk < F
        a = tl.load(a_ptr + i[:, None].to(tl.int64) * F + kk[None, :], mask=(i < M)[:, None] & mk[None, :], other=0.0)
        b = tl.load(b_ptr + j[:, None].to(tl.int64) * F + kk[None, :], mask=(j < M)[:, None] & mk[None, :], other=0.0)
        acc += tl.dot(a, tl.trans(b), input_precision=PRECISION)
    tl.atomic_add(out_ptr + i[:, None] * M + j[None, :], acc, mask=(i < M)[:, None] & (j < M)[None, :])


@triton.jit
def _softmax_rows(x, mask_cols):
    """The row softmax over the columns mask_cols (zero outside them) of an fp32 tile of logits: the mixing matrix as
    `MixingMatrices` forms it, made where the kernel loads it instead of by a launch of its own."""
    x = tl.where(mask_cols[None, :], x, float("-inf"))
    e = tl.exp(x - tl.max(x, axis=1)[:, None])
    return e / tl.sum(e, axis=1)[:, None]


@triton.jit
def _mix_walk(a, src_ptr, dst_ptr, partner_ptr, i, mask_i, k, M, F, sb, sf, spb, spf, first, step,
              BLOCK_F: tl.constexpr, PRECISION: tl.constexpr, GRAM: tl.constexpr, KEEP: tl.constexpr):
    """dst[i, f] = sum_b a[i, b] src[b, f] for the BLOCK_F column tiles first, first + step, ...; int64 row offsets
    (M * F passes 2^31 for long videos). src's tiles are taken in a's type: a no-op for the walks `_mix_kernel` runs,
    but Triton 3.6 also compiles its z walk without WITH_Z (a Python False as an if's condition is no constexpr
    there), on S's bf16 buffer standing in for z (H200, session 38: every launch without z failed to compile).
    Returns, with GRAM, the walk's share of the Gram sum_f src[b, f] partner[b', f] (partner read through its strides
    spb, spf, in src's tile type; TF32 products for fp32 tiles, as `block_gram` takes them for 16-bit inputs, where
    IEEE fp32 took 255 registers and spilled on sm_90): the (blocks x blocks) tile over the same src tiles."""
    dst_rows = dst_ptr + i.to(tl.int64)[:, None] * F
    gram = tl.zeros((k.shape[0], k.shape[0]), tl.float32)
    for t in range(first, tl.cdiv(F, BLOCK_F), step):
        f = t * BLOCK_F + tl.arange(0, BLOCK_F)
        mask_f = f < F
        tile = _tile(src_ptr, k.to(tl.int64), sb, k < M, f, sf, mask_f, 0.0, "").to(a.dtype)
        acc = tl.dot(a, tile, input_precision=PRECISION)
        tl.store(dst_rows + f[None, :], acc.to(dst_ptr.dtype.element_ty), mask=mask_i[:, None] & mask_f[None, :],
                 eviction_policy=KEEP)
        if GRAM:
            other = _tile(partner_ptr, k.to(tl.int64), spb, k < M, f, spf, mask_f, 0.0, "").to(a.dtype)
            gram = tl.dot(tile, tl.trans(other), gram, input_precision="tf32")
    return gram


@triton.jit
def _mix_kernel(mix_ptr, s_ptr, out_ptr, z_ptr, zout_ptr, ps_ptr, pz_ptr, gram_ptr, M, F, FZ, KM, smi, smk, ssb, ssf,
                szb, szf, spsb, spsf, spzb, spzf, s_walks, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr,
                BLOCK_K: tl.constexpr, WITH_Z: tl.constexpr, GRAM: tl.constexpr, KEEP: tl.constexpr,
                SOFTMAX: tl.constexpr = False, PDL: tl.constexpr = 0):
    """out[i, f] = sum_b mix[i, b] s[b, f] ((M, F) s, contiguous (M, F) out), fp32 accumulate (bf16 s in the op,
    where `mixes_with_kernel` sends only bf16; fp32 s, which the interpreter test passes, multiplies in TF32), and
    with WITH_Z the same for the fp32 normalizer sums z (M, FZ) into zout, in full fp32 with mix as given (Triton's
    TF32 products truncate their operands where cuBLAS' round them: a bias in the normalizer; z's products are
    1 / Dv of S's).
    mix: read through its strides (smi, smk) up to column KM, converted to s's type in the kernel: either the
    padded operand `_mix_operand` makes (KM its width, a multiple of 16: vectorized row loads) or, up to
    CONFIG["mix"]["fold_up_to"] blocks, the fp32 matrix (or the backward's mix^T view) as the caller holds it; with
    SOFTMAX there, the matrix's logits, each row softmaxed over its KM = M columns as it is loaded.
    Row-stationary: the program holds the BLOCK_M rows of grid axis 0 of mix over all M <= BLOCK_K columns (loaded
    once, kept in shared memory) and walks the BLOCK_F column tiles of s from axis 1's index in steps of s_walks
    (axis 1's programs past s_walks walk z's tiles), the launch's num_stages tiles in flight; the programs of one
    walk, one per row block, are adjacent in launch order, so each S tile comes from HBM once and from L2 for the
    other row blocks.
    GRAM (made for one row block, as at up to CONFIG["mix"]["gram_up_to"] blocks; with more, each walk's tiles are
    read by one program per row block and the first row block's add): the backward's dmix as well, from the
    tiles it mixes, added into the zeroed (M x M) fp32 gram: sum_f s[b, f] ps[b', f] + z[b, f] pz[b', f] (ps, pz: the
    forward's S and z); one atomic add of a (blocks x blocks) tile per program."""
    _await_inputs(PDL)
    r, p = tl.program_id(0), tl.program_id(1)
    i = r * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_i = i < M
    k = tl.arange(0, BLOCK_K)
    a = _tile(mix_ptr, i, smi, mask_i, k, smk, k < KM, 0.0, "")
    if SOFTMAX:
        a = _softmax_rows(a.to(tl.float32), k < KM)
    z_walk = False
    if WITH_Z:
        z_walk = p >= s_walks
    if z_walk:
        gram = _mix_walk(a.to(tl.float32), z_ptr, zout_ptr, pz_ptr, i, mask_i, k, M, FZ, szb, szf, spzb, spzf,
                         p - s_walks, tl.num_programs(1) - s_walks, BLOCK_F, "ieee", GRAM, KEEP)
    else:
        gram = _mix_walk(a.to(s_ptr.dtype.element_ty), s_ptr, out_ptr, ps_ptr, i, mask_i, k, M, F, ssb, ssf, spsb,
                         spsf, p, s_walks, BLOCK_F, "tf32", GRAM, KEEP)
    if GRAM:  # the first row block's programs add: every row block walks the same tiles
        tl.atomic_add(gram_ptr + k[:, None] * M + k[None, :], gram, mask=(k < M)[:, None] & (k < M)[None, :] & (r == 0))


# ----------------------------------------------------------------------------- launchers


class Geometry:
    """Integer arguments shared by all kernels of one call: the tensors' sizes over the call's block geometry.

    The call's tensors hold raster tokens [start, start + N) of the grid (a context-parallel rank's slice; the
    whole grid is start 0). The token kernels launch over blocks [m0, m0 + m_count), the id range of the
    blocks the slice touches, for as many tokens as the slice has in its fullest block (`max_len`); summaries
    keep all M blocks, so that ranks can sum them.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, blocks: BlockGeometry, start: int = 0):
        self.B, self.N, self.heads, self.D = x.shape
        self.DV = y.shape[-1]
        self.grid, self.blocks = blocks.grid, blocks.blocks
        self.M = blocks.num_blocks
        self.BH = self.B * self.heads
        self.partial = self.N < blocks.num_tokens
        self.m0, self.m_count, self.max_len = blocks.slice_blocks(start, start + self.N)
        self.args = (*self.grid, *self.blocks)
        self.slice_args = (start, self.m0)


def _dot_types(dtype: torch.dtype):
    """Operand type of the tensor-core products and their fp32 precision.

    bf16 inputs multiply in bf16 (fp32 accumulate); fp16 inputs in tf32, since fp32 summaries can
    overflow fp16; fp32 inputs in full fp32.
    """
    if dtype == torch.bfloat16:
        return tl.bfloat16, "tf32"
    return tl.float32, ("ieee" if dtype == torch.float32 else "tf32")


def _tokens_per_program(g: Geometry, block_n: int, programs_per_token_group: int, target: int) -> int:
    """Tokens each program walks: enough programs to fill the GPU, as few as possible beyond that."""
    tiles = cdiv(g.max_len, block_n)
    groups = max(1, min(tiles, cdiv(target, max(1, programs_per_token_group))))
    return cdiv(tiles, groups) * block_n


def head_align(*tensors: torch.Tensor) -> int:
    """A launch's HEAD_ALIGN (`_head`) over `tensors` (B, N, heads, D): the largest power of two, up to 16, that
    divides every head stride."""
    return math.gcd(16, *(t.stride(2) for t in tensors))


def _rope_args(rope, g: Geometry, like: torch.Tensor):
    if rope is None:
        return like, like, (0, 0, 0, 0)
    cos, sin = (t.expand(g.B, g.N, g.heads, g.D) for t in rope)
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    return cos, sin, (cos.stride(0), cos.stride(1), cos.stride(2), cos.stride(3))


# Launch settings for bf16 tiles up to 128 x 128 (measured on an H200: kernels/NOTES.md; a card with less shared memory
# per program takes them stepped down, `fitting.launch_within_card`); "programs" is how many programs to aim for
# (tokens per program follow from it); "maxnreg" caps registers per thread (None: the compiler's choice). "mix": the
# mixing GEMM (`_mix_settings`): a program holds 64 rows of mix and walks
# 64-column S tiles on 4 warps, 4 tiles in flight, 264 programs; over "wide_over" blocks, 128 rows on 8 warps ("wide");
# up to "max_blocks" blocks (more take cuBLAS: `mixes_with_kernel`). H200, session 34 sweeps (BENCHMARKS.md), bf16 S,
# us, session 29's kernel (a program per S tile, all rows) -> this: 180 blocks 89.0 -> 64.0, 252: 343.5 -> 263.4
# (wide: 232.3), 121 (SANA 4K): 17.8 -> 13.2, 60: 20.3 -> 15.2; wide at 180 blocks 67.5, at 256 13.9 (not wide 15.3).
# Up to "fold_up_to" blocks it reads mix unpadded and mixes z in the same launch (session 37, not yet timed); up to
# "gram_up_to" (no more than "fold_up_to") the backward's mix^T launch also forms dmix (`output_backward`), on its
# "gram" settings. H100, session 45 (`bench op --versus`, f+b ms, two Gram launches, their fills and sum -> the Gram
# in the mixing launch at 4 stages): DiT-XL/2 512 px 0.112 -> 0.0916, 384 px 0.0866 -> 0.0717, SANA-1.6B 1K 0.112 ->
# 0.0939; every mixing launch on 2 stages then took the f+b 5 % lower and the forward 3-4 % higher, so the Gram's
# launch alone takes 2 (sm_90: 219 -> 128 registers); H100, session 46: 2 -> 4 stages f+b 1.055-1.072x, 264 -> 132
# programs 0.992-1.005x, 66: 1.071-1.075x. Up to "keep_up_to" blocks the backward takes the mixed summaries the
# forward made (`keeps_mixed`); H100, session 46 (`--versus mhla.CONFIG.mix.keep_up_to=0`, f+b ms, mixed again -> kept):
# DiT-XL/2 384 px 0.0688 -> 0.0641, 512 px 0.0874 -> 0.0826, SANA-1.6B 1K 0.0895 -> 0.0852; session 47, 32 -> 64
# blocks: DiT-XL/2 1024 px (64 blocks) 0.209 -> 0.195 (7 rounds), folding z and the Gram there too ("fold_up_to",
# "gram_up_to" 64: the launch spills on sm_90, 248-352 B) no faster (0.194; alone 0.998x); session 48, "fold_up_to"
# and "gram_up_to" 32 -> 64 (`--versus`, two calls, fwd / f+b ms): Wan2.1-1.3B 480p in 3 x 4 x 5 blocks (60: the padded
# copy, its fill, z's cuBLAS GEMM and two Gram launches gone) 0.230 / 0.892 -> 0.225 / 0.823 and 0.230 / 0.890 ->
# 0.226 / 0.819, DiT-XL/2 1024 px unchanged (0.996x / 0.999x); 128 lost at SANA-1.6B 4K (121 blocks: 1.084x /
# 1.169x) and tied at Wan2.1-14B 720p in 3 x 5 x 8 (120); the Gram's launch at 60 blocks spills 784 B on its 4 warps
# (resources.py), 104 B on 8, and 8 warps measured 0.982x f+b there (inside the spread), 0.999x at 64 blocks, 1.015x at
# 30 (session 48, call 12): it keeps 4; "keep_within_v" (session 47, `--versus
# mhla.CONFIG.mix.keep_up_to=256`, f+b ms): SANA-1.6B 4K 0.820 -> 0.791, Wan2.1-1.3B 480p at the model's 180
# blocks 1.229 -> 1.154, Wan2.1-14B 720p at 252: 6.566 -> 6.284. 1056 programs instead of 264: forward 1.065x at
# 512 px, 1.045x at SANA 1K. "grad": where blocks of at most "summarize_up_to" tokens fit one token tile, the q-side
# grad launch also makes dO's summaries dS~, dz~ (`block_grad`), on "summarize_warps" where its D x Dv tile is over
# "summarize_wide_over" elements (`grad_options`). H100, session 47 (`--versus`, f+b ms; a launch of their own -> in
# the grad launch; DiT's 128 x 128 tiles on 8 warps, SANA's 32 x 32 on 4): DiT-XL/2 384 px 0.0633 -> 0.0593, 512 px
# 0.0816 -> 0.0785, 1024 px 0.225 -> 0.211, SANA-1.6B 1K 0.0842 -> 0.0805; DiT on 4 warps 1.28-1.51x, SANA on 8 warps
# 1.34x; the Dv loop's last tile only as wide as its columns (DiT's 72 as 64 + 16, not 128) was 1.07-1.09x slower at
# DiT-XL/2 384-1024 px f+b (session 48, kernels/NOTES.md). "summary": 4 pipeline stages over SHORT_BLOCK tokens a block
# (SHORT_CONFIG keeps 3); H100, session 48 (`--versus mhla.CONFIG.summary.num_stages=4`, two calls, forward ms):
# Wan2.1-14B 720p 1.445 -> 1.400 and 1.444 -> 1.407, at its 252 blocks 1.736 -> 1.714, Wan2.1-1.3B 480p at its 180
# 0.318 -> 0.310 (as Wan uses it 0.317 -> 0.310), 60 blocks and SANA-1.6B 4K level, every f+b level (0.995-1.003);
# DiT-XL/2 1024 px's 64-token blocks 1.023x. "output": "fit_block" puts blocks of at most 32 tokens on 32-token tiles
# (`block_output`); H100, session 47 (`--versus mhla.CONFIG.output.block_n=32`, f+b ms): DiT-XL/2 384 px (30-token
# blocks) 0.0592 -> 0.0573; at 512 px (42) 32-token tiles cost the forward 10.7 %, where the rule keeps 64. Its
# "programs" (512, not 1024) splits a block over programs only where fewer than 512 blocks x heads make the launch: of
# the shapes timed, only Wan2.1-1.3B 480p in (3, 4, 5) blocks (720) is between; there one program a block, not two, took
# the forward 0.976-0.987x in six `--versus mhla.CONFIG.output.programs=512` runs (H100, sessions 48-49; f+b 0.990-
# 1.007x, inside the spread), and every other shape was unchanged. "narrow_warps" {width: warps}: a head tile no
# wider than `width` runs the launch on that many warps, whatever its blocks' length (`_config`; the warps above were
# tuned for 128-wide tiles: 8 warps are 256 threads over SANA's 32 x 32 accumulator). H100, session 49 (`--versus`,
# fwd / f+b ms): SANA-1.6B 4K (D = 32, 121-144-token blocks) summary and output on 2 warps, not 8: 0.253 / 0.789 ->
# 0.168 / 0.657 (on 4, the summaries on 3 stages: 0.176 / 0.670), then the grad launches on 2, not 4: f+b 0.656 ->
# 0.642 and 0.639 (two calls); SANA-1.6B 1K (30-42-token blocks, SHORT(EST)_CONFIG's 4 warps) all three on 2: 0.0251 /
# 0.0791 -> 0.0195 / 0.0705; DiT-S/2 4096 px (D = 64) summary and output on 4: 0.128 / 0.426 -> 0.110 / 0.389 (on 2:
# 0.121 / 0.415), its grad launches on 2 f+b 1.074x (kept on 4). L2 eviction priorities: "keep" (summary, mix) stores
# S and S~ evict_last, so the next launch reads them from L2 while q, k and v stream through; the output's "stream"
# loads q and stores o evict_first (`_tile`: plain loads only, the pipelined async copies drop it). With them the output
# launch on 4 warps, not 8 (three programs an SM, not two; the RoPE and norm paths had 4 already). H100, session 50
# (`--versus`, against the settings before, fwd / f+b): Wan2.1-1.3B 480p (3, 4, 5) 0.980 / 0.982, at its 180 blocks
# 0.982 / 0.980, Wan2.1-14B 720p 0.991 / 0.995, DiT-XL/2 1024 px (4 warps before too) 0.974 / 0.997; blocks of up to
# SHORTEST_BLOCK tokens take no hint (DiT-XL/2 512 px: forward 1.02x with them). The output's "prefetch" issues the
# next q tile's loads before this tile's product (`_block_outputs`; 167 -> 255 registers on sm_90 with the next tile's
# rows carried over the loop, session 52: 480p forward 1-1.5 % lower than working them out twice; two programs an SM).
# H100, session 51 (`--versus mhla.CONFIG.output.prefetch=True`, fwd / f+b): Wan2.1-1.3B 480p (3, 4, 5) 0.928 / 0.982,
# at its 180 blocks 0.971 / 0.992, Wan2.1-14B 720p 0.942 / 0.986, SANA-1.6B 4K 0.989 / 0.992; DiT-XL/2 at 512 px 1.036
# / 1.005 and 1024 px 1.015 / 1.003 (then left off there); capped at 168 registers, on 8 warps or on 32-token tiles no
# faster. The same in the summary launch (k and v ahead, on 1, 2 or 4 stages): forward 1.00-1.05x, f+b 1.02-1.13x; not
# kept. Since session 60 the first tile's loads are issued before the program waits for the mixing launch (PDL), and
# before S~'s (they were after), and short blocks take it too: H100, `--in-layer --versus`, fwd / f+b over the launch
# without it: DiT-XL/2 384 px (one 32-token tile a block) 0.872 / 0.959 and 0.840 / 0.970 (two calls), 512 px 0.971 /
# 1.007 and 0.995 / 0.986, 1024 px 1.019 / 0.993, SANA-1.6B 1K 0.951 / 1.000; q ahead of S~ but after the wait: 0.930
# at 384 px (BENCHMARKS.md, session 60). The grad launches' "early" (since session 61): where each program walks one token
# tile, the operands the launch ahead did not write (`block_grad`'s `early`) are loaded before the wait; f+b over the
# launches without it, between a layer's projections: H100, DiT-XL/2 384 px 0.955, 512 px 0.961, SANA-1.6B 1K 0.947;
# H200 0.947, 0.973, 0.979; alone level at 1024 px and Wan2.1-1.3B 480p (BENCHMARKS.md, session 61).
CONFIG = {
    "summary": {"block_n": 32, "num_warps": 8, "num_stages": 4, "programs": 256, "max_dv": 128, "maxnreg": 128,
                "narrow_warps": {32: 2, 64: 4}, "keep": "evict_last"},
    "output": {"block_n": 64, "num_warps": 4, "num_stages": 1, "programs": 512, "maxnreg": None, "fit_block": True,
               "narrow_warps": {32: 2}, "stream": "evict_first", "prefetch": True},
    "grad": {"block_n": 64, "num_warps": 4, "num_stages": 2, "programs": 1024, "maxnreg": None, "summarize_up_to": 64,
             "summarize_warps": 8, "summarize_wide_over": 64 * 64, "narrow_warps": {32: 2}, "early": True},
    "gram": {"block_k": 64, "num_stages": 3, "programs": 1024},
    "mix": {"block_m": 64, "block_f": 64, "max_blocks": 256, "programs": 264, "num_warps": 4, "num_stages": 4,
            "wide_over": 192, "wide": {"block_m": 128, "num_warps": 8}, "fold_up_to": 64, "gram_up_to": 64,
            "gram": {"num_stages": 2, "programs": 264, "num_warps": 4}, "keep_up_to": 64, "keep_within_v": True,
            "keep": "evict_last"},
}
# Overrides of a kernel's CONFIG entry for its RoPE variant (bf16 cos/sin tiles: more registers and shared memory
# per token tile than the plain kernel). H200, session 34 (`tune.py --sweep rope` at a converted Wan's own blocks, op
# as Wan uses it, fwd / f+b ms; kernels/NOTES.md): grad 16 warps, 1 stage (the fifth pass's choice with fp32 tables,
# no async copies) -> 8 warps, 2 stages: 1.3B 480p 0.303 / 1.268 -> 0.303 / 1.171, 14B 720p 1.649 / 7.085 -> 1.653 /
# 6.421; then the output kernel on 4 warps (CONFIG's since session 50): 0.297 / 1.162, 1.610 / 6.394 (the plain op:
# 0.314 / 1.153, 1.713 / 6.223). The output's next-tile loads ahead (CONFIG's "prefetch") cost the RoPE launch its third
# program an SM (151 -> 190 registers on sm_90): H100, session 51 (`bench op --impls mhla_used --set`, fwd ms, off ->
# on): 1.3B 480p 0.232 -> 0.256, 14B 720p 1.436 -> 1.554, at 180 blocks 0.309 -> 0.341; capped at 168 registers, on 8
# warps or 32-token tiles 0.229-0.258, 1.439-1.517 and 0.320-0.341: it stays off. The summaries keep CONFIG's 4 stages
# (122 KB of shared memory, one program an SM): H100, session 52, fwd ms, on 3 stages or 16-token tiles 0.229-0.231 at
# 480p (0.231-0.233 as run), but 1.448-1.471 at 14B (1.431-1.434) and 0.311-0.316 at 180 blocks (0.309).
ROPE_CONFIG = {"summary": {}, "output": {"prefetch": False}, "grad": {"num_warps": 8, "num_stages": 2}}
# Overrides of a kernel's CONFIG entry for bf16 calls without RoPE whose blocks hold at most SHORT_BLOCK tokens
# (DiT-XL/2 and PixArt up to 1024 px, SANA 1K): each program walks one or two token tiles, so latency, not bandwidth,
# sets the time. Re-swept once the head offsets were marked aligned (session 39; the settings before were tuned on DiT's
# scalar loads): H200, 2026-12-05 (`tune.py --sweep short`, one process, whole op, GPU time, fwd / f+b ms), session 38's
# overrides (summary 64-token tiles and 2 stages, output 16-token tiles and 4 warps, grad 32-token tiles) -> these:
# DiT-XL/2 512 px 0.0229 / 0.1118 -> 0.0209 / 0.1049, 1024 px 0.0549 / 0.2261 -> 0.0517 / 0.2006, SANA-1.6B 1K 0.0269 /
# 0.1111 -> 0.0254 / 0.1059; the grad kernels keep CONFIG's settings (BENCHMARKS.md, session 39). The summaries keep 3
# pipeline stages where CONFIG's went to 4 (session 48: at 1024 px 4 stages were 1.023x). The output launch loads q a
# tile ahead here too since session 60 (CONFIG's "prefetch": its first tile overlaps the mixing launch).
SHORT_BLOCK = 128
SHORT_CONFIG = {"summary": {"num_warps": 4, "num_stages": 3}}
# Over SHORT_CONFIG for blocks of at most SHORTEST_BLOCK tokens (DiT-XL/2 and PixArt at 512 px, SANA 1K: 42): the
# summaries on 16-token tiles and 4 warps. H200, 2026-12-05, session 38 (`tune.py --sweep short`, fwd / f+b ms, against
# SHORT_CONFIG's): DiT-XL/2 512 px 0.0426 / 0.1730 -> 0.0372 / 0.1602, SANA-1.6B 1K 0.0371 / 0.1323 -> 0.0280 / 0.1125;
# at 1024 px (64 tokens a block) it lost, 0.1094 / 0.3665 -> 0.1738 / 0.5282. No L2 priorities on the summaries and
# the output's tokens (CONFIG's "keep", "stream"): H100, session 50, DiT-XL/2 512 px forward 1.02x with both.
SHORTEST_BLOCK = 48
SHORTEST_CONFIG = {"summary": {"block_n": 16, "num_warps": 4, "num_stages": 2, "keep": ""}, "output": {"stream": ""}}


# The tiles each launch's settings give shared memory back by on a card that refuses them, in order, after its pipeline
# stages (`fitting.smaller`): the gradients' Dv tile first, as their D x Dv operand tile is where the memory goes.
STEP_TILES = {"summary": ("block_n", "max_dv"), "output": ("block_n", "block_dv"), "grad": ("block_dv", "block_n"),
              "mix": ("block_f",), "parallel": ("WALK",)}


def step_tiles(kernel: str, out_norm: bool = False) -> tuple[str, ...]:
    """STEP_TILES[kernel]; the output kernel applying the output norm keeps its whole Dv row, so not its Dv tile."""
    return tuple(t for t in STEP_TILES[kernel] if not (out_norm and t == "block_dv"))


def _tuned(dtype: torch.dtype, block_d: int) -> bool:
    """Whether a call's tiles are those CONFIG was tuned for: bf16, up to 128 wide."""
    return dtype == torch.bfloat16 and block_d <= MAX_TILE


def _short(dtype: torch.dtype, block_d: int, max_len: int, rope: bool) -> bool:
    """Whether a call takes SHORT_CONFIG's overrides (where `tune.py --sweep short` measured them): tuned tiles
    (`_tuned`), no RoPE, blocks of at most SHORT_BLOCK tokens."""
    return _tuned(dtype, block_d) and not rope and max_len <= SHORT_BLOCK


def _config(kernel: str, dtype: torch.dtype, block_d: int, max_len: int, rope: bool = False) -> dict:
    """CONFIG[kernel] (tuned for bf16 tiles up to 128 x 128; for such calls without RoPE whose blocks hold at most
    SHORT_BLOCK tokens, SHORT_CONFIG's overrides, and at most SHORTEST_BLOCK, SHORTEST_CONFIG's over those; with
    `rope`, ROPE_CONFIG's);
    for fp32 operands or D tiles over 128, a small unpipelined tile on 8 warps without a register cap, so
    shared memory and registers suffice.

    A register cap fits two programs of a 128-wide tile per SM; it pays only when each program walks
    many token tiles (H200: Wan, 14B, SANA-like D = 112 gain; narrower D tiles, and DiT-XL at <= 64
    tokens per block, lose), so it is dropped for narrower tiles and blocks of under 4 tiles. A bf16 head tile no
    wider than one of the kernel's "narrow_warps" widths runs on the warps given for the narrowest such width, before
    the RoPE overrides (warps tuned for 128 x 128 accumulators idle over SANA's 32 x 32).
    """
    tuned = _tuned(dtype, block_d)
    short = _short(dtype, block_d, max_len, rope)
    shortest = short and max_len <= SHORTEST_BLOCK
    cfg = {**CONFIG[kernel], **(SHORT_CONFIG.get(kernel, {}) if short else {}),
           **(SHORTEST_CONFIG.get(kernel, {}) if shortest else {})}
    narrow = cfg.pop("narrow_warps", {})  # launch settings stay flat: `fitting` keys on their items
    widths = [width for width in sorted(narrow) if tuned and block_d <= width]
    if widths:
        cfg["num_warps"] = narrow[widths[0]]
    cfg.update(ROPE_CONFIG.get(kernel, {}) if rope else {})
    if not tuned:
        cfg.update(block_n=min(cfg["block_n"], 32), num_stages=1, num_warps=8, maxnreg=None)
    elif block_d < MAX_TILE or max_len < 4 * cfg["block_n"]:
        cfg["maxnreg"] = None
    return cfg


def _launch(cfg: dict) -> dict:
    """Triton launch options of a config: warps, pipeline depth, and a register cap where one is set
    (a cap that lets two programs share a multiprocessor can beat one unconstrained program)."""
    options = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if cfg.get("maxnreg"):
        options["maxnreg"] = cfg["maxnreg"]
    return options


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """Storage type of the summaries S: the operand type the token kernels multiply them in.

    bf16 inputs: bf16, which halves the bytes of the mixing GEMM and of every read after it (the output and
    grad kernels round S~ to bf16 anyway); fp16 inputs keep fp32, as block sums can overflow fp16.
    """
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def _summary_buffer(shape, dtype, g: Geometry, device, zeros: bool) -> torch.Tensor:
    """Summaries of all M blocks, zero where no program stores: everywhere with `zeros` (programs add into it, or
    it stays a placeholder), else the blocks outside the launched range."""
    if zeros:
        return torch.zeros(shape, device=device, dtype=dtype)
    buf = torch.empty(shape, device=device, dtype=dtype)
    if g.m_count < g.M:  # a slice that misses some blocks (an unsharded call launches all of them)
        buf[:g.m0].zero_()
        buf[g.m0 + g.m_count:].zero_()
    return buf


def block_summaries(x, y, rope, g: Geometry, *, elu: bool, with_z: bool, y_scale=None, z_weight=None, dtype=None,
                    x_norm=None):
    """(S, z), block-major: S[m, bh] = sum rope(phi(x))^T (y * y_scale) in `dtype` (default `state_dtype`), and
    z[m, bh] = sum phi(x) * z_weight in fp32, over the call's tokens (zero for blocks its slice misses).
    x_norm: (rstd (B, N) from `token_rstd`, weight (heads*D,)), x RMSNormed across heads on the way.
    Programs that split a block add into fp32 with atomics; S is rounded once after.
    Where Dv pads its tile and z is a plain sum of unrotated features (no RoPE, y_scale or z_weight: the forward's), y
    is loaded with ones past Dv and z is the product's column Dv: no per-token fp32 z tile beside the accumulator (H200,
    DiT-XL/2 forward 512 px 0.0440 -> 0.0426 ms, 1024 px 0.1121 -> 0.1093; sm_90 at 64-token tiles, 168 -> 128
    registers). z then sums phi(x) as the product's operands hold it, as S does: rounded to bf16 for bf16 inputs,
    truncated to TF32 for fp16 inputs (exact for relu of either; with elu, fp16's z gets S's truncation bias, ~-2e-4,
    which partly cancels in o = num / den)."""
    block_d = min(pow2(g.D), MAX_TILE)
    d_tiles = cdiv(g.D, block_d)
    state = dtype or state_dtype(x.dtype)
    cos, sin, cs = _rope_args(rope, g, x)
    dot, precision = _dot_types(x.dtype)
    flags = dict(BLOCK_D=block_d, D_TILES=d_tiles, ELU=elu, ROPE=rope is not None, SCALE_Y=y_scale is not None,
                 WEIGHT_Z=z_weight is not None, WITH_Z=with_z, NORM_X=x_norm is not None, DOT=dot, PRECISION=precision,
                 HEAD_ALIGN=head_align(x, y, cos))

    def launch(settings):
        block_dv = min(pow2(g.DV), settings["max_dv"])
        dv_tiles = cdiv(g.DV, block_dv)
        z_in_dot = with_z and rope is None and y_scale is None and z_weight is None and g.DV < block_dv
        programs = g.BH * g.m_count * d_tiles * dv_tiles
        tok = _tokens_per_program(g, settings["block_n"], programs, settings["programs"])
        splits = cdiv(g.max_len, tok)
        s = _summary_buffer((g.M, g.BH, g.D, g.DV), torch.float32 if splits > 1 else state, g, x.device, splits > 1)
        z = _summary_buffer((g.M, g.BH, g.D), torch.float32, g, x.device, splits > 1 or not with_z)
        xs, xw = x_norm if x_norm is not None else (s, s)
        compiled.launch(_summary_kernel, (g.BH, g.m_count * d_tiles * dv_tiles, splits),
            x, y, cos, sin, y_scale if y_scale is not None else s, z_weight if z_weight is not None else s, xs, xw,
            s, z, x.stride(0), x.stride(1), x.stride(2), y.stride(0), y.stride(1), y.stride(2), *cs,
            g.heads, g.N, g.M, *g.args, *g.slice_args, g.D, g.DV, tok,
            BLOCK_N=settings["block_n"], BLOCK_DV=block_dv, DV_TILES=dv_tiles, Z_IN_DOT=z_in_dot, ATOMIC=splits > 1,
            KEEP=settings["keep"], name="summaries", **flags,
            **_launch(settings),
        )
        return s.to(state), z

    cfg = _config("summary", x.dtype, block_d, g.max_len, rope is not None)
    return launch_within_card(_summary_kernel, x.device, cfg, step_tiles("summary"), {**flags, "DV": g.DV}, launch)


def _full_d_tiles(d: int, dv: int):
    """Kernels that keep the whole (padded) D in registers tile Dv so that D x Dv_tile stays bounded."""
    block_d = pow2(d)
    block_dv = min(pow2(dv), max(16, MAX_TILE_AREA // block_d))
    return block_d, block_dv, cdiv(dv, block_dv)


def fuses_output_norm(d: int, dv: int) -> bool:
    """Whether `block_output` can apply a per-head output norm: its programs hold a head's whole Dv."""
    return _full_d_tiles(d, dv)[2] == 1


def block_output(q, mixed_s, mixed_z, rope, g: Geometry, *, elu: bool, normalize: bool, eps: float, out_dtype,
                 q_norm=None, out_norm=None):
    """o = rope(phi(q)) S~_b [/ (phi(q) . z~_b + eps)], written in raster order. q_norm: (rstd, weight), q RMSNormed
    across heads on the way; out_norm: (gain (heads, Dv), eps), each head's o RMSNormed and scaled by its gain
    (only where `fuses_output_norm`). Launched right after the launch that wrote S~ and z~ (`output_forward`): under
    PDL its programs load their first q tile, q_norm's weight and the gain before they wait for that launch, so
    those were written before it started."""
    block_d, block_dv, dv_tiles = _full_d_tiles(g.D, g.DV)
    if out_norm is not None and dv_tiles > 1:
        raise ValueError(f"the output kernel tiles Dv = {g.DV} (D = {g.D}) and cannot apply the output norm")
    cfg = {**_config("output", q.dtype, block_d, g.max_len, rope is not None), "block_dv": block_dv}
    if cfg["fit_block"]:  # blocks of at most 32 tokens on 32-token tiles, not half-empty 64-token ones
        cfg["block_n"] = min(cfg["block_n"], max(32, pow2(g.max_len)))
    o = torch.empty((g.B, g.N, g.heads, g.DV), device=q.device, dtype=out_dtype)
    cos, sin, cs = _rope_args(rope, g, q)
    dot, precision = _dot_types(q.dtype)
    qs, qw = q_norm if q_norm is not None else (o, o)
    gain, out_eps = out_norm if out_norm is not None else (o, 0.0)
    flags = dict(BLOCK_D=block_d, ELU=elu, ROPE=rope is not None, NORMALIZE=normalize, NORM_Q=q_norm is not None,
                 OUT_NORM=out_norm is not None, DOT=dot, PRECISION=precision, HEAD_ALIGN=head_align(q, o, cos))

    def launch(settings):
        dv_tiles = cdiv(g.DV, settings["block_dv"])
        tok = _tokens_per_program(g, settings["block_n"], g.BH * g.m_count * dv_tiles, settings["programs"])
        compiled.launch(_output_kernel, (g.BH, g.m_count * dv_tiles, cdiv(g.max_len, tok)),
            q, cos, sin, mixed_s, mixed_z, qs, qw, gain, o,
            q.stride(0), q.stride(1), q.stride(2), *cs, o.stride(0), o.stride(1), o.stride(2),
            g.heads, g.N, g.M, *g.args, *g.slice_args, g.D, g.DV, tok, eps, out_eps,
            BLOCK_N=settings["block_n"], BLOCK_DV=settings["block_dv"], DV_TILES=dv_tiles, STREAM=settings["stream"],
            PREFETCH=settings["prefetch"], name="output", **flags,
            **_launch(settings),
        )
        return o

    return launch_within_card(_output_kernel, q.device, cfg, step_tiles("output", out_norm is not None),
                              {**flags, "DV": g.DV}, launch)


def block_grad(x, y, mat, vec, rope, g: Geometry, *, elu: bool, stats: bool, use_vec: bool, with_dy: bool, eps: float,
               summarize: bool = False, clear: torch.Tensor | None = None, early: tuple[str, ...] = ()):
    """dx (and dy) of one side; with `stats`, also the per-token 1/den and c of the q side. With `summarize`, where
    each block fits one token tile (`summarizes`), also the q side's summaries as `block_summaries(x, y, rope, g,
    with_z=stats, y_scale=rden, z_weight=c)` makes them, from the x and y tiles this launch holds: one launch and one
    read of q and dO fewer in a short sequence's backward. `clear`: an fp32 buffer the launch zeroes on the way (the
    Gram a later launch adds dmix into: no fill launch of its own). `early`: which of "x", "y" and "mat" (with vec)
    were complete before the launch ahead of this one started, so the kernel may load them before it waits for that
    launch (`_grad_kernel`'s EARLY_*: where CONFIG["grad"]["early"] and each program walks one token tile).

    Returns (dx, dy or None, rden or None, c or None, (dS~, dz~) or None).
    """
    block_d, block_dv, _ = _full_d_tiles(g.D, g.DV)
    cfg = {**_config("grad", x.dtype, block_d, g.max_len, rope is not None), "block_dv": block_dv}
    dx = torch.empty((g.B, g.N, g.heads, g.D), device=x.device, dtype=x.dtype)
    dy = torch.empty((g.B, g.N, g.heads, g.DV), device=x.device, dtype=y.dtype) if with_dy else dx
    rden = torch.empty((g.BH, g.N), device=x.device, dtype=torch.float32) if stats else vec
    c = torch.empty((g.BH, g.N), device=x.device, dtype=torch.float32) if stats else vec
    cos, sin, cs = _rope_args(rope, g, x)
    dot, precision = _dot_types(x.dtype)
    flags = dict(BLOCK_D=block_d, ELU=elu, ROPE=rope is not None, STATS=stats, USE_VEC=use_vec, WITH_DY=with_dy,
                 DOT=dot, PRECISION=precision, HEAD_ALIGN=head_align(x, y, dx, dy, cos))

    def launch(settings):
        tok = _tokens_per_program(g, settings["block_n"], g.BH * g.m_count, settings["programs"])
        summaries = None
        if summarize and summarizes(g, settings):  # blocks the slice misses, or holds none of, stay zero
            summaries = (_summary_buffer((g.M, g.BH, g.D, g.DV), state_dtype(x.dtype), g, x.device, g.partial),
                         _summary_buffer((g.M, g.BH, g.D), torch.float32, g, x.device, g.partial or not stats))
        ds, dz = summaries or (dx, dx)
        ahead = early if settings["early"] and min(tok, g.max_len) <= settings["block_n"] else ()
        compiled.launch(_grad_kernel, (g.BH, g.m_count, cdiv(g.max_len, tok)),
            x, y, cos, sin, mat, vec, dx, dy, rden, c, ds, dz, rden if clear is None else clear,
            x.stride(0), x.stride(1), x.stride(2), y.stride(0), y.stride(1), y.stride(2), *cs,
            dx.stride(0), dx.stride(1), dx.stride(2), dy.stride(0), dy.stride(1), dy.stride(2),
            g.heads, g.N, g.M, *g.args, *g.slice_args, g.D, g.DV, tok, eps, 0 if clear is None else clear.numel(),
            BLOCK_N=settings["block_n"], BLOCK_DV=settings["block_dv"], DV_TILES=cdiv(g.DV, settings["block_dv"]),
            SUMMARIZE=summaries is not None, CLEAR=clear is not None, EARLY_X="x" in ahead, EARLY_Y="y" in ahead,
            EARLY_MAT="mat" in ahead, name="grad_keys" if with_dy else "grad_queries",
            **flags, **grad_options(settings, summaries is not None, block_d),
        )
        return summaries

    summaries = launch_within_card(_grad_kernel, x.device, cfg, step_tiles("grad"), {**flags, "DV": g.DV}, launch)
    return dx, (dy if with_dy else None), (rden if stats else None), (c if stats else None), summaries


def grad_options(settings: dict, summarize: bool, block_d: int) -> dict:
    """`_launch` options of a grad launch; one that also makes the summaries over D x Dv tiles of more than
    settings["summarize_wide_over"] elements runs on settings["summarize_warps"]: its fp32 D x Dv accumulator beside
    the token tile's P spilled on 4 warps (sm_90, DiT's d72 in 128 x 128 tiles: 255 registers and 720 bytes of stack;
    223 registers on 8)."""
    wide = summarize and block_d * settings["block_dv"] > settings["summarize_wide_over"]
    return {**_launch(settings), **({"num_warps": settings["summarize_warps"]} if wide else {})}


def summarizes(g: Geometry, settings: dict) -> bool:
    """Whether the q-side grad launch on `settings` also makes the summaries of dO: each program holds one whole block
    in one token tile, of at most settings["summarize_up_to"] tokens, so it stores them without atomics."""
    return g.max_len <= min(settings["block_n"], settings["summarize_up_to"])


def token_rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    """(B, N) fp32: 1 / RMS across all heads and features of each token of x (B, N, heads, D), + eps inside."""
    b, n, heads, d = x.shape
    out = torch.empty((b, n), device=x.device, dtype=torch.float32)
    block_n = 32
    compiled.launch(_rstd_kernel, (b, cdiv(n, block_n)), x, out, x.stride(0), x.stride(1), x.stride(2), n, heads,
                    eps, d, BLOCK_N=block_n, BLOCK_D=pow2(d), num_warps=4)
    return out


def _mix_settings(m: int, gram: bool = False) -> dict:
    """`_mix_kernel`'s settings at M <= CONFIG["mix"]["max_blocks"] blocks: CONFIG["mix"], its "wide" settings over
    "wide_over" blocks, and for the launch that forms the Gram too, its "gram" settings; row blocks no taller than M
    needs."""
    cfg = {**CONFIG["mix"], **(CONFIG["mix"]["wide"] if m > CONFIG["mix"]["wide_over"] else {}),
           **(CONFIG["mix"]["gram"] if gram else {})}
    return dict(block_m=max(16, min(cfg["block_m"], pow2(m))), block_f=cfg["block_f"], programs=cfg["programs"],
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], keep=cfg["keep"])


def _mix_launch(m: int, f: int, settings: dict, fz: int = 0) -> tuple[tuple[int, int], dict]:
    """Grid and launch arguments of `_mix_kernel` for (M x M) @ (M x F) at `settings` (`_mix_settings`): a program
    per row block and walk, settings["programs"] programs in all (fewer where F has fewer tiles); with `fz` columns
    of z as well, as many again at most for z's tiles (s_walks: the walks over S)."""
    row_blocks = cdiv(m, settings["block_m"])
    walks = [max(1, min(cdiv(cols, settings["block_f"]), settings["programs"] // row_blocks))
             for cols in (f, fz) if cols]
    return (row_blocks, sum(walks)), dict(s_walks=walks[0], BLOCK_M=settings["block_m"], BLOCK_F=settings["block_f"],
                                          BLOCK_K=max(16, pow2(m)), WITH_Z=bool(fz), num_warps=settings["num_warps"],
                                          num_stages=settings["num_stages"], KEEP=settings["keep"])


def _mix_operand(mix: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """mix in the type S multiplies in, zero-padded to a multiple of 16 columns: its row loads, masked at that width,
    vectorize (masked at 180 or 252 they were 2-byte loads in bf16), and the backward's mix^T view becomes the same
    contiguous operand (read through its strides it took 255 registers and spilled at 180 and 252 blocks; sm_90
    compiles, `resources.py`). An (M x M) copy, as cuBLAS' mix.to(s.dtype) made; written into a fresh buffer, as
    torch's pad and .to() hand mix^T back in its own strides where there is nothing to pad or convert. Up to
    CONFIG["mix"]["fold_up_to"] blocks the kernel reads mix as it is instead (`mix_with_kernel`)."""
    m = mix.shape[0]
    out = torch.zeros((m, cdiv(m, 16) * 16), device=device, dtype=dtype)
    out[:, :m] = mix.detach()
    return out


def _reads_mix_as_is(m: int) -> bool:
    """Whether `_mix_kernel` at m blocks reads mix as the caller holds it (and can mix z in the same launch) rather
    than the padded copy `_mix_operand` makes."""
    return m <= CONFIG["mix"]["fold_up_to"]


def mix_with_kernel(mix: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None = None, gram_with=None,
                    gram: torch.Tensor | None = None, logits: bool = False, name: str = "mix"):
    """(sum_b mix[i, b] s[b] in s's type, the same of fp32 z or None, the Gram or None) by one `_mix_kernel` launch
    (fp32 accumulate). Up to CONFIG["mix"]["fold_up_to"] blocks the kernel reads mix as it is, and mixes z in the same
    launch: at short sequences the padded copy, its fill and z's own GEMM were three of the forward's seven launches
    (DiT-XL/2 512 px: 6 of its 50 us); z is only taken there. `gram_with`: (S, z or None) shaped as s and z, there
    too: the launch also returns sum over f of s[i, f] S[j, f] + z[i, f] z_gram[j, f], (M x M) fp32 (the backward's
    dmix, from the dS~ and dz~ tiles it mixes back: no `_gram_kernel` launches, their fills and sum), added into
    `gram` where given (zeroed by an earlier launch: `output_backward`), else into a zero-filled buffer. `logits`:
    mix holds the matrix's logits, which the kernel softmaxes row by row as it loads them (there too). `name`: the
    launch's name without the Gram (`compiled.LAUNCHES`; with it, "mix_back")."""
    flat = s.flatten(1)
    m = s.shape[0]
    direct = _reads_mix_as_is(m)
    if (z is not None or gram_with is not None or logits) and not direct:
        raise ValueError(f"the mixing kernel mixes z, forms the Gram and softmaxes logits in the same launch up to "
                         f"{CONFIG['mix']['fold_up_to']} blocks, not {m}: use `mix_blocks` and `block_gram`")
    a = mix.detach().to(s.device) if direct else _mix_operand(mix, s.dtype, s.device)
    out = torch.empty(flat.shape, device=s.device, dtype=s.dtype)
    z_flat = flat if z is None else z.flatten(1)
    z_out = out if z is None else torch.empty(z_flat.shape, device=z.device, dtype=z.dtype)
    if gram is None and gram_with is not None:
        gram = torch.zeros((m, m), device=s.device, dtype=torch.float32)
    ps, pz = (flat, z_flat) if gram_with is None else (
        gram_with[0].flatten(1), z_flat if gram_with[1] is None else gram_with[1].flatten(1))

    def launch(settings):
        grid, kwargs = _mix_launch(m, flat.shape[1], settings, 0 if z is None else z_flat.shape[1])
        compiled.launch(_mix_kernel, grid, a, flat, out, z_flat, z_out, ps, pz, out if gram is None else gram, m,
                        flat.shape[1], z_flat.shape[1], m if direct else a.shape[1], a.stride(0), a.stride(1),
                        flat.stride(0), flat.stride(1), z_flat.stride(0), z_flat.stride(1), ps.stride(0), ps.stride(1),
                        pz.stride(0), pz.stride(1), GRAM=gram is not None, SOFTMAX=logits,
                        name=name if gram_with is None else "mix_back", **kwargs)

    launch_within_card(_mix_kernel, s.device, _mix_settings(m, gram is not None), step_tiles("mix"),
                       {"dtype": s.dtype, "M": m, "z": z is not None, "gram": gram is not None}, launch)
    return out.view(s.shape), None if z is None else z_out.view(z.shape), gram


def mixes_with_kernel(s: torch.Tensor) -> bool:
    """Whether `mix_blocks` takes `_mix_kernel`: for bf16 summaries (fp16 inputs keep fp32 S; z is fp32) at up to
    CONFIG["mix"]["max_blocks"] blocks that are no multiple of 8, or up to 32. H200, bf16 S, CUDA-graph replay, us,
    cuBLAS -> kernel (BENCHMARKS.md, session 34): M = 16: 8.1 -> 4.7, 30: 11.4 -> 6.4, 60: 23.8 -> 15.2, 121: 90.5 ->
    39.2, 180: 108.1 -> 64.0, 252: 472.0 -> 232.3; ties at 64 (7.3 -> 7.4) and 120 (94.8 -> 95.4), cuBLAS at 256
    (F = 24,576: 9.8 -> 13.9); fp32 z lost at all but 16 blocks (session 29). Not timed: 8 and 24 blocks (taken with
    16 and 30), and over 256 (cuBLAS, which won at 512 in session 29)."""
    m = s.shape[0]
    return s.dtype == torch.bfloat16 and m <= CONFIG["mix"]["max_blocks"] and (m <= 32 or m % 8 != 0)


@contextlib.contextmanager
def _tf32(enabled: bool):
    """fp32 GEMMs in TF32 for 16-bit inputs: mixing is compute-bound in plain fp32 at large M.

    Flips torch's process-wide flag for the duration (restored after), as torch offers no per-call switch.
    """
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def _mixes_in_one_launch(s: torch.Tensor) -> bool:
    """Whether mixing summaries like s (block-major) is one `_mix_kernel` launch on mix as the caller holds it, which
    also mixes z, may form the backward's Gram (`_gram_in_mix`) and softmaxes the matrix's logits as it loads them (a
    launch fewer than PyTorch's softmax before the op)."""
    return mixes_with_kernel(s) and _reads_mix_as_is(s.shape[0])


def mix_blocks(mix: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """sum_b mix[i, b] s[b]: block-major s makes this one GEMM, (M x M) @ (M x rest), in s's type (fp32
    accumulate; fp32 s in TF32 for 16-bit inputs): `_mix_kernel` where it measured faster (`mixes_with_kernel`),
    else cuBLAS.

    The layout is the point: with (B*heads, M, ...) summaries it was a batched GEMM of B*heads (M x M) @
    (M x D*Dv) products, which cuBLAS ran at ~1.7 TB/s whatever the type (H200, Wan 480p: 28 us for fp32 and
    for bf16). cuBLAS' one GEMM then ran at 4x its byte floor at the model's block counts (180, 252). `mix` is
    detached (gradients reach it through the custom op's backward): torch.matmul with a grad-requiring 2-D operand
    and a batched one folds into a copy of s, grad mode or not.
    """
    if mixes_with_kernel(s):
        return mix_with_kernel(mix, s)[0]
    with _tf32(dtype != torch.float32):
        return torch.mm(mix.detach().to(s.dtype), s.flatten(1)).view(s.shape)


def mix_summaries(mix: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None, dtype: torch.dtype,
                  logits: bool = False, name: str = "mix"):
    """(mix @ s, mix @ z) as `mix_blocks` makes each, in one launch where the kernel folds z in (bf16 s, which only
    bf16 inputs have, at up to CONFIG["mix"]["fold_up_to"] blocks; z then in full fp32, not TF32); z None
    (unnormalized: nothing to mix) gives None. `logits`: mix holds the matrix's logits (`mixing.mixing_matrix`);
    `name`: that one launch's name (`compiled.LAUNCHES`)."""
    if _mixes_in_one_launch(s):
        return mix_with_kernel(mix, s, z, logits=logits, name=name)[:2]
    mix = mixing_matrix(mix, logits)
    return mix_blocks(mix, s, dtype), None if z is None else mix_blocks(mix, z, dtype)


def block_gram(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """sum over batch, heads and features of a[i] . b[j] (block-major a, b): (M, M) fp32, as dmix needs it."""
    m = a.shape[0]
    f = a[0].numel()
    cfg = CONFIG["gram"]
    block_m = max(16, min(64, pow2(m)))
    tiles = cdiv(m, block_m) ** 2
    splits = max(1, min(cdiv(f, cfg["block_k"]), cdiv(cfg["programs"], tiles)))
    f_per = cdiv(cdiv(f, splits), cfg["block_k"]) * cfg["block_k"]
    out = torch.zeros((m, m), device=a.device, dtype=torch.float32)
    compiled.launch(_gram_kernel, (cdiv(f, f_per), tiles),
        a, b, out, m, f, f_per, BLOCK_M=block_m, BLOCK_K=cfg["block_k"], PRECISION=_dot_types(dtype)[1],
        num_warps=4, num_stages=cfg["num_stages"],
    )
    return out


# ----------------------------------------------------------------------------- forward / backward


def summary_forward(k, v, rope, g: Geometry, *, elu: bool, normalize: bool, k_norm=None):
    """The summaries (S, z) of the call's keys (RMSNormed across heads on the way with `k_norm`: (rstd, weight)).
    A slice short of the grid keeps S in fp32: its partial sums are summed over ranks before they are rounded to
    `state_dtype`."""
    return block_summaries(k, v, rope, g, elu=elu, with_z=normalize,  # unnormalized: z stays zeros, unmixed
                           dtype=torch.float32 if g.partial else None, x_norm=k_norm)


def summary_backward(ds, dz, k, v, rope, g: Geometry, *, elu: bool, normalize: bool, eps: float,
                     settled: bool = False):
    """dk, dv from the gradients of the summaries (complete: summed over ranks, for a slice). `settled`: k and v were
    complete before the launch ahead of this one started (`block_grad`'s `early`)."""
    dk, dv, *_ = block_grad(k, v, ds, dz, rope, g, elu=elu, stats=False, use_vec=normalize, with_dy=True, eps=eps,
                            early=("x", "y") if settled else ())
    return dk, dv


def keeps_mixed(m: int, tokens: int, d: int) -> bool:
    """Whether a call of m blocks over `tokens` tokens (its slice's) with heads of d features, recorded for autograd,
    keeps the mixed summaries (S~, z~) its forward made for its backward rather than the backward mixing them again
    (one mixing launch, 4-7 % of a forward+backward): up to CONFIG["mix"]["keep_up_to"] blocks, where S~ is small
    whatever its ratio to v, and with CONFIG["mix"]["keep_within_v"] wherever S~ (M D Dv a head) is no larger than v
    (N Dv): blocks hold at least D tokens on average (Wan and SANA at their released sizes and 'auto' blocks)."""
    cfg = CONFIG["mix"]
    return m <= cfg["keep_up_to"] or (cfg["keep_within_v"] and m * d <= tokens)


def output_forward(q, mix, s, z, rope, g: Geometry, *, elu: bool, normalize: bool, eps: float, q_norm=None,
                   out_norm=None, logits: bool = False):
    """(o, (S~, z~ or None)): the output of the call's queries from the complete summaries (S in `state_dtype`), and
    the mixed summaries it read (`keeps_mixed`); `block_output` says what q_norm and out_norm apply; `logits`: mix
    holds the matrix's logits (`mix_summaries`). The mixing launch of a call on SHORT_CONFIG's settings is "mix_short"
    (`compiled.CONFIG["trigger_dependents"]`)."""
    short = _short(q.dtype, _full_d_tiles(g.D, g.DV)[0], g.max_len, rope is not None)
    mixed_s, mixed_z = mix_summaries(mix, s, z if normalize else None, q.dtype, logits,
                                     name="mix_short" if short else "mix")
    o = block_output(q, mixed_s, z if mixed_z is None else mixed_z, rope, g, elu=elu, normalize=normalize, eps=eps,
                     out_dtype=q.dtype, q_norm=q_norm, out_norm=out_norm)
    return o, (mixed_s, mixed_z)


def output_backward(do, q, mix, s, z, rope, g: Geometry, *, elu: bool, normalize: bool, eps: float, mixed=None,
                    settled: bool = False):
    """dq, dmix and the gradients (dS, dz) of the summaries; for a slice, dmix, dS and dz are its queries' share.
    `mixed`: the forward's (S~, z~ or None), or None to mix them again. `settled`: q and `mixed` were complete before
    the launch ahead of this call's first launch started, so the q-side grad launch may read them before it waits
    (`block_grad`'s `early`; not S~ mixed here, by the launch just ahead of it)."""
    # unnormalized: z (zeros) and dz~ only stand in for the kernels' unused normalizer vectors, and are not mixed
    mixed_s, mixed_z = mixed or mix_summaries(mix, s, z if normalize else None, q.dtype)
    # the Gram the mixing launch adds dmix into, zeroed by the q-side grad launch: a fill launch fewer (H100, session
    # 54: f+b 2-3 % lower at DiT-XL/2 384-512 px and SANA-1.6B 1K)
    gram = torch.empty((g.M, g.M), device=q.device, dtype=torch.float32) if _gram_in_mix(mixed_s) else None
    dq, _, rden, c, summaries = block_grad(q, do, mixed_s, z if mixed_z is None else mixed_z, rope, g, elu=elu,
                                           stats=normalize, use_vec=normalize, with_dy=False, eps=eps, summarize=True,
                                           clear=gram, early=(("x", "mat") if mixed else ("x",)) if settled else ())
    ds_mixed, dz_mixed = summaries or block_summaries(q, do, rope, g, elu=elu, with_z=normalize, y_scale=rden,
                                                      z_weight=c)
    ds, dz, dmix = mix_back(mix, ds_mixed, dz_mixed if normalize else None, s, z if normalize else None, q.dtype,
                            gram)
    return dq, dmix.to(mix.dtype), ds, dz_mixed if dz is None else dz


def _gram_in_mix(s: torch.Tensor) -> bool:
    """Whether the backward's mix^T launch over summaries like s (block-major) also forms dmix (`mix_back`)."""
    return _mixes_in_one_launch(s) and s.shape[0] <= CONFIG["mix"]["gram_up_to"]


def mix_back(mix, ds_mixed, dz_mixed, s, z, dtype: torch.dtype, gram: torch.Tensor | None = None):
    """(dS, dz or None, dmix in fp32) from the gradients of the mixed summaries (dz~ and z None unnormalized). Short
    sequences (`_gram_in_mix`): one launch, whose mix^T walk also forms dmix from the tiles it mixes, into `gram`
    where given (already zeroed); else two Gram launches and the mix^T products."""
    if _gram_in_mix(ds_mixed):
        return mix_with_kernel(mix.t(), ds_mixed, dz_mixed, gram_with=(s, z), gram=gram)
    dmix = block_gram(ds_mixed, s, dtype)
    if dz_mixed is not None:
        dmix += block_gram(dz_mixed, z, dtype)
    return *mix_summaries(mix.t(), ds_mixed, dz_mixed, dtype), dmix
