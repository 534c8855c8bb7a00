"""What a run will cost before it starts: `mima plan`, and the summary `mima fit` prints at start.

From the run config, the number of processes W (trainer.devices x trainer.num_nodes) and the model's
footprint (mima.models.footprint: its tensors and activations, traced on the meta device), this
works out:
  * the layout: each process's tasks and steps per phase, and the utilisation, the share of process
    time spent stepping rather than waiting at syncs: sum_r steps_r / (W x max_r steps_r) (with
    replicas, W > T, the same over task groups); W values that would waste less are listed;
  * device memory per process: float32 weights, gradients and the running task's AdamW moments, the
    phase average the next segments start from, and the activations of the configured batch (per
    process: batch / replicas) in the training precision, with gradient checkpointing as configured;
    under mixed precision the low-precision copies of the weights autocast keeps;
  * host memory per process: the interpreter with the fit stack imported (measured in this
    process), a runtime workspace, theta_0, the task segments' end weights kept until the sync, the
    kept AdamW moments (optimizer_state: keep), the whole CLIP while the heads are built, and on the
    CPU everything listed under device memory; per node: the processes of one node;
  * the files of the run folder: bytes of each checkpoint file, bytes written over the run (every
    atomic write of the run-folder contract: pretrained.safetensors, config.yaml, checkpoints, final/,
    metrics.jsonl, logs) and the peak on disk (one generation of moments, mima.training.checkpoint_retention);
  * the sync volume: the end weights each process sends and receives at a sync (all-gather in task
    order, mima.training.averaging).
  * the defaults it chooses (mima.training.plan_choices): gradient checkpointing, the checkpoint
    schedule, a warning when the loader cannot feed the GPU, and the lead of SLURM's warning signal,
    with the step and run time estimated from the traced FLOPs on a GPU.
The file counts follow MimaCheckpoint's rules (mima.training.checkpoint_callback): a save at every
task segment end but the process's last one, a segment's end weights written unless a sync follows it
at once, the phase average and the moments of every phase but the last.
"""

from __future__ import annotations

import io
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from mima.core.errors import MimaError
from mima.core.layout import TaskLayout, allowed_world_sizes
from mima.core.run_folder import JOINT
from mima.models.footprint import ModelFootprint, safetensors_file_bytes
from mima.training.rng_state import capture_rng
from mima.training.save_schedule import SaveSchedule
from mima.training.sync_merge import OUTER_DEFAULTS, OUTER_NESTEROV
from mima.training.plan_choices import (
    COMPILED_STEP_OVERHEAD_S,
    STEP_OVERHEAD_S,
    Choice,
    StepTiming,
    as_json,
    choose_batch_tasks,
    choose_checkpoint_every,
    choose_compile,
    choose_grad_checkpointing,
    loader_warning,
    signal_lead,
    step_timing,
    WRITE_BYTES_PER_S,
    time_saves,
)

GIB = 2**30
MIB = 2**20
# What a `mima fit` process holds besides the imported code and the tensors counted one by one
# (Lightning's trainer and loggers, thread pools, the allocator's caches, a small in-memory suite):
# its peak RSS minus its RSS after the imports, less the counted tensors, measured on configs/demo.yaml
# (2026-11-26, CPU, W = 1).
RUNTIME_WORKSPACE_BYTES = 96 * MIB
CUDA_CONTEXT_BYTES = 1 * GIB  # CUDA context, kernels and allocator fragmentation on a GPU (a reserve, not traced)
STATE_OVERHEAD_BYTES = 3000  # a process state besides its random states: loops, scheduler, references
CONFIG_BYTES = 2048  # config.yaml
FINAL_METADATA_BYTES = 1100  # what final/<task>.safetensors carries in its header besides the tensors
FINAL_RECORD_BYTES = 1200  # final/<task>.json
CSV_ROW_BYTES = 26  # logs/metrics.csv: a row per logged step (plus one column per task)
TENSORBOARD_STEP_BYTES = 68  # logs/events.*: per step of a process (measured on the demo)


