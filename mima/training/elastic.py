"""Elastic resume: a run stopped at W processes goes on at another W, ending as the uninterrupted run.

Why it can: with W <= T every task's computation depends only on the phase's start average, its own
kept AdamW moments, its per-task step (learning rate, batches, crops) and nothing a process holds
for all its tasks, which is why every such W writes the same final/ files. At any point of a phase a
task has either finished its segment (its end weights, moments and loss sum are in the cut: files
of checkpoints/ and a float) or not (it can run the segment again from the average and its moments
of the phase before). A process of the new layout runs its tasks in order, so it resumes after the
longest prefix of them that is finished; a finished task after an unfinished one of the same process,
and a segment that was in progress, are run again, giving the same bytes. The cut is thus always
one every layout shares; what is lost is at most the work of the tasks run again, said in one line.

W > T gives each task R = W / T replicas that split its batch and average their gradients, which
rounds differently from one process per task: a cut can only resume where R stays the same (any
W <= T for a cut written at W <= T; the same W otherwise). Lightning's loop counters, the learning
rate and the scheduler of a process are functions of its step; they are taken from one saved state
(the template) and moved to the new step. The outer momentum of `sync_merge: outer_nesterov`, like
the phase's average, is one file that every process of the cut refers to; every process of the new
layout takes it.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from mima.core.errors import MimaError
from mima.core.layout import TaskLayout
from mima.training.checkpoint_format import CheckpointFiles, expand, reference


def check_world_size(num_tasks: int, saved: int, now: int, raise_error: bool = True) -> str | None:
    """None if a cut written by `saved` processes can resume on `now`; otherwise the one-line reason
    (raised as a MimaError unless `raise_error` is False)."""
    before, after = TaskLayout(num_tasks, saved).replicas, TaskLayout(num_tasks, now).replicas
    if before == after:
        return None
    allowed = f"1 .. {num_tasks}" if before == 1 else str(saved)
    problem = (f"--ckpt_path: the run's checkpoints were written by {_processes(saved)} ({before} per task) and this "
               f"run has {now} ({after} per task): processes that share a task split its batch, which rounds differently, "
               f"so a resume must keep each task's number of processes; use {allowed} processes "
               "(trainer.devices x trainer.num_nodes)")
    if raise_error:
        raise MimaError(problem)
    return problem


def _processes(count: int) -> str:
    return f"{count} process" + ("" if count == 1 else "es")


@dataclass(frozen=True)
class TaskPoint:
    """Where one task stands at the cut, in the running phase."""

    done: bool  # its segment of the running phase is finished
    segment: dict | None  # reference to its end weights of the phase (done)
    moments: dict | None  # reference to its kept AdamW moments now (after the phase if done, before it if not)
    moments_phase: int | None
    loss_sum: float | None  # its summed step losses of the phase (done)
    moments_before: dict | None  # reference to its moments before the phase (to run a finished segment again)


@dataclass(frozen=True)
class Redeal:
    """A cut written by `source_world_size` processes, dealt to `layout`: target rank q resumes after
    the first `prefixes[q]` of its tasks in the running phase `phase`."""

    source_world_size: int
    layout: TaskLayout
    tasks: tuple[str, ...]
    phase: int
    iterations: int
    avg: dict  # reference to the phase's start average
    points: tuple[TaskPoint, ...]  # per task index
    prefixes: tuple[int, ...]  # per target rank
    template: Path  # a state of the cut whose Lightning state is moved to each new step
    problem: str | None = None  # why the cut cannot be dealt (a file it needs is missing)
    outer_momentum: dict | None = None  # reference to the outer momentum with `avg` (sync_merge: outer_nesterov)

    @property
    def kept(self) -> int:
        """Task segments (one task, one phase) this run need not recompute; -1 when it cannot resume."""
        return -1 if self.problem else self.phase * len(self.tasks) + sum(self.prefixes)

    def redone(self) -> list[str]:
        kept = {task for rank in range(self.layout.world_size)
                for task in self.layout.local_tasks(rank)[: self.prefixes[rank]]}
        return [self.tasks[t] for t, point in enumerate(self.points) if point.done and t not in kept]

    def describe(self) -> str:
        done = sum(point.done for point in self.points)
        again = self.redone()
        line = (f"elastic resume: the cut saved by {_processes(self.source_world_size)} is dealt to "
                f"{self.layout.world_size}; phase {self.phase + 1} of {self.iterations}: {done} of {len(self.tasks)} "
                f"task segments finished")
        if again:
            line += f", {', '.join(again)} run again (a process of this layout runs its tasks in order)"
        return line


def plan_redeal(run_dir: Path, cut: dict, source_world_size: int, layout: TaskLayout, expected: dict) -> Redeal:
    """How the cut (rank -> resume.SavedState) of `source_world_size` processes resumes on `layout`."""
    tasks = tuple(expected["tasks"])
    source = TaskLayout(len(tasks), source_world_size, layout.work)  # dealt as it was: the budgets are the same
    phases = {state.avg_phase for state in cut.values()}
    if len(phases) != 1:
        raise MimaError(f"--ckpt_path: the states {sorted(str(s.path) for s in cut.values())} do not share a phase average")
    phase = phases.pop() + 1
    files = CheckpointFiles(Path(run_dir))
    keep = any(state.phase_state.get("task_moments") for state in cut.values())
    points: dict[int, TaskPoint] = {}
    problem = None
    for rank in range(source_world_size):
        state = cut[rank].phase_state
        segments = {int(slot): ref for slot, ref in state.get("segment_ends", {}).items()}
        moments = {int(slot): ref for slot, ref in state.get("task_moments", {}).items()}
        moments_phase = {int(slot): int(p) for slot, p in state.get("moments_phase", {}).items()}
        losses = {int(slot): float(value) for slot, value in state.get("loss_sums", {}).items()}
        for slot, task in enumerate(source.local_tasks(rank)):
            done = slot in segments
            before = None
            if done and keep and phase > 0:
                before_file = files.moments(phase - 1, task=tasks[task])
                if before_file.is_file():
                    before = reference(files, before_file, "moments")
                else:
                    problem = f"{before_file} is missing"
            elif not done:
                before = moments.get(slot)
            points[task] = TaskPoint(done, segments.get(slot), moments.get(slot), moments_phase.get(slot),
                                     losses.get(slot) if done else None, before)
    last = phase == int(expected["iterations"]) - 1
    prefixes = []
    for rank in range(layout.world_size):
        local = layout.local_tasks(rank)
        prefix = 0
        while prefix < len(local) and points[local[prefix]].done:
            prefix += 1
        # the last phase's final sync cannot be run by a process that has no step left: run one again
        prefixes.append(min(prefix, len(local) - 1) if last else prefix)
    template = cut[0].path
    avg = cut[0].phase_state["avg"]
    # the same on every process of the cut (made from the same average), like `avg`: one file, taken as it is
    outer_momentum = cut[0].phase_state.get("outer_momentum") or None
    return Redeal(source_world_size, layout, tasks, phase, int(expected["iterations"]), avg,
                  tuple(points[t] for t in range(len(tasks))), tuple(prefixes), template, problem, outer_momentum)


def redealt_state(redeal: Redeal, rank: int, run_dir: Path, module, accumulate: int) -> dict:
    """Process `rank`'s state for resuming the cut, in the layout `trainer.fit(ckpt_path=...)` restores
    (as MimaStrategy.load_checkpoint returns it: tensors, no references). `module` is the set-up
    MimaModule (its plan is this process's; its options give the learning rate)."""
    from mima.training.lr_schedule import lr_factor

    template = torch.load(redeal.template, map_location="cpu", weights_only=True)
    plan, hp = module.plan, module.hparams
    if plan.batched or template.get("mima", {}).get("batch_tasks"):
        # a batched state holds the stacked task models and their moments, not the per-task files a redeal reads
        raise MimaError("model.batch_tasks: a run whose tasks step together resumes on its own number of processes "
                        f"only ({redeal.source_world_size}); resume with that many")
    local = redeal.layout.local_tasks(rank)
    prefix = redeal.prefixes[rank]
    pending = prefix == len(local)  # every task of this process finished: its sync runs first
    step = plan.process_starts[redeal.phase] + prefix * plan.lengths[redeal.phase]
    shift = step - int(template["global_step"])
    points = [redeal.points[task] for task in local]
    task_moments, moments_phase = {}, {}
    for slot, point in enumerate(points):
        moments = point.moments if slot < prefix else point.moments_before
        if moments is not None:
            task_moments[slot] = moments
            moments_phase[slot] = point.moments_phase if slot < prefix else redeal.phase - 1
    phase_state = {
        "avg": redeal.avg,
        "avg_phase": redeal.phase - 1,
        "segment_ends": {slot: points[slot].segment for slot in range(prefix)},
        "segment_phase": redeal.phase if prefix else max(redeal.phase - 1, 0),
        "task_moments": task_moments,
        "moments_phase": moments_phase,
        "loss_sums": {slot: points[slot].loss_sum for slot in range(prefix)},
        "pending_sync": pending,
        "outer_momentum": redeal.outer_momentum or {},
    }
    state = dict(template)
    state["global_step"] = step
    state["loops"] = _moved_loops(template["loops"], shift, shift * accumulate)
    # the working encoder: the phase's average at a segment start, the last segment's end at a pending sync
    weights = points[-1].segment if pending else redeal.avg
    module_state = expand(template["state_dict"], run_dir)
    state["state_dict"] = {**module_state, **{f"encoder.{key}": value for key, value in expand(weights, run_dir).items()}}
    schedulers = copy.deepcopy(template["lr_schedulers"])
    rates = []
    for scheduler in schedulers:
        scheduler["last_epoch"] += shift
        scheduler["_step_count"] += shift
        # as LambdaLR computes it: base rate x the schedule's factor at the new step
        factor = lr_factor(plan, step, hp.lr_schedule, hp.schedule_scope, hp.warmup_steps, hp.segment_warmup_steps)
        scheduler["_last_lr"] = [base * factor for base in scheduler["base_lrs"]]
        rates = scheduler["_last_lr"]
    optimizer = copy.deepcopy({key: value for key, value in template["optimizer_states"][0].items() if key != "state"})
    for group, rate in zip(optimizer["param_groups"], rates):
        group["lr"] = rate
    optimizer["state"] = {} if pending or prefix >= len(local) else task_moments.get(prefix, {})
    state["optimizer_states"] = [optimizer] + list(template["optimizer_states"][1:])
    state["lr_schedulers"] = schedulers
    state["mima"] = {**template["mima"], "rank": rank, "phase_state": phase_state}
    return expand(state, run_dir)


def _moved_loops(loops: dict, steps: int, batches: int) -> dict:
    """Lightning's fit-loop counters of a state `steps` optimiser steps (`batches` batches) later. The
    counters are those of Lightning 2.x's `fit_loop.state_dict()`; a release that changes them
    cannot be re-dealt (the resume would not know where each process stands)."""
    moved = copy.deepcopy(loops)
    try:
        fit = moved["fit_loop"]
        _add(fit["epoch_loop.batch_progress"], batches)
        _add(fit["epoch_loop.scheduler_progress"], steps)
        for progress in fit["epoch_loop.automatic_optimization.optim_progress"]["optimizer"].values():
            _add(progress, steps)
        fit["epoch_loop.state_dict"]["_batches_that_stepped"] += steps
    except (KeyError, TypeError) as exc:
        raise MimaError(f"--ckpt_path: this Lightning's loop state lacks {exc}; an elastic resume cannot place the "
                        "processes (resume on the number of processes that saved the run)") from None
    return moved


def _add(progress: dict, amount: int) -> None:
    """Add `amount` to every counter of a Lightning progress record ({"total": {...}, "current": {...}})."""
    for part in ("total", "current"):
        for key, value in progress[part].items():
            progress[part][key] = value + amount


def set_aside(run_dir: Path, states: list[tuple[Path, int]]) -> None:
    """Move states of other layouts out of checkpoints/ranks/ (into checkpoints/layouts/wWWWWW/), where
    this layout's processes write states whose names could be the same. They stay readable: until
    this layout has a cut of its own, a later resume may still need them."""
    files = CheckpointFiles(Path(run_dir))
    for path, world_size in states:
        target = files.set_aside_dir(world_size, path.parent.name) / path.name
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, target)
