"""`eval attention`: one sample through a converted pipeline, attention stats per MHLA layer."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from . import attention_stats
from .attention_capture import record_attention
from .sampling import SamplingSettings, generate, load_pipeline


def run_attention(model, out, settings: SamplingSettings, *, step: int = -1, rtol: float = 1e-6,
                  max_queries: int = 1024, torch_dtype=None, device="cpu") -> dict:
    """Sample 0 without guidance (one transformer call per step, the sample's own activations),
    recorded at denoising step `step` (-1: last); writes attention.json, attention.txt, attention.png."""
    pipe = load_pipeline(model, torch_dtype).to(device)
    pipe.set_progress_bar_config(disable=True)
    with record_attention(pipe.transformer, call=step) as captures:
        generate(pipe, [0], replace(settings, guidance_scale=1.0))
    if not captures:
        raise ValueError(f"denoising step {step} was never reached: the pipeline ran fewer steps")
    rows = {name.removesuffix(".processor"): attention_stats.layer_stats(cap, rtol, max_queries) for name, cap in captures.items()}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    table = attention_stats.format_table(rows)
    (out / "attention.txt").write_text(table + "\n")
    attention_stats.plot(rows, out / "attention.png")
    report = {"model": str(model), "step": step, "rank_rtol": rtol, "max_queries": max_queries,
              "settings": settings.to_dict(), "layers": rows, "table": str(out / "attention.txt"), "plot": str(out / "attention.png")}
    (out / "attention.json").write_text(json.dumps(report, indent=2))
    return report
