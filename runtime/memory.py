"""What a forward-only run (generate, validate) needs, estimated from config.json alone before any weight
is read; kvconvert.memory holds the estimate's type and the check that refuses with the option that fits.

    need = estimate_memory(config, weight_dtype=torch.bfloat16, kv_cache_bytes=..., tokens_per_step=512,
                           context=4096)
    check_memory(need, "kvconvert generate", hints=[...])   # kvconvert.memory: KVConvertError when it cannot fit

The estimate is deliberately simple and a little pessimistic: weights at the chosen dtype (mapped
bf16 weights still become resident as page cache when a forward touches them), the KV cache pool,
the largest per-step activations, and a fixed allowance for the interpreter, torch and the tokenizer
(kvconvert.memory.RUNTIME_OVERHEAD; on a GPU it stands for the CUDA context and the allocator's slack).
"""

from __future__ import annotations

import torch

from kvconvert.kvmath import parameter_count
from kvconvert.memory import RUNTIME_OVERHEAD, MemoryEstimate

KEEP_FP32_HEAD = 1 << 28  # a 16-bit lm_head whose fp32 copy is at most this is upcast once, not every step


def estimate_memory(config: dict, weight_dtype: torch.dtype, kv_cache_bytes: int = 0, tokens_per_step: int = 2048,
                    context: int = 2048) -> MemoryEstimate:
    """Bytes a forward-only run of the model in `config` needs (pure: config and numbers in, no I/O).

    weights: every parameter at weight_dtype's size. activations, for one step of tokens_per_step
    tokens attending to at most `context` positions (fp32 upper bounds):
      residual, normed input, q/k/v, attention output   ~ 6 x hidden per token
      gate, up, act(gate) * up                          ~ 3 x intermediate per token
      attention scores of one layer                     heads x tokens x context
      logits and their log-softmax (scoring every row)  2 x vocab per token
    """
    hidden = config["hidden_size"]
    inter = config.get("intermediate_size") or 4 * hidden
    heads = config["num_attention_heads"]
    t = tokens_per_step
    weights = parameter_count(config) * torch.finfo(weight_dtype).bits // 8
    head_fp32 = 4 * config["vocab_size"] * hidden  # a 16-bit lm_head's fp32 copy, kept when small (layers.upcast_chunks)
    if weight_dtype != torch.float32 and head_fp32 <= KEEP_FP32_HEAD:
        weights += head_fp32
    per_token = 6 * hidden + 3 * inter + 2 * config["vocab_size"]
    activations = 4 * (t * per_token + heads * t * min(context, config.get("max_position_embeddings") or context))
    return MemoryEstimate(weights=weights, kv_cache=kv_cache_bytes, activations=activations, overhead=RUNTIME_OVERHEAD)
