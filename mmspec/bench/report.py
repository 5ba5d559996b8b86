"""Summaries of a bench run: per batch size and configuration, the figures of summary.md / summary.json.

Definitions (per batch size; a "pass" is one configuration over every sample, see `mmspec.bench.runner`):

- target forwards: sum over the pass's batches of the batch's target forwards (NFE, prefill included).
- step compression: vanilla's target forwards / the method's, in the same pass (median over passes; None
  when the method reports no target forwards).
- mean acceptance length: tokens emitted per drafting row-iteration (a row's verify call with >= 1 draft token;
  plain steps left out), bonus included: 1 + accepted / drafting row-iterations (vLLM's; vanilla: 1.0).
- draft acceptance rate: accepted / drafted tokens (None when nothing was drafted).
- speed-up: vanilla's wall time / the method's wall time in the same pass; min, median and max over passes.
- tokens/s: new tokens of the pass / its wall time (median over passes).
- peak memory: the largest per-batch peak over every pass (see `mmspec.bench.memory` for what it measures).
- quality: the family's figures, numbers averaged over passes (text figures shown as they are).
- budget_steps: the draft sizes a draft budget chose, steps per pass; budget_notice: one line when the budget kept
  the method from drafting on most of its steps (`mmspec.stats.budget_notice`, printed on stderr), else None.
- phases (with --phase-times): the share of the recorded passes' wall time spent in each loop phase
  (`mmspec.phases.PHASES`), "other" for the rest (the pipeline around the loop: conditioning, the drafter's own
  prefill, decoding images, loop bookkeeping), and milliseconds per call of `verify` (one target forward over the
  draft) and `draft` (one proposal, all the drafter's forwards of an iteration). Absent for methods that do not
  run the shared loop (VAR/CoDe, MAR/CSpD).
- ideal speed-up (with phase times): vanilla's model seconds / the method's in the same pass, model seconds being
  the loop's prefill + verify + draft phases (the target's and the drafter's forwards, with the little host work in
  them, e.g. building a tree): the speed-up if nothing but those cost time. system efficiency = speed-up / ideal
  speed-up (median over passes): the share of what the forwards allow that the whole system delivers.
- forced drafts (with --force-acceptance, `mmspec.forced`): the drafts per pass whose tokens the profile set; 0 for
  a method with draft forwards means its acceptance was not forced (it drafts outside the shared loop); forced
  decisions: the verify results the profile decided instead of a rule that is not exact (greedy and coupled rules
  decide themselves), so that method's outputs are vanilla's and only its timing counts.
- operations (with --phase-ops): tensor operations and host syncs dispatched per target forward, by phase and in
  total ("other" also holds the pipeline around the loop, e.g. decoding images), counted on any device
  (`mmspec.phases`, count_ops): the per-step launch and sync overhead a GPU run pays, whatever device measured it.

A configuration that raised at a batch size has a row {"method", "failed": error} there instead.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from mmspec.bench.configs import MethodConfig
from mmspec.bench.runner import BenchResult, RunResult
from mmspec.phases import OUTSIDE, PHASES, PhaseTimes
from mmspec.stats import SpecStats, budget_notice

MIB = 1024 * 1024
INTERLEAVED = {"batch": "per batch (batch i of every method before batch i+1)",
               "pass": "per pass (each method's pass over all batches in turn)"}


def spread(values: Sequence[float]) -> dict[str, float]:
    """{min, median, max} of a non-empty sequence."""
    return {"min": float(min(values)), "median": float(statistics.median(values)), "max": float(max(values))}


def merge_quality(passes: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per figure: the mean over passes when numeric; else the distinct values joined by ' / '."""
    merged: dict[str, Any] = {}
    keys = [k for q in passes for k in q]
    for key in dict.fromkeys(keys):
        values = [q[key] for q in passes if key in q]
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        merged[key] = float(statistics.fmean(values)) if numeric else " / ".join(dict.fromkeys(map(str, values)))
    return merged


