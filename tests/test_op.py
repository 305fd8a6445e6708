"""The MHLA operator against the dense O(N^2) formula of docs/MHLA.md (section 1), in fp64."""

import math

import pytest
import torch

from mhla_diffusion import mhla_attention
from mhla_diffusion.blocks import auto_blocks, block_layout, locality_mix
from mhla_diffusion.ops.feature_maps import FEATURE_MAPS

from dense import dense_mhla, random_inputs, random_rope


RAGGED = [((1, 5, 7), (1, 2, 3)), ((3, 4, 5), (2, 3, 2)), ((2, 3, 5), (2, 2, 3)), ((1, 6, 6), (1, 1, 1)), ((4, 1, 9), (3, 1, 4))]


@pytest.mark.parametrize("grid,blocks", RAGGED)
@pytest.mark.parametrize("normalize", [True, False])
def test_matches_dense_formula(grid, blocks, normalize):
    q, k, v, mix = random_inputs(grid, blocks, dv=6)
    out = mhla_attention(q, k, v, mix, grid, blocks, normalize=normalize)
    torch.testing.assert_close(out, dense_mhla(q, k, v, mix, grid, blocks, normalize), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("feature", sorted(FEATURE_MAPS))
def test_rope_on_numerator_and_feature_maps(feature):
    grid, blocks = (2, 3, 4), (2, 1, 2)
    q, k, v, mix = random_inputs(grid, blocks, d=8)
    rope = random_rope(24, 8)
    for normalize in (True, False):
        out = mhla_attention(q, k, v, mix, grid, blocks, normalize=normalize, feature=feature, rope=rope)
        ref = dense_mhla(q, k, v, mix, grid, blocks, normalize, feature=feature, rope=rope)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    # RoPE must change the numerator: otherwise the rope branch is silently ignored
    assert not torch.allclose(out, mhla_attention(q, k, v, mix, grid, blocks, normalize=False, feature=feature))


def test_normalized_rows_are_weighted_averages():
    """With a row-stochastic mix, the implied attention rows sum to 1 (the upstream bug does not)."""
    grid, blocks = (1, 6, 6), (1, 2, 3)
    q, k, _, mix = random_inputs(grid, blocks)
    q = q.abs()  # a query with phi(q) = 0 has no weights to normalize (0 / 0)
    ones = torch.ones(2, 36, 2, 1, dtype=torch.float64)
    out = mhla_attention(q, k, ones, mix, grid, blocks, eps=0.0)
    torch.testing.assert_close(out, ones)


def test_gradients_q_k_v_mix():
    grid, blocks = (2, 3, 3), (2, 2, 1)
    q, k, v, mix = (t.requires_grad_() for t in random_inputs(grid, blocks, batch=1, d=3))
    f = lambda q, k, v, mix: mhla_attention(q, k, v, mix, grid, blocks)  # noqa: E731
    assert torch.autograd.gradcheck(f, (q, k, v, mix))
    g = lambda q, k, v, mix: mhla_attention(q, k, v, mix, grid, blocks, normalize=False)  # noqa: E731
    assert torch.autograd.gradcheck(g, (q, k, v, mix))


def test_gradients_with_rope_match_dense():
    grid, blocks = (2, 2, 3), (1, 2, 2)
    inputs = [t.requires_grad_() for t in random_inputs(grid, blocks, batch=1, d=4)]
    rope = random_rope(12, 4)
    ours = torch.autograd.grad(mhla_attention(*inputs, grid, blocks, rope=rope).square().sum(), inputs)
    dense = torch.autograd.grad(dense_mhla(*inputs, grid, blocks, rope=rope).square().sum(), inputs)
    for a, b in zip(ours, dense):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_accumulates_in_fp32(dtype):
    grid, blocks = (1, 8, 8), (1, 2, 2)
    q, k, v, mix = random_inputs(grid, blocks, d=16)
    out = mhla_attention(q.to(dtype), k.to(dtype), v.to(dtype), mix.float(), grid, blocks)
    assert out.dtype == dtype
    ref = dense_mhla(q.to(dtype).double(), k.to(dtype).double(), v.to(dtype).double(), mix, grid, blocks)
    assert ((out.double() - ref).norm() / ref.norm()) < 1e-2


def test_block_layout_partitions_tokens():
    for grid, blocks in RAGGED:
        lay = block_layout(grid, blocks)
        n = math.prod(grid)
        slots = lay.slot_index[lay.slot_index < n]
        assert sorted(slots.tolist()) == list(range(n))  # every token in exactly one slot
        sizes = torch.bincount(lay.token_block, minlength=lay.num_blocks)
        assert int(sizes.max()) <= math.prod(math.ceil(L / b) for L, b in zip(grid, blocks))
        assert int(sizes.min()) >= math.prod(L // b for L, b in zip(grid, blocks))


def test_auto_blocks_keep_mixing_below_tokens():
    for grid in [(1, 16, 16), (21, 30, 52), (21, 45, 80), (1, 3, 5), (1, 1, 1), (5, 7, 1)]:
        blocks = auto_blocks(grid)
        assert math.prod(blocks) ** 2 <= math.prod(grid)
        assert all(1 <= b <= L for b, L in zip(blocks, grid))
    assert auto_blocks((1, 16, 16)) == (1, 4, 4)


def test_locality_init_rows():
    mix = locality_mix((3, 5, 10))
    torch.testing.assert_close(mix.sum(1), torch.ones(150, dtype=torch.float64))
    assert (mix >= 0).all() and (mix.diagonal() == mix.max(1).values).all()


@pytest.mark.parametrize(
    "args,match",
    [
        (dict(grid=(1, 5, 7), blocks=(1, 6, 1)), "does not fit"),
        (dict(grid=(1, 5, 6), blocks=(1, 2, 3)), "holds 30 tokens"),
        (dict(grid=(1, 5, 7), blocks=(1, 2, 2)), r"mix must be \(4, 4\)"),
        (dict(grid=(1, 5, 7), blocks="big"), "auto"),
    ],
)
def test_bad_inputs_are_explained(args, match):
    q, k, v, mix = random_inputs((1, 5, 7), (1, 2, 3))
    with pytest.raises(ValueError, match=match):
        mhla_attention(q, k, v, mix, args["grid"], args["blocks"])
