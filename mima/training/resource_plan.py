"""What a run will cost before it starts, as arithmetic: the numbers of `mima plan` and of the summary
`mima fit` prints at start, from plain values (no probing, no config reading, no torch).

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
  * host memory per process: the interpreter with the fit stack imported (measured by the caller), a
    runtime workspace, theta_0, the task segments' end weights kept until the sync, the kept AdamW
    moments (optimizer_state: keep), the whole CLIP while the heads are built, and on the CPU
    everything listed under device memory; per node: the processes of one node;
  * the files of the run folder: bytes of each checkpoint file, bytes written over the run (every
    atomic write of the run-folder contract: pretrained.safetensors, config.yaml, checkpoints, final/,
    metrics.jsonl, logs) and the peak on disk (one generation of moments, mima.training.checkpoint_retention);
  * the sync volume: the end weights each process sends and receives at a sync (all-gather in task
    order, mima.training.averaging).
  * the step and run time estimated from the traced FLOPs on a GPU, a warning when the loader cannot
    feed the GPU and the lead of SLURM's warning signal (mima.training.plan_choices; the defaults
    chosen from the plan, gradient checkpointing and the checkpoint schedule, are settled by
    mima.training.plan_from_config and shown with it).
The file counts follow MimaCheckpoint's rules (mima.training.checkpoint_callback): a save at every
task segment end but the process's last one, a segment's end weights written unless a sync follows it
at once, the phase average and the moments of every phase but the last.

What this module is given, it does not look up: the run config's values are read into `PlanInputs`
by mima.training.plan_from_config; what depends on the machine (its memory, the GPU, this process's
RSS) and what torch itself decides (a process state's random states, a moments file's header) is
measured by mima.training.plan_probes; the text and JSON are mima.training.plan_format's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from mima.core.errors import MimaError
from mima.core.layout import TaskLayout
from mima.training.plan_choices import (
    COMPILED_STEP_OVERHEAD_S,
    STEP_OVERHEAD_S,
    Choice,
    StepTiming,
    as_json,
    loader_warning,
    signal_lead,
    step_timing,
    time_saves,
)
from mima.training.save_schedule import SaveSchedule

if TYPE_CHECKING:  # its module traces models with torch and open_clip; here only its numbers are read
    from mima.models.footprint import ModelFootprint

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

    @property
    def on_gpu(self) -> bool:
        return self.accelerator not in ("cpu",)

    @property
    def iterations(self) -> int:
        """N, the number of phases."""
        return len(self.task_lengths[0])


@dataclass(frozen=True)
class FileMeasures:
    """The parts of the checkpoint files' sizes that torch decides, measured by
    mima.training.plan_probes.file_measures."""

    moments_file_bytes: int  # one task's AdamW moments as a .safetensors file (header included)
    rng_state_bytes: int  # a process's random states as torch.save writes them


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



def make_plan(inputs: PlanInputs, footprint: ModelFootprint, measured: FileMeasures) -> RunPlan:
    """The plan (module docstring) of the run `inputs` describe, of the model `footprint` describes, with
    the checkpoint files' measured parts."""
    world, num_tasks = inputs.world_size, len(inputs.tasks)
    if world % inputs.num_nodes:
        raise MimaError(f"trainer.devices x trainer.num_nodes: {world} processes do not spread evenly over "
                        f"{inputs.num_nodes} nodes")
    budgets = tuple(map(sum, inputs.task_lengths))
    layout = TaskLayout(num_tasks, world, budgets)
    layout.check_batch(inputs.batch_size)  # as `mima fit` refuses it: a process gets a whole share of the batch
    groups = process_groups(layout)
    most_tasks = max(len(tasks) for tasks, _ in groups)
    per_process_batch = inputs.batch_size // layout.replicas
    keep = inputs.optimizer_state == "keep"
    device = device_memory_parts(inputs, footprint, per_process_batch)
    host = host_memory_parts(inputs, footprint, device, most_tasks, per_process_batch)
    timing = estimated_timing(inputs, footprint, layout, per_process_batch)
    files = checkpoint_file_bytes(footprint, measured, num_tasks)
    schedule = SaveSchedule.parse(inputs.checkpoint_every)
    counts = checkpoint_counts(layout, inputs.task_lengths, schedule, keep, timing)
    written = bytes_written_parts(inputs, layout, files, counts)
    lead = signal_lead(stop_save_bytes(files, most_tasks, keep), timing.step_s if timing else None)
    processes_per_node = world // inputs.num_nodes
    return RunPlan(
        world_size=world, num_nodes=inputs.num_nodes, processes_per_node=processes_per_node,
        tasks_per_process=per_process(groups, lambda tasks: [inputs.tasks[t] for t in tasks]),
        steps_per_phase=per_process(groups, lambda tasks: group_phase_steps(inputs.task_lengths, tasks, 0)),
        utilisation=utilisation(budgets, world), better_world_sizes=better_world_sizes(budgets, world),
        device_memory_per_process=sum(device.values()), device_memory_parts=device,
        host_memory_per_process=sum(host.values()), host_memory_parts=host,
        host_memory_per_node=sum(host.values()) * processes_per_node,
        checkpoint_file_bytes=files, checkpoint_files=counts,
        bytes_written=sum(written.values()), bytes_written_parts=written,
        peak_disk_bytes=peak_disk(files, counts, layout, num_tasks, keep, written),
        sync_bytes_per_process=world * most_tasks * footprint.state_bytes if world > 1 else 0,
        syncs=inputs.iterations - 1, on_gpu=inputs.on_gpu, device_memory_bytes=inputs.device_memory_bytes,
        timing=as_json(t=timing)["t"] if timing else None,
        choices=as_json(**dict(inputs.choices), slurm_signal=lead) | {"slurm_signal_option": lead.option},
        notes=plan_notes(inputs, schedule, counts, timing, per_process_batch),
    )


