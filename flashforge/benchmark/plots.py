"""PNG charts of the rows (matplotlib is imported only to draw one; without it a plot is a message, not an
error)."""

from __future__ import annotations

import os
from typing import Optional, Sequence

from .cases import fmt_len
from .report import SHORT, peer_columns, short_error


def _impl_series(rows: Sequence[dict]) -> list:
    return ["ours"] + peer_columns(rows)


def _value(row: dict, impl: str) -> Optional[float]:
    return row["ours"] if impl == "ours" else row["peers"].get(impl)


def plot_rows(rows: Sequence[dict], path: str, title: str) -> Optional[str]:
    """Write a PNG of the rows; returns None, or why it could not (matplotlib missing, nothing to plot).

    fwd/fwdbwd: TFLOP/s against S, one panel per (head dim, causal).  Anything else: grouped bars
    (one group per row, one bar per implementation), one panel per unit.  all: ratios."""
    rows = [r for r in rows if r["ours"] is not None or any(v is not None for v in r["peers"].values())]
    if not rows:
        return "nothing to plot"
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # ImportError, or a broken install
        return f"matplotlib unavailable ({type(e).__name__}: {e})"
    suites = {r["suite"] for r in rows}
    if len(suites) > 1:
        fig = _plot_ratios(plt, rows, title)
    elif suites <= {"fwd", "fwdbwd"}:
        fig = _plot_grid(plt, rows, title)
    elif suites == {"decode"}:
        fig = _plot_decode(plt, rows, title)
    else:
        fig = _plot_bars(plt, rows, title)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return None


def _plot_grid(plt, rows, title):
    panels = sorted({(r["case"]["D"], r["case"]["causal"]) for r in rows})
    ncol = 2 if len(panels) > 1 else 1
    nrow = -(-len(panels) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(6 * ncol, 4 * nrow), squeeze=False)
    for ax, (D, causal) in zip(axes.flat, panels):
        sub = sorted((r for r in rows if r["case"]["D"] == D and r["case"]["causal"] == causal),
                     key=lambda r: r["case"]["Sq"])
        for impl in _impl_series(sub):
            pts = [(r["case"]["Sq"], _value(r, impl)) for r in sub if _value(r, impl) is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                        linewidth=2.5 if impl == "ours" else 1.2, label=SHORT.get(impl, impl))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_ylabel(sub[0]["unit"] if sub else "")
        ax.set_title(f"D={D} {'causal' if causal else 'non-causal'}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def _plot_bars(plt, rows, title):
    units = sorted({r["unit"] for r in rows})
    fig, axes = plt.subplots(len(units), 1, figsize=(max(8, 0.9 * len(rows) + 3), 4.5 * len(units)), squeeze=False)
    for ax, unit in zip(axes.flat, units):
        sub = [r for r in rows if r["unit"] == unit]
        impls = _impl_series(sub)
        width = 0.8 / len(impls)
        for i, impl in enumerate(impls):
            xs = [j + (i - (len(impls) - 1) / 2) * width for j in range(len(sub))]
            ys = [_value(r, impl) or 0.0 for r in sub]
            ax.bar(xs, ys, width, label=SHORT.get(impl, impl))
        ax.set_xticks(range(len(sub)))
        ax.set_xticklabels([f"{r['name']}\n{r['pass']}" for r in sub], rotation=45, ha="right", fontsize=7)
        ax.set_ylabel(unit)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def _plot_decode(plt, rows, title):
    """One panel per batch size; groups = cache length; bars = ours contiguous / paged and each peer."""
    batches = sorted({r["case"]["B"] for r in rows})
    ncol = 2 if len(batches) > 1 else 1
    nrow = -(-len(batches) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(7 * ncol, 3.8 * nrow), squeeze=False)
    for ax, B in zip(axes.flat, batches):
        sub = [r for r in rows if r["case"]["B"] == B]
        caches = sorted({r["case"]["Sk"] for r in sub})
        series = {"ours contiguous": {}, "ours paged": {}}
        for r in sub:
            L = r["case"]["Sk"]
            series["ours " + r["case"].get("layout", "contiguous")][L] = r["ours"]
            for n, v in r["peers"].items():
                series.setdefault(n, {})[L] = v
        width = 0.8 / len(series)
        for i, (name, vals) in enumerate(series.items()):
            xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(caches))]
            ax.bar(xs, [vals.get(L) or 0.0 for L in caches], width, label=SHORT.get(name, name))
        ax.set_xticks(range(len(caches)))
        ax.set_xticklabels([f"cache {fmt_len(L)}" for L in caches])
        ax.set_ylabel("GB/s (K+V bytes / time)")
        ax.set_title(f"B={B}")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(batches):]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def _plot_ratios(plt, rows, title):
    rows = [r for r in rows if r["ratio"] is not None]
    fig, ax = plt.subplots(figsize=(9, max(3, 0.22 * len(rows) + 1)))
    ys = range(len(rows))
    colors = [{"fa4": "tab:green", "cudnn": "tab:blue"}.get(r["ratio_to"], "tab:orange") for r in rows]
    ax.barh(list(ys), [r["ratio"] for r in rows], color=colors)
    ax.set_yticks(list(ys))
    ax.set_yticklabels([f"{r['suite']}: {r['name']} {r['pass']} (vs {SHORT.get(r['ratio_to'], r['ratio_to'])})"
                        for r in rows], fontsize=6)
    ax.axvline(1.0, color="k", linewidth=0.8)
    ax.invert_yaxis()
    ax.set_xlabel("ours / the faster of FA4 (green) and cuDNN (blue), else / the best peer (orange); "
                  "GiB rows: lower is better")
    ax.set_title(title)
    fig.tight_layout()
    return fig


def safe_plot(rows, path, title) -> Optional[str]:
    try:
        return plot_rows(rows, path, title)
    except Exception as e:  # a plot must never cost the numbers
        return short_error(e)
