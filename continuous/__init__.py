"""Continuous-token AR image models: MAR and CSpD continuous speculative decoding.

Not implemented yet: see the project's issues. The shared machinery these pipelines use lives in `mmspec`.
"""
