"""End-to-end distillation of a converted MLA student from its source (teacher).

Loss per token (temperature tau, distributions over the shared vocabulary):
    kl_weight * tau^2 * KL(softmax(z_t / tau) || softmax(z_s / tau))  +  lm_weight * CE(z_s, next token)
averaged over all predicted positions. The student is transformers' DeepseekV3ForCausalLM loaded
from the checkpoint (no remote code), the teacher AutoModelForCausalLM (Llama). Only attention
weights train (q_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj; kv_a_layernorm stays fixed), either
fully or as LoRA deltas merged at the end, in units of each row's RMS (heal.reparam).

accelerate runs the same loop on one CPU, one GPU or `accelerate launch` (DDP/FSDP; see docs/heal.md).
Resumable: every `checkpoint_every` optimizer steps (and on Ctrl-C) the trainable tensors, optimizer
and scheduler state, step and loss history go to state_dir (the output's temp area); a rerun with
the same inputs continues from there and reaches the same final weights as an uninterrupted run.

Token ids: ids [N, seq_len] int64 training windows; the data order is a function of the step only.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.nn.utils import parametrize
from tqdm.auto import tqdm

from kvconvert.checkpoint import read_config
from kvconvert.errors import KVConvertError
from kvconvert.heal.fsdp import (
    adopt_fsdp_plugin, check_fsdp_launch, fsdp_requested, full_training_state, gathered_weights, is_sharded,
    load_full_training_state, place_teacher, shard_report,
)
from kvconvert.heal.fused_loss import fused_distill_loss, next_token_targets
from kvconvert.heal.memory import LOADER_ATTENTION, distill_memory, distill_memory_problem  # noqa: F401 (public here too)
from kvconvert.heal.reparam import ScaledWeight, row_scales, scheduled_lr
from kvconvert.heal.options import TRAINABLE_ATTENTION, DistillOptions
from kvconvert.heal.state import damaged_state, load_torch_state
from kvconvert.kvformat import torch_dtype
from kvconvert.token_stream import Batches, DataExhausted, TensorWindows

STATE_FILE = "distill_state.pt"


@dataclass
class DistillResult:
    weights: dict  # checkpoint name -> trained attention weight (float32, merged)
    history: list = field(default_factory=list)  # one dict per optimizer step
    steps_done: int = 0
    finished: bool = False


def hidden_state_loss(teacher_states, student_states) -> torch.Tensor:
    """Mean over layers of |h_s - h_t|^2 / |h_t|^2: transformers' hidden_states are the embeddings
    (identical in both, skipped), the residual stream after each decoder layer but the last, and
    the final normed state (what lm_head reads); each [B, T, hidden]."""
    terms = [(s.float() - t.float()).pow(2).sum() / t.float().pow(2).sum().clamp_min(1e-30)
             for t, s in zip(teacher_states[1:], student_states[1:])]
    return torch.stack(terms).mean()


def attach_trainable(model, stage: DistillOptions) -> list[str]:
    """Freeze the model, then make stage.targets (those a layer has) trainable through ScaledWeight
    parametrizations. Returns the checkpoint names of the parametrized weights."""
    for p in model.parameters():
        p.requires_grad_(False)
    rank = getattr(model.config, "kv_lora_rank", None)  # row_scales splits kv_a_proj_with_mqa's latent / RoPE rows
    lora = stage.lora_rank if stage.train == "lora" else 0
    names = []
    for i, layer in enumerate(model.model.layers):
        for short in (name for name in TRAINABLE_ATTENTION if name in stage.targets):
            module = getattr(layer.self_attn, short, None)
            if module is None:
                continue
            w = module.weight
            param = ScaledWeight(row_scales(short, w, rank), w.shape[1], lora, stage.lora_alpha).to(w.device)
            parametrize.register_parametrization(module, "weight", param)
            module.parametrizations.weight.original.requires_grad_(stage.train == "full")
            names.append(f"model.layers.{i}.self_attn.{short}.weight")
    return names


def store_frozen_matmuls_in(model, dtype: torch.dtype) -> int:
    """Keep every frozen nn.Linear's weight (and bias) in the autocast dtype; returns the parameters cast.

    Autocast casts each float32 matmul weight to `dtype` at every forward and keeps that copy for the
    backward; a frozen weight never changes, so storing it cast once gives bit-identical products
    without the per-step copies (the frozen MLP and attention weights: most of the student). Left
    float32: trained weights (their parametrized Linears), and weights shared with a non-Linear module
    (lm_head tied to the embedding, which autocast does not cast: the residual stream stays float32).
    The checkpoint heal writes takes frozen tensors from the source files, never from here."""
    shared = {id(p) for m in model.modules() if not isinstance(m, torch.nn.Linear) for p in m.parameters(recurse=False)}
    cast = 0
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear) or parametrize.is_parametrized(module):
            continue
        for name, param in module.named_parameters(recurse=False):
            if param.requires_grad or id(param) in shared or param.dtype == dtype:
                continue
            param.data = param.data.to(dtype)
            cast += param.numel()
    return cast


def compile_layers(*models) -> None:
    """torch.compile each decoder layer of each model (regional compilation): the layers share their code,
    so one compiled graph serves them all and the warm-up stays a one-layer compile; the fused loss,
    embeddings and lm_head stay eager."""
    import torch._dynamo

    for model in models:
        layers = model.model.layers
        # each trained Linear gets its own parametrized class (torch.nn.utils.parametrize), and dynamo
        # guards on the type: one recompile per layer, whose graph inductor's cache already holds
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, 2 * len(layers) + 8)
        for layer in layers:
            layer.compile()


def keep_logits_dtype(model) -> None:
    """Undo accelerate's float32 conversion of the prepared model's outputs under mixed precision
    (prepare_model wraps forward in autocast + convert_outputs_to_fp32): it would turn the student's
    [N, V] logits into a float32 copy and make the fused loss store its [N, V] gradient in float32, two
    vocabulary-sized tensors twice the size kvconvert.heal.memory counts. Distiller._loss opens the
    autocast region itself, and the fused loss upcasts per chunk."""
    inner = getattr(model, "module", model)  # DDP-style wrappers keep the model as .module
    for m in {id(model): model, id(inner): inner}.values():
        original = m.__dict__.pop("_original_forward", None)  # what accelerate's unwrap_model restores too
        if original is not None:
            m.forward = original


# --------------------------------------------------------------------------- memory (checked up front)

def check_distill_memory(student: dict, teacher: dict, stage: DistillOptions, device: torch.device,
                         shards: int = 1) -> None:
    """Refuse before loading anything when the two models and one micro-batch cannot fit on `device`
    (kvconvert.heal.memory.distill_memory_problem with kvconvert.memory.available_memory: the GPU's free
    memory, or RAM's). shards: the processes an FSDP launch shards the models over, each with its own GPU
    (on CPUs they share one RAM and every process loads both models whole first, so there it stays 1)."""
    from kvconvert.memory import available_memory

    where = f"free on {device}" if device.type == "cuda" else "available in RAM"
    problem = distill_memory_problem(student, teacher, stage, available_memory(device), device.type, where,
                                     shards=shards)
    if problem:
        raise KVConvertError(problem)


def check_loaded_attention(*models) -> None:
    """The estimate assumes the attention the loader picks (LOADER_ATTENTION); a model loaded with
    another one would make it wrong: say so instead of running on a wrong number."""
    for model in models:
        impl = getattr(model.config, "_attn_implementation", None)
        if impl != LOADER_ATTENTION:
            raise KVConvertError(f"{type(model).__name__} loaded with attn_implementation {impl!r}; heal_distill's "
                                 f"memory estimate (kvconvert.heal.memory) assumes {LOADER_ATTENTION!r}")


def make_accelerator(stage: DistillOptions):
    """accelerate's Accelerator on the stage's device (kvconvert.device.resolve_device: auto = cuda when
    visible; a GPU asked for and missing is an error). Under `accelerate launch` with several
    processes, each process keeps the GPU accelerate gives it unless the stage says cpu."""
    from accelerate import Accelerator

    from kvconvert.device import launched_world_size, resolve_device

    from accelerate.state import AcceleratorState, PartialState

    device = resolve_device(stage.device)
    if launched_world_size() == 1:
        # accelerate keeps its first device and mixed precision for the whole process: an earlier run's
        # (a library caller, the tests) would silently win over this stage's device, or refuse its precision
        if PartialState._shared_state and PartialState().device.type != device.type:
            AcceleratorState._reset_state(reset_partial_state=True)
        elif AcceleratorState._shared_state and AcceleratorState().mixed_precision != stage.mixed_precision:
            AcceleratorState._reset_state()
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)  # accelerate's single-process device is the current one
    accelerator = Accelerator(mixed_precision=stage.mixed_precision, cpu=device.type == "cpu")
    check_accelerator_device(accelerator.device, device)
    return accelerator


def check_accelerator_device(chosen: torch.device, resolved: torch.device) -> None:
    """accelerate picks its device by its own probe (torch.accelerator in accelerate >= 1.16, torch.cuda
    before), not by ours: a disagreement would run the heal silently somewhere else than `--device` said
    (a GPU asked for and trained on the CPU). Refuse it by name instead."""
    if chosen.type != resolved.type:
        raise KVConvertError(f"heal_distill: --device resolved to {resolved}, but accelerate chose {chosen} "
                             f"(its own probe of the machine disagrees with torch.cuda); pass --device "
                             f"{chosen.type} to run there, or fix the torch/accelerate install")


def data_fix_note(saved: bool) -> str:
    """What fixing the data means for the progress (said before the user fixes it): the saved progress is keyed to the
    data's files as they are (names and sizes, heal.api's run record), so a fixed file cannot resume it."""
    if not saved:
        return "No progress was saved yet: fix it and rerun."
    return ("Note: the progress saved so far is keyed to the data as it is (its files' names and sizes), so once the "
            "file is fixed it cannot be resumed: rerun with --restart after fixing it (the heal starts again from "
            "step 0).")


class Distiller:
    """One distillation run. Call run(); `max_steps` stops early (state saved) for resumption."""

    def __init__(self, student_dir: Path, teacher_dir: Path, ids, stage: DistillOptions,
                 state_dir: Path, fingerprint: str, progress: bool = True):
        """ids: the training windows, a kvconvert.token_stream.WindowStream (streamed) or an [N, seq_len]
        tensor held in memory (a seeded permutation of all N per epoch)."""
        from accelerate.utils import set_seed

        self.stage = stage
        self.state_path = Path(state_dir) / STATE_FILE
        self.fingerprint = fingerprint
        self.progress = progress
        check_fsdp_launch()  # an FSDP1 launch config: refused before accelerate reads it (heal.fsdp)
        if stage.compile and fsdp_requested():
            raise KVConvertError("heal_distill.compile is not supported under FSDP yet (measured on one GPU only): "
                                 "set compile: false, or run on one GPU")
        self.accelerator = make_accelerator(stage)
        adopt_fsdp_plugin(self.accelerator)  # `accelerate launch` with an FSDP config, on CPUs too (heal.fsdp)
        set_seed(stage.seed)
        shards = self.accelerator.num_processes if fsdp_requested() and self.accelerator.device.type == "cuda" else 1
        check_distill_memory(read_config(student_dir), read_config(teacher_dir), stage, self.accelerator.device, shards)
        self.student, self.teacher = self._load_models(student_dir, teacher_dir)
        self.names = attach_trainable(self.student, stage)
        if stage.kv_dtype is not None:  # before accelerate wraps the model (the hooks need its layers)
            from kvconvert.heal.quant_aware import attach_cache_rounding
            from kvconvert.kvmath import kv_shape

            attach_cache_rounding(self.student, kv_shape(read_config(student_dir)), stage.kv_dtype)
        params = [p for p in self.student.parameters() if p.requires_grad]
        if not params:
            raise KVConvertError("heal_distill.targets selects no weights to train")
        if stage.mixed_precision != "no" and not fsdp_requested():
            store_frozen_matmuls_in(self.student, torch_dtype(stage.mixed_precision))  # bf16/fp16: kvformat's names
        if stage.compile:
            compile_layers(self.student, self.teacher)
        # fused: one kernel per step, no foreach temporaries the size of the trainable set (distill_memory)
        self.optimizer = torch.optim.Adam(params, lr=stage.lr, betas=(0.9, 0.99), fused=stage.fused_optimizer or None)
        self.student, self.optimizer = self.accelerator.prepare(self.student, self.optimizer)
        keep_logits_dtype(self.student)
        # Our own scheduler, one step per optimizer step (accelerate's wrapper would step it once
        # per process), on the optimizer inside accelerate's wrapper.
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        world = self.accelerator.num_processes
        self.steps = stage.steps_on(world)  # `tokens` is the total over processes
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            inner, lambda step: scheduled_lr(step, stage.warmup_steps, self.steps, stage.schedule))
        self.teacher = place_teacher(self.accelerator, self.teacher, self.student)  # sharded under FSDP
        self.sharding = shard_report(self.accelerator, self.student, self.teacher)  # bytes per process
        stream = TensorWindows(ids, stage.seed) if isinstance(ids, torch.Tensor) else ids
        # this process's micro-batches, tokenized and batched by a background thread (token_stream.Batches)
        self.batches = Batches(stream, stage.batch_size, self.accelerator.process_index, world)
        self.history: list[dict] = []
        self.step = 0

    def _load_models(self, student_dir: Path, teacher_dir: Path):
        """Both models, whole (the up-front check_distill_memory has said they fit)."""
        from kvconvert.quant.capture import load_hf_model

        student = load_hf_model(student_dir)  # DeepseekV3ForCausalLM (compat checked the config), fp32
        teacher = load_hf_model(teacher_dir, torch.bfloat16 if self.stage.mixed_precision == "bf16" else torch.float32)
        # no KV cache in either forward: the teacher's would hold every layer's K/V for the whole step
        # (0.4 GB at 8 x 2048 tokens of SmolLM2, 1 GB per 2048 tokens of a 7B) and its per-layer state
        # makes torch.compile recompile each layer
        student.config.use_cache = teacher.config.use_cache = False
        if self.stage.gradient_checkpointing:
            student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        teacher.requires_grad_(False)
        student.train()
        check_loaded_attention(student, teacher)
        return student, teacher

    # ------------------------------------------------------------------ state
    def save_state(self) -> None:
        layout = "fsdp" if is_sharded(self.student) else "whole"
        if layout == "fsdp":  # gathered whole onto the main process: every process takes part
            trainable, optimizer = full_training_state(self.student, self.optimizer)
        if not self.accelerator.is_main_process:
            return
        if layout == "whole":
            model = self.accelerator.unwrap_model(self.student)
            trainable = {n: p.detach().clone().cpu() for n, p in model.named_parameters() if p.requires_grad}
            optimizer = self.optimizer.state_dict()
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "fingerprint": self.fingerprint, "layout": layout, "step": self.step, "history": self.history,
            "trainable": trainable, "optimizer": optimizer, "scheduler": self.scheduler.state_dict(),
            "data": self.batches.position(self._windows_before(self.step)),  # where the data continues
        }
        tmp = self.state_path.with_suffix(".partial")
        torch.save(state, tmp)
        os.replace(tmp, self.state_path)

    def try_resume(self) -> bool:
        """Load a saved state with the same fingerprint; True when resumed."""
        if not self.state_path.is_file():
            return False
        state = load_torch_state(self.state_path)  # tensors, numbers, strings: nothing unpickled; damaged: named
        layout = "fsdp" if is_sharded(self.student) else "whole"
        if state.get("fingerprint") != self.fingerprint or state.get("layout", "whole") != layout:
            return False
        try:
            self._restore(state, layout)
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:  # a dict, but not the one save() writes
            raise damaged_state(self.state_path, exc) from None
        return True

    def _restore(self, state: dict, layout: str) -> None:
        """Weights, optimizer, schedule, history and data position from a saved state (try_resume)."""
        if layout == "fsdp":
            load_full_training_state(self.student, self.optimizer, state["trainable"], state["optimizer"])
        else:
            model = self.accelerator.unwrap_model(self.student)
            params = dict(model.named_parameters())
            with torch.no_grad():
                for name, value in state["trainable"].items():
                    params[name].copy_(value)
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.history = state["step"], state["history"]
        # a state without a data position replays the data from its start to the step's window
        self.batches.seek(state.get("data") or {"index": self._windows_before(self.step), "block_state": None})

    # ------------------------------------------------------------------ training
    def _windows_before(self, step: int) -> int:
        """Windows every process together has consumed before optimizer step `step` (0-based)."""
        s = self.stage
        return step * s.grad_accum * self.accelerator.num_processes * s.batch_size

    def _micro_batch(self) -> torch.Tensor:
        """This process's next micro-batch: global micro-batch g = (step x grad_accum + micro) x world + rank
        of the window sequence (token_stream.Batches hands them out in that order)."""
        try:
            batch = self.batches.get()
        except DataExhausted:
            raise
        except KVConvertError as exc:  # a broken line or file met mid-run (the data is read as the run goes)
            every = self.stage.checkpoint_every
            note = data_fix_note(bool(every) and self.step >= every)
            raise KVConvertError(f"heal_distill stopped at step {self.step + 1}: {exc}. {note}") from None
        return batch.to(self.accelerator.device)

    def _loss(self, batch: torch.Tensor) -> tuple[torch.Tensor, dict]:
        s = self.stage
        hidden = s.hidden_weight > 0
        with torch.no_grad():
            t_out = self.teacher(input_ids=batch, output_hidden_states=hidden, use_cache=False)
        with self.accelerator.autocast():
            s_out = self.student(input_ids=batch, output_hidden_states=hidden)
        parts = {}
        loss = torch.zeros((), device=batch.device)
        if hidden:
            parts["hidden"] = hidden_state_loss(t_out.hidden_states, s_out.hidden_states)
            loss = loss + s.hidden_weight * parts["hidden"]
        if s.kl_weight or s.lm_weight:
            # fused over the vocabulary: no float32 [B, T, V] copies (kvconvert.heal.fused_loss)
            logit_loss, logit_parts = fused_distill_loss(s_out.logits, t_out.logits, next_token_targets(batch),
                                                         s.temperature, s.kl_weight, s.lm_weight)
            parts.update(logit_parts)
            loss = loss + logit_loss
        return loss, {k: float(v.detach()) for k, v in parts.items()}

    def train_step(self) -> dict:
        s = self.stage
        t0 = time.time()
        waited = self.batches.wait_s
        totals: dict[str, float] = {}
        loss_sum = 0.0
        for micro in range(s.grad_accum):
            batch = self._micro_batch()
            last = micro == s.grad_accum - 1
            with contextlib.nullcontext() if last else self.accelerator.no_sync(self.student):
                loss, parts = self._loss(batch)
                self.accelerator.backward(loss / s.grad_accum)
            loss_sum += float(loss.detach()) / s.grad_accum
            for k, v in parts.items():
                totals[k] = totals.get(k, 0.0) + v / s.grad_accum
        loss_sum, totals = self._mean_over_processes(loss_sum, totals)
        grad_norm = self.accelerator.clip_grad_norm_(
            [p for p in self.student.parameters() if p.requires_grad], s.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        tokens = s.tokens_per_step * self.accelerator.num_processes
        dt = time.time() - t0
        record = {"step": self.step + 1, "loss": loss_sum, **totals, "grad_norm": float(grad_norm),
                  "lr": self.scheduler.get_last_lr()[0], "tokens": tokens, "seconds": dt,
                  "data_wait_s": self.batches.wait_s - waited}  # the training thread blocked on data
        self.step += 1
        self.batches.mark()
        return record

    def _mean_over_processes(self, loss: float, parts: dict[str, float]) -> tuple[float, dict[str, float]]:
        """The step's loss and parts averaged over every process's micro-batches (what one process
        with the same global batch logs); a no-op in a single process."""
        if self.accelerator.num_processes == 1:
            return loss, parts
        names = sorted(parts)
        values = torch.tensor([loss, *(parts[k] for k in names)], dtype=torch.float64, device=self.accelerator.device)
        values = self.accelerator.reduce(values, reduction="mean")
        return float(values[0]), {k: float(v) for k, v in zip(names, values[1:])}

    def run(self, max_steps: int | None = None) -> DistillResult:
        """Train to self.steps (or stop after max_steps total steps, saving state)."""
        s = self.stage
        stop = self.steps if max_steps is None else min(self.steps, max_steps)
        bar = tqdm(total=self.steps, initial=self.step, desc="heal: distill", unit="step",
                   disable=not self.progress or not self.accelerator.is_main_process)
        try:
            while self.step < stop:
                record = self.train_step()
                self.history.append(record)
                bar.update(1)
                if self.step % s.log_every == 0:
                    bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens'] / max(record['seconds'], 1e-9):.0f}")
                if s.checkpoint_every and self.step % s.checkpoint_every == 0 and self.step < self.steps:
                    self.save_state()
        except KeyboardInterrupt:
            # FSDP's save is collective, and signalled processes stop at different points (or one has
            # died): no save there; a rerun resumes from the last checkpoint_every snapshot
            if not is_sharded(self.student):
                self.save_state()
            raise
        except DataExhausted as exc:  # the data ran out mid-run (a large source: no up-front count)
            if not is_sharded(self.student):
                self.save_state()
            raise KVConvertError(f"heal_distill (data {s.data!r}) at step {self.step + 1}: {exc}") from None
        finally:
            bar.close()
            self.batches.close()
        finished = self.step >= self.steps
        if not finished:
            self.save_state()
        model = self.accelerator.unwrap_model(self.student)
        # under FSDP every process takes part in gathering the shards; the main process keeps them
        weights = gathered_weights(model, self.names, keep=self.accelerator.is_main_process)
        return DistillResult(weights, self.history, self.step, finished)


def plot_loss_curve(history: list[dict], path: Path, title: str = "heal: distillation loss") -> None:
    """loss (and KL / CE parts) per optimizer step, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=110)
    steps = [r["step"] for r in history]
    for key, color in (("loss", "C0"), ("kl", "C1"), ("ce", "C2"), ("hidden", "C3")):
        if not history or key not in history[0] or (key == "kl" and len(history[0].keys() & {"ce", "hidden"}) == 0):
            continue  # with KL alone, loss == kl: one curve
        values = [r[key] for r in history]
        ax.plot(steps, values, color=color, lw=0.8, alpha=0.35)
        ax.plot(steps, _ema(values), color=color, lw=1.6, label=f"{key} (EMA)")
    ax.set(xlabel="optimizer step", ylabel="loss (nats/token)", yscale="log", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _ema(values: list[float], beta: float = 0.9) -> list[float]:
    """Bias-corrected exponential moving average (minibatch losses are noisy)."""
    out, avg = [], 0.0
    for i, v in enumerate(values, start=1):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta ** i))
    return out


def summarize(history: list[dict]) -> dict:
    if not history:
        return {}
    k = max(1, len(history) // 10)
    tokens, secs = sum(r["tokens"] for r in history), sum(r["seconds"] for r in history)
    return {"steps": len(history), "loss_first": sum(r["loss"] for r in history[:k]) / k,
            "loss_last": sum(r["loss"] for r in history[-k:]) / k, "tokens": tokens,
            "tokens_per_s": tokens / max(secs, 1e-9),
            # share of the training time spent waiting for tokenized data (0: the prefetch kept up)
            "data_wait_share": sum(r.get("data_wait_s", 0.0) for r in history) / max(secs, 1e-9)}


def write_history(history: list[dict], path: Path) -> None:
    path.write_text("\n".join(json.dumps(r) for r in history) + "\n")
