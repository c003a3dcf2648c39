"""Layer-wise reconstruction: fit each converted MLA attention block to the source block's output.

Streaming, one decoder layer in memory at a time. Two residual streams of calibration hidden
states are carried through the layers, the teacher's (h_t, source layers) and the student's (h_s,
healed MLA layers); at layer i the student block A_s (q_proj, kv_a_proj_with_mqa, kv_b_proj,
o_proj; kv_a_layernorm fixed and uniform, MLP untouched) is fitted by Adam, starting from the
conversion's closed form, to one of three targets (LayerwiseOptions.target):

    student_input     min |A_s(x_s) - A_t(x_s)|^2          (x = RMSNorm(h): the block input)
    teacher_input     min |A_s(x_t) - A_t(x_t)|^2
    student_residual  min |h_s + A_s(x_s) - (h_t + A_t(x_t))|^2

The loss is normalised by the target's energy, so `rel_err` below is |error|^2 / |target|^2 over
all calibration tokens. Each weight is optimised in units of its own RMS (heal.reparam), then
o_proj is refitted by least squares (exact optimum for the rest fixed) and the latent is
re-scaled if training pushed kv_a_layernorm out of its linear range.

Tensors: x, y [N, T, hidden] (N calibration windows of T tokens), float32 on `device`.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from kvconvert.checkpoint import CheckpointReader, CheckpointWriter, atomic_save_tensors, atomic_write_text
from kvconvert.heal.options import LayerwiseOptions
from kvconvert.heal.state import load_tensor_state, read_json_state
from kvconvert.heal.reparam import row_scales, scheduled_lr
from kvconvert.mla import factorize as fz
from kvconvert.mla.convert_layer import LayerResult
from kvconvert.mla.options import LATENT_LINEAR_RHO
from kvconvert.models import deepseek_v3 as ds, llama
from kvconvert.models.common import DecoderLayer, rms_norm, short_names, take
from kvconvert.models.deepseek_v3 import MLAAttention, MLAShape
from kvconvert.models.llama import LlamaAttention, LlamaShape
from kvconvert.models.registry import COPIED_LAYER_TENSORS, TARGET_ATTENTION
from kvconvert.progress import eta_text

CHUNK_WINDOWS = 8  # windows per forward when evaluating on the whole calibration set


def read_layer(reader: CheckpointReader, i: int, attention_cls, device="cpu") -> DecoderLayer:
    """Layer i's weights in float32 on `device`; attention_cls: LlamaAttention (teacher) or MLAAttention (student)."""
    w = short_names(reader.tensors(f"model.layers.{i}.", torch.float32))
    return DecoderLayer.of({k: v.to(device) for k, v in w.items()}, attention_cls)


def attention_tensors(a: MLAAttention) -> dict:
    """The attention's weights by short name (the ones present): what the fit optimises."""
    return {k: getattr(a, k) for k in TARGET_ATTENTION if getattr(a, k) is not None}


def _chunks(n: int, size: int = CHUNK_WINDOWS):
    return [slice(i, min(n, i + size)) for i in range(0, n, size)]


@torch.no_grad()
def relative_error(x: torch.Tensor, y: torch.Tensor, w: dict, shape: MLAShape) -> float:
    """sum |A_s(x) - y|^2 / sum |y|^2 over all windows (chunked)."""
    num = den = 0.0
    for sl in _chunks(x.shape[0]):
        diff = ds.attention(x[sl], take(MLAAttention, w), shape) - y[sl]
        num += float(diff.double().pow(2).sum())
        den += float(y[sl].double().pow(2).sum())
    return num / max(den, 1e-300)


@torch.no_grad()
def latent_sq_mean_max(x: torch.Tensor, kv_a: torch.Tensor, rank: int) -> float:
    """max over tokens of mean(c^2), c = the latent rows of kv_a applied to x (pre-norm latent)."""
    best = 0.0
    for sl in _chunks(x.shape[0]):
        c = x[sl] @ kv_a[:rank].T
        best = max(best, float(c.pow(2).mean(-1).max()))
    return best


