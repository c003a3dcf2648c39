"""Tiny random Llama checkpoints for conversion tests (real safetensors, real tokenizer)."""

import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def make_tiny_llama(folder: Path, tokenizer_dir: Path, kv_heads: int, heads: int = 4, head_dim: int = 32,
                    layers: int = 2, seed: int = 0, shared_key_phase: bool = False) -> Path:
    """A random Llama with SmolLM2's tokenizer (vocab 49152), saved as safetensors.

    shared_key_phase: make every KV head's key a complex multiple of head 0's key per frequency
    (rank one across heads), so the RoPE step keeps 100% of the key energy.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=heads * head_dim, intermediate_size=2 * heads * head_dim,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim, max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # larger q/k so attention is not uniform
            layer.self_attn.q_proj.weight.mul_(4)
            layer.self_attn.k_proj.weight.mul_(4)
            if shared_key_phase:
                w = layer.self_attn.k_proj.weight.view(kv_heads, head_dim, -1)
                half = head_dim // 2
                base = torch.complex(w[0, :half], w[0, half:])
                for g in range(1, kv_heads):
                    phase = torch.exp(1j * torch.rand(half, 1) * 6.28) * (0.5 + torch.rand(half, 1))
                    mixed = base * phase
                    w[g, :half], w[g, half:] = mixed.real, mixed.imag
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, folder / name)
    return folder


