"""Discrete-token AR image models: LlamaGen (SJD, GSD, LANTERN, EAGLE drafts) and VAR (CoDe).

Not implemented yet: see the project's issues. The shared machinery these pipelines use lives in `mmspec`.
"""
