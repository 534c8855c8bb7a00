"""The defaults a run's plan chooses, each of which the config or the command line can set instead.

`mima plan` prints them, `mima fit` prints them at start and uses them:
  * model.grad_checkpointing "auto": off when the plan's device memory without it fits the GPU with
    MEMORY_MARGIN to spare (recomputing activations costs about a quarter of a ViT's step time),
    on otherwise; off on the CPU and when the GPU's memory is unknown (`mima plan --device-memory`);
  * model.compile "auto": on when training on a CUDA GPU, off on the CPU (where TorchInductor's C++
    kernels take longer to build than a CPU run takes) and with `trainer.deterministic`;
  * --checkpoint_every "auto": by time on a GPU (CHECKPOINT_EVERY_ON_GPU), at every segment end on
    the CPU (mima.config.defaults);
  * the loader: data.cache stays as configured (the cache writes every decoded image to disk and
    takes the training crop from the cached centre crop, mima.data.cache_augment: not something to
    switch on silently), but when its per-image path cannot keep up with the GPU the plan says so,
    with both rates in images/s;
  * SLURM's warning signal: how long before the time limit it must come for a process to save its
    state (`--signal=USR1@LEAD`), from the bytes one process writes when stopped.

Run and step times are estimates, not measurements: the FLOPs of a training step traced on the meta
device (mima.models.footprint) over the GPU's dense bf16 peak (PEAK_BF16_TFLOPS by device name) at
ASSUMED_UTILISATION, plus STEP_OVERHEAD_S per step (COMPILED_STEP_OVERHEAD_S with model.compile, whose
first step also pays COMPILE_S). They decide only how many time-based
checkpoints the byte counts assume and the loader comparison; every assumption is printed with them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from mima.config.defaults import AUTO, CHECKPOINT_EVERY_ON_CPU, CHECKPOINT_EVERY_ON_GPU

# Dense (no sparsity) bf16 tensor-core peaks from the vendors' data sheets, TFLOP/s; the first name
# found in the device's name wins, so the more specific names come first.
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("GH200", 989.0), ("H200", 989.0), ("H100", 989.0),
                    ("A100", 312.0), ("L40S", 362.0), ("L4", 121.0), ("A10G", 70.0))
ASSUMED_DEVICE = "A100"  # planned for when the GPU is not here (a login node) or not in the table
ASSUMED_UTILISATION = 0.35  # of the bf16 peak (float32 runs: of half of it, TF32)
# Per step besides the FLOPs: Python, launches, optimiser and logging. About what `mima fit` spent per
# step beyond the model on ViT-B/32, batch 128, bf16, one H100 (benchmarks/README.md, 2026-11-22).
STEP_OVERHEAD_S = 0.05
# The same with the encoder compiled (model.compile): kernel launches fused away. A compiled bare ViT-B/32
# step at batch 128 took 18.8 ms on an H200 against 35.7 ms eager (docs/results.md, "One H200, before issue 47"), about
# 14 ms above its FLOPs at ASSUMED_UTILISATION.
COMPILED_STEP_OVERHEAD_S = 0.015
# What compiling costs once per process, in the first step: 35 s (batch 128) and 46 s (batch 512) for
# ViT-B/32's training step on an H200 (the same table); the plan adds it to the run time.
COMPILE_S = 40.0
WRITE_BYTES_PER_S = 200e6  # a shared file system's write rate for one process (the plan's assumption)
MEMORY_MARGIN = 0.15  # grad_checkpointing "auto" keeps it off only while the plan needs <= 85 % of the GPU
# Images per second that one DataLoader worker decodes and augments through open_clip's training
# transform (PIL JPEG decode of a benchmark-sized photo, RandomResizedCrop to 224 px, to tensor): an
# assumption of the plan, of the order one CPU core manages; `benchmarks/data_pipeline.py` measures it.
LOADER_IMAGES_PER_WORKER_S = 150.0
SLURM_SIGNAL_JITTER_S = 60  # SLURM may deliver --signal up to a minute early or late
SLURM_SIGNAL_MINIMUM_S = 90


def peak_bf16_tflops(device_name: str | None) -> float | None:
    """The dense bf16 peak of a GPU named `device_name` (torch.cuda.get_device_name), None if unknown."""
    if not device_name:
        return None
    return next((peak for key, peak in PEAK_BF16_TFLOPS if key in device_name), None)


@dataclass(frozen=True)
class StepTiming:
    """The plan's estimate of one process's training step and run."""

    device: str  # the GPU the estimate is for (the present one, or ASSUMED_DEVICE)
    peak_tflops: float  # of the precision the run computes in
    utilisation: float
    flops_per_step: float  # forward and backward of one process's batch (plus a forward when checkpointing)
    step_s: float
    run_s: float  # the slowest process's steps (and compiling), syncs not counted
    phase_s: tuple[float, ...]  # the slowest process's time per phase (the first with the compile time)
    compile_s: float = 0.0  # model.compile's one-off cost, in the first phase


def step_timing(flops_per_step: float, device_name: str | None, precision: str, steps_per_phase: list[int],
                compiled: bool = False) -> StepTiming:
    """Step and run time from FLOPs, at ASSUMED_UTILISATION of the device's peak (module docstring);
    `compiled` (model.compile): the compiled step's overhead, and the compile time once."""
    peak = peak_bf16_tflops(device_name)
    device = device_name if peak is not None else f"{ASSUMED_DEVICE} (assumed: {device_name or 'no GPU here'})"
    peak = peak if peak is not None else peak_bf16_tflops(ASSUMED_DEVICE)
    if not (precision.startswith("bf16") or precision.startswith("16")):
        peak = peak / 2  # float32 matmuls run as TF32 on tensor cores: half the bf16 rate
    overhead, compile_s = (COMPILED_STEP_OVERHEAD_S, COMPILE_S) if compiled else (STEP_OVERHEAD_S, 0.0)
    step_s = overhead + flops_per_step / (peak * 1e12 * ASSUMED_UTILISATION)
    phase_s = tuple(steps * step_s + (compile_s if phase == 0 else 0.0) for phase, steps in enumerate(steps_per_phase))
    return StepTiming(device, peak, ASSUMED_UTILISATION, flops_per_step, step_s, sum(phase_s), phase_s, compile_s)


