"""End-to-end conversion of small random Llamas, loaded back in stock transformers."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from kvconvert.errors import KVConvertError, UnsupportedModelError
from kvconvert.mla.convert import MLAOptions, convert_to_mla

from mla_tiny_models import make_tiny_llama

FAST = dict(dtype="fp32", calib_tokens=1024, calib_window=256, target="any")  # research shapes


def _logits_rel_error(src, out, seed=0):
    torch.manual_seed(seed)
    ids = torch.randint(0, 49152, (2, 300))
    a = LlamaForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    b = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(b).__name__ == "DeepseekV3ForCausalLM"
    with torch.no_grad():
        la, lb = a(ids).logits, b(ids).logits
    return float((la - lb).norm() / la.norm())


def test_mqa_full_rank_matches_source_in_stock_transformers(tmp_path, smollm2_path):
    """One KV head, rope_dim = head_dim, full rank: the conversion is exact up to the latent
    RMSNorm linearisation (<= rho/2 per token): relative logit error < 1e-4."""
    src = make_tiny_llama(tmp_path / "src", smollm2_path, kv_heads=1)
    out = tmp_path / "mla"
    convert_to_mla(src, out, MLAOptions(rank=2 * 32 - 32, rope_dim=32, **FAST), progress=False)
    assert _logits_rel_error(src, out) < 1e-4
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3" and cfg["q_lora_rank"] is None
    assert cfg["first_k_dense_replace"] == cfg["num_hidden_layers"] and not cfg["tie_word_embeddings"]
    assert (out / "spectra.png").stat().st_size > 10_000
    assert (out / "conversion_report.json").is_file() and (out / "manifest.json").is_file()


def test_gqa_error_tracks_rope_energy_lost(tmp_path, smollm2_path):
    """Full latent rank: the only error left is the key energy that lost its rotation.
    Keys that are complex multiples of one head per frequency keep 100% -> exact; random keys
    lose energy -> the logit error is larger, in the order the report predicts."""
    exact_src = make_tiny_llama(tmp_path / "exact", smollm2_path, kv_heads=2, shared_key_phase=True)
    lossy_src = make_tiny_llama(tmp_path / "lossy", smollm2_path, kv_heads=2)
    errors, kept = [], []
    for src in (exact_src, lossy_src):
        out = tmp_path / f"{src.name}-mla"
        rep = convert_to_mla(src, out, MLAOptions(rank=2 * 2 * 32 - 32, rope_dim=32, refit_o_proj=False, **FAST), progress=False)
        errors.append(_logits_rel_error(src, out))
        kept.append(min(layer["rope_energy_kept"] for layer in rep.layers))
    assert kept[0] > 0.999999 and errors[0] < 1e-4
    assert kept[1] < 0.9 and errors[1] > 10 * errors[0]


def test_low_rank_refit_reduces_attention_error(tmp_path, smollm2_path):
    src = make_tiny_llama(tmp_path / "src", smollm2_path, kv_heads=2)
    rep = convert_to_mla(src, tmp_path / "out", MLAOptions(rank=24, rope_dim=16, **FAST), progress=False)
    for layer in rep.layers:
        assert layer["attn_rel_error_refit"] <= layer["attn_rel_error"] + 1e-9


@pytest.mark.parametrize("kw,match", [
    (dict(rank=10_000, rope_dim=32), "--rank 10000: must be between 1 and"),
    (dict(rank=16, rope_dim=7), "--rope-dim 7: must be a positive even number"),
    (dict(rank=16, rope_dim=24), "--rope-dim 24: must divide"),
    (dict(rank=16, rope_dim=64), "--rope-dim 64: must divide"),
])
def test_bad_plans_fail_before_work(tmp_path, smollm2_path, kw, match):
    src = make_tiny_llama(tmp_path / "src", smollm2_path, kv_heads=2)
    with pytest.raises(KVConvertError, match=match):
        convert_to_mla(src, tmp_path / "out", MLAOptions(**kw, **FAST), progress=False)
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture(tmp_path, smollm2_path):
    src = make_tiny_llama(tmp_path / "src", smollm2_path, kv_heads=2)
    cfg = json.loads((src / "config.json").read_text())
    for edit, match in (({"attention_bias": True}, "biases"), ({"model_type": "qwen3"}, "not supported yet")):
        (src / "config.json").write_text(json.dumps({**cfg, **edit}))
        with pytest.raises(UnsupportedModelError, match=match):
            convert_to_mla(src, tmp_path / "out", MLAOptions(rank=16, rope_dim=16, **FAST), progress=False)


def test_nan_weights_and_existing_output(tmp_path, smollm2_path):
    from safetensors.torch import load_file, save_file

    src = make_tiny_llama(tmp_path / "src", smollm2_path, kv_heads=2)
    (tmp_path / "exists").mkdir()
    with pytest.raises(KVConvertError, match="--overwrite"):
        convert_to_mla(src, tmp_path / "exists", MLAOptions(rank=16, rope_dim=16, **FAST), progress=False)
    state = load_file(src / "model.safetensors")
    state["model.layers.1.self_attn.k_proj.weight"][0, 0] = float("nan")
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(KVConvertError, match="layer 1 k_proj: source weights contain NaN"):
        convert_to_mla(src, tmp_path / "out", MLAOptions(rank=16, rope_dim=16, **FAST), progress=False)
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.tmp-*")), "temp folder must be cleaned up"


def test_cli_writes_checkpoint_and_refuses_existing(tmp_path, smollm2_path):
    from click.testing import CliRunner

    from kvconvert.commands.main import cli

    src = make_tiny_llama(tmp_path / "src", smollm2_path, kv_heads=2)
    args = ["mla", "--src", str(src), "--rank", "24", "--rope-dim", "16", "--target", "any", "--calib-tokens", "512",
            "--calib-window", "256", "--dtype", "bf16", "--out", str(tmp_path / "out"), "--json"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.output[result.output.index("{"):])["kv_lora_rank"] == 24
    again = CliRunner().invoke(cli, args)
    assert again.exit_code != 0


def test_kv_budget_parsing():
    """(The splits a budget allows: tests/test_targets.py.)"""
    from kvconvert.mla.budget_search import parse_budget

    cfg = {"model_type": "llama", "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "hidden_size": 576}
    assert parse_budget("0.25", cfg) == 96 and parse_budget("25%", cfg) == 96 and parse_budget("96", cfg) == 96
    with pytest.raises(KVConvertError, match="--kv-budget"):
        parse_budget("2.5x", cfg)


def test_kv_budget_search_picks_lowest_measured_error(tmp_path, smollm2_path):
    from kvconvert.mla.budget_search import search_split

    src = make_tiny_llama(tmp_path / "src", smollm2_path, kv_heads=2, layers=2)
    rank, rope, table = search_split(src, 48, calib_tokens=512, probes=1, progress=False)
    assert rank + rope == 48 and len(table) >= 2
    assert min(t["mean_attn_error"] for t in table) == next(
        t["mean_attn_error"] for t in table if (t["rank"], t["rope_dim"]) == (rank, rope))


def test_q_rank_full_is_exact_and_low_rank_loads(tmp_path, smollm2_path):
    """--q-rank = hidden size reproduces plain q_proj through the stock q_lora path (q_a_layernorm
    linearised); a smaller q-rank still loads and runs in stock transformers."""
    src = make_tiny_llama(tmp_path / "src", smollm2_path, kv_heads=1)
    out = tmp_path / "mla-q"
    convert_to_mla(src, out, MLAOptions(rank=32, rope_dim=32, q_rank=128, **FAST), progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["q_lora_rank"] == 128
    assert _logits_rel_error(src, out) < 1e-4
    with pytest.raises(KVConvertError, match="--q-rank 100000"):
        convert_to_mla(src, tmp_path / "bad", MLAOptions(rank=32, rope_dim=32, q_rank=100_000, **FAST), progress=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto means cuda on this machine")
def test_device_cpu_and_auto_write_identical_tensors(tmp_path, smollm2_path, monkeypatch):
    """--device cpu and the default (auto: cpu without a GPU) write the same bytes; cuda without a GPU
    is refused before any work."""
    from safetensors.torch import load_file

    from kvconvert.stage_options import build_options

    src = make_tiny_llama(tmp_path / "src", smollm2_path, kv_heads=2)
    opts = dict(rank=40, rope_dim=16, q_rank=48, **FAST)
    for device in ("cpu", "auto"):
        convert_to_mla(src, tmp_path / device, MLAOptions(device=device, **opts), progress=False)
    tensors = [{k: v for f in sorted((tmp_path / d).glob("*.safetensors")) for k, v in load_file(f).items()}
               for d in ("cpu", "auto")]
    assert tensors[0].keys() == tensors[1].keys() and all(torch.equal(v, tensors[1][k]) for k, v in tensors[0].items())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(KVConvertError, match="torch sees none"):
        convert_to_mla(src, tmp_path / "cuda", MLAOptions(device="cuda", **opts), progress=False)
    assert not (tmp_path / "cuda").exists()
    with pytest.raises(KVConvertError, match="device"):
        build_options(MLAOptions, {"rank": 40, "device": "gpu"})
