"""--device reaches healing: `pipeline --device cpu` with a recipe that heals runs the real
conversion, layer-wise stage and distillation on the CPU while torch claims a GPU is visible, and any
touch of CUDA fails. Without a device, `auto` would pick that GPU: the same heal then fails."""

from __future__ import annotations

import pytest
import torch
import yaml

from heal_cases import distill_recipe, layerwise_recipe


class CudaTouched(RuntimeError):
    pass


@pytest.fixture
def cuda_visible_but_forbidden(monkeypatch):
    """torch says one GPU is there (so `auto` means cuda), and initialising or allocating on it raises."""
    def forbidden(*args, **kwargs):
        raise CudaTouched("CUDA was touched")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for name in ("_lazy_init", "set_device", "mem_get_info", "synchronize", "current_device"):
        monkeypatch.setattr(torch.cuda, name, forbidden)


def _recipe(text_file, tmp_path):
    data = {"name": "device-test",
            "convert": {"rank": 8, "rope_dim": 8, "target": "any", "calib_data": str(text_file), "calib_tokens": 1024,
                        "calib_window": 128, "dtype": "fp32"},
            **layerwise_recipe(text_file, steps=4), **distill_recipe(text_file, tokens=2 * 2 * 128)}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_pipeline_device_cpu_heals_without_touching_cuda(tiny_teacher, text_file, tmp_path, cuda_visible_but_forbidden,
                                                        capfd):
    from kvconvert.pipeline import recipe_stages
    from kvconvert.recipe import load_recipe

    path = _recipe(text_file, tmp_path)
    stages = recipe_stages(load_recipe(path), path, str(tiny_teacher), tmp_path / "job", device="cpu")
    convert = stages[0]
    assert convert.name == "convert" and "--device" in convert.argv
    convert.run()  # conversion, heal_layerwise, heal_distill: all in this process
    report = (tmp_path / "job" / "mla" / "heal_report.json").read_text()
    assert '"heal_distill"' in report and '"heal_layerwise"' in report
    plan = capfd.readouterr().err  # printed before the stages ran
    assert "heal_distill plan on cpu: memory ~" in plan and "tokens = 2 steps of 256" in plan


def test_heal_on_auto_would_use_the_visible_gpu(tiny_student, tiny_teacher, text_file, tmp_path,
                                                 cuda_visible_but_forbidden):
    """The control: the same fake GPU does stop a heal left on `auto` (so the test above can fail)."""
    from kvconvert.recipe import heal

    with pytest.raises((CudaTouched, AssertionError, RuntimeError)):
        heal(tiny_student, tiny_teacher, distill_recipe(text_file, tokens=2 * 2 * 128), tmp_path / "out", progress=False)
