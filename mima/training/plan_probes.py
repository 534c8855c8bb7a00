"""What the plan reads from the machine, and what it measures with torch rather than computes.

The machine: this process's resident memory (the interpreter with the fit stack imported), the memory
of the device a process would train on (the first GPU's, or the machine's for the CPU), the GPU's
name (its peak FLOP/s), whether a `trainer:` section trains on a GPU here (or asks for a device this
machine lacks: accelerator_refusal, checked by `mima fit` before anything is built), and whether tensorboard is
installed (it adds event files to the logs). Torch: the bytes torch.save writes for a process's
random states, and the size of a task's AdamW moments as a .safetensors file (the file format's
header, mima.models.footprint.safetensors_file_bytes). The arithmetic they feed:
mima.training.resource_plan.
"""

from __future__ import annotations

import io
import os
import re
from pathlib import Path

import torch

from mima.models.footprint import ModelFootprint, safetensors_file_bytes
from mima.training.resource_plan import FileMeasures
from mima.training.rng_state import capture_rng


def resident_bytes() -> int:
    """This process's resident set size now (VmRSS)."""
    text = Path("/proc/self/status").read_text() if Path("/proc/self/status").is_file() else ""
    found = re.search(r"VmRSS:\s+(\d+) kB", text)
    return int(found.group(1)) * 1024 if found else 0


def present_device_memory(accelerator: str) -> int | None:
    """The memory of the device a process would train on here: the first GPU's, or for the CPU the
    machine's (MemTotal); None when the configured device is not present (planning elsewhere)."""
    if accelerator == "cpu":
        text = Path("/proc/meminfo").read_text() if Path("/proc/meminfo").is_file() else ""
        found = re.search(r"MemTotal:\s+(\d+) kB", text)
        return int(found.group(1)) * 1024 if found else None
    try:
        return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    except (RuntimeError, AssertionError):  # CUDA reported available but no device answers (no driver)
        return None


def present_device_name() -> str | None:
    """The name of the first GPU here, None without one."""
    try:
        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except (RuntimeError, AssertionError):  # CUDA reported available but no device answers (no driver)
        return None


def trains_on_gpu(trainer) -> bool:
    """Whether a `trainer:` section (a mapping) trains on a CUDA GPU: accelerator gpu or cuda, or auto
    with CUDA present."""
    accelerator = trainer.get("accelerator") or "auto"
    name = accelerator if isinstance(accelerator, str) else type(accelerator).__name__.removesuffix("Accelerator")
    if name.lower() == "auto":
        return torch.cuda.is_available()
    return name.lower() in ("gpu", "cuda")


def cuda_device_count() -> int:
    """The CUDA GPUs torch can use here (0 without CUDA, or with a CUDA build but no driver)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def machine_devices() -> str:
    """What this machine offers torch, for a line that refuses a device it lacks."""
    build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "built without CUDA"
    count = cuda_device_count()
    gpus = f"{count} CUDA GPU{'s' if count != 1 else ''}" if count else "no CUDA GPU"
    others = "Apple MPS and the CPU" if torch.backends.mps.is_available() else "only the CPU"
    return f"this machine has {gpus}{'' if count else ', ' + others} (torch {torch.__version__}, {build})"


def accelerator_refusal(trainer) -> str | None:
    """Why this machine cannot train as a `trainer:` section (a mapping) asks, in one line naming the
    option and what the machine has, before anything is built (Lightning refuses the same later, in
    a traceback); None where it can, or where Lightning itself decides (auto, an Accelerator object)."""
    accelerator = trainer.get("accelerator")
    name = accelerator.strip().lower() if isinstance(accelerator, str) else "auto"
    fix = "use --trainer.accelerator cpu (or auto, which takes a GPU where there is one)"
    if name in ("gpu", "cuda") and not cuda_device_count():
        return f"trainer.accelerator={accelerator!r}: {machine_devices()}; {fix}"
    if name == "mps" and not torch.backends.mps.is_available():
        return f"trainer.accelerator={accelerator!r}: {machine_devices()}; {fix}"
    devices = trainer.get("devices")
    wanted = int(devices) if isinstance(devices, int | str) and str(devices).isdigit() else None
    if name in ("gpu", "cuda") and wanted is not None and wanted > cuda_device_count() and not launcher_binds_devices():
        return (f"trainer.devices={wanted} with trainer.accelerator={accelerator!r}: {machine_devices()}; "
                f"give --trainer.devices {cuda_device_count()} or fewer")
    return None


LAUNCHER_VARIABLES = ("SLURM_NTASKS", "TORCHELASTIC_RUN_ID", "LOCAL_RANK")


def launcher_binds_devices() -> bool:
    """Whether a launcher (SLURM, torchrun, Lightning's own for the processes after the first) made
    this process: it may see only its own GPU (slurm/one_gpu_task.sh) while trainer.devices counts a
    node's, so the count is Lightning's to judge there, not this machine's visible devices."""
    return any(variable in os.environ for variable in LAUNCHER_VARIABLES)


def tensorboard_installed() -> bool:
    from mima.training.rank_logger import tensorboard_available

    return tensorboard_available()


def file_measures(footprint: ModelFootprint) -> FileMeasures:
    """The checkpoint files' parts that torch decides: a task's AdamW moments (a step count and two
    tensors per parameter, named as mima.training.checkpoint_format.flatten_moments names them) as a
    .safetensors file, and this process's random states as torch.save writes them now."""
    moments = {}
    for index, shape in enumerate(footprint.parameter_shapes):
        tensor = torch.empty(shape, device="meta")
        moments |= {f"{index}.step": torch.empty((), device="meta"), f"{index}.exp_avg": tensor,
                    f"{index}.exp_avg_sq": tensor}
    buffer = io.BytesIO()
    torch.save({"rng": capture_rng()}, buffer)
    return FileMeasures(moments_file_bytes=safetensors_file_bytes(moments), rng_state_bytes=buffer.tell())
