"""`kvconvert mla ... --heal RECIPE.yaml`: convert, heal into --out, leave no one-shot folder behind."""

from __future__ import annotations

import yaml
from click.testing import CliRunner

from kvconvert.commands.main import cli


def test_mla_cli_chains_healing(tiny_teacher, text_file, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"heal_layerwise": {"data": str(text_file), "tokens": 512, "window": 128,
                                                         "steps": 3, "lr": 0.01}}))
    out = tmp_path / "healed"
    result = CliRunner().invoke(cli, ["mla", "--src", str(tiny_teacher), "--rank", "8", "--rope-dim", "8", "--target", "any",
                                      "--calib-data", str(text_file), "--calib-tokens", "1024", "--calib-window", "128",
                                      "--dtype", "fp32", "--heal", str(recipe), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert (out / "heal_report.json").is_file()  # healed, not only converted (manifest: test_layerwise)
    assert not (tmp_path / ".healed.oneshot").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["healed", "recipe.yaml"]