def process_groups(layout: TaskLayout) -> list[tuple[tuple[int, ...], int]]:
    """Each kind of process in rank order, as (its tasks, how many processes): with W > T a task
    group's R processes step alike, so the plan's arithmetic is done once per group, never per process."""
    if layout.world_size <= layout.num_tasks:
        return [(layout.local_tasks(rank), 1) for rank in range(layout.world_size)]
    return [((task,), layout.replicas) for task in range(layout.num_tasks)]


def per_process(groups: list[tuple[tuple[int, ...], int]], value: Callable[[tuple[int, ...]], Any]) -> list:
    """`value` of each process in rank order, computed once per group (a group's processes share it)."""
    return [item for tasks, count in groups for item in [value(tasks)] * count]


def group_phase_steps(lengths, tasks: tuple[int, ...], phase: int) -> int:
    """The steps in `phase` of a process holding `tasks` (one after another)."""
    return sum(lengths[task][phase] for task in tasks)


def utilisation(budgets: tuple[int, ...], world_size: int) -> float:
    """The share of process time spent stepping: every process waits at each sync for the one with
    the most steps (a task group's processes all step together)."""
    layout = TaskLayout(len(budgets), world_size, budgets)
    if world_size > len(budgets):  # task groups: each trains its one task
        return sum(budgets) / (len(budgets) * max(budgets))
    loads = [sum(budgets[t] for t in layout.local_tasks(rank)) for rank in range(world_size)]
    return sum(loads) / (world_size * max(loads))


