"""Typed, self-validating configuration of the runtime engine and of sampling.

Every value is checked in ``__post_init__`` so a bad setting fails at construction time with a
one-line KVConvertError, never deep inside a forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvconvert.errors import KVConvertError
from kvconvert.kvformat import RUNTIME_KV_DTYPES, check_kv_dtype

KV_SCALE_SOURCES = ("checkpoint", "dynamic")
ATTENTION_BACKENDS = ("torch", "triton")

# When neither num_blocks nor kv_memory is given the pool gets this many bytes (capped at what
# max_num_seqs full-length requests could ever use).
DEFAULT_KV_MEMORY = 1 << 30


def _positive_int(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise KVConvertError(f"{name} must be a positive integer, got {value!r}")


@dataclass
class EngineConfig:
    """How the engine lays out and schedules the paged KV cache.

    block_size: tokens per KV block. num_blocks / kv_memory: pool size as a block count or in
    bytes (at most one of them; neither = DEFAULT_KV_MEMORY capped at the useful maximum).
    max_num_seqs: most sequences in one step. max_num_batched_tokens: token budget of one step
    (long prompts are prefilled in chunks of at most this many tokens). max_model_len: longest
    sequence (prompt + generated); None = the checkpoint's max_position_embeddings.
    kv_dtype: cache storage format (kvconvert.kvformat.RUNTIME_KV_DTYPES). kv_scales: where fp8/nvfp4
    scales come from: "checkpoint" (k_scale / v_scale tensors, required) or "dynamic" (amax of the
    first prefill).
    attention_backend: "torch" (reference, CPU) or "triton" (kvconvert.kernels).
    decoded_copy: keep each quantized layer's rows also decoded, in the weights' dtype, as they are written
    (kv_cache.add_decoded_copy), so the torch backend's steps copy them instead of dequantizing the whole context
    again; the same values, for that dtype's bytes per cached value more memory. The Triton kernels read the
    stored cache itself.
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_memory: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    kv_dtype: str = "bf16"
    kv_scales: str = "checkpoint"
    attention_backend: str = "torch"
    enable_prefix_caching: bool = True
    decoded_copy: bool = False

    def __post_init__(self):
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            _positive_int(name, getattr(self, name))
        for name in ("num_blocks", "kv_memory", "max_model_len"):
            _positive_int(name, getattr(self, name), allow_none=True)
        if self.num_blocks is not None and self.kv_memory is not None:
            raise KVConvertError("give num_blocks or kv_memory, not both")
        try:  # a format, or a K/V pair of llama.cpp's types (q5_0/iq4_nl), kept in its canonical spelling
            self.kv_dtype = check_kv_dtype(self.kv_dtype, RUNTIME_KV_DTYPES)
        except ValueError as exc:
            raise KVConvertError(f"kv_dtype {self.kv_dtype!r} is not supported; choose one of "
                                 f"{', '.join(RUNTIME_KV_DTYPES)}, or a K/V pair KTYPE/VTYPE of llama.cpp's types ({exc})"
                                 ) from None
        if self.decoded_copy and self.attention_backend != "torch":
            raise KVConvertError("decoded_copy is the torch attention backend's: the Triton kernels read the stored "
                                 "cache itself; use attention_backend='torch' or leave decoded_copy off")
        for name, choices in (("kv_scales", KV_SCALE_SOURCES),
                              ("attention_backend", ATTENTION_BACKENDS)):
            if getattr(self, name) not in choices:
                raise KVConvertError(
                    f"{name} {getattr(self, name)!r} is not supported; choose one of {', '.join(choices)}")


@dataclass
class SamplingParams:
    """How to pick the next token and when to stop.

    greedy (or temperature == 0): argmax. Otherwise softmax(logits / temperature) restricted to the
    smallest set of tokens whose probability reaches top_p. seed: a private generator per request,
    so the same seed gives the same tokens whatever else is in the batch.
    max_tokens: new tokens to generate (0 is allowed: prefill only). stop_token_ids: extra stop
    tokens besides the model's EOS; ignore_eos: keep going past EOS. min_tokens: the first min_tokens
    new tokens cannot be a stop token or (without ignore_eos) EOS: their logits are masked before
    sampling (vLLM's SamplingParams.min_tokens), so at least min(min_tokens, max_tokens) tokens come back
    unless the context runs out.
    """

    max_tokens: int = 64
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 0:
            raise KVConvertError(f"max_tokens must be a non-negative integer, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or \
                not 0 <= self.min_tokens <= self.max_tokens:
            raise KVConvertError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                                 f"got {self.min_tokens!r}")
        if not (self.temperature >= 0.0):  # also rejects NaN
            raise KVConvertError(f"temperature must be >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise KVConvertError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise KVConvertError(f"seed must be a non-negative integer, got {self.seed!r}")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0.0
