"""`mmspec bench`: vanilla and speculative methods side by side, in one process, on the same models and inputs.

    from mmspec.bench import BenchSettings, run_bench, write_outputs
    result = run_bench("toy", "vanilla,draft-model,tree", batch_sizes=[1, 8], repeats=3, warmup=1,
                       settings=BenchSettings(num_samples=16, max_new_tokens=64))
    summary = write_outputs(result, "runs/toy")   # results.jsonl, summary.md, summary.json, PNG plots

Families offer their methods through their records (`mmspec.families`; bench-only ones: `register_family`, see
`mmspec.bench.registry`);
the `toy` family (`mmspec.bench.toy`) proves the harness on the toy LM target. docs/benchmarks.md explains
every column and plot.
"""

from mmspec.bench.configs import MethodConfig, parse_method_list
from mmspec.bench.output import write_outputs
from mmspec.bench.registry import (
    REFERENCE_METHOD,
    BenchSettings,
    Family,
    Method,
    MethodOutput,
    Sample,
    available_families,
    get_family,
    methods_of,
    register_family,
    unregister_family,
)
from mmspec.bench.runner import BenchResult, RunResult, plan_steps, run_bench

__all__ = [
    "REFERENCE_METHOD", "BenchResult", "BenchSettings", "Family", "Method", "MethodConfig", "MethodOutput",
    "RunResult", "Sample", "available_families", "get_family", "methods_of", "parse_method_list", "plan_steps",
    "register_family", "run_bench", "unregister_family", "write_outputs",
]
