"""Launches of a JIT kernel that go straight to the kernel it compiled, after the first of their kind.

Why: `kernel[grid](*args)` makes Triton's JIT bind and specialize every argument (~25-45 of them here) and build its
cache key on each call before it launches: at DiT and SANA sizes, where the op's GPU time is 20-30 us, eager calls are
host-bound (kernels/NOTES.md, session 40). `launch` keeps the compiled kernel per launch key and starts it through
`CompiledKernel[grid]`, Triton's own launcher for a kernel it compiled. Measured (H100, torch 2.11, session 41, eager
`mhla_attention`, medians of 6 rounds): 2-6 % of a call, e.g. DiT-XL/2 512 px forward+backward 2263 -> 2149 us; the
binding is a smaller share of the host time than session 40's profile suggested.

The key holds what Triton specializes a kernel on: each tensor's dtype and whether its address is 16-byte aligned,
every other argument's type and value (ints as they are, so whatever Triton reads of them, divisibility by 16 or being
1, is in it), the launch options, and the current device. A launch whose key was not seen yet takes the JIT, which
compiles, checks and launches as ever; so does every launch of an interpreted kernel (TRITON_INTERPRET=1), a kernel
with pre-run hooks, and every launch inside `through_jit`.
"""

from __future__ import annotations

import contextlib

import torch
from triton.runtime.jit import JITFunction

# "dependent_launch": kernels with a PDL parameter (each waits for its inputs first, `mhla._await_inputs`) launch as
# programmatic dependent launches on cards that have them (sm_90 on): the launch overlaps the tail of the kernel
# before it, where a short sequence's op is a chain of small kernels. H100, session 45 (`bench op --versus`, CUDA-graph
# replay, off -> on, ms): forward DiT-XL/2 512 px 0.0205 -> 0.0198, SANA-1.6B 1K 0.0260 -> 0.0247, DiT-XL/2 256 px
# (one launch) 0.00829 -> 0.00802; forward+backward 0-3 % lower. "trigger_dependents": the launches (`LAUNCHES`) whose
# kernel also lets the next launch start once all its programs have passed their wait, not once they exit (PDL=2):
# the next one's programs then sit on SM slots while this one runs. H100, session 55 (`bench op --versus`, f+b, on /
# off): the backward's q-side gradient and mix^T launches 0.979x at DiT-XL/2 384 px, 0.989x at 512 px, 0.982x at
# SANA-1.6B 1K, 1.000x at 256 px (the quadratic form); the summaries' trigger 1.02-1.12x slower in the forward, the
# mixing launch's 1.056x at 384 px, the quadratic form's query launch's 1.11x f+b at 256 px. The output launch's
# trigger (forward 0.98x) only lets the benchmark's next replay start early: in a model a GEMM follows it. H100,
# session 58, the forward mixing launch's trigger between a layer's projections (`bench op --in-layer --versus`, 5
# rounds, fwd / f+b): DiT-XL/2 384 px 0.958 / 0.988, 512 px 0.959 / 1.000 (another call: 0.940 / 0.981), 1024 px 0.988
# / 1.004, SANA-1.6B 1K 0.925 / 1.010; replayed alone, Wan2.1-1.3B 480p (60 blocks of 546 tokens) 1.039 / 1.002,
# SANA-1.6B 4K and Wan2.1-14B 720p level: it triggers at short blocks only ("mix_short").
CONFIG = {"dependent_launch": True, "trigger_dependents": ("grad_queries", "mix_back", "mix_short")}
# The op's launches by name (`launch`'s `name`): the linear path's forward (summaries, mixing, output; the mixing
# launch of a call on mhla.SHORT_CONFIG's settings, blocks of at most mhla.SHORT_BLOCK tokens, is "mix_short") and
# backward (the q-side gradients, the mix^T launch that also forms dmix, at up to 64 blocks: past that its products
# launch as "mix"; the k/v-side gradients), and the quadratic form's forward and two backward launches.
LAUNCHES = ("summaries", "mix", "mix_short", "output", "grad_queries", "mix_back", "grad_keys", "parallel",
            "parallel_grad_queries", "parallel_grad_keys")
# (kernel, current device, the arguments' keys) -> (compiled kernel, the parameters after the positional arguments,
# each with its default)
_COMPILED: dict = {}
_direct = True  # off inside `through_jit`
_HOPPER_ON: dict = {}  # device index -> whether its card has programmatic dependent launch (NVIDIA sm_90 on)
_WAITS: dict = {}  # kernel -> whether it has the PDL parameter (waits for its inputs first)


def _dependent(kernel, device: int, name: str) -> int:
    """`kernel`'s PDL on `device` as launch `name` (`CONFIG`, `mhla._await_inputs`): 0, a plain launch; 1, a
    programmatic dependent launch; 2, one that also lets the next launch start early."""
    if not CONFIG["dependent_launch"]:
        return 0
    if kernel not in _WAITS:
        _WAITS[kernel] = isinstance(kernel, JITFunction) and "PDL" in kernel.arg_names
    if not _WAITS[kernel]:
        return 0
    if device not in _HOPPER_ON:
        _HOPPER_ON[device] = torch.version.hip is None and torch.cuda.get_device_capability(device) >= (9, 0)
    return _HOPPER_ON[device] * (1 + (name in CONFIG["trigger_dependents"]))


def launch(kernel, grid: tuple, *args, name: str = "", **kwargs) -> None:
    """`kernel[grid](*args, **kwargs)` (a grid of one to three ints): on a launch key seen before, the compiled
    kernel's own launcher with the arguments in the kernel's parameter order (defaults where a parameter is not given);
    the JIT's otherwise. Programmatic dependent where `_dependent` says; `name`: which of `LAUNCHES` this is."""
    device = torch.cuda.current_device() if isinstance(kernel, JITFunction) else None  # none interpreted
    pdl = _dependent(kernel, device, name)
    if pdl:
        kwargs.update(PDL=pdl, launch_pdl=True)
    if not (_direct and device is not None) or kernel.pre_run_hooks:
        kernel[grid](*args, **kwargs)
        return
    # one comprehension, not a function per argument: the key of a DiT launch (23 arguments, 20 keywords) took 11.0 ->
    # 5.9 us to build and look up (this CPU machine, torch 2.14)
    key = (kernel, device,
           *[(a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else (a.__class__, a) for a in args],
           *kwargs.items(), *map(type, kwargs.values()))
    known = _COMPILED.get(key)
    if known is None:
        compiled = kernel[grid](*args, **kwargs)
        params = list(kernel.signature.parameters.values())[len(args):]
        _COMPILED[key] = compiled, [(p.name, p.default) for p in params]
        return
    compiled, rest = known
    compiled[(*grid, 1, 1)[:3]](*args, *[kwargs.get(name, default) for name, default in rest])


@contextlib.contextmanager
def through_jit():
    """Every launch through the JIT, as `kernel[grid](...)` does: for a check or A/B of `launch` itself."""
    global _direct
    _direct = False
    try:
        yield
    finally:
        _direct = True
