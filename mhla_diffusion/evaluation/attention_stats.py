"""Rank and entropy of effective attention matrices: the global-context-collapse diagnostic.

For one layer's q, k (N, heads, D) three row-stochastic N x N matrices are formed per head:
  softmax: softmax(q k^T / sqrt(D)), what the original layer computes (RoPE applied if used);
  linear:  phi(q) phi(k)^T, rows normalized (rank <= D: the collapse);
  mhla:    Mc[b(n), b(j)] phi(q_n) . phi(k_j), rows normalized (rank up to M*D).
RoPE is left out of linear and MHLA, whose weights must stay non-negative to form rows.
Rank is numerical (singular values above `rtol` * the largest), entropy is the mean row
entropy in nats; both are averaged over heads. Only every s-th query row is kept when N is
above `max_queries`, so huge layers stay tractable (rank is then that of the row subset).
"""

from __future__ import annotations

import math

import torch

from ..blocks import block_layout
from ..ops.feature_maps import feature_map
from ..ops.naive import apply_rope
from .attention_capture import LayerCapture

KINDS = ("softmax", "linear", "mhla")


def rows_normalized(weights: torch.Tensor) -> torch.Tensor:
    """Rows scaled to sum 1; rows with no mass (phi(q) = 0) stay zero."""
    total = weights.sum(-1, keepdim=True)
    return torch.where(total > 0, weights / total.clamp_min(1e-300), torch.zeros_like(weights))


def attention_matrices(cap: LayerCapture, query_rows: torch.Tensor, kinds=KINDS) -> dict[str, torch.Tensor]:
    """The (heads, n_queries, N) float64 matrices of one layer, of each of `kinds`."""
    q, k = cap.q.double(), cap.k.double()
    out = {}
    if "softmax" in kinds:
        rq, rk = (apply_rope(q, cap.rope), apply_rope(k, cap.rope)) if cap.rope is not None else (q, k)
        out["softmax"] = (torch.einsum("nhd,jhd->hnj", rq[query_rows], rk) / math.sqrt(q.shape[-1])).softmax(-1)
    if "linear" in kinds or "mhla" in kinds:
        phi = feature_map(cap.feature)
        kernel = torch.einsum("nhd,jhd->hnj", phi(q)[query_rows], phi(k))
        if "linear" in kinds:
            out["linear"] = rows_normalized(kernel)
        if "mhla" in kinds:
            block = block_layout(cap.grid, cap.blocks).token_block
            out["mhla"] = rows_normalized(cap.mix.double()[block[query_rows]][:, block] * kernel)
    return out


def numerical_rank(a: torch.Tensor, rtol: float) -> torch.Tensor:
    """(heads,) count of singular values above rtol * the largest."""
    s = torch.linalg.svdvals(a)
    return (s > rtol * s[..., :1]).sum(-1)


def row_entropy(a: torch.Tensor) -> torch.Tensor:
    """(heads,) mean entropy (nats) over rows that carry mass."""
    h = -(a * torch.log(a.clamp_min(1e-300))).sum(-1)
    alive = a.sum(-1) > 0
    return (h * alive).sum(-1) / alive.sum(-1).clamp_min(1)


def layer_stats(cap: LayerCapture, rtol: float = 1e-6, max_queries: int = 1024, kinds=KINDS) -> dict:
    n, heads, d = cap.q.shape
    query_rows = torch.arange(0, n, max(1, math.ceil(n / max_queries)))
    stats = {"tokens": n, "heads": heads, "head_dim": d, "grid": list(cap.grid), "blocks": list(cap.blocks),
             "num_blocks": math.prod(cap.blocks), "queries": len(query_rows), "max_entropy": math.log(n)}
    for kind, a in attention_matrices(cap, query_rows, kinds).items():
        stats[f"{kind}_rank"] = numerical_rank(a, rtol).double().mean().item()
        stats[f"{kind}_entropy"] = row_entropy(a).mean().item()
    return stats


def format_table(rows: dict[str, dict]) -> str:
    """Plain-text table: one line per layer, rank and entropy of each matrix."""
    head = f"{'layer':<40} {'N':>6} {'D':>4} {'M':>4} " + " ".join(f"{k + ' rank':>12}" for k in KINDS) + " " + " ".join(f"{k + ' H':>10}" for k in KINDS)
    lines = [head, "-" * len(head)]
    for name, r in rows.items():
        lines.append(
            f"{name:<40} {r['tokens']:>6} {r['head_dim']:>4} {r['num_blocks']:>4} "
            + " ".join(f"{r[k + '_rank']:>12.1f}" for k in KINDS) + " "
            + " ".join(f"{r[k + '_entropy']:>10.3f}" for k in KINDS)
        )
    return "\n".join(lines)


def plot(rows: dict[str, dict], path) -> None:
    """Rank and entropy per layer, one line per matrix kind (PNG, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = range(len(rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric, label in ((axes[0], "rank", "numerical rank (mean over heads)"), (axes[1], "entropy", "row entropy, nats")):
        for kind, marker in zip(KINDS, "o^s"):
            ax.plot(x, [r[f"{kind}_{metric}"] for r in rows.values()], marker=marker, label=kind)
        ax.set_xticks(list(x))
        ax.set_xlabel("converted layer")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    d = [r["head_dim"] for r in rows.values()]
    axes[0].plot(x, d, "k--", linewidth=1, label="head dim D")
    axes[1].plot(x, [r["max_entropy"] for r in rows.values()], "k--", linewidth=1, label="log N (uniform)")
    for ax in axes:
        ax.legend()
    fig.suptitle("Effective attention: softmax vs linear vs MHLA")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
