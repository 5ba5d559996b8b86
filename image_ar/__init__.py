"""Discrete-token AR image models: LlamaGen (`image_ar.llamagen`: SJD, GSD, LANTERN, EAGLE drafts) and VAR
(`image_ar.var`: the next-scale transformer so far; the VQVAE, pipelines and CoDe are issue 6's remaining work).

The shared machinery these pipelines use lives in `mmspec`.
"""
