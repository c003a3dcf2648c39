"""The decode kernels compile for Hopper (sm_90) and Blackwell (sm_100) on this CPU-only machine, and
their tiles lower to the matrix instructions the kernels are designed around.

The interpreter runs @triton.jit code as Python and accepts code the compiler refuses (a jit function
whose returns differ in type passed every interpreter test and failed to compile); it also cannot
say which instructions a tile becomes. compile_kernels.py runs the real launchers up to the launch
and compiles each captured launch with Triton and ptxas (no GPU needed); see its CASES.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernel_cases import triton  # noqa: F401 - skips without Triton

SCRIPT = Path(__file__).resolve().parent / "compile_kernels.py"


def compile_report(arch: int, cases: list[str] | None = None) -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, str(SCRIPT), "--arch", str(arch)] + [a for c in cases or [] for a in ("--case", c)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {row["name"]: row for row in rows}


@pytest.fixture(scope="module")
def hopper():
    return compile_report(90)


def test_every_case_compiles_for_hopper(hopper):
    from compile_kernels import CASES

    assert sorted(hopper) == sorted(name for name, *_ in CASES)


def test_hopper_matrix_instructions(hopper):
    """16-row head tiles run on mma.sync; 64-row tiles on wgmma, and fp8 dots there on e4m3 wgmma for both
    dots (fp8 dots on 16-row tiles get no fp8 instruction: Triton converts them to fp16 mma.sync)."""
    for name, row in hopper.items():
        ops = " ".join(row["matrix_ops"])
        if name.endswith("_h64"):
            assert "mma.sync" not in ops and "wgmma.mma_async" in ops, (name, ops)
            if "fp8dot" in name:
                assert all(".e4m3.e4m3" in op for op in row["matrix_ops"]), (name, ops)
        else:
            assert ops.startswith("mma.sync") and "e4m3" not in ops and "wgmma" not in ops, (name, ops)


def test_default_launches_do_not_spill(hopper):
    """Registers at the defaults (block_h 16, block_n 16, 4 warps): no local-memory spills, except the
    MLA NVFP4 kernel, which spills a few bytes at these defaults with a 16-bit or an FP8 k_rope (4 warps
    hold 255 registers each; 8 warps do not spill). A kernel change that starts spilling shows here before any GPU run."""
    for name, row in hopper.items():
        if name.endswith("_bf16") and not name.startswith("mla_nvfp4"):
            assert row["stack"] == 0 and row["reg"] <= 255, (name, row)


def test_second_transposed_fp8_latent_load_is_pipelined(hopper):
    """latent_loads=2 on an fp8 MLA cache (block_n 64, 8 warps, 3 stages): the tile read once for both dots
    loads mostly synchronously (a handful of cp.async) because one layout must be made from the other in
    registers; read a second time in QK^T's transposed layout, both loads become cp.async (about 10x more)
    with fewer synchronous loads, and the kernel still does not spill."""
    one, two = hopper["mla_fp8_bf16_n64_1load"], hopper["mla_fp8_bf16_n64_2load"]
    assert two["cp_async"] >= 5 * max(1, one["cp_async"]), (one, two)
    assert two["ld_global"] < one["ld_global"], (one, two)
    assert two["stack"] == 0 and two["reg"] <= 255, two


@pytest.mark.parametrize("dot", ["fp16", "bf16"])
def test_fp8_latent_halves_transpose_without_byte_loads(hopper, dot):
    """The compile analysis of the MLA fp8 tile at the tuned config: read as bytes, the P@V operand (the tile
    transposed) is read back from shared memory one byte at a time (ld.shared.b8: Hopper has no 8-bit ldmatrix
    .trans), its loads are synchronous, and the kernel spills at 255 registers. Read as 16-bit words on even/odd
    byte planes (word_planes), it transposes with ldmatrix like a bf16 tile: no byte loads, several times the
    ldmatrix and cp.async, no spill, and registers for 3 CTAs of 4 warps per SM (<= 168) instead of 2."""
    bytes_, halves = hopper[f"mla_fp8_{dot}_tuned_bytes"], hopper[f"mla_fp8_{dot}_tuned_halves"]
    assert bytes_["ld_shared_b8"] >= 64 and halves["ld_shared_b8"] == 0, (bytes_, halves)
    assert halves["ldmatrix"] >= 4 * bytes_["ldmatrix"] and halves["cp_async"] >= 4 * bytes_["cp_async"], (bytes_, halves)
    assert halves["stack"] == 0 and halves["reg"] <= 168 < bytes_["reg"], (bytes_, halves)


def test_nvfp4_latent_nibble_planes_do_not_spill(hopper):
    """The NVFP4 latent at the tuned config: its even/odd halves of packed bytes spill at 255 registers; read as
    16-bit words on four nibble planes (word_planes, one multiply per value) it does not spill, converts less
    than half as much, and reads at most half as many bytes one by one (the block scales still are)."""
    halves, quarters = hopper["mla_nvfp4_bf16_tuned_halves"], hopper["mla_nvfp4_bf16_tuned_quarters"]
    assert halves["stack"] > 0 and quarters["stack"] == 0 and quarters["reg"] <= 255, (halves, quarters)
    assert 2 * quarters["cvt"] <= halves["cvt"] and 2 * quarters["ld_shared_b8"] <= halves["ld_shared_b8"]
    # GQA's NVFP4 V tile (its P@V operand) likewise: byte-wise reads 20 -> 2 at its tuned config
    halves, quarters = hopper["gqa_nvfp4_bf16_tuned_halves"], hopper["gqa_nvfp4_bf16_tuned_quarters"]
    assert quarters["ld_shared_b8"] * 4 <= halves["ld_shared_b8"] and quarters["stack"] == 0, (halves, quarters)


def test_blackwell_fp8_dots_use_tcgen05():
    """On sm_100 the 64-row fp8-dot tile lowers to tcgen05 MMA of kind f8f6f4, the default tile still compiles."""
    report = compile_report(100, ["mla_fp8_fp8dot_h64", "gqa_nvfp4_bf16"])
    assert report["mla_fp8_fp8dot_h64"]["matrix_ops"] == ["tcgen05.mma.cta_group::1.kind::f8f6f4"]
    assert report["gqa_nvfp4_bf16"]["matrix_ops"]
