"""The 'triton' attention backend (kvconvert.kernels) against the 'torch' reference backend.

Scoring with a token budget of 1 sends every position through the decode kernels
(paged_gqa_decode / paged_mla_decode) and every cache write through kv_append. On a CPU this needs
Triton's interpreter (TRITON_INTERPRET=1, set by scripts/test.sh); the kernels accumulate in fp32,
so logits agree within 1e-4 and greedy tokens are identical.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvconvert.errors import KVConvertError
from kvconvert.runtime import LLM
from runtime_cases import greedy, random_ids

pytest.importorskip("triton")
needs_interpreter = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need a GPU or TRITON_INTERPRET=1 (scripts/test.sh sets it)",
)


@needs_interpreter
@pytest.mark.parametrize("kv_dtype", ["fp32", "fp8", "nvfp4", "nvfp4_fp8rope"])
def test_triton_backend_matches_torch(tiny_model, kv_dtype, request):
    if kv_dtype == "nvfp4_fp8rope" and "llama" in request.node.callspec.id:
        pytest.skip("an MLA-only cache format (refused for Llama: test_kv_quant)")
    prompt, params = random_ids(10), greedy(6)
    results = {}
    for backend in ("torch", "triton"):
        llm = LLM(tiny_model, kv_dtype=kv_dtype, kv_scales="dynamic", block_size=4, max_num_batched_tokens=1,
                  attention_backend=backend)
        results[backend] = (llm.score(prompt), llm.generate([prompt], params)[0].token_ids)
    torch.testing.assert_close(results["triton"][0], results["torch"][0], atol=1e-4, rtol=0)
    assert results["triton"][1] == results["torch"][1]


def test_triton_backend_refuses_e5m2(llama_gqa):
    with pytest.raises(KVConvertError, match="e4m3"):
        LLM(llama_gqa, kv_dtype="fp8_e5m2", kv_scales="dynamic", attention_backend="triton")
