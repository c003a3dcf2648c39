"""`kvconvert plan`: for a KV byte budget, the artifact with the least measured damage, and its recipe.

    candidates (the source's own attention or an MLA shape, x a KV format bf16/fp8/nvfp4 or one of llama.cpp's
      q8_0/q5_1/q5_0/q4_1/q4_0/iq4_nl, and for MLA
      nvfp4_fp8rope: its k_rope in 8 bits makes wide RoPE parts cheap, so shapes with up to 64 RoPE dims
      are candidates in that format only; for the source's own attention llama.cpp's K/V pairs, whose extra bits
      go to the half, K or V, that costs the model more when rounded alone: plan_pairs measures it first)
      -> keep those that fit the budget and that the target engine serves
      -> prune the dominated (orderings that hold by construction, below)
      -> measure the survivors: KL to the source on held-out essay windows, in the bundled runtime
      -> choose the least KL; write plan.json, plan.png and the chosen recipe (kvconvert.recipe)

Pruning (`dominated_by`), for two candidates that both fit and are both served:
  * the same cached values in a finer number format lose less (FINER_CHAINS: bf16 < fp8 < nvfp4 <
    nvfp4_fp8rope; llama.cpp's bf16 < q8_0 < q5_0 < q4_0, q8_0 < iq4_nl, q5_1 < q4_1): the source in fp8 beats
    the source in nvfp4, MLA 160+32 in bf16 beats it in fp8; iq4_nl and q4_0 are not ordered;
  * the source in a format at least as fine beats any MLA conversion in that format (MLA caches a
    projection of the same K/V: conversion error on top of the same rounding);
  * among MLA conversions in one format, a shape with at least the rank and at least the RoPE part of
    another keeps more (each part is the leading part of one decomposition); 256+64 and 288+32
    are not ordered, and both are measured.
Nothing else is predicted: what survives is measured. Bytes per token come from kvconvert.kvmath
(tests/test_kv_bytes.py: equal to what the runtime allocates).
"""

from __future__ import annotations

import json
import math
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from kvconvert.device import DEVICE_FIELD
from kvconvert.errors import KVConvertError
from kvconvert.kvformat import kv_dtype_slug, kv_format, kv_pair
from kvconvert.kvmath import MLA, KVShape, kv_bytes_per_token, kv_shape, mla_whatif
from kvconvert.mla.options import DEFAULT_CONVERT_TEXT
from kvconvert.progress import eta_text
from kvconvert.stage_options import StageOptions
from kvconvert.targets import (DEFAULT_TARGET, TARGETS, engines_serving, get_target, llamacpp_shape_problem,
                               rope_dims_for, servable_shapes)

# Formats a plan considers, in chains where each holds the same cached values with less rounding than the next
# by construction (finest first): vLLM / TensorRT-LLM's; llama.cpp's symmetric blocks scaled by their largest
# value (q8_0's step bounds every error below q5_0's, q5_0's below q4_0's, q8_0's below iq4_nl's); its affine
# blocks (q5_1's levels halve q4_1's steps over the same range). Formats in no common chain are not ordered.
FINER_CHAINS = (("bf16", "fp8", "nvfp4", "nvfp4_fp8rope"), ("bf16", "q8_0", "q5_0", "q4_0"),
                ("bf16", "q8_0", "iq4_nl"), ("bf16", "q5_1", "q4_1"))
FORMATS = tuple(dict.fromkeys(f for chain in FINER_CHAINS for f in chain))


def llamacpp_pairs(finer_half: str = "k") -> tuple[str, ...]:
    """K and V apart in llama.cpp's types (-ctk / -ctv; kvformat.KVPair), for the source's own attention (an MLA row
    has no V half): the pairs whose `finer_half` ("k" or "v") has more bits than the other. The plan gives the bits
    to the half whose 4-bit rounding costs the model more (plan_pairs: measured by kvconvert.quant.sensitivity;
    on SmolLM2 the keys, and in llama.cpp q5_0/iq4_nl has KL 0.014 against iq4_nl/q5_0's 0.036 at the same bytes).
    Any other pair is planned when --kv-dtypes names it."""
    bits = {f: kv_format(f).bits for f in FORMATS if kv_format(f).ggml_type}
    finer = (lambda k, v: bits[k] > bits[v]) if finer_half == "k" else (lambda k, v: bits[v] > bits[k])
    return tuple(f"{k}/{v}" for k in bits for v in bits if finer(k, v))


PAIRS = llamacpp_pairs("k")
HEAL_LR = 1e-4  # a source's heal for its cache: at the distillation preset's 5e-4 its KL rises (docs/heal.md)
SENSITIVITY_TYPE = "iq4_nl"  # the 4-bit type whose K-only and V-only KL decide which half a pair gives more bits


def _finer_one(a: str, b: str) -> bool:
    return any(a in chain and b in chain and chain.index(a) < chain.index(b) for chain in FINER_CHAINS)


def finer(a: str, b: str) -> bool:
    """Format a rounds the same values less than format b by construction (a chain has a before b); K/V pairs half
    by half (one name is both halves): each half finer or the same, and not the same pair."""
    pa, pb = kv_pair(a), kv_pair(b)
    if not (pa.mixed or pb.mixed):
        return _finer_one(pa.name, pb.name)

    def at_most(x: str, y: str) -> bool:
        return x == y or _finer_one(x, y)
    return pa.name != pb.name and at_most(pa.k.name, pb.k.name) and at_most(pa.v.name, pb.v.name)
WIDE_ROPE = 64  # RoPE dims the research shapes may reach where k_rope is stored in 8 bits (else 32)


def _plan_format(name: str) -> str | None:
    """A --kv-dtypes entry's canonical name (q5_0/iq4_nl; q4_0/q4_0 -> q4_0), None when plan does not measure it."""
    try:
        pair = kv_pair(name)
    except KVConvertError:
        return None
    return pair.name if pair.name in FORMATS or pair.mixed else None


