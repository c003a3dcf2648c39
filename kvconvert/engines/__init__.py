"""Serving engines kvconvert's checkpoints are checked in: stock vLLM (run from its own venv) and stock llama.cpp
(its C API through llama-cpp-python, in a worker process), each behind kvconvert.engines.worker's client."""
