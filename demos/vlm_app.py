"""Gradio demo: ask a LLaVA target about an image and watch the speculative answer stream in, coloured by the draft
round that produced each piece.

    python demos/vlm_app.py                          # the embedded world LLaVA (assets/vlm), http://127.0.0.1:7861
    python demos/vlm_app.py --model /data/llava-1.5-7b-mmspec --device cuda

Upload an image (or pick one of the world's example scenes; "more images" adds others: one question about all of
them, as `mmspec vlm --image A --image B`), ask a question, choose a drafter (the kinds found
in MODEL/drafters, or none for the target alone), the draft budget ("default": the pipeline's own, "auto": each
step's tree shape, or a plain step, from this device's measured costs; "fixed": the drafter's tree every step) and
the sampling settings. Each draft-verify round commits the
drafts the target accepted (highlighted, alternating colours per round) and one token of the target's own (the
correction or bonus token, plain). The stats give the answer's tokens, rounds, mean acceptance length, target
forwards, tokens/s and what the draft budget did (the steps drafted, the shapes chosen, and a note when it chose
plain steps on most steps). The model is loaded once, on first use; requests queue and run one at a time. Bad input
(no image, a file that is not an image, an empty question, absurd settings) comes back as a message in the
page. No network access: analytics off, system fonts, no share link.
"""

from __future__ import annotations

import argparse
import contextvars
import queue
import sys
import tempfile
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # `python demos/vlm_app.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gradio as gr  # noqa: E402
import torch  # noqa: E402

from demos.common import BUDGET_INFO, BUDGETS, budget_figures, launch  # noqa: E402
from mmspec.data.artifacts import ASSETS_DIR  # noqa: E402
from mmspec.errors import InputError, check  # noqa: E402
from mmspec.limits import check_sampling, check_seed  # noqa: E402

MAX_NEW_TOKENS = 256
MAX_MORE_IMAGES = 7  # images a request adds to the first (each one is a run of image tokens in the prompt)
EXAMPLE_QUESTIONS = ["What color is the object? Answer in detail.", "Describe the image. Answer in detail.",
                     "Where is the object? Answer in detail.", "How many objects are there?"]
DRAFT_LABELS = ("draft (odd round)", "draft (even round)")
COLORS = {DRAFT_LABELS[0]: "#7cc4ff", DRAFT_LABELS[1]: "#ffd27c"}


class VLMStore:
    """The target folder and its drafters, loaded on first use (one lock)."""

    def __init__(self, model: str | Path | None = None, device: str = "cpu") -> None:
        self.folder = Path(model) if model else ASSETS_DIR / "vlm"
        self.device = device
        self._vlms: dict[str, object] = {}
        self._lock = threading.Lock()

    def drafters(self) -> list[str]:
        """The drafter kinds of the VLM family record saved in the folder, the training-free ones, then "none" (the
        target alone)."""
        from vlm.family import TRAINING_FREE_KINDS, drafter_kinds_in

        return [*drafter_kinds_in(self.folder), *TRAINING_FREE_KINDS, "none"]

    def get(self, drafter: str):
        from vlm.pipeline import SpeculativeVLM

        check(drafter in self.drafters(), f"unknown drafter {drafter!r}; available: {', '.join(self.drafters())}.")
        with self._lock:
            if not (self.folder / "config.json").is_file():
                raise InputError(f"no VLM target at {self.folder}: the embedded default is made by `mmspec train "
                                 "vlm` (and its drafter by `mmspec train vlm-drafter`); or start the app with "
                                 "--model DIR.")
            if drafter not in self._vlms:
                self._vlms[drafter] = SpeculativeVLM.from_pretrained(
                    self.folder, None if drafter == "none" else drafter, device=self.device)
            return self._vlms[drafter]


def example_images(n: int = 6) -> list[str]:
    """World test scenes written as PNGs in a temporary folder (gr.Examples wants files)."""
    import PIL.Image

    from mmspec.data import generate_batch

    folder = Path(tempfile.mkdtemp(prefix="mmspec-vlm-examples-"))
    paths = []
    for i, image in enumerate(generate_batch(n, seed=0, split="test", two_objects=0.3).images):
        path = folder / f"scene{i}.png"
        PIL.Image.fromarray(image.permute(1, 2, 0).numpy()).resize((128, 128), PIL.Image.NEAREST).save(path)
        paths.append(str(path))
    return paths