@dataclass(frozen=True)
class Choice:
    """One default as the plan settled it: the value, whether the plan chose it ("auto") or the user
    gave it, and why."""

    value: object
    chosen: bool
    reason: str


def choose_checkpoint_every(given: str | int | None, on_gpu: bool) -> Choice:
    """--checkpoint_every: the given schedule, or for "auto" (and None) the device's default."""
    if given is not None and str(given).strip().lower() != AUTO:
        return Choice(given, False, "given")
    if on_gpu:
        return Choice(CHECKPOINT_EVERY_ON_GPU, True, "on a GPU, by time: a process state with its AdamW moments is large, "
                      "so not at every segment end")
    return Choice(CHECKPOINT_EVERY_ON_CPU, True, "on the CPU, at every segment end")


def choose_compile(given: bool | str, on_gpu: bool, deterministic: bool = False) -> Choice:
    """model.compile: as given, or for "auto" on when training on a CUDA GPU, unless the run asks
    for `trainer.deterministic`: bit-for-bit repeatable GPU runs were measured with eager kernels
    (docs/results.md, "One H200, before issue 47"), not yet with compiled ones."""
    if given is True or given is False:
        return Choice(given, False, "given")
    if not on_gpu:
        return Choice(False, True, "on the CPU")
    if deterministic:
        return Choice(False, True, "trainer.deterministic: repeatable bit for bit as measured, with eager kernels")
    return Choice(True, True, "on a GPU: a compiled step launches fewer kernels")