def _merged_stats(runs: Sequence[RunResult]) -> SpecStats:
    merged = SpecStats()
    for run in runs:
        merged = merged + run.stats
    return merged


def phase_summary(runs: Sequence[RunResult]) -> dict[str, Any] | None:
    """Shares of the wall time per phase and ms per verify / draft call over `runs` (None if not recorded)."""
    if any(r.phases is None for r in runs):
        return None
    times = sum((r.phases for r in runs), PhaseTimes())
    wall = sum(r.wall_time for r in runs)
    if not times.calls or wall <= 0:
        return None
    share = {name: times.seconds.get(name, 0.0) / wall for name in PHASES}
    share["other"] = max(0.0, 1.0 - sum(share.values()))
    per_call = {f"{name}_ms": 1000 * times.seconds[name] / times.calls[name]
                for name in ("verify", "draft") if times.calls.get(name)}
    summary = {"share": share, **per_call, "calls": dict(times.calls)}
    forwards = sum(r.nfe for r in runs)
    if times.ops and forwards:
        for key, counts in (("ops_per_forward", times.ops), ("syncs_per_forward", times.syncs)):
            per = {name: counts.get(name, 0) / forwards for name in (*PHASES, OUTSIDE)}
            summary[key] = {**per, "total": sum(per.values())}
    return summary


MODEL_PHASES = ("prefill", "verify", "draft")  # the phases that hold the models' forwards


def model_seconds(run: RunResult) -> float | None:
    """The pass's seconds in MODEL_PHASES (None without phase times)."""
    if run.phases is None:
        return None
    return sum(run.phases.seconds.get(name, 0.0) for name in MODEL_PHASES)


def ideal_speedups(runs: Sequence[RunResult], reference: Mapping[int, RunResult]) -> list[float]:
    """Per pass: vanilla's model seconds / the method's (empty without phase times)."""
    pairs = [(model_seconds(reference[r.repeat]), model_seconds(r)) for r in runs]
    return [ours / theirs for ours, theirs in pairs if ours and theirs]


def summarize_config(config: MethodConfig, runs: Sequence[RunResult],
                     reference: Mapping[int, RunResult]) -> dict[str, Any]:
    """The summary row of one configuration at one batch size; `reference` maps repeat -> vanilla's pass."""
    runs = sorted(runs, key=lambda r: r.repeat)
    stats = _merged_stats(runs)
    speedups = [reference[r.repeat].wall_time / r.wall_time for r in runs]
    compressions = [reference[r.repeat].nfe / r.nfe for r in runs if r.nfe > 0]  # a family may not count NFE
    drafted = stats.num_draft_tokens > 0
    ideal = ideal_speedups(runs, reference)
    return {
        "method": config.label,
        "base_method": config.method,
        "params": dict(config.params),
        "lossless": runs[0].lossless,
        "repeats": len(runs),
        "target_forwards": float(statistics.median(r.nfe for r in runs)),
        "draft_forwards": float(statistics.median(r.stats.num_draft_forwards for r in runs)),
        "new_tokens": float(statistics.median(sum(r.new_tokens) for r in runs)),
        "step_compression": float(statistics.median(compressions)) if compressions else None,
        # None (a dash in the tables) when the method records no verify rounds at all (e.g. VAR, MAR vanilla)
        "mean_acceptance_length": stats.mean_acceptance_length or None,
        "draft_acceptance_rate": stats.draft_acceptance_rate if drafted else None,
        "per_position_acceptance_rate": stats.per_position_acceptance_rate if drafted else [],
        "acceptance_histogram": stats.acceptance_histogram if drafted else [],
        "wall_time_s": spread([r.wall_time for r in runs]),
        "speedup": {**spread(speedups), "per_repeat": speedups},
        "tokens_per_s": float(statistics.median(sum(r.new_tokens) / r.wall_time for r in runs)),
        "peak_memory_bytes": int(max(max(r.peak_memory_bytes) for r in runs)),
        "quality": merge_quality([r.quality for r in runs]),
        "phases": phase_summary(runs),
        "ideal_speedup": float(statistics.median(ideal)) if ideal else None,
        "system_efficiency": (float(statistics.median(s / i for s, i in zip(speedups, ideal)))
                              if len(ideal) == len(speedups) else None),
        "forced_drafts": (None if runs[0].forced_drafts is None else
                          float(statistics.median(r.forced_drafts for r in runs))),
        "forced_decisions": (None if runs[0].forced_decisions is None else
                             float(statistics.median(r.forced_decisions for r in runs))),
        "budget_steps": budget_steps(stats, len(runs)),
        "budget_notice": config_budget_notice(config, stats, runs),
    }