def check_request(image_path, question: str, max_new_tokens, temperature, top_p, depth, top_k, total,
                  more_images=None) -> list:
    """The request's images (the first, then `more_images`' paths) and settings, validated (InputError with what to
    fix)."""
    from vlm.cli import load_image

    check(image_path, "upload an image (or pick an example) first.")
    more = list(more_images or [])
    check(len(more) <= MAX_MORE_IMAGES, f"{len(more)} more images; ask about at most {MAX_MORE_IMAGES + 1} images at "
                                        "once.")
    images = [load_image(path) for path in (image_path, *more)]
    check(isinstance(question, str) and question.strip(), "type a question about the image.")
    check(len(question) <= 1000, f"the question is {len(question)} characters long; keep it under 1000.")
    for name, value, low, high in (("max new tokens", max_new_tokens, 1, MAX_NEW_TOKENS),
                                   ("tree depth", depth, 0, 12), ("tree top-k", top_k, 0, 32),
                                   ("tree size", total, 0, 256)):
        check(isinstance(value, (int, float)) and int(value) == value and low <= value <= high,
              f"{name} must be a whole number from {low} to {high}, got {value!r}.")
    check_sampling(temperature=temperature, top_p=top_p)  # (the command line's limits, `mmspec.limits`)
    return images


def highlighted(rounds: list[tuple[str, str]]) -> list[tuple[str, str | None]]:
    """[(drafted text, target text)] per round -> HighlightedText segments (drafts labelled by round parity)."""
    segments = []
    for k, (drafted, own) in enumerate(rounds):
        if drafted:
            segments.append((drafted, DRAFT_LABELS[k % 2]))
        if own:
            segments.append((own, None))
    return segments


def budget_option(budget: str) -> dict:
    """The pipeline's `budget` argument for a page choice (one of BUDGETS): {} for "default" (the pipeline's own)."""
    check(budget in BUDGETS, f"draft budget must be one of {', '.join(BUDGETS)}, got {budget!r}.")
    return {} if budget == "default" else {"budget": budget}


def answer_stream(store: VLMStore, image_path, question, drafter, max_new_tokens, temperature, top_p, depth, top_k,
                  total, seed=0, budget="default", more_images=None):
    """Yields (segments, stats) as the answer grows; `budget` one of BUDGETS; `more_images`: paths of further images
    the question is about; raises InputError for bad input."""
    from vlm.pipeline import piece_text

    images = check_request(image_path, question, max_new_tokens, temperature, top_p, depth, top_k, total,
                           more_images)
    check_seed("seed", seed)
    options = budget_option(budget)
    vlm = store.get(drafter)
    tok = vlm.processor.tokenizer
    updates: queue.Queue = queue.Queue()
    result: dict = {}

    def on_round(row: int, text: str, ids: list[int]) -> None:
        updates.put((piece_text(tok, ids[:-1]) if len(ids) > 1 else "", piece_text(tok, ids[-1:])))

    def work() -> None:
        try:
            start = time.perf_counter()
            row = images[0] if len(images) == 1 else images  # a row of several images: one question about all
            result["out"] = vlm.generate([row], [question.strip()], int(max_new_tokens), float(temperature),
                                         float(top_p), tree=tuple(int(v) or None for v in (depth, top_k, total)),
                                         generator=torch.Generator().manual_seed(int(seed)), stream=on_round,
                                         **options)
            result["seconds"] = time.perf_counter() - start
        except Exception as err:  # handed to the request's thread
            result["error"] = err
        finally:
            updates.put(None)

    thread = threading.Thread(target=contextvars.copy_context().run, args=(work,), daemon=True)  # the request's
    # context vars go along (a forced budget of a test, `mmspec.testing.budgets`)
    thread.start()
    rounds: list[tuple[str, str]] = []
    while True:
        item = updates.get()
        if item is None:
            break
        rounds.append(item)
        yield highlighted(rounds), {}
    thread.join()
    if "error" in result:
        raise result["error"]
    out, seconds = result["out"], result["seconds"]
    stats = out.stats
    tokens = len(out.token_ids[0])
    yield highlighted(rounds), {
        "drafter": drafter, "new_tokens": tokens, "rounds": len(out.rounds[0]), "seconds": round(seconds, 3),
        "tokens_per_second": round(tokens / seconds, 2) if seconds > 0 else None,
        "target_forwards": stats.num_target_forwards,
        "mean_acceptance_length": round(stats.mean_acceptance_length, 3) if stats.num_drafts else None,
        "draft_acceptance_rate": round(stats.draft_acceptance_rate, 3) if stats.num_drafts else None,
        "budget": budget, "images": len(images), **budget_figures(stats, drafter), "answer": out.texts[0]}


