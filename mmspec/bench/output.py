"""Write a bench result to its output directory: results.jsonl, summary.json, summary.md and the PNG plots.

Each file is replaced atomically, so calling `write_outputs` after every batch size (plotting only the batch
size just completed) leaves a consistent set of partial results if a long run is interrupted.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path
from typing import Any

from mmspec.bench.files import atomic_write_text
from mmspec.bench.records import to_jsonl
from mmspec.bench.report import summarize, summary_json, summary_markdown
from mmspec.bench.runner import BenchResult

RESULTS_FILE = "results.jsonl"
SUMMARY_JSON = "summary.json"
SUMMARY_MD = "summary.md"


def write_outputs(result: BenchResult, out_dir: str | os.PathLike, *, plots: bool = True,
                  plot_batch_sizes: Collection[int] | None = None) -> dict[str, Any]:
    """Write every output file of `result` into `out_dir` (which must exist); returns the summary dict.

    `plot_batch_sizes` limits which batch sizes are (re)plotted (default all); the summary links the plots
    of every completed batch size either way.
    """
    out = Path(out_dir)
    summary = summarize(result)
    atomic_write_text(out / RESULTS_FILE, to_jsonl(result.records))
    plot_files: dict[int, list[str]] = {}
    if plots:
        from mmspec.bench.plots import plot_names, write_plots  # matplotlib is imported only for plots

        write_plots(summary, out, plot_batch_sizes)
        plot_files = {b: plot_names(b) for b in result.completed_batch_sizes}
    summary["plots"] = {str(b): names for b, names in plot_files.items()}
    atomic_write_text(out / SUMMARY_JSON, summary_json(summary))
    atomic_write_text(out / SUMMARY_MD, summary_markdown(summary, plot_files))
    return summary
