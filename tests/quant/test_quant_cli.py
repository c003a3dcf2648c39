"""`kvconvert calibrate` end to end on tiny checkpoints: outputs, names, round trips, bad input."""

import importlib.util
import json
import math
import shutil

import pytest
import torch
from quant_cases import assert_same_logits, read_json
from safetensors.torch import load_file, save_file

from kvconvert.checkpoint import CheckpointReader
from kvconvert.commands.main import main
from kvconvert.quant.scales import read_kv_scales

TINY = ["--calib-tokens", "256", "--window-len", "64", "--batch-size", "2", "--quiet"]


@pytest.fixture
def calibrate(run_main):
    """calibrate(src, out, *flags) -> out, asserting success (the tiny settings TINY); out None: --in-place."""
    def run(src, out, *extra):
        where = ["--in-place"] if out is None else ["--out", out]
        code, err = run_main(["calibrate", "--src", src, *where, *TINY, *extra])
        assert code == 0, err
        return out
    return run


@pytest.fixture(scope="module")
def fp8_both(tiny_llama, calib_text, tmp_path_factory):
    out = tmp_path_factory.mktemp("cal") / "fp8"
    main(["calibrate", "--src", str(tiny_llama), "--out", str(out), "--kv-dtype", "fp8", "--observer", "amax",
          "--calib-data", str(calib_text), *TINY])
    return out


