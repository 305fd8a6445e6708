"""The Triton MHLA kernels against the PyTorch reference, on CPU through the Triton interpreter.

The interpreter has to be on before triton is imported, so the kernel checks run in one
subprocess (tests/kernels_interp.py) and each case here asserts on its reported errors; the
rest of the session keeps importing triton normally.
"""

import contextlib
import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from mhla_diffusion import mhla_attention
from mhla_diffusion.blocks import block_geometry, locality_mix
from mhla_diffusion.ops import MHLAOptions, dispatch
from mhla_diffusion.ops.feature_maps import FEATURE_MAPS

from dense import dense_mhla

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve().parent / "kernels_interp.py"
CASES = [
    "ragged relu normalized fused-qkv strides",
    "elu rope unnormalized Dv!=D",
    "rope normalized split programs",
    "rope unnormalized split programs",
    "D=136 Dv=72 (tiled D and Dv)",
    "rope normalized D=136 Dv=72",
    "fp16 rope",
    "fp16 block sums beyond fp16 range",
    "norms on the way, rope unnormalized (as Wan)",
    "norms on the way, normalized Dv!=D split programs",
    "norms on the way, Dv tiled (output norm after)",
    "wan model, norms on the way",
    "wan model training, norms around the op",
    "rms norm kernels",
    "stages",
    "stages split programs",
    "output prefetch",
    "mixing kernel",
    "mixing kernel in the op",
    "parallel form",
    "card refusing the tuned settings",
    "torch.compile fullgraph",
    "opcheck",
    "quadratic form at the eager limit",
    "custom ops only under torch.compile",
    "torch.compile fullgraph, compiling marked in Dynamo's trace only",
]
# fp32 kernels against fp64 references land near 1e-7; fp16 inputs near 3e-4. bf16 numerics are checked on
# the GPU only (`bench op --check`): Triton's interpreter multiplies bf16 tiles wrongly (tl.dot of two bf16
# operands returns ~1e10 for unit inputs, triton 3.8), so opcheck below covers bf16 types, not values.
TOLERANCE = {"torch.float32": 1e-5, "torch.float16": 3e-3}


