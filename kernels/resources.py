"""Developer tool: the kernels compiled for Hopper (sm_90) on any machine, GPU or not, and what they use.

    python -c "from mhla_diffusion.kernels.resources import main; main()" [--sass DIR]

For each token kernel at its bf16, 128 x 128 launch configuration (`mhla.CONFIG`, `mhla.ROPE_CONFIG` for RoPE rows,
`mhla.SHORTEST_CONFIG` and `mhla.SHORT_CONFIG` for the DiT rows' 42- and 64-token blocks), specialized as the JIT
specializes a real call over contiguous tensors (pointers and strides divisible by 16, RoPE tables' included, but the
token tensors' head strides: the head dim, 72 in the DiT rows, which the JIT leaves unmarked and `_head` marks
8-aligned, `mhla.head_align`, and 32 in the SANA-1.6B rows, which it marks; head dims are constexprs: 128, 72 in the DiT
rows and 32 in the SANA-1.6B rows; bf16 summaries and RoPE tables, as an all-bf16 call passes them), prints registers
per thread, stack (spilled) bytes, shared memory, and counts of the SASS instructions that decide speed: tensor-core ops
(HGMMA: Hopper's wgmma; HMMA: the warp-level mma that tiles of under 64 rows get), async copies (LDGSTS), 16-byte and
scalar 16-bit global loads, local-memory traffic (LDL/STL) and integer/float divisions' helper ops (MUFU, I2F/F2I).
Costs no device time: Triton's bundled ptxas compiles and its cuobjdump reads the binary. Registers over 128 at 8 warps
mean one program per SM; LDG.E.U16 in a hot loop means a load lost its vectorization. The mixing GEMM's rows
(`mhla.CONFIG["mix"]`) are at the 14B model's 252 blocks, where a program holds 128 rows of mix (CONFIG's "wide") over
all 256 (padded) columns, and at DiT-XL/2 512 px's 30 blocks, where it reads the fp32 matrix unpadded and mixes z too. A
row may name another input type ("DTYPE": the fp16 key-gradient row, on fp16's untuned settings with fp32 S and tables).
`row_settings` and `compile_row` also compile a row for another GPU at other settings: the tests check that the settings
`fitting.smaller` steps down to fit an A100's and a 4090's shared memory.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import tempfile

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ..blocks import resolve_blocks
from . import mhla, parallel
from .sizes import cdiv, pow2

HOPPER = GPUTarget("cuda", 90, 32)
# Pointers an all-bf16 call passes as fp32 (normalizer sums, per-token scalars). Summaries S, S~ (state_dtype), the
# mixing matrix as the mixing kernel gets it and, since `ops.rope.kernel_table`, RoPE tables are bf16 for bf16 inputs.
FP32_POINTERS = {"ys_ptr", "zw_ptr", "z_ptr", "zout_ptr", "vec_ptr", "rden_ptr", "c_ptr", "xs_ptr", "qs_ptr", "dz_ptr",
                 "clear_ptr"}
# Pointer types of a token-kernel call by input type: (the inputs' and outputs', pointers that are fp32). fp16 inputs
# keep S and RoPE tables in fp32 (`mhla.state_dtype`, `ops.rope.kernel_table`).
POINTER_TYPES = {torch.bfloat16: ("*bf16", FP32_POINTERS),
                 torch.float16: ("*fp16", FP32_POINTERS | {"s_ptr", "ds_ptr", "mat_ptr", "cos_ptr", "sin_ptr"}),
                 torch.float32: ("*fp32", FP32_POINTERS)}
# Flags a row leaves off unless it turns them on: the RMSNorms applied on the way (`ops.norms`), and z out of the
# summary product's padding column (`mhla.block_summaries`: Dv short of its tile, no RoPE, unweighted z).
OFF = dict(NORM_X=False, NORM_Q=False, OUT_NORM=False, Z_IN_DOT=False)
# Integer arguments a Wan2.1 call passes as multiples of 16 (the JIT marks them so; loads vectorize on it).
DIVISIBLE = re.compile(r"^s[a-z]*[bnh]$")
# A token tensor's head stride: its head dim in a contiguous (B, N, heads, D) call, so not divisible by 16 at D = 72
# (RoPE tables' excluded: they broadcast over heads, stride 0).
HEAD_STRIDE = re.compile(r"^s(?!c)[a-z]*h$")
INSTRUCTIONS = ("HGMMA", "HMMA", "LDGSTS", "LDG.E.128", "LDG.E.U16", "LDL", "STL", "MUFU", "I2F", "F2I")
BF16 = dict(DOT=tl.bfloat16, PRECISION="tf32", scd=1)  # RoPE tables: unit stride along D (JIT: constant 1)
TILE = dict(BLOCK_D=128, BLOCK_DV=128, D=128, DV=128)  # head dims are constexprs: masks at D = 72 vectorize too
# Blocks of the 14B mixing row (Wan2.1-14B 720p in its "auto" cut (3, 7, 12)); S and z columns (B*heads*D*Dv,
# B*heads*D) of the mixing rows by their blocks: that model, and DiT-XL/2 512 px (30 blocks, 16 x 72 heads), B = 1
MIX_BLOCKS = 252
MIX_COLUMNS = {MIX_BLOCKS: (40 * 128 * 128, 40 * 128), 30: (16 * 72 * 72, 16 * 72), 60: (12 * 128 * 128, 12 * 128)}
WAN_BLOCK_TOKENS = 7 * 8 * 11  # longest block of Wan2.1-1.3B 480p: grid (21, 30, 52) cut (3, 4, 5)
DIT_BLOCK_TOKENS = 7 * 6  # longest block of DiT-XL/2 512 px: grid (1, 32, 32) cut (1, 5, 6); SHORTEST_CONFIG applies
DIT_1024_BLOCK_TOKENS = 8 * 8  # DiT-XL/2 1024 px: grid (1, 64, 64) cut (1, 8, 8); mhla.SHORT_CONFIG applies
# name: (kernel, CONFIG entry, constexprs besides the config's block_n[, tokens of the longest block: Wan's if absent])
KERNELS = {
    "summary fwd": (mhla._summary_kernel, "summary", dict(
        D_TILES=1, DV_TILES=1, ELU=False, ROPE=False, SCALE_Y=False, WEIGHT_Z=False, WITH_Z=True, ATOMIC=False)),
    "summary fwd rope": (mhla._summary_kernel, "summary", dict(
        D_TILES=1, DV_TILES=1, ELU=False, ROPE=True, SCALE_Y=False, WEIGHT_Z=False, WITH_Z=True, ATOMIC=False)),
    "summary bwd dS~": (mhla._summary_kernel, "summary", dict(
        D_TILES=1, DV_TILES=1, ELU=False, ROPE=False, SCALE_Y=True, WEIGHT_Z=True, WITH_Z=True, ATOMIC=False)),
    "output": (mhla._output_kernel, "output", dict(DV_TILES=1, ELU=False, ROPE=False, NORMALIZE=True)),
    # Wan inference: RoPE, unnormalized, the q/k RMSNorms across heads and the output norm applied on the way
    "summary fwd rope qk-norm": (mhla._summary_kernel, "summary", dict(
        D_TILES=1, DV_TILES=1, ELU=False, ROPE=True, SCALE_Y=False, WEIGHT_Z=False, WITH_Z=False, ATOMIC=False,
        NORM_X=True)),
    "output rope norms": (mhla._output_kernel, "output", dict(DV_TILES=1, ELU=False, ROPE=True, NORMALIZE=False,
                                                             NORM_Q=True, OUT_NORM=True)),
    "grad dq": (mhla._grad_kernel, "grad", dict(  # at 60 blocks dmix's buffer is zeroed here (`output_backward`)
        DV_TILES=1, ELU=False, ROPE=False, STATS=True, USE_VEC=True, WITH_DY=False, CLEAR=True)),
    "grad dk dv": (mhla._grad_kernel, "grad", dict(
        DV_TILES=1, ELU=False, ROPE=False, STATS=False, USE_VEC=True, WITH_DY=True)),
    "grad dk dv rope": (mhla._grad_kernel, "grad", dict(  # as Wan uses it: RoPE, unnormalized
        DV_TILES=1, ELU=False, ROPE=True, STATS=False, USE_VEC=False, WITH_DY=True)),
    # the same in fp16 (training under fp16 autocast): untuned settings, fp32 operands (tf32 products)
    "grad dk dv rope fp16": (mhla._grad_kernel, "grad", dict(
        DV_TILES=1, ELU=False, ROPE=True, STATS=False, USE_VEC=False, WITH_DY=True, DTYPE=torch.float16)),
    # DiT and PixArt heads (16 x 72): a head dim that is no multiple of 16, in the same 128-wide tiles, short blocks
    "summary fwd d72": (mhla._summary_kernel, "summary", dict(  # z out of the product's padding column
        D_TILES=1, DV_TILES=1, ELU=False, ROPE=False, SCALE_Y=False, WEIGHT_Z=False, WITH_Z=True, Z_IN_DOT=True,
        ATOMIC=False, D=72, DV=72), DIT_BLOCK_TOKENS),
    "summary fwd d72, 1024 px": (mhla._summary_kernel, "summary", dict(
        D_TILES=1, DV_TILES=1, ELU=False, ROPE=False, SCALE_Y=False, WEIGHT_Z=False, WITH_Z=True, Z_IN_DOT=True,
        ATOMIC=False, D=72, DV=72), DIT_1024_BLOCK_TOKENS),
    "output d72": (mhla._output_kernel, "output", dict(DV_TILES=1, ELU=False, ROPE=False, NORMALIZE=True, D=72, DV=72),
                   DIT_BLOCK_TOKENS),
    # dS~ and dz~ of the one-tile blocks in the launch, and dmix's buffer zeroed for the mixing launch after it
    "grad dq d72, summaries": (mhla._grad_kernel, "grad", dict(
        DV_TILES=1, ELU=False, ROPE=False, STATS=True, USE_VEC=True, WITH_DY=False, SUMMARIZE=True, CLEAR=True, D=72,
        DV=72),
        DIT_BLOCK_TOKENS),
    "grad dk dv d72": (mhla._grad_kernel, "grad", dict(
        DV_TILES=1, ELU=False, ROPE=False, STATS=False, USE_VEC=True, WITH_DY=True, D=72, DV=72), DIT_BLOCK_TOKENS),
    # the mixing GEMM (no token kernel: its own CONFIG entry, `_mix_row`) on bf16 S at the 14B model's 252 blocks,
    # forward and backward alike (`mhla._mix_operand` makes mix and mix^T the same operand); at DiT-XL/2 512 px's 30
    # blocks with mix as the model holds it (fp32, unpadded) and z mixed in the same launch, and so at Wan2.1-1.3B
    # 480p's 60 in 3 x 4 x 5 blocks (up to CONFIG["mix"]["fold_up_to"] = 64 since session 48)
    "mix bf16": (mhla._mix_kernel, "mix", dict(M=MIX_BLOCKS)),
    "mix bf16 z folded": (mhla._mix_kernel, "mix", dict(M=30, WITH_Z=True)),
    "mix bf16 z folded, Gram": (mhla._mix_kernel, "mix", dict(M=30, WITH_Z=True, GRAM=True)),  # the backward's
    "mix bf16 z folded, Gram, 60 blocks": (mhla._mix_kernel, "mix", dict(M=60, WITH_Z=True, GRAM=True)),
    # the quadratic form (`parallel.CONFIG`) for 16 x 72 heads: DiT-XL/2 256 px (256 tokens, 16 blocks), the
    # forward over 256 tokens (24 x 24 tokens, 16 blocks) and at DiT-XL/2 512 px (eager calls take it there); fp32
    # mix; heads in column tiles as `parallel.CONFIG["split_heads"]` says (64 + 16 for the forward and dq), and where
    # the name says in one 128-wide tile or in 64 + 16
    "parallel fwd d72": (parallel._parallel_kernel, "parallel", dict(grid=(1, 16, 16))),
    "parallel fwd d72, 576 tokens": (parallel._parallel_kernel, "parallel", dict(grid=(1, 24, 24))),
    "parallel fwd d72, 1024 tokens": (parallel._parallel_kernel, "parallel", dict(grid=(1, 32, 32))),
    "parallel fwd d72, 1024 tokens, one tile": (parallel._parallel_kernel, "parallel",
                                                dict(grid=(1, 32, 32), SPLIT_HEADS=False)),
    "parallel grad dq d72": (parallel._parallel_grad_kernel, "parallel", dict(KEYS=False, grid=(1, 16, 16))),
    "parallel grad dq d72, one tile": (parallel._parallel_grad_kernel, "parallel",
                                       dict(KEYS=False, grid=(1, 16, 16), SPLIT_HEADS=False)),
    "parallel grad dk dv dmix d72": (parallel._parallel_grad_kernel, "parallel", dict(KEYS=True, grid=(1, 16, 16))),
    "parallel grad dk dv dmix d72, heads 64 + 16": (parallel._parallel_grad_kernel, "parallel",
                                                    dict(KEYS=True, grid=(1, 16, 16), SPLIT_HEADS=True)),
    # and for SANA-1.6B 512 px's 70 x 32 heads (256 tokens, 16 blocks): the launches of the "_narrow" settings
    "parallel grad dq d32": (parallel._parallel_grad_kernel, "parallel",
                             dict(KEYS=False, grid=(1, 16, 16), HEADS=(70, 32))),
    "parallel grad dk dv dmix d32": (parallel._parallel_grad_kernel, "parallel",
                                     dict(KEYS=True, grid=(1, 16, 16), HEADS=(70, 32))),
}


def _tool(name: str) -> str:
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: this Triton install carries no {name} for NVIDIA targets")
    return path


def compile_for_hopper(kernel, constexprs: dict, options: dict, fp32_pointers=FP32_POINTERS, target=HOPPER,
                       pointer_type="*bf16"):
    """The kernel compiled for sm_90 (or `target`) with `constexprs` fixed and the other arguments typed as a call
    passes them (pointers: `pointer_type` but `fp32_pointers`).

    A value given for an integer the kernel does not declare constexpr (a stride, a head dim) is specialized as the
    JIT specializes a run-time integer: fixed when it is 1, marked divisible by 16 when it is, else left unknown.
    A constexpr left out takes its default, as the JIT fills it in (PDL: off)."""
    signature, fixed, attrs = {}, {}, {}
    defaults = {name: p.default for name, p in kernel.signature.parameters.items() if p.default is not p.empty}
    constexprs = {**{arg: defaults[arg] for arg, param in zip(kernel.arg_names, kernel.params)
                     if param.is_constexpr and arg in defaults}, **constexprs}  # as the JIT fills them in
    for i, (arg, param) in enumerate(zip(kernel.arg_names, kernel.params)):
        if arg in constexprs and (param.is_constexpr or constexprs[arg] == 1):
            signature[arg], fixed[(i,)] = "constexpr", constexprs[arg]
            continue
        if arg in constexprs:
            signature[arg] = "i32"
            if constexprs[arg] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
            continue
        if arg.endswith("_ptr"):
            signature[arg] = "*fp32" if arg in fp32_pointers else pointer_type
        else:
            signature[arg] = "fp32" if arg in ("eps", "out_eps") else "i32"
        if arg.endswith("_ptr") or DIVISIBLE.match(arg):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(kernel, signature, fixed, attrs), target=target, options=options)


def usage(compiled) -> dict:
    """Registers, stack and shared memory from the binary's resource table; instruction counts from its SASS."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        table = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", cubin.name],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "--dump-sass", cubin.name],
                              capture_output=True, text=True, check=True).stdout
    found = dict(re.findall(r"(REG|STACK):(\d+)", table))
    ops = re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, re.M)
    row = {"registers": int(found["REG"]), "stack": int(found["STACK"]), "shared": compiled.metadata.shared}
    row.update({name: sum(op == name or op.startswith(name + ".") for op in ops) for name in INSTRUCTIONS})
    row["sass"] = sass
    return row


