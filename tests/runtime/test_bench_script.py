"""scripts/bench_runtime.py runs end to end (tiny models, tiny grid) and reports exact KV numbers."""

from __future__ import annotations

import json

from kvconvert.runtime import LLM
from runtime_cases import load_script


def test_bench_script_tiny_grid(llama_gqa, deepseek_mla, tmp_path, capsys):
    bench = load_script("bench_runtime")
    out = tmp_path / "bench.json"
    bench.main(["--source", str(llama_gqa), "--mla", str(deepseek_mla), "--batches", "1,2", "--contexts", "8",
                "--decode-tokens", "2", "--kv-memory", "64K", "--request-tokens", "40", "--threads", "1", "--out", str(out)])
    report = json.loads(out.read_text())
    engines = {(r["model"], r["engine"], r["batch"]) for r in report["decode"]}
    assert engines == {(m, e, b) for m, e in [("source", "kvconvert-runtime"), ("mla", "kvconvert-runtime"),
                                              ("source", "transformers")] for b in (1, 2)}
    assert all(r["tokens_per_s"] > 0 for r in report["decode"])
    sizes = {(r["model"], r["kv_dtype"]): r["bytes_per_token"] for r in report["kv_bytes_per_token"]}
    for model, path in (("source", llama_gqa), ("mla", deepseek_mla)):
        assert sizes[(model, "fp8")] == LLM(path, kv_dtype="fp8", kv_scales="dynamic", num_blocks=1).kv_bytes_per_token
    fits = {(r["model"], r["kv_dtype"]): r for r in report["concurrency"]}
    # source bf16: 256 B/token; 64 KiB = 16 blocks of 16 tokens; a 40-token request takes 3 blocks -> 5
    # requests paged, while reserving max_model_len (256 tokens = 64 KiB) per request fits 1
    assert (fits[("source", "bf16")]["paged"], fits[("source", "bf16")]["reserved_max_len"]) == (5, 1)
    assert "| source | transformers | 2 | 8 |" in capsys.readouterr().out