def better_world_sizes(budgets: tuple[int, ...], world_size: int) -> list[int]:
    """W values that waste less than `world_size`, up to four: the least wasteful and nearest to it
    chosen first, shown in increasing order."""
    usage, num_tasks = utilisation(budgets, world_size), len(budgets)
    largest = max(2 * world_size, num_tasks)
    # the multiples of T beyond T all waste alike (task groups): of them only the four nearest W can be chosen
    nearest_multiple = world_size // num_tasks
    multiples = range(max(2, nearest_multiple - 4), min(largest // num_tasks, nearest_multiple + 5) + 1)
    sizes = [*range(1, min(num_tasks, largest) + 1), *(num_tasks * m for m in multiples)]
    candidates = [w for w in sizes if utilisation(budgets, w) > usage + 1e-9]
    nearest = sorted(candidates, key=lambda w: (-round(utilisation(budgets, w), 9), abs(w - world_size), w))
    return sorted(nearest[:4])


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


def device_memory_parts(inputs: PlanInputs, footprint: ModelFootprint, per_process_batch: int) -> dict[str, int]:
    """A process's device memory: a training step's, the phase average the next segments start from,
    the outer optimiser's momentum where kept, and on a GPU the CUDA context."""
    mixed = inputs.precision.endswith("-mixed") or inputs.precision in ("bf16", "16")
    device = step_device_bytes(footprint, per_process_batch, mixed)
    device["phase_average"] = footprint.state_bytes
    if inputs.outer_momentum:  # kept beside the phase average from one sync to the next
        device["outer_momentum"] = footprint.state_bytes
    if inputs.on_gpu:
        device["cuda_context_reserve"] = CUDA_CONTEXT_BYTES
    return device


def host_memory_parts(inputs: PlanInputs, footprint: ModelFootprint, device: dict[str, int], most_tasks: int,
                      per_process_batch: int) -> dict[str, int]:
    """A process's host memory (module docstring): the interpreter and a workspace, and the larger of
    what training holds (on the CPU the device's parts too) and the whole CLIP loaded at setup."""
    image_bytes = 3 * footprint.image_size**2 * 4
    training_host = {
        "theta_0": footprint.state_bytes,
        "segment_end_weights": (most_tasks - 1) * footprint.state_bytes,
        "kept_adamw_moments": most_tasks * 2 * footprint.parameter_bytes if inputs.optimizer_state == "keep" else 0,
        "batches_in_flight": max(1, inputs.num_workers) * 2 * per_process_batch * image_bytes,
    }
    if not inputs.on_gpu:  # the "device" is the host
        training_host.update({f"device_{name}": value for name, value in device.items()})
    # while the heads are built the whole CLIP (text tower included) is loaded, before training starts
    setup_host = footprint.model_bytes + footprint.state_bytes
    host = {"interpreter_and_libraries": inputs.base_rss_bytes, "runtime_workspace": RUNTIME_WORKSPACE_BYTES}
    if setup_host > sum(training_host.values()):
        host["clip_loaded_at_setup"] = setup_host
    else:
        host.update(training_host)
    return host


def estimated_timing(inputs: PlanInputs, footprint: ModelFootprint, layout: TaskLayout,
                     per_process_batch: int) -> StepTiming | None:
    """The step and run time estimated on a GPU (mima.training.plan_choices.step_timing); None on the CPU."""
    if not inputs.on_gpu:
        return None
    # forward and backward (twice the forward), one more forward where checkpointing recomputes
    passes = 4 if inputs.grad_checkpointing else 3
    flops = passes * footprint.forward_flops_per_example * per_process_batch * inputs.accumulate
    groups = process_groups(layout)
    slowest = [max(group_phase_steps(inputs.task_lengths, tasks, phase) for tasks, _ in groups)
               for phase in range(inputs.iterations)]
    return step_timing(flops, inputs.device_name, inputs.precision, slowest, inputs.compiled)


FILE_OF_KIND = {"states": "state", "segments": "weights", "averages": "weights", "moments": "moments",
                "inline_states": "inline_state"}


def checkpoint_file_bytes(footprint: ModelFootprint, measured: FileMeasures, num_tasks: int) -> dict[str, int]:
    """The size of each kind of checkpoint file: a task's weights, its AdamW moments, a process state
    (its random states, Lightning's loops and references, a reference per task) and a state saved
    inside a segment, which holds the encoder and its moments itself."""
    state = measured.rng_state_bytes + STATE_OVERHEAD_BYTES + 40 * num_tasks
    weights, moments = footprint.file_bytes, measured.moments_file_bytes
    return {"weights": weights, "moments": moments, "state": state, "inline_state": state + weights + moments}


def checkpoint_counts(layout: TaskLayout, lengths, schedule: SaveSchedule, keep: bool,
                      timing: StepTiming | None = None) -> dict[str, int]:
    """How many files of each kind MimaCheckpoint writes over a run (module docstring); a time
    schedule saves at the syncs the estimated `timing` reaches after each interval (every sync
    without an estimate)."""
    world, iterations = layout.world_size, len(lengths[0])
    groups = process_groups(layout)
    later = iterations - 1  # phases with a later one: their averages and moments can be needed
    if schedule.kind == "never":
        return {}
    if schedule.kind == "segment":
        saves = sum(count * (len(tasks) * iterations - 1) for tasks, count in groups)
        segments = sum(len(tasks) - 1 for tasks, _ in groups) * later if world <= layout.num_tasks else 0
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
        inline = sum(count * inline_saves(phase_ends(lengths, tasks), int(schedule.amount)) for tasks, count in groups)
        saves = world * saved_syncs
    counts = {"states": saves, "segments": segments, "averages": saved_syncs,
              "moments": layout.num_tasks * saved_syncs if keep else 0}
    if inline:
        counts["inline_states"] = inline
    return counts


def phase_ends(lengths, tasks: tuple[int, ...]) -> list[int]:
    """The process steps at which the phases of a process holding `tasks` end (its syncs; the last is
    its last step)."""
    ends, total = [], 0
    for phase in range(len(lengths[0])):
        total += group_phase_steps(lengths, tasks, phase)
        ends.append(total)
    return ends


def inline_saves(phase_ends: list[int], every: int) -> int:
    """Saves every `every` process steps that do not fall on a sync (those are counted as states):
    the multiples of `every` before the last step, less the syncs among them (counted, not walked)."""
    last = phase_ends[-1]
    return (last - 1) // every - sum(1 for end in set(phase_ends) if end < last and end % every == 0)


def bytes_written_parts(inputs: PlanInputs, layout: TaskLayout, files: dict[str, int],
                        counts: dict[str, int]) -> dict[str, int]:
    """The bytes written over the run, by what writes them (module docstring)."""
    num_tasks = len(inputs.tasks)
    written = {
        "pretrained": files["weights"] + 40,
        "config": CONFIG_BYTES,
        "final": num_tasks * (files["weights"] + FINAL_METADATA_BYTES + FINAL_RECORD_BYTES),
        "metrics_jsonl": metrics_bytes(num_tasks, inputs.iterations),
        "logs": log_bytes(layout, inputs.task_lengths, inputs.tensorboard),
    }
    for kind, count in counts.items():
        written[f"checkpoints_{kind}"] = count * files[FILE_OF_KIND[kind]]
    return written


def metrics_bytes(num_tasks: int, iterations: int) -> int:
    """metrics.jsonl is rewritten (atomically) after every phase with one record per phase so far; a
    record holds the T x T cosine matrices and per-task values (about 40 characters a number)."""
    record = 150 + 40 * num_tasks + 2 * 20 * num_tasks**2
    return record * iterations * (iterations + 1) // 2


def log_bytes(layout: TaskLayout, lengths, tensorboard: bool) -> int:
    """Each process's logs/: a CSV row per step (its loss) and, with tensorboard installed, its events."""
    steps = sum(count * phase_ends(lengths, tasks)[-1] for tasks, count in process_groups(layout))
    per_step = CSV_ROW_BYTES + len(lengths) + (TENSORBOARD_STEP_BYTES if tensorboard else 0)
    return steps * per_step


def peak_disk(files: dict[str, int], counts: dict[str, int], layout: TaskLayout, num_tasks: int, keep: bool,
              written: dict[str, int]) -> int:
    """The most the run folder holds at once: pretrained and final/ (written in the last phase, while
    checkpoints/ still exists), the logs, and in checkpoints/ two averages (the committed cut's and the
    newest), two phases' segment ends, one generation of moments plus each process's next one being
    written, and two states per process."""
    if not counts:
        checkpoints = 0
    else:
        per_phase_segments = sum(len(tasks) - 1 for tasks, _ in process_groups(layout)) \
            if layout.world_size <= num_tasks else 0
        writers = min(layout.world_size, num_tasks)
        checkpoints = (2 * files["weights"] + 2 * per_phase_segments * files["weights"]
                       + ((num_tasks + writers) * files["moments"] if keep and counts.get("moments") else 0)
                       + 2 * layout.world_size * files["state"]
                       + (2 * layout.world_size * files["inline_state"] if counts.get("inline_states") else 0))
    return written["pretrained"] + written["config"] + written["final"] + written["logs"] + checkpoints


def stop_save_bytes(files: dict[str, int], most_tasks: int, keep: bool) -> int:
    """What a stop request saves at once: the running task's encoder and moments, the other tasks'
    segment ends and kept moments of the phase, and the phase average."""
    return files["inline_state"] + files["weights"] \
        + (most_tasks - 1) * (files["weights"] + (files["moments"] if keep else 0))


def plan_notes(inputs: PlanInputs, schedule: SaveSchedule, counts: dict[str, int], timing: StepTiming | None,
               per_process_batch: int) -> list[str]:
    """What the plan's numbers assume or leave out, and the loader warning."""
    notes = []
    if schedule.kind == "seconds" and timing is None:
        notes.append(f"checkpoint_every {inputs.checkpoint_every}: counted as a save at every sync (the most it can save)")
    elif schedule.kind == "seconds":
        notes.append(f"checkpoint_every {inputs.checkpoint_every}: {counts.get('averages', 0)} of {inputs.iterations - 1} "
                     "syncs save, by the estimated run time")
    loader = loader_warning(timing, per_process_batch * inputs.accumulate, inputs.num_workers, inputs.data_cache,
                            inputs.reads_images)
    if loader:
        notes.append(loader)
    if inputs.num_workers:
        notes.append(f"host memory leaves out the {inputs.num_workers} DataLoader worker processes of each process")
    return notes


@dataclass(frozen=True)
class BatchedLayout:
    """model.batch_tasks on a GPU: a process whose L tasks step as one stacked model (L copies of the
    weights, gradients and AdamW moments, L batches' activations: the one-after-another layout's plus
    L - 1 of each), and its step time (L batches' FLOPs in one step with one step's overhead, K steps
    per phase instead of L K), beside the one-after-another layout's."""

    copies: int  # L, the most tasks a process holds
    device_memory_per_process: int
    step_s: float | None  # a step of one task, one after another (None: no timing estimate)
    stacked_step_s: float | None  # a step of the stack


def batched_layout(plan: RunPlan, num_tasks: int, compiled: bool) -> BatchedLayout:
    """The stacked layout of `plan` (BatchedLayout); `compiled`: model.compile as the run uses it (the
    stacked forward itself runs eager)."""
    copies = -(-num_tasks // plan.world_size)
    parts = plan.device_memory_parts
    extra = parts["weights"] + parts["gradients"] + parts["adamw_moments"] + parts["activations"]
    need = plan.device_memory_per_process + (copies - 1) * extra
    if plan.timing is None:
        return BatchedLayout(copies, need, None, None)
    step_s, overhead = plan.timing["step_s"], COMPILED_STEP_OVERHEAD_S if compiled else STEP_OVERHEAD_S
    stacked_s = STEP_OVERHEAD_S + copies * (step_s - overhead)  # eager: the stacked forward is not compiled
    return BatchedLayout(copies, need, step_s, stacked_s)