def _mix_row(constexprs: dict, settings: dict) -> tuple[dict, dict, set]:
    """Arguments, launch options and fp32 pointers of a mixing row at `settings`: `mhla._mix_launch` at the row's
    M, mix as the launcher passes it (`mhla._mix_operand`'s zero-padded bf16 copy; with WITH_Z, the fp32 matrix
    unpadded) and contiguous S and z, specialized as the JIT specializes them; without WITH_Z, z's pointers are S's
    bf16 buffers, as `mhla.mix_with_kernel` passes them (Triton 3.6 compiles the z walk even then); with GRAM, the
    forward's S and z beside them and the fp32 Gram (without, S's and z's buffers and the output stand in)."""
    constexprs = {"GRAM": False, **constexprs}
    m, with_z = constexprs.pop("M"), constexprs.get("WITH_Z", False)
    f, fz = MIX_COLUMNS[m]
    _, launch = mhla._mix_launch(m, f, settings, fz if with_z else 0)
    options = {k: launch.pop(k) for k in ("num_warps", "num_stages")}
    width = m if with_z else cdiv(m, 16) * 16
    sizes = dict(M=m, F=f, FZ=fz, KM=width, smi=width, smk=1, ssb=f, ssf=1, szb=fz, szf=1, spsb=f, spsf=1, spzb=fz,
                 spzf=1)
    fp32 = FP32_POINTERS | {"mix_ptr", "pz_ptr"} if with_z else FP32_POINTERS - {"z_ptr", "zout_ptr"}
    return {**sizes, **launch, **constexprs}, options, fp32 | ({"gram_ptr"} if constexprs["GRAM"] else set())