class PlanOptions(StageOptions):
    """How `kvconvert plan` measures (the budget aside): its flags, and what `pipeline --kv-budget` plans with."""

    target: Literal[tuple(TARGETS)] = Field(DEFAULT_TARGET, description="Engine that must serve the artifact "
                                                                        "(any: every candidate).")
    quality_eval_tokens: int = Field(2048, ge=64, description="Held-out essay tokens each survivor is scored on "
                                                              "(windows of --window-len).")
    window_len: int = Field(512, ge=64, description="Tokens per scoring window.")
    calib_tokens: int = Field(2048, ge=512, description="Calibration tokens of each quick MLA conversion (the KV "
                                                        "scales: calibrate's defaults, as the recipe ships them).")
    kv_calib_tokens: int | None = Field(None, ge=512, description="Calibration tokens of the KV scales, which the "
                                        "recipe carries (default: calibrate's own, 16384).")
    kv_dtypes: tuple[str, ...] | None = Field(None, description="KV formats to consider (e.g. fp8,nvfp4, or "
                                              "llama.cpp's K/V pairs q5_0/iq4_nl); default: every format the target "
                                              "serves, and for llama.cpp the pairs whose K has more bits than V.")
    measure_dominated: bool = Field(False, description="Also measure the candidates the pruning rules drop.")
    heal_tokens: int = Field(0, ge=0, description="Heal budget: distillation tokens to teach the chosen source "
                             "candidate its quantized cache (heal_distill with its kv_dtype, lr 1e-4); the healed "
                             "model is measured on the same windows and chosen only when it loses less, paired over "
                             "the windows (0: no heal).")
    dtype: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="Weights of the quick conversions, of scoring and of the recipe's conversion: auto = as "
                            "the source stores them (a bf16 checkpoint stays bf16; the built-in SmolLM2 is fp32).")
    device: str = DEVICE_FIELD

    @field_validator("kv_dtypes")
    @classmethod
    def _known_formats(cls, value):
        unknown = [v for v in value or () if _plan_format(v) is None]
        if unknown:
            raise ValueError(f"{', '.join(unknown)}: not a KV format plan measures; choose from {', '.join(FORMATS)}, "
                             "or a K/V pair KTYPE/VTYPE of llama.cpp's types (q5_0/iq4_nl)")
        if value is not None and not value:
            raise ValueError("give at least one KV format, or leave the option out for every format")
        return None if value is None else tuple(_plan_format(v) for v in value)

    @model_validator(mode="after")
    def _whole_windows(self):
        from kvconvert.quant.options import check_whole_windows

        # the quick conversions read 512-token windows (min(512, calib_tokens), calib_tokens >= 512)
        check_whole_windows(self.calib_tokens, 512, "the quick conversions' window")
        if self.kv_calib_tokens is not None:  # calibrate's windows (its --window-len default)
            check_whole_windows(self.kv_calib_tokens, 512, "the KV calibration's --window-len", "--kv-calib-tokens")
        return self


PLAN_FORMAT = 2  # 2: the candidates are built from their recipe's blocks (recipe_blocks), plan.json names them
PLAN_FILES = ("plan.json", "recipe.yaml", "plan.md", "plan.png")  # what a plan writes into its --out (and artifacts/)


def plan_problem(out: Path, budget: float, opts: PlanOptions, source: Path | None = None) -> str | None:
    """None when `out` holds a finished plan (plan.json and its recipe.yaml) of this PLAN_FORMAT for `budget` made
    with the same options, the device aside (it moves the work, not what is measured), from `source`'s weights
    (when given: plan.json's source fingerprint), whose recipe.yaml is still the one it chose; else why not."""
    from kvconvert.checkpoint.fingerprint import checkpoint_fingerprint
    from kvconvert.checkpoint.provenance import option_changes

    done = out / "plan.json"
    if not (done.is_file() and (out / "recipe.yaml").is_file()):
        return "it holds no finished plan (plan.json and recipe.yaml)"
    try:
        measured = json.loads(done.read_text())
        made_with = PlanOptions(**measured["options"])
    except (ValueError, TypeError, KeyError):  # unreadable, or from another version (ValidationError: a ValueError)
        return f"{done} is unreadable or from another kvconvert version"
    was, now = made_with.model_dump(exclude={"device"}), opts.model_dump(exclude={"device"})
    if measured.get("format") != PLAN_FORMAT:
        return f"the plan there was made by another kvconvert version (plan format {measured.get('format')})"
    if measured.get("budget") != budget:
        return f"the plan there is for --kv-budget {measured.get('budget'):.0%}, not {budget:.0%}"
    if was != now:
        return f"the plan there was made with other options ({option_changes(was, now)})"
    recorded = measured.get("source_fingerprint")
    if source is not None and recorded is None:
        return "the plan there records no source fingerprint (an older kvconvert): it may be another model's"
    if source is not None and recorded != (now_fp := checkpoint_fingerprint(source)):
        return (f"the plan there was made for other weights ({measured.get('source')}, fingerprint {recorded}; "
                f"{source} is {now_fp}): its measurements and recipe are not this source's")
    edited = recipe_edits(out, measured)
    return f"{out / 'recipe.yaml'} was edited since the plan chose it ({edited}): the plan measured another recipe" \
        if edited else None


