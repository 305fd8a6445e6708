"""`bench op --versus`: MHLA's launch settings A/B'd in one process, in turn, each with its own spread.

Why: separate `bench op --set` runs differ by the GPU's state between processes, and at DiT's 8-30 us a change of
a few percent is inside that (session 44: the same code printed 0.087-0.092 ms in three runs). Here every candidate
is timed on the same inputs, in turn (the order rotating each round, after an untimed warm-up round), and the table
gives each one's median and range beside the shipped settings' own: a difference inside that range is noise.
"""

from __future__ import annotations

import math
import statistics

import torch
from triton.runtime.errors import OutOfResources

from .bench_layer import IN_LAYER, layer_leaves, layer_of, projections_only

PASSES = (("fwd", False), ("fwdbwd", True))
# The tables plain MHLA (no RoPE, no norms: what --versus times) reads; ROPE_CONFIG and rms_norm's would print "no
# change" whatever they held.
PLAIN_TABLES = ("compiled.CONFIG", "mhla.CONFIG", "mhla.SHORT_CONFIG", "mhla.SHORTEST_CONFIG", "parallel.CONFIG")


def candidate_settings(candidates: list[str]) -> list[list[str]]:
    """Each candidate's settings, TABLE.KEY=VALUE joined by ';' (no Python literal of a table holds one), every one
    checked as `--set` checks its own: a candidate that would fail is refused before anything is timed."""
    from ..kernels.overrides import parse

    split = [[part.strip() for part in candidate.split(";") if part.strip()] for candidate in candidates]
    for settings in split:
        if not settings:
            raise ValueError("--versus: an empty candidate; give TABLE.KEY=VALUE settings, several joined by ';'")
        for setting in settings:
            table = parse(setting)[0]
            if table not in PLAIN_TABLES:
                raise ValueError(f"--versus times MHLA without RoPE or norms, which never reads {table}: compare "
                                 "that with `bench op --set` runs on a Wan shape")
    return split


def versus_row(shape, dtype: torch.dtype, batch: int, candidates: list[list[str]], rounds: int,
               in_layer: bool = False) -> dict:
    """GPU times (CUDA-graph replay, ms) of MHLA on one shape's inputs under the settings in force (index 0) and
    under each candidate's on top of them, forward and forward+backward. Round r times them in turn starting at the
    r-th; a warm-up round before is not kept. A settings whose launch fails (e.g. refused by the card) is kept as
    its error, and the others are timed on. `in_layer`: each call inside a layer's projections, less the projections
    alone as timed in the same round (`bench_layer`)."""
    from triton.testing import do_bench_cudagraph

    from ..kernels.overrides import overridden
    from ..ops import mhla_attention
    from .bench import shape_inputs, time_op

    geometry, (q, k, v, do), mix, _ = shape_inputs(shape, dtype, batch)
    leaves = [t.requires_grad_() for t in (q, k, v, mix)]

    def fn(q, k, v, mix):
        return mhla_attention(q, k, v, mix, shape.grid, geometry.blocks, backend="triton")

    if in_layer:
        leaves, do = layer_leaves(q, do, mix)
        fn, projections = layer_of(fn, shape.heads), layer_of(projections_only, shape.heads)
    settings = [[], *candidates]
    times = [{key: [] for key, _ in PASSES} for _ in settings]
    errors = [None] * len(settings)
    for r in range(-1, rounds):
        base = [time_op(do_bench_cudagraph, projections, leaves, do, backward) if in_layer else 0.0
                for _, backward in PASSES]
        for i in ((r + j) % len(settings) for j in range(len(settings))):
            if errors[i] is not None:
                continue
            with overridden(settings[i]):
                try:
                    timed = [time_op(do_bench_cudagraph, fn, leaves, do, backward) for _, backward in PASSES]
                except (RuntimeError, OutOfResources) as err:
                    errors[i] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                    continue
            if r >= 0:
                for (key, _), ms, less in zip(PASSES, timed, base):
                    times[i][key].append(ms - less)
        torch.cuda.empty_cache()
    return {"shape": shape.name, "N": geometry.num_tokens, "settings": settings, "times": times, "errors": errors}


def versus_table(rows: list[dict], device: str, dtype: str, batch: int, rounds: int, in_layer: bool = False) -> str:
    """A line per shape and settings: median (range) over the rounds, and the median against the first line's."""
    lines = [f"{device}, {dtype}, B = {batch}: MHLA's GPU time in ms (CUDA-graph replay), median of {rounds} rounds "
             "(min-max), the settings timed in turn each round after a warm-up round; '/ as run': median over the "
             "first line's (the settings in force), > 1 slower. A difference inside the first line's range is noise."
             + (" " + IN_LAYER if in_layer else ""),
             "", "| shape | N | settings | forward | / as run | forward+backward | / as run |", "|---" * 7 + "|"]
    failed = [f"{r['shape']}, {'; '.join(s) or 'as run'}: {e}" for r in rows for s, e in zip(r["settings"], r["errors"])
              if e is not None]
    return "\n".join(lines + [line for r in rows for line in versus_lines(r)] + (["", "Failed: " + "; ".join(failed)]
                                                                                  if failed else []))


def versus_lines(row: dict) -> list[str]:
    """The table's lines of one shape: printed as each shape finishes too, so a run cut short keeps them."""
    from .bench import ms_text

    def median(values):
        return statistics.median(values) if values else math.nan

    base = {key: median(row["times"][0][key]) for key, _ in PASSES}
    lines = []
    for changed, timed, error in zip(row["settings"], row["times"], row["errors"]):
        cells = []
        for key, _ in PASSES:
            if error is not None:
                cells += ["fail", ""]
                continue
            cells += [f"{ms_text(median(timed[key]))} ({ms_text(min(timed[key]))}-{ms_text(max(timed[key]))})",
                      f"{median(timed[key]) / base[key]:.3f}"]
        lines.append(f"| {row['shape']} | {row['N']:,} | {'; '.join(changed) or 'as run'} | " + " | ".join(cells)
                     + " |")
    return lines