@torch.no_grad()
def refit_o_proj(x: torch.Tensor, y: torch.Tensor, w: dict, shape: MLAShape) -> tuple[torch.Tensor, float]:
    """Least-squares o_proj [hidden, H*v] given the other weights (float64 normal equations), and
    the resulting rel_err, read off the same statistics without another forward pass:
    |A W^T - Y|^2 = tr(Y^T Y) - 2 <W, Y^T A> + <W, W A^T A>."""
    din = w["o_proj"].shape[1]
    cov = torch.zeros(din, din, dtype=torch.float64, device=x.device)
    cross = torch.zeros(y.shape[-1], din, dtype=torch.float64, device=x.device)
    energy = 0.0
    n = 0
    for sl in _chunks(x.shape[0]):
        a = ds.attention_heads(x[sl], take(MLAAttention, w), shape).reshape(-1, din).double()
        t = y[sl].reshape(-1, y.shape[-1]).double()
        cov += a.T @ a
        cross += t.T @ a
        energy += float(t.pow(2).sum())
        n += a.shape[0]
    w_o = fz.refit_o_proj(cov.cpu() / n, cross.cpu() / n, w["o_proj"].double().cpu())
    cov, cross = cov.cpu(), cross.cpu()
    err = energy - 2 * float((w_o * cross).sum()) + float((w_o * (w_o @ cov)).sum())
    return w_o.to(w["o_proj"]), max(err, 0.0) / max(energy, 1e-300)


def relinearize_latent(x: torch.Tensor, w: dict, shape: MLAShape, limit: float,
                       limit_q: float | None = None) -> tuple[dict, float]:
    """Shrink the latent rows of kv_a (and grow kv_b_proj by the inverse) when training pushed
    max mean(c^2) above `limit`: in the linear range RMSNorm(b c) ~ b c / sqrt(eps), so kv_b / b
    keeps the function. With low-rank queries the same is done for q_a_proj / q_b_proj against
    limit_q. Returns (weights, applied kv factor b <= 1)."""
    out = dict(w)
    b = _shrink_latent(x, out, "kv_a_proj_with_mqa", "kv_b_proj", shape.rank, limit)
    bq = 1.0
    if "q_a_proj" in w and limit_q is not None:
        bq = _shrink_latent(x, out, "q_a_proj", "q_b_proj", w["q_a_proj"].shape[0], limit_q)
    return (out, b) if b < 1.0 or bq < 1.0 else (w, 1.0)


def _shrink_latent(x: torch.Tensor, w: dict, down: str, up: str, rows: int, limit: float) -> float:
    """When max mean(c^2) of the latent c = x @ w[down][:rows].T exceeds `limit`: those rows times
    b = sqrt(limit / peak) and w[up] divided by b (new tensors in the dict). Returns b (1.0: unchanged)."""
    peak = latent_sq_mean_max(x, w[down], rows)
    if peak <= limit:
        return 1.0
    b = math.sqrt(limit / peak)
    scaled = w[down].clone()
    scaled[:rows] *= b
    w[down], w[up] = scaled, w[up] / b
    return b


def fit_attention_block(x: torch.Tensor, y: torch.Tensor, weights: dict, shape: MLAShape, stage: LayerwiseOptions,
                        generator: torch.Generator | None = None, x_val=None, y_val=None) -> LayerResult:
    """Fit one MLA attention block so that A_s(x) ~ y.

    x, y: [N, T, hidden] float32 (normed block inputs and targets). weights: the block's current
    attention weights (short names; kv_a_layernorm included and kept fixed). Returns the fitted float32
    weights and a report: rel_err before and after the fit (and on x_val/y_val when given),
    latent_rescale (1.0 = the latent norm stayed in its linear range), seconds.
    """
    t0 = time.time()
    w0 = {k: v.detach().float().to(x.device) for k, v in weights.items()}
    report = {"rel_err_before": relative_error(x, y, w0, shape)}
    if x_val is not None:
        report["val_rel_err_before"] = relative_error(x_val, y_val, w0, shape)
    linear_peak = LATENT_LINEAR_RHO * shape.latent_eps  # peaks up to here keep the latent norm linear
    limit = max(latent_sq_mean_max(x, w0["kv_a_proj_with_mqa"], shape.rank), linear_peak)
    limit_q = (max(latent_sq_mean_max(x, w0["q_a_proj"], w0["q_a_proj"].shape[0]), linear_peak)
               if "q_a_proj" in w0 else None)
    w = _adam_fit(x, y, w0, shape, stage, generator) if stage.steps else dict(w0)
    w, factor = relinearize_latent(x, w, shape, limit, limit_q)
    report["latent_rescale"] = factor
    if stage.refit_o_proj:
        w["o_proj"], report["rel_err_after"] = refit_o_proj(x, y, w, shape)
    else:
        report["rel_err_after"] = relative_error(x, y, w, shape)
    if report["rel_err_after"] > report["rel_err_before"]:  # never hand back a worse block
        w, report["reverted"] = w0, True
        report["rel_err_after"] = report["rel_err_before"]
    if x_val is not None:
        report["val_rel_err_after"] = relative_error(x_val, y_val, w, shape)
    report["seconds"] = round(time.time() - t0, 2)
    return LayerResult(w, report)


