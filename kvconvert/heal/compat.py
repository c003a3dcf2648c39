"""Checks that a student/teacher pair can be healed, run before any data is read or any training
starts. Each failure is one KVConvertError line that says what differs and what to do."""

from __future__ import annotations

from pathlib import Path

import torch

from kvconvert.checkpoint import CheckpointReader, load_tokenizer, read_manifest
from kvconvert.errors import KVConvertError, UnsupportedModelError
from kvconvert.mla import deepseek_format as fmt
from kvconvert.models.registry import TARGET_MODEL_TYPE

MATCHING_KEYS = ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads", "intermediate_size")
# Tensors the converter copies unchanged (up to a dtype cast): equal in a real conversion.
SHARED_TENSORS = ("model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight")
SHARED_TOLERANCE = 1e-2  # relative max error: covers an fp32 -> bf16 cast (2^-8), not other weights


def check_student_config(cfg: dict, where: Path) -> None:
    """The student must be a stock DeepSeek-V3 MLA checkpoint with the layout the healer trains."""
    if cfg.get("model_type") != TARGET_MODEL_TYPE:
        raise UnsupportedModelError(
            f"{where}: student model_type is {cfg.get('model_type')!r}, not {TARGET_MODEL_TYPE!r}; "
            "heal a checkpoint written by `kvconvert mla`, or a model of the teacher's own architecture")
    if cfg.get("first_k_dense_replace", 0) < cfg.get("num_hidden_layers", 0):
        raise UnsupportedModelError(f"{where}: MoE layers found (first_k_dense_replace < num_hidden_layers); "
                                    "only all-dense MLA conversions can be healed")


# A student with the teacher's own architecture (healed for its KV cache): these must match too.
SAME_ARCH_KEYS = ("model_type", "num_key_value_heads", "head_dim")


def same_architecture(s_cfg: dict, t_cfg: dict) -> bool:
    """The student keeps the teacher's architecture (a source healed for its cache, e.g. --student SRC
    --teacher SRC), rather than being an MLA conversion of it."""
    return s_cfg.get("model_type") == t_cfg.get("model_type") != TARGET_MODEL_TYPE


def check_pair(student: CheckpointReader, teacher: CheckpointReader) -> list[str]:
    """Raise unless `student` is an MLA conversion of `teacher`, or a model of the teacher's own architecture
    and shape (its own copy or an earlier heal of it). Returns notes (soft findings)."""
    s_cfg, t_cfg = student.config, teacher.config
    if same_architecture(s_cfg, t_cfg):
        for key in (*MATCHING_KEYS, *SAME_ARCH_KEYS):
            if s_cfg.get(key) != t_cfg.get(key):
                raise KVConvertError(f"student {key}={s_cfg.get(key)} but teacher {key}={t_cfg.get(key)}: a student "
                                     "of the teacher's own architecture must have its shape; pass the model it came "
                                     "from as --teacher")
        for name in SHARED_TENSORS:
            _check_shared_tensor(student, teacher, name)
        check_tokenizers(student.path, teacher.path)
        return []
    check_student_config(s_cfg, student.path)
    try:
        fmt.check_source_config(t_cfg)
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(f"{teacher.path}: teacher: {exc}") from None
    for key in MATCHING_KEYS:
        if s_cfg.get(key) != t_cfg.get(key):
            raise KVConvertError(
                f"student {key}={s_cfg.get(key)} but teacher {key}={t_cfg.get(key)}: the student is not an MLA "
                f"conversion of this teacher; pass the source the student was converted from")
    for name in SHARED_TENSORS:
        _check_shared_tensor(student, teacher, name)
    check_tokenizers(student.path, teacher.path)
    return _manifest_notes(student.path, teacher.path)


def _check_shared_tensor(student: CheckpointReader, teacher: CheckpointReader, name: str) -> None:
    if name not in student or name not in teacher:
        raise KVConvertError(f"{name} missing from {'student' if name not in student else 'teacher'}: "
                             "is this a complete checkpoint?")
    if student.shape(name) != teacher.shape(name):
        raise KVConvertError(f"{name}: student shape {student.shape(name)} != teacher {teacher.shape(name)}")
    s = student.get(name, torch.float32)
    t = teacher.get(name, torch.float32)
    err = float((s - t).abs().max() / t.abs().max().clamp_min(1e-30))
    if err > SHARED_TOLERANCE:
        raise KVConvertError(
            f"{name} differs between student and teacher (relative error {err:.3g}): the student was not "
            "converted from this teacher; pass the source the student was converted from")


def check_tokenizers(student_dir: Path, teacher_dir: Path) -> None:
    """Distillation compares next-token distributions position by position: the two vocabularies
    (token -> id maps) must be identical."""
    s_vocab, t_vocab = load_tokenizer(student_dir).get_vocab(), load_tokenizer(teacher_dir).get_vocab()
    if s_vocab != t_vocab:
        only_s = len(set(s_vocab) - set(t_vocab))
        moved = sum(1 for k, v in s_vocab.items() if k in t_vocab and t_vocab[k] != v)
        raise KVConvertError(
            f"student and teacher tokenizers differ ({len(s_vocab)} vs {len(t_vocab)} tokens, {only_s} only in the "
            f"student, {moved} with other ids): heal needs the teacher the student was converted from")


def _manifest_notes(student_dir: Path, teacher_dir: Path) -> list[str]:
    manifest = read_manifest(student_dir)
    source = manifest.get("source")
    if not source:
        return [f"{student_dir}: no manifest source recorded; relied on the weight check"]
    src_path = Path(source).expanduser()
    if src_path.exists() and src_path.resolve() != Path(teacher_dir).resolve():
        return [f"student manifest names source {source}, teacher is {teacher_dir} (shared weights match)"]
    return []
