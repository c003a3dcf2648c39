"""Temporary (issue 40): run_gate lives in kvconvert.eval.gate; this goes when the pipeline imports it from there."""

from kvconvert.eval.gate import run_gate  # noqa: F401
