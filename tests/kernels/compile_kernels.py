"""Compile the paged decode kernels for a GPU architecture on a machine without a GPU.

Each case runs the real public launcher (``paged_mla_decode`` / ``paged_gqa_decode``) on CPU tensors
up to its kernel launch, captures the launch's arguments, and has Triton compile the kernel for the
target (``sm_90`` Hopper, ``sm_100`` Blackwell) with the same specialization a GPU launch would get,
through ptxas to a cubin. The interpreter cannot show what this shows: code that only the compiler
refuses (e.g. a jit function whose returns differ in type), the matrix instructions a tile lowers to
(mma.sync below 64 query rows, wgmma at 64), registers and spills.

    python tests/kernels/compile_kernels.py [--arch 90] [--case NAME]   # one JSON line per case

TRITON_INTERPRET must be unset (the interpreter replaces @triton.jit functions); the test runs this
file in a subprocess. It uses Triton's launch internals (binder, _pack_args), as of Triton 3.9.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

# (name, architecture, mode, launcher options); mla_* on the DeepSeek-V3 TP-8 shard (16 heads,
# 512 + 64), gqa_* on Llama-3-8B's (32 q / 8 kv heads, D 128). Default options = the GPU defaults.
CASES = [
    *((f"mla_{mode}_bf16", "mla", mode, {"dot": "bf16"}) for mode in ("none", "fp8", "fp8_tile", "nvfp4", "nvfp4_fp8rope")),
    *((f"gqa_{mode}_bf16", "gqa", mode, {"dot": "bf16"}) for mode in ("none", "fp8", "nvfp4")),
    ("mla_fp8_fp8dot_h16", "mla", "fp8", {"dot": "fp8", "block_n": 32}),
    ("mla_fp8_fp8dot_h64", "mla", "fp8", {"dot": "fp8", "block_h": 64, "block_n": 64, "num_warps": 8}),
    ("mla_none_bf16_h64", "mla", "none", {"dot": "bf16", "block_h": 64, "block_n": 32, "num_warps": 8}),
    ("gqa_fp8_fp8dot_h64", "gqa", "fp8", {"dot": "fp8", "block_h": 64, "block_n": 64, "num_warps": 4}),
    # the fp8 latent read once for both dots, and twice (a transposed second load for QK^T), at the
    # config where the compile analysis found the second load pipelined and spill-free
    *((f"mla_fp8_bf16_n64_{n}load", "mla", "fp8", {"dot": "bf16", "latent_loads": n, "block_n": 64,
                                                   "num_warps": 8, "num_stages": 3}) for n in (1, 2)),
    # the fp8 latent as bytes vs as 16-bit words on even/odd byte halves (word_planes), at the tuned
    # MLA config (block_h 16, block_n 32, 4 warps, 2 stages), fp16 and bf16 dots
    *((f"mla_fp8_{dot}_tuned_{layout}", "mla", "fp8", {"dot": dot, "block_n": 32, "num_warps": 4, "num_stages": 2,
                                                        "word_planes": layout == "halves"})
      for dot in ("fp16", "bf16") for layout in ("bytes", "halves")),
    *((f"mla_nvfp4_bf16_tuned_{layout}", "mla", "nvfp4", {"dot": "bf16", "block_n": 32, "num_warps": 4, "num_stages": 2,
                                                           "word_planes": layout == "quarters"})
      for layout in ("halves", "quarters")),
    *((f"gqa_nvfp4_bf16_tuned_{layout}", "gqa", "nvfp4", {"dot": "bf16", "block_n": 64, "num_warps": 8, "num_stages": 2,
                                                           "word_planes": layout == "quarters"})
      for layout in ("halves", "quarters")),
]


class _Captured(Exception):
    def __init__(self, args, kwargs):
        super().__init__("launch captured")
        self.args, self.kwargs = args, kwargs


def _capture(architecture: str, mode: str, options: dict):
    """(jit kernel, positional args, keyword args) of the launcher's stage-1 launch."""
    from kvconvert.kernels import gqa_decode, mla_decode
    import test_kernel_gqa_decode as gqa_cases
    import test_kernel_mla_decode as mla_cases

    module = mla_decode if architecture == "mla" else gqa_decode
    kernel = module._mla_decode_split_kernel if architecture == "mla" else module._gqa_decode_split_kernel
    module.check_kernel_device = lambda *tensors: None  # CPU tensors stand in for GPU ones

    def run(*args, grid, warmup, **kwargs):
        raise _Captured(args, kwargs)

    kernel.run = run
    try:
        if architecture == "mla":
            cache, qn, qr, *args, _ = mla_cases.build_case(mode, 16, 512, 64, 64, [4096, 77], dtype=torch.bfloat16)
            module.paged_mla_decode_triton(qn, qr, cache, *args, **options)
        else:
            cache, q, *args = gqa_cases.build_case(mode, True, 32, 8, 128, 64, [4096, 77], dtype=torch.bfloat16)
            module.paged_gqa_decode_triton(q, cache, *args, **options)
    except _Captured as launch:
        del kernel.run
        return kernel, launch.args, launch.kwargs
    raise RuntimeError("the launcher returned without launching its kernel")