@dataclass(frozen=True)
class PlanInputs:
    """What the plan is computed from (the run config's values, and W)."""

    tasks: tuple[str, ...]
    task_lengths: tuple[tuple[int, ...], ...]  # each task's K_1 .. K_N (ModelSettings.task_lengths)
    world_size: int
    num_nodes: int
    batch_size: int
    num_workers: int
    precision: str
    accelerator: str  # "cpu" or "gpu"
    optimizer_state: str
    checkpoint_every: str | int
    log_every_n_steps: int = 10
    tensorboard: bool = False
    base_rss_bytes: int = 0  # the RSS of a process with the fit stack imported (measured by the caller)
    device_memory_bytes: int | None = None  # the device's memory, when known: a plan that exceeds it does not fit
    device_name: str | None = None  # the GPU present here (its peak FLOP/s), None elsewhere
    accumulate: int = 1  # trainer.accumulate_grad_batches: micro-batches per optimiser step
    grad_checkpointing: bool = False  # as the run will use it (resolved from "auto")
    compiled: bool = False  # model.compile as the run will use it (resolved from "auto")
    reads_images: bool = False  # whether training decodes image files (clip suite, custom folders)
    data_cache: bool = False
    outer_momentum: bool = False  # model.sync_merge outer_nesterov with momentum: one more state-sized buffer
    # the defaults the plan settled, by option name (plan_choices.Choice), shown with the plan
    choices: tuple[tuple[str, Choice], ...] = ()


@dataclass
class RunPlan:
    """The plan's numbers; `as_json` is `mima plan --json`."""

    world_size: int
    num_nodes: int
    processes_per_node: int
    tasks_per_process: list[list[str]]
    steps_per_phase: list[int]  # each process's optimiser steps in the first phase
    utilisation: float
    better_world_sizes: list[int]
    device_memory_per_process: int
    device_memory_parts: dict[str, int]
    host_memory_per_process: int
    host_memory_parts: dict[str, int]
    host_memory_per_node: int
    checkpoint_file_bytes: dict[str, int]
    checkpoint_files: dict[str, int]  # how many of each are written over the run
    bytes_written: int
    bytes_written_parts: dict[str, int]
    peak_disk_bytes: int
    sync_bytes_per_process: int  # sent + received by one process at one sync
    syncs: int
    on_gpu: bool
    device_memory_bytes: int | None
    timing: dict | None = None  # plan_choices.StepTiming on a GPU (estimates)
    choices: dict = field(default_factory=dict)  # each chosen default, and the SLURM signal lead
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        """Whether the memory the plan needs fits the device: a GPU's per process; on the CPU the
        machine's, shared by the processes of a node."""
        if self.device_memory_bytes is None:
            return True
        need = self.device_memory_per_process if self.on_gpu else self.host_memory_per_node
        return need <= self.device_memory_bytes

    def as_json(self) -> dict[str, Any]:
        return asdict(self) | {"fits": self.fits}


