"""RoPE tables as the fused kernels read them, and as a model hands them to its layers once a forward.

A Wan model makes its fp32 (cos, sin) once a forward and every layer passes them to the op; the kernels read them
rounded to bf16 for bf16 inputs. `RoPETables` carries the tables from where the model makes them
(`Family.rope_module`, hooked at conversion) and rounds them once, for every MHLA layer of that forward.
"""

from __future__ import annotations

import torch


def kernel_table(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A RoPE table as the kernels read it: rounded to bf16 for bf16 inputs, whose rotated features are rounded to
    bf16 before every product anyway. Half the table bytes per token tile: H200, op as Wan uses it (RoPE,
    unnormalized), fp32 -> bf16 tables, fwd 0.243 -> 0.201 ms (plain op 0.210) at Wan 1.3B 480p and 1.526 -> 1.24
    (plain 1.263) at 14B 720p, f+b 1.05 -> 0.93 and 6.57 -> 5.71; output error vs fp64 4.0e-3 -> 4.4e-3. The
    rounding itself moves 50 MB at 480p (21 us on an H100, session 52), which is why `RoPETables` does it once."""
    t = t.detach()
    return t.to(torch.bfloat16) if dtype == torch.bfloat16 and t.dtype == torch.float32 else t


def _kernel_pair(rope, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of `rope` as the kernels read them (`kernel_table`)."""
    return kernel_table(rope[0], dtype), kernel_table(rope[1], dtype)


class RoPETables(tuple):
    """(cos, sin) as a model's rotary embedding made them: layers unpack it as before (an unconverted layer's
    processor gets the very same tensors), and `for_kernels` gives each MHLA layer the tables as the kernels read
    them (`kernel_table`), made on the first layer's call and kept for the rest of the forward."""

    def __new__(cls, tables):
        cos, sin = tables
        return super().__new__(cls, (cos, sin))

    def for_kernels(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        made = self.__dict__.setdefault("_for_kernels", {})
        if dtype not in made:
            made[dtype] = _kernel_pair(self, dtype)
        return made[dtype]


def kernel_tables(rope, dtype: torch.dtype):
    """(cos, sin) as the kernels read them (`kernel_table`; once a forward for `RoPETables`), or (None, None)."""
    if rope is None:
        return None, None
    if isinstance(rope, RoPETables) and not torch.compiler.is_compiling():  # a traced call rounds as it always did
        return rope.for_kernels(dtype)
    return _kernel_pair(rope, dtype)


def share_rope_tables(module, args, output):
    """Forward hook on a model's rotary embedding (`Family.rope_module`): its (cos, sin) as `RoPETables`. A
    module-level function, so a deepcopy or an unpickled copy keeps it. Traced forwards (torch.compile) keep the
    plain tuple, and so does anything else: the op then rounds the tables itself, as before."""
    if torch.compiler.is_compiling() or not isinstance(output, tuple) or len(output) != 2:
        return None
    return RoPETables(output)
