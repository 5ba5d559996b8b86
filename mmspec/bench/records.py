"""Per-sample records in Spec-Bench's answer format, plus mmspec's fields.

One record per sample per recorded repeat (one JSONL line):

    {"question_id", "category", "answer_id", "model_id", "tstamp",
     "choices": [{"index": 0, "turns": [turn], "decoding_steps": [NFE], "new_tokens": [n], "wall_time": [s],
                  "accept_lengths": [emitted tokens per verify call]}],
     "family", "method", "params", "lossless", "batch_size", "repeat", "nfe", "peak_memory_bytes",
     "memory_kind", "quality"}

The timed unit is a batch, so `decoding_steps` / `nfe` are the target forwards of the sample's batch and
`wall_time` is the batch's wall time divided by the number of samples in that batch.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from mmspec.bench.registry import MethodOutput, Sample

SPEC_BENCH_FIELDS = ("question_id", "category", "answer_id", "model_id", "choices", "tstamp")
CHOICE_FIELDS = ("index", "turns", "decoding_steps", "new_tokens", "wall_time", "accept_lengths")
MMSPEC_FIELDS = ("family", "method", "params", "lossless", "batch_size", "repeat", "nfe", "peak_memory_bytes",
                 "memory_kind", "quality")


def default_turn(output: Any) -> Any:
    """A JSON-serialisable turn: tensors and arrays become (nested) lists, JSON scalars stay, else repr."""
    if isinstance(output, torch.Tensor):
        return output.detach().cpu().tolist()
    if hasattr(output, "tolist"):
        return output.tolist()
    if isinstance(output, (str, int, float, bool, list, dict)) or output is None:
        return output
    return repr(output)


def batch_records(*, family: str, model_id: str, label: str, params: Mapping[str, Any], lossless: bool,
                  batch_size: int, repeat: int, samples: Sequence[Sample], output: MethodOutput, wall_time: float,
                  peak_memory_bytes: int, memory_kind: str, quality: Mapping[str, Any],
                  to_turn: Callable[[Any], Any] | None = None) -> list[dict]:
    """The records of one timed batch (one per sample)."""
    to_turn = to_turn or default_turn
    nfe = int(output.stats.num_target_forwards)
    per_row = output.stats.accept_lengths_per_row()
    per_sample_time = wall_time / len(samples)
    records = []
    for row, sample in enumerate(samples):
        choice = {
            "index": 0,
            "turns": [to_turn(output.outputs[row])],
            "decoding_steps": [nfe],
            "new_tokens": [int(output.new_tokens[row])],
            "wall_time": [per_sample_time],
            "accept_lengths": [int(n) for n in per_row[row]] if row < len(per_row) else [],
        }
        records.append({
            "question_id": sample.question_id,
            "category": sample.category,
            "answer_id": uuid.uuid4().hex,
            "model_id": f"{model_id}-{label}",
            "choices": [choice],
            "tstamp": time.time(),
            "family": family,
            "method": label,
            "params": dict(params),
            "lossless": lossless,
            "batch_size": batch_size,
            "repeat": repeat,
            "nfe": nfe,
            "peak_memory_bytes": int(peak_memory_bytes),
            "memory_kind": memory_kind,
            "quality": dict(quality),
        })
    return records


def to_jsonl(records: Sequence[Mapping[str, Any]]) -> str:
    """One JSON object per line (trailing newline included when non-empty)."""
    return "".join(json.dumps(record, sort_keys=False) + "\n" for record in records)
