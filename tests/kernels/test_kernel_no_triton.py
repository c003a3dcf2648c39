"""Without Triton the package imports, the torch backend works, and kernels raise a clear error."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import sys
    sys.modules["triton"] = None  # any `import triton` now raises ImportError
    import torch
    from kvconvert.errors import KVConvertError
    from kvconvert.kernels import MLACacheLayer, paged_mla_decode, kv_append
    cache = MLACacheLayer.allocate("fp8", 2, 16, 64, 32, kv_scale=0.01)
    cache.append(torch.randn(3, 64), torch.randn(3, 32), torch.tensor([0, 1, 2]), backend="torch")
    args = (torch.randn(1, 4, 64), torch.randn(1, 4, 32), cache, torch.tensor([[0]], dtype=torch.int32),
            torch.tensor([3], dtype=torch.int32), 0.1)
    out, lse = paged_mla_decode(*args, backend="torch")
    assert out.shape == (1, 4, 64) and torch.isfinite(lse).all()
    for call in (lambda: paged_mla_decode(*args), lambda: kv_append(cache.data, cache.data[0], torch.zeros(16, dtype=torch.long))):
        try:
            call()
        except KVConvertError as e:
            assert str(e) == "Triton is not installed: pip install triton (or pass backend='torch')", str(e)
        else:
            raise AssertionError("no KVConvertError without triton")
    print("ok")
    """
)


def test_kernels_without_triton():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
