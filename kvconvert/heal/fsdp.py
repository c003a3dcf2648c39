"""FSDP for the distillation stage: the student (and the teacher) sharded over processes by
accelerate's FSDP plugin.

Launch: `accelerate launch --config_file recipes/accelerate/fsdp.yaml -m kvconvert.cli heal ...`
(docs/heal.md, "FSDP: the models sharded over processes"). accelerate reads the config into environment variables
(ACCELERATE_USE_FSDP, FSDP_VERSION, FSDP_TRANSFORMER_CLS_TO_WRAP, ...) and starts one process per
device; the Distiller's Accelerator turns them into FullyShardedDataParallelPlugin, and
`accelerator.prepare(student, optimizer)` shards every DeepseekV3DecoderLayer (FSDP2: each
parameter a DTensor holding 1/world of its rows). The frozen teacher is sharded the same way
(`place_teacher`; accelerate prepares one FSDP2 model per Accelerator, so that is torch's
fully_shard directly): forward only, one layer gathered at a time.

Data and loss are the Distiller's own: process r of W takes global micro-batch
g = (step x grad_accum + micro) x W + r, and the logged loss is the mean over processes, so W
processes with batch b log the same loss per step as one process with batch b x W (or batch b and
grad_accum x W). FSDP's reduce-scatter averages the gradients as DDP's all-reduce does.

On GPUs accelerate selects FSDP itself. On CPUs (gloo) accelerate 1.x keeps MULTI_CPU and ignores
the plugin (its FSDP branch lists only accelerator device types); `adopt_fsdp_plugin` applies the
same plugin there, which is how CI runs FSDP (tests/heal/test_fsdp.py, two CPU processes).
FSDP2 only: FSDP1 flattens each layer into one parameter, which the trainable subset (attention
only, through torch parametrizations) and the per-tensor resume state do not fit.
"""

from __future__ import annotations

import os

import torch

from kvconvert.errors import KVConvertError


def fsdp_requested() -> bool:
    """True inside `accelerate launch` with an FSDP config (or ACCELERATE_USE_FSDP=true)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def check_fsdp_launch() -> None:
    """Before the Accelerator exists (accelerate fails first, and less clearly, on FSDP1 on CPUs):
    an FSDP launch must ask for FSDP2 (see the module docstring); accelerate's default is 1."""
    version = os.environ.get("FSDP_VERSION", "1")
    if fsdp_requested() and version != "2":
        from kvconvert.resources import recipes_dir

        config = recipes_dir() / "accelerate" / "fsdp.yaml"  # shipped with the package
        raise KVConvertError(
            f"heal_distill under FSDP needs fsdp_version: 2 in the accelerate config (got {version}; FSDP1 flattens "
            "each layer into one tensor, which the attention-only trainable set does not fit); launch with "
            f"--config_file {config} or pass --fsdp_version 2")


def adopt_fsdp_plugin(accelerator) -> None:
    """Make `accelerator` shard with FSDP when the launch asked for it. On GPUs accelerate has done
    it already; on several CPU processes (gloo) this sets accelerate's own
    FullyShardedDataParallelPlugin (read from the same environment) on the shared state, before
    anything is prepared. One CPU process has nothing to shard with and is left as it is."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = accelerator.state
    if fsdp_requested() and state.distributed_type == DistributedType.MULTI_CPU:
        state.fsdp_plugin = FullyShardedDataParallelPlugin()
        if state.mixed_precision != "no":  # as AcceleratorState does on GPUs: gather and reduce in bf16/fp16
            state.fsdp_plugin.set_mixed_precision(state.mixed_precision)
        state.distributed_type = DistributedType.FSDP
        # what AcceleratorState.__init__ does when it picks FSDP itself: a later AcceleratorState()
        # (accelerate's own helpers create them) copies PartialState's type over its own
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def is_sharded(model: torch.nn.Module) -> bool:
    """True for a model that accelerate.prepare sharded with FSDP2."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def local_parameter_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of parameter storage this process holds, bytes of the whole model's parameters).
    FSDP2 parameters are DTensors: the local shard is to_local(), the whole is the global shape."""
    from torch.distributed.tensor import DTensor

    local = whole = 0
    for p in model.parameters():
        shard = p.to_local() if isinstance(p, DTensor) else p
        local += shard.numel() * shard.element_size()
        whole += p.numel() * p.element_size()
    return local, whole


def place_teacher(accelerator, teacher: torch.nn.Module, student: torch.nn.Module) -> torch.nn.Module:
    """The frozen teacher on the run's device; when the student is sharded, sharded the same way
    (FSDP2, one unit per decoder layer plus the root): each process keeps 1/N of its weights, and
    each layer's are gathered for its forward and freed after it (no gradients, no optimizer)."""
    if not is_sharded(student):
        return teacher.to(accelerator.device)
    from torch.distributed.fsdp import fully_shard

    for layer in teacher.model.layers:  # moved to the device one layer at a time, then sharded
        fully_shard(layer)
    fully_shard(teacher)  # the rest: embeddings, final norm, head (tied or not: one group)
    return teacher


