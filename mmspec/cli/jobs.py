"""Job files and the manifest of `mmspec generate`: what to make, and what is already made.

A job file is JSONL (one object per line) or CSV (a header line, then one row per line) with the columns

    id      optional; letters, digits, '.', '_', '-' (default: "row" + the line number); unique
    class   a class id or a world class name (class-conditional families)
    prompt  a caption (text-to-image families)
    count   optional; images of the row (default 1)
    seed    optional; the row's seed, in [0, 2^53) (default: derived from --seed and the line number)

Every image is one *work item* (row, index) with its own generator, seeded from (row seed, index): an image does
not depend on the batch or the process it is made in, so a resumed or sharded run writes the same bytes.

The manifest (`manifest.jsonl` in the output folder; `manifest.rank{r}.jsonl` per process while a multi-process
run is under way) gets one line per image, appended and flushed only after the image file exists:
{"id", "index", "inputs", "seed", "settings", "output", "batch_stats"}. A rerun skips what any manifest file
lists, and refuses to resume into a folder whose images were made from other inputs, seeds or settings.
"""

from __future__ import annotations

import csv
import json
import os
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from mmspec.bench.files import atomic_write_text
from mmspec.errors import InputError, why_not_a_file
from mmspec.limits import MAX_IMAGES_PER_ROW, SEED_LIMIT

ID_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,100}$")
MANIFEST = "manifest.jsonl"
COLUMNS = ("id", "class", "prompt", "count", "seed")
MAX_COUNT = MAX_IMAGES_PER_ROW


@dataclass(frozen=True)
class JobRow:
    """One row of a job: `inputs` as the family takes them (e.g. {"class": 3}), `count` images, `seed`."""

    id: str
    line: int
    inputs: dict
    count: int
    seed: int


@dataclass(frozen=True)
class WorkItem:
    """Image `index` of `row`."""

    row: JobRow
    index: int

    @property
    def key(self) -> tuple[str, int]:
        return (self.row.id, self.index)

    def generator(self) -> torch.Generator:
        return torch.Generator().manual_seed((self.row.seed * 1_000_003 + self.index) % 2**63)

    @property
    def file_name(self) -> str:
        return f"{self.row.id}_{self.index:03d}.png"


def row_seed(base_seed: int, position: int) -> int:
    """The default seed of the row at `position` (0-based) of a job run with --seed base_seed."""
    return (base_seed * 1_000_003 + position) % SEED_LIMIT


def _raw_rows(path: Path) -> Iterable[tuple[int, dict | str]]:
    """(line number, the row's fields or an error message) for every non-empty row of a JSONL or CSV file."""
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".csv":
        reader = csv.DictReader(text.splitlines())
        for fields in reader:
            line = reader.line_num
            if None in fields:
                yield line, "more values than header columns"
            elif any(v is None for v in fields.values()):
                yield line, "fewer values than header columns"
            elif any(v.strip() for v in fields.values()):
                yield line, {k.strip(): v.strip() for k, v in fields.items() if v.strip() != ""}
        return
    for line, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            fields = json.loads(raw)
        except json.JSONDecodeError as err:
            yield line, f"not valid JSON ({err.msg})"
            continue
        yield line, fields if isinstance(fields, dict) else "each line must be a JSON object"


def _int_field(fields: dict, name: str, default: int, low: int, high: int) -> int:
    value = fields.get(name, default)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"'{name}' must be an integer in [{low}, {high}], got {value!r}")
    return value