def test_fp8_export_names_values_and_report(fp8_both, tiny_llama):
    report = read_json(fp8_both / "calibration_report.json")
    assert report["kv_dtype"] == "fp8" and report["formats"] == ["vllm", "modelopt"]
    assert report["calibration"]["tokens"] == 256 and len(report["calibration"]["data_hash"]) == 16
    tensors = {}
    for f in fp8_both.glob("*.safetensors"):
        tensors.update(load_file(f))
    src = CheckpointReader(tiny_llama)
    fold = report["scale_folding"]
    for name in src.weight_map:  # key pair phases change q/k_proj; scale folding (powers of two) v/o_proj
        same = torch.equal(tensors[name], src.get(name))
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        folds_v = layer is not None and fold["f_v"][layer] != 1.0
        assert same != (name.endswith(("q_proj.weight", "k_proj.weight"))
                        or (folds_v and name.endswith(("v_proj.weight", "o_proj.weight")))), name
    assert len(report["rotation"]["key_pair_phase"]["predicted_noise_ratio_per_layer"]) == 2
    assert "value_rotation" not in report["rotation"]
    assert_same_logits(fp8_both, tiny_llama)
    for layer, entry in enumerate(report["layers"]):  # written scale x folded power of two = amax / 448
        k_amax, v_amax = max(entry["k_amax"]), max(entry["v_amax"])
        f_k, f_v = fold["f_k"][layer], fold["f_v"][layer]
        k = tensors[f"model.layers.{layer}.self_attn.k_scale"]
        assert k.dtype == torch.float32 and k.shape == (1,) and 0.5 < k.item() <= 1.0
        assert k.item() * f_k == pytest.approx(k_amax / 448, rel=1e-6)
        assert tensors[f"model.layers.{layer}.self_attn.v_scale"].item() * f_v == pytest.approx(v_amax / 448, rel=1e-6)
        assert tensors[f"model.layers.{layer}.self_attn.k_proj.k_scale"].shape == ()
        assert tensors[f"model.layers.{layer}.self_attn.v_proj.v_scale"].item() * f_v == pytest.approx(v_amax / 448, rel=1e-6)
    config = read_json(fp8_both / "config.json")
    scheme = config["quantization_config"]["kv_cache_scheme"]
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    assert scheme == {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    hq = read_json(fp8_both / "hf_quant_config.json")
    assert hq["producer"]["name"] == "kvconvert" and hq["quantization"] == {"quant_algo": None, "kv_cache_quant_algo": "FP8"}
    assert (fp8_both / "kv_scales.png").read_bytes()[:4] == b"\x89PNG"
    scales = read_kv_scales(fp8_both)
    assert scales.k[1].item() * fold["f_k"][1] == pytest.approx(max(report["layers"][1]["k_amax"]) / 448, rel=1e-6)


def test_transformers_loads_vllm_format(fp8_both):
    pytest.importorskip("compressed_tensors", reason="transformers needs compressed-tensors for a kv_cache_scheme config")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(fp8_both)
    k_scale = model.model.layers[0].self_attn.k_scale
    assert k_scale.item() == pytest.approx(read_kv_scales(fp8_both).k[0].item())


def test_per_head_vllm_shapes_and_transformers_load(tiny_llama, calib_text, tmp_path, calibrate):
    out = calibrate(tiny_llama, tmp_path / "head", "--kv-dtype", "fp8", "--granularity", "head",
                    "--observer", "percentile", "--calib-data", str(calib_text))
    tensors = load_file(out / "model.safetensors")
    assert tensors["model.layers.0.self_attn.k_scale"].shape == (2, 1, 1)
    assert not any(n.endswith("k_proj.k_scale") for n in tensors)  # ModelOpt has no per-head KV scales
    assert read_json(out / "config.json")["quantization_config"]["kv_cache_scheme"]["strategy"] == "attn_head"
    report = read_json(out / "calibration_report.json")
    assert report["percentile"] == 99.99
    f_k = report["scale_folding"]["f_k"][0]
    for h in range(2):  # percentile never exceeds the head's amax
        assert tensors["model.layers.0.self_attn.k_scale"][h, 0, 0] * f_k * 448 <= report["layers"][0]["k_amax"][h] * (1 + 1e-6)
    if importlib.util.find_spec("compressed_tensors") is not None:  # transformers needs it for this config
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(out)
        assert model.model.layers[1].self_attn.v_scale.shape == (2, 1, 1)


def test_no_key_phase_leaves_queries_and_keys(tiny_llama, calib_text, tmp_path, calibrate):
    out = calibrate(tiny_llama, tmp_path / "nv", "--kv-dtype", "nvfp4", "--observer", "amax",
                    "--no-key-phase", "--calib-data", str(calib_text))
    rotation = read_json(out / "calibration_report.json")["rotation"]
    assert "key_pair_phase" not in rotation and rotation["value_rotation"].startswith("hadamard")
    written, src = CheckpointReader(out), CheckpointReader(tiny_llama)
    f_k = read_json(out / "calibration_report.json")["scale_folding"]["f_k"]
    for name in src.weight_map:  # only V / o_proj carry the Hadamard; q/k move by the folded power of two only
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            f = f_k[int(name.split(".")[2])]
            assert torch.equal(written.get(name), src.get(name) * (f if "q_proj" in name else 1 / f)), name
        else:
            assert torch.equal(written.get(name), src.get(name)) != name.endswith(("v_proj.weight", "o_proj.weight")), name


def test_mla_row_scale_names(tiny_deepseek, calib_text, tmp_path, calibrate):
    out = calibrate(tiny_deepseek, tmp_path / "mla", "--kv-dtype", "fp8", "--observer", "mse",
                    "--calib-data", str(calib_text))
    tensors = load_file(out / "model.safetensors")
    for layer in range(2):
        k = tensors[f"model.layers.{layer}.self_attn.k_scale"]
        assert torch.equal(k, tensors[f"model.layers.{layer}.self_attn.v_scale"])  # one row scale
        assert torch.equal(k.reshape(()), tensors[f"model.layers.{layer}.self_attn.kv_a_proj_with_mqa.k_scale"])
    report = read_json(out / "calibration_report.json")
    assert report["layout"] == "MLA" and "kv_amax" in report["layers"][0]
    assert report["path"] == "layer-streamed" and report["peak_rss_mb_before_export"] > 0
    for entry in report["layers"]:  # the search never ships scales worse than amax on its replay
        assert entry["search"]["rel_error_search"] <= entry["search"]["rel_error_amax"]


def test_mla_nvfp4_fp8rope_scales_load_in_the_runtime(tiny_deepseek, calib_text, tmp_path, calibrate):
    """The MLA-only layout: NVFP4 scales under the ModelOpt row name, no hf_quant_config.json (no engine's
    kv_cache_quant_algo names it), and the bundled runtime serves it from the checkpoint's scales."""
    from kvconvert.runtime import LLM

    out = calibrate(tiny_deepseek, tmp_path / "mla", "--kv-dtype", "nvfp4_fp8rope", "--calib-data", str(calib_text))
    tensors = load_file(out / "model.safetensors")
    assert all(f"model.layers.{i}.self_attn.kv_a_proj_with_mqa.k_scale" in tensors for i in range(2))
    assert not (out / "hf_quant_config.json").exists()
    assert read_kv_scales(out).kv_dtype == "nvfp4_fp8rope"
    llm = LLM(out, kv_dtype="nvfp4_fp8rope", block_size=4)
    assert llm.kv_bytes_per_token == 2 * (32 // 2 + 32 // 16 + 16)  # tiny: rank 32 + rope 16, k_rope 1 B/value
    assert torch.isfinite(llm.score(list(range(1, 20)))).all()


def test_in_place_replaces_the_folder_and_keeps_its_other_files(tiny_llama, calib_text, tmp_path, calibrate):
    folder = tmp_path / "inplace"
    shutil.copytree(tiny_llama, folder)
    tokenizer_before = (folder / "tokenizer.json").read_bytes()
    (folder / "conversion_report.json").write_text('{"kept": true}')  # e.g. written by kvconvert mla
    for _ in range(2):  # a second calibration replaces the first one's scales
        calibrate(folder, None, "--kv-dtype", "fp8", "--observer", "amax", "--format", "vllm",
                  "--calib-data", str(calib_text))
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) == []  # no temp files, no backup
    assert (folder / "tokenizer.json").read_bytes() == tokenizer_before
    assert read_json(folder / "conversion_report.json") == {"kept": True}
    assert read_json(folder / "calibration_report.json")["in_place"] is True
    names = list(load_file(folder / "model.safetensors"))
    assert names.count("model.layers.0.self_attn.k_scale") == 1
    assert "quantization_config" in read_json(folder / "config.json")
    assert read_kv_scales(folder).k[0].item() > 0
    assert not (folder / "hf_quant_config.json").exists()


def no_attention(tiny_llama, folder):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "mamba", "num_hidden_layers": 1}))
    save_file({"model.embed_tokens.weight": torch.zeros(4, 4)}, str(folder / "model.safetensors"))
    return folder


