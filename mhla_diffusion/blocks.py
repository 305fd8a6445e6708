"""Token-block geometry: how a (T, H, W) token grid is cut into MHLA blocks.

Along an axis of length L cut into n blocks, block i covers
[floor(i*L/n), floor((i+1)*L/n)): lengths differ by at most one token, no padding.
Block ids are raster order over the block grid, like tokens over the token grid.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch


def eager_cache(maxsize: int):
    """`functools.lru_cache` for eager calls. Under torch.compile the wrapped function is traced once per
    graph anyway, so the cache (which Dynamo ignores, warning about it on every compiled run) is bypassed."""

    def wrap(fn):
        cached = functools.lru_cache(maxsize=maxsize)(fn)

        @functools.wraps(fn)
        def call(*args):
            return fn(*args) if torch.compiler.is_compiling() else cached(*args)

        call.cache_clear = cached.cache_clear
        return call

    return wrap


Grid = tuple[int, int, int]


def as_grid(grid) -> Grid:
    """A token grid as (T, H, W); a 2-tuple (H, W) is an image (T = 1)."""
    grid = tuple(int(x) for x in grid)
    if len(grid) == 2:
        grid = (1, *grid)
    if len(grid) != 3 or min(grid) < 1:
        raise ValueError(f"token grid must be (T, H, W) or (H, W) of positive ints, got {grid}")
    return grid


def as_blocks(blocks) -> Grid:
    """A block grid as (bt, bh, bw); a 2-tuple (bh, bw) means bt = 1."""
    try:
        blocks = tuple(int(x) for x in blocks)
    except (TypeError, ValueError):
        raise ValueError(f"blocks must be 'auto' or (bt, bh, bw) / (bh, bw) of ints, got {blocks!r}") from None
    if len(blocks) == 2:
        blocks = (1, *blocks)
    if len(blocks) != 3 or min(blocks) < 1:
        raise ValueError(f"blocks must be (bt, bh, bw) or (bh, bw) of positive ints, got {blocks}")
    return blocks


def check_blocks(grid, blocks, where: str = "") -> Grid:
    """Validate that `blocks` cuts `grid` (at most one block per token along each axis).

    where: what the grid is, for the message (e.g. "of WanTransformer3DModel at 480p x 81 frames").
    """
    grid, blocks = as_grid(grid), as_blocks(blocks)
    bad = [f"{axis}: {n} blocks > {L} tokens" for axis, n, L in zip("THW", blocks, grid) if n > L]
    if bad:
        raise ValueError(
            f"block grid {blocks} does not fit token grid {grid}{' ' + where if where else ''} ({'; '.join(bad)}); "
            "use at most as many blocks as tokens along each axis, or blocks='auto'"
        )
    return blocks


def auto_blocks(grid) -> Grid:
    """The largest roughly cubic block grid with M^2 <= N (so mixing costs no more than the tokens)."""
    grid = as_grid(grid)
    n_tokens = math.prod(grid)
    m_max = max(1, math.isqrt(n_tokens))
    dims = max(1, sum(L > 1 for L in grid))
    side = (n_tokens / m_max) ** (1.0 / dims)  # tokens per block edge
    blocks = [max(1, min(L, round(L / side))) for L in grid]
    while math.prod(blocks) > m_max:  # rounding can overshoot: trim the axis with the most blocks
        i = max(range(3), key=lambda a: (blocks[a], -a))
        blocks[i] -= 1
    return tuple(blocks)


def resolve_blocks(grid, blocks) -> Grid:
    """`blocks` for this token grid: 'auto' is chosen from the grid, explicit grids are checked."""
    if isinstance(blocks, str):
        if blocks != "auto":
            raise ValueError(f"blocks must be 'auto' or (bt, bh, bw), got {blocks!r}")
        return auto_blocks(grid)
    return check_blocks(grid, blocks)


@dataclass(frozen=True)
class BlockGeometry:
    """A token grid and the block grid that cuts it, checked once: what every stage of one MHLA call shares.

    Built by `block_geometry` (cached per pair), handed from the processor through the dispatch to the kernels.
    """

    grid: Grid
    blocks: Grid

    @property
    def num_tokens(self) -> int:
        return math.prod(self.grid)

    @property
    def num_blocks(self) -> int:
        return math.prod(self.blocks)

    @property
    def max_len(self) -> int:
        """Tokens of the longest block: each axis cut holds ceil(L / n) tokens at most."""
        return math.prod([-(-length // n) for length, n in zip(self.grid, self.blocks)])

    def layout(self, device=None) -> "BlockLayout":
        return block_layout(self.grid, self.blocks, device)

    def slice_blocks(self, start: int, end: int) -> tuple[int, int, int]:
        """For raster tokens [start, end) (a context-parallel rank's slice): the first block id m0 and the count of
        ids from it to the last block holding any of them, and the most of them one block holds."""
        return _slice_blocks(self.grid, self.blocks, start, end)


@eager_cache(maxsize=256)
def _block_geometry(grid: Grid, blocks) -> BlockGeometry:
    return BlockGeometry(grid, resolve_blocks(grid, blocks))


def block_geometry(grid, blocks) -> BlockGeometry:
    """`grid` ((T, H, W) or (H, W)) cut into `blocks` ('auto', (bt, bh, bw) or (bh, bw)), resolved and checked."""
    if not isinstance(blocks, str):
        blocks = as_blocks(blocks)
    return _block_geometry(as_grid(grid), blocks)


def block_of_position(length: int, n: int, pos: torch.Tensor) -> torch.Tensor:
    """Block index of positions along one axis: the i with floor(iL/n) <= p < floor((i+1)L/n)."""
    return ((pos + 1) * n - 1) // length


@dataclass(frozen=True)
class BlockLayout:
    """Index maps between raster token order and a zero-padded block-major layout.

    slot_index: (M, Lmax) token index of each slot, N (an appended zero row) for padding.
    token_slot: (N,) flat slot (block * Lmax + rank in block) of each token.
    token_block: (N,) block id of each token.
    """

    slot_index: torch.Tensor
    token_slot: torch.Tensor
    token_block: torch.Tensor
    num_blocks: int
    max_len: int

    def to(self, device) -> "BlockLayout":
        move = lambda x: x.to(device)  # noqa: E731
        return BlockLayout(move(self.slot_index), move(self.token_slot), move(self.token_block), self.num_blocks,
                           self.max_len)


def pack_blocks(token_block: torch.Tensor, num_blocks: int) -> BlockLayout:
    """The layout of tokens (in raster order) whose block ids are `token_block`, ids < num_blocks."""
    order = torch.argsort(token_block, stable=True)  # raster order inside each block
    counts = torch.bincount(token_block, minlength=num_blocks)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(token_block)
    rank[order] = torch.arange(token_block.numel()) - starts[token_block[order]]
    max_len = int(counts.max())
    slot_index = torch.full((num_blocks, max_len), token_block.numel(), dtype=torch.long)
    slot_index[token_block, rank] = torch.arange(token_block.numel())
    return BlockLayout(slot_index, token_block * max_len + rank, token_block, num_blocks, max_len)


@eager_cache(maxsize=64)
def _layout_cpu(grid: Grid, blocks: Grid) -> BlockLayout:
    T, H, W = grid
    t, h, w = torch.meshgrid(torch.arange(T), torch.arange(H), torch.arange(W), indexing="ij")
    bt, bh, bw = blocks
    ib = [block_of_position(L, n, p.reshape(-1)) for L, n, p in zip(grid, blocks, (t, h, w))]
    return pack_blocks((ib[0] * bh + ib[1]) * bw + ib[2], bt * bh * bw)


def block_layout(grid, blocks, device=None) -> BlockLayout:
    """Cached layout of `grid` cut into `blocks`, on `device`."""
    grid = as_grid(grid)
    lay = _layout_cpu(grid, check_blocks(grid, blocks))
    if device is None or torch.device(device).type == "cpu":
        return lay
    return _layout_on(grid, as_blocks(blocks), torch.device(device))


@eager_cache(maxsize=64)
def _layout_on(grid: Grid, blocks: Grid, device: torch.device) -> BlockLayout:
    return _layout_cpu(grid, blocks).to(device)


@eager_cache(maxsize=64)
def _slice_blocks(grid: Grid, blocks: Grid, start: int, end: int) -> tuple[int, int, int]:
    ids = _layout_cpu(grid, blocks).token_block[start:end]
    return int(ids.min()), int(ids.max() - ids.min()) + 1, int(torch.bincount(ids).max())


def block_coords(blocks) -> torch.Tensor:
    """(M, 3) block-grid coordinates in raster order."""
    bt, bh, bw = as_blocks(blocks)
    t, h, w = torch.meshgrid(torch.arange(bt), torch.arange(bh), torch.arange(bw), indexing="ij")
    return torch.stack([t, h, w], -1).reshape(-1, 3).double()


def locality_mix(blocks) -> torch.Tensor:
    """The paper's locality-biased init, rows normalized: Mc0[i,j] ∝ 1 - d(i,j)/max_k d(i,k)."""
    c = block_coords(blocks)
    d = torch.cdist(c, c)
    far = d.max(dim=1, keepdim=True).values
    mc = torch.where(far > 0, 1 - d / far.clamp_min(1e-12), torch.ones_like(d))
    return mc / mc.sum(dim=1, keepdim=True)
