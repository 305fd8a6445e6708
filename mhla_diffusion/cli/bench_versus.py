"""`bench op --versus`: MHLA's launch settings A/B'd in one process, in alternation, each with its own spread.

Why: separate `bench op --set` runs differ by the GPU's state between processes, and at DiT's 8-30 us a change of
a few percent is inside that (session 44: the same code printed 0.087-0.092 ms in three runs). Here every candidate
is timed on the same inputs, in turn, `rounds` times, and the table gives each one's median and range beside the
shipped settings' own: a difference smaller than the shipped settings' range is noise.
"""

from __future__ import annotations

import statistics

import torch

PASSES = (("fwd", False), ("fwdbwd", True))


def candidate_settings(candidates: list[str]) -> list[list[str]]:
    """Each candidate's settings, TABLE.KEY=VALUE joined by ';' (no Python literal of a table holds one), every one
    checked as `--set` checks its own: a candidate that would fail is refused before anything is timed."""
    from ..kernels.overrides import parse

    split = [[part.strip() for part in candidate.split(";") if part.strip()] for candidate in candidates]
    for settings in split:
        if not settings:
            raise ValueError("--versus: an empty candidate; give TABLE.KEY=VALUE settings, several joined by ';'")
        for setting in settings:
            parse(setting)
    return split


def versus_row(shape, dtype: torch.dtype, batch: int, candidates: list[list[str]], rounds: int) -> dict:
    """GPU times (CUDA-graph replay, ms) of MHLA on one shape's inputs under the settings in force (index 0) and
    under each candidate's on top of them, forward and forward+backward, every round timing each in turn."""
    from triton.testing import do_bench_cudagraph

    from ..kernels.overrides import overridden
    from .bench import _time_op, implementations, shape_inputs

    geometry, (q, k, v, do), mix, rope = shape_inputs(shape, dtype, batch)
    leaves = [t.requires_grad_() for t in (q, k, v, mix)]
    fn = implementations(shape, geometry.blocks, rope)["mhla"]
    settings = [[], *candidates]
    times = [{key: [] for key, _ in PASSES} for _ in settings]
    for _ in range(rounds):
        for changed, timed in zip(settings, times):
            with overridden(changed):
                for key, backward in PASSES:
                    timed[key].append(_time_op(do_bench_cudagraph, fn, leaves, do, backward))
        torch.cuda.empty_cache()
    return {"shape": shape.name, "N": geometry.num_tokens, "settings": settings, "times": times}


def versus_table(rows: list[dict], device: str, dtype: str, batch: int, rounds: int) -> str:
    """A line per shape and settings: median (range) over the rounds, and the median against the first line's."""
    lines = [f"{device}, {dtype}, B = {batch}: MHLA's GPU time in ms (CUDA-graph replay), median of {rounds} rounds "
             "(min-max), every settings timed in turn each round; '/ as run': median over the first line's (the "
             "settings in force), > 1 slower. A difference inside the first line's range is noise.", "",
             "| shape | N | settings | forward | / as run | forward+backward | / as run |", "|---" * 7 + "|"]
    return "\n".join(lines + [line for r in rows for line in versus_lines(r)])


def versus_lines(row: dict) -> list[str]:
    """The table's lines of one shape: printed as each shape finishes too, so a run cut short keeps them."""
    from .bench import _ms

    base = {key: statistics.median(row["times"][0][key]) for key, _ in PASSES}
    lines = []
    for changed, timed in zip(row["settings"], row["times"]):
        cells = []
        for key, _ in PASSES:
            median = statistics.median(timed[key])
            cells += [f"{_ms(median)} ({_ms(min(timed[key]))}-{_ms(max(timed[key]))})", f"{median / base[key]:.3f}"]
        lines.append(f"| {row['shape']} | {row['N']:,} | {'; '.join(changed) or 'as run'} | " + " | ".join(cells)
                     + " |")
    return lines