def make_plan(inputs: PlanInputs, footprint: ModelFootprint) -> RunPlan:
    tasks, lengths, world = inputs.tasks, inputs.task_lengths, inputs.world_size
    if world % inputs.num_nodes:
        raise MimaError(f"trainer.devices x trainer.num_nodes: {world} processes do not spread evenly over "
                        f"{inputs.num_nodes} nodes")
    budgets = tuple(map(sum, lengths))
    layout = TaskLayout(len(tasks), world, budgets)
    replicas = layout.replicas
    iterations = len(lengths[0])
    owned = [list(layout.local_tasks(rank)) for rank in range(world)]
    first_phase = layout.phase_steps(lengths, 0)
    usage = utilisation(budgets, world)
    # W values that waste less, the least wasteful and nearest to W first (four of them, shown in order)
    candidates = [w for w in allowed_world_sizes(len(tasks), max(2 * world, len(tasks)))
                  if utilisation(budgets, w) > usage + 1e-9]
    better = sorted(sorted(candidates, key=lambda w: (-round(utilisation(budgets, w), 9), abs(w - world), w))[:4])

    on_gpu = inputs.accelerator not in ("cpu",)
    per_process_batch = inputs.batch_size // replicas
    mixed = inputs.precision.endswith("-mixed") or inputs.precision in ("bf16", "16")
    device = step_device_bytes(footprint, per_process_batch, mixed)
    device["phase_average"] = footprint.state_bytes
    if inputs.outer_momentum:  # kept beside the phase average from one sync to the next
        device["outer_momentum"] = footprint.state_bytes
    if on_gpu:
        device["cuda_context_reserve"] = CUDA_CONTEXT_BYTES
    most_tasks = max(map(len, owned))
    keep = inputs.optimizer_state == "keep"
    image_bytes = 3 * footprint.image_size**2 * 4
    training_host = {
        "theta_0": footprint.state_bytes,
        "segment_end_weights": (most_tasks - 1) * footprint.state_bytes,
        "kept_adamw_moments": most_tasks * 2 * footprint.parameter_bytes if keep else 0,
        "batches_in_flight": max(1, inputs.num_workers) * 2 * per_process_batch * image_bytes,
    }
    if not on_gpu:  # the "device" is the host
        training_host.update({f"device_{name}": value for name, value in device.items()})
    # while the heads are built the whole CLIP (text tower included) is loaded, before training starts
    setup_host = footprint.model_bytes + footprint.state_bytes
    host = {"interpreter_and_libraries": inputs.base_rss_bytes, "runtime_workspace": RUNTIME_WORKSPACE_BYTES}
    if setup_host > sum(training_host.values()):
        host["clip_loaded_at_setup"] = setup_host
    else:
        host.update(training_host)
    host_per_process = sum(host.values())

    timing = None
    if on_gpu:  # forward and backward (twice the forward), one more forward where checkpointing recomputes
        passes = 4 if inputs.grad_checkpointing else 3
        flops = passes * footprint.forward_flops_per_example * per_process_batch * inputs.accumulate
        slowest = [max(layout.phase_steps(lengths, phase)) for phase in range(iterations)]
        timing = step_timing(flops, inputs.device_name, inputs.precision, slowest, inputs.compiled)
    files = _checkpoint_file_bytes(footprint, tasks, lengths, world)
    schedule = SaveSchedule.parse(inputs.checkpoint_every)
    counts = _checkpoint_counts(layout, lengths, schedule, keep, timing)
    written = {
        "pretrained": files["weights"] + 40,
        "config": CONFIG_BYTES,
        "final": len(tasks) * (files["weights"] + FINAL_METADATA_BYTES + FINAL_RECORD_BYTES),
        "metrics_jsonl": _metrics_bytes(len(tasks), iterations),
        "logs": _log_bytes(layout, lengths, inputs.tensorboard),
    }
    for kind, count in counts.items():
        written[f"checkpoints_{kind}"] = count * files[_FILE_OF_KIND[kind]]
    notes = []
    if schedule.kind == "seconds" and timing is None:
        notes.append(f"checkpoint_every {inputs.checkpoint_every}: counted as a save at every sync (the most it can save)")
    elif schedule.kind == "seconds":
        notes.append(f"checkpoint_every {inputs.checkpoint_every}: {counts.get('averages', 0)} of {iterations - 1} syncs "
                     "save, by the estimated run time")
    # a stop request saves at once: the running task's encoder and moments, the other tasks' segment
    # ends and kept moments of the phase, and the phase average
    stop_save = files["inline_state"] + files["weights"] \
        + (most_tasks - 1) * (files["weights"] + (files["moments"] if keep else 0))
    lead = signal_lead(stop_save, timing.step_s if timing else None)
    loader = loader_warning(timing, per_process_batch * inputs.accumulate, inputs.num_workers, inputs.data_cache,
                            inputs.reads_images)
    if loader:
        notes.append(loader)
    peak = _peak_disk(files, counts, layout, len(tasks), keep, written)
    syncs = iterations - 1
    sync_bytes = world * most_tasks * footprint.state_bytes if world > 1 else 0
    if inputs.num_workers:
        notes.append(f"host memory leaves out the {inputs.num_workers} DataLoader worker processes of each process")
    return RunPlan(
        world_size=world, num_nodes=inputs.num_nodes, processes_per_node=world // inputs.num_nodes,
        tasks_per_process=[[tasks[t] for t in ts] for ts in owned], steps_per_phase=first_phase,
        utilisation=usage, better_world_sizes=better,
        device_memory_per_process=sum(device.values()), device_memory_parts=device,
        host_memory_per_process=host_per_process, host_memory_parts=host,
        host_memory_per_node=host_per_process * (world // inputs.num_nodes),
        checkpoint_file_bytes=files, checkpoint_files=counts,
        bytes_written=sum(written.values()), bytes_written_parts=written, peak_disk_bytes=peak,
        sync_bytes_per_process=sync_bytes, syncs=syncs, on_gpu=on_gpu,
        device_memory_bytes=inputs.device_memory_bytes, timing=as_json(t=timing)["t"] if timing else None,
        choices=as_json(**dict(inputs.choices), slurm_signal=lead) | {"slurm_signal_option": lead.option},
        notes=notes,
    )


def utilisation(budgets: tuple[int, ...], world_size: int) -> float:
    """The share of process time spent stepping: every process waits at each sync for the one with
    the most steps (a task group's processes all step together)."""
    layout = TaskLayout(len(budgets), world_size, budgets)
    if world_size > len(budgets):  # task groups: each trains its one task
        return sum(budgets) / (len(budgets) * max(budgets))
    loads = [sum(budgets[t] for t in layout.local_tasks(rank)) for rank in range(world_size)]
    return sum(loads) / (world_size * max(loads))


_FILE_OF_KIND = {"states": "state", "segments": "weights", "averages": "weights", "moments": "moments",
                 "inline_states": "inline_state"}


def _checkpoint_file_bytes(footprint: ModelFootprint, tasks, lengths, world: int) -> dict[str, int]:
    """The size of each kind of checkpoint file."""
    meta = [torch.empty(shape, device="meta") for shape in footprint.parameter_shapes]
    moments = {}
    for index, tensor in enumerate(meta):
        moments |= {f"{index}.step": torch.empty((), device="meta"), f"{index}.exp_avg": tensor,
                    f"{index}.exp_avg_sq": tensor}
    buffer = io.BytesIO()
    torch.save({"rng": capture_rng()}, buffer)
    state = buffer.tell() + STATE_OVERHEAD_BYTES + 40 * len(tasks)
    weights = footprint.file_bytes
    moments_file = safetensors_file_bytes(moments)
    return {"weights": weights, "moments": moments_file, "state": state, "inline_state": state + weights + moments_file}


def _checkpoint_counts(layout: TaskLayout, lengths, schedule: SaveSchedule, keep: bool,
                       timing: StepTiming | None = None) -> dict[str, int]:
    """How many files of each kind MimaCheckpoint writes over a run (module docstring); a time
    schedule saves at the syncs the estimated `timing` reaches after each interval (every sync
    without an estimate)."""
    world, iterations = layout.world_size, len(lengths[0])
    owned = [len(layout.local_tasks(rank)) for rank in range(world)]
    later = iterations - 1  # phases with a later one: their averages and moments can be needed
    if schedule.kind == "never":
        return {}
    if schedule.kind == "segment":
        saves = sum(tasks * iterations - 1 for tasks in owned)
        segments = sum(tasks - 1 for tasks in owned) * later if world <= layout.num_tasks else 0
        saved_syncs, inline = later, 0
    elif schedule.kind == "seconds" and timing is not None:
        saved_syncs = time_saves(timing.phase_s, schedule.amount)
        saves, segments, inline = world * saved_syncs, 0, 0
    elif schedule.kind in ("phases", "seconds"):
        every = int(schedule.amount) if schedule.kind == "phases" else 1
        saved_syncs = sum(1 for phase in range(later) if (phase + 1) % every == 0)
        saves, segments, inline = world * saved_syncs, 0, 0
    else:  # every n process steps and at every sync; a save inside a segment holds the encoder and its moments
        saved_syncs, segments = later, 0
        inline = sum(_inline_saves(_phase_ends(layout, lengths, rank), int(schedule.amount)) for rank in range(world))
        saves = world * saved_syncs
    counts = {"states": saves, "segments": segments, "averages": saved_syncs,
              "moments": layout.num_tasks * saved_syncs if keep else 0}
    if inline:
        counts["inline_states"] = inline
    return counts


def _phase_ends(layout: TaskLayout, lengths, rank: int) -> list[int]:
    """The process steps at which process `rank`'s phases end (its syncs; the last is its last step)."""
    ends, total = [], 0
    for phase in range(len(lengths[0])):
        total += layout.phase_steps(lengths, phase)[rank]
        ends.append(total)
    return ends


def _inline_saves(phase_ends: list[int], every: int) -> int:
    """Saves every `every` process steps that do not fall on a sync (those are counted as states)."""
    last = phase_ends[-1]
    return sum(1 for step in range(every, last, every) if step not in phase_ends)


def _metrics_bytes(num_tasks: int, iterations: int) -> int:
    """metrics.jsonl is rewritten (atomically) after every phase with one record per phase so far; a
    record holds the T x T cosine matrices and per-task values (about 40 characters a number)."""
    record = 150 + 40 * num_tasks + 2 * 20 * num_tasks**2
    return record * iterations * (iterations + 1) // 2


def _log_bytes(layout: TaskLayout, lengths, tensorboard: bool) -> int:
    """Each process's logs/: a CSV row per step (its loss) and, with tensorboard installed, its events."""
    steps = [_phase_ends(layout, lengths, rank)[-1] for rank in range(layout.world_size)]
    per_step = CSV_ROW_BYTES + len(lengths) + (TENSORBOARD_STEP_BYTES if tensorboard else 0)
    return sum(steps) * per_step


def _peak_disk(files: dict[str, int], counts: dict[str, int], layout: TaskLayout, num_tasks: int, keep: bool,
               written: dict[str, int]) -> int:
    """The most the run folder holds at once: pretrained and final/ (written in the last phase, while
    checkpoints/ still exists), the logs, and in checkpoints/ two averages (the committed cut's and the
    newest), two phases' segment ends, one generation of moments plus each process's next one being
    written, and two states per process."""
    if not counts:
        checkpoints = 0
    else:
        per_phase_segments = sum(len(layout.local_tasks(rank)) - 1 for rank in range(layout.world_size)) \
            if layout.world_size <= num_tasks else 0
        writers = min(layout.world_size, num_tasks)
        checkpoints = (2 * files["weights"] + 2 * per_phase_segments * files["weights"]
                       + ((num_tasks + writers) * files["moments"] if keep and counts.get("moments") else 0)
                       + 2 * layout.world_size * files["state"]
                       + (2 * layout.world_size * files["inline_state"] if counts.get("inline_states") else 0))
    return written["pretrained"] + written["config"] + written["final"] + written["logs"] + checkpoints


# ------------------------------------------------------------------------- from a config
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


def check_fits(plan: RunPlan, force: bool) -> str | None:
    """None when the plan fits its device; otherwise the refusal (or, with --force, the warning) line."""
    if plan.fits:
        return None
    where = "GPU" if plan.on_gpu else "machine (the processes of a node share its memory)"
    need = plan.device_memory_per_process if plan.on_gpu else plan.host_memory_per_node
    line = (f"the plan needs {gib(need)} per {'process' if plan.on_gpu else 'node'} but the {where} has "
            f"{gib(plan.device_memory_bytes or 0)} (`mima plan` shows where it goes; reduce data.batch_size with "
            "trainer.accumulate_grad_batches, set model.grad_checkpointing, or use more processes per task)")
    return f"warning (--force): {line}" if force else f"{line}; pass --force true to start anyway"


def plan_tasks(config) -> list[str]:
    """The run's task names, without opening the data: a clip-suite benchmark is a list of names."""
    from mima.data.benchmarks import BENCHMARKS

    data = config.data
    if data.tasks:
        return list(data.tasks)
    if data.suite == "clip" and data.benchmark is not None and not data.custom_tasks:
        return list(BENCHMARKS[str(data.benchmark)])
    return config.datamodule().task_names


def step_device_bytes(footprint: ModelFootprint, batch: int, mixed: bool) -> dict[str, int]:
    """The device memory of one training step at `batch` examples: weights, gradients, AdamW's two
    moments and the activations (with the fixed part mixed precision adds). The plan of a process
    adds the phase average and the CUDA context to it; benchmarks/gpu_large.py measures it."""
    return {
        "weights": footprint.parameter_bytes,
        "gradients": footprint.parameter_bytes,
        "adamw_moments": 2 * footprint.parameter_bytes,
        "activations": batch * footprint.activation_bytes_per_example + (footprint.activation_fixed_bytes if mixed else 0),
    }

def plan_for_config(config, world_size: int, num_nodes: int = 1, checkpoint_every: str | int | None = None,
                    device_memory: int | None = None, trainer: dict | None = None,
                    tasks: list[str] | None = None) -> tuple[RunPlan, ModelFootprint, PlanInputs]:
    """The plan of a run config (mima.config.run_config.RunConfig) on `world_size` processes (its
    `tasks` when known, else read from the config), with the defaults it chooses for the "auto"
    values of model.grad_checkpointing and `checkpoint_every` (None: auto). The interpreter's share
    of host memory is this process's RSS: call it with the fit stack imported."""
    from mima.config.model import ModelSettings
    from mima.models.footprint import measure_footprint

    trainer = dict(config.other.get("trainer") or {}) | dict(trainer or {})
    settings = ModelSettings(**config.model_args())
    tasks = list(tasks) if tasks is not None else plan_tasks(config)
    joint = settings.mode == JOINT
    lengths = ((settings.steps,) * 1,) if joint else settings.task_lengths(tasks)
    precision = str(trainer.get("precision") or "32-true")
    on_gpu = trains_on_gpu(trainer)
    schedule = choose_checkpoint_every(checkpoint_every, on_gpu)
    compiling = choose_compile(settings.compile, on_gpu, trainer.get("deterministic") is True)
    inputs = PlanInputs(
        tasks=(JOINT,) if joint else tuple(tasks), task_lengths=tuple(lengths), world_size=world_size,
        num_nodes=num_nodes, batch_size=int(config.data.batch_size), num_workers=int(config.data.num_workers),
        precision=precision, accelerator="gpu" if on_gpu else "cpu", optimizer_state=settings.optimizer_state,
        checkpoint_every=schedule.value, log_every_n_steps=int(trainer.get("log_every_n_steps") or 10),
        tensorboard=_tensorboard_installed(), base_rss_bytes=resident_bytes(),
        device_memory_bytes=device_memory if device_memory is not None else present_device_memory("gpu" if on_gpu else "cpu"),
        device_name=present_device_name() if on_gpu else None,
        accumulate=int(trainer.get("accumulate_grad_batches") or 1),
        reads_images=reads_image_files(config), data_cache=bool(config.data.cache),
        grad_checkpointing=settings.grad_checkpointing is True, compiled=bool(compiling.value),
        outer_momentum=keeps_outer_momentum(settings.sync_merge, settings.sync_merge_args),
    )
    footprint = measure_footprint(settings.clip, precision, inputs.grad_checkpointing)
    plan = make_plan(inputs, footprint)
    checkpointing = choose_grad_checkpointing(settings.grad_checkpointing, on_gpu, plan.device_memory_per_process,
                                              inputs.device_memory_bytes)
    if checkpointing.value and not inputs.grad_checkpointing:
        footprint = measure_footprint(settings.clip, precision, True)
    inputs = replace(inputs, grad_checkpointing=bool(checkpointing.value),
                     choices=(("grad_checkpointing", checkpointing), ("compile", compiling), ("checkpoint_every", schedule)))
    plan = make_plan(inputs, footprint)
    plan.notes += settings.schedule_notes(tasks)  # printed by `mima plan` and at `mima fit` start alike
    if not joint and on_gpu:  # model.batch_tasks: both layouts' memory and step time, and what "auto" takes
        stacked = batched_layout(plan, footprint, inputs, tasks, world_size)
        conflict = settings.batch_tasks_conflict(tasks)
        choice = choose_batch_tasks(settings.batch_tasks, on_gpu, conflict, stacked["device_memory_per_process"],
                                    inputs.device_memory_bytes)
        plan.choices["batch_tasks"] = as_json(choice=choice)["choice"]
        plan.notes.append(stacked["line"])
    return plan, footprint, inputs


def batched_layout(plan: RunPlan, footprint: ModelFootprint, inputs: PlanInputs, tasks: list[str],
                   world_size: int) -> dict:
    """model.batch_tasks on a GPU: the device memory of a process whose L tasks step as one stacked
    model (L copies of the weights, gradients and AdamW moments, L batches' activations: the
    one-after-another layout's plus L - 1 of each) and its step time (L batches' FLOPs in one step
    with one step's overhead, K steps per phase instead of L K), beside the one-after-another ones."""
    copies = -(-len(tasks) // world_size)  # the most tasks a process holds
    parts = plan.device_memory_parts
    extra = parts["weights"] + parts["gradients"] + parts["adamw_moments"] + parts["activations"]
    need = plan.device_memory_per_process + (copies - 1) * extra
    line = (f"model.batch_tasks: one after another {gib(plan.device_memory_per_process)} per process; "
            f"{copies} tasks stacked {gib(need)}")
    if plan.timing is not None:
        step_s, overhead = plan.timing["step_s"], COMPILED_STEP_OVERHEAD_S if inputs.compiled else STEP_OVERHEAD_S
        stacked_s = STEP_OVERHEAD_S + copies * (step_s - overhead)  # eager: the stacked forward is not compiled
        line += (f"; a step of one task {step_s:.3f} s ({copies} per phase step), of the stack {stacked_s:.3f} s "
                 "(estimates)")
    return {"device_memory_per_process": need, "line": line}
    return plan, footprint, inputs


def trains_on_gpu(trainer) -> bool:
    """Whether a `trainer:` section (a mapping) trains on a CUDA GPU: accelerator gpu or cuda, or auto
    with CUDA present."""
    accelerator = trainer.get("accelerator") or "auto"
    name = accelerator if isinstance(accelerator, str) else type(accelerator).__name__.removesuffix("Accelerator")
    if name.lower() == "auto":
        return torch.cuda.is_available()
    return name.lower() in ("gpu", "cuda")


def present_device_name() -> str | None:
    """The name of the first GPU here, None without one."""
    try:
        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except (RuntimeError, AssertionError):  # CUDA reported available but no device answers (no driver)
        return None


def reads_image_files(config) -> bool:
    """Whether the run's training data are image files decoded per example (the loader's work)."""
    return config.data.suite == "clip" or bool(config.data.custom_tasks)


def _tensorboard_installed() -> bool:
    from mima.training.rank_logger import tensorboard_available

    return tensorboard_available()


# --------------------------------------------------------------------------- printing
def gib(value: int) -> str:
    if value >= GIB:
        return f"{value / GIB:.2f} GiB"
    if value >= MIB:
        return f"{value / MIB:.1f} MiB"
    return f"{value / 1024:.1f} KiB"


def _size(value: int) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if value >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value} B"


def _budgets(inputs: PlanInputs) -> tuple[int, ...]:
    return tuple(map(sum, inputs.task_lengths))


def format_plan(plan: RunPlan, footprint: ModelFootprint, inputs: PlanInputs) -> str:
    """The plan as `mima plan` prints it (and `mima fit`, shortened, at start)."""
    tasks = inputs.tasks
    lines = [f"plan: {len(tasks)} tasks on W = {plan.world_size} processes ({plan.num_nodes} node(s) x "
             f"{plan.processes_per_node}); {footprint.source}: {footprint.parameters / 1e6:.1f} M parameters, "
             f"{_size(footprint.state_bytes)} of weights"]
    shown = plan.tasks_per_process if plan.world_size <= 8 else plan.tasks_per_process[:8]
    for rank, owned in enumerate(shown):
        lines.append(f"  process {rank}: {', '.join(owned)} ({plan.steps_per_phase[rank]} steps in phase 1)")
    if len(shown) < plan.world_size:
        lines.append(f"  ... ({plan.world_size - len(shown)} processes more)")
    better = "; W with less waiting: " + ", ".join(f"{w} ({utilisation(_budgets(inputs), w):.0%})" for w in plan.better_world_sizes) \
        if plan.better_world_sizes else ""
    lines.append(f"utilisation: {plan.utilisation:.1%} of process time stepping (the rest waits at syncs){better}")
    what = "GPU" if plan.on_gpu else "device (the CPU: counted in host memory too)"
    parts = ", ".join(f"{name.replace('_', ' ')} {gib(value)}" for name, value in plan.device_memory_parts.items() if value)
    verdict = "" if plan.device_memory_bytes is None else \
        f" of {gib(plan.device_memory_bytes)} ({'fits' if plan.fits else 'DOES NOT FIT'})"
    lines.append(f"{what} memory per process: {gib(plan.device_memory_per_process)}{verdict}: {parts} "
                 f"(batch {inputs.batch_size // max(1, plan.world_size // len(tasks)) if plan.world_size > len(tasks) else inputs.batch_size}, "
                 f"{inputs.precision})")
    parts = ", ".join(f"{name.replace('_', ' ')} {gib(value)}" for name, value in plan.host_memory_parts.items() if value)
    lines.append(f"host memory per process: {gib(plan.host_memory_per_process)} ({parts}); per node: "
                 f"{gib(plan.host_memory_per_node)}")
    files = plan.checkpoint_file_bytes
    counts = ", ".join(f"{count} {kind.replace('_', ' ')}" for kind, count in plan.checkpoint_files.items() if count)
    lines.append(f"checkpoint files: weights {_size(files['weights'])}, AdamW moments {_size(files['moments'])}, "
                 f"process state {_size(files['state'])}; over the run (checkpoint_every {inputs.checkpoint_every}): "
                 f"{counts or 'none'}")
    lines.append(f"disk: {_size(plan.bytes_written)} written over the run, at most {_size(plan.peak_disk_bytes)} "
                 f"on disk at once")
    if plan.world_size > 1:
        lines.append(f"sync: {_size(plan.sync_bytes_per_process)} sent and received per process at each of "
                     f"{plan.syncs} syncs")
    lines += _choice_lines(plan)
    lines += [f"note: {note}" for note in plan.notes]
    return "\n".join(lines)


def _choice_lines(plan: RunPlan) -> list[str]:
    """The defaults the plan chose (or that were given), the timing estimate and the SLURM signal."""
    def shown(option: str, key: str, spell=str) -> str:
        choice = plan.choices[key]
        how = f"auto: {choice['reason']}" if choice["chosen"] else "given"
        return f"{option} {spell(choice['value'])} ({how})"

    on_off = {True: "on", False: "off"}.get
    lines = ["defaults: " + "; ".join(
        shown(option, key, spell) for option, key, spell in (
            ("model.grad_checkpointing", "grad_checkpointing", on_off), ("model.compile", "compile", on_off),
            ("model.batch_tasks", "batch_tasks", on_off),
            ("--checkpoint_every", "checkpoint_every", str))
        if key in plan.choices)]
    timing = plan.timing
    if timing is not None:
        lines.append(f"time (estimate): {timing['step_s']:.3f} s per step, {timing['run_s'] / 3600:.2f} h of steps for "
                     f"the slowest process ({timing['flops_per_step'] / 1e12:.2f} TFLOP per step at "
                     f"{timing['utilisation']:.0%} of {timing['peak_tflops']:.0f} TFLOP/s, {timing['device']})"
                     + (f", {timing['compile_s']:.0f} s of it compiling the encoder" if timing.get("compile_s") else ""))
    signal = plan.choices.get("slurm_signal")
    if signal is not None:
        lines.append(f"slurm: a stop saves about {_size(signal['save_bytes'])} per process ({signal['save_s']:.0f} s at "
                     f"{WRITE_BYTES_PER_S / 1e6:.0f} MB/s): submit with {plan.choices['slurm_signal_option']}")
    return lines


def keeps_outer_momentum(sync_merge: str, args: Mapping[str, object] | None) -> bool:
    """Whether the phase-end operator keeps a momentum buffer (outer_nesterov with momentum > 0)."""
    return sync_merge == OUTER_NESTEROV and float({**OUTER_DEFAULTS, **(args or {})}["outer_momentum"]) > 0