def build_app(store: VLMStore | None = None, concurrency: int = 1, max_queue: int = 16) -> gr.Blocks:
    store = store or VLMStore()
    drafters = store.drafters()

    def run(image_path, question, drafter, max_new_tokens, temperature, top_p, depth, top_k, total,
            budget="default", more_images=None, progress=gr.Progress()):  # noqa: B008  (gradio finds the tracker)
        progress(0, desc="loading the model" if drafter not in store._vlms else "answering")
        try:
            yield from answer_stream(store, image_path, question, drafter, max_new_tokens, temperature, top_p,
                                     depth, top_k, total, budget=budget, more_images=more_images)
        except InputError as err:
            raise gr.Error(str(err), print_exception=False) from None

    with gr.Blocks(title="mmspec: speculative VLM answers", analytics_enabled=False) as app:
        gr.Markdown("# mmspec: speculative decoding for a vision-language model\nHighlighted pieces are drafts the "
                    "target accepted (colours alternate per draft round); plain pieces are the target's own tokens.")
        with gr.Row():
            with gr.Column(scale=1):
                image = gr.Image(type="filepath", label="image", elem_id="vlm-image", height=256)
                more_images = gr.File(file_count="multiple", file_types=["image"], type="filepath",
                                      label="more images (optional: one question about all of them)",
                                      elem_id="vlm-more-images")
                question = gr.Textbox(label="question", value=EXAMPLE_QUESTIONS[0], elem_id="vlm-question")
                drafter = gr.Dropdown(drafters, value=drafters[0], label="drafter")
                budget = gr.Dropdown(list(BUDGETS), value="default", label="draft budget", info=BUDGET_INFO)
                with gr.Accordion("settings", open=False):
                    max_new_tokens = gr.Slider(1, MAX_NEW_TOKENS, value=96, step=1, label="max new tokens")
                    temperature = gr.Number(value=0.0, label="temperature (0 = greedy)")
                    top_p = gr.Number(value=1.0, label="top-p")
                    depth = gr.Number(value=0, precision=0, label="tree depth (0: the drafter's paper tree)")
                    top_k = gr.Number(value=0, precision=0, label="tree top-k (0: the paper's)")
                    total = gr.Number(value=0, precision=0, label="tree size in tokens (0: the paper's)")
                button = gr.Button("Answer", variant="primary")
            with gr.Column(scale=2):
                answer = gr.HighlightedText(label="answer", color_map=COLORS, combine_adjacent=False,
                                            show_legend=True, elem_id="vlm-answer")
                stats = gr.JSON(label="stats", elem_id="vlm-stats")
        gr.Examples([[path, q] for path, q in zip(example_images(), EXAMPLE_QUESTIONS * 2)], [image, question],
                    label="world scenes")
        button.click(run, [image, question, drafter, max_new_tokens, temperature, top_p, depth, top_k, total,
                           budget, more_images], [answer, stats], api_name="answer")
    return app.queue(default_concurrency_limit=concurrency, max_size=max_queue)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="target folder (default: the embedded assets/vlm)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=7861)
    parser.add_argument("--max-queue", type=int, default=16, help="requests waiting at most")
    args = parser.parse_args(argv)
    if args.model is not None and not Path(args.model).is_dir():
        parser.error(f"--model {args.model} is not a folder; pass a VLM folder (LLaVA, Qwen2-VL) with its processor.")
    launch(build_app(VLMStore(args.model, args.device), 1, args.max_queue), args.host, args.port)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