def config_budget_notice(config: MethodConfig, stats: SpecStats, runs: Sequence[RunResult]) -> str | None:
    """`budget_notice` of one configuration at one batch size (its passes' merged counts), the hint naming the
    bench's own way to draft every step (the method parameter `budget=fixed`)."""
    passes = f"{len(runs)} pass{'' if len(runs) == 1 else 'es'}"
    hint = f"--methods {config.method}:budget=fixed" if "budget" in config.params else "budget=fixed"
    return budget_notice(stats, f"{config.label} (batch size {runs[0].batch_size}, {passes})", hint)


def budget_steps(stats: SpecStats, passes: int) -> dict[str, float]:
    """Steps per pass at each draft size a budget chose (`budget="auto"`; the loop's `budget_<size>` counts), most
    used first; empty without a budget."""
    counts = {key[len("budget_"):]: value / passes for key, value in stats.extra.items() if key.startswith("budget_")}
    return dict(sorted(counts.items(), key=lambda item: -item[1]))


def budget_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Per method with a draft budget: the sizes it chose and how many steps each (per recorded pass)."""
    lines = [f"| {row['method']} | " + ", ".join(f"{size} ({count:g})" for size, count in row["budget_steps"].items())
             + " |" for row in rows if row.get("budget_steps")]
    if not lines:
        return ""
    return "| method | draft sizes chosen (steps per pass; 0 = a plain step) |\n|---|---|\n" + "\n".join(lines) + "\n"


def failed_row(config: MethodConfig, error: str) -> dict[str, Any]:
    """The summary row of a configuration that raised at this batch size."""
    return {"method": config.label, "base_method": config.method, "params": dict(config.params), "failed": error}


def summarize(result: BenchResult) -> dict[str, Any]:
    """summary.json: settings, environment and one table (list of rows) per completed batch size."""
    tables = []
    for batch_size in result.completed_batch_sizes:
        runs = [r for r in result.runs if r.batch_size == batch_size]
        reference = {r.repeat: r for r in runs if r.config.is_reference}
        failed = result.failures.get(batch_size, {})
        rows = [failed_row(c, failed[c.label]) if c.label in failed else
                summarize_config(c, [r for r in runs if r.config.label == c.label], reference)
                for c in result.configs]
        tables.append({"batch_size": batch_size, "methods": rows})
    s = result.settings
    return {
        "family": result.family,
        "model_id": result.model_id,
        "command": result.command,
        "settings": {"num_samples": s.num_samples, "max_new_tokens": s.max_new_tokens,
                     "temperature": s.temperature, "seed": s.seed, "device": s.device, "options": dict(s.options),
                     "batch_sizes": result.batch_sizes, "repeats": result.repeats, "warmup": result.warmup,
                     "interleave": result.interleave,
                     "force_acceptance": None if result.forcing is None else result.forcing.source},
        "memory_kind": result.memory_kind,
        "primary_quality": result.primary_quality,
        "environment": result.environment,
        "batch_sizes": tables,
        "failures": result.failure_list(),
    }


# ------------------------------------------------------------------------------------------ markdown
def format_quality(quality: Mapping[str, Any]) -> str:
    """'exactness=1.000' style (small figures such as p-values in 3 significant digits); text verbatim."""
    if not quality:
        return "—"

    def number(v: float) -> str:
        return f"{v:.3g}" if 0 < abs(v) < 0.001 else f"{v:.3f}"

    parts = [f"{k}={number(v)}" if isinstance(v, float) else f"{k}={v}" for k, v in quality.items()]
    return ", ".join(parts)


def _fmt(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


TABLE_COLUMNS = ("method", "lossless", "target fwd", "step compression", "mean acc. length", "draft acc. rate",
                 "speed-up median (min–max)", "tokens/s", "peak mem (MiB)", "quality")


def markdown_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """One markdown table, one row per configuration."""
    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "|".join("---" for _ in TABLE_COLUMNS) + "|"]
    for row in rows:
        if "failed" in row:
            cells = [row["method"], f"FAILED: {row['failed']}"] + [""] * (len(TABLE_COLUMNS) - 2)
            lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
            continue
        sp = row["speedup"]
        cells = [row["method"], "yes" if row["lossless"] else "no", f"{row['target_forwards']:.0f}",
                 _fmt(row["step_compression"]) + ("x" if row["step_compression"] is not None else ""),
                 _fmt(row["mean_acceptance_length"]),
                 _fmt(row["draft_acceptance_rate"]),
                 f"{sp['median']:.2f}x ({sp['min']:.2f}–{sp['max']:.2f})", f"{row['tokens_per_s']:.1f}",
                 f"{row['peak_memory_bytes'] / MIB:.1f}", format_quality(row["quality"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


PHASE_COLUMNS = ("method", *PHASES, "other", "verify ms/call", "draft ms/call", "ideal speed-up",
                 "system efficiency")


def phase_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Where the time goes (shares of wall time per loop phase), or "" when no row recorded phases."""
    rows = [r for r in rows if r.get("phases")]
    if not rows:
        return ""
    lines = ["| " + " | ".join(PHASE_COLUMNS) + " |", "|" + "|".join("---" for _ in PHASE_COLUMNS) + "|"]
    for row in rows:
        p = row["phases"]
        cells = [row["method"], *(f"{100 * p['share'][name]:.0f}%" for name in (*PHASES, "other")),
                 _fmt(p.get("verify_ms")), _fmt(p.get("draft_ms")),
                 _fmt(row.get("ideal_speedup")) + ("x" if row.get("ideal_speedup") is not None else ""),
                 "—" if row.get("system_efficiency") is None else f"{100 * row['system_efficiency']:.0f}%"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def ops_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Tensor operations (and host syncs) per target forward by loop phase, or "" when none were counted."""
    rows = [r for r in rows if (r.get("phases") or {}).get("ops_per_forward")]
    if not rows:
        return ""
    columns = ("method", *PHASES, OUTSIDE, "total", "host syncs")
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        ops, syncs = row["phases"]["ops_per_forward"], row["phases"]["syncs_per_forward"]
        cells = [row["method"], *(f"{ops[name]:.0f}" for name in (*PHASES, OUTSIDE, "total")),
                 f"{syncs['total']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _with_phases(rows: Sequence[Mapping[str, Any]]) -> str:
    phases, ops, budgets = phase_table(rows), ops_table(rows), budget_table(rows)
    text = markdown_table(rows)
    if budgets:
        text += f"\nDraft budgets (`budget=auto`): the size chosen per step:\n\n{budgets}"
        notes = [row["budget_notice"] for row in rows if row.get("budget_notice")]
        text += "".join(f"\n- {note}" for note in notes) + ("\n" if notes else "")
    if phases and not ops:  # with --phase-ops every op is hooked: its timings are not worth a table
        text += f"\nWhere the time goes (share of wall time per loop phase):\n\n{phases}"
    unforced = [row["method"] for row in rows if row.get("forced_drafts") == 0 and row.get("draft_forwards")]
    if unforced:
        text += f"\n- not forced (no draft went through the shared loop): {', '.join(unforced)}\n"
    decided = [row["method"] for row in rows if row.get("forced_decisions")]
    if decided:
        text += (f"\n- decided by the profile (their rules are not exact; outputs are vanilla's, timing only): "
                 f"{', '.join(decided)}\n")
    if ops:
        text += ("\nTensor operations per target forward by loop phase (host syncs: per target forward, all "
                 f"phases; counted with --phase-ops, so this run's timings are slowed):\n\n{ops}")
    return text


def budget_notices(summary: Mapping[str, Any]) -> list[str]:
    """Every row's budget notice (`summarize_config`), batch size by batch size: one line per method and batch size
    where the draft budget kept the method from drafting on most of its steps."""
    return [row["budget_notice"] for table in summary["batch_sizes"] for row in table["methods"]
            if row.get("budget_notice")]


def new_tokens_heading(rows: Sequence[Mapping[str, Any]], settings: Mapping[str, Any]) -> str:
    """The new tokens a sample got in vanilla's passes, beside --max-new-tokens when they differ: an image family
    generates its model's token count whatever the cap (a 16x16-token LlamaGen: 256), a VLM stops rows at EOS."""
    vanilla = next((row for row in rows if row["method"] == "vanilla"), None)
    cap = settings["max_new_tokens"]
    if vanilla is None or not settings["num_samples"]:
        return f"max {cap} new tokens"
    per_sample = vanilla["new_tokens"] / settings["num_samples"]
    if per_sample == cap:
        return f"{cap} new tokens"
    return f"{per_sample:.4g} new tokens a sample (--max-new-tokens {cap})"


def tables_markdown(summary: Mapping[str, Any]) -> str:
    """The per-batch-size tables with a heading each (what `mmspec bench` prints)."""
    s = summary["settings"]
    blocks = []
    for table in summary["batch_sizes"]:
        blocks.append(f"### {summary['family']} · batch size {table['batch_size']} · {s['num_samples']} samples · "
                      f"{new_tokens_heading(table['methods'], s)} · temperature {s['temperature']:g} · "
                      f"{s['repeats']} repeats\n\n" + _with_phases(table["methods"]))
    return "\n".join(blocks)


def summary_markdown(summary: Mapping[str, Any], plots: Mapping[int, Sequence[str]] | None = None) -> str:
    """summary.md: what was run, on what, then one table (and its plots) per batch size."""
    s, env = summary["settings"], summary["environment"]
    memory = {"cpu_peak_rss": "peak process RSS (CPU, sampled)",
              "cuda_max_allocated": "CUDA max allocated",
              "tensor_peak": "peak bytes of the tensors a batch allocates (weights excluded; ops hooked, so the "
                             "timings of this run are slowed)"}.get(summary["memory_kind"], summary["memory_kind"])
    head = [f"# mmspec bench: {summary['family']} ({summary['model_id']})", ""]
    if summary.get("command"):
        head += ["```", summary["command"], "```", ""]
    head += [f"- samples: {s['num_samples']}, max new tokens: {s['max_new_tokens']}, temperature: "
             f"{s['temperature']:g}, seed: {s['seed']}, options: {json.dumps(s['options'])}",
             f"- warm-up passes: {s['warmup']} (not recorded), recorded passes: {s['repeats']}, interleaved "
             f"{INTERLEAVED[s.get('interleave', 'pass')]}",
             f"- device: {env.get('gpu', env['device'])}; torch {env['torch']}, python {env['python']}, "
             f"{env.get('cpu_count')} CPUs, {env['torch_threads']} torch threads; {env['platform']}",
             f"- memory: {memory}",
             *([f"- acceptance forced by the profile `{s['force_acceptance']}` (mmspec.forced): timings at that "
                "acceptance, not the models' own"] if s.get("force_acceptance") else []),
             "- speed-up and step compression are vanilla / method within the same pass; mean acceptance length "
             "is the tokens emitted per drafting step (the bonus token included, plain steps left out). See "
             "docs/benchmarks.md.", ""]
    body = []
    for table in summary["batch_sizes"]:
        b = table["batch_size"]
        body += [f"## Batch size {b}", "", _with_phases(table["methods"])]
        for name in (plots or {}).get(b, []):
            body += [f"![{name}]({name})", ""]
    return "\n".join(head + body)


def summary_json(summary: Mapping[str, Any]) -> str:
    return json.dumps(summary, indent=2) + "\n"
