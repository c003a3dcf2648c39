"""Kernel tests run in Triton's interpreter on CPU tensors (no GPU needed or used).

TRITON_INTERPRET must be set before triton decorates the kernels, i.e. before the first import of
kvconvert.kernels' kernel modules; setdefault keeps an explicit TRITON_INTERPRET=0 (GPU runs).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
