"""Checkpoint I/O: lazy safetensors reading, atomic sharded writing, GGUF import."""

from kvconvert.checkpoint.reader import (
    CheckpointReader, eos_token_ids, healed_cache_format, load_tokenizer, read_config, read_manifest,
)
from kvconvert.checkpoint.writer import (
    CheckpointWriter, atomic_save_tensors, atomic_write_bytes, atomic_write_text, check_not_source, check_output_path, check_writable, clean_stale_temps, ensure_free_space,
    free_space_problem,
    estimate_checkpoint_bytes, sha256_file, verify_manifest,
)
from kvconvert.checkpoint.checks import check_checkpoint, check_finite_weights, check_tensors_present  # noqa: E402

__all__ = [
    "CheckpointReader", "CheckpointWriter", "atomic_save_tensors", "atomic_write_bytes", "atomic_write_text", "check_checkpoint", "check_finite_weights", "check_not_source", "check_output_path",
    "check_tensors_present", "check_writable", "clean_stale_temps", "ensure_free_space", "eos_token_ids", "free_space_problem",
    "estimate_checkpoint_bytes", "healed_cache_format", "load_tokenizer", "read_config", "read_manifest", "sha256_file", "verify_manifest",
]
