"""kvconvert.runtime: a small paged-KV serving runtime (installed as kvconvert.runtime)."""