@pytest.fixture(scope="module")
def interpreted():
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    # the cases take 13-15 min on CI's 2-core machine (session 61): 900 s left no margin
    proc = subprocess.run([sys.executable, str(SCRIPT), *CASES], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", CASES)
def test_kernels_match_reference(interpreted, case):
    errors = dict(interpreted[case])
    assert "error" not in errors, errors.get("error")
    tolerance = TOLERANCE[errors.pop("dtype", "torch.float32")]
    assert errors, "case reported nothing"
    bad = {name: err for name, err in errors.items() if not err <= tolerance}
    assert not bad, f"relative errors above {tolerance}: {bad}"


def _recorded_kernel(x_ptr, n, eps, BLOCK: "tl.constexpr", FLAG: "tl.constexpr" = True):
    pass


def test_repeated_launches_go_to_the_compiled_kernel_and_new_specializations_to_the_jit(monkeypatch):
    """`kernels/compiled.py` (no GPU here: Triton's JIT and the kernel it compiles are recorders over a real JIT
    signature): a launch key's first launch goes through the JIT; a repeat, on other tensors of the same dtype and
    alignment, to the kernel the JIT compiled, every parameter in order (defaults filled in) on a 3-D grid; whatever
    Triton specializes on takes the JIT again: a tensor's dtype or 16-byte alignment, an int's value, a launch option."""
    from triton.runtime.jit import JITFunction

    from mhla_diffusion.kernels import compiled

    launches = []

    class Compiled:
        def __init__(self, number):
            self.number = number

        def __getitem__(self, grid):
            return lambda *args: launches.append(("compiled", self.number, grid, args))

    class RecordedJIT(JITFunction):
        def run(self, *args, grid, warmup, **kwargs):
            launches.append(("jit", grid, args, kwargs))
            return Compiled(len(launches))

    monkeypatch.setattr(compiled, "_COMPILED", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    kernel = RecordedJIT(_recorded_kernel)
    buf = torch.zeros(64)
    aligned, also_aligned, misaligned = buf[:32], buf[4:36], buf[1:33]  # fp32: 16 bytes are 4 elements
    calls = [((aligned, 32, 1e-6), {"BLOCK": 16}), ((also_aligned, 32, 1e-6), {"BLOCK": 16}),
             ((misaligned, 32, 1e-6), {"BLOCK": 16}), ((aligned, 33, 1e-6), {"BLOCK": 16}),
             ((aligned.half(), 32, 1e-6), {"BLOCK": 16}), ((aligned, 32, 1e-6), {"BLOCK": 16, "num_warps": 8}),
             ((buf[5:37], 32, 1e-6), {"BLOCK": 16})]
    for args, kwargs in calls:
        compiled.launch(kernel, (4, 2), *args, **kwargs)
    assert [launch[0] for launch in launches] == ["jit", "compiled", "jit", "jit", "jit", "jit", "compiled"]
    assert launches[1] == ("compiled", 1, (4, 2, 1), (also_aligned, 32, 1e-6, 16, True))
    assert launches[6][1] == 3 and launches[6][3][0].data_ptr() == buf[5:].data_ptr()
    with compiled.through_jit():
        compiled.launch(kernel, (4, 2), aligned, 32, 1e-6, BLOCK=16)
    assert launches[-1][0] == "jit"


def _recorded_dependent_kernel(x_ptr, n, BLOCK: "tl.constexpr", PDL: "tl.constexpr" = 0):
    pass


@pytest.mark.parametrize("capability,hip", [((8, 9), None), ((9, 0), None), ((10, 0), None), ((9, 4), "6.4")],
                         ids=["sm_89", "sm_90", "sm_100", "MI300 (ROCm)"])
def test_kernels_that_wait_for_their_inputs_launch_dependent_on_cards_that_have_it(capability, hip, monkeypatch):
    """`compiled.launch` (no GPU here: the JIT and the kernel it compiles are recorders): a kernel with a PDL parameter
    launches as a programmatic dependent launch (PDL=1, and launch_pdl=True: the compile option Triton's launcher
    reads) on sm_90 and later, through the JIT and then through the kernel it compiled; PDL=2 (which also lets the next
    launch start early) for a launch `compiled.CONFIG["trigger_dependents"]` names, and not for another; an sm_89 card,
    an AMD card (whose capability reads 9.4), a kernel without the parameter, and `compiled.CONFIG["dependent_launch"]`
    off launch as before, under a key of their own."""
    from triton.runtime.jit import JITFunction

    from mhla_diffusion.kernels import compiled
    from mhla_diffusion.kernels.overrides import overridden

    launches = []

    class Compiled:
        def __init__(self, number):
            self.number = number

        def __getitem__(self, grid):
            return lambda *args: launches.append(("compiled", args[-1], self.number))

    monkeypatch.setattr(compiled, "_COMPILED", {})
    monkeypatch.setattr(compiled, "_HOPPER_ON", {})
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability)
    class RecordedJIT(JITFunction):
        def run(self, *args, grid, warmup, **kwargs):
            launches.append(("jit", kwargs.get("PDL", 0), kwargs.get("launch_pdl", False)))
            return Compiled(len(launches))

    waits, plain = RecordedJIT(_recorded_dependent_kernel), RecordedJIT(_recorded_kernel)
    buf = torch.zeros(32)
    for _ in range(2):
        compiled.launch(waits, (2,), buf, 32, BLOCK=16)
    compiled.launch(plain, (2,), buf, 32, 1e-6, BLOCK=16)
    with overridden(["compiled.CONFIG.trigger_dependents=('mix', 'output')"]):
        for _ in range(2):
            compiled.launch(waits, (2,), buf, 32, BLOCK=16, name="output")
        compiled.launch(waits, (2,), buf, 32, BLOCK=16, name="summaries")
    with overridden(["compiled.CONFIG.dependent_launch=False"]):
        for _ in range(2):
            compiled.launch(waits, (2,), buf, 32, BLOCK=16)
    if capability >= (9, 0) and hip is None:
        assert launches == [("jit", 1, True), ("compiled", 1, 1), ("jit", 0, False), ("jit", 2, True),
                            ("compiled", 2, 4), ("compiled", 1, 1), ("jit", 0, False), ("compiled", 0, 7)]
    else:
        assert launches == [("jit", 0, False), ("compiled", 0, 1), ("jit", 0, False), *[("compiled", 0, 1)] * 5]


def test_every_kernel_launched_dependent_waits_before_it_touches_memory():
    """A programmatic dependent launch may start while the kernel before it runs: compiled for sm_90 with PDL on
    (the op's launches on sm_90 and later, `compiled.launch`), each of the op's kernels (`resources.KERNELS`'s, the
    Gram's and the norms' rstd) waits (`griddepcontrol.wait`) before its first global load, store, async copy or
    atomic, and with PDL 2 lets the next launch start (`griddepcontrol.launch_dependents`) after the wait; with PDL off
    it holds neither. Exceptions: the output launch loading q a tile ahead issues its first q tile's loads, and
    nothing else, before the wait (q was written before the mixing launch ahead of it started); the grad kernel's
    EARLY flags, off here, are the next test's. CUDA-graph capture and the timing are checked on the GPU (`bench op
    --check`, BENCHMARKS.md)."""
    import re

    from mhla_diffusion.kernels import mhla, resources

    memory = re.compile(r"\b(ld\.global|st\.global|cp\.async|atom\.global|red\.global)")
    output = resources.KERNELS["output"][0]
    settings, _ = resources.row_settings(resources.KERNELS["output"])
    assert settings["prefetch"]  # bf16 q in 16-byte loads over the program's threads
    q_tile_loads = settings["block_n"] * resources.TILE["BLOCK_D"] * 2 // (settings["num_warps"] * 32 * 16)
    first_rows = {}
    for row in resources.KERNELS.values():
        first_rows.setdefault(row[0], row)
    assert len(first_rows) == 6  # the three token kernels, the mixing GEMM and the quadratic form's two
    compiles = {kernel: lambda pdl, kernel=kernel, row=row: resources.compile_row(
        (kernel, row[1], {**row[2], "PDL": pdl}, *row[3:])) for kernel, row in first_rows.items()}
    # the Gram of the backward's summaries past 32 blocks, and the per-token rstd of the norms applied on the way
    compiles[mhla._gram_kernel] = lambda pdl: resources.compile_for_hopper(
        mhla._gram_kernel, dict(BLOCK_M=64, BLOCK_K=64, PRECISION="tf32", PDL=pdl), dict(num_warps=4, num_stages=3),
        fp32_pointers={"out_ptr"})
    compiles[mhla._rstd_kernel] = lambda pdl: resources.compile_for_hopper(
        mhla._rstd_kernel, dict(D=128, BLOCK_N=32, BLOCK_D=128, PDL=pdl), dict(num_warps=4, num_stages=1),
        fp32_pointers={"out_ptr"})
    for kernel, compile_with in compiles.items():
        for pdl in (2, 1, 0):
            ptx = compile_with(pdl).asm["ptx"]
            wait, trigger = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
            early = [m.group() for m in memory.finditer(ptx, 0, max(wait, 0))]
            assert early == (["ld.global"] * q_tile_loads if kernel is output and pdl else []), (kernel.__name__, pdl)
            assert (wait >= 0) == (pdl > 0), (kernel.__name__, pdl)
            assert (trigger > wait) == (pdl > 1) and (trigger >= 0) == (pdl > 1), (kernel.__name__, pdl)


def test_launches_reading_inputs_early_load_only_those_before_they_wait():
    """`_grad_kernel`'s EARLY_X, EARLY_Y and EARLY_MAT, compiled for sm_90 with PDL on at DiT's heads: before
    `griddepcontrol.wait` the kernel issues global loads only (no store, atomic or async copy: the q-side launch's
    clearing of dmix stays after it), exactly the 16-byte loads of the x tile and of the first y tile the flags name
    (bf16, 64 x 128), and at least those of mat's first (128 x 128) tile with EARLY_MAT."""
    import re

    from mhla_diffusion.kernels import resources

    memory = re.compile(r"\b(ld\.global|st\.global|cp\.async|atom\.global|red\.global)")

    def early(name, **flags):
        kernel, entry, constexprs, *rest = resources.KERNELS[name]
        ptx = resources.compile_row((kernel, entry, {**constexprs, "PDL": 1, **flags}, *rest)).asm["ptx"]
        return [m.group() for m in memory.finditer(ptx, 0, ptx.find("griddepcontrol.wait"))]

    def tile_loads(rows, cols, warps):
        return rows * cols * 2 // (warps * 32 * 16)

    # the k side on 4 warps; the q side, which also makes dO's summaries, on 8 (`mhla.grad_options`)
    assert early("grad dk dv d72", EARLY_X=True, EARLY_Y=True) == ["ld.global"] * 2 * tile_loads(64, 128, 4)
    assert early("grad dq d72, summaries", EARLY_X=True) == ["ld.global"] * tile_loads(64, 128, 8)
    with_mat = early("grad dq d72, summaries", EARLY_X=True, EARLY_MAT=True)
    assert set(with_mat) == {"ld.global"} and len(with_mat) >= tile_loads(64, 128, 8) + tile_loads(128, 128, 8)


def test_head_tiles_cover_a_head_in_one_or_two_tensor_core_tiles_with_the_least_padding():
    """`sizes.head_tiles` (the quadratic form's split heads): every head of 1 to 256 features is covered by a power of
    two of at least 16 columns, or by two such tiles where they pad fewer columns than one, the first wholly inside the
    head (its columns all real); DiT's and PixArt's 72 as 64 + 16."""
    from mhla_diffusion.kernels.sizes import head_tiles, pow2

    for d in range(1, 257):
        main, tail = head_tiles(d)
        whole = max(16, pow2(d))
        assert main >= 16 and pow2(main) == main and (tail == 0 or (tail >= 16 and pow2(tail) == tail)), d
        if tail:
            assert main < d <= main + tail < whole, d
        else:
            assert main == whole, d
            assert all(m + max(16, pow2(d - m)) >= whole for m in (16, 32, 64, 128) if m < d), d
    assert [head_tiles(d) for d in (72, 40, 96, 112, 128, 32)] == [(64, 16), (32, 16), (64, 32), (128, 0), (128, 0),
                                                                   (32, 0)]


@pytest.mark.parametrize("d", [32, 72])
def test_the_quadratic_forms_gradient_launches_take_the_settings_of_their_head_width(d, monkeypatch):
    """An f+b through `mhla_attention` at 256 tokens (the quadratic form): with SANA's 32-wide heads both gradient
    launches take `parallel.CONFIG`'s "_narrow" settings (H100, session 62: 128 queries a dq program, 1.07x faster
    f+b at SANA-1.6B 512 px, 1.05x slower at DiT's heads), with DiT's 72-wide heads the others; each launch gets its
    entry's tiles, warps and stages. The kernels are recorders (nothing runs)."""
    from mhla_diffusion.kernels import parallel

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launches = _record_launches(monkeypatch, ("_parallel_kernel", "_parallel_grad_kernel"))
    q, k, v = (torch.randn(1, 256, 2, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    mhla_attention(q, k, v, locality_mix((1, 4, 4)).requires_grad_(), (1, 16, 16), (1, 4, 4),
                   backend="triton").sum().backward()
    taken = [(kw["KEYS"], kw["OWN"], kw["WALK"], kw["num_warps"], kw["num_stages"])
             for _, kw in launches["_parallel_grad_kernel"]]
    suffix = "_narrow" if d == 32 else ""
    settings = ("own", "walk", "num_warps", "num_stages")
    assert taken == [(keys, *(parallel.CONFIG[entry + suffix][key] for key in settings))
                     for keys, entry in ((False, "grad_queries"), (True, "grad_keys"))]
    assert parallel.CONFIG["grad_queries_narrow"] != parallel.CONFIG["grad_queries"]


def test_triton_backend_on_cpu_needs_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q = torch.randn(1, 12, 2, 8)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        mhla_attention(q, q, q, locality_mix((1, 2, 2)).float(), (1, 3, 4), (1, 2, 2), backend="triton")


def test_triton_backend_refuses_blocks_too_long_to_index(monkeypatch):
    """The kernels find a block's tokens with fp32 division, exact below 2**21 tokens per block: a longer
    block (here plain linear attention, one block, over 2**21 tokens) gets a clear error, not wrong rows."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    grid = (1, 1024, 2048)
    q = torch.zeros(1, 1, 1, 8).expand(1, 2**21, 1, 8)  # no memory: the call must stop before any kernel
    with pytest.raises(ValueError, match="fewer than 2097152.*more blocks"):
        mhla_attention(q, q, q, torch.ones(1, 1), grid, (1, 1, 1), backend="triton")


def test_auto_backend_on_cpu_is_the_reference():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 12, 2, 8, generator=g) for _ in range(3))
    mix = locality_mix((1, 2, 2)).float()
    out = mhla_attention(q, k, v, mix, (1, 3, 4), (1, 2, 2), backend="auto")
    assert torch.equal(out, mhla_attention(q, k, v, mix, (1, 3, 4), (1, 2, 2), backend="torch"))


def _inputs(d=8, dv=8, dtype=torch.float32, n=12):
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, n, 2, d, generator=g).to(dtype) for _ in range(2))
    return q, k, torch.randn(2, n, 2, dv, generator=g).to(dtype)


REFUSALS = {  # what the Triton backend cannot take, and the words of its refusal
    "device": (dict(), {}, "need CUDA"),
    "dtype": (dict(dtype=torch.float64), {}, "share one dtype"),
    "head dim D": (dict(d=12), {}, "D = 12 must be a multiple of 8"),
    "head dim D_v": (dict(dv=264), {}, "D_v = 264 must be a multiple of 8 up to 256"),
    "feature map": (dict(), dict(feature="cubed"), "feature maps \\('relu', 'elu'\\), not 'cubed'"),
    "16-bit head dim": (dict(d=8, dtype=torch.bfloat16), {}, "D = 8 must be at least 16 in bfloat16"),
}


@pytest.fixture
def cubed_feature(monkeypatch):
    """A feature map the reference knows and the kernels do not."""
    monkeypatch.setitem(FEATURE_MAPS, "cubed", lambda x: x.relu() ** 3)


@pytest.mark.parametrize(("card", "capability", "hip"), [("Tesla T4", (7, 5), None),
                                                         ("Tesla V100-SXM2-16GB", (7, 0), None),
                                                         ("AMD Instinct MI300X", (9, 4), "6.2"),
                                                         ("NVIDIA A10", (8, 6), None)])
def test_triton_refuses_gpus_older_than_ampere_and_amd_and_auto_takes_the_reference(card, capability, hip,
                                                                                    monkeypatch):
    """CUDA tensors on a GPU older than Ampere (compute capability 8.0, Triton's own floor), or on an AMD GPU under a
    ROCm build of torch (device type "cuda" too; the kernels were never run there): asked for by name the Triton
    backend says why in one line; "auto" takes the reference. An Ampere card passes the device check. The card's
    properties are read once a device, not at every call. (No GPU here: the card's properties are what
    torch.cuda.get_device_properties answers on one.)"""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.version, "hip", hip)
    properties = types.SimpleNamespace(name=card, major=capability[0], minor=capability[1])
    reads = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: reads.append(device) or properties)
    dispatch._card_refusal.cache_clear()  # this process's card is the one each case stands in
    q = types.SimpleNamespace(device=torch.device("cuda", 0))  # a CUDA tensor as the device check reads it
    geometry, options = block_geometry((1, 3, 4), (1, 2, 2)), MHLAOptions()
    if capability >= (8, 0) and hip is None:
        assert dispatch._triton_device(q, q, q, geometry, options) is None
        assert dispatch._triton_device(q, q, q, geometry, options) is None and len(reads) == 1
        dispatch._card_refusal.cache_clear()
        return
    rocm = "this is a ROCm build of PyTorch; the Triton kernels are built and checked for NVIDIA GPUs only"
    match = rocm if hip else f"{card} has compute capability {capability[0]}.{capability[1]}; the Triton kernels need 8.0"
    with pytest.raises(ValueError, match=f"backend='triton' cannot run this call: {match}.*backend='auto'"):
        dispatch.choose("triton", q, q, q, geometry, options)
    assert dispatch.choose("auto", q, q, q, geometry, options) is dispatch.BACKENDS["torch"]
    assert len(reads) == (0 if hip else 1)
    dispatch._card_refusal.cache_clear()


@pytest.mark.parametrize("what", list(REFUSALS))
def test_triton_refusals_are_explained_and_auto_takes_the_reference(what, monkeypatch, cubed_feature):
    """Each capability the Triton backend checks: asked for by name it raises why (one line, with what to do);
    "auto" takes the reference for the same call. Only the device refusal needs TRITON_INTERPRET unset."""
    shapes, options, match = REFUSALS[what]
    if what == "device":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v = _inputs(**shapes)
    geometry, opts = block_geometry((1, 3, 4), (1, 2, 2)), MHLAOptions(**options)
    with pytest.raises(ValueError, match=f"backend='triton' cannot run this call: .*{match}.*backend='auto'") as err:
        dispatch.choose("triton", q, k, v, geometry, opts)
    assert "\n" not in str(err.value)
    assert dispatch.choose("auto", q, k, v, geometry, opts) is dispatch.BACKENDS["torch"]


def test_triton_takes_what_it_supports_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v = _inputs()
    chosen = dispatch.choose("auto", q, k, v, block_geometry((1, 3, 4), (1, 2, 2)), MHLAOptions(feature="elu"))
    assert chosen is dispatch.BACKENDS["triton"]


@pytest.mark.parametrize("backend", ["auto", "triton"])
@pytest.mark.parametrize("autocast", [False, True])
def test_norms_are_fused_only_without_autograd_or_autocast_and_autocast_runs_the_op_in_its_type(autocast, backend,
                                                                                                monkeypatch):
    """Under autocast the norms run first, in PyTorch, and the op then runs in autocast's type, as SDPA does: norms
    that return fp32 q, k beside bf16 v leave it the Triton path in bf16 (it took the PyTorch reference, which the
    Triton path's one-dtype rule left it). Without autocast and autograd the Triton path applies the norms itself."""
    from mhla_diffusion.ops.norms import Norms

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ran = []

    def record(name):
        return lambda q, k, v, *args: ran.append((name, q.dtype)) or v

    triton, torch_backend = dispatch.BACKENDS["triton"], dispatch.BACKENDS["torch"]
    monkeypatch.setitem(dispatch.BACKENDS, "triton", dispatch.Backend(record("triton"), triton.constraints,
                                                                      record("triton, norms on the way")))
    monkeypatch.setitem(dispatch.BACKENDS, "torch", dispatch.Backend(record("torch"), torch_backend.constraints))
    monkeypatch.setattr(Norms, "inputs", lambda self, q, k, fused: (q.float(), k.float()))  # norms returning fp32
    q, k, v = _inputs(d=16, dv=16, dtype=torch.bfloat16)
    norms = Norms(torch.ones(32), torch.ones(32), 1e-6)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        dispatch.mhla_op(q, k, v, locality_mix((1, 2, 2)).float(), block_geometry((1, 3, 4), (1, 2, 2)), MHLAOptions(),
                         norms=norms, backend=backend)
    assert ran == ([("triton", torch.bfloat16)] if autocast else [("triton, norms on the way", torch.bfloat16)])


def test_rms_norm_kernels_refuse_groups_that_do_not_split_the_row_or_a_weight_of_another_size():
    """One line saying what was wrong, instead of a launch reading past the weight (a (Dv,) gain for several heads,
    which PyTorch's passes broadcast) or leaving the row's last columns unwritten."""
    from mhla_diffusion.kernels.op import grouped_rms_norm

    x = torch.randn(3, 2, 16)
    with pytest.raises(ValueError, match=r"last dim \(16\) to split into 3 equal groups"):
        grouped_rms_norm(x, torch.ones(16), 3, 1e-6)
    with pytest.raises(ValueError, match=r"weight of shape \(8,\)"):
        grouped_rms_norm(x, torch.ones(8), 2, 1e-6)


def test_under_autocast_the_op_returns_autocasts_type_but_for_fp64_and_meta_tensors_run():
    """As autocast treats SDPA: fp32 inputs under bf16 autocast give a bf16 output (close to the fp32 one), fp64
    inputs stay fp64; tensors on the meta device, which has no autocast, still give a meta output."""
    mix = locality_mix((1, 2, 2)).float()
    q, k, v = _inputs(d=16, dv=16)
    exact = mhla_attention(q, k, v, mix, (1, 3, 4), (1, 2, 2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mhla_attention(q, k, v, mix, (1, 3, 4), (1, 2, 2))
        wide = mhla_attention(q.double(), k.double(), v.double(), mix.double(), (1, 3, 4), (1, 2, 2))
    assert out.dtype == torch.bfloat16 and ((out.float() - exact).norm() / exact.norm()).item() < 2e-2
    assert wide.dtype == torch.float64 and torch.allclose(wide.float(), exact, atol=1e-5)
    meta = [t.to("meta") for t in (q, k, v, mix)]
    assert mhla_attention(*meta, (1, 3, 4), (1, 2, 2)).device.type == "meta"


def test_unsupported_feature_map_falls_back_to_the_reference(monkeypatch, cubed_feature):
    """A feature map registered for the reference only is computed as that map under "auto", also where the
    Triton backend is available, never as one of the kernels' maps; the custom op itself refuses it too."""
    from mhla_diffusion.kernels import op

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v = (t.double() for t in _inputs())
    mix = locality_mix((1, 2, 2))
    out = mhla_attention(q, k, v, mix, (1, 3, 4), (1, 2, 2), feature="cubed")
    torch.testing.assert_close(out, dense_mhla(q, k, v, mix, (1, 3, 4), (1, 2, 2), feature="cubed"))
    with pytest.raises(ValueError, match="not 'cubed'"):
        op.mhla_summaries(k.float(), v.float(), None, None, None, 0.0, [1, 3, 4, 1, 2, 2, 0], True, 1e-6, "cubed")


def test_unknown_backend_is_rejected():
    q = torch.randn(1, 12, 2, 8)
    with pytest.raises(ValueError, match="backend"):
        mhla_attention(q, q, q, locality_mix((1, 2, 2)).float(), (1, 3, 4), (1, 2, 2), backend="cuda")


def test_resource_report_builds_hopper_binaries_without_a_gpu(tmp_path, capsys):
    """`kernels/resources.py` compiles every token kernel and the mixing GEMM for sm_90 on this CPU-only machine and
    reads the binaries: all run on tensor cores (wgmma at Wan's block length; the short blocks' small token tiles take
    the warp-level mma), and the bf16 forward summary keeps to 128 registers (two programs per SM) with async-copy loads
    and nothing spilled, the property its launch config was tuned for. At DiT's head dim (72, no multiple of 16) the
    token loads of every kernel stay 16-byte and pipelined, at DiT's own head stride (72): with the head dim a run-time
    integer, and then with that head stride unmarked (session 39: the H200's 249-register summary kernel), they were
    scalar 2-byte loads without async copies (the JIT marks only multiples of 16; `_head` marks the head offset). The
    mixing GEMM at the 14B model's 252 blocks (128 rows of mix over 256 padded columns, 4 S tiles in flight) keeps to
    registers and fits in shared memory; at DiT-XL/2 512 px's 30 blocks, mixing z in the same launch, its S and z walks
    both pipeline, and the backward's launch that forms dmix from the same tiles spills nothing (with IEEE fp32
    products for z's Gram it spilled 208 bytes). DiT's forward summary kernel at 1024 px, z out of its product, fits
    two programs per SM. Each row is
    typed as its launcher passes it: the 252-block mixing row (no z) with S's bf16 buffers standing in for z's, which
    Triton 3.6 compiled into a z walk of mismatched types and refused (every mixing launch without z, on the H200 in
    session 38; reproduced on CPU with Triton 3.6's compiler, which this environment does not install)."""
    from mhla_diffusion.kernels import resources

    resources.main(["--sass", str(tmp_path)])
    table = capsys.readouterr().out.splitlines()
    header = [c.strip() for c in table[0].strip("|").split("|")]
    rows = {cells[0]: dict(zip(header, cells)) for cells in
            ([c.strip() for c in line.strip("|").split("|")] for line in table[2:])}
    assert set(rows) == set(resources.KERNELS)
    # wgmma for bf16 at Wan's block length (fp16's fp32 operands on 32-token tiles and 30 blocks' 32-row mix take the
    # warp-level mma)
    assert all(int(row["HGMMA"]) > 0 for name, row in rows.items()
               if not name.endswith(("d72", "fp16", "z folded", "Gram")))
    assert all(int(row["HGMMA"]) + int(row["HMMA"]) > 0 for row in rows.values())
    forward = rows["summary fwd"]
    assert int(forward["regs"]) <= 128 and int(forward["stack B"]) == 0 and int(forward["LDL"]) == 0
    assert int(forward["LDGSTS"]) > 0 and int(forward["LDG.E.U16"]) == 0
    # the RoPE dk/dv kernel spilled 1,240 bytes at 4 warps and 2 stages; its own launch options keep it in registers
    assert int(rows["grad dk dv rope"]["stack B"]) == 0 and int(rows["grad dk dv rope"]["LDL"]) == 0
    assert all(int(row["LDG.E.U16"]) == 0 for name, row in rows.items() if "d72" in name), rows
    for name in ("summary fwd d72", "grad dk dv d72", "parallel fwd d72"):
        assert int(rows[name]["LDGSTS"]) > 0, rows[name]
    # DiT-XL/2 1024 px's forward summaries, z out of the product's padding column: two programs per SM (65,536
    # registers), nothing spilled
    row = rows["summary fwd d72, 1024 px"]
    warps = resources.row_settings(resources.KERNELS["summary fwd d72, 1024 px"])[0]["num_warps"]
    assert 2 * 32 * warps * int(row["regs"]) <= 65536 and int(row["stack B"]) == 0, (warps, row)
    assert int(rows["output d72"]["LDG.E.128"]) > 0 and int(rows["output d72"]["LDG.E.U16"]) == 0
    # DiT-XL/2 512 px's q-side gradients making dO's summaries in the same launch, on its own warps: nothing spilled
    assert int(rows["grad dq d72, summaries"]["stack B"]) == 0, rows["grad dq d72, summaries"]
    row = rows["mix bf16"]  # 16-byte loads (no 2-byte mix loads either), no spill
    assert int(row["stack B"]) == 0 and int(row["LDG.E.128"]) > 0 and int(row["LDG.E.U16"]) == 0, row
    row = rows["mix bf16 z folded"]  # S's and z's walks both pipelined (async copies), nothing spilled, 4+ programs/SM
    assert int(row["stack B"]) == 0 and int(row["LDGSTS"]) > 0 and int(row["regs"]) <= 128, row
    row = rows["mix bf16 z folded, Gram"]  # the backward's, forming dmix too: pipelined, nothing spilled, 4+ per SM
    assert int(row["stack B"]) == 0 and int(row["LDGSTS"]) > 0 and int(row["regs"]) <= 128, row
    # the quadratic form's forward and dq as shipped, DiT's heads in 64 + 16 columns: the 128-wide tile's padding
    # neither loaded nor kept
    for one, split in (("parallel fwd d72, 1024 tokens, one tile", "parallel fwd d72, 1024 tokens"),
                       ("parallel grad dq d72, one tile", "parallel grad dq d72")):
        one, split = rows[one], rows[split]
        assert int(split["smem B"]) < 0.7 * int(one["smem B"]) and int(split["regs"]) <= int(one["regs"]), (one, split)
        assert int(split["LDG.E.128"]) + int(split["LDGSTS"]) < int(one["LDG.E.128"]) + int(one["LDGSTS"]), (one, split)
        assert int(split["stack B"]) == 0, split
    # every kernel's CONFIG settings within the H200's 232,448 bytes of shared memory per program, as tuned there
    assert all(int(r["smem B"]) <= 232448 for r in rows.values()), {n: r["smem B"] for n, r in rows.items()}
    assert len(list(tmp_path.glob("*.sass"))) == len(resources.KERNELS)


# Shared memory one program may opt into (CUDA's per-architecture limits): an A100, and the 99 KB of the RTX 3090 /
# A10 / A6000 (sm_86), RTX 4090 / L4 / L40S (sm_89) and RTX 5090 (sm_120)
CARDS = {"A100": (80, 166_912), "RTX 4090": (89, 101_376)}
# The kernels (resources.KERNELS rows) whose H200 settings each card refuses
REFUSED = {"A100": {"mix bf16"},
           "RTX 4090": {"mix bf16", "grad dk dv", "grad dk dv rope", "grad dk dv rope fp16", "grad dk dv d72",
                        "parallel fwd d72, 1024 tokens, one tile", "summary fwd rope", "summary fwd rope qk-norm"}}


@pytest.mark.parametrize("card", CARDS)
def test_every_kernel_has_settings_that_cards_with_less_shared_memory_take(card):
    """Each kernel's launch at a real model's shape (`resources.KERNELS`: Wan, DiT, the 14B model's mixing GEMM),
    compiled for the card's architecture on this CPU by Triton's own compiler: the H200's settings (CONFIG's) where
    they fit the card, else the first of `fitting.smaller` that does, which the launchers step down to as the card
    refuses (`launch_within_card`; kernels_interp.py's "card refusing the tuned settings" runs that on the
    interpreter). Launched as tuned, the A100 refused the 14B model's mixing GEMM, and a 4090 also a converted Wan's
    key gradients (147,456 bytes as Wan uses them in bf16; 155,648 in fp16, also at 16-token tiles: its Dv tile is
    what gives): training Wan failed there. DiT's key gradients, on CONFIG's 64-token tiles since session 39's re-sweep,
    step down there too, and since session 48 (4 pipeline stages) the summaries with RoPE tables, as Wan uses them.
    The quadratic form's forward with DiT's heads in 64 + 16 columns, as shipped since session 44
    (`parallel.CONFIG["split_heads"]`), fits a 4090 as tuned at 576 and 1,024 tokens, where one 128-wide tile did
    not."""
    from triton.backends.compiler import GPUTarget

    from mhla_diffusion.kernels import fitting, resources

    capability, limit = CARDS[card]
    target, stepped = GPUTarget("cuda", capability, 32), set()
    for name, row in resources.KERNELS.items():
        settings, tiles = resources.row_settings(row)
        for i, candidate in enumerate(fitting.smaller(settings, tiles)):
            if resources.compile_row(row, candidate, target).metadata.shared <= limit:
                break
        else:
            pytest.fail(f"{name}: no settings of fitting.smaller({settings}, {tiles}) fit {card}'s {limit} bytes")
        if i:
            stepped.add(name)
    assert stepped == REFUSED[card]


def test_a_refused_launch_runs_the_first_settings_the_card_takes_and_the_card_is_remembered(monkeypatch, caplog):
    """`launch_within_card` against an RTX 4090's answer (Triton's sm_89 compile of a converted Wan's key gradients
    as Wan uses them, OutOfResources over 101,376 bytes, as its JIT raises it): CONFIG's two stages refused, one
    stage taken; the next call with the same kernel, settings and constexprs launches one stage at once. A launch
    no settings fit raises the card's refusal, and so does any refused launch inside `as_asked` (`tune.py`'s sweeps
    time the candidate they name or skip it)."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.errors import OutOfResources

    from mhla_diffusion.kernels import fitting, mhla, resources

    monkeypatch.setattr(fitting, "_TAKEN", {})
    tried, row = [], resources.KERNELS["grad dk dv rope"]

    def launch(settings):
        tried.append(settings["num_stages"])
        shared = resources.compile_row(row, settings, GPUTarget("cuda", 89, 32)).metadata.shared
        if shared > CARDS["RTX 4090"][1]:
            raise OutOfResources(shared, CARDS["RTX 4090"][1], "shared memory")
        return settings

    settings, tiles = resources.row_settings(row)
    constexprs = {"ROPE": True, "WITH_DY": True}
    with caplog.at_level("INFO", logger="mhla_diffusion.kernels.fitting"):
        took = fitting.launch_within_card(mhla._grad_kernel, "cuda:0", settings, tiles, constexprs, launch)
    assert tried == [2, 1] and took == {**settings, "num_stages": 1}
    # one line says what the card refused and what runs instead
    assert "_grad_kernel on cuda:0" in caplog.text
    assert "needs 147456 bytes of shared memory, the card has 101376; trying" in caplog.text
    assert fitting.launch_within_card(mhla._grad_kernel, "cuda:0", settings, tiles, constexprs, launch) == took
    assert tried == [2, 1, 1]

    def refused(settings):
        raise OutOfResources(1, 0, "shared memory")

    with pytest.raises(OutOfResources):
        fitting.launch_within_card(mhla._grad_kernel, "cuda:0", settings, tiles, {}, refused)
    with fitting.as_asked(), pytest.raises(OutOfResources):
        fitting.launch_within_card(mhla._grad_kernel, "cuda:1", settings, tiles, constexprs, launch)
    assert tried == [2, 1, 1, 2]


def test_a_larger_card_refuses_what_a_smaller_one_would_inside_card_with_shared_memory(monkeypatch):
    """`bench op --shared-memory 101376` on an H200: Triton's JIT reads the card's limit through
    `compiler.max_shared_mem`, which answers the smaller of the card's and the limit inside the context, the card's
    own after it (the launchers then step down there as on a 4090; `bench op --check` checks those settings)."""
    from triton.compiler import compiler

    from mhla_diffusion.kernels import fitting

    monkeypatch.setattr(compiler, "max_shared_mem", lambda device: 232_448)  # what an H200's driver answers
    with fitting.card_with_shared_memory(101_376):
        assert compiler.max_shared_mem(0) == 101_376
    with fitting.card_with_shared_memory(300_000):
        assert compiler.max_shared_mem(0) == 232_448
    assert compiler.max_shared_mem(0) == 232_448


def test_a_refused_launchs_buffers_are_freed_before_the_retry(monkeypatch):
    """The buffers a refused attempt allocated are freed when the card refuses, not at the next garbage collection:
    Triton raises OutOfResources from a frame that keeps the exception (as `refuse` below), a cycle through the
    traceback that held the attempt's frame, and so its buffers (a Wan-14B summary buffer is 660 MB), alive."""
    import gc
    import weakref

    from triton.runtime.errors import OutOfResources

    from mhla_diffusion.kernels import fitting, mhla

    monkeypatch.setattr(fitting, "_TAKEN", {})
    attempts = []

    def refuse():
        refusal = OutOfResources(2, 1, "shared memory")
        raise refusal

    def launch(settings):
        buffer = torch.empty(1 << 16)
        attempts.append(weakref.ref(buffer))
        if settings["num_stages"] > 1:
            refuse()
        return settings["num_stages"]

    gc.disable()
    try:
        assert fitting.launch_within_card(mhla._grad_kernel, "cpu", dict(num_stages=2, block_n=32), ("block_n",), {},
                                          launch) == 1
        assert attempts[0]() is None and len(attempts) == 2
    finally:
        gc.enable()


def test_launch_sweep_keeps_each_kernels_fastest_override(monkeypatch):
    """`tune.py --sweep short` (a GPU tool; its timing faked here): coordinate descent keeps, kernel by kernel, the
    candidate with the least summed time, skips candidates that fail to compile, leaves the winners in
    mhla.SHORT_CONFIG, and refuses shapes whose blocks are too long for the table to apply. An entry's settings that no
    candidate sets (the summaries' "num_stages") stay under every candidate timed and in the winner; a kernel the table
    has no entry for (the output) gets the winner alone."""
    from mhla_diffusion.kernels import mhla, tune

    fast, broken = {"block_n": 32}, {"num_warps": 2}
    candidates = {kernel: ({}, broken, fast) for kernel in ("summary", "output")}
    monkeypatch.setitem(tune.SWEEPS, "short", (mhla.SHORT_CONFIG, candidates, False, ("dit512",)))
    committed = {kernel: dict(cfg) for kernel, cfg in mhla.SHORT_CONFIG.items()}
    assert "output" not in committed and "num_stages" in committed["summary"]
    timed = []

    def fake_op_times(name, as_used=False):
        timed.append({kernel: dict(mhla.SHORT_CONFIG.get(kernel, {})) for kernel in candidates})
        if any(cfg.get("num_warps") == 2 for cfg in mhla.SHORT_CONFIG.values()):
            raise RuntimeError("out of resources")
        ms = sum(cfg.get("block_n") != 32 for cfg in mhla.SHORT_CONFIG.values()) + 1.0
        return ms, 2 * ms

    monkeypatch.setattr(tune, "op_times", fake_op_times)
    kept = {"summary": {"num_stages": committed["summary"]["num_stages"]}, "output": {}}
    try:
        winners = {kernel: {**kept[kernel], **fast} for kernel in candidates}
        assert tune.sweep("short") == winners
        assert mhla.SHORT_CONFIG == {**committed, **winners}
        assert all(cfg[kernel].items() >= kept[kernel].items() for cfg in timed for kernel in candidates)
        with pytest.raises(ValueError, match="SHORT_CONFIG would not apply"):
            tune.main(["--sweep", "short", "--shapes", "wan480"])
    finally:
        mhla.SHORT_CONFIG.clear()
        mhla.SHORT_CONFIG.update(committed)


def test_short_block_overrides_apply_where_they_were_measured():
    """SHORT_CONFIG was chosen on plain bf16 calls with tiles up to 128: fp32 and fp16 keep their own small tile, RoPE
    calls their own overrides, long blocks CONFIG; SHORTEST_CONFIG, over it, for blocks of up to 48 tokens (DiT-XL/2
    512 px, SANA 1K: 42), not at 1024 px's 64."""
    from mhla_diffusion.kernels import mhla

    shortest_output = mhla._config("output", torch.bfloat16, 128, 42)
    assert {k: shortest_output[k] for k in mhla.SHORTEST_CONFIG["output"]} == mhla.SHORTEST_CONFIG["output"]
    shortest = mhla._config("summary", torch.bfloat16, 128, 42)
    assert {k: shortest[k] for k in mhla.SHORTEST_CONFIG["summary"]} == mhla.SHORTEST_CONFIG["summary"]
    at_64 = mhla._config("summary", torch.bfloat16, 128, 64)
    assert {k: at_64[k] for k in mhla.SHORT_CONFIG["summary"]} == mhla.SHORT_CONFIG["summary"]
    rope_summary = mhla._config("summary", torch.bfloat16, 128, 64, rope=True)
    assert rope_summary["num_warps"] == mhla.CONFIG["summary"]["num_warps"]
    assert mhla._config("output", torch.bfloat16, 128, 616)["stream"] == mhla.CONFIG["output"]["stream"]
    assert mhla.SHORTEST_CONFIG["output"]["stream"] != mhla.CONFIG["output"]["stream"]
    long_summary = mhla._config("summary", torch.bfloat16, 128, 616)  # Wan's blocks pipeline deeper than DiT's
    assert long_summary["num_stages"] == mhla.CONFIG["summary"]["num_stages"] != at_64["num_stages"]
    assert mhla._config("output", torch.float32, 128, 42) == mhla._config("output", torch.float32, 128, 616)
    assert mhla._config("grad", torch.bfloat16, 128, 42, rope=True) == mhla._config("grad", torch.bfloat16, 128, 616,
                                                                                  rope=True)


# Every kernel an op call launches, as `kernels.mhla` and `kernels.parallel` name them
KERNEL_NAMES = ("_summary_kernel", "_output_kernel", "_grad_kernel", "_mix_kernel", "_gram_kernel", "_rstd_kernel",
                "_parallel_kernel", "_parallel_grad_kernel")
TOKEN_KERNEL_NAMES = ("_summary_kernel", "_output_kernel", "_grad_kernel", "_parallel_kernel", "_parallel_grad_kernel")


def _record_launches(monkeypatch, names=KERNEL_NAMES) -> dict:
    """The named kernels replaced by recorders, which run nothing: {name: [(args, kwargs) of each launch]}, the
    launch's grid in kwargs["grid"]."""
    from mhla_diffusion.kernels import mhla, parallel

    launches = {name: [] for name in names}

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches[self.name].append((args, {**kwargs, "grid": tuple(grid)}))

    for name in names:
        monkeypatch.setattr(mhla if hasattr(mhla, name) else parallel, name, Recorder(name))
    return launches


def _record_mix_launches(monkeypatch) -> list:
    """`mhla._mix_kernel` replaced by a recorder: the (args, kwargs) of each launch, and nothing runs."""
    return _record_launches(monkeypatch, ("_mix_kernel",))["_mix_kernel"]


def _aten_operand_shapes(fn) -> list:
    """The input shapes of every copy, fill or GEMM `fn` runs (torch.profiler, CPU)."""
    from torch.profiler import ProfilerActivity, profile

    ops = {"aten::clone", "aten::contiguous", "aten::copy_", "aten::_to_copy", "aten::mm", "aten::bmm", "aten::fill_",
           "aten::zero_", "aten::zeros"}
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return [shape for event in prof.events() if event.name in ops for shape in event.input_shapes or [[]]]


@pytest.mark.parametrize("transposed", [False, True], ids=["mix", "mix^T"])
def test_mixing_kernel_gets_the_summaries_uncopied_and_mix_padded(transposed, monkeypatch):
    """Over CONFIG["mix"]["fold_up_to"] blocks the mixing kernel gets the summaries as a view (torch.matmul folded a
    grad-requiring 2-D operand with batched summaries into copies of them, even under no_grad), and mix, a model's
    Parameter or the backward's mix^T view, as one small contiguous copy in the summaries' type, zero-padded to a
    multiple of 16 columns. The launch is recorded, not run (its values: kernels_interp.py, "mixing kernel")."""
    from mhla_diffusion.kernels import mhla

    launches = _record_mix_launches(monkeypatch)
    m = 69
    mix = torch.nn.Parameter(torch.rand(m, m))
    mat = mix.t() if transposed else mix
    s = torch.randn(m, 4, 8, 8, dtype=torch.bfloat16)  # (M, B*heads, D, Dv)
    out = []
    shapes = _aten_operand_shapes(lambda: out.append(mhla.mix_blocks(mat, s, torch.bfloat16)))
    assert all(math.prod(shape) <= m * 80 for shape in shapes), shapes  # nothing the size of the summaries
    [(args, kwargs)] = launches
    padded = args[0]
    assert padded.dtype == s.dtype and padded.shape == (m, 80) and padded.stride() == (80, 1)
    assert args[11:14] == (80, 80, 1) and not kwargs["WITH_Z"]  # mix read up to column 80, row stride 80
    assert torch.equal(padded[:, :m], mat.detach().to(s.dtype)) and not padded[:, m:].any()
    assert args[1].data_ptr() == s.data_ptr() and args[1].shape == (m, 4 * 8 * 8)
    assert out[0].shape == s.shape and out[0].dtype == s.dtype


@pytest.mark.parametrize("transposed", [False, True], ids=["mix", "mix^T"])
@pytest.mark.parametrize("m", [6, 30, 60])
def test_short_sequences_mix_s_and_z_in_one_launch_on_mix_as_it_is(m, transposed, monkeypatch):
    """Up to CONFIG["mix"]["fold_up_to"] blocks (DiT-XL/2 512 px and SANA 1K have 30, Wan2.1 480p in 3 x 4 x 5 blocks
    60) `mix_summaries` is one mixing launch for bf16 S and fp32 z, on mix as the caller holds it (the fp32 Parameter
    or the backward's mix^T view, its own storage and strides): no padded copy, no fill, no GEMM for z; unnormalized
    calls (z None) mix S alone, and fp32 S (fp32 inputs) stays on cuBLAS. The launch is recorded, not run (values:
    kernels_interp.py)."""
    from mhla_diffusion.kernels import mhla

    launches = _record_mix_launches(monkeypatch)
    mix = torch.nn.Parameter(torch.rand(m, m))
    mat = mix.t() if transposed else mix
    s, z = torch.randn(m, 4, 8, 8, dtype=torch.bfloat16), torch.rand(m, 4, 8)
    out = []
    assert _aten_operand_shapes(lambda: out.append(mhla.mix_summaries(mat, s, z, torch.bfloat16))) == []
    [(args, kwargs)] = launches
    assert args[0].data_ptr() == mix.data_ptr() and args[0].dtype == torch.float32 and args[11:14] == (m, *mat.stride())
    assert args[1].data_ptr() == s.data_ptr() and args[3].data_ptr() == z.data_ptr() and kwargs["WITH_Z"]
    (mixed_s, mixed_z), = out
    assert mixed_s.shape == s.shape and mixed_s.dtype == s.dtype and mixed_z.shape == z.shape
    assert mixed_z.dtype == torch.float32 and mixed_z.data_ptr() == args[4].data_ptr()
    mixed_s, no_z = mhla.mix_summaries(mat, s, None, torch.bfloat16)
    assert no_z is None and not launches[1][1]["WITH_Z"] and launches[1][0][0].data_ptr() == mix.data_ptr()
    mhla.mix_summaries(mat, s.float(), z, torch.float32)
    assert len(launches) == 2
    s69 = torch.randn(69, 4, dtype=torch.bfloat16)
    for z, gram_with, logits in ((torch.rand(69, 2), None, False), (None, (s69, None), False), (None, None, True)):
        with pytest.raises(ValueError, match="softmaxes logits in the same launch up to 64 blocks, not 69"):
            mhla.mix_with_kernel(torch.rand(69, 69), s69, z, gram_with=gram_with, logits=logits)


# aten ops that write zeros or a constant into a buffer: each a fill launch on the GPU
FILL_OPS = {"zeros", "zeros_like", "zero_", "fill_", "fill"}


def test_the_op_mixes_s_and_z_together_forward_and_backward_at_short_sequences(monkeypatch):
    """`output_forward` and `output_backward` (the op's mixing, forward, and backward with the mix^T products) at 30
    blocks with bf16 inputs: one mixing launch per direction with z folded in, and the token kernels get the mixed
    z it returns; the backward's mix^T launch also forms dmix from the dS~ and dz~ it mixes and the forward's S and
    z, into the buffer the backward returns, which the q-side grad launch before it zeroes (`block_grad(clear=)`): no
    `_gram_kernel` launch and no fill. The mixing launches are recorded, the token kernels replaced by recorders of
    their inputs (values, with that buffer poisoned until the grad launch clears it: kernels_interp.py, "mixing
    kernel in the op")."""
    from mhla_diffusion.blocks import block_geometry
    from mhla_diffusion.kernels import mhla

    launches = _record_mix_launches(monkeypatch)
    grams = _record_launches(monkeypatch, ("_gram_kernel",))["_gram_kernel"]
    seen = []
    m = 30
    ds_mixed, dz_mixed = torch.randn(m, 2, 8, 8, dtype=torch.bfloat16), torch.rand(m, 2, 8)
    monkeypatch.setattr(mhla, "block_output", lambda q, s, z, *a, **kw: seen.append(z) or q)
    cleared = []
    monkeypatch.setattr(mhla, "block_grad", lambda x, y, s, z, *a, **kw: seen.append(z) or cleared.append(
        kw.get("clear")) or (x, None, x[..., 0], x[..., 0], None))
    monkeypatch.setattr(mhla, "block_summaries", lambda q, do, *a, **kw: (ds_mixed, dz_mixed))
    grid, blocks = (1, 10, 12), (1, 5, 6)
    q = torch.randn(1, 120, 2, 8, dtype=torch.bfloat16)
    g = mhla.Geometry(q, q, block_geometry(grid, blocks))
    mix = torch.rand(m, m)
    s, z = torch.randn(m, 2, 8, 8, dtype=torch.bfloat16), torch.rand(m, 2, 8)
    kw = dict(elu=False, normalize=True, eps=1e-6)
    mhla.output_forward(q, mix, s, z, None, g, **kw)
    backward = []
    calls = _aten_calls(lambda: backward.extend(mhla.output_backward(q, q, mix, s, z, None, g, **kw)))
    _, dmix, ds, dz = backward
    assert [kwargs["WITH_Z"] for _, kwargs in launches] == [True, True, True]
    assert [kwargs["GRAM"] for _, kwargs in launches] == [False, False, True] and grams == []
    assert [args[0].stride() for args, _ in launches] == [mix.stride(), mix.stride(), mix.t().stride()]
    assert [z_in.data_ptr() for z_in in seen] == [args[4].data_ptr() for args, _ in launches[:2]]
    back = launches[2][0]  # mix, dS~, dS, dz~, dz, S, z, the Gram's buffer, ...
    assert [back[i].data_ptr() for i in (1, 3, 5, 6)] == [t.data_ptr() for t in (ds_mixed, dz_mixed, s, z)]
    assert back[7].shape == (m, m) and back[7].dtype == torch.float32
    assert not FILL_OPS & set(calls), calls
    assert len(cleared) == 1 and cleared[0] is not None and cleared[0].data_ptr() == back[7].data_ptr()
    assert dmix.data_ptr() == back[7].data_ptr() and dmix.dtype == mix.dtype
    assert ds.shape == s.shape and dz.data_ptr() == back[4].data_ptr()


def test_the_quadratic_forms_backward_has_its_query_launch_clear_dmix_not_a_fill(monkeypatch):
    """`parallel.parallel_grad` (the quadratic form's backward, DiT-XL/2 256 px and PixArt's short calls): two launches
    and no fill; dmix, which the key launch adds into, is the buffer the query launch gets and zeroes (KEYS=False:
    `_clear` from its first program), the one returned. The launches are recorded, not run (values, with dmix
    poisoned until the query launch runs: kernels_interp.py, "parallel form")."""
    from mhla_diffusion.blocks import resolve_blocks
    from mhla_diffusion.kernels import parallel

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launches = _record_launches(monkeypatch, ("_parallel_grad_kernel",))["_parallel_grad_kernel"]
    grid = (1, 16, 16)
    blocks = resolve_blocks(grid, "auto")
    q, k, v, do, o = (torch.randn(1, 256, 2, 72, dtype=torch.bfloat16) for _ in range(5))
    mix = locality_mix(blocks).float()
    rden = torch.rand(2, 256)
    got = []
    calls = _aten_calls(lambda: got.extend(parallel.parallel_grad(do, q, k, v, mix, o, rden, grid, blocks, elu=False,
                                                                   normalize=True)))
    assert not FILL_OPS & set(calls), calls
    assert [kwargs["KEYS"] for _, kwargs in launches] == [False, True]
    dmix = got[3]
    assert dmix.shape == mix.shape and dmix.dtype == torch.float32
    assert [args[10].data_ptr() for args, _ in launches] == [dmix.data_ptr()] * 2


def _aten_calls(fn) -> list:
    """The aten ops `fn` dispatches, by name (the autograd engine's own allocations included)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Recorder():
        fn()
    return Recorder.calls


@pytest.mark.parametrize("route", ["body", "custom op"])
@pytest.mark.parametrize(("m", "tokens", "kept"), [(6, 64, True), (64, 64, True), (65, 64, False), (65, 520, True)])
def test_the_backward_takes_the_forwards_mixed_summaries_and_no_zeros(route, m, tokens, kept, monkeypatch):
    """Through the output op with autograd, at up to CONFIG["mix"]["keep_up_to"] (64) blocks, or more where S~ is no
    larger than v (m D <= N: here D = 8, so 65 blocks over 520 tokens), the backward gets the S~ and z~ its forward
    mixed (`mhla.keeps_mixed`: one mixing launch fewer, 4-7 % of the f+b from DiT-XL/2 384 px to Wan2.1-14B 720p;
    kernels_interp.py, "mixing kernel in the op", counts them and checks the values); otherwise none, and mixes
    again. Neither those outputs nor the quadratic form's 1 / den are differentiated: autograd hands their backward
    None, not a zero-filled tensor of each (a fill launch a step). The launchers are recorded, not run; both ways
    autograd records the op (`op._call`)."""
    from mhla_diffusion.kernels import mhla, op, parallel

    seen = {}
    mixed = torch.randn(m, 4, 8, 8, dtype=torch.bfloat16), torch.rand(m, 4, 8)
    monkeypatch.setattr(mhla, "output_forward", lambda q, *a, **kw: (q * 1, tuple(t.clone() for t in mixed)))
    monkeypatch.setattr(mhla, "output_backward", lambda do, q, mix, s, z, *a, mixed, **kw: seen.update(mixed=mixed) or (
        torch.empty_like(q), torch.empty_like(mix), torch.empty_like(s), torch.empty_like(z)))
    monkeypatch.setattr(parallel, "parallel_output", lambda q, *a, **kw: (q * 1, torch.rand(q.shape[0] * 4, 64)))
    monkeypatch.setattr(parallel, "parallel_grad", lambda do, q, k, v, mix, *a, **kw: tuple(
        torch.empty_like(t) for t in (q, k, v, mix)))
    call = op._call if route == "body" else lambda fn, *args: fn(*args)
    q = torch.randn(2, tokens, 4, 8, dtype=torch.bfloat16, requires_grad=True)
    mix = torch.rand(m, m, requires_grad=True)
    s, z = mixed[0].detach().requires_grad_(), mixed[1].detach().requires_grad_()
    args = op.op_args(block_geometry((1, 1, tokens), (1, 1, 1)), MHLAOptions())
    o, mixed_s, mixed_z = call(op.mhla_output, q, mix, False, s, z, None, None, None, 0.0, None, 0.0, *args)
    assert [mixed_s.shape, mixed_z.shape] == [s.shape, z.shape]
    calls = _aten_calls(lambda: o.sum().backward())
    assert not FILL_OPS & set(calls), calls
    if kept:
        assert [t.data_ptr() for t in seen["mixed"]] == [mixed_s.data_ptr(), mixed_z.data_ptr()]
    else:
        assert seen["mixed"] is None
    o, rden = call(op.mhla_parallel, q, q, q, mix, False, *args)
    calls = _aten_calls(lambda: o.sum().backward())
    assert not FILL_OPS & set(calls), calls


@pytest.mark.parametrize("transposed", [False, True], ids=["mix", "mix^T"])
def test_mixing_takes_the_kernel_where_it_measured_faster_and_cublas_elsewhere(transposed, monkeypatch):
    """bf16 summaries at the block counts where the kernel beat cuBLAS on an H200 (a converted Wan's 180 and 252
    among them) take the kernel; at multiples of 8 over 32 blocks, over 256 blocks, and for fp32 summaries (fp16
    inputs' S, every z) at any count, cuBLAS: one GEMM on the summaries as they are, in TF32 for 16-bit inputs."""
    from torch.profiler import ProfilerActivity, profile

    from mhla_diffusion.kernels import mhla

    launches = _record_mix_launches(monkeypatch)
    seen, mm = [], torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: seen.append((b.dtype, b.shape[0],
                                                                torch.backends.cuda.matmul.allow_tf32)) or mm(a, b))
    cases = [(torch.bfloat16, torch.bfloat16, m) for m in (16, 30, 60, 121, 180, 252, 64, 120, 256, 300, 512)]
    cases += [(dtype, torch.float32, m) for dtype in (torch.float16, torch.bfloat16) for m in (16, 180, 252)]
    for dtype, state, m in cases:
        mix = torch.nn.Parameter(torch.rand(m, m))
        s = torch.randn(m, 2, 4, dtype=state)
        with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
            out = mhla.mix_blocks(mix.t() if transposed else mix, s, dtype)
        if state == torch.float32 or m > 256 or (m > 32 and m % 8 == 0):
            assert not {e.name for e in prof.events()} & {"aten::bmm", "aten::clone", "aten::contiguous"}
            ref = torch.einsum("ij,jbd->ibd", (mix.t() if transposed else mix).detach().double(), s.double())
            assert out.dtype == state and ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
    assert [(args[1].dtype, args[1].shape[0]) for args, _ in launches] == [(torch.bfloat16, m) for m in
                                                                           (16, 30, 60, 121, 180, 252)]
    assert seen == [(torch.bfloat16, m, True) for m in (64, 120, 256, 300, 512)] + [
        (torch.float32, m, True) for _ in (0, 1) for m in (16, 180, 252)]


def test_host_tile_arithmetic_is_plain_python_and_matches_tritons():
    """`kernels.sizes` gives what Triton's cdiv and next_power_of_2 give, for every size a launcher meets."""
    import triton

    from mhla_diffusion.kernels.sizes import cdiv, pow2

    assert all(pow2(n) == triton.next_power_of_2(n) for n in range(1, 5000))
    assert all(cdiv(a, b) == triton.cdiv(a, b) for a in range(0, 600) for b in (1, 2, 3, 16, 64, 100))


def test_an_op_call_calls_no_triton_helper_on_the_host(monkeypatch):
    """Through `mhla_attention(backend="triton")`, forward and backward on the linear path (DiT-XL/2 512 px's 1,024
    tokens, 30 blocks) and the no-grad quadratic form: the launchers' grids and tiles come from `kernels.sizes`, not
    from Triton's constexpr functions (cdiv, next_power_of_2 since Triton 3.4), which cost ~2 us a call from host code:
    a no-grad call made about twenty (its host time on this CPU with the launches left out: 178 -> 128 us). The
    kernels' launches are recorded, not run."""
    import triton.runtime.jit as jit

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the Triton backend takes CPU tensors
    launches = _record_launches(monkeypatch)
    helper_calls = []
    call = jit.ConstexprFunction.__call__
    monkeypatch.setattr(jit.ConstexprFunction, "__call__", lambda self, *a, **kw: helper_calls.append(self) or call(
        self, *a, **kw))
    mix = torch.nn.Parameter(locality_mix((1, 5, 6)).float())
    for side, grad in ((32, True), (32, False), (16, False)):
        q, k, v = (torch.randn(1, side * side, 2, 72, dtype=torch.bfloat16, requires_grad=grad) for _ in range(3))
        with torch.set_grad_enabled(grad):
            out = mhla_attention(q, k, v, mix, (1, side, side), (1, 5, 6), backend="triton")
        if grad:
            out.float().sum().backward()
    launched = {name for name, calls in launches.items() if calls}
    assert {"_summary_kernel", "_output_kernel", "_grad_kernel", "_mix_kernel", "_parallel_kernel"} <= launched
    assert helper_calls == []


@pytest.mark.parametrize(("dims", "rope", "normalize", "forward", "backward"), [
    ((72, 72), False, True, True, False),  # DiT's heads: Dv = 72 in a 128-wide tile; the backward's z is weighted
    ((24, 40), False, True, True, False),
    ((64, 64), False, True, False, False),  # no padding column
    ((72, 72), True, True, False, False),  # z sums unrotated features, the product rotated ones
    ((72, 72), False, False, False, False),  # unnormalized: no z
], ids=["72", "24x40", "64", "72 rope", "72 unnormalized"])
def test_the_forward_summaries_take_z_from_the_products_padding_column(dims, rope, normalize, forward, backward,
                                                                       monkeypatch):
    """Through `mhla_attention(backend="triton")`, forward and backward: the summary launch takes z out of its product
    (Z_IN_DOT: y loaded with ones past Dv) exactly where that is z, a forward's unweighted sum of unrotated features
    with a padding column to hold it; elsewhere the per-token z tile. The launches are recorded, not run (values:
    kernels_interp.py, "stages" and the D=136 / Dv=72 op case). The backward's summaries get a launch of their own
    here as in blocks over one token tile (`mhla.summarizes`)."""
    from mhla_diffusion.kernels import mhla

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(mhla.CONFIG["grad"], "summarize_up_to", 0)
    launches = _record_launches(monkeypatch)
    d, dv = dims
    grid, blocks = (1, 6, 8), (1, 2, 2)
    q, k = (torch.randn(1, 48, 2, d, requires_grad=True) for _ in range(2))
    v = torch.randn(1, 48, 2, dv, requires_grad=True)
    tables = (torch.ones(1, 48, 1, d), torch.zeros(1, 48, 1, d)) if rope else None
    out = mhla_attention(q, k, v, locality_mix(blocks).float(), grid, blocks, rope=tables, normalize=normalize,
                         backend="triton")
    out.sum().backward()
    assert [kwargs["Z_IN_DOT"] for _, kwargs in launches["_summary_kernel"]] == [forward, backward]


def _recorded_square_call(monkeypatch, side: int, heads: int, d: int, backward: bool, rope: bool = False) -> dict:
    """The kernel launches (`_record_launches`, none run) of one bf16 `mhla_attention(backend="triton")` call with
    gradients over a (1, side, side) grid in its 'auto' blocks (with RoPE tables where `rope`), and of its backward
    where `backward`."""
    from mhla_diffusion.blocks import resolve_blocks

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launches = _record_launches(monkeypatch)
    q, k, v = (torch.randn(1, side * side, heads, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grid = (1, side, side)
    blocks = resolve_blocks(grid, "auto")
    tables = (torch.ones(1, side * side, 1, d), torch.zeros(1, side * side, 1, d)) if rope else None
    out = mhla_attention(q, k, v, locality_mix(blocks).float(), grid, blocks, rope=tables, backend="triton")
    if backward:
        out.float().sum().backward()
    return launches


@pytest.mark.parametrize(("heads", "d", "side", "warps"), [
    (16, 72, 32, 8),  # DiT-XL/2 512 px: 30 blocks of up to 42 tokens, a 128 x 128 D x Dv tile
    (70, 32, 32, 2),  # SANA-1.6B 1K: 32 x 32, on the narrow heads' warps
    (16, 72, 64, 8),  # DiT-XL/2 1024 px: 64 blocks of 64 tokens
    (16, 72, 96, None),  # 1536 px: 90 blocks of up to 110 tokens, over one token tile
], ids=["dit 512", "sana 1k", "dit 1024", "dit 1536"])
def test_the_q_side_grad_launch_makes_the_summaries_of_do_where_each_block_is_one_token_tile(heads, d, side, warps,
                                                                                             monkeypatch):
    """Through `mhla_attention(backend="triton")`, bf16, forward and backward: where every block fits one 64-token
    tile, the q-side grad launch also makes dS~ and dz~ (SUMMARIZE), so the backward runs no summary launch of its own
    (one launch and one read of q and dO fewer: H100, f+b 4-6 % lower at DiT-XL/2 384-1024 px and SANA-1.6B 1K), on
    8 warps for DiT's 128 x 128 D x Dv tile (4 spilled it and ran 1.3-1.5x slower) and 2 for SANA's 32 x 32
    (`CONFIG["grad"]["narrow_warps"]`; 4: f+b 5 % slower, 8: 1.34x); longer blocks keep the launch of their own. The
    launches are recorded, not run (values: kernels_interp.py, "stages" and "mixing kernel in the op"; `bench op
    --check` on the GPU)."""
    from mhla_diffusion.kernels import mhla

    launches = _recorded_square_call(monkeypatch, side, heads, d, backward=True)
    q_side, kv_side = launches["_grad_kernel"]
    assert [q_side[1]["SUMMARIZE"], kv_side[1]["SUMMARIZE"]] == [warps is not None, False]
    assert q_side[1]["num_warps"] == (warps or mhla.CONFIG["grad"]["num_warps"])
    assert len(launches["_summary_kernel"]) == (1 if warps else 2)


@pytest.mark.parametrize(("side", "block_n"), [(24, 32), (32, 64)], ids=["384 px", "512 px"])
def test_the_output_launch_puts_blocks_of_up_to_32_tokens_on_32_token_tiles(side, block_n, monkeypatch):
    """Through `mhla_attention(backend="triton")` with gradients (the linear path), bf16, DiT's heads: DiT-XL/2 384 px's
    blocks of up to 30 tokens take 32-token output tiles (H100: f+b 3 % lower than on 64), 512 px's of up to 42 keep 64
    (32 cost its forward 11 %). The launches are recorded, not run."""
    launches = _recorded_square_call(monkeypatch, side, 16, 72, backward=False)
    assert [kwargs["BLOCK_N"] for _, kwargs in launches["_output_kernel"]] == [block_n]


@pytest.mark.parametrize(("side", "d", "warps"), [
    (128, 32, (2, 2, 2)),  # SANA-1.6B 4K: 121-144-token blocks
    (32, 32, (2, 2, 2)),  # SANA-1.6B 1K: blocks of up to 42 tokens
    (128, 64, (4, 4, 4)),  # DiT-S/2's 64-wide heads: the grad launches keep CONFIG's 4
    (128, 128, (8, 4, 4)),  # Wan's and DiT's 128-wide tiles: CONFIG's
], ids=["sana 4k, d32", "sana 1k, d32", "d64", "d128"])
def test_narrow_heads_take_the_token_launches_on_fewer_warps(side, d, warps, monkeypatch):
    """Through `mhla_attention(backend="triton")`, bf16, forward and backward: the summary, output and grad launches of
    a head tile narrower than 128 run on `CONFIG[...]["narrow_warps"]`, over long blocks and short (H100: SANA-1.6B 4K
    f+b 0.789 -> 0.642 ms, 1K 0.0791 -> 0.0705; DiT-S/2 4096 px's summary and output on 4 warps 0.426 -> 0.389, its
    grad launches on 2 slower), while 128-wide tiles keep their settings. The launches are recorded, not run."""
    launches = _recorded_square_call(monkeypatch, side, 2, d, backward=True)
    used = [{kwargs["num_warps"] for _, kwargs in launches[name]}
            for name in ("_summary_kernel", "_output_kernel", "_grad_kernel")]
    assert used == [{w} for w in warps]


@pytest.mark.parametrize(("side", "d", "hint", "mixes"), [
    (128, 128, True, {"evict_last"}),
    (64, 72, True, set()),  # 64 blocks: cuBLAS mixes them (`mixes_with_kernel`)
    (32, 72, False, {"evict_last"}),
], ids=["144-token blocks", "64-token blocks", "42-token blocks"])
def test_the_forward_launches_keep_the_summaries_in_l2_and_stream_the_tokens_past_it(side, d, hint, mixes,
                                                                                      monkeypatch):
    """Through `mhla_attention(backend="triton")`, bf16: the summary and mixing launches store S and S~ with L2
    priority evict_last, so that the next launch reads them from L2 while q, k and v stream through, and the output
    launch loads q and stores o evict_first (H100: Wan2.1-1.3B 480p forward / f+b 0.7 / 2.2 % lower, with the output
    launch on 4 warps 2.0 / 1.8 %); blocks of up to `mhla.SHORTEST_BLOCK` tokens (DiT-XL/2 512 px: forward 2 % slower
    with them) take neither. The launches are recorded, not run."""
    launches = _recorded_square_call(monkeypatch, side, 2, d, backward=False)
    assert [kwargs["KEEP"] for _, kwargs in launches["_summary_kernel"]] == ["evict_last" if hint else ""]
    assert [kwargs["STREAM"] for _, kwargs in launches["_output_kernel"]] == ["evict_first" if hint else ""]
    assert {kwargs["KEEP"] for _, kwargs in launches["_mix_kernel"]} == mixes


@pytest.mark.parametrize(("side", "rope", "prefetch"), [(128, False, True), (64, False, True), (128, True, False)],
                         ids=["144-token blocks", "64-token blocks", "144-token blocks, rope"])
def test_the_output_launch_loads_q_a_tile_ahead_without_rope(side, rope, prefetch, monkeypatch):
    """Through `mhla_attention(backend="triton")`, bf16: without RoPE the output launch issues the next q tile's loads
    before this tile's product, and the first tile's before it waits for the mixing launch (H100: forward Wan2.1-1.3B
    480p 0.217 -> 0.201 ms, Wan2.1-14B 720p 1.389 -> 1.305; DiT-XL/2 384 px between a layer's projections 0.84-0.87x);
    RoPE's launch (190 registers with it: Wan as used 1.10x) does not. Recorded, not run (values: kernels_interp.py,
    "output prefetch"; the wait: `test_every_kernel_launched_dependent_waits_before_it_touches_memory`)."""
    launches = _recorded_square_call(monkeypatch, side, 2, 128, backward=False, rope=rope)
    assert [kwargs["PREFETCH"] for _, kwargs in launches["_output_kernel"]] == [prefetch]


@pytest.mark.parametrize(("heads", "splits"), [(8, 1), (4, 2)], ids=["720 programs", "360 programs"])
def test_the_output_launch_splits_blocks_only_under_512_programs(heads, splits, monkeypatch):
    """Through `mhla_attention(backend="triton")`, bf16: 90 blocks of up to 110 tokens (two 64-token tiles) on 8 heads
    are 720 programs, one a block (`CONFIG["output"]["programs"]`: 512); on 4 heads, 360, the blocks split in two.
    H100, Wan2.1-1.3B 480p in (3, 4, 5) blocks (720 programs), one a block against two: forward 2 % lower in six runs.
    The launches are recorded, not run."""
    launches = _recorded_square_call(monkeypatch, 96, heads, 16, backward=False)
    assert [kwargs["grid"] for _, kwargs in launches["_output_kernel"]] == [(heads, 90, splits)]


@pytest.mark.parametrize(("side", "heads", "d", "stages"), [(64, 16, 72, 3), (128, 4, 32, 4)],
                         ids=["dit 1024 px, 64-token blocks", "sana 4k, 144-token blocks"])
def test_the_summary_launch_pipelines_deeper_over_short_blocks(side, heads, d, stages, monkeypatch):
    """Through `mhla_attention(backend="triton")`, bf16: blocks over `mhla.SHORT_BLOCK` tokens (SANA-1.6B 4K's, Wan's)
    take the summaries on 4 pipeline stages (H100: Wan2.1-14B 720p forward 3 % lower), shorter ones keep 3 (DiT-XL/2
    1024 px: 4 were 2.3 % slower). The launches are recorded, not run."""
    launches = _recorded_square_call(monkeypatch, side, heads, d, backward=False)
    assert [kwargs["num_stages"] for _, kwargs in launches["_summary_kernel"]] == [stages]


@pytest.mark.parametrize(("dims", "width", "align"), [
    ((72, 72), None, 8),  # DiT's and PixArt's heads: head stride 72, 16-byte rows the JIT cannot see
    ((128, 128), None, 16),  # Wan's: the JIT's own mark
    ((64, 40), None, 8),  # v's and o's head stride, 40, decides
    ((64, 64), 192, 16),  # q, k, v slices of one fused projection
    ((40, 40), 124, 4),  # slices of rows of 124 features
], ids=["72", "128", "64x40", "fused", "124-wide rows"])
def test_every_token_launch_marks_the_head_offset_as_aligned_as_all_its_tensors_are(dims, width, align, monkeypatch):
    """Through `mhla_attention(backend="triton")`, forward and backward, linear path (fp32) and quadratic form (bf16,
    short grids): each token-kernel launch passes HEAD_ALIGN, the largest power of two up to 16 that divides the head
    stride of every tensor it reads or writes (`_head` marks the head offset a multiple of it: DiT's 72 left every
    token load scalar, kernels/NOTES.md session 39; a larger mark than the strides allow would load misaligned
    rows). The launches are recorded, not run."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launches = _record_launches(monkeypatch)
    d, dv = dims
    for dtype, side in ((torch.float32, 8), (torch.bfloat16, 8)):
        n = side * side
        if width:
            rows = torch.randn(1, n, 2, width, dtype=dtype, requires_grad=True)
            q, k, v = rows[..., :d], rows[..., d:2 * d], rows[..., width - dv:]
        else:
            q, k = (torch.randn(1, n, 2, d, dtype=dtype, requires_grad=True) for _ in range(2))
            v = torch.randn(1, n, 2, dv, dtype=dtype, requires_grad=True)
        out = mhla_attention(q, k, v, locality_mix((1, 2, 2)).float(), (1, side, side), (1, 2, 2), backend="triton")
        out.float().sum().backward()
    assert all(launches[name] for name in TOKEN_KERNEL_NAMES), {name: len(calls) for name, calls in launches.items()}
    marks = {kwargs.get("HEAD_ALIGN") for name in TOKEN_KERNEL_NAMES for _, kwargs in launches[name]}
    assert marks == {align}, marks


def test_short_calls_take_the_quadratic_form_and_everything_else_the_linear_path(monkeypatch):
    """Through `mhla_attention(backend="triton")`: bf16 calls over a whole grid of up to `parallel.CONFIG["max_tokens"]`
    tokens without gradients in a CUDA graph's capture (256; `"max_tokens_eager"`, 1024, run as called;
    `"max_tokens_with_grad"`, 256, with gradients) take the quadratic op; with RoPE, for fp32 inputs and past those
    lengths, the linear path. Calls are recorded, not run (values: kernels_interp.py, "parallel form", and `bench op
    --check` for bf16); the capture is what torch.cuda answers during one."""
    from mhla_diffusion.kernels import op, parallel

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    taken = []

    def parallel_op(q, *args):
        taken.append("parallel")
        return q, None

    parallel_op.body = parallel_op  # what `op._call` runs eagerly, recorded by autograd with these where it records
    parallel_op.autograd = (lambda ctx, inputs, output: None, lambda ctx, *grads: ())
    monkeypatch.setattr(op, "mhla_parallel", parallel_op)
    monkeypatch.setattr(op, "mhla_linear", lambda q, *args: taken.append("linear") or q)
    blocks = (1, 5, 6)
    mix = torch.nn.Parameter(locality_mix(blocks).float())

    def call(side, dtype=torch.bfloat16, grad=False, rope=False):
        grid = (1, side, side)
        q, k, v = (torch.randn(1, side * side, 2, 16, dtype=dtype, requires_grad=True) for _ in range(3))
        angle = torch.zeros(1, side * side, 1, 16)
        with torch.set_grad_enabled(grad):
            mhla_attention(q, k, v, mix, grid, blocks, rope=(angle.cos(), angle.sin()) if rope else None,
                           backend="triton")
        return taken.pop()

    capturing = []
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: bool(capturing)))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: bool(capturing))
    for grad, captured, limit in ((False, True, parallel.CONFIG["max_tokens"]),
                                  (False, False, parallel.CONFIG["max_tokens_eager"]),
                                  (True, False, parallel.CONFIG["max_tokens_with_grad"])):
        capturing[:] = [True] if captured else []
        side = math.isqrt(limit)  # the longest square grid at the limit
        assert call(side, grad=grad) == "parallel"
        assert [call(side, grad=grad, rope=True), call(side, dtype=torch.float32, grad=grad)] == ["linear"] * 2
        assert call(side + 1, grad=grad) == "linear"


def test_fp32_inputs_mix_in_plain_fp32_whatever_the_global_tf32_flag(monkeypatch):
    """fp32 inputs mix through cuBLAS with TF32 off for the call, also where a recipe turned TF32 on for the process;
    the flag is restored after, and the mixing kernel is not launched."""
    from mhla_diffusion.kernels import mhla

    seen, mm = [], torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: seen.append(torch.backends.cuda.matmul.allow_tf32) or mm(a, b))
    monkeypatch.setattr(mhla, "_mix_kernel", None)  # indexing it for a launch would raise
    mix = torch.nn.Parameter(torch.rand(6, 6))
    s = torch.randn(6, 4, 8, 8)
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        out = mhla.mix_blocks(mix.t(), s, torch.float32)
        assert seen == [False] and torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    torch.testing.assert_close(out, torch.einsum("ij,jbde->ibde", mix.detach().t(), s))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("made_once", [False, True], ids=["tuple", "RoPETables"])
def test_rope_tables_reach_the_kernels_in_bf16_for_bf16_inputs(dtype, made_once, monkeypatch):
    """bf16 inputs: fp32 RoPE tables are rounded to bf16 (half the table bytes in every token tile), once per call, or
    once for every call given the same `RoPETables` (a converted model's layers in one forward); fp16 and fp32 inputs
    keep them as given."""
    from mhla_diffusion.kernels import op
    from mhla_diffusion.ops.rope import RoPETables

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    seen = []

    def fake_linear(q, k, v, mix, cos, sin, *args):
        seen.append((cos, sin))
        return torch.zeros_like(v)

    monkeypatch.setattr(op, "mhla_linear", fake_linear)
    q = torch.randn(1, 512, 2, 8).to(dtype)
    angle = torch.rand(1, 512, 1, 8)
    tables = (angle.cos(), angle.sin())
    rope = RoPETables(tables) if made_once else tables
    for _ in range(2):
        op.mhla_attention_triton(q, q, q, locality_mix((1, 2, 2)).float(),
                                 block_geometry((1, 16, 32), (1, 2, 2)), MHLAOptions(), rope=rope)
    expected = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    assert [t.dtype for t in seen[0]] == [expected, expected]
    assert all(torch.equal(a, b.to(expected)) for a, b in zip(seen[0], tables))
    if dtype == torch.bfloat16:  # the rounded copies: made again each call from a plain tuple, once from RoPETables
        assert (seen[1][0] is seen[0][0]) == made_once


@pytest.mark.parametrize(("grid", "blocks", "names"), [
    ((1, 16, 16), "auto", ["parallel", "parallel_grad_queries", "parallel_grad_keys"]),
    ((1, 32, 32), "auto", ["summaries", "mix_short", "output", "grad_queries", "mix_back", "grad_keys"]),
    ((1, 32, 32), (1, 2, 2), ["summaries", "mix", "output", "grad_queries", "summaries", "mix_back", "grad_keys"]),
], ids=["quadratic form, 256 tokens", "linear path, 1024 tokens", "linear path, blocks of 256 tokens"])
def test_each_launch_of_the_op_names_itself_so_that_triggers_can_be_set_per_launch(grid, blocks, names, monkeypatch):
    """`compiled.CONFIG["trigger_dependents"]` names the launches that let the next one start early: the op's
    forward+backward through `mhla_attention` (bf16, DiT's heads: the quadratic form at 256 tokens, the linear path's
    six launches at 1,024) hands `compiled.launch` each of its launches' names, in order, all of `compiled.LAUNCHES`;
    the forward's mixing launch is "mix_short" over blocks of at most `mhla.SHORT_BLOCK` tokens (30 blocks of at most
    42 here), "mix" over longer ones (4 blocks of 256, whose dO summaries are a launch of their own); a setting naming
    anything else is refused. The kernels are recorders (nothing runs)."""
    from mhla_diffusion.blocks import resolve_blocks
    from mhla_diffusion.kernels import compiled
    from mhla_diffusion.kernels.overrides import parse

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _record_launches(monkeypatch)
    named, launch = [], compiled.launch
    monkeypatch.setattr(compiled, "launch", lambda kernel, grid, *a, name="", **kw: named.append(name) or launch(
        kernel, grid, *a, **kw))
    blocks = resolve_blocks(grid, blocks)
    q, k, v = (torch.randn(1, math.prod(grid), 16, 72, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    mix = locality_mix(blocks).requires_grad_()
    mhla_attention(q, k, v, mix, grid, blocks, backend="triton").sum().backward()
    assert named == names and set(names) <= set(compiled.LAUNCHES)
    assert parse("compiled.CONFIG.trigger_dependents=('mix_back', 'grad_queries')")[2] == ("mix_back", "grad_queries")
    with pytest.raises(ValueError, match="names kernels of"):
        parse("compiled.CONFIG.trigger_dependents=('mix_backward',)")


EARLY_FLAGS = ("EARLY_X", "EARLY_Y", "EARLY_MAT")


@pytest.mark.parametrize(("blocks", "settings", "run", "early"), [
    ("auto", [], "eager", {"grad_queries": {"EARLY_X", "EARLY_MAT"}, "grad_keys": {"EARLY_X", "EARLY_Y"}}),
    ("auto", [], "torch.compile", {}),
    ("auto", [], "saved-tensor hooks", {}),
    ((1, 2, 2), [], "eager", {"grad_queries": {"EARLY_X", "EARLY_MAT"}, "grad_keys": {"EARLY_X", "EARLY_Y"}}),
    ((1, 2, 2), ["mhla.CONFIG.mix.keep_up_to=0", "mhla.CONFIG.mix.keep_within_v=False"], "eager",
     {"grad_queries": {"EARLY_X"}, "grad_keys": {"EARLY_X", "EARLY_Y"}}),
    ((1, 2, 2), ["mhla.CONFIG.grad.programs=16"], "eager", {}),
], ids=["eager, 42-token blocks", "torch.compile", "saved-tensor hooks", "eager, 256-token blocks, one tile a grad "
        "program", "eager, S~ mixed again in the backward", "eager, 4 tiles a grad program"])
def test_launches_read_inputs_before_they_wait_only_where_the_launch_ahead_did_not_write_them(
        blocks, settings, run, early, monkeypatch):
    """Under PDL a launch starts once the launch ahead of it has passed its own wait, so what was complete before that
    launch started may be read early. The op's forward+backward through `mhla_attention` (bf16, DiT's heads, 1,024
    tokens; the kernels are recorders, nothing runs) hands the grad launches the EARLY flags of the inputs they may
    so read, and no others:
    - eager, where each grad program walks one token tile: the q-side launch q, and S~ and z~ where the forward kept
      them (not where the backward mixes them again, `mhla.keeps_mixed`: the launch just ahead makes them then), not
      dO (the launch just ahead makes it); the k-side one k and v, not dS and dz (the mix^T launch just ahead makes
      them);
    - under torch.compile, whose launches inductor orders (it may recompute q or k just ahead), none;
    - under saved-tensor hooks (offloading, compression, non-reentrant checkpointing: their unpacking may remake what
      the op saved by the launch just ahead), none;
    - where each grad program walks several tiles, none.
    `CONFIG["grad"]["early"]` off, none either."""
    from mhla_diffusion.blocks import resolve_blocks
    from mhla_diffusion.kernels import compiled
    from mhla_diffusion.kernels.overrides import overridden

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _record_launches(monkeypatch)
    seen, launch = [], compiled.launch
    monkeypatch.setattr(compiled, "launch", lambda kernel, grid, *a, name="", **kw: seen.append(
        (name, {flag for flag in EARLY_FLAGS if kw.get(flag)})) or launch(kernel, grid, *a, **kw))
    grid = (1, 32, 32)
    blocks = resolve_blocks(grid, blocks)
    q, k, v = (torch.randn(1, math.prod(grid), 16, 72, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    mix = locality_mix(blocks).requires_grad_()

    def step(q, k, v, mix):
        mhla_attention(q, k, v, mix, grid, blocks, backend="triton").sum().backward()

    torch._dynamo.reset()
    hooks = torch.autograd.graph.saved_tensors_hooks(torch.clone, torch.clone)
    with overridden(settings), hooks if run == "saved-tensor hooks" else contextlib.nullcontext():
        (torch.compile(step, backend="aot_eager") if run == "torch.compile" else step)(q, k, v, mix)
    assert [(name, flags) for name, flags in seen if flags] == list(early.items())  # in launch order
    assert len(seen) >= 6
    seen.clear()
    with overridden(["mhla.CONFIG.grad.early=False"]):
        step(q, k, v, mix)
    assert seen and not any(flags for _, flags in seen)


@pytest.mark.parametrize(("dtype", "side", "blocks", "grad", "reader", "in_kernel"), [
    (torch.bfloat16, 32, "auto", False, "_parallel_kernel", True),  # 1,024 tokens, eager: the quadratic form
    (torch.bfloat16, 32, "auto", True, "_mix_kernel", True),  # with gradients the linear path, 30 blocks
    (torch.bfloat16, 48, "auto", False, "_mix_kernel", True),  # 2,304 tokens, 48 blocks
    (torch.bfloat16, 36, (1, 9, 9), False, "_mix_kernel", False),  # 81 blocks: mix padded, past the folded launch
    (torch.float32, 32, "auto", True, None, False),  # fp32 summaries: cuBLAS mixes
], ids=["quadratic form", "linear path", "48 blocks", "81 blocks", "fp32"])
def test_the_kernels_softmax_the_mixing_logits_where_they_read_the_matrix(dtype, side, blocks, grad, reader, in_kernel,
                                                                        monkeypatch):
    """`mhla_attention(..., mix_logits=True)` (what a converted layer passes where its matrix is made each call:
    with gradients, and under torch.compile): where a launch reads mix as it is (the quadratic form; the mixing
    launch up to CONFIG["mix"]["fold_up_to"] blocks, bf16) it gets the logits themselves and softmaxes each row as
    it loads it (SOFTMAX), and no softmax runs before it; elsewhere PyTorch's softmax makes the matrix first, once.
    The backward takes the matrix softmaxed once and returns the logits' gradient through one softmax backward.
    The kernels are recorders (nothing runs; values: kernels_interp.py, "mixing kernel", "mixing kernel in the op",
    "parallel form")."""
    from mhla_diffusion.blocks import resolve_blocks

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launches = _record_launches(monkeypatch)
    grid = (1, side, side)
    blocks = resolve_blocks(grid, blocks)
    q, k, v = (torch.randn(1, side * side, 4, 16, dtype=dtype, requires_grad=grad) for _ in range(3))
    logits = torch.randn(math.prod(blocks), math.prod(blocks), requires_grad=grad)
    out = []
    with torch.set_grad_enabled(grad):
        forward = _aten_calls(lambda: out.append(mhla_attention(q, k, v, logits, grid, blocks, backend="triton",
                                                                mix_logits=True)))
    assert forward.count("_softmax") == (0 if in_kernel else 1), forward
    if reader is not None:  # the launch that reads mix: the forward's first of that kernel
        args, kwargs = launches[reader][0]
        given = args[3 if reader == "_parallel_kernel" else 0]
        assert kwargs["SOFTMAX"] == in_kernel and (given.data_ptr() == logits.data_ptr()) == in_kernel
    if grad:
        backward = _aten_calls(lambda: out[0].float().sum().backward())
        assert (backward.count("_softmax"), backward.count("_softmax_backward_data")) == (1, 1), backward
        assert not any(kw["SOFTMAX"] for _, kw in launches["_mix_kernel"][1:])
        assert logits.grad.shape == logits.shape