def shard_report(accelerator, student: torch.nn.Module, teacher: torch.nn.Module) -> dict:
    """How the models are laid out over the processes (collective under several processes):
    {"processes", "fsdp", "student_bytes", "student_bytes_per_process": [one per rank], and the same
    for the teacher}. Unsharded (one process, DDP), every process holds the whole of each."""
    report = {"processes": accelerator.num_processes, "fsdp": is_sharded(student)}
    for name, model in (("student", student), ("teacher", teacher)):
        local, whole = local_parameter_bytes(model)
        per_rank = [local]
        if accelerator.num_processes > 1:
            per_rank = accelerator.gather(torch.tensor([local], device=accelerator.device)).tolist()
        report |= {f"{name}_bytes": whole, f"{name}_bytes_per_process": per_rank}
    return report


def _owner_unit(modules: dict, name: str):
    """The FSDP unit whose parameter group holds module `name`'s parameters: its nearest FSDPModule
    ancestor (itself included); FSDP2's root is the whole model ('')."""
    from torch.distributed.fsdp import FSDPModule

    parts = name.split(".")
    for i in range(len(parts), -1, -1):
        module = modules[".".join(parts[:i])]
        if isinstance(module, FSDPModule):
            return module
    raise RuntimeError(f"{name} is in no FSDP unit (fully_shard always wraps the root)")  # not a user error


def merged_weights(model, names: list[str]) -> dict[str, torch.Tensor]:
    """Current effective weights (scale * (P + LoRA)) by checkpoint name, float32 on the CPU."""
    modules = dict(model.named_modules())
    with torch.no_grad():
        return {n: modules[n.rsplit(".", 1)[0]].weight.detach().float().cpu().clone() for n in names}


def gathered_weights(model: torch.nn.Module, names: list[str], keep: bool) -> dict[str, torch.Tensor]:
    """The effective weights `names` (parametrized: scale x (P + LoRA)) as float32 CPU tensors.

    Sharded, one FSDP unit at a time is gathered whole (collective: every process calls this, in
    the same order), read, and resharded, so no more than one decoder layer is ever whole on a
    device; only the process with keep=True copies them out (the others return {})."""
    if not is_sharded(model):
        return merged_weights(model, names) if keep else {}
    modules = dict(model.named_modules())
    by_unit: dict[int, tuple] = {}
    for name in names:
        module_name = name.rsplit(".", 1)[0]
        unit = _owner_unit(modules, module_name)
        by_unit.setdefault(id(unit), (unit, []))[1].append(name)
    out = {}
    with torch.no_grad():
        for unit, unit_names in by_unit.values():
            unit.unshard()
            try:
                for name in unit_names if keep else ():
                    out[name] = modules[name.rsplit(".", 1)[0]].weight.detach().float().cpu().clone()
            finally:
                unit.reshard()
    return out


# ---------------------------------------------------------------------------- resumable state

def _state_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # whole tensors, gathered onto rank 0's CPU (the others get {}); trainable parameters only
    return StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)


def full_training_state(model: torch.nn.Module, optimizer) -> tuple[dict, dict]:
    """(trainable parameters by name, optimizer state keyed by parameter name), whole, on the main
    process; empty dicts on the others. Collective: every process calls it."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    return get_state_dict(model, getattr(optimizer, "optimizer", optimizer), options=_state_options())


def load_full_training_state(model: torch.nn.Module, optimizer, trainable: dict, optim_state: dict) -> None:
    """The inverse of full_training_state on every process (each reads the same saved file): the
    whole tensors are split into this process's shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(model, getattr(optimizer, "optimizer", optimizer), model_state_dict=trainable,
                   optim_state_dict=optim_state,
                   options=StateDictOptions(full_state_dict=True, ignore_frozen_params=True, strict=False))
