"""Gradio demo: a speculative (or collaborative) decoding method next to vanilla decoding, for the image families.

    python demos/image_app.py                                    # embedded defaults, http://127.0.0.1:7860
    python demos/image_app.py --model var=/data/var-code --port 7861   # a real checkpoint folder for one family

Pick a family (llamagen, llamagen-t2i, var, mar), a method, a class (or a caption for llamagen-t2i), sampling
settings and, for families whose pipeline takes
one, the draft budget (docs/budgets.md: "default" is the pipeline's own, "auto" for LlamaGen and CSpD: each step's
size from this device's measured costs; "fixed" drafts the method's size every step); both runs use the same seeds. The
app shows the two image grids, wall times, the speed-up, step compression (vanilla's target forwards / the
method's), the mean acceptance length, what the draft budget did (the steps drafted and the sizes it chose; when it
chose plain steps on most steps, a line saying so and that "fixed" drafts every step) and a per-position acceptance
plot. Families, methods and their loaders are
the family records `mmspec generate` reads (`mmspec.families`, those with a generate hook); pipelines are
loaded lazily once per family; their tqdm bars
feed the page's progress bar (`gr.Progress(track_tqdm=True)`). Requests wait in a queue that runs
`--concurrency` of them at a time. Bad input (empty class, absurd sizes, unknown method parameters) comes back
as a message in the page, not a traceback. No network access: analytics off, system fonts, no share link.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # `python demos/image_app.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gradio as gr  # noqa: E402
import torch  # noqa: E402

from demos.common import BUDGET_INFO, BUDGETS, budget_figures, launch  # noqa: E402
from mmspec.bench.plots import per_position_figure  # noqa: E402
from mmspec.cli.family_io import resolve_class, world_class_names  # noqa: E402
from mmspec.cli.generate import parse_method_args  # noqa: E402
from mmspec.cli.image_job import make_grid  # noqa: E402
from mmspec.errors import InputError, check  # noqa: E402
from mmspec.families import FamilyRecord, available_families, get_family  # noqa: E402
from mmspec.limits import check_count, check_sampling, check_seed  # noqa: E402

PREFERRED_METHOD = {"llamagen": "sjd"}  # shown first where a family has it; else its first speculative method
MAX_IMAGES = 16
TILE = 128  # pixels per displayed image (world images are 32 px: upscaled with nearest neighbours)


def image_families() -> list[str]:
    return available_families("generate")


class ModelStore:
    """Family records and their pipelines, loaded on first use (one lock: a pipeline is loaded once)."""

    def __init__(self, models: dict[str, str] | None = None, device: str = "cpu") -> None:
        unknown = set(models or {}) - set(image_families())
        check(not unknown, f"--model for unknown famil(ies) {sorted(unknown)}; known: {image_families()}.")
        self.models, self.device = dict(models or {}), device
        self._pipes: dict[str, object] = {}
        self._lock = threading.Lock()

    def families(self) -> list[str]:
        """The families the page offers: those with an embedded default or a --model (janus needs one)."""
        return [f for f in image_families() if get_family(f).default_model is not None or f in self.models]

    @staticmethod
    def record(family: str) -> FamilyRecord:
        check(family in image_families(), f"unknown family {family!r}; pick one of {image_families()}.")
        return get_family(family)

    def pipeline(self, family: str):
        with self._lock:
            if family not in self._pipes:
                pipe = self.record(family).load(self.models.get(family), self.device)
                pipe.set_progress_bar_config(disable=False, leave=False)  # tqdm -> the page's progress bar
                self._pipes[family] = pipe
            return self._pipes[family]

    def defaults(self, family: str) -> dict:
        """The sampling settings the family uses by default (MAR: its model's own guidance; loads it then)."""
        return self.record(family).defaults(load=lambda: self.pipeline(family))

    def default_guidance(self, family: str) -> float:
        return self.defaults(family)["guidance_scale"]


EXAMPLE_CAPTIONS = ("a small red circle in the center on a black background",
                    "a large yellow cross in the upper left on a white background",
                    "a medium green square at the bottom on a purple background")


def condition_choices(family: str) -> tuple[list[str], str]:
    """What the condition box offers for a family, and its label: world class names, or example captions for a
    text-to-image family (any caption can be typed)."""
    if ModelStore.record(family).condition == "prompt":
        return list(EXAMPLE_CAPTIONS), "caption"
    return world_class_names(16) or [], "class (name or id)"


def speculative_methods(family: str) -> list[str]:
    return [m for m in ModelStore.record(family).methods if m != "vanilla"]


def default_method(family: str) -> str:
    methods = speculative_methods(family)
    preferred = PREFERRED_METHOD.get(family)
    return preferred if preferred in methods else methods[0]


def method_example(family: str, method: str) -> str:
    """The method-parameters box's placeholder: the method's own parameters with their defaults."""
    params = ModelStore.record(family).get_method(method).params if method in speculative_methods(family) else {}
    shown = ", ".join(f"{k}={'<model default>' if v is None else v}" for k, v in list(params.items())[:3]
                      if v is None or isinstance(v, (int, float, str, bool)))
    return f"e.g. {shown}" if shown else "(this method takes no parameters)"


def check_budget(budget: str, pipe) -> dict:
    """The `budget` option (one of BUDGETS, checked by `compare`) for the method's run: {} for "default"; a family
    whose pipeline has no draft budget refuses "fixed" / "auto"."""
    import inspect

    if budget == "default":
        return {}
    check("budget" in inspect.signature(type(pipe).__call__).parameters,
          f"this family's pipeline has no draft budget; choose 'default' (got {budget!r}).")
    return {"budget": budget}


def sampling_options(family: str, defaults: dict, guidance_scale: float, temperature: float, top_k: int,
                     top_p: float) -> dict:
    """The family's sampling options (its `defaults`) with the page's, validated; top-k 0 and top-p 1 mean 'off';
    a family without top-k / top-p (continuous tokens: defaults None) takes neither."""
    check_sampling(guidance_scale, temperature, top_k, top_p)  # (the command line's limits, `mmspec.limits`)
    options = {**defaults, "guidance_scale": float(guidance_scale), "temperature": float(temperature)}
    if defaults.get("top_k") is None:
        check(top_k == 0 and top_p == 1, f"{family} samples continuous tokens: set top-k to 0 and top-p to 1 (off).")
    else:
        options.update(top_k=int(top_k), top_p=float(top_p))
    return options


def parse_method_text(text: str) -> dict:
    """'gamma=4, align=false' -> {"gamma": 4, "align": False}."""
    items = [part.strip() for part in (text or "").replace("\n", ",").split(",") if part.strip()]
    return parse_method_args(items)


def vanilla_kwargs(family: str, method: str, method_kwargs: dict) -> dict:
    """The method parameters vanilla decoding shares with the method (MAR: num_sampling_steps, cfg_schedule)."""
    record = ModelStore.record(family)
    shared = set(record.methods["vanilla"].params) & set(record.get_method(method).params)
    return {k: v for k, v in method_kwargs.items() if k in shared}


def display_grid(images: list):
    import PIL.Image

    grid = make_grid([im.convert("RGB") for im in images], columns=min(len(images), 4))
    scale = max(1, TILE // images[0].size[0])
    return grid.resize((grid.width * scale, grid.height * scale), PIL.Image.NEAREST)


def timed_generate(record: FamilyRecord, pipe, labels: list[int], seed: int, options: dict):
    generators = [torch.Generator().manual_seed(seed + i) for i in range(len(labels))]
    start = time.perf_counter()
    images, stats = record.generate(pipe, labels, generators, options)
    return images, stats, time.perf_counter() - start


def compare(store: ModelStore, family: str, method: str, class_text: str, method_text: str, num_images: int,
            guidance_scale: float, temperature: float, top_k: int, top_p: float, seed: int,
            budget: str = "default") -> dict:
    """Vanilla and `method` on the same class and seeds; the grids, a stats dict and the per-position figure.
    budget: "default", "fixed" or "auto" (the method's draft budget, families whose pipeline takes one).
    Raises InputError for bad input (before any generation where it can be told in advance)."""
    record = ModelStore.record(family)
    check(method in speculative_methods(family),
          f"unknown method {method!r} for {family}; pick one of {', '.join(speculative_methods(family))}.")
    text = record.condition == "prompt"
    check(class_text is not None and str(class_text).strip(),
          "write a caption (e.g. 'a small red circle in the center on a black background')." if text else
          "pick a class (a name such as 'red circle' or a class id).")
    check_count("number of images", num_images, MAX_IMAGES, hint="")  # (a page shows few; `mmspec generate`: 100000)
    check_seed("seed", seed)
    method_kwargs = record.get_method(method).check_given(parse_method_text(method_text), family)
    sampling_options(family, record.defaults(), guidance_scale, temperature, top_k, top_p)  # before loading
    check(budget in BUDGETS, f"draft budget must be one of {', '.join(BUDGETS)}, got {budget!r}.")
    pipe = store.pipeline(family)
    budget_option = check_budget(budget, pipe)
    options = sampling_options(family, store.defaults(family), guidance_scale, temperature, top_k, top_p)
    label = str(class_text).strip() if text else resolve_class(str(class_text).strip(), record.num_classes(pipe))
    labels, seed = [label] * int(num_images), int(seed)

    shared = vanilla_kwargs(family, method, method_kwargs)
    base, base_stats, base_time = timed_generate(
        record, pipe, labels, seed, {**options, "method": "vanilla", "method_kwargs": shared})
    spec, spec_stats, spec_time = timed_generate(
        record, pipe, labels, seed, {**options, **budget_option, "method": method, "method_kwargs": method_kwargs})
    drafted = spec_stats.num_drafts > 0
    stats = {
        "family": family, "method": method, "method_kwargs": method_kwargs, "budget": budget, "class": label,
        "num_images": len(labels), "seed": seed,
        "vanilla_seconds": round(base_time, 3), "method_seconds": round(spec_time, 3),
        "speedup": round(base_time / spec_time, 3) if spec_time > 0 else None,
        "vanilla_target_forwards": base_stats.num_target_forwards,
        "method_target_forwards": spec_stats.num_target_forwards,
        "method_draft_forwards": spec_stats.num_draft_forwards,
        "step_compression": (round(base_stats.num_target_forwards / spec_stats.num_target_forwards, 3)
                             if spec_stats.num_target_forwards else None),
        "mean_acceptance_length": round(spec_stats.mean_acceptance_length, 3) if drafted else None,
        "draft_acceptance_rate": round(spec_stats.draft_acceptance_rate, 3) if drafted else None,
        "per_position_acceptance_rate": [round(r, 3) for r in spec_stats.per_position_acceptance_rate],
        "extra": dict(spec_stats.extra),
        **budget_figures(spec_stats, method),
    }
    empty = ("no drafted tokens: the draft budget chose plain steps" if stats["budget_note"] and not drafted
             else "no method drafted tokens")
    figure = per_position_figure([{"method": method, "per_position_acceptance_rate":
                                   stats["per_position_acceptance_rate"]}],
                                 f"{family} / {method}: per-position acceptance ({len(labels)} images)", empty)
    return {"vanilla": display_grid(base), "method": display_grid(spec), "stats": stats, "figure": figure}


def summary_markdown(stats: dict) -> str:
    """The page's summary: times, speed-up, step compression, acceptance, then what the draft budget did (why the
    method barely drafted, where that is the case)."""
    def fmt(value, suffix=""):
        return "n/a" if value is None else f"{value}{suffix}"

    budget = stats.get("budget_note") or stats.get("draft_budget")
    return (f"**{stats['method']}**: {stats['method_seconds']:.2f} s vs vanilla {stats['vanilla_seconds']:.2f} s "
            f"(speed-up {fmt(stats['speedup'], 'x')}) · step compression {fmt(stats['step_compression'], 'x')} "
            f"({stats['vanilla_target_forwards']} → {stats['method_target_forwards']} target forwards) · "
            f"mean acceptance length {fmt(stats['mean_acceptance_length'])} · draft acceptance rate "
            f"{fmt(stats['draft_acceptance_rate'])}" + (f"\n\n{budget}" if budget else ""))


def build_app(store: ModelStore | None = None, family: str = "llamagen", concurrency: int = 1,
              max_queue: int = 16) -> gr.Blocks:
    """The Blocks app (queued; call `.launch()`); `store` defaults to the embedded models on the CPU."""
    store = store or ModelStore()
    check(family in image_families(), f"unknown family {family!r}; pick one of {image_families()}.")
    names, condition_label = condition_choices(family)

    def run(family, method, class_text, method_text, num_images, guidance_scale, temperature, top_k, top_p, seed,
            budget="default", progress=gr.Progress(track_tqdm=True)):  # noqa: B008  (gradio finds the tracker)
        progress(0, desc="vanilla, then the method")
        try:
            result = compare(store, family, method, class_text, method_text, num_images, guidance_scale,
                             temperature, top_k, top_p, seed, budget)
        except InputError as err:
            raise gr.Error(str(err), print_exception=False) from None
        return (result["vanilla"], result["method"], summary_markdown(result["stats"]), result["stats"],
                result["figure"])

    def guidance_for(family):
        try:
            return store.default_guidance(family)
        except InputError as err:
            raise gr.Error(str(err), print_exception=False) from None

    def methods_for(family):
        return gr.Dropdown(choices=speculative_methods(family), value=default_method(family))

    def conditions_for(family):
        choices, label = condition_choices(family)
        return gr.Dropdown(choices=choices, value=choices[0] if choices else None, label=label)

    def example_for(family, method):
        try:
            return gr.Textbox(placeholder=method_example(family, method))
        except InputError:  # a family / method pair mid-switch
            return gr.Textbox()

    with gr.Blocks(title="mmspec: speculative image generation", analytics_enabled=False) as app:
        gr.Markdown("# mmspec: speculative vs vanilla image generation\nSame class, same seeds; the method's "
                    "images on the right. World images are 32 px, shown enlarged.")
        with gr.Row():
            family_box = gr.Dropdown(store.families(), value=family, label="family")
            # custom values: an API call may name another family's method; `compare` checks the pair
            method_box = gr.Dropdown(speculative_methods(family), value=default_method(family), label="method",
                                     allow_custom_value=True)
            class_box = gr.Dropdown(names, value=names[0] if names else None, allow_custom_value=True,
                                    label=condition_label)
            method_args = gr.Textbox(label="method parameters",
                                     placeholder=method_example(family, default_method(family)))
        with gr.Row():
            num_images = gr.Slider(1, MAX_IMAGES, value=4, step=1, label="images")
            guidance = gr.Number(value=store.default_guidance(family), label="CFG scale")
            temperature = gr.Number(value=1.0, label="temperature")
            top_k = gr.Number(value=0, precision=0, label="top-k (0 = off)")
            top_p = gr.Number(value=1.0, label="top-p (1 = off)")
            seed = gr.Number(value=0, precision=0, label="seed")
            budget = gr.Dropdown(list(BUDGETS), value="default", label="draft budget",
                                 info=BUDGET_INFO)
        button = gr.Button("Generate", variant="primary")
        with gr.Row():
            vanilla_image = gr.Image(label="vanilla (same seeds)", type="pil", format="png", elem_id="vanilla-image")
            method_image = gr.Image(label="method (same seeds)", type="pil", format="png",
                                    elem_id="method-image")
        summary = gr.Markdown(elem_id="summary")
        with gr.Row():
            plot = gr.Plot(label="per-position acceptance rate", show_label=False)
            stats = gr.JSON(label="stats")
        family_box.change(methods_for, family_box, method_box)
        family_box.change(guidance_for, family_box, guidance)
        family_box.change(conditions_for, family_box, class_box)
        method_box.change(example_for, [family_box, method_box], method_args)
        button.click(run, [family_box, method_box, class_box, method_args, num_images, guidance, temperature, top_k,
                           top_p, seed, budget], [vanilla_image, method_image, summary, stats, plot],
                     api_name="generate")
    return app.queue(default_concurrency_limit=concurrency, max_size=max_queue)


def parse_models(items: list[str]) -> dict[str, str]:
    models = {}
    for item in items:
        check("=" in item, f"--model must look like FAMILY=PATH (e.g. var=/data/var-code), got {item!r}.")
        family, path = item.split("=", 1)
        models[family.strip()] = path.strip()
    return models


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", default=[], metavar="FAMILY=PATH",
                        help="a pipeline folder for a family (default: the embedded asset); repeatable")
    parser.add_argument("--family", default="llamagen", help="family shown first (one with a generate hook)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=7860)
    parser.add_argument("--concurrency", type=int, default=1, help="requests generated at the same time")
    parser.add_argument("--max-queue", type=int, default=16, help="requests waiting at most")
    args = parser.parse_args(argv)
    try:
        store = ModelStore(parse_models(args.model), args.device)
        app = build_app(store, args.family, args.concurrency, args.max_queue)
    except InputError as err:
        parser.error(str(err))
    launch(app, args.host, args.port)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
