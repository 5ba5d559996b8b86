"""Continuous-token AR image models: MAR (`continuous.mar`) and CSpD continuous speculative decoding. The
shared machinery these pipelines use (the CSpD acceptance rule, stats, pipeline I/O) lives in `mmspec`."""
