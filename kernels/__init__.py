"""kvconvert.kernels: Triton kernels, each beside a pure-PyTorch reference (installed as kvconvert.kernels)."""
