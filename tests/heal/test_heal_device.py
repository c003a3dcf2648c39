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
    """torch says one GPU is there (so `auto` means cuda), and initialising or allocating on it raises.
    accelerate is told so too: from 1.16 it asks torch.accelerator (not torch.cuda) which device to train
    on, and torch.accelerator cannot be faked without breaking torch's own CPU optimizers, so its probe
    is. The fake GPU is then seen by kvconvert and accelerate alike, on any CPU and accelerate version."""
    def forbidden(*args, **kwargs):
        raise CudaTouched("CUDA was touched")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    import accelerate.state

    monkeypatch.setattr(accelerate.state, "get_torch_accelerator_backend", lambda *a, **k: ("cuda", torch.cuda),
                        raising=False)  # accelerate < 1.16 asks torch.cuda.is_available, faked above
    for name in ("_lazy_init", "set_device", "mem_get_info", "synchronize", "current_device"):
        monkeypatch.setattr(torch.cuda, name, forbidden)
    fresh_accelerate_state()
    yield
    fresh_accelerate_state()  # no fake-GPU state left for the next test


def fresh_accelerate_state():
    """accelerate keeps its device for the process: forget it, so each test's fake machine is seen."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


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
    """The control: the same fake GPU does stop a heal left on `auto` (so the test above can fail): the
    heal goes to CUDA and touches it, nothing else stops it."""
    from kvconvert.recipe import heal

    with pytest.raises(CudaTouched):
        heal(tiny_student, tiny_teacher, distill_recipe(text_file, tokens=2 * 2 * 128), tmp_path / "out", progress=False)


def test_heal_refuses_when_accelerate_disagrees_with_the_device(tiny_student, tiny_teacher, text_file, tmp_path,
                                                               monkeypatch):
    """torch.cuda sees a GPU but accelerate's probe (torch.accelerator) does not: `auto` resolves to cuda
    and accelerate would train on the CPU. The heal refuses by name instead of running somewhere else."""
    from kvconvert.errors import KVConvertError
    from kvconvert.recipe import heal

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    import accelerate.state

    monkeypatch.setattr(accelerate.state, "get_torch_accelerator_backend", lambda *a, **k: (None, None), raising=False)
    fresh_accelerate_state()
    with pytest.raises(KVConvertError, match="accelerate chose cpu"):
        heal(tiny_student, tiny_teacher, distill_recipe(text_file, tokens=2 * 2 * 128), tmp_path / "out", progress=False)
