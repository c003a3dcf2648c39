"""The options of `kvconvert mla`: one pydantic model that is the recipe's `convert` block, the
argument of `convert_to_mla` and (generated) the command's flags. Torch-free."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from kvconvert.device import DEVICE_FIELD
from kvconvert.kvformat import WEIGHT_DTYPE_NAMES
from kvconvert.stage_options import StageOptions, text_source_help
from kvconvert.targets import DEFAULT_TARGET, TARGETS

# The latent RMSNorm stays linear while mean(c^2) <= rho * eps on every calibration token: 3e-4
# keeps the per-token error <= 1.5e-4 (docs/mla.md). One value for the converter and the healer.
LATENT_LINEAR_RHO = 3e-4


# The conversion's calibration text (kvconvert.data.calibration_windows): half pydoc, half Wikipedia beat
# either text alone at every KV budget on two held-out corpora (SmolLM2, 8192 tokens; docs/BENCHMARKS.md,
# "Calibration text and tokens of the one-shot fit").
DEFAULT_CONVERT_TEXT = "pydoc+wiki"


class MLAOptions(StageOptions):
    rank: int = Field(gt=0, description="kv_lora_rank: size of the cached latent per token and layer.")
    rope_dim: int | None = Field(None, gt=0, description="qk_rope_head_dim (default min(64, head_dim)).")
    q_rank: int | None = Field(None, gt=0, description="q_lora_rank: low-rank queries (default: plain q_proj).")
    target: Literal[tuple(TARGETS)] = Field(
        DEFAULT_TARGET, description="Engine the checkpoint is for: only MLA shapes it serves are written (vllm: "
                                    "latent 576 or 320; tensorrt-llm: 512 + 64); kvconvert (the bundled runtime) "
                                    "and any allow every shape.")
    calib_data: str = Field(DEFAULT_CONVERT_TEXT, description=text_source_help())
    calib_tokens: int = Field(8192, gt=0, description="Calibration tokens.")
    calib_window: int = Field(512, gt=0, description="Tokens per calibration window.")
    # measured on SmolLM2: 0.3 beats 1.0 (ppl 128 vs 141 at rank 64 + rope 32)
    key_weight: float = Field(0.3, ge=0, description="Weight of key (attention score) errors against value "
                                                     "errors in the latent objective.")
    refit_o_proj: bool = Field(True, description="Least-squares o_proj refit against the source attention output.")
    rho: float = Field(LATENT_LINEAR_RHO, gt=0, lt=1,
                       description="Latent-norm linear range: mean(c^2) <= rho * eps on calibration tokens.")
    stream: Literal["converted", "source"] = Field(
        "converted", description="Calibration hidden states carried through the converted layers or the source's.")
    dtype: Literal[WEIGHT_DTYPE_NAMES] = Field("bf16", description="Dtype of the written weights.")
    device: str = DEVICE_FIELD

    @model_validator(mode="after")
    def _enough_tokens(self):
        if self.calib_tokens < self.calib_window:
            raise ValueError(f"--calib-tokens {self.calib_tokens} is less than one window ({self.calib_window})")
        from kvconvert.quant.options import check_whole_windows

        check_whole_windows(self.calib_tokens, self.calib_window, "--calib-window")
        return self
