"""What the demo apps share: launching on localhost with no network access (analytics off, a theme with system
fonts only, no share link)."""

from __future__ import annotations

import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402

from mmspec.stats import SpecStats, budget_notice, budget_summary  # noqa: E402

BUDGETS = ("default", "fixed", "auto")  # a draft budget choice: "default" is the pipeline's own default
BUDGET_INFO = ('"fixed" drafts every step; "auto" picks each step\'s size (plain steps included) from this '
               "device's measured costs")
BUDGET_HINT = 'the draft budget "fixed"'  # how to draft every step, in the pages' words
THEME_FONTS = ["ui-sans-serif", "system-ui", "sans-serif"]  # local fonts: the page loads nothing from outside


def launch(app: gr.Blocks, host: str = "127.0.0.1", port: int | None = None, **kwargs):
    """`app.launch` on `host:port` with the offline theme and no share link; kwargs go to `launch`."""
    theme = gr.themes.Default(font=THEME_FONTS, font_mono=["ui-monospace", "monospace"])
    return app.launch(server_name=host, server_port=port, share=False, theme=theme, **kwargs)


def budget_figures(stats: SpecStats, method: str) -> dict:
    """What the method's draft budget did, for a page's stats: the verify steps drafted (counted per row), the
    budget's summary line (None without a budget) and the line saying it chose plain steps on most steps and that
    "fixed" drafts every step (None when it did not)."""
    return {"drafted_steps": stats.num_drafts, "verify_steps": stats.num_verify_rows,
            "draft_budget": budget_summary(stats), "budget_note": budget_notice(stats, method, BUDGET_HINT)}
