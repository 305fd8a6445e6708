"""Sequence-parallel MHLA under diffusers' context parallelism: 2 and 3 CPU processes (gloo,
launched by torchrun) give the one-process output and gradients of tiny Wan, PixArt and DiT
models whose token counts divide by neither, with slices that start mid-block; and the sharded
Triton kernels (under Triton's CPU interpreter) give the unsharded kernels' output and gradients."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mhla_diffusion import zoo
import mhla_diffusion as md
from mhla_diffusion.blocks import auto_blocks, block_layout
from mhla_diffusion.context_parallel import cp_plan, enable_context_parallel
from mhla_diffusion.ops.context_parallel import comm_bytes, local_layout, token_range

from sp_worker import CASES

ROOT = Path(__file__).resolve().parents[1]


def grid_of(family):
    (h, w), frames = CASES[family][:2]
    return (frames, h // 2, w // 2)


def run_ranks(worker: str, world: int, tmp_path) -> dict:
    """What rank 0 of `world` CPU processes running tests/`worker` wrote."""
    out = tmp_path / "result.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
           str(ROOT / "tests" / worker), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def starts_mid_block(grid, blocks, world) -> bool:
    """Whether some rank's slice of `grid` begins inside a block that the previous rank's slice ends in."""
    token_block = block_layout(grid, blocks).token_block
    starts = [token_range(math.prod(grid), world, rank)[0] for rank in range(1, world)]
    return any(token_block[s - 1] == token_block[s] for s in starts)


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_matches_one_process(world, tmp_path):
    results = run_ranks("sp_worker.py", world, tmp_path)
    assert results.keys() == CASES.keys()
    for family, r in results.items():
        grid, blocks = grid_of(family), CASES[family][2]
        n = math.prod(grid)
        assert n % world != 0
        sizes = [len(s) for s in torch.arange(n).tensor_split(world)]
        assert r["tokens_seen"] == sizes, f"{family}: the sequence was not split as diffusers splits it"
        assert r["layer0_calls"] == [3] * world, f"{family}: gradient checkpointing did not recompute the layer"
        assert starts_mid_block(grid, blocks, world), f"{family}: no slice starts mid-block"
        for key in ("out", "grads", "checkpointed_grads", "input_grad"):
            assert r[key] < 1e-5, f"{family} {key}: relative error {r[key]:.2e} (worst grads {r['worst']})"


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_kernels_match_unsharded(world, tmp_path):
    """Each rank's kernels walk its slice's tokens of each block (some slices start mid-block), one all-reduce
    completes the summaries, and the backward's completes their gradients: o and all gradients match the
    unsharded kernels to fp32 rounding, normalized and not, with RoPE and without; with dO's summaries of each slice
    made in the q-side grad launch (each rank's blocks in one token tile: one summary launch a rank, k's) and in
    their own."""
    results = run_ranks("sp_kernels_worker.py", world, tmp_path)
    grid, blocks = results["grid"], results["blocks"]
    assert starts_mid_block(grid, blocks, world) and results["cases"]
    starts = [[token_range(math.prod(grid), world, rank)[0]] for rank in range(world)]
    for case, r in results["cases"].items():
        assert r["starts"] == starts, f"{case}: the Triton kernels did not run once per rank on its slice"
        if "split" not in case:  # split: per rank, as its slice's longest block fits a 16-token tile or not
            assert r["summary launches"] == [1] * world, f"{case}: {r['summary launches']}"
        bad = {name: err for name, err in r["errors"].items() if not err < 1e-6}
        assert not bad, f"{case}: relative errors {bad}"


def test_token_range_is_tensor_split():
    for n, world in [(175, 2), (175, 3), (25, 3), (8, 4), (5, 5)]:
        expected = [(int(s[0]), int(s[-1]) + 1) for s in torch.arange(n).tensor_split(world)]
        assert [token_range(n, world, r) for r in range(world)] == expected
    with pytest.raises(ValueError, match="cannot be split over 4 ranks"):
        token_range(3, 4, 0)


def test_local_layouts_partition_the_blocks():
    grid, blocks = (5, 5, 7), (2, 2, 3)
    full = block_layout(grid, blocks).token_block
    for start, end in [(0, 59), (59, 117), (117, 175), (88, 175)]:
        lay, ids = local_layout(grid, blocks, start, end, "cpu")
        assert torch.equal(ids[lay.token_block], full[start:end])  # each local token in its global block
        slots = lay.slot_index[lay.slot_index < end - start]
        assert sorted(slots.tolist()) == list(range(end - start))  # every local token packed once


def test_plans_and_refusals():
    sana = zoo.build_transformer("sana")
    with pytest.raises(ValueError, match="Mix-FFN"):
        cp_plan(sana)
    wan = zoo.build_transformer("wan")
    assert cp_plan(wan) is type(wan)._cp_plan  # diffusers' own plan
    dit = zoo.build_transformer("dit", num_layers=3)
    md.convert(dit, md.default_config(dit, layers="hybrid:3"))
    with pytest.raises(ValueError, match="layer 2 uses AttnProcessor2_0"):
        enable_context_parallel(dit, None)
    hybrid_wan = zoo.build_transformer("wan", num_layers=3)  # diffusers' Wan processor is CP-aware, but CUDA-only
    md.convert(hybrid_wan, md.default_config(hybrid_wan, layers="hybrid:3"))
    with pytest.raises(ValueError, match="layer 2 keeps WanAttnProcessor.*CPU-only host"):
        enable_context_parallel(hybrid_wan, None)


def comm_rows():
    """The README's communication table, from `comm_bytes` (Wan2.1 configs of DIFFUSERS_NOTES)."""
    mib = 2**20
    rows = []
    for name, grid, heads in [("Wan2.1-1.3B 480p x 81", (21, 30, 52), 12), ("Wan2.1-14B 720p x 81", (21, 45, 80), 40)]:
        n, m_auto = math.prod(grid), math.prod(auto_blocks(grid))
        for ranks in (2, 4, 8):
            c, a = comm_bytes(n, heads, 128, 150, ranks), comm_bytes(n, heads, 128, m_auto, ranks)
            rows.append(f"| {name} ({n:,} tokens) | {ranks} | {c['ulysses'] / mib:.1f} | {c['ring'] / mib:.1f} "
                        f"| {c['mhla'] / mib:.1f} | {a['mhla'] / mib:.1f} (M = {m_auto}) |")
    return rows