def _parallel_row(constexprs: dict) -> tuple[dict, dict]:
    """Arguments and settings of a quadratic-form row: `parallel._launch_args` and `parallel.launch_settings` for
    the heads the row names ("HEADS": (heads, features), not a kernel argument; 16 x 72, DiT-XL/2's and PixArt's,
    if it names none) over the grid it names (bf16, normalized, relu, "auto" blocks), sizes specialized as the JIT
    specializes them; the head tiles as the row names them ("SPLIT_HEADS", not a kernel argument), else as
    CONFIG["split_heads"] says."""
    constexprs = dict(constexprs)
    grid = constexprs.pop("grid")
    split = constexprs.pop("SPLIT_HEADS", None)
    heads, width = constexprs.pop("HEADS", (16, 72))
    blocks = resolve_blocks(grid, "auto")
    n, m = math.prod(grid), math.prod(blocks)
    q = torch.empty((1, n, heads, width), dtype=torch.bfloat16, device="meta")
    sizes, meta = parallel._launch_args(q, q, torch.empty((m, m), device="meta"), grid, blocks, elu=False,
                                        normalize=True, strided=(q,))
    kernel = "forward" if "KEYS" not in constexprs else "grad_keys" if constexprs["KEYS"] else "grad_queries"
    meta.update(parallel.head_tile_args(width, width,
                                        kernel in parallel.CONFIG["split_heads"] if split is None else split))
    return {**dict(zip(("heads", "M"), sizes)), **meta, **constexprs}, parallel.launch_settings(kernel, n, q.shape[-1])


