"""What the demo apps share: launching on localhost with no network access (analytics off, a theme with system
fonts only, no share link)."""

from __future__ import annotations

import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402

THEME_FONTS = ["ui-sans-serif", "system-ui", "sans-serif"]  # local fonts: the page loads nothing from outside


def launch(app: gr.Blocks, host: str = "127.0.0.1", port: int | None = None, **kwargs):
    """`app.launch` on `host:port` with the offline theme and no share link; kwargs go to `launch`."""
    theme = gr.themes.Default(font=THEME_FONTS, font_mono=["ui-monospace", "monospace"])
    return app.launch(server_name=host, server_port=port, share=False, theme=theme, **kwargs)