def _adam_fit(x, y, w0: dict, shape: MLAShape, stage: LayerwiseOptions, generator) -> dict:
    names = [k for k in stage.train if k in w0]
    scales = {k: row_scales(k, w0[k], shape.rank).to(x.device)[:, None] for k in names}
    params = {k: torch.nn.Parameter(w0[k] / scales[k]) for k in names}
    opt = torch.optim.Adam(params.values(), lr=stage.lr)
    denom = y.pow(2).mean().clamp_min(1e-30)  # normalise: the loss reads as a relative error
    n = x.shape[0]
    # warm-up over the first 10% of steps (Adam's first steps are ~lr-sized on every element, too
    # big for a block that already fits well), then cosine decay to lr/20
    warmup = max(1, stage.steps // 10)
    for step in range(stage.steps):
        for group in opt.param_groups:
            group["lr"] = scheduled_lr(step, warmup, stage.steps, "cosine", stage.lr)
        idx = torch.randperm(n, generator=generator)[: stage.batch_windows].to(x.device)
        w = dict(w0)
        w.update({k: scales[k] * p for k, p in params.items()})
        loss = (ds.attention(x[idx], take(MLAAttention, w), shape) - y[idx]).pow(2).mean() / denom
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    out = dict(w0)
    out.update({k: (scales[k] * p).detach() for k, p in params.items()})
    return out


# ------------------------------------------------------------------------- streaming driver

def block_targets(h_t, h_s, tw: DecoderLayer, sw: DecoderLayer, t_shape: LlamaShape, s_shape: MLAShape, target: str):
    """(x, y, teacher attention output) for one layer, chunked over windows.

    x: the student block's input (normed), y: what A_s(x) should produce (see module docstring).
    """
    xs, ys, at = [], [], []
    for sl in _chunks(h_t.shape[0]):
        x_t = rms_norm(h_t[sl], tw.input_layernorm, t_shape.rms_eps)
        a_t = llama.attention(x_t, tw.attn, t_shape)
        at.append(a_t)
        if target == "teacher_input":
            xs.append(x_t)
            ys.append(a_t)
            continue
        xs.append(rms_norm(h_s[sl], sw.input_layernorm, s_shape.rms_eps))
        if target == "student_input":
            x_for_teacher = rms_norm(h_s[sl], tw.input_layernorm, t_shape.rms_eps)
            ys.append(llama.attention(x_for_teacher, tw.attn, t_shape))
        else:  # student_residual
            ys.append(h_t[sl] + a_t - h_s[sl])
    return torch.cat(xs), torch.cat(ys), torch.cat(at)


@torch.no_grad()
def _advance(h_t, h_s, a_t, tw: DecoderLayer, sw: DecoderLayer, t_shape: LlamaShape, s_shape: MLAShape):
    """Both streams through layer i (teacher attention output a_t already computed)."""
    new_t, new_s = [], []
    for sl in _chunks(h_t.shape[0]):
        mid = h_t[sl] + a_t[sl]
        new_t.append(mid + tw.mlp(rms_norm(mid, tw.post_attention_layernorm, t_shape.rms_eps)))
        new_s.append(ds.layer(h_s[sl], sw, s_shape))
    return torch.cat(new_t), torch.cat(new_s)


class LayerwiseState:
    """Resumable progress of the layer-wise stage in `folder` (the output's temp area):
    layer_00007.safetensors (fitted attention weights), stream.safetensors (h_t, h_s after the last
    finished layer), progress.json {"done": i, "fingerprint": ...}."""

    def __init__(self, folder: Path, fingerprint: str):
        self.folder = Path(folder)
        self.fingerprint = fingerprint

    def _progress(self) -> dict:
        path = self.folder / "progress.json"
        return read_json_state(path) if path.is_file() else {}

    def done(self) -> int:
        """Number of finished layers that can be reused (0 when the state is absent or stale)."""
        info = self._progress()
        return info["done"] if info.get("fingerprint") == self.fingerprint else 0

    def save_layer(self, i: int, w: dict, report: dict, h_t, h_s) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        atomic_save_tensors({k: v.contiguous().cpu() for k, v in w.items()}, self.folder / f"layer_{i:05d}.safetensors")
        atomic_save_tensors({"h_t": h_t.contiguous().cpu(), "h_s": h_s.contiguous().cpu()}, self.folder / "stream.safetensors")
        reports = self.reports()[:i] + [report]
        atomic_write_text(self.folder / "progress.json",
                      json.dumps({"done": i + 1, "fingerprint": self.fingerprint, "reports": reports}))

    def reports(self) -> list:
        return self._progress().get("reports", [])

    def load_layer(self, i: int) -> dict:
        return load_tensor_state(self.folder / f"layer_{i:05d}.safetensors")

    def load_stream(self):
        s = load_tensor_state(self.folder / "stream.safetensors")
        return s["h_t"], s["h_s"]


def run_layerwise(student: CheckpointReader, teacher: CheckpointReader, ids: torch.Tensor, stage: LayerwiseOptions,
                  writer: CheckpointWriter, state: LayerwiseState, device: str = "cpu", progress: bool = True,
                  val_windows: int = 0) -> list[dict]:
    """Heal every attention block of `student` and write the full checkpoint into `writer`
    (stock DeepSeek-V3 names, the student's dtypes; non-attention tensors copied unchanged).

    ids: [N, T] calibration token ids; the last `val_windows` windows are held out and only
    measured. Returns one report dict per layer.
    """
    s_shape, t_shape = MLAShape.from_config(student.config), LlamaShape.from_config(teacher.config)
    start = state.done()
    reports = state.reports()[:start]
    if start:
        h_t, h_s = (t.to(device) for t in state.load_stream())
    else:
        h_s = student.get("model.embed_tokens.weight", torch.float32)[ids].to(device)
        h_t = teacher.get("model.embed_tokens.weight", torch.float32)[ids].to(device)
    n_fit = ids.shape[0] - val_windows
    layers, started = s_shape.layers, time.time()
    _say(f"heal_layerwise: {layers} layers x {stage.steps} Adam steps of {stage.batch_windows} x {stage.window} "
         f"tokens ({layers * stage.steps} steps" + (f"; layers 1-{start} resumed from saved progress)" if start else ")"))
    bar = tqdm(range(layers), desc="heal: layer-wise", disable=not progress, initial=start)
    for i in range(s_shape.layers):
        if i < start:
            fitted = state.load_layer(i)
        else:
            tw, sw = read_layer(teacher, i, LlamaAttention, device), read_layer(student, i, MLAAttention, device)
            x, y, a_t = block_targets(h_t, h_s, tw, sw, t_shape, s_shape, stage.target)
            gen = torch.Generator().manual_seed(stage.seed * 100_003 + i)  # per layer: resumable
            fit = fit_attention_block(x[:n_fit], y[:n_fit], attention_tensors(sw.attn), s_shape, stage, gen,
                                      x[n_fit:] if val_windows else None, y[n_fit:] if val_windows else None)
            fitted = {k: v.cpu() for k, v in fit.weights.items()}
            sw.attn = take(MLAAttention, fit.weights)
            del x, y
            h_t, h_s = _advance(h_t, h_s, a_t, tw, sw, t_shape, s_shape)
            report = {"layer": i, **fit.report}
            reports.append(report)
            state.save_layer(i, fitted, report, h_t, h_s)
            _say(f"heal_layerwise: layer {i + 1}/{layers} ({eta_text(started, i + 1 - start, layers - start)})")
            bar.update(1)
            bar.set_postfix(err=f"{report['rel_err_before']:.3f}->{report['rel_err_after']:.3f}")
        for short, tensor in fitted.items():
            key = TARGET_ATTENTION[short].format(i=i)
            writer.add(key, tensor.to(student.stored_dtype(key)))
        for name in COPIED_LAYER_TENSORS.values():  # norms and MLP, unchanged
            writer.add(name.format(i=i), student.get(name.format(i=i)))
    bar.close()
    return reports


def _say(line: str) -> None:
    """A progress line on stderr that keeps a running tqdm bar intact."""
    tqdm.write(line, file=sys.stderr)


def copy_globals(student: CheckpointReader, writer: CheckpointWriter) -> None:
    """Embeddings, final norm and lm_head, unchanged."""
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        writer.add(name, student.get(name))

