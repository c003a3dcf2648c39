"""The options of `kvconvert export-gguf` (kvconvert.checkpoint.gguf_export), torch- and numpy-free so the
command's --help imports nothing heavy: GGUF files are what stock llama.cpp (kvconvert.engines.llamacpp) loads."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvconvert.stage_options import StageOptions

OUTTYPES = ("auto", "f32", "f16", "bf16", "q8_0")


class GGUFExportOptions(StageOptions):
    outtype: Literal[OUTTYPES] = Field(
        "auto", description="Weight type of the 2-D weights (norms stay f32): auto = as stored (an fp32 checkpoint "
                            "gives f32, bf16 gives bf16), f32, f16, bf16, or q8_0 (llama.cpp's 8-bit blocks of 32).")
