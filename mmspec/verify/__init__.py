"""Acceptance rules (filled in below)."""
