"""Functional teacher (Llama) and student (DeepSeek-V3 MLA) decoder layers read straight from
checkpoints, for the layer-wise stage. Everything is read from each checkpoint's own config, so any
checkpoint the converter writes works.

Shapes: hidden states h [B, T, hidden]; weights keep checkpoint layouts (nn.Linear: [out, in]).
Student layer weights use short names: q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj,
o_proj, input_layernorm, post_attention_layernorm, gate_proj, up_proj, down_proj.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvconvert.checkpoint import CheckpointReader
from kvconvert.mla import deepseek_format as fmt
from kvconvert.mla.llama_block import LlamaShape, llama_attention, llama_layer, llama_mlp, rms_norm
from kvconvert.mla.mla_block import MLAShape, mla_attention

# short name -> "model.layers.{i}.self_attn.<name>.weight"; a checkpoint has q_proj or, with
# low-rank queries, q_a_proj + q_a_layernorm + q_b_proj.
STUDENT_ATTENTION = fmt.TARGET_ATTENTION
STUDENT_OTHER = {
    "input_layernorm": "model.layers.{i}.input_layernorm.weight",
    "post_attention_layernorm": "model.layers.{i}.post_attention_layernorm.weight",
    "gate_proj": "model.layers.{i}.mlp.gate_proj.weight",
    "up_proj": "model.layers.{i}.mlp.up_proj.weight",
    "down_proj": "model.layers.{i}.mlp.down_proj.weight",
}
TEACHER_LAYER = {**fmt.SOURCE_ATTENTION, **STUDENT_OTHER}
KV_A_LAYERNORM_EPS = 1e-6  # transformers' DeepseekV3Attention hard-codes it (docs/formats.md)


@dataclass(frozen=True)
class StudentShape:
    """MLA attention shape plus the decoder norms' eps, from a DeepSeek-V3 config."""

    mla: MLAShape
    rms_eps: float


def student_shape(cfg: dict) -> StudentShape:
    """Read the MLA geometry and RoPE exactly as transformers' DeepseekV3 builds them."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    config = DeepseekV3Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    rotary = DeepseekV3RotaryEmbedding(config)
    mla = MLAShape(
        heads=cfg["num_attention_heads"], rank=cfg["kv_lora_rank"], rope_dim=cfg["qk_rope_head_dim"],
        nope_dim=cfg["qk_nope_head_dim"], v_dim=cfg["v_head_dim"], latent_eps=KV_A_LAYERNORM_EPS,
        inv_freq=rotary.inv_freq.to(torch.float64), attention_scaling=float(rotary.attention_scaling))
    return StudentShape(mla, float(cfg.get("rms_norm_eps", 1e-6)))


def teacher_shape(cfg: dict) -> LlamaShape:
    from kvconvert.mla.convert import source_rope

    d = fmt.head_dim(cfg)
    inv_freq, scaling = source_rope(cfg, d)
    heads = cfg["num_attention_heads"]
    return LlamaShape(cfg["hidden_size"], heads, cfg.get("num_key_value_heads", heads), d,
                      float(cfg.get("rms_norm_eps", 1e-5)), inv_freq, scaling)


def read_layer(reader: CheckpointReader, names: dict[str, str], i: int, dtype=torch.float32,
               optional: bool = False) -> dict:
    """Layer i's tensors by short name; optional=True skips names the checkpoint lacks."""
    return {short: reader.get(name.format(i=i), dtype) for short, name in names.items()
            if not optional or name.format(i=i) in reader}


def student_layer_weights(reader: CheckpointReader, i: int, dtype=torch.float32) -> dict:
    return {**read_layer(reader, STUDENT_ATTENTION, i, dtype, optional=True), **read_layer(reader, STUDENT_OTHER, i, dtype)}


def attention_part(w: dict) -> dict:
    """The attention tensors of a layer-weights dict (the ones present)."""
    return {k: w[k] for k in STUDENT_ATTENTION if k in w}


def teacher_layer_weights(reader: CheckpointReader, i: int, dtype=torch.float32) -> dict:
    return read_layer(reader, TEACHER_LAYER, i, dtype)


def student_attention(h: torch.Tensor, w: dict, s: StudentShape) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed input x, attention block output) for residual stream h [B, T, hidden]."""
    x = rms_norm(h, w["input_layernorm"], s.rms_eps)
    return x, mla_attention(x, w, s.mla)


def student_mlp_residual(h_mid: torch.Tensor, w: dict, s: StudentShape) -> torch.Tensor:
    """h_mid + MLP(norm(h_mid)): the second half of a DeepseekV3 dense decoder layer."""
    return h_mid + llama_mlp(rms_norm(h_mid, w["post_attention_layernorm"], s.rms_eps), w)


def student_layer(h: torch.Tensor, w: dict, s: StudentShape) -> torch.Tensor:
    return student_mlp_residual(h + student_attention(h, w, s)[1], w, s)


def teacher_attention(h: torch.Tensor, w: dict, s: LlamaShape) -> tuple[torch.Tensor, torch.Tensor]:
    x = rms_norm(h, w["input_layernorm"], s.rms_eps)
    return x, llama_attention(x, w, s)


def teacher_layer(h: torch.Tensor, w: dict, s: LlamaShape) -> torch.Tensor:
    return llama_layer(h, w, s)
