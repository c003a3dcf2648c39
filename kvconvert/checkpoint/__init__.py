"""Checkpoint I/O: lazy safetensors reading, atomic sharded writing, GGUF import."""

from kvconvert.checkpoint.reader import CheckpointReader, check_safetensors_file, read_config
from kvconvert.checkpoint.writer import (
    CheckpointWriter, check_output_path, ensure_free_space, sha256_file, verify_manifest,
)

__all__ = [
    "CheckpointReader", "CheckpointWriter", "check_output_path", "check_safetensors_file",
    "ensure_free_space", "read_config", "sha256_file", "verify_manifest",
]