def _dtype(constexprs: dict) -> torch.dtype:
    """The inputs' type of a token-kernel row: bf16 unless the row names another ("DTYPE", not a kernel argument)."""
    return constexprs.get("DTYPE", torch.bfloat16)


def row_settings(row: tuple) -> tuple[dict, tuple]:
    """The launch settings a KERNELS row takes on an H200, and the tiles `fitting.smaller` halves on a card with less
    shared memory, as the launchers pass them."""
    kernel, entry, constexprs, *block_tokens = row
    if entry == "mix":
        return mhla._mix_settings(constexprs["M"], constexprs.get("GRAM", False)), mhla.step_tiles("mix")
    if entry == "parallel":
        return _parallel_row(constexprs)[1], mhla.step_tiles("parallel")
    d, dv = constexprs.get("D", TILE["D"]), constexprs.get("DV", TILE["DV"])
    block_d = min(pow2(d), mhla.MAX_TILE) if entry == "summary" else pow2(d)
    cfg = mhla._config(entry, _dtype(constexprs), block_d, (block_tokens or [WAN_BLOCK_TOKENS])[0],
                       constexprs["ROPE"])
    if entry != "summary":
        cfg["block_dv"] = mhla._full_d_tiles(d, dv)[1]
    return cfg, mhla.step_tiles(entry, constexprs.get("OUT_NORM", False))


