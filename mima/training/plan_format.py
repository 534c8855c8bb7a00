"""The plan as text: what `mima plan` prints (and `mima fit`, shortened, at start), the refusal of a run
that does not fit, and the line of the stacked layout. The numbers are mima.training.resource_plan's;
`mima plan --json` is its RunPlan.as_json.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mima.training.plan_choices import WRITE_BYTES_PER_S
from mima.training.resource_plan import GIB, MIB, BatchedLayout, PlanInputs, RunPlan, utilisation

if TYPE_CHECKING:  # its module traces models with torch and open_clip; here only its numbers are read
    from mima.models.footprint import ModelFootprint


def gib(value: int) -> str:
    """A memory size in binary units (GiB, MiB or KiB)."""
    if value >= GIB:
        return f"{value / GIB:.2f} GiB"
    if value >= MIB:
        return f"{value / MIB:.1f} MiB"
    return f"{value / 1024:.1f} KiB"


def decimal_size(value: int) -> str:
    """A size on disk or on the network, in decimal units (TB to KB, or bytes)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if value >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value} B"


def budgets_of(inputs: PlanInputs) -> tuple[int, ...]:
    """Each task's steps over the run."""
    return tuple(map(sum, inputs.task_lengths))


def format_plan(plan: RunPlan, footprint: ModelFootprint, inputs: PlanInputs) -> str:
    """The plan as `mima plan` prints it (and `mima fit`, shortened, at start)."""
    tasks = inputs.tasks
    lines = [f"plan: {len(tasks)} tasks on W = {plan.world_size} processes ({plan.num_nodes} node(s) x "
             f"{plan.processes_per_node}); {footprint.source}: {footprint.parameters / 1e6:.1f} M parameters, "
             f"{decimal_size(footprint.state_bytes)} of weights"]
    shown = plan.tasks_per_process if plan.world_size <= 8 else plan.tasks_per_process[:8]
    for rank, owned in enumerate(shown):
        lines.append(f"  process {rank}: {', '.join(owned)} ({plan.steps_per_phase[rank]} steps in phase 1)")
    if len(shown) < plan.world_size:
        lines.append(f"  ... ({plan.world_size - len(shown)} processes more)")
    better = "; W with less waiting: " + ", ".join(f"{w} ({utilisation(budgets_of(inputs), w):.0%})" for w in plan.better_world_sizes) \
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
    lines.append(f"checkpoint files: weights {decimal_size(files['weights'])}, AdamW moments "
                 f"{decimal_size(files['moments'])}, process state {decimal_size(files['state'])}; over the run "
                 f"(checkpoint_every {inputs.checkpoint_every}): {counts or 'none'}")
    lines.append(f"disk: {decimal_size(plan.bytes_written)} written over the run, at most "
                 f"{decimal_size(plan.peak_disk_bytes)} on disk at once")
    if plan.world_size > 1:
        lines.append(f"sync: {decimal_size(plan.sync_bytes_per_process)} sent and received per process at each of "
                     f"{plan.syncs} syncs")
    lines += choice_lines(plan)
    lines += [f"note: {note}" for note in plan.notes]
    return "\n".join(lines)


def choice_lines(plan: RunPlan) -> list[str]:
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
        lines.append(f"slurm: a stop saves about {decimal_size(signal['save_bytes'])} per process "
                     f"({signal['save_s']:.0f} s at {WRITE_BYTES_PER_S / 1e6:.0f} MB/s): submit with "
                     f"{plan.choices['slurm_signal_option']}")
    return lines


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


def batched_layout_line(plan: RunPlan, batched: BatchedLayout) -> str:
    """model.batch_tasks on a GPU: both layouts' memory and step time (a note of the plan)."""
    line = (f"model.batch_tasks: one after another {gib(plan.device_memory_per_process)} per process; "
            f"{batched.copies} tasks stacked {gib(batched.device_memory_per_process)}")
    if batched.step_s is not None:
        line += (f"; a step of one task {batched.step_s:.3f} s ({batched.copies} per phase step), of the stack "
                 f"{batched.stacked_step_s:.3f} s (estimates)")
    return line