def recipe_edits(out: Path, measured: dict) -> str | None:
    """How `out`/recipe.yaml differs from the recipe plan.json records (`measured`), or None when it does not."""
    import yaml

    from kvconvert.checkpoint.provenance import option_changes

    try:
        written = yaml.safe_load((out / "recipe.yaml").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return "it is no longer readable YAML"
    chosen = measured.get("recipe")
    return None if written == chosen else option_changes(chosen, written)


def finished_plan(out: Path, budget: float, opts: PlanOptions, source: Path | None = None) -> bool:
    """Whether `out` holds a finished plan that stands for this one (plan_problem)."""
    return plan_problem(out, budget, opts, source) is None


@dataclass(frozen=True)
class Candidate:
    """One artifact: the source's attention (rank None) or an MLA shape, with its KV format."""

    kv_dtype: str
    bytes_per_token: int  # all layers, as the runtime allocates
    baseline_bytes: int  # the source in bf16: "today's bytes"
    engines: tuple[str, ...]
    rank: int | None = None
    rope_dim: int | None = None
    heal_tokens: int = 0  # a source taught its cache by that many distillation tokens (the plan's heal budget)

    @property
    def kind(self) -> str:
        return "source" if self.rank is None else "mla"

    @property
    def latent(self) -> int:
        return 0 if self.rank is None else self.rank + self.rope_dim

    @property
    def fraction(self) -> float:
        return self.bytes_per_token / self.baseline_bytes

    @property
    def name(self) -> str:
        healed = f" healed {self.heal_tokens}" if self.heal_tokens else ""
        return (f"source {self.kv_dtype}{healed}" if self.rank is None
                else f"MLA {self.rank}+{self.rope_dim} {self.kv_dtype}{healed}")


def parse_budget(text: str) -> float:
    """'25%' or '0.25' -> 0.25 (a fraction of the source's bf16 KV bytes)."""
    raw = str(text).strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise KVConvertError(f"--kv-budget {text!r}: give a share of today's bf16 KV bytes, e.g. 25% or 0.25")
    if value >= 1 - 1e-9:  # fits() keeps 1e-9 of slack: the source's own bf16 cache would fit and beat every candidate
        raise KVConvertError(f"--kv-budget {text!r}: 100% is the source's own bf16 KV cache, which loses nothing and "
                             "so is always chosen: nothing to convert or quantize. Give a budget below 100%, e.g. 50% "
                             "(the source's KV cache in fp8)")
    return value


def mla_shapes(shape: KVShape, max_rope: int = 32) -> list[tuple[int, int]]:
    """(rank, rope_dim) to consider for a GQA/MHA source: every shape vLLM or TensorRT-LLM serves, and
    research shapes for the runtime: latents in steps of 16 below the source's K+V width, each with the
    largest valid RoPE part up to min(max_rope, latent / 3) (160+32, 96+32, 64+32, 32+16 on SmolLM2;
    with max_rope 64 also 224+64)."""
    kv_heads, d = shape.num_kv_heads, shape.head_dim
    width = 2 * kv_heads * d
    shapes = {s for t in ("vllm", "tensorrt-llm") for s in servable_shapes(TARGETS[t], kv_heads, d)}
    for latent in range(16, width, 16):
        ropes = [r for r in rope_dims_for(d) if r <= min(max_rope, latent // 3)]
        if ropes:
            shapes.add((latent - max(ropes), max(ropes)))
    return sorted((r, p) for r, p in shapes if r + p < width)  # a latent as wide as K+V saves nothing


def enumerate_candidates(config: dict, pairs: tuple[str, ...] = PAIRS) -> list[Candidate]:
    """Every (attention shape, KV format) for a model config, with bytes per token and engines; `pairs`: the K/V
    pairs of llama.cpp's types the source's own attention is planned with."""
    shape = kv_shape(config)
    if shape.kind == MLA:
        raise KVConvertError("the source is already MLA: plan its KV format with `kvconvert calibrate`, or plan "
                             "from the GQA/MHA model it was converted from")
    out = [c for rank, rope in [(None, None), *mla_shapes(shape)] for c in shape_candidates(shape, rank, rope, pairs)]
    wide = sorted(set(mla_shapes(shape, WIDE_ROPE)) - set(mla_shapes(shape)))
    return out + [c for rank, rope in wide for c in shape_candidates(shape, rank, rope)
                  if kv_format(c.kv_dtype).mla_rope == "fp8"]


def shape_candidates(shape, rank: int | None, rope: int | None, pairs: tuple[str, ...] = PAIRS) -> list[Candidate]:
    """Every KV format of one attention shape of a GQA/MHA source ``shape``: the source's own (rank None, with the
    K/V `pairs` too) or MLA rank + rope, with bytes per token and engines."""
    baseline = kv_bytes_per_token(shape, "bf16")
    cached = shape if rank is None else mla_whatif(shape, rank, rope)
    out = []
    for fmt in FORMATS + (tuple(pairs) if rank is None else ()):  # an MLA row has no V half to store apart
        if kv_pair(fmt).k.mla_only and rank is None:  # nvfp4_fp8rope: the source has no k_rope to keep apart
            continue
        if not _whole_blocks(shape, fmt, rank, rope):
            continue
        out.append(Candidate(fmt, kv_bytes_per_token(cached, fmt), baseline, engines_serving(fmt, rank, rope), rank,
                             rope))
    return out


def _whole_blocks(shape, fmt: str, rank: int | None, rope: int | None) -> bool:
    """True when `fmt`'s blocks tile what it quantizes: NVFP4 groups of 16 along head_dim or the latent (k_rope
    apart); llama.cpp's blocks of 32 along head_dim or the MLA row, whose latent and k_rope llama.cpp takes in
    whole blocks each (targets.TARGETS["llamacpp"]: a shape it cannot load is no candidate for its formats)."""
    pair = kv_pair(fmt)
    if pair.ggml_types:  # llama.cpp's one rule (kvconvert.targets)
        heads = (shape.head_dim, shape.head_dim) if rank is None else (rank + rope, rank)
        return llamacpp_shape_problem(*heads) is None
    spec = pair.k
    if not spec.block:
        return True
    return (shape.head_dim if rank is None else rank) % spec.block == 0


def plan_pairs(src: Path, opts: PlanOptions, dtype: str, device: str = "cpu",
               echo=lambda msg: None) -> tuple[tuple[str, ...], dict | None]:
    """(the K/V pairs to plan, the sensitivity that chose them or None).

    --kv-dtypes given: the pairs it names, whichever half has more bits. Else, where the target serves llama.cpp's
    pairs: the source's keys and values are each rounded alone to SENSITIVITY_TYPE on two held-out essay windows
    (kvconvert.quant.sensitivity, in `dtype` weights on `device`), and the pairs give their extra bits to the half whose
    rounding costs more (llamacpp_pairs). A target that serves no pair plans none."""
    if opts.kv_dtypes is not None:
        return tuple(d for d in opts.kv_dtypes if kv_pair(d).mixed), None
    from kvconvert.checkpoint import read_config

    shape = kv_shape(read_config(src))
    if not (opts.target == "any" or opts.target in engines_serving(PAIRS[0], None, None)) or shape.kind == MLA \
            or llamacpp_shape_problem(shape.head_dim, shape.head_dim) is not None:
        return (), None  # no pair served, an MLA source (refused by enumerate_candidates), or no whole blocks
    from kvconvert.memory import DTYPES
    from kvconvert.quant.sensitivity import SensitivityOptions, cache_sensitivity

    report = cache_sensitivity(src, SensitivityOptions(kv_dtype=SENSITIVITY_TYPE, windows=2, window_len=opts.window_len,
                                                       per_layer=False), dtype=DTYPES[dtype], device=device)
    k_only, v_only = report["all"]["k_only"], report["all"]["v_only"]
    finer_half = "k" if k_only >= v_only else "v"
    echo(f"where a 4-bit cache's loss sits ({SENSITIVITY_TYPE}, 2 x {opts.window_len} essay tokens): K-only KL "
         f"{k_only:.4f}, V-only {v_only:.4f}: K/V pairs give the {'keys' if finer_half == 'k' else 'values'} more bits")
    return llamacpp_pairs(finer_half), {"kv_dtype": SENSITIVITY_TYPE, "k_only": k_only, "v_only": v_only,
                                       "tokens": report["tokens"], "finer_half": finer_half}


def fits(candidates: list[Candidate], budget: float, target: str) -> list[Candidate]:
    """Candidates within the budget that the target engine serves (any: every candidate)."""
    get_target(target)
    return [c for c in candidates if c.fraction <= budget + 1e-9 and (target == "any" or target in c.engines)]


def dominated_by(c: Candidate, d: Candidate) -> bool:
    """True when d loses less than c by construction (module docstring); both must fit and be served."""
    finer_or_same = d.kv_dtype == c.kv_dtype or finer(d.kv_dtype, c.kv_dtype)
    if c.kind == "source":
        return d.kind == "source" and finer(d.kv_dtype, c.kv_dtype)
    if d.kind == "source":
        return finer_or_same
    if (d.rank, d.rope_dim) == (c.rank, c.rope_dim):
        return finer(d.kv_dtype, c.kv_dtype)
    if d.kv_dtype != c.kv_dtype:
        return False
    return d.rank >= c.rank and d.rope_dim >= c.rope_dim  # (the shapes differ, so one is strictly larger)


def why_dominated(c: Candidate, d: Candidate) -> str:
    """Why d loses less than c by construction (dominated_by(c, d) holds), in words, whatever their bytes: within
    the budget the plan picks the least damage, so a cheaper candidate that must lose more is not measured."""
    if c.kind == "source" or (d.kind == "mla" and (d.rank, d.rope_dim) == (c.rank, c.rope_dim)):
        return f"the same cached values in a finer format ({d.kv_dtype} < {c.kv_dtype})"
    if d.kind == "source":
        return f"the source's own K/V in a format as fine ({d.kv_dtype}), without the MLA conversion's error"
    return (f"MLA with at least its rank and RoPE dims ({d.rank}+{d.rope_dim} >= {c.rank}+{c.rope_dim}) in the same "
            f"format: more of the same decomposition")


def prune(candidates: list[Candidate]) -> tuple[list[Candidate], dict[str, str]]:
    """(survivors, {pruned name: a candidate that dominates it, a survivor where one does})."""
    beaten = {c.name: [d for d in candidates if d is not c and dominated_by(c, d)] for c in candidates}
    survivors = [c for c in candidates if not beaten[c.name]]
    pruned = {name: next((d for d in by if d in survivors), by[0]).name for name, by in beaten.items() if by}
    return survivors, pruned


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the (bytes, damage) points no other point beats on both (ties: the first kept)."""
    front = []
    for i, (x, y) in enumerate(points):
        beaten = any((x2 <= x and y2 <= y) and ((x2, y2) != (x, y) or j < i) for j, (x2, y2) in enumerate(points)
                     if j != i)
        if not beaten:
            front.append(i)
    return front


# ------------------------------------------------------------------------------ measurement

def weights_dtype(src: Path, choice: str) -> str:
    """PlanOptions.dtype -> "bf16" / "fp16" / "fp32", the weights plan converts to and scores in; auto: as the
    source stores them (kvconvert.memory.resolve_dtype), so a bf16 7B is never copied to 28 GB of fp32."""
    from kvconvert.checkpoint import CheckpointReader
    from kvconvert.memory import dtype_name, resolve_dtype
    from kvconvert.runtime.models import stored_dtype

    with CheckpointReader(src, verify=False) as reader:
        dtype = resolve_dtype(choice, stored_dtype(reader))
    return dtype_name(dtype)


def artifact_folders(c: Candidate, src: Path, work: Path) -> tuple[Path, Path]:
    """(the model under the candidate's cache: `src`, its MLA conversion or the source healed for its cache in
    `work`, the checkpoint scored: that model for bf16, its calibrated copy in `work` for a quantized cache)."""
    if c.heal_tokens:
        model = work / f"healed-{c.heal_tokens}-{kv_dtype_slug(c.kv_dtype)}"
    else:
        model = src if c.rank is None else work / f"mla-{c.rank}-{c.rope_dim}"
    scored = model if c.kv_dtype == "bf16" else \
        work / f"{'source' if model == src else model.name}-{kv_dtype_slug(c.kv_dtype)}"
    return model, scored


def disk_needed(candidates: list[Candidate], src: Path, work: Path, dtype: str) -> int:
    """Bytes the candidates' checkpoints not yet in `work` will take, at most: each a copy of the source in the
    larger of `dtype` and its stored dtype (calibrate copies as stored; an MLA conversion is smaller)."""
    from kvconvert.checkpoint import estimate_checkpoint_bytes
    from kvconvert.memory import DTYPES

    missing = {folder for c in candidates for folder in artifact_folders(c, src, work)
               if folder != src and not (folder / "manifest.json").is_file()}
    copy = max(estimate_checkpoint_bytes(src, DTYPES[dtype].itemsize, untie=True),
               estimate_checkpoint_bytes(src, untie=True))
    return len(missing) * copy


def recipe_blocks(c: Candidate, target: str, calib_tokens: int, dtype: str, kv_calib_tokens: int | None = None) -> dict:
    """The recipe blocks that build `c` (kvconvert.recipe): `convert` for an MLA shape (one-shot, `calib_tokens`,
    weights in `dtype`, for `target` when it serves the shape) and `calibrate` for a quantized cache (calibrate's
    defaults for the format: mse scale search and key phases, on `kv_calib_tokens` tokens, None: its default
    16384). The plan builds what it measures from these same blocks, so the recipe ships what was measured and
    the pipeline reuses the plan's build."""
    blocks = {}
    if c.heal_tokens:  # the source taught its cache (pipeline: the heal stage, before the calibration)
        blocks["heal_distill"] = {"kv_dtype": c.kv_dtype, "tokens": c.heal_tokens, "lr": HEAL_LR}
    if c.rank is not None:
        blocks["convert"] = {"rank": c.rank, "rope_dim": c.rope_dim, "target": target if target in c.engines else "any",
                             "calib_tokens": calib_tokens, "dtype": dtype}
    if c.kv_dtype != "bf16":
        blocks["calibrate"] = {"kv_dtype": c.kv_dtype}
        if kv_calib_tokens is not None:
            blocks["calibrate"]["calib_tokens"] = kv_calib_tokens
    return blocks


def build_artifact(c: Candidate, src: Path, work: Path, blocks: dict, device: str, echo,
                   overwrite: bool = False) -> Path:
    """The candidate's checkpoint under `work`, built from its recipe blocks (recipe_blocks) on `device`: the MLA
    conversion or the source's heal for its cache, then the KV calibration of a quantized cache. Each build is
    recorded with its provenance (kvconvert.checkpoint.provenance: the pipeline's stage record), and one already in
    `work` is reused only when its record matches (same source weights, same options), unless `overwrite`."""
    from kvconvert.checkpoint.provenance import record_artifact, reuse_problem, stage_record
    from kvconvert.mla.convert import convert_to_mla
    from kvconvert.mla.options import MLAOptions
    from kvconvert.quant.options import CalibrateOptions
    from kvconvert.quant.run import CalibrateJob, run_calibrate

    model, out = artifact_folders(c, src, work)

    def built(folder: Path, source: Path, record: dict) -> bool:
        return not overwrite and (folder / "manifest.json").is_file() and reuse_problem(folder, source, record) is None

    if "heal_distill" in blocks:
        from kvconvert.recipe import heal as run_heal, heal_blocks, parse_recipe

        heal_recipe = parse_recipe({"heal_distill": {**blocks["heal_distill"], "device": device}}, "the plan's heal")
        record = stage_record("heal", None, heal=heal_blocks(heal_recipe))  # what the pipeline's heal stage records
        if not built(model, src, record):
            echo(f"  healing: the source for its {c.kv_dtype} cache, {c.heal_tokens} distillation tokens")
            run_heal(src, src, heal_recipe, model, overwrite=True, progress=False)
            record_artifact(model, src, record)

    if "convert" in blocks:
        opts = MLAOptions(**blocks["convert"], device=device)
        record = stage_record("convert", opts, heal=None)  # one-shot, as the pipeline's convert stage records it
        if not built(model, src, record):
            echo(f"  converting: MLA {c.rank}+{c.rope_dim}, {opts.calib_tokens} calibration tokens")
            convert_to_mla(src, model, opts, overwrite=True, progress=False)
            record_artifact(model, src, record)
    if "calibrate" not in blocks:
        return model
    opts = CalibrateOptions(**blocks["calibrate"], device=device)
    record = stage_record("calibrate", opts)
    if not built(out, model, record):
        echo(f"  calibrating: {c.kv_dtype} scales of {model.name} ({opts.observer}, {opts.calib_tokens} tokens: "
             "the recipe's calibration)")
        run_calibrate(CalibrateJob(src=str(model), options=opts, out=out, overwrite=True),
                      echo=lambda msg: echo(f"    {msg.strip()}"))
        record_artifact(out, model, record)
    return out


class Scorer:
    """Source logits on `windows` essay windows of `window_len` tokens (the runtime, bf16 cache: today's
    serving), and KL/perplexity of candidates against them, all in the runtime with `dtype` weights on `device`.

    The source's logits go to validate's store of source results kept across runs (kvconvert.eval.validate:
    source_logits_store): they are the quick suite's perplexity windows measured by the same runner, so a
    plan and the validations after it (`pipeline --kv-budget`, the README's demo) run the source on them once.
    `scratch`: where they go when they are too large to keep (removed by close)."""

    def __init__(self, src: Path, windows: int, window_len: int, dtype: str, device: str, scratch: Path,
                 echo=lambda msg: None):
        from kvconvert.checkpoint import load_tokenizer
        from kvconvert.data import eval_windows
        from kvconvert.eval.cache import source_logits_store, source_results_dir
        from kvconvert.eval.runner import LazyRunner
        from kvconvert.eval.samples import EssayWindow
        from kvconvert.progress import counted

        self.ids = eval_windows(load_tokenizer(src), windows, window_len)
        self.dtype, self.device = dtype, device
        source = LazyRunner(src, "runtime", "bf16", dtype=dtype, device=device)  # loads only if a window is missing
        source.max_len = window_len
        essay = [EssayWindow(w) for w in self.ids]
        self.store = source_logits_store(source, essay, source_results_dir(), scratch, say=echo)
        self.hashes = [w.key for w in essay]  # validate's names for the same windows
        missing = [i for i, h in enumerate(self.hashes) if not self.store.has(h)]
        step = counted("  source logits: window", echo)
        for n, i in enumerate(missing, 1):
            self.store.put(self.hashes[i], source.logits(self.ids[i]))
            step(n, len(missing))
        if len(missing) < len(self.ids):
            echo(f"  source logits: {len(self.ids) - len(missing)} of {len(self.ids)} windows measured by an earlier "
                 f"run (kept in {self.store.folder})")
        source.close()

    def score(self, path: Path, kv_dtype: str) -> dict:
        """{kl: mean token KL(source || candidate) in nats, ppl, source_ppl, tokens, window_kls: each window's}."""
        from kvconvert.eval.report import perplexity_summary
        from kvconvert.eval.runner import RuntimeRunner
        from kvconvert.eval.metrics import window_stats

        runner = RuntimeRunner(path, kv_dtype, dtype=self.dtype, max_len=self.ids.shape[1], device=self.device)
        stats = [window_stats(self.store.get(h), runner.logits(w), w) for h, w in zip(self.hashes, self.ids)]
        runner.close()
        pooled = perplexity_summary(stats)
        return {"kl": pooled["kl_mean"], "ppl": pooled["candidate"], "source_ppl": pooled["source"],
                "tokens": pooled["tokens"], "window_kls": [w["kl"] / w["n_tokens"] for w in stats]}

    def close(self) -> None:
        self.store.close()


# ------------------------------------------------------------------------------ outputs

def chosen_recipe(c: Candidate, src: str, target: str, calib_tokens: int, dtype: str,
                  kv_calib_tokens: int | None = None) -> dict:
    """The recipe that builds `c` (validated by kvconvert.recipe): recipe_blocks, the very blocks the plan built
    and measured `c` with, validated with the quick suite and default gate."""
    from kvconvert.recipe import parse_recipe

    pct = round(100 * c.fraction)
    data = {"name": f"{Path(src).name}-plan-{pct}pct", "source": src,
            "description": f"kvconvert plan: {c.name}, {c.bytes_per_token} KV bytes/token ({pct}% of bf16), "
                           f"served by {', '.join(c.engines)}",
            **recipe_blocks(c, target, calib_tokens, dtype, kv_calib_tokens)}
    data["validate"] = {"suite": "quick"}
    parse_recipe(data, "kvconvert plan")  # what the pipeline will load; a key left out keeps its one default
    return data


LABEL_ALL_UP_TO = 12  # points per panel that all get their names
LABEL_LINE = 8  # points between two stacked labels (6-point text)


def label_drops(xy: list[tuple[float, float]], near_x: float = 25.0, line_decades: float = 0.12) -> list[int]:
    """Lines each label moves down so that labels of nearby points do not print over each other.

    xy: the labelled points (x in % of bytes, y > 0 on a log axis). A label runs right of its point, one line
    (LABEL_LINE points, about line_decades on the panels drawn here) high; it drops line by line while it
    would overlap an earlier (by x) label within near_x of its x."""
    placed: list[tuple[float, float]] = []  # x, log10 of the label's line
    drops = [0] * len(xy)
    for i in sorted(range(len(xy)), key=lambda i: (xy[i][0], -xy[i][1])):
        x, ly = xy[i][0], math.log10(xy[i][1])
        while any(abs(x - px) < near_x and abs(ly - line_decades * drops[i] - py) < line_decades for px, py in placed):
            drops[i] += 1
        placed.append((x, ly - line_decades * drops[i]))
    return drops


def plot_frontier(points: list[dict], path: Path, title: str, budget: float | None = None,
                  metrics: tuple[str, ...] = ("kl",)) -> None:
    """One panel per metric ("kl", "ppl_increase_pct"): KV bytes (share of bf16) against damage, the Pareto front
    joined, each point labelled with its name and engines (beyond LABEL_ALL_UP_TO points only the front's and the
    chosen one: the rest are grey dots, named in the table beside the picture). points: dicts with name, fraction, engines,
    the metrics (None: not measured, left out) and optionally chosen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes_of = {"kl": ("KL(source || candidate), nats/token", 1e-5),  # (label, floor of the log axis)
               "ppl_increase_pct": ("perplexity increase over the source on the same windows, %", 0.01)}
    fig, axes = plt.subplots(1, len(metrics), figsize=(9 * len(metrics), 6), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        shown = [p for p in points if p.get(metric) is not None]
        label, floor = axes_of[metric]
        xy = [(p["fraction"] * 100, max(p[metric], floor)) for p in shown]
        front = sorted(pareto_front(xy), key=lambda i: xy[i][0])
        ax.step([xy[i][0] for i in front], [xy[i][1] for i in front], where="post", color="tab:green", alpha=0.6,
                label="Pareto frontier (less damage for no more bytes)", zorder=1)
        named = [i for i, p in enumerate(shown)  # crowded: the frontier's names only
                 if len(shown) <= LABEL_ALL_UP_TO or i in front or p.get("chosen")]
        drops = label_drops([xy[i] for i in named])
        for i, (p, (x, y)) in enumerate(zip(shown, xy)):
            color = "tab:red" if p.get("chosen") else ("tab:green" if i in front else "tab:gray")
            ax.scatter(x, y, s=80 if p.get("chosen") else 28, marker="*" if p.get("chosen") else "o", color=color,
                       zorder=2)
        for i, drop in zip(named, drops):
            p, (x, y) = shown[i], xy[i]
            ax.annotate(f"{p['name']} [{', '.join(p['engines']) or 'none'}]", (x, y), fontsize=6,
                        xytext=(4, 3 - LABEL_LINE * drop), textcoords="offset points",
                        arrowprops={"arrowstyle": "-", "lw": 0.4, "color": "0.6"} if drop else None)
        if budget is not None:
            ax.axvline(budget * 100, color="tab:blue", ls="--", lw=1, label=f"budget {budget:.0%}")
        ax.set_xlim(0, 1.1 * max([x for x, _ in xy] + [100 * (budget or 0)]))
        ax.set(xlabel="KV bytes per token, % of the source in bf16", ylabel=label, yscale="log", title=title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)


def format_kl(kl: float | None) -> str:
    return "-" if kl is None else f"{kl:.4f}" if kl >= 1e-3 else f"{kl:.1e}"


def table(rows: list[dict]) -> str:
    lines = ["| candidate | KV bytes/token | of bf16 | served by | KL | ppl | status |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        kl = format_kl(r.get("kl"))
        ppl = f"{r['ppl']:.2f}" if r.get("ppl") is not None else "-"
        lines.append(f"| {r['name']} | {r['bytes_per_token']} | {r['fraction']:.1%} | {', '.join(r['engines'])} | "
                     f"{kl} | {ppl} | {r['status']} |")
    return "\n".join(lines)


def dropped_kv_dtypes(candidates: list, kv_dtypes: tuple[str, ...] | None, target: str) -> list[str]:
    """The formats --kv-dtypes names that `target` serves in none of the candidates (the plan leaves them out: said,
    not silent)."""
    if not kv_dtypes or target == "any":
        return []
    served = {c.kv_dtype for c in candidates if target in c.engines}
    return [d for d in kv_dtypes if d not in served]


def healed_candidate(best: Candidate, heal_tokens: int) -> tuple[Candidate | None, str | None]:
    """(the chosen candidate taught its cache with the heal budget, or None; why not, when a budget was given and
    nothing is healed)."""
    if not heal_tokens:
        return None, None
    if best.kind != "source":
        return None, (f"not spent: {best.name} is an MLA conversion, healed by `kvconvert heal` (`heal --plan` "
                      "sizes its budget); the plan's heal budget teaches a source its cache")
    if best.kv_dtype == "bf16":
        return None, "not spent: the chosen cache is bf16, with no rounding to teach"
    return replace(best, heal_tokens=heal_tokens), None


def paired_change(before: list[float], after: list[float]) -> dict:
    """Mean and standard error of the per-window KL change after - before (the same windows, so paired)."""
    diffs = [a - b for a, b in zip(after, before, strict=True)]
    mean = sum(diffs) / len(diffs)
    var = sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1) if len(diffs) > 1 else float("inf")
    return {"mean": mean, "se": math.sqrt(var / len(diffs)), "windows": len(diffs)}


def heal_lowers(change: dict) -> bool:
    """The healed model is chosen only when its KL falls by more than 2 standard errors of the paired change."""
    return change["mean"] + 2 * change["se"] < 0


def heal_verdict(change: dict) -> str:
    """What the heal budget bought, in words (heal_lowers decides)."""
    said = f"KL change {change['mean']:+.4f} ± {change['se']:.4f} over {change['windows']} windows, paired"
    if heal_lowers(change):
        return f"healed: {said}"
    return f"the heal did not lower the KL by 2 standard errors ({said}): the unhealed candidate is shipped"


def run_plan(src: str, budget: float, opts: PlanOptions, out: Path, echo=print, overwrite: bool = False,
             rebuild: bool = False) -> dict:
    """Enumerate, filter, prune, measure, choose; writes plan.json (with `opts`, the source's fingerprint, and under
    "artifacts" the chosen candidate's builds, which the pipeline reuses), plan.png, plan.md and recipe.yaml to
    `out`. overwrite: replace those files where `out` has them (refused otherwise, before any work); rebuild: the
    candidates' checkpoints too, even where a matching build is in `out` (the pipeline's --overwrite)."""
    import yaml

    from kvconvert.checkpoint import (atomic_write_text, check_checkpoint, check_not_source, check_writable,
                                      ensure_free_space, read_config)
    from kvconvert.device import resolve_device
    from kvconvert.checkpoint.fingerprint import checkpoint_fingerprint
    from kvconvert.checkpoint.writer import refuse_existing_outputs
    from kvconvert.sources import resolve_source

    t0 = time.time()
    target, calib_tokens, device = opts.target, opts.calib_tokens, str(resolve_device(opts.device))  # no GPU: now
    windows = max(1, opts.quality_eval_tokens // opts.window_len)
    window_len = min(opts.window_len, opts.quality_eval_tokens)
    src_path = Path(resolve_source(src))
    check_checkpoint(src_path, finite=False)  # config, tensors and their shapes first; each candidate's build scans
    dtype = weights_dtype(src_path, opts.dtype)
    check_not_source(out, (src_path,))  # --out inside the source: refused before any work
    refuse_existing_outputs([out / name for name in PLAN_FILES], overwrite)  # the user's recipe.yaml is not replaced
    pairs, sensitivity = plan_pairs(src_path, opts, dtype, device, echo)
    everything = [c for c in enumerate_candidates(read_config(src_path), pairs)
                  if opts.kv_dtypes is None or c.kv_dtype in opts.kv_dtypes]
    for kv_dtype in dropped_kv_dtypes(everything, opts.kv_dtypes, target):
        engines = sorted({e for c in everything if c.kv_dtype == kv_dtype for e in c.engines},
                         key=lambda e: (e == "kvconvert", e))  # a stock engine first
        echo(f"note: --kv-dtypes {kv_dtype} left out: {target} serves no candidate with it"
             + (f" (served by {', '.join(engines)}: --target {engines[0]}, or --target any)" if engines else ""))
    fitting = fits(everything, budget, target)
    if not fitting:
        served = [c for c in everything if target == "any" or target in c.engines]
        if not served:
            raise KVConvertError(f"{target} serves none of --kv-dtypes {','.join(opts.kv_dtypes or ())} for this "
                                 "model: add a format it serves, or leave --kv-dtypes out")
        smallest = min(served, key=lambda c: c.fraction)
        raise KVConvertError(f"nothing {target} serves fits {budget:.1%} of the bf16 KV bytes: the smallest is "
                             f"{smallest.name} at {smallest.fraction:.1%}; raise --kv-budget or use --target any")
    survivors, pruned = prune(fitting)
    to_measure = fitting if opts.measure_dominated else survivors
    echo(f"{len(everything)} candidates, {len(fitting)} fit {budget:.0%} and are served by {target}, "
         f"{len(survivors)} not dominated: " + ", ".join(c.name for c in survivors))
    by_name = {c.name: c for c in fitting}
    unmeasured = [c for c in sorted(fitting, key=lambda c: c.fraction) if c.name in pruned and not opts.measure_dominated]
    for c in unmeasured:
        d = by_name[pruned[c.name]]
        echo(f"  not measured: {c.name} ({c.fraction:.0%} of bf16): dominated by {d.name} ({d.fraction:.0%}), which "
             f"loses less by construction ({why_dominated(c, d)})")
    if unmeasured:
        echo("  (within the budget the plan picks the least damage, not the fewest bytes; --measure-dominated "
             "measures these too)")
    work = out / "artifacts" / f"{dtype}-{calib_tokens}"  # a rerun reuses what its provenance says was built alike
    check_writable(out)
    # up front, not at the second candidate; a heal budget may heal any source candidate measured (two copies)
    heals = [h for c in to_measure if (h := healed_candidate(c, opts.heal_tokens)[0]) is not None]
    ensure_free_space(out, disk_needed(to_measure, src_path, work, dtype)
                      + (max(disk_needed([h], src_path, work, dtype) for h in heals) if heals else 0))
    out.mkdir(parents=True, exist_ok=True)
    echo(f"measuring {len(to_measure)} on {windows} x {window_len} essay tokens (KL to the source, bundled runtime "
         f"with {dtype} weights on {device})")
    scorer = Scorer(src_path, windows, window_len, dtype, device, work / ".source-logits", echo)
    results, measured_from = {}, time.time()
    order = sorted(to_measure, key=lambda c: (c.kind != "source", c.latent, c.kv_dtype))

    def measure(c: Candidate) -> dict:
        started = time.time()  # the seconds building and scoring the candidate took
        blocks = recipe_blocks(c, target, calib_tokens, dtype, opts.kv_calib_tokens)
        path = build_artifact(c, src_path, work, blocks, device, echo, rebuild)
        return {**scorer.score(path, c.kv_dtype), "seconds": round(time.time() - started, 1)}

    healed, heal_note = None, None
    try:
        for i, c in enumerate(order, 1):
            echo(f"[{i}/{len(order)}] {c.name}: build and score")
            m = results[c.name] = measure(c)
            echo(f"  {c.name}: KL {m['kl']:.4f}, ppl {m['ppl']:.2f} ({m['seconds']} s; plan "
                 f"{eta_text(measured_from, i, len(order))})")
        best = min(to_measure, key=lambda c: results[c.name]["kl"])
        healed, heal_note = healed_candidate(best, opts.heal_tokens)
        if healed is not None:
            echo(f"[heal] {healed.name}: the chosen {best.name} taught its cache, {healed.heal_tokens} tokens")
            m = results[healed.name] = measure(healed)
            change = m["paired_kl_change"] = paired_change(results[best.name]["window_kls"], m["window_kls"])
            heal_note = heal_verdict(change)
            echo(f"  {healed.name}: KL {m['kl']:.4f} ({heal_note})")
            if heal_lowers(change):
                best = healed
        if heal_note:
            echo(f"  heal budget: {heal_note}")
    finally:
        scorer.close()
    # with --measure-dominated: a pruned candidate measured better than what dominates it
    contradicted = [f"{name} < {by}" for name, by in pruned.items()
                    if name in results and results[name]["kl"] < results[by]["kl"]]
    rows = []
    for c in sorted(fitting, key=lambda c: -c.fraction):
        dominated = (f"dominated by {pruned[c.name]} ({why_dominated(c, by_name[pruned[c.name]])})"
                     if c.name in pruned else "")
        status = ("chosen" if c is best else ("measured; " + dominated if dominated else "measured")
                  if c.name in results else "not measured: " + dominated)
        rows.append({**asdict(c), "name": c.name, "fraction": c.fraction, **results.get(c.name, {}), "status": status,
                     "chosen": c is best})
    if healed is not None:  # beside the candidate it heals
        at = next(i for i, r in enumerate(rows) if r["name"] == replace(healed, heal_tokens=0).name)
        rows.insert(at, {**asdict(healed), "name": healed.name, "fraction": healed.fraction, **results[healed.name],
                         "status": "chosen" if healed is best else f"measured; not chosen: {heal_note}",
                         "chosen": healed is best})
    verdict = (f"don't convert, just quantize: the source with its KV cache in {best.kv_dtype}" if best.rank is None
               else f"convert to MLA {best.rank}+{best.rope_dim} with its KV cache in {best.kv_dtype}")
    if best.heal_tokens:
        verdict = (f"don't convert: heal the source for its {best.kv_dtype} KV cache ({best.heal_tokens} distillation "
                   "tokens), then quantize")
    protocol = {"eval": f"essays, {windows} x {window_len} tokens", "engine": f"kvconvert runtime, {dtype} weights",
                "reference": "the source with a bf16 KV cache",
                "conversion": f"one-shot, {calib_tokens} calibration tokens of {DEFAULT_CONVERT_TEXT}",
                "kv_scales": "the recipe's calibration (calibrate's defaults for the format), what the pipeline ships"}
    model, scored = artifact_folders(best, src_path, work)
    artifacts = {"convert": str(model) if best.rank is not None else None,  # the builds the pipeline reuses
                 "heal": str(model) if best.heal_tokens else None,
                 "calibrate": str(scored) if best.kv_dtype != "bf16" else None}
    plan = {"format": PLAN_FORMAT, "source": src, "source_fingerprint": checkpoint_fingerprint(src_path),
            "budget": budget, "target": target, "options": opts.model_dump(), "device": device, "chosen": best.name,
            "verdict": verdict, "protocol": protocol,
            "pruning_contradicted": contradicted, "artifacts": artifacts, "sensitivity": sensitivity,
            "heal": heal_note,
            "seconds": round(time.time() - t0, 1),
            "rows": rows}
    recipe = chosen_recipe(best, src, target, calib_tokens, dtype, opts.kv_calib_tokens)
    atomic_write_text(out / "recipe.yaml", yaml.safe_dump(recipe, sort_keys=False))
    plot_frontier([r for r in rows if r.get("kl") is not None], out / "plan.png",
                  f"kvconvert plan: {src}, budget {budget:.0%}, target {target}", budget)
    atomic_write_text(out / "plan.md", f"{verdict}\n\n{table(rows)}\n")
    atomic_write_text(out / "plan.json", json.dumps({**plan, "recipe": recipe}, indent=1) + "\n")
    echo(f"\n{table(rows)}\n\nChosen: {best.name} ({best.fraction:.1%} of the bf16 KV bytes, KL "
         f"{results[best.name]['kl']:.4f}): {verdict}.\nRecipe: {out / 'recipe.yaml'} (kvconvert pipeline --recipe "
         f"{out / 'recipe.yaml'} --out OUT)\nPicture: {out / 'plan.png'}\nTotal: {plan['seconds']:.0f} s")
    if best.kind == "mla":  # one-shot as measured: healing is the way to less KL, sized before it is paid for
        echo(f"Healing it: `kvconvert heal --plan --plan-kl-target K` on the conversion (recipe + a heal_distill "
             "block) measures short distillations and prints the tokens and GPU-hours to reach KL K (docs/heal.md)")
    return plan


@contextmanager
def removed_if_empty(out: Path):
    """If the body fails (Ctrl-C, SIGTERM, an error) and `out` did not exist before, remove the folders it
    left empty under `out`, `out` included (finished artifacts stay, for the rerun to reuse)."""
    existed = out.exists()
    try:
        yield out
    except BaseException:
        if not existed and out.is_dir():
            for folder in sorted((p for p in out.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [out]:
                try:
                    folder.rmdir()  # empty folders only: anything written stays
                except OSError:
                    pass
        raise