def compile_row(row: tuple, settings: dict | None = None, target=HOPPER):
    """A KERNELS row compiled for `target` at `settings` (default: `row_settings`, what an H200 takes)."""
    kernel, entry, constexprs, *_ = row
    settings = settings or row_settings(row)[0]
    if entry == "mix":
        return compile_for_hopper(kernel, *_mix_row(constexprs, settings), target=target)
    if entry == "parallel":
        sizes = _parallel_row(constexprs)[0]
        tiles = {key: settings[key] for key in ("OWN", "WALK")}
        options = {key: settings[key] for key in ("num_warps", "num_stages")}
        return compile_for_hopper(kernel, {**sizes, **tiles, **_head_strides(kernel, sizes["D"])}, options,
                                  FP32_POINTERS | {"mix_ptr", "dmix_ptr"}, target=target)
    constexprs = dict(constexprs)
    dtype = constexprs.pop("DTYPE", torch.bfloat16)
    shape = {**TILE, **constexprs}
    if entry == "summary":
        block_d, block_dv = min(pow2(shape["D"]), mhla.MAX_TILE), min(pow2(shape["DV"]), settings["max_dv"])
    else:
        block_d, block_dv = pow2(shape["D"]), settings["block_dv"]
    tiles = dict(BLOCK_D=block_d, BLOCK_DV=block_dv, DV_TILES=cdiv(shape["DV"], block_dv),
                 BLOCK_N=settings["block_n"])
    dot, precision = mhla._dot_types(dtype)
    off = {k: v for k, v in OFF.items() if k in kernel.arg_names}
    pointers, fp32 = POINTER_TYPES[dtype]
    head_align = mhla.head_align(torch.empty((1, 1, 1, shape["D"]), device="meta"))
    options = mhla.grad_options(settings, constexprs.get("SUMMARIZE", False), block_d)  # `_launch`'s unless SUMMARIZE
    # the L2 priorities and the output's loads ahead
    hints = {name: settings[name.lower()] for name in ("KEEP", "STREAM", "PREFETCH") if name in kernel.arg_names}
    return compile_for_hopper(kernel, {**off, **shape, **BF16, "DOT": dot, "PRECISION": precision, **tiles, **hints,
                                       **_head_strides(kernel, shape["D"]), "HEAD_ALIGN": head_align},
                              options, fp32, target=target, pointer_type=pointers)


def _head_strides(kernel, d: int) -> dict:
    """The kernel's token-tensor head strides in a call over contiguous (B, N, heads, d) tensors (the rows' D and Dv
    are equal)."""
    return {arg: d for arg in kernel.arg_names if HEAD_STRIDE.match(arg)}


def report() -> dict:
    """Usage of each kernel in KERNELS at the settings an H200 takes (`row_settings`)."""
    return {name: usage(compile_row(row)) for name, row in KERNELS.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sass", metavar="DIR", help="also write each kernel's SASS to DIR")
    args = parser.parse_args(argv)
    rows = report()
    print("| kernel | regs | stack B | smem B | " + " | ".join(INSTRUCTIONS) + " |")
    print("|---" * (4 + len(INSTRUCTIONS)) + "|")
    for name, row in rows.items():
        cells = [row["registers"], row["stack"], row["shared"], *(row[op] for op in INSTRUCTIONS)]
        print(f"| {name} | " + " | ".join(str(c) for c in cells) + " |")
        if args.sass:
            os.makedirs(args.sass, exist_ok=True)
            with open(os.path.join(args.sass, name.replace(" ", "_") + ".sass"), "w") as f:
                f.write(row["sass"])