def overflowing_keys(tiny_llama, folder):
    """Finite weights whose keys overflow fp32 (an inf weight is refused earlier, by the up-front scan)."""
    shutil.copytree(tiny_llama, folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.1.self_attn.k_proj.weight"][0] = 3e38
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("make_src, args, message", [
    (None, ["--kv-dtype", "int4"], "--kv-dtype: 'int4' is not one of fp8, fp8_e5m2, nvfp4"),
    (None, ["--calib-data", "CALIB", "--calib-tokens", "99968", "--window-len", "64"], "data too short"),
    (None, ["--kv-dtype", "nvfp4", "--format", "vllm"], "no static NVFP4 KV-cache scheme"),
    (None, ["--kv-dtype", "nvfp4_fp8rope", *TINY], "per-head K and V (no k_rope): use --kv-dtype nvfp4"),
    (None, ["--kv-dtype", "fp8_e5m2", "--format", "modelopt"], "no FP8 E5M2 KV cache"),
    (no_attention, [], "no attention layers"),
    (overflowing_keys, ["--observer", "amax", "--calib-data", "CALIB", *TINY], "layer 1: non-finite key activations"),
], ids=["kv-dtype", "data-too-short", "nvfp4-vllm", "mla-only-format", "e5m2-modelopt", "no-attention",
        "non-finite-activations"])
def test_bad_input_is_refused_before_writing(make_src, args, message, tiny_llama, calib_text, tmp_path, run_main):
    src, out = make_src(tiny_llama, tmp_path / "src") if make_src else tiny_llama, tmp_path / "o"
    args = [str(calib_text) if a == "CALIB" else a for a in args]
    code, err = run_main(["calibrate", "--src", src, "--out", out, *args])
    assert code == 2, err
    assert "error:" in err.lower() and message in err, err
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}*"))  # no temp folder left either


