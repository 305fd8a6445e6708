"""`bench op` on a machine without a GPU: its peers' arithmetic, ratios, and the table it prints."""

import copy
import math

import pytest
import torch

from mhla_diffusion.cli import bench, main


def test_global_linear_is_relu_q_times_relu_k_transposed_v():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 10, 3, 4, generator=g, dtype=torch.float64) for _ in range(3))
    ref = torch.stack([torch.stack([q[b, :, h].relu() @ (k[b, :, h].relu().T @ v[b, :, h]) for h in range(3)], 1)
                       for b in range(2)])
    torch.testing.assert_close(bench.global_linear(q, k, v), ref)


def _row(times):
    return {"shape": "s", "N": 4096, "heads": 2, "D": 8, "blocks": [1, 2, 2], "M": 4, "blocks_chosen": "auto",
            "floor_fwd_ms": 0.01, "floor_fwdbwd_ms": 0.03, "times": times}


def test_ratios_and_table():
    t = lambda ms, how="graph": {"ms": ms, "how": how, "eager_ms": 2 * ms}  # noqa: E731
    times = {"cudnn": {"fwd": t(0.2), "fwdbwd": t(0.8, "busy")}, "fa2": {"fwd": t(0.3), "fwdbwd": t(1.0, "busy")},
             "linear": {"fwd": t(0.05), "fwdbwd": t(0.2)}, "mhla": {"fwd": t(0.1), "fwdbwd": t(0.4)},
             "mhla_used": {"fwd": t(0.11), "fwdbwd": t(0.6)}}
    row = _row(times)
    row.update(bench.ratios(row))
    assert row["mhla_vs_cudnn_fwd"] == pytest.approx(0.5) and row["mhla_vs_linear_fwd"] == pytest.approx(2.0)
    assert row["used_vs_mhla_fwdbwd"] == pytest.approx(1.5) and row["mhla_vs_cudnn_fwdbwd"] == pytest.approx(0.5)
    table = bench._table([row], "GPU", 4e12, "bfloat16", 1)
    fwd, fwdbwd = (line for line in table.splitlines() if line.startswith("| s |"))
    assert fwd.split(" | ")[5:] == ["0.200", "0.300", "0.0500", "0.100", "0.110", "0.200", "0.50x", "2.00x", "1.10x |"]
    assert "0.800*" in fwdbwd and "1.50x" in fwdbwd  # eager-timed (profiler GPU time) cells are starred


def test_short_times_keep_three_significant_digits():
    """DiT's shapes take 8-30 us: three decimals of a millisecond would print 0.008 and 0.009 for 8.4 and 8.6 us."""
    t = lambda ms: {"ms": ms, "how": "graph", "eager_ms": 2 * ms, "queued_ms": ms}  # noqa: E731
    row = _row({"cudnn": {"fwd": t(0.01936), "fwdbwd": t(0.0752)}, "mhla": {"fwd": t(0.00843), "fwdbwd": t(1.6734)}})
    row["floor_fwd_ms"] = 0.00262
    row.update(bench.ratios(row))
    fwd, fwdbwd = (line for line in bench._table([row], "GPU", 4e12, "bfloat16", 1).splitlines()
                   if line.startswith("| s |"))
    assert fwd.split(" | ")[4:8] == ["0.00262", "0.0194", "0.00843", "0.0169"]
    assert fwdbwd.split(" | ")[5:8] == ["0.0752", "1.673", "3.347"]
    assert "mhla fwd 0.00843 (queued 0.00843, eager 0.0169)" in bench._progress(row)


def test_missing_impls_give_nan_ratios_and_dashes():
    row = _row({"mhla": {"fwd": {"ms": 0.1, "how": "graph", "eager_ms": 0.2},
                         "fwdbwd": {"ms": math.nan, "error": "no kernel"}}})
    row.update(bench.ratios(row))
    assert math.isnan(row["mhla_vs_cudnn_fwd"]) and math.isnan(row["used_vs_mhla_fwd"])
    table = bench._table([row], "GPU", 4e12, "bfloat16", 1)
    assert "fail" in table and "Failed: s mhla fwdbwd: no kernel" in table


