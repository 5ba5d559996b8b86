"""PNG plots of a bench summary (matplotlib, Agg backend), one set per batch size:

- `speedup_vs_quality_bs{B}.png`: median wall-clock speed-up (bars: min–max over passes) against the family's
  primary quality figure; methods whose figure is not a number (e.g. 'n/a (sampling)') are listed, not drawn.
  When no method has a numeric figure, or every method has the same one (all exact), a bar chart of
  speed-ups is drawn instead, with the common figure in the title.
- `acceptance_per_position_bs{B}.png`: per-position acceptance rate (drafts accepted at position i / drafts
  that had a position i), one line per method that drafts.
- `acceptance_histogram_bs{B}.png`: per method, the fraction of verify calls that accepted exactly n drafts.

Every file is written atomically (temporary file + rename).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after selecting the backend)
from matplotlib.ticker import MaxNLocator  # noqa: E402

from mmspec.bench.files import atomic_write  # noqa: E402


def _save(fig, path: Path) -> Path:
    atomic_write(path, lambda handle: fig.savefig(handle, format="png", dpi=100), binary=True)
    plt.close(fig)
    return path


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def plot_speedup_vs_quality(rows: Sequence[Mapping[str, Any]], quality_key: str | None, title: str,
                            path: Path) -> Path:
    """Speed-up (median, min–max bars) against `quality_key`; a bar chart when no figure is numeric."""
    fig, ax = plt.subplots(figsize=(6, 4), layout="constrained")
    numeric = [bool(quality_key) and _is_number(r["quality"].get(quality_key)) for r in rows]
    points = [r for r, ok in zip(rows, numeric) if ok]
    skipped = [r for r, ok in zip(rows, numeric) if not ok]
    distinct = {r["quality"][quality_key] for r in points}
    if len(distinct) == 1 and len(points) > 1:  # every point on one vertical line: draw bars, say the value
        title = f"{title}\nevery plotted method: {quality_key}={next(iter(distinct)):.3f}"
        points = []
    if points:
        for r in points:
            sp, x = r["speedup"], r["quality"][quality_key]
            ax.errorbar([x], [sp["median"]], yerr=[[sp["median"] - sp["min"]], [sp["max"] - sp["median"]]],
                        fmt="o" if r["lossless"] else "s", capsize=3, label=r["method"])
            ax.annotate(r["method"], (x, sp["median"]), textcoords="offset points", xytext=(5, 4), fontsize=8)
        ax.set_xlabel(f"{quality_key} (o lossless, s lossy)")
        ax.legend(fontsize=7, loc="best")
    else:
        labels = [r["method"] for r in rows]
        medians = [r["speedup"]["median"] for r in rows]
        low = [r["speedup"]["median"] - r["speedup"]["min"] for r in rows]
        high = [r["speedup"]["max"] - r["speedup"]["median"] for r in rows]
        colors = ["tab:blue" if r["lossless"] else "tab:orange" for r in rows]
        ax.bar(labels, medians, yerr=[low, high], capsize=3, color=colors)
        ax.tick_params(axis="x", labelrotation=30)
        ax.set_xlabel("method (blue lossless, orange lossy)")
    if skipped:
        reason = ", ".join(f"{r['method']}: {r['quality'].get(quality_key, 'n/a')}" for r in skipped)
        ax.text(0.01, 0.01, f"quality not numeric ({reason})", transform=ax.transAxes, fontsize=7, va="bottom")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_ylabel("wall-clock speed-up vs vanilla")
    ax.set_title(title, fontsize=9)
    return _save(fig, path)


def per_position_figure(rows: Sequence[Mapping[str, Any]], title: str, empty: str = "no method drafted tokens"):
    """A matplotlib figure of the per-position acceptance rate, one line per drafting method (rows: dicts with
    "method" and "per_position_acceptance_rate"; `empty`: the text shown when no method drafted); the caller closes
    or saves it."""
    fig, ax = plt.subplots(figsize=(6, 4), layout="constrained")
    drawn = 0
    for r in rows:
        rates = r["per_position_acceptance_rate"]
        if rates:
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=r["method"])
            drawn += 1
    if drawn:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, empty, ha="center", wrap=True, transform=ax.transAxes)
    ax.set_ylim(0, 1.05)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("draft position (1 = first drafted token; trees: depth)")
    ax.set_ylabel("acceptance rate")
    ax.set_title(title, fontsize=9)
    return fig


def plot_per_position(rows: Sequence[Mapping[str, Any]], title: str, path: Path) -> Path:
    """Per-position acceptance rate, one line per drafting method, saved as a PNG."""
    return _save(per_position_figure(rows, title), path)


def plot_histograms(rows: Sequence[Mapping[str, Any]], title: str, path: Path) -> Path:
    """One panel per drafting method: fraction of verify calls accepting exactly n drafts."""
    drafting = [r for r in rows if r["acceptance_histogram"]]
    n = max(len(drafting), 1)
    cols = min(n, 3)
    nrows = math.ceil(n / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.2 * cols, 2.6 * nrows), squeeze=False, layout="constrained")
    for ax, r in zip(axes.flat, drafting):
        hist = r["acceptance_histogram"]
        total = sum(hist) or 1
        ax.bar(range(len(hist)), [h / total for h in hist])
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(f"{r['method']} (mean len {r['mean_acceptance_length']:.2f})", fontsize=8)
        ax.set_xlabel("accepted drafts per verify call", fontsize=7)
        ax.set_ylabel("fraction", fontsize=7)
    for ax in list(axes.flat)[len(drafting):]:
        ax.axis("off")
    if not drafting:
        axes.flat[0].text(0.5, 0.5, "no method drafted tokens", ha="center", transform=axes.flat[0].transAxes)
    fig.suptitle(title, fontsize=9)
    return _save(fig, path)


def plot_names(batch_size: int) -> list[str]:
    """The plot files of one batch size (relative to the output directory)."""
    return [f"{stem}_bs{batch_size}.png" for stem in ("speedup_vs_quality", "acceptance_per_position",
                                                        "acceptance_histogram")]


def write_plots(summary: Mapping[str, Any], out_dir: Path,
                batch_sizes: Collection[int] | None = None) -> dict[int, list[str]]:
    """The plots of `batch_sizes` (default: every batch size in the summary); returns batch size -> names."""
    written: dict[int, list[str]] = {}
    for table in summary["batch_sizes"]:
        b, rows = table["batch_size"], [r for r in table["methods"] if "failed" not in r]
        if batch_sizes is not None and b not in batch_sizes:
            continue
        title = f"{summary['family']} · batch size {b} · temperature {summary['settings']['temperature']:g}"
        speed, per_position, histogram = (out_dir / name for name in plot_names(b))
        plot_speedup_vs_quality(rows, summary.get("primary_quality"), title, speed)
        plot_per_position(rows, title, per_position)
        plot_histograms(rows, title, histogram)
        written[b] = plot_names(b)
    return written
