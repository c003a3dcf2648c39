"""Serving engines kvconvert's checkpoints are checked in (stock vLLM, run from its own venv)."""