def test_wan_shapes_time_mhla_as_used_and_the_cli_needs_a_gpu(capsys):
    assert {s.name for s in bench.SHAPES if s.as_used} == {"Wan2.1-1.3B 480p", "Wan2.1-14B 720p",
                                                           "Wan2.1-1.3B 480p, model's blocks",
                                                           "Wan2.1-14B 720p, model's blocks"}
    assert main(["bench", "op", "--impls", "mhla", "linear"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_shard_table_gives_each_p_its_slowest_rank_and_scaling():
    t = lambda ms: {"ms": ms, "how": "graph", "eager_ms": 2 * ms}  # noqa: E731
    rows = [{"shape": "s", "P": p, "rank": r, "start": 0, "end": 10, "M": 4, "blocks_launched": 4, "longest": 5,
             "times": {"mhla": {"fwd": t(ms), "fwdbwd": t(3 * ms)}}}
            for p, r, ms in [(1, 0, 1.0), (2, 0, 0.5), (2, 1, 0.625)]]
    wan = {**rows[0], "shape": "w", "times": {**rows[0]["times"], "mhla_used": {"fwd": t(2.0), "fwdbwd": t(4.0)}}}
    lines = bench._shard_table([wan, *rows], "GPU", "bfloat16", 1).splitlines()
    assert lines[-1] == "| s | 2 | slowest | | | | 0.625 (0.80) | 1.875 (0.80) | - | - |"
    assert lines[-2] == "| s | 2 | 1 | [0, 10) | 4 of 4 | 5 | 0.625 | 1.875 | - | - |"
    assert lines[4] == "| w | 1 | 0 | [0, 10) | 4 of 4 | 5 | 1.000 | 3.000 | 2.000 | 4.000 |"
    assert bench._progress(rows[1]).startswith("[s, P = 2, rank 0] mhla fwd 0.500 ")


def _gpu_stand_in(monkeypatch):
    """torch.cuda as a GPU machine's, for the CLI's own logic; the kernels themselves are timed and checked on one."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "GPU")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)


def _stand_in_check_case(done: list):
    """check_case recording each case's name and the quadratic form's split setting in force when it ran; the case
    "dit-xl-384 elu" fails with the key kernel's heads split."""
    from mhla_diffusion.kernels import parallel

    def check_case(name, heads, d, dv, grid, blocks, options, dtype):
        split = parallel.CONFIG["split_heads"]
        done.append((name, split))
        return {"case": name, "dtype": str(dtype).replace("torch.", ""), "N": 1, "M": 1, "heads": 1, "D": 1, "Dv": 1,
                "errors": {}, "worst": 0.0, "ok": name != "dit-xl-384 elu" or "grad_keys" not in split}
    return check_case


def test_check_takes_the_cases_a_setting_touches(monkeypatch):
    """`--check dit-xl-256 dit-xl-384` checks only the cases whose names hold one of those (the quadratic form's: a
    `--set` of its kernels needs no 5 minutes of long-sequence cases), each on the inputs a full run gives it."""
    from mhla_diffusion.ops import check

    done, seeds = [], []
    monkeypatch.setattr(check, "check_case", _stand_in_check_case(done))
    monkeypatch.setattr(check.torch, "manual_seed", seeds.append)
    _gpu_stand_in(monkeypatch)
    monkeypatch.setattr(bench, "_copy_bandwidth", lambda do_bench: 1e12)
    monkeypatch.setattr(bench, "bench_shape", lambda *a: pytest.fail("timed before the check finished") if not done
                        else _row({}))
    assert main(["bench", "op", "--check", "dit-xl-256", "dit-xl-384", "--shapes", "DiT-XL/2 256px"]) == 0
    quadratic = ["dit-xl-256", "dit-xl-384 elu", "dit-xl-256, 64 blocks", "dit-xl-384, 36 blocks", "dit-xl-256 logits"]
    assert [name for name, _ in done] == [name for name in quadratic for _ in range(2)]  # bf16, fp32
    assert seeds == [i for i, c in enumerate(check.CASES) if c[0] in quadratic for _ in range(2)]


def test_check_refuses_a_case_name_no_case_holds_before_asking_for_a_gpu(capsys):
    assert main(["bench", "op", "--check", "dit-xl-2048"]) == 2  # this machine has no GPU: refused before that
    err = capsys.readouterr().err.strip()
    assert "no check case's name holds 'dit-xl-2048'" in err and "dit-xl-256" in err and len(err.splitlines()) == 1


def _cpu_inputs(shape, dtype, batch):
    from mhla_diffusion.blocks import block_geometry

    geometry = block_geometry(shape.grid, shape.blocks)
    q, k, v, do = (torch.randn(batch, geometry.num_tokens, shape.heads, shape.d) for _ in range(4))
    return geometry, (q, k, v, do), torch.eye(geometry.num_blocks), None


def test_versus_times_each_candidate_in_turn_on_top_of_the_settings_in_force(monkeypatch, capsys):
    """`--versus A B --rounds 3`: after an untimed warm-up round, each round times the settings in force (here with
    --set), A and B in turn, starting one further each round, forward then forward+backward, on one shape's inputs;
    the tables are as they were afterwards. GPU time is stood in for: a function of the settings in force, growing
    by 1e-4 ms with each timing of the same settings and pass."""
    from mhla_diffusion.kernels import parallel

    seen, count = [], {}

    def time_op(do_bench, fn, leaves, do, backward):
        c = parallel.CONFIG
        seen.append((c["max_tokens"], c["split_heads"], c["long_over"], backward))
        count[seen[-1]] = count.get(seen[-1], 0) + 1
        return {576: 0.0100, 256: 0.0050, 1024: 0.0200}[c["max_tokens"]] * (1 + 3 * backward) + 1e-4 * count[seen[-1]]

    shipped = copy.deepcopy(parallel.CONFIG)
    _gpu_stand_in(monkeypatch)
    monkeypatch.setattr(bench, "shape_inputs", _cpu_inputs)
    monkeypatch.setattr(bench, "time_op", time_op)
    split = "parallel.CONFIG.split_heads=('forward',)"
    assert main(["bench", "op", "--shapes", "DiT-XL/2 256px", "--rounds", "3", "--set", "parallel.CONFIG.long_over=128",
                 "parallel.CONFIG.max_tokens=576", "--versus", "parallel.CONFIG.max_tokens=256",
                 f"parallel.CONFIG.max_tokens=1024; {split}"]) == 0
    settings = [(576, shipped["split_heads"]), (256, shipped["split_heads"]), (1024, ("forward",))]
    order = [2, 0, 1, 0, 1, 2, 1, 2, 0, 2, 0, 1]  # warm-up, then rounds 1-3
    assert seen == [(*settings[i], 128, backward) for i in order for backward in (False, True)]
    assert parallel.CONFIG == shipped
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| DiT")]
    assert len(rows) == 6 and rows[:3] == rows[3:]  # as the shape finished, then in the table
    assert rows[0] == ("| DiT-XL/2 256px | 256 | as run | 0.0103 (0.0102-0.0104) | 1.000 | 0.0403 (0.0402-0.0404) "
                       "| 1.000 |")
    assert rows[1].startswith("| DiT-XL/2 256px | 256 | parallel.CONFIG.max_tokens=256 | 0.00530 (0.00520-0.00540) | "
                              "0.515 |")
    assert rows[2].startswith(f"| DiT-XL/2 256px | 256 | parallel.CONFIG.max_tokens=1024; {split} | 0.0203 ")


def test_versus_keeps_timing_past_a_failing_candidate_and_checks_each(monkeypatch, capsys):
    """A candidate whose launch fails is reported as such and the others are timed on; with --check, the cases run
    under every candidate as well, and one failing under a candidate fails the command, naming both."""
    from mhla_diffusion.kernels import parallel
    from mhla_diffusion.ops import check

    def time_op(do_bench, fn, leaves, do, backward):
        if parallel.CONFIG["max_tokens"] == 1024:
            raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")
        return 0.01

    done = []
    monkeypatch.setattr(check, "check_case", _stand_in_check_case(done))
    _gpu_stand_in(monkeypatch)
    monkeypatch.setattr(bench, "shape_inputs", _cpu_inputs)
    monkeypatch.setattr(bench, "time_op", time_op)
    split = "parallel.CONFIG.split_heads=('grad_keys',)"
    assert main(["bench", "op", "--shapes", "DiT-XL/2 256px", "--check", "dit-xl-384 elu",
                 "--versus", "parallel.CONFIG.max_tokens=1024", split]) == 2
    shipped = parallel.CONFIG["split_heads"]
    assert [s for _, s in done] == [shipped] * 4 + [("grad_keys",)] * 2
    out, err = capsys.readouterr()
    assert f"check, {split}:" in out and "dit-xl-384 elu (parallel.CONFIG.split_heads=('grad_keys',))" in err
    rows = [line for line in out.splitlines() if line.startswith("| DiT")]
    assert rows[1] == "| DiT-XL/2 256px | 256 | parallel.CONFIG.max_tokens=1024 | fail |  | fail |  |"
    assert rows[2].startswith(f"| DiT-XL/2 256px | 256 | {split} | 0.0100 (0.0100-0.0100) | 1.000 |")
    assert ("Failed: DiT-XL/2 256px, parallel.CONFIG.max_tokens=1024: RuntimeError: CUDA error: an illegal memory "
            "access was encountered") in out


@pytest.mark.parametrize("argv, message", [
    (["--versus", "parallel.CONFIG.max_tokens=256;parallel.CONFIG.no_such_key=1"], "no_such_key"),
    (["--versus", "parallel.CONFIG.max_tokens=256", " ; "], "--versus: an empty candidate"),
    (["--versus", "mhla.ROPE_CONFIG.output.num_warps=8"], "never reads mhla.ROPE_CONFIG"),
    (["--versus", "parallel.CONFIG.max_tokens=256", "--impls", "mhla"], "drop --impls and --profile"),
    (["--versus", "parallel.CONFIG.max_tokens=256", "--rounds", "0"], "--rounds must be at least 1"),
    (["--rounds", "2"], "give --versus too"),
    (["--in-layer", "--shard", "2"], "drop --in-layer or --shard"),
])
def test_versus_refuses_a_bad_run_in_one_line(argv, message, capsys):
    assert main(["bench", "op", *argv]) == 2  # this machine has no GPU: refused before that
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_check_prints_each_case_as_it_finishes(monkeypatch, capsys):
    """`bench op --check` streams one row per case, so a run cut short (here: the third case fails) still shows
    the cases it checked; the kernels themselves are checked on a GPU, so check_case is stood in for here."""
    from mhla_diffusion.ops import check

    def check_case(name, heads, d, dv, grid, blocks, options, dtype):
        if len(done) == 2:
            raise RuntimeError("cut short")
        done.append(name)
        errors = dict.fromkeys(("o", "dq", "dk", "dv", "dmix", "o no-grad"), 1e-3)
        return {"case": name, "dtype": str(dtype).replace("torch.", ""), "N": math.prod(grid), "M": 4, "heads": heads,
                "D": d, "Dv": dv, "errors": errors, "worst": 1e-3, "ok": True}

    done = []
    monkeypatch.setattr(check, "check_case", check_case)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "GPU")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    with pytest.raises(RuntimeError, match="cut short"):
        main(["bench", "op", "--check"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert lines[0] == bench.CHECK_HEADER[0] and len(lines) == 3
    first = check.CASES[0]
    assert lines[1] == (f"| {first[0]} | bfloat16 | {math.prod(first[4]):,} | 4 | {first[1]} x {first[2]}/{first[3]} | "
                        + " | ".join(["1.0e-03"] * 6) + " | - | yes |")  # a case without norms: no norms column
    assert lines[2].startswith(f"| {first[0]} | float32 |")


def test_set_runs_bench_with_kernel_settings_changed_and_restores_them(monkeypatch, capsys):
    """`bench op --set`: the kernels' settings tables hold the values asked while the run checks and times (the
    check case stood in for, as above, reads them where the launchers do; a second `--set` adds to the first), and
    what they held before once it ends, also when it ends in an error."""
    from mhla_diffusion.kernels import mhla, parallel
    from mhla_diffusion.ops import check

    before = copy.deepcopy((parallel.CONFIG, mhla.SHORT_CONFIG, mhla.CONFIG))
    entry = parallel.CONFIG["forward_long"]  # held elsewhere, as launchers' callers may hold it
    seen = []

    def check_case(*args, **kwargs):
        seen.append((parallel.CONFIG["split_heads"], parallel.CONFIG["forward_long"]["num_stages"],
                     dict(mhla.SHORT_CONFIG.get("grad", {})), mhla.CONFIG["summary"]["maxnreg"],
                     mhla.CONFIG["grad"]["narrow_warps"]))
        raise RuntimeError("stop here")

    monkeypatch.setattr(check, "check_case", check_case)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "GPU")
    with pytest.raises(RuntimeError, match="stop here"):
        main(["bench", "op", "--check", "--set", "parallel.CONFIG.split_heads=('forward', 'grad_queries')",
              "parallel.CONFIG.forward_long.num_stages=4", "--set", "mhla.SHORT_CONFIG.grad.num_warps=8",
              "mhla.CONFIG.summary.maxnreg=None", "mhla.CONFIG.grad.narrow_warps.32=4"])
    # None: a register cap lifted; 32: a table keyed by head width takes its keys as numbers
    assert seen == [(("forward", "grad_queries"), 4, {"num_warps": 8}, None, {32: 4})]
    assert (parallel.CONFIG, mhla.SHORT_CONFIG, mhla.CONFIG) == before and parallel.CONFIG["forward_long"] is entry
    assert entry["num_stages"] == before[0]["forward_long"]["num_stages"]
    from mhla_diffusion.kernels.overrides import describe

    assert describe(["parallel.CONFIG.max_tokens=1024"]) == " (settings changed: parallel.CONFIG.max_tokens=1024)"


@pytest.mark.parametrize("setting,message", [
    ("parallel.CONFIG.split_head=('forward',)", "parallel.CONFIG has no key 'split_head' (it has forward,"),
    ("parallel.CONFIG.forward_long.stages=4", "parallel.CONFIG.forward_long has no key 'stages'"),
    ("parallel.CONFIG.split_heads=forward", "'forward' is not a Python literal"),
    ("parallel.CONFIG.split_heads=True",
     "parallel.CONFIG.split_heads holds ('forward', 'grad_queries') (tuple), not True (bool)"),
    ("parallel.CONFIG.split_heads=('fwd',)", "names kernels of ('forward', 'grad_queries', 'grad_keys'), not ['fwd']"),
    ("parallel.CONFIG.max_tokens=None", "parallel.CONFIG.max_tokens takes no None (it holds 256)"),
    ("parallel.CONFIG.forward={}", "parallel.CONFIG.forward holds keys; set one of them"),
    ("mhla.SHORT_CONFIG.mix.programs=4", "mhla.SHORT_CONFIG has no key 'mix' (it has grad, output, summary)"),
    ("parallel.CONFIG.max_tokens.own=64", "parallel.CONFIG.max_tokens holds a value, not keys"),
    ("kernels.CONFIG.x=1", "expected TABLE.KEY=VALUE with TABLE one of mhla.CONFIG,"),
    ("parallel.CONFIG.max_tokens", "expected TABLE.KEY=VALUE"),
    ("mhla.CONFIG.grad.narrow_warps.48=2", "mhla.CONFIG.grad.narrow_warps has no key '48' (it has 32)"),
])
@pytest.mark.parametrize("command", [["op"], ["model", "--family", "dit-xl-2"]])
def test_set_refuses_what_no_table_holds_in_one_line(setting, message, command, capsys):
    """A misspelt table or key, a value of another type or not a literal: one line saying which and what there is,
    before anything runs (here, before the GPU is looked for), and no table changed."""
    from mhla_diffusion.kernels import parallel

    before = dict(parallel.CONFIG)
    assert main(["bench", *command, "--set", "parallel.CONFIG.max_tokens=1024", setting]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "CUDA" not in err
    assert dict(parallel.CONFIG) == before


def test_in_layer_runs_the_attention_between_the_layer_projections():
    """`layer_of(fn)`: q, k, v projected from x, fn, the output projection; the baseline's attention (the projections
    alone) passes v on and hands the output's gradient to q, k and v alike, with no kernel of its own."""
    from mhla_diffusion.cli.bench_layer import layer_leaves, layer_of, projections_only

    g = torch.Generator().manual_seed(0)
    q, do = (torch.randn(2, 6, 3, 4, generator=g, dtype=torch.float64) for _ in range(2))
    leaves, do_flat = layer_leaves(q, do, torch.eye(2, dtype=torch.float64))
    x, wq, wk, wv, wo, mix = leaves
    assert x.shape == (2, 6, 12) and wo.shape == (12, 12) and do_flat.shape == (2, 6, 12)
    assert all(t.requires_grad for t in leaves)

    def split(t):
        return t.unflatten(-1, (3, 4))

    out = layer_of(bench.global_linear, 3)(*leaves)
    want = bench.global_linear(split(x @ wq), split(x @ wk), split(x @ wv)).flatten(-2) @ wo
    torch.testing.assert_close(out, want)

    def passing(t):  # v forward; the gradient to q, k and v alike backward
        return (t[2] + (t[0] - t[0].detach()) + (t[1] - t[1].detach())).flatten(-2) @ wo

    got = layer_of(projections_only, 3)(*leaves)
    torch.testing.assert_close(got, x @ wv @ wo)
    grads = torch.autograd.grad(got, (x, wq, wk, wv, wo), do_flat)
    want = torch.autograd.grad(passing([split(x @ w) for w in (wq, wk, wv)]), (x, wq, wk, wv, wo), do_flat)
    for a, b in zip(grads, want):
        torch.testing.assert_close(a, b)


def test_in_layer_takes_each_call_less_the_projections_timed_the_same_way():
    from mhla_diffusion.cli.bench_layer import less_projections

    base = {"ms": 0.010, "how": "graph", "eager_ms": 0.030, "queued_ms": 0.012}
    graph = less_projections({"ms": 0.025, "how": "graph", "eager_ms": 0.050, "queued_ms": 0.028}, base)
    assert graph == pytest.approx({"ms": 0.015, "how": "graph", "eager_ms": 0.020, "queued_ms": 0.016,
                                   "layer_ms": 0.025})
    queued = less_projections({"ms": 0.040, "how": "queued", "eager_ms": 0.060, "queued_ms": 0.040}, base)
    assert queued["ms"] == pytest.approx(0.028) and queued["layer_ms"] == 0.040
    failed = less_projections({"ms": 0.040, "how": "graph", "eager_ms": 0.06, "queued_ms": 0.04},
                              {"ms": math.nan, "error": "no kernel"})
    assert math.isnan(failed["ms"]) and math.isnan(failed["queued_ms"])


def _projections_alone(fn, leaves):
    """Whether `fn` of the layer's leaves (x, W_q, W_k, W_v, W_o, mix) is the projections-alone baseline: its output
    is x W_v W_o."""
    with torch.no_grad():
        return torch.allclose(fn(*leaves), leaves[0] @ leaves[3] @ leaves[4])


def test_bench_op_in_layer_times_each_call_inside_the_projections_less_them(monkeypatch, capsys):
    """`bench op --in-layer`: every implementation runs between the layer's projections (forward and backward, on the
    layer's leaves), the projections alone are timed too, and the table gives each call's time less theirs. GPU time
    is stood in for: 0.010 / 0.040 ms (forward / f+b) for the projections alone, 0.025 / 0.070 for the layer with
    global linear attention."""
    calls = []

    def time_impl(fn, leaves, do, backward, graph):
        alone = _projections_alone(fn, leaves)
        out = fn(*leaves)
        assert out.shape == do.shape == leaves[0].shape
        if backward:
            out.backward(do)
            assert all(t.grad is not None for t in leaves[:5])
            for t in leaves:
                t.grad = None
        calls.append(("projections" if alone else "linear", backward))
        ms = {(True, False): 0.010, (True, True): 0.040, (False, False): 0.025, (False, True): 0.070}[alone, backward]
        return {"ms": ms, "how": "graph", "eager_ms": 2 * ms, "queued_ms": ms}

    _gpu_stand_in(monkeypatch)
    monkeypatch.setattr(bench, "shape_inputs", _cpu_inputs)
    monkeypatch.setattr(bench, "_copy_bandwidth", lambda do_bench: 1e12)
    monkeypatch.setattr(bench, "time_impl", time_impl)
    assert main(["bench", "op", "--shapes", "DiT-XL/2 256px", "--impls", "linear", "--in-layer"]) == 0
    assert calls == [("projections", False), ("projections", True), ("linear", False), ("linear", True)]
    out = capsys.readouterr().out
    assert "less those projections alone" in out
    fwd, fwdbwd = (line for line in out.splitlines() if line.startswith("| DiT-XL/2 256px |"))
    assert fwd.endswith(" | 0.0150 |") and fwdbwd.endswith(" | 0.0300 |")


def test_versus_in_layer_takes_each_round_less_its_projections(monkeypatch, capsys):
    """`--versus --in-layer`: MHLA runs between the layer's projections, which each round times alone first; a
    candidate's time is its own less that round's. Stand-ins: MHLA (the op itself runs on a GPU) and GPU time
    (projections 0.010 / 0.040 ms in round r + 1 of the warm-up's 0, plus 0.001 r; the layer with MHLA that plus
    0.005 / 0.020, doubled under the candidate)."""
    from mhla_diffusion import ops
    from mhla_diffusion.kernels import parallel

    rounds = []

    def time_op(do_bench, fn, leaves, do, backward):
        alone = _projections_alone(fn, leaves)
        if alone and not backward:
            rounds.append(len(rounds))
        base = (0.010, 0.040)[backward] + 0.001 * rounds[-1]
        return base if alone else base + (0.005, 0.020)[backward] * (1 + (parallel.CONFIG["max_tokens"] == 1024))

    _gpu_stand_in(monkeypatch)
    monkeypatch.setattr(bench, "shape_inputs", _cpu_inputs)
    monkeypatch.setattr(bench, "time_op", time_op)
    monkeypatch.setattr(ops, "mhla_attention", lambda q, k, v, mix, grid, blocks, backend: bench.global_linear(q, k, v))
    assert main(["bench", "op", "--shapes", "DiT-XL/2 256px", "--rounds", "2", "--in-layer",
                 "--versus", "parallel.CONFIG.max_tokens=1024"]) == 0
    assert rounds == [0, 1, 2]  # the warm-up round, then two
    out = capsys.readouterr().out
    assert "less those projections alone" in out
    rows = [line for line in out.splitlines() if line.startswith("| DiT")]
    assert rows[0] == ("| DiT-XL/2 256px | 256 | as run | 0.00500 (0.00500-0.00500) | 1.000 | 0.0200 (0.0200-0.0200) "
                       "| 1.000 |")
    assert rows[1].startswith("| DiT-XL/2 256px | 256 | parallel.CONFIG.max_tokens=1024 | 0.0100 (0.0100-0.0100) "
                              "| 2.000 |")
