"""Host-side tile arithmetic in plain Python.

Why: Triton's `cdiv` and `next_power_of_2` are constexpr functions (Triton 3.4 on): called from host code each one
unwraps its arguments as the JIT would, about 2 us a call on this project's CPU machine against 0.03 for the
arithmetic, and one no-grad call of the op made about twenty of them.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive b."""
    return -(-a // b)


def pow2(n: int) -> int:
    """The smallest power of two that is at least n (1 for n <= 1)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def head_tiles(d: int) -> tuple[int, int]:
    """(main, tail): power-of-two column tiles of at least 16 (tensor-core products) covering a head of d features
    with the least padding, the tail 0 where one tile pads no more: 72 (DiT's, PixArt's) as 64 + 16 columns, not 128;
    40 as 32 + 16; 32, 112 and 128 whole."""
    whole = max(16, pow2(d))
    main = whole // 2
    tail = max(16, pow2(d - main))
    return (main, tail) if main >= 16 and main + tail < whole else (whole, 0)