def test_existing_output(tiny_llama, tmp_path, run_main):
    out = tmp_path / "o"
    out.mkdir()
    code, err = run_main(["calibrate", "--src", str(tiny_llama), "--kv-dtype", "fp8", "--out", str(out)])
    assert code == 2 and "output exists" in err


def test_nvfp4_rotated_in_place_on_a_sharded_checkpoint(tiny_llama, calib_text, tmp_path, calibrate):
    """A sharded checkpoint written by CheckpointWriter (with manifest), calibrated to nvfp4 in place:
    Hadamard-rotated and folded weights, the scales in the index, the manifest's hashes valid, logits unchanged."""
    from kvconvert.checkpoint import CheckpointWriter, verify_manifest

    folder = tmp_path / "sharded"
    src = CheckpointReader(tiny_llama)
    with CheckpointWriter(folder, max_shard_bytes=200_000) as w:
        for name in src.weight_map:
            w.add(name, src.get(name))
        w.write_config(src.config)
        w.copy_tokenizer(tiny_llama)
    assert (folder / "model.safetensors.index.json").is_file()
    calibrate(folder, None, "--kv-dtype", "nvfp4", "--observer", "percentile", "--calib-data", str(calib_text))
    assert verify_manifest(folder) == []
    assert "model.layers.1.self_attn.k_proj.k_scale" in CheckpointReader(folder).weight_map
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) == []
    assert "quantization_config" not in (folder / "config.json").read_text()
    assert read_json(folder / "hf_quant_config.json")["quantization"]["kv_cache_quant_algo"] == "NVFP4"
    rotation = read_json(folder / "calibration_report.json")["rotation"]
    assert rotation["value_rotation"].startswith("hadamard") and "key_pair_phase" in rotation
    assert_same_logits(folder, tiny_llama)
    assert not torch.equal(CheckpointReader(folder).get("model.layers.0.self_attn.v_proj.weight"),
                           src.get("model.layers.0.self_attn.v_proj.weight"))
    assert read_kv_scales(folder).kv_dtype == "nvfp4"


def test_fp8_e5m2_scales_without_engine_config(tiny_llama, calib_text, tmp_path, calibrate):
    out = calibrate(tiny_llama, tmp_path / "e5m2", "--kv-dtype", "fp8_e5m2", "--observer", "amax",
                    "--calib-data", str(calib_text))
    assert "quantization_config" not in read_json(out / "config.json")  # vLLM refuses e5m2 with an FP8-KV config
    assert not (out / "hf_quant_config.json").exists()
    report = read_json(out / "calibration_report.json")
    k = load_file(out / "model.safetensors")["model.layers.0.self_attn.k_scale"]
    f_k = report["scale_folding"]["f_k"][0]
    assert k.item() * f_k == pytest.approx(max(report["layers"][0]["k_amax"]) / 57344, rel=1e-6)


def test_int8_export_names_values_and_report(tiny_llama, calib_text, tmp_path, calibrate):
    """INT8 (TensorRT-LLM's cache): ModelOpt names only, hf_quant_config INT8, no compressed-tensors config; K and V
    tied a power of two apart (the engine stores both at max(k_scale, v_scale)), so the written k and v scales are
    equal, each times its folded power of two the tied scale: amax / 127 with one of the two raised < sqrt(2)."""
    out = calibrate(tiny_llama, tmp_path / "int8", "--kv-dtype", "int8", "--observer", "amax",
                    "--calib-data", str(calib_text))
    report = read_json(out / "calibration_report.json")
    assert report["formats"] == ["modelopt"] and report["scale_convention"].startswith("amax / 127;")
    assert "quantization_config" not in read_json(out / "config.json")
    hq = read_json(out / "hf_quant_config.json")
    assert hq["quantization"] == {"quant_algo": None, "kv_cache_quant_algo": "INT8"}
    tensors = load_file(out / "model.safetensors")
    assert not any(n.endswith(("self_attn.k_scale", "self_attn.v_scale")) for n in tensors)  # no vLLM names
    fold = report["scale_folding"]
    for layer, entry in enumerate(report["layers"]):
        k = tensors[f"model.layers.{layer}.self_attn.k_proj.k_scale"]
        v = tensors[f"model.layers.{layer}.self_attn.v_proj.v_scale"]
        assert k.dtype == torch.float32 and k.shape == () and torch.equal(k, v) and 0.5 < k.item() <= 1.0
        assert k.item() * fold["f_k"][layer] == entry["k_scale"] and v.item() * fold["f_v"][layer] == entry["v_scale"]
        raised = sorted((entry["k_scale"] / (max(entry["k_amax"]) / 127), entry["v_scale"] / (max(entry["v_amax"]) / 127)))
        assert raised[0] == pytest.approx(1.0, rel=1e-6) and 1.0 <= raised[1] <= 2 ** 0.5 * (1 + 1e-6)
    assert_same_logits(out, tiny_llama)
    scales = read_kv_scales(out)
    assert scales.kv_dtype == "int8" and torch.equal(scales.k[1], scales.v[1])


