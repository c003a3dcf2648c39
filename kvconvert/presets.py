"""Published model configs, as literal dicts, for `kvconvert budget --model NAME`.

Each preset copies the fields of the model's Hugging Face `config.json` that size the KV cache and
the weights (source named per entry). `parameters` is the exact count of the checkpoint's
tensors (tied embeddings once; DeepSeek-V3 without its multi-token-prediction module), which
rounds to the published figure in `published`. tests/test_budget.py recomputes both from the
fields by hand.
"""

from __future__ import annotations

from kvconvert.errors import KVConvertError

_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "tie_word_embeddings": False}

PRESETS: dict[str, dict] = {
    "llama-2-7b": {
        "source": "meta-llama/Llama-2-7b-hf: config.json",
        "published": "6.74B",
        "parameters": 6_738_415_616,
        "config": {**_LLAMA, "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                   "num_key_value_heads": 32, "head_dim": 128, "vocab_size": 32000,
                   "intermediate_size": 11008, "max_position_embeddings": 4096},
    },
    "llama-2-70b": {
        "source": "meta-llama/Llama-2-70b-hf: config.json",
        "published": "69.0B",
        "parameters": 68_976_648_192,
        "config": {**_LLAMA, "num_hidden_layers": 80, "hidden_size": 8192, "num_attention_heads": 64,
                   "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 32000,
                   "intermediate_size": 28672, "max_position_embeddings": 4096},
    },
    "llama-3.1-8b": {
        "source": "meta-llama/Llama-3.1-8B: config.json",
        "published": "8.03B",
        "parameters": 8_030_261_248,
        "config": {**_LLAMA, "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
                   "intermediate_size": 14336, "max_position_embeddings": 131072},
    },
    "llama-3.1-70b": {
        "source": "meta-llama/Llama-3.1-70B: config.json",
        "published": "70.6B",
        "parameters": 70_553_706_496,
        "config": {**_LLAMA, "num_hidden_layers": 80, "hidden_size": 8192, "num_attention_heads": 64,
                   "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
                   "intermediate_size": 28672, "max_position_embeddings": 131072},
    },
    "llama-3.1-405b": {
        "source": "meta-llama/Llama-3.1-405B: config.json",
        "published": "406B",
        "parameters": 405_853_388_800,
        "config": {**_LLAMA, "num_hidden_layers": 126, "hidden_size": 16384, "num_attention_heads": 128,
                   "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
                   "intermediate_size": 53248, "max_position_embeddings": 131072},
    },
    # v0.3 chosen: no sliding window (sliding_window null), 32768-token vocab. v0.1 differs: vocab
    # 32000 and sliding_window 4096 (its cache holds at most 4096 tokens per layer).
    "mistral-7b": {
        "source": "mistralai/Mistral-7B-v0.3: config.json",
        "published": "7.25B",
        "parameters": 7_248_023_552,
        "config": {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "tie_word_embeddings": False,
                   "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 32768,
                   "intermediate_size": 14336, "max_position_embeddings": 32768, "sliding_window": None},
    },
    # Qwen2.5 base models (the -Instruct configs say max_position_embeddings 32768). q/k/v biases;
    # sliding_window is present but use_sliding_window is false.
    "qwen2.5-7b": {
        "source": "Qwen/Qwen2.5-7B: config.json",
        "published": "7.61B",
        "parameters": 7_615_616_512,
        "config": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "tie_word_embeddings": False,
                   "num_hidden_layers": 28, "hidden_size": 3584, "num_attention_heads": 28,
                   "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 152064,
                   "intermediate_size": 18944, "max_position_embeddings": 131072,
                   "sliding_window": 131072, "use_sliding_window": False, "max_window_layers": 28},
    },
    "qwen2.5-72b": {
        "source": "Qwen/Qwen2.5-72B: config.json",
        "published": "72.7B",
        "parameters": 72_706_203_648,
        "config": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "tie_word_embeddings": False,
                   "num_hidden_layers": 80, "hidden_size": 8192, "num_attention_heads": 64,
                   "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 152064,
                   "intermediate_size": 29568, "max_position_embeddings": 131072,
                   "sliding_window": 131072, "use_sliding_window": False, "max_window_layers": 80},
    },
    # MLA: the cache holds kv_lora_rank + qk_rope_head_dim = 576 values per token and layer.
    "deepseek-v2-lite": {
        "source": "deepseek-ai/DeepSeek-V2-Lite: config.json",
        "published": "15.7B",
        "parameters": 15_706_484_224,
        "config": {"model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"],
                   "tie_word_embeddings": False, "num_hidden_layers": 27, "hidden_size": 2048,
                   "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 102400,
                   "intermediate_size": 10944, "max_position_embeddings": 163840,
                   "q_lora_rank": None, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                   "qk_nope_head_dim": 128, "v_head_dim": 128,
                   "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
                   "moe_intermediate_size": 1408, "first_k_dense_replace": 1, "topk_method": "greedy"},
    },
    "deepseek-v3": {
        "source": "deepseek-ai/DeepSeek-V3: config.json",
        "published": "671B (685B on the hub with the 14B multi-token-prediction module)",
        "parameters": 671_026_419_200,
        "config": {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
                   "tie_word_embeddings": False, "num_hidden_layers": 61, "hidden_size": 7168,
                   "num_attention_heads": 128, "num_key_value_heads": 128, "vocab_size": 129280,
                   "intermediate_size": 18432, "max_position_embeddings": 163840,
                   "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                   "qk_nope_head_dim": 128, "v_head_dim": 128,
                   "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
                   "moe_intermediate_size": 2048, "first_k_dense_replace": 3, "topk_method": "noaux_tc"},
    },
    "smollm2-135m": {
        "source": "HuggingFaceTB/SmolLM2-135M-Instruct: config.json",
        "published": "135M",
        "parameters": 134_515_008,
        "config": {**_LLAMA, "tie_word_embeddings": True, "num_hidden_layers": 30, "hidden_size": 576,
                   "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
                   "intermediate_size": 1536, "max_position_embeddings": 8192},
    },
}


def get_preset(name: str) -> dict:
    """The preset entry for `name` (case-insensitive); error lists the known names."""
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise KVConvertError(
            f"unknown model {name!r}: not a preset, folder or config.json; presets: {', '.join(PRESETS)}") from None