def read_job_file(path: str | os.PathLike, base_seed: int, parse_inputs: Callable[[dict], dict],
                  columns: tuple[str, ...] = COLUMNS) -> tuple[list[JobRow], list[str]]:
    """The rows of a job file and its bad lines ("line N: what is wrong"); `parse_inputs(fields)` turns a row's
    fields into the family's inputs or raises ValueError / InputError with what is wrong; `columns` are the
    known columns (image generation's by default)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"job file {path} {why_not_a_file(path)}.")
    if path.suffix.lower() not in (".jsonl", ".csv"):
        raise InputError(f"job file {path} must end in .jsonl or .csv.")
    rows, bad, seen = [], [], set()
    for position, (line, fields) in enumerate(_raw_rows(path)):
        try:
            if isinstance(fields, str):
                raise ValueError(fields)
            unknown = set(fields) - set(columns)
            if unknown:
                raise ValueError(f"unknown column(s) {sorted(unknown)}; known: {', '.join(columns)}")
            row_id = str(fields.get("id", f"row{line}"))
            if not ID_PATTERN.match(row_id):
                raise ValueError(f"id {row_id!r} must be 1-100 letters, digits, '.', '_' or '-'")
            if row_id in seen:
                raise ValueError(f"id {row_id!r} appears twice")
            count = _int_field(fields, "count", 1, 1, MAX_COUNT)
            seed = _int_field(fields, "seed", row_seed(base_seed, position), 0, SEED_LIMIT - 1)
            inputs = parse_inputs(fields)
        except (ValueError, InputError) as err:
            bad.append(f"line {line}: {err}")
            continue
        seen.add(row_id)
        rows.append(JobRow(row_id, line, inputs, count, seed))
    return rows, bad


def work_items(rows: Iterable[JobRow]) -> list[WorkItem]:
    return [WorkItem(row, k) for row in rows for k in range(row.count)]


# ------------------------------------------------------------------------------------------------ manifest
def manifest_files(out: Path) -> list[Path]:
    """The merged manifest and any per-process shards left by an interrupted or running multi-process run."""
    return sorted(p for p in out.glob("manifest*.jsonl") if p.is_file())


def read_manifest(path: Path, keys: tuple[str, ...] = ("id", "index")) -> list[dict]:
    """The records of one manifest file (objects with `keys`); a torn last line (a killed process) is ignored."""
    records = []
    for raw in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(raw)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and all(key in record for key in keys):
            records.append(record)
    return records


def done_records(out: Path) -> dict[tuple[str, int], dict]:
    """(row id, index) -> manifest record, for every image a manifest lists whose file exists."""
    return {(r["id"], int(r["index"])): r for path in manifest_files(out) for r in read_manifest(path)
            if (out / r.get("output", "")).is_file()}


def check_same_job(done: dict[tuple[str, int], dict], items: list[WorkItem], settings: dict, out: Path) -> None:
    """InputError if an image the manifest lists was made from other inputs, seed or settings than this run's
    (resuming must not mix two jobs in one folder)."""
    for item in items:
        record = done.get(item.key)
        if record is None:
            continue
        mine = json.loads(json.dumps({"inputs": item.row.inputs, "seed": item.row.seed, **settings}))
        theirs = {"inputs": record.get("inputs"), "seed": record.get("seed"), **(record.get("settings") or {})}
        changed = [k for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]
        if changed:
            what = ", ".join(f"{k} ({theirs.get(k)!r} there, {mine.get(k)!r} now)" for k in changed[:4])
            raise InputError(f"{out} already holds image {item.row.id!r} #{item.index} made with another {what}; "
                             "rerun with the same job and options to resume, or pick another --out.")


def drop_torn_tail(path: Path) -> bool:
    """Cut a manifest file back to its last complete line: a record that a killed process left half written (no
    final newline) lists nothing (`read_manifest` skips it, so its image is made again), and a record appended after
    it would join its line and be lost too. Returns whether it cut."""
    if not path.is_file():
        return False
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return False
    with open(path, "r+b") as handle:
        handle.truncate(data.rfind(b"\n") + 1)
        handle.flush()
        os.fsync(handle.fileno())
    return True


class ManifestWriter:
    """Appends one JSON line per finished image, flushed and fsynced (a crash loses at most the line being
    written, never a listed image); a torn last line left by a killed run is cut first (`drop_torn_tail`). The file
    is opened at the first record, so a run that fails before making anything leaves none."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = None

    def append(self, record: dict) -> None:
        if self._file is None:
            drop_torn_tail(self.path)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def merge_manifests(out: Path, order: list[tuple[str, int]]) -> list[dict]:
    """Fold every manifest file into one `manifest.jsonl` (one record per image, in job order; images not in the
    job go last), written atomically; the shards are removed. Returns the merged records, in that order."""
    records: dict[tuple[str, int], dict] = {}
    for path in manifest_files(out):
        for record in read_manifest(path):
            records[(record["id"], int(record["index"]))] = record
    rank = {key: i for i, key in enumerate(order)}
    keys = sorted(records, key=lambda k: (rank.get(k, len(rank)), k))
    atomic_write_text(out / MANIFEST, "".join(json.dumps(records[k]) + "\n" for k in keys))
    for path in manifest_files(out):
        if path.name != MANIFEST:
            path.unlink()
    return [records[k] for k in keys]


def job_budget(given: str | None, default: str, output_depends: bool, outputs: str, say: bool) -> str:
    """The draft budget a job runs (it records it): `given` (--budget), else the method's `default`, except that a
    default "auto" becomes "fixed" where a seed's `outputs` depend on the draft sizes (`output_depends`: speculative
    sampling at temperature > 0), so a resumed job gives an uninterrupted run's outputs; a given "auto" there is
    honoured with a note (`say`: print the notes, on stderr)."""
    budget = given or default
    if budget != "auto" or not output_depends:
        return budget
    why = f"a seed's {outputs} depend on the draft sizes, which budget auto picks from measured times"
    if given:
        if say:
            print(f"note: {why}; a resumed job will not give an uninterrupted run's {outputs} (--budget fixed does).",
                  file=sys.stderr)
        return budget
    if say:
        print(f"budget: fixed ({why}; a resumed job gives an uninterrupted run's {outputs}). --budget auto to pick "
              "sizes anyway.", file=sys.stderr)
    return "fixed"