def test_int8_mse_search_ties_scales_and_serves_in_the_runtime(tiny_llama, tiny_deepseek, calib_text, tmp_path,
                                                               calibrate):
    """The mse search's pick, tied: the report names each scale's move (a factor < 2 for one of the two) and the
    tied pair's replayed error; the runtime serves the checkpoint (Llama and an MLA row) from its scales."""
    from kvconvert.runtime import LLM

    out = calibrate(tiny_llama, tmp_path / "int8", "--kv-dtype", "int8", "--calib-data", str(calib_text))
    for entry in read_json(out / "calibration_report.json")["layers"]:
        tied = entry["search"]["tied"]
        assert 1 in (tied["k"], tied["v"]) and 0.5 < tied["k"] * tied["v"] < 2 and tied["rel_error"] >= 0
        assert math.log2(entry["k_scale"] / entry["v_scale"]).is_integer()
    mla = calibrate(tiny_deepseek, tmp_path / "mla", "--kv-dtype", "int8", "--calib-data", str(calib_text))
    assert "kv_a_proj_with_mqa.k_scale" in " ".join(load_file(mla / "model.safetensors"))
    for path in (out, mla):
        llm = LLM(path, kv_dtype="int8", block_size=4)
        assert llm.cache.layers[0].stored("k" if path == out else "kv")[0].dtype == torch.int8
        assert torch.isfinite(llm.score(list(range(1, 20)))).all()


def test_int8_per_head_is_refused(tiny_llama, tmp_path, run_main):
    code, err = run_main(["calibrate", "--src", tiny_llama, "--out", tmp_path / "o", "--kv-dtype", "int8",
                          "--granularity", "head"])
    assert code == 2 and "per-tensor KV scales only" in err and not (tmp_path / "o").exists()


def test_int8_both_engines_store_k_and_v_at_the_larger_scale(tiny_llama, calib_text, tmp_path, calibrate):
    """validate's two engines (transformers + the fake-quant hook, the runtime's INT8 cache) read a checkpoint's
    k_scale / v_scale as TensorRT-LLM does, both at the larger: halving every v_scale changes nothing, and the
    engines agree bit for bit (to fp32 rounding) with each other; INT8 does change the logits."""
    from kvconvert.eval import runner as R

    out = calibrate(tiny_llama, tmp_path / "int8", "--kv-dtype", "int8", "--observer", "amax",
                    "--calib-data", str(calib_text))
    halved = tmp_path / "halved"
    shutil.copytree(out, halved)
    tensors = load_file(halved / "model.safetensors")
    for name in [n for n in tensors if n.endswith("v_proj.v_scale")]:
        tensors[name] = tensors[name] / 2
    save_file(tensors, str(halved / "model.safetensors"), metadata={"format": "pt"})
    ids = torch.arange(3, 120)
    logits = {}
    for path in (out, halved):
        hf, rt = R.TransformersRunner(path, "int8"), R.RuntimeRunner(path, "int8")
        logits[path] = hf.logits(ids)
        torch.testing.assert_close(logits[path], rt.logits(ids), rtol=1e-5, atol=1e-5)
        assert hf.greedy(ids, 6, (0,)) == rt.greedy(ids, 6, (0,))
    assert torch.equal(logits[out], logits[halved])
    assert (logits[out] - R.TransformersRunner(out, "fp32").logits(ids)).abs().max() > 1e-4
