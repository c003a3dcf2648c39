"""Published model configs, as literal dicts, for `kvconvert budget --model NAME`.

Each preset copies the fields of the model's Hugging Face `config.json` that size the KV cache and
the weights (source named per entry). `parameters` is the exact count of the checkpoint's
tensors (tied embeddings once; DeepSeek-V3 without its multi-token-prediction module), which
rounds to the published figure in `published`. tests/test_budget.py recomputes both from the
fields by hand.
"""

from __future__ import annotations

from kvconvert.errors import KVConvertError

# MLA: the cache holds kv_lora_rank + qk_rope_head_dim = 576 values per token and layer.
_DEEPSEEK_MLA = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}


def _preset(repo: str, published: str, parameters: int, model_type: str, layers: int, hidden: int, heads: int,
            kv_heads: int, vocab: int, ffn: int, context: int, **fields) -> dict:
    """A PRESETS entry: `repo`'s config.json fields (the family's: model_type, its transformers class
    deepseek_v3 -> DeepseekV3ForCausalLM, untied embeddings; the sizes; then `fields`)."""
    architecture = "".join(part.capitalize() for part in model_type.split("_")) + "ForCausalLM"
    config = {"model_type": model_type, "architectures": [architecture], "tie_word_embeddings": False,
              "num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "vocab_size": vocab, "intermediate_size": ffn,
              "max_position_embeddings": context, **fields}
    return {"source": f"{repo}: config.json", "published": published, "parameters": parameters, "config": config}


PRESETS: dict[str, dict] = {
    "llama-2-7b": _preset("meta-llama/Llama-2-7b-hf", "6.74B", 6_738_415_616, "llama", layers=32, hidden=4096,
                          heads=32, kv_heads=32, vocab=32000, ffn=11008, context=4096, head_dim=128),
    "llama-2-70b": _preset("meta-llama/Llama-2-70b-hf", "69.0B", 68_976_648_192, "llama", layers=80, hidden=8192,
                           heads=64, kv_heads=8, vocab=32000, ffn=28672, context=4096, head_dim=128),
    "llama-3.1-8b": _preset("meta-llama/Llama-3.1-8B", "8.03B", 8_030_261_248, "llama", layers=32, hidden=4096,
                            heads=32, kv_heads=8, vocab=128256, ffn=14336, context=131072, head_dim=128),
    "llama-3.1-70b": _preset("meta-llama/Llama-3.1-70B", "70.6B", 70_553_706_496, "llama", layers=80, hidden=8192,
                             heads=64, kv_heads=8, vocab=128256, ffn=28672, context=131072, head_dim=128),
    "llama-3.1-405b": _preset("meta-llama/Llama-3.1-405B", "406B", 405_853_388_800, "llama", layers=126,
                              hidden=16384, heads=128, kv_heads=8, vocab=128256, ffn=53248, context=131072,
                              head_dim=128),
    # v0.3 chosen: no sliding window (sliding_window null), 32768-token vocab. v0.1 differs: vocab
    # 32000 and sliding_window 4096 (its cache holds at most 4096 tokens per layer).
    "mistral-7b": _preset("mistralai/Mistral-7B-v0.3", "7.25B", 7_248_023_552, "mistral", layers=32, hidden=4096,
                          heads=32, kv_heads=8, vocab=32768, ffn=14336, context=32768, head_dim=128,
                          sliding_window=None),
    # Qwen2.5 base models (the -Instruct configs say max_position_embeddings 32768). q/k/v biases;
    # sliding_window is present but use_sliding_window is false.
    "qwen2.5-7b": _preset("Qwen/Qwen2.5-7B", "7.61B", 7_615_616_512, "qwen2", layers=28, hidden=3584, heads=28,
                          kv_heads=4, vocab=152064, ffn=18944, context=131072, head_dim=128, sliding_window=131072,
                          use_sliding_window=False, max_window_layers=28),
    "qwen2.5-72b": _preset("Qwen/Qwen2.5-72B", "72.7B", 72_706_203_648, "qwen2", layers=80, hidden=8192, heads=64,
                           kv_heads=8, vocab=152064, ffn=29568, context=131072, head_dim=128, sliding_window=131072,
                           use_sliding_window=False, max_window_layers=80),
    "deepseek-v2-lite": _preset("deepseek-ai/DeepSeek-V2-Lite", "15.7B", 15_706_484_224, "deepseek_v2", layers=27,
                                hidden=2048, heads=16, kv_heads=16, vocab=102400, ffn=10944, context=163840,
                                q_lora_rank=None, **_DEEPSEEK_MLA, n_routed_experts=64, n_shared_experts=2,
                                num_experts_per_tok=6, moe_intermediate_size=1408, first_k_dense_replace=1,
                                topk_method="greedy"),
    "deepseek-v3": _preset("deepseek-ai/DeepSeek-V3", "671B (685B on the hub with the 14B multi-token-prediction "
                           "module)", 671_026_419_200, "deepseek_v3", layers=61, hidden=7168, heads=128, kv_heads=128,
                           vocab=129280, ffn=18432, context=163840, q_lora_rank=1536, **_DEEPSEEK_MLA,
                           n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
                           moe_intermediate_size=2048, first_k_dense_replace=3, topk_method="noaux_tc"),
    "smollm2-135m": _preset("HuggingFaceTB/SmolLM2-135M-Instruct", "135M", 134_515_008, "llama", layers=30,
                            hidden=576, heads=9, kv_heads=3, vocab=49152, ffn=1536, context=8192, head_dim=64,
                            tie_word_embeddings=True),
}


def get_preset(name: str) -> dict:
    """The preset entry for `name` (case-insensitive); error lists the known names."""
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise KVConvertError(
            f"unknown model {name!r}: not a preset, folder or config.json; presets: {', '.join(PRESETS)}") from None
