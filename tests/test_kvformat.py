"""The KV-format registry (kvconvert.kvformat): byte counts, scale conventions, and that the
docs and the engine names agree with it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvconvert.errors import KVConvertError
from kvconvert.kvformat import KV_FORMATS, kv_format, markdown_table
from kvconvert.targets import TARGETS


def test_format_bytes_per_value():
    expected = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "fp8_e5m2": 1, "int8": 1, "nvfp4": 0.5 + 1 / 16,
                "nvfp4_fp8rope": 0.5 + 1 / 16, "int4": 0.5 + 2 / 32,
                # llama.cpp's: 32 values a block with an fp16 scale (+ an fp16 minimum for the _1 types)
                "q8_0": 1 + 2 / 32, "q5_1": 5 / 8 + 4 / 32, "q5_0": 5 / 8 + 2 / 32, "q4_1": 0.5 + 4 / 32,
                "q4_0": 0.5 + 2 / 32, "iq4_nl": 0.5 + 2 / 32}
    assert {n: f.bytes_per_value for n, f in KV_FORMATS.items()} == expected


@pytest.mark.parametrize("name, values, rope_tail, expected", [
    ("nvfp4", 16, 0, 8 + 1),
    ("nvfp4", 24, 0, 12 + 2),  # the second block, half full, still needs its scale
    ("nvfp4", 576, 0, 288 + 36),
    ("int4", 64, 0, 32 + 2 * 2),
    # MLA's k_rope tail stays 16-bit only under the 4-bit formats
    ("nvfp4", 576, 64, 256 + 32 + 128),
    ("nvfp4_fp8rope", 576, 64, 256 + 32 + 64),  # k_rope at one byte per value
    ("nvfp4_fp8rope", 288, 64, 112 + 14 + 64),  # SmolLM2's 224 + 64 (x 30 layers: 5700 B, 24.7%)
    ("fp8", 576, 64, 576),
    ("fp32", 576, 64, 4 * 576),
])
def test_vector_bytes(name, values, rope_tail, expected):
    assert kv_format(name).vector_bytes(values, rope_tail=rope_tail) == expected


@pytest.mark.parametrize("name", [n for n, f in KV_FORMATS.items() if f.ggml_type])
def test_llamacpp_formats_match_the_engines_blocks(name):
    """A llama.cpp type's bytes are its ggml block's (kvconvert.ggml_formats, byte-exact with the engine), and it
    has no kv scale: llama.cpp sets one per block as it writes a row."""
    from kvconvert.ggml_formats import GGML_TYPES

    fmt = kv_format(name)
    assert fmt.vector_bytes(320) == 10 * GGML_TYPES[fmt.ggml_type].block_bytes
    assert fmt.vector_bytes(320, rope_tail=64) == fmt.vector_bytes(320)  # an MLA row is quantized whole
    assert not fmt.has_kv_scale and "llamacpp" in fmt.engines


def test_unknown_kv_dtype_lists_the_known_ones():
    with pytest.raises(KVConvertError, match="nvfp4"):
        kv_format("fp6")
    assert kv_format("FP8_E4M3") is kv_format("fp8")


@pytest.mark.parametrize("name", [n for n, f in KV_FORMATS.items() if f.torch_dtype and f.quantized])
def test_scale_divisor_is_the_torch_dtype_max(name):
    """FP8's amax maps to its largest finite value, INT8's to 127 (symmetric: -128 is left to saturation)."""
    fmt = kv_format(name)
    dtype = getattr(torch, fmt.torch_dtype)
    assert fmt.integer == (not dtype.is_floating_point)
    assert fmt.amax_divisor == (torch.iinfo if fmt.integer else torch.finfo)(dtype).max
    assert fmt.scale_from_amax(fmt.amax_divisor) == 1.0


def test_int8_is_tensorrt_llms_cache():
    """INT8: ModelOpt's names and kv_cache_quant_algo, served by TensorRT-LLM (per-head K/V) and the runtime, no
    Triton kernel mode, one scale for K and V (the report's scale convention says so)."""
    fmt = kv_format("int8")
    assert (fmt.exports, fmt.modelopt_algo, fmt.kernel_mode) == (("modelopt",), "INT8", None)
    assert fmt.served_by() == ("tensorrt-llm", "kvconvert") and fmt.served_by(mla=True) == ("kvconvert",)
    assert fmt.has_kv_scale and fmt.shared_kv_scale and fmt.scale_rule.startswith("amax / 127;")
    assert kv_format("int4").engines == () and not kv_format("int4").has_kv_scale  # planning only


def test_engines_are_target_names():
    assert {e for f in KV_FORMATS.values() for e in (*f.engines, *(f.mla_engines or ()))} <= set(TARGETS)


def test_rope_formats_name_registry_formats():
    """A k_rope kept apart is stored in a registry format (its bytes and quantizer are that format's)."""
    assert {f.mla_rope for f in KV_FORMATS.values() if f.mla_rope} <= set(KV_FORMATS)
    assert kv_format("nvfp4_fp8rope").rope_tail(True, 64) == 64 == kv_format("nvfp4").rope_tail(True, 64)
    assert kv_format("nvfp4_fp8rope").rope_tail(False, 64) == 0 == kv_format("fp8").rope_tail(True, 64)


def test_docs_table_is_the_registry():
    docs = (Path(__file__).parents[1] / "docs" / "formats.md").read_text()
    assert markdown_table() in docs, "docs/formats.md's registry table is stale: paste kvformat.markdown_table()"


def test_weight_dtypes_are_one_table():
    """Every `--dtype` choice list and byte count reads kvformat's weight-dtype table."""
    import typing

    import torch

    from kvconvert.eval.options import ValidateOptions
    from kvconvert.kvformat import AUTO_WEIGHT_DTYPE_NAMES, WEIGHT_DTYPES, stored_bytes, torch_dtype
    from kvconvert.mla.options import MLAOptions
    from kvconvert.memory import DTYPES

    assert typing.get_args(MLAOptions.model_fields["dtype"].annotation) == tuple(WEIGHT_DTYPES)
    assert typing.get_args(ValidateOptions.model_fields["dtype"].annotation) == AUTO_WEIGHT_DTYPE_NAMES
    assert tuple(DTYPES) == AUTO_WEIGHT_DTYPE_NAMES
    for name, d in WEIGHT_DTYPES.items():
        assert torch_dtype(name).itemsize == d.bytes == stored_bytes(d.torch_name) == stored_bytes(f"torch.{d.torch_name}")
    assert torch_dtype("bf16") is torch.bfloat16 and stored_bytes(None) == 4 and stored_bytes("int8", 1) == 1


# ---------------------------------------------------------------------------------------------- K/V pairs

def test_a_pair_is_written_k_slash_v_and_one_name_means_both():
    from kvconvert.kvformat import kv_pair

    pair = kv_pair("Q5_0/IQ4_NL")
    assert (pair.k.name, pair.v.name, pair.name, pair.mixed) == ("q5_0", "iq4_nl", "q5_0/iq4_nl", True)
    assert pair.ggml_types == ("q5_0", "iq4_nl") and pair.side("kv") is pair.k and pair.side("v") is pair.v
    one = kv_pair("q4_0")
    assert one.k is one.v and not one.mixed and one.name == "q4_0" == kv_pair("q4_0/q4_0").name
    assert kv_pair("fp8_e4m3").name == "fp8"


def test_pair_bytes_are_the_sum_of_both_halves():
    from kvconvert.kvformat import kv_pair

    pair = kv_pair("q5_0/iq4_nl")
    # 64 values: two blocks of 32; q5_0 22 bytes a block, iq4_nl 18
    assert pair.token_bytes(64, 64) == 2 * 22 + 2 * 18 == kv_format("q5_0").vector_bytes(64) + kv_format(
        "iq4_nl").vector_bytes(64)
    assert pair.bytes_per_value == (22 + 18) / 2 / 32 and pair.bits == 4.5
    assert kv_pair("fp8").token_bytes(64, 64) == 128


@pytest.mark.parametrize("text", ["fp8/iq4_nl", "q5_0/bf16", "nvfp4/fp8", "q5_0/", "/q4_0", "a/b/c", "q5_0/zz"])
def test_pairs_outside_llamacpps_block_types_are_refused(text):
    from kvconvert.kvformat import kv_pair

    with pytest.raises(KVConvertError, match="KV dtype|unknown KV dtype"):
        kv_pair(text)


def test_mixed_pairs_are_refused_by_one_type_engines_and_for_mla():
    from kvconvert.kvformat import kv_pair

    pair = kv_pair("q8_0/iq4_nl")
    assert pair.served_by() == ("llamacpp", "kvconvert") and pair.served_by(mla=True) == ()
    pair.check_engine("llamacpp")
    for engine in ("vllm", "tensorrt-llm"):
        with pytest.raises(KVConvertError, match=f"{engine} stores K and V in one cache dtype"):
            pair.check_engine(engine)
    with pytest.raises(KVConvertError, match="MLA model caches one row"):
        pair.check_cache_kind(is_mla=True)
    pair.check_cache_kind(is_mla=False)
    kv_pair("q4_0").check_cache_kind(is_mla=True)


def test_kv_dtype_option_type_takes_pairs_of_its_choices():
    from pydantic import BaseModel, ValidationError

    from kvconvert.kvformat import RUNTIME_KV_DTYPES, kv_dtype_type

    class Opts(BaseModel):
        kv_dtype: kv_dtype_type(RUNTIME_KV_DTYPES) = "bf16"

    assert Opts(kv_dtype="Q5_0/IQ4_NL").kv_dtype == "q5_0/iq4_nl"
    assert Opts(kv_dtype="fp8_e4m3").kv_dtype == "fp8_e4m3" and Opts(kv_dtype="q4_0/q4_0").kv_dtype == "q4_0"
    for bad in ("fp8/q4_0", "int4", "q4_0/int4"):
        with pytest.raises(ValidationError):
            Opts(kv_dtype=bad)


def test_validate_takes_a_pair_and_vllm_refuses_it_by_name():
    from kvconvert.eval.engine_llamacpp import llamacpp_cache
    from kvconvert.eval.engine_vllm import vllm_kv_dtype
    from kvconvert.eval.options import ValidateOptions
    from kvconvert.eval.runner import resolve_kv_dtype

    assert ValidateOptions(kv_dtype="Q5_0/IQ4_NL").kv_dtype == "q5_0/iq4_nl"
    assert resolve_kv_dtype("transformers", "q5_0/iq4_nl") == "q5_0/iq4_nl" == resolve_kv_dtype("runtime", "q5_0/iq4_nl")
    assert llamacpp_cache("q5_0/iq4_nl", "candidate") == ("q5_0", "iq4_nl")
    assert llamacpp_cache("bf16", "source") == ("bf16", "bf16") and llamacpp_cache("auto", "source") == ("f16", "f16")
    assert vllm_kv_dtype("fp8", "candidate") == "fp8"
    with pytest.raises(KVConvertError, match="vllm stores K and V in one cache dtype"):
        vllm_kv_dtype("q5_0/iq4_nl", "candidate")
    with pytest.raises(KVConvertError, match="unknown"):
        resolve_kv_dtype("runtime", "fp8/q4_0")