def choose_batch_tasks(given: bool | str, on_gpu: bool, conflict: str | None, need_batched: int | None,
                       device_memory: int | None) -> Choice:
    """model.batch_tasks: as given, or for "auto" on only on a GPU where the run's options allow it
    (`conflict`: ModelSettings.batch_tasks_conflict) and the plan's memory with the stacked task
    models (`need_batched`) fits the GPU with MEMORY_MARGIN to spare."""
    if given is True or given is False:
        return Choice(given, False, "given")
    if not on_gpu:
        return Choice(False, True, "on the CPU")
    if conflict is not None:
        return Choice(False, True, f"{conflict}")
    if device_memory is None or need_batched is None:
        return Choice(False, True, "the GPU's memory is unknown here (mima plan --device-memory GIB)")
    share = need_batched / device_memory
    if share <= 1 - MEMORY_MARGIN:
        return Choice(True, True, f"the stacked task models need {share:.0%} of the GPU's memory")
    return Choice(False, True, f"the stacked task models would need {share:.0%} of the GPU's memory "
                  f"(over {1 - MEMORY_MARGIN:.0%})")


def choose_grad_checkpointing(given: bool | str, on_gpu: bool, need_without: int, device_memory: int | None) -> Choice:
    """model.grad_checkpointing: as given, or for "auto" on only where the memory without it does not
    fit the GPU with MEMORY_MARGIN to spare."""
    if given is True or given is False:
        return Choice(given, False, "given")
    if not on_gpu:
        return Choice(False, True, "on the CPU")
    if device_memory is None:
        return Choice(False, True, "the GPU's memory is unknown here (mima plan --device-memory GIB)")
    share = need_without / device_memory
    if share <= 1 - MEMORY_MARGIN:
        return Choice(False, True, f"the plan needs {share:.0%} of the GPU's memory without it")
    return Choice(True, True, f"the plan needs {share:.0%} of the GPU's memory without it (over {1 - MEMORY_MARGIN:.0%})")


def loader_warning(timing: StepTiming | None, images_per_step: int, num_workers: int, cached: bool,
                   reads_images: bool) -> str | None:
    """A note when the per-image loader cannot feed the GPU as fast as the plan's steps use images."""
    if timing is None or cached or not reads_images:
        return None
    supply = max(1, num_workers) * LOADER_IMAGES_PER_WORKER_S
    demand = images_per_step / timing.step_s
    if supply >= demand:
        return None
    return (f"the loader is the bottleneck: {num_workers} worker(s) decode about {supply:.0f} images/s "
            f"({LOADER_IMAGES_PER_WORKER_S:.0f} per worker, assumed) while the GPU steps through about {demand:.0f}; "
            "set data.cache true (decoded once, `mima data cache`) or more data.num_workers")


@dataclass(frozen=True)
class SignalLead:
    """How long before the time limit SLURM's warning signal must come."""

    save_bytes: int  # what one process writes when a stop request saves its state
    save_s: float  # at WRITE_BYTES_PER_S
    lead_s: int

    @property
    def option(self) -> str:
        return f"--signal=USR1@{self.lead_s}"


def signal_lead(save_bytes: int, step_s: float | None) -> SignalLead:
    """Time for the stop to reach every process at a step boundary (two steps), to write twice the
    plan's bytes, and SLURM's jitter; rounded up to 30 s, at least SLURM_SIGNAL_MINIMUM_S."""
    save_s = save_bytes / WRITE_BYTES_PER_S
    need = SLURM_SIGNAL_JITTER_S + 2 * save_s + 2 * (step_s or 0.0)
    lead = max(SLURM_SIGNAL_MINIMUM_S, 30 * math.ceil(need / 30))
    return SignalLead(save_bytes, save_s, int(lead))


def time_saves(phase_s: tuple[float, ...], interval_s: float) -> int:
    """How many syncs a time schedule saves at: the first sync after `interval_s` has passed since the
    previous save (or the start); the last phase ends the run, not at a sync."""
    saves, last, now = 0, 0.0, 0.0
    for duration in phase_s[:-1]:
        now += duration
        if now - last >= interval_s:
            saves, last = saves + 1, now
    return saves


def as_json(**parts) -> dict:
    """The choices as `mima plan --json` shows them."""
    return {name: asdict(part) if hasattr(part, "__dataclass_fields__") else part for name, part in parts.items()}