def compile_case(architecture: str, mode: str, options: dict, arch: int = 90):
    """The Triton CompiledKernel of one launch, for ``sm_<arch>``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel, args, kwargs = _capture(architecture, mode, options)
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, launch_options = binder(*args, **kwargs)
    packed_options, signature, constexprs, attrs = kernel._pack_args(
        backend, kwargs, bound_args, specialization, launch_options
    )
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                          options=packed_options.__dict__)


def resource_usage(cubin: bytes) -> dict[str, int]:
    """REG / STACK / SHARED of the kernel in a cubin, read by cuobjdump (shipped with Triton)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    return {key.lower(): int(value) for key, value in re.findall(r"\b(REG|STACK|SHARED):(\d+)", text)}


def summary(name: str, architecture: str, mode: str, options: dict, arch: int) -> dict:
    kernel = compile_case(architecture, mode, options, arch)
    # PTX lines without their optional predicate ("@%p3 tcgen05.mma..."); an instruction is the first token
    lines = [re.sub(r"^@!?%\w+\s+", "", line.strip()) for line in kernel.asm["ptx"].splitlines()]
    ops = {line.split(" ")[0] for line in lines}
    matrix_ops = sorted(op for op in ops if op.startswith(("mma.", "wgmma.mma_async", "tcgen05.mma")))
    # global loads: asynchronous copies to shared memory (cp.async.ca/.cg, what software pipelining
    # overlaps with the dots) and synchronous loads to registers (ld.global*)
    loads = {"cp_async": sum(line.startswith(("cp.async.ca.", "cp.async.cg.")) for line in lines),
             "ld_global": sum(line.startswith("ld.global") for line in lines),
             # the conversion and shared-memory staging work a quantized tile costs (static counts)
             "cvt": sum(line.startswith("cvt.") for line in lines),
             "cvt_f16x2_e4m3": sum(line.startswith("cvt.rn.f16x2.e4m3x2") for line in lines),
             "ld_shared": sum(line.startswith("ld.shared") for line in lines),
             "ld_shared_b8": sum(line.startswith("ld.shared.b8") for line in lines),  # byte-wise (transposing) reads
             "st_shared": sum(line.startswith("st.shared") for line in lines),
             "ldmatrix": sum(line.startswith("ldmatrix") for line in lines)}
    # dyn_shared: the shared memory a CTA allocates at launch (the pipeline stages, the layout conversions),
    # which with the registers bounds the CTAs per SM
    return {"name": name, "arch": arch, "matrix_ops": matrix_ops, **loads, **resource_usage(kernel.asm["cubin"]),
            "dyn_shared": kernel.metadata.shared}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--case", action="append", help="case name (repeatable; default: all)")
    a = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("unset TRITON_INTERPRET: the interpreter replaces the @triton.jit functions this compiles")
    for name, architecture, mode, options in CASES:
        if not a.case or name in a.case:
            print(json.dumps(summary(name, architecture, mode, options, a.arch)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