def test_comm_bytes_and_readme_table():
    c = comm_bytes(num_tokens=8, heads=1, head_dim=2, num_blocks=2, ranks=2, normalize=True)
    assert c == {"ulysses": 4 * 8.0 * 0.5 * 2, "ring": 2 * 8.0 * 1 * 2, "mhla": 1.0 * 2 * (4 + 2) * 4}
    readme = (ROOT / "README.md").read_text()
    missing = [row for row in comm_rows() if row not in readme]
    assert not missing, "README's sequence-parallel table is stale; regenerate it:\n" + "\n".join(comm_rows())


def test_one_rank_group_equals_reference_and_rejects_wrong_slices(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        g = torch.Generator().manual_seed(0)
        grid, blocks = (3, 4, 5), (2, 2, 2)
        q, k, v = (torch.randn(2, 60, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
        mix = torch.rand(8, 8, generator=g, dtype=torch.float64)
        group = dist.group.WORLD
        expected = md.mhla_attention(q, k, v, mix, grid, blocks, normalize=True)
        torch.testing.assert_close(md.mhla_attention(q, k, v, mix, grid, blocks, normalize=True, group=group), expected)
        with pytest.raises(ValueError, match=r"rank 0 of 1 got 59, 59, 59 q, k, v tokens.*\[0, 60\)"):
            md.mhla_attention(q[:, 1:], k[:, 1:], v[:, 1:], mix, grid, blocks, group=group)
    finally:
        dist.destroy_process_group()
