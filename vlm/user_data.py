"""A user's own multimodal rows for `mmspec train vlm-drafter --data DATA`: (one image, a question, the dataset's
reply when it has one), read from

    data.jsonl                 JSON Lines, one row a line
    llava_v1_5_mix665k.json    a JSON list of rows (LLaVA's training files)
    folder/                    a `datasets` folder written by `Dataset.save_to_disk` (of a DatasetDict, its "train")

in any of these row layouts:

    {"image": "coco/1.jpg", "conversations": [{"from": "human", "value": "<image>\\nWhat is here?"},
                                               {"from": "gpt", "value": "A dog on a sofa."}]}        # LLaVA
    {"images": ["1.jpg"], "messages": [{"role": "user", "content": [{"type": "image"},
               {"type": "text", "text": "What is here?"}]}, {"role": "assistant", "content": "A dog."}]}  # chat
    {"image": "1.jpg", "prompt": "What is here?", "answer": "A dog on a sofa."}  # "answer" may be left out

A row gives its exchanges (a user turn and the reply after it when there is one; `vlm.text_data.raw_exchanges`):
the first as `question` / `answer`, the later ones in `later` (`turns="first"`: not read); `VLMData.turns_notice`
says how many rows hold several and which are read. The `<image>` marker leaves the question: the target's own
prompt format places the image (`SpeculativeVLM.prompt_text`). A relative image path is
read under `image_folder` (default: the data file's folder); a `datasets` folder's image column may hold the images
themselves. A row holds one image or several (an `images` list, chat image parts, a folder's image lists: `image`
returns a list for those); text-only conversations train through `--text-data`. `VLMData` checks every row and image
path before any model loads, with a one-line error naming the row.

    data = VLMData("my_rows.jsonl")
    image = data.image(0)                        # uint8 [3, H, W]
    train_rows, held_out = data.split(32, seed=0)
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from mmspec.errors import InputError, check
from vlm.text_data import checked_exchange, conversation_turns, raw_exchanges, turns_notice

IMAGE_MARKER = "<image>"  # LLaVA's marker in its data's questions
TURNS = ("all", "first")  # a row's exchanges read: every one (one training example each), or the first


@dataclass(frozen=True)
class VLMRow:
    """One training row: its image (a file path, a tuple of them for a row of several images, or the row index of a
    `datasets` folder's image column), the first question without its image marker, the dataset's reply (None where
    the row has none) and, when its conversation is read whole, the later exchanges (question, reply or None)."""

    image: str | int | tuple[str, ...]
    question: str
    answer: str | None
    later: tuple[tuple[str, str | None], ...] = ()
    exchanges: int = field(default=1, compare=False)  # how many the row holds, read or not (not its content)


def row_images(row: dict, where: str) -> list:
    """The images a row names, in order: `image`, `images`, or chat parts {"type": "image", "image": ...}."""
    images = row.get("images")
    if images is None and "image" in row:
        images = [row["image"]]
    if images is None:  # chat rows may carry the image inside the user turn
        parts = [part for turn in row.get("messages", []) if isinstance(turn, dict)
                 and isinstance(turn.get("content"), list) for part in turn["content"]
                 if isinstance(part, dict) and part.get("type") == "image" and part.get("image") is not None]
        images = [part["image"] for part in parts] or None
    check(images is not None, f"{where}: no image ('image', 'images' or a chat image part); text-only rows train "
                              "through --text-data.")
    images = images if isinstance(images, list) else [images]
    check(len(images) > 0, f"{where}: an empty 'images' list; text-only rows train through --text-data.")
    return images


def row_exchanges(row: dict, where: str, whole: bool) -> tuple[str, str | None, tuple, int]:
    """(first question without its image marker, its reply, the later exchanges: read when `whole`, how many
    exchanges the row holds)."""
    raw = raw_exchanges(row, where)
    exchanges = conversation_turns(raw, where) if whole else [checked_exchange(raw[0], where, need_reply=False)]
    (question, answer), later = exchanges[0], tuple(exchanges[1:])
    question = " ".join(question.replace(IMAGE_MARKER, " ").split())
    check(question, f"{where}: the question is empty once its {IMAGE_MARKER} marker is taken out.")
    for n, (text, _) in enumerate(later, 2):
        check(IMAGE_MARKER not in text, f"{where} (exchange {n}): an {IMAGE_MARKER} marker after the first exchange; "
                                        "a row's images are asked about from its first question on.")
    return question, answer, later, len(raw)


def parse_row(row: object, where: str, folder: Path, whole: bool = True) -> VLMRow:
    """A raw JSON row as a VLMRow with its image path resolved under `folder` (`whole`: every exchange read);
    InputError naming `where`."""
    check(isinstance(row, dict), f"{where}: a row must be a JSON object.")
    fields = row_exchanges(row, where, whole)
    paths = []
    for image in row_images(row, where):
        check(isinstance(image, str) and image.strip(), f"{where}: the image must be a file path, got {image!r}.")
        check("://" not in image, f"{where}: {image!r} is a URL; mmspec reads local files only (download it first).")
        path = Path(image) if Path(image).is_absolute() else folder / image
        check(path.is_file(), f"{where}: image {path} not found; set --image-folder to the folder the paths start "
                              "in.")
        paths.append(str(path))
    return VLMRow(paths[0] if len(paths) == 1 else tuple(paths), *fields)


def json_rows(path: Path) -> list[tuple[str, object]]:
    """(where, row) of a JSON Lines file or of a JSON file holding a list."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InputError(f"--data {path}: not UTF-8 text; give JSON Lines, a JSON list or a datasets folder.") from None
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as err:
            raise InputError(f"--data {path}: not JSON ({err.msg} at line {err.lineno}).") from None
        return [(f"--data {path} row {i}", row) for i, row in enumerate(rows)]
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                out.append((f"--data {path} line {number}", json.loads(line)))
            except json.JSONDecodeError as err:
                raise InputError(f"--data {path} line {number}: not JSON ({err.msg}).") from None
    return out


class VLMData:
    """The rows of one --data source and how to read their images (see the module docstring)."""

    def __init__(self, source: str | Path, image_folder: str | Path | None = None, turns: str = "all") -> None:
        check(turns in TURNS, f"turns must be one of {', '.join(TURNS)}, got {turns!r}.")
        self.source, self.turns = Path(source), turns
        check(self.source.exists(), f"--data {self.source}: no such file or folder.")
        self.dataset, self.image_column = None, None
        if self.source.is_dir():
            self.rows = self.read_dataset_folder()
        else:
            folder = Path(image_folder) if image_folder is not None else self.source.parent
            check(folder.is_dir(), f"--image-folder {folder}: no such folder.")
            self.rows = [parse_row(row, where, folder, turns == "all") for where, row in json_rows(self.source)]
        check(self.rows, f"--data {self.source}: no rows.")

    @functools.cached_property
    def image_counts(self) -> tuple[int, ...]:
        """How many images each row holds (a `datasets` folder's from its image column's Arrow list lengths, no
        image decoded); read once."""
        if self.dataset is None:
            return tuple(len(row.image) if isinstance(row.image, tuple) else 1 for row in self.rows)
        import pyarrow.compute as pc

        column = self.dataset.data.column(self.image_column)
        if not str(column.type).startswith(("list", "large_list")):
            return (1,) * len(self.rows)
        lengths = pc.list_value_length(column).to_pylist()  # [rows of the folder]
        return tuple(lengths[row.image] for row in self.rows)

    def image_count(self, i: int) -> int:
        """How many images row i holds."""
        return self.image_counts[i]

    def rows_with_several_images(self) -> int:
        return sum(n > 1 for n in self.image_counts)

    @property
    def multi_turn_rows(self) -> int:
        """How many rows hold more than one exchange."""
        return sum(row.exchanges > 1 for row in self.rows)

    @property
    def reads_later_exchanges(self) -> bool:
        """Whether later exchanges are training examples too (read whole, and some row holds them)."""
        return self.turns == "all" and self.multi_turn_rows > 0

    def turns_notice(self) -> str | None:
        """One line saying how many rows hold turns after the first (which training does not read), or None."""
        return turns_notice(f"--data {self.source}", self.multi_turn_rows, len(self.rows), self.turns == "all")

    def read_dataset_folder(self) -> list[VLMRow]:
        """The rows of a `datasets` folder; its images stay in the folder (read by `image`)."""
        try:
            from datasets import DatasetDict, Image, load_from_disk
        except ImportError:
            raise InputError(f"--data {self.source} is a folder: reading a datasets folder needs the `datasets` "
                             "package (pip install datasets), or give a JSON Lines file.") from None
        try:
            dataset = load_from_disk(str(self.source))
        except (FileNotFoundError, ValueError) as err:
            raise InputError(f"--data {self.source}: not a folder written by save_to_disk ({err}).") from None
        if isinstance(dataset, DatasetDict):
            check("train" in dataset, f"--data {self.source}: a DatasetDict without a 'train' split "
                                      f"(splits: {', '.join(dataset)}).")
            dataset = dataset["train"]
        column = next((c for c in ("image", "images") if c in dataset.column_names), None)
        check(column is not None, f"--data {self.source}: no 'image' or 'images' column (columns: "
                                  f"{', '.join(dataset.column_names)}).")
        if isinstance(dataset.features[column], Image):  # keep the images encoded: `image` decodes one at a time
            dataset = dataset.cast_column(column, Image(decode=False))
        self.dataset, self.image_column = dataset, column
        rows = []
        for i, row in enumerate(dataset.remove_columns(column)):
            where = f"--data {self.source} row {i}"
            rows.append(VLMRow(i, *row_exchanges(row, where, self.turns == "all")))
        return rows

    def __len__(self) -> int:
        return len(self.rows)

    def image(self, i: int) -> torch.Tensor | list[torch.Tensor]:
        """Row i's image as RGB uint8 [3, H, W], or a list of them for a row of several; InputError naming the row
        when one cannot be read."""
        row = self.rows[i]
        stored = row.image if self.dataset is None else self.dataset[row.image][self.image_column]
        if isinstance(stored, (list, tuple)):
            check(len(stored) > 0, f"--data {self.source} row {i}: no image.")
            images = [self.read_image(one, i) for one in stored]
            return images[0] if len(images) == 1 else images
        return self.read_image(stored, i)

    def read_image(self, stored: object, i: int) -> torch.Tensor:
        """One stored image (a path, PIL image or encoded datasets image) as RGB uint8 [3, H, W]."""
        import PIL.Image

        if isinstance(stored, dict):  # an encoded datasets image: {"bytes", "path"}
            stored = io.BytesIO(stored["bytes"]) if stored.get("bytes") else stored.get("path")
        try:
            image = stored if isinstance(stored, PIL.Image.Image) else PIL.Image.open(stored)
            array = np.asarray(image.convert("RGB"))  # [H, W, 3]
        except (OSError, ValueError, TypeError) as err:
            raise InputError(f"--data {self.source} row {i}: cannot read its image ({err}).") from None
        return torch.from_numpy(array.copy()).permute(2, 0, 1)

    def split(self, held_out: int, seed: int) -> tuple[list[int], list[int]]:
        """(training rows, held-out rows): `held_out` rows drawn by a seeded permutation, the rest for training."""
        check(0 < held_out < len(self.rows), f"--data {self.source} has {len(self.rows)} rows: it cannot hold out "
                                             f"{held_out} for the eval and still train; lower --eval-prompts.")
        order = torch.randperm(len(self.rows), generator=torch.Generator().manual_seed(seed)).tolist()
        return sorted(order[held_out:]), sorted(order[:held_out])

    def fingerprint(self) -> str:
        """A hash of the data's rows: a JSON file's contents, a datasets folder's files by name, size and
        modification time (its Arrow files run to gigabytes and are written once); images by path, not content."""
        digest = hashlib.sha256()
        if self.source.is_dir():
            for path in sorted(p for p in self.source.rglob("*") if p.is_file()):
                stat = path.stat()
                digest.update(f"{path.relative_to(self.source)}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        else:
            digest.update(self.source.read_bytes())
        digest.update("\n".join(str(row.image) for row in self.rows).encode())
        return digest.hexdigest()[:16]


class RowImages:
    """The images of chosen data rows, read on demand (`data["images"]` of a --data training set)."""

    def __init__(self, data: VLMData, rows: list[int]) -> None:
        self.data, self.rows = data, rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data.image(self.rows[int(i)])


# ---------------------------------------------------------------------------------------------------- example
EXAMPLE_QUESTIONS = (  # phrasings the world's question templates (mmspec.data.text) never use
    "Tell me about this picture. Answer in detail.",
    "Which colors can you see here? Answer in detail.",
    "Is anything round in the image? Answer in detail.",
    "Describe the scene for a blind person.",
    "What would you call this drawing? Answer in detail.",
    "Count the shapes and name them. Answer in detail.",
    "Where should I look first in this image? Answer in detail.",
    "Write a caption for this image.",
)


def write_example_data(out: str | Path, n: int, seed: int = 0) -> Path:
    """A --data example in LLaVA's layout: n world scenes of the val split as PNGs under `out`/images and
    `out`/rows.jsonl asking them questions unlike the world's templates, the scene's caption as the dataset's answer.
    Returns the rows file."""
    import PIL.Image

    from mmspec.data import generate_batch

    out = Path(out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    batch = generate_batch(n, seed, split="val")
    lines = []
    for i, (image, caption) in enumerate(zip(batch.images, batch.captions)):
        name = f"images/scene{i:05d}.png"
        PIL.Image.fromarray(image.permute(1, 2, 0).numpy()).save(out / name)
        question = EXAMPLE_QUESTIONS[(i * 7 + seed) % len(EXAMPLE_QUESTIONS)]
        answer = f"{caption[:1].upper()}{caption[1:]}."
        lines.append(json.dumps({"image": name, "conversations": [
            {"from": "human", "value": f"<image>\n{question}"}, {"from": "gpt", "value": answer}]}))
    (out / "rows.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return out / "rows.jsonl"


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m vlm.user_data",
                                     description="Write an example --data folder: world scenes with questions unlike "
                                                 "the world's templates (LLaVA layout).")
    parser.add_argument("out", help="the folder to write (rows.jsonl and images/)")
    parser.add_argument("--num", type=int, default=200, help="rows")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = write_example_data(args.out, args.num, args.seed)
    print(f"wrote {args.num} rows to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
